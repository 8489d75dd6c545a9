"""Writes identity_keys.json: the store keys, identities, declared and resolved settings, and the settings part
of the block-checkpoint identity that `bench.run.cell.settle` gave a matrix of requests at f10fffb, the last revision
before typed method configs (issue R).

tests/test_identity_keys.py settles the same requests with today's code and asserts the same keys, so a results
store or a carried long run written before is found and resumed. Rerun this only where a key is meant to change
(a method's version bump, say), and say so in the commit.

    LRQ_BENCH_DATA=../shared/data python tests/data/make_identity_keys.py
"""
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.run.cell import Request  # noqa: E402

OVERRIDES = {
    "lrq": [{}, {"iters": "20", "heldout_samples": "8", "error_samples": "8"}, {"rank_rule": "uniform", "rank": "64"},
            {"compile": "on"}, {"train_precision": "authors"}, {"iters": 7, "autocast": "false", "lr_schedule": "constant"}],
    "flexround": [{}, {"iters": "20", "heldout_samples": "8", "error_samples": "8"}, {"train_precision": "authors"}],
    "omniquant": [{}, {"iters": "20", "heldout_samples": "8", "error_samples": "8"}],
    "gptq": [{}, {"act_order": "false", "damp": "0.05"}],
    "awq": [{}, {"n_grid": "10", "clip": "off"}],
    "smoothquant": [{}, {"alpha": "0.8"}],
    "rtn": [{}],
    "fp": [{}],
}
SCHEMES = ["w8a8", "w4a8", "w4a16", "w3a16", "w4a16-g128", "w3a16-g128", "w4a8-kv8"]
PRESETS = ["quick", "long", "paper"]


def requests():
    for method, overrides in OVERRIDES.items():
        for preset in PRESETS:
            for scheme in (["fp"] if method == "fp" else SCHEMES):
                for o in overrides:
                    for prec in (("bf16", "fp32") if preset == "quick" else ("bf16",)):
                        tasks = ("piqa", "arc_easy") if (not o and scheme in ("fp", "w4a16")) else ()
                        yield Request(model="smollm2-135m", method=method, scheme=scheme, preset=preset, overrides=o,
                                      tasks=tasks, task_limit=10 if tasks else None, precision=prec, device="cpu")


def record(req, cell) -> dict:
    out = {"request": {"method": req.method, "scheme": req.scheme, "preset": req.preset, "overrides": req.overrides,
                       "tasks": list(req.tasks), "task_limit": req.task_limit, "precision": req.precision},
           "keys": {u: k[:20] for u, k in cell.keys.items()}}
    if not cell.is_fp:
        out["resolved"] = json.loads(json.dumps(dict(cell.resolved), default=str))
        # the settings part of the block-checkpoint identity (lrq.engine), the rest of which is unchanged
        res = cell.method.resolve(cell.scheme, cell.config)
        # (f10fffb hashed keyed_settings(resolved) there, its lr_schedule always present; today's code:
        # ReconstructionMethod.checkpoint_settings)
        ck = getattr(cell.method, "checkpoint_settings", None)
        settings = ck(res) if ck else type(cell.method).keyed_settings(res)
        out["checkpoint_settings"] = json.dumps(settings, sort_keys=True, default=str)
    return out


if __name__ == "__main__":
    from bench.run.cell import settle
    rows = [record(r, settle(r)) for r in requests()]
    path = Path(__file__).with_name("identity_keys.json")
    path.write_text("{\"revision\": \"f10fffb\", \"cells\": [\n" + ",\n".join(json.dumps(r, sort_keys=True) for r in rows) + "\n]}\n")
    print(f"{len(rows)} requests -> {path}")
