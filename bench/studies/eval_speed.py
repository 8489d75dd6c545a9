"""Evaluation speed, side by side: our perplexity harness vs lm-eval's Hugging Face backend.

    python -m bench.studies.eval_speed --data-dir ../shared/data [--max-tokens N] [--out FILE.json]

One process, one model, the same WikiText-2 test text, three timed runs back to back:

  1. ours, bf16      bench.evaluations.perplexity.perplexity on a bf16 copy of the model, autocast off
  2. lm-eval, bf16   lm_eval.simple_evaluate(HFLM(<the same bf16 copy>, batch 1, max_length 2048)) on a
                     loglikelihood_rolling task (the lm-eval `wikitext` task, read from the local
                     wikitext_document_level.test.jsonl through a YAML written to a temporary folder)
  3. ours, default   fp32 weights + bf16 autocast (what `lrq-bench run` uses on CPU)

Both sides take text from the start of WikiText-2 test. Ours cuts the raw test stream into
non-overlapping `seq_len` windows (each scores seq_len - 1 tokens); lm-eval scores whole documents in
rolling windows (its last window per document is full length but scores only the remainder). `--limit`
for lm-eval is the number of documents whose token count is closest to ours. Every figure counts the
tokens each side actually scored (and, separately, the tokens it fed through the model).

The CPU may be shared with other jobs: each side runs once, so treat small differences as noise.
On a loaded 2-core machine, torch's two OpenMP threads can run 2-3x slower than one thread (they
wait on each other at every op while a core is taken): `--threads 1` gives steadier figures there.
The detail lines give the median decoder-body time per full window, which bursts of load move less.
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import json
import math
import os
import shutil
import sys
import tempfile
import textwrap
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import nn

from lrq import precision as P
from lrq.errors import UserError
from lrq.io import dumps_json

DOCS_FILE = "wikitext2/wikitext_document_level.test.jsonl"
TASK_NAME = "wikitext_local_speed"
DEFAULT_MAX_TOKENS = 20 * 2048

# The lm-eval `wikitext` task (lm_eval/tasks/wikitext/wikitext.yaml), reading a local JSON-lines file.
_TASK_YAML = """\
task: {task}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {docs}
test_split: test
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: !function preprocess_wikitext.wikitext_detokenizer
process_results: !function preprocess_wikitext.process_results
metric_list:
  - metric: word_perplexity
  - metric: byte_perplexity
  - metric: bits_per_byte
metadata:
  version: 2.0
"""


@dataclass
class SideResult:
    harness: str                 # "ours" or "lm-eval"
    dtype: str                   # what the matmuls ran in, said plainly
    tokens: int                  # tokens scored (targets whose log-probability was summed)
    forward_tokens: int          # tokens fed through the model (input positions)
    windows: int                 # model calls
    wall_s: float                # the whole evaluation call
    body_s: float                # time inside the decoder body (model.model), the shared part
    ppl: float                   # token-level perplexity, exp(total NLL / tokens)
    extra: dict = field(default_factory=dict)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_s if self.wall_s > 0 else float("nan")

    def as_dict(self) -> dict:
        d = asdict(self)
        d["tokens_per_s"] = self.tokens_per_s
        d["forward_tokens_per_s"] = self.forward_tokens / self.wall_s if self.wall_s > 0 else float("nan")
        d["outside_body_s"] = self.wall_s - self.body_s
        return d


def _median_full(calls: list[list], length: int) -> float | None:
    """Median decoder-body seconds of the full-length calls: robust to bursts of load from other jobs."""
    times = sorted(t for n, t in calls if n == length)
    if not times:
        return None
    mid = len(times) // 2
    return times[mid] if len(times) % 2 else (times[mid - 1] + times[mid]) / 2


@contextmanager
def _body_timer(model: nn.Module):
    """Accumulate the seconds spent in the decoder body (model.model) while the context is open."""
    body = getattr(model, "model", model)
    acc = {"s": 0.0, "calls": []}  # calls: [input length, seconds] per forward
    start = []

    def pre(_module, args, kwargs):
        x = kwargs.get("input_ids", args[0] if args else None)
        if x is None:
            x = kwargs.get("inputs_embeds")
        start.append((int(x.shape[1]) if x is not None else 0, time.perf_counter()))

    def post(*_):
        n, t = start.pop()
        dt = time.perf_counter() - t
        acc["s"] += dt
        acc["calls"].append([n, round(dt, 4)])

    h1 = body.register_forward_pre_hook(pre, with_kwargs=True)
    h2 = body.register_forward_hook(post)
    try:
        yield acc
    finally:
        h1.remove()
        h2.remove()


def _warm_up(model: nn.Module, autocast: bool) -> None:
    """One short forward so neither timed side pays lazy library initialisation."""
    device = next(model.parameters()).device
    x = torch.arange(16, device=device).unsqueeze(0) % model.config.vocab_size
    with torch.no_grad(), P.use("bf16" if autocast else "fp32"), P.autocast(device):
        model(x)


# ---------------------------------------------------------------------------------------------- ours

def run_ours(model: nn.Module, ids: torch.Tensor, seq_len: int = 2048, autocast: bool = False,
             dtype_label: str | None = None) -> SideResult:
    """Time bench.evaluations.perplexity.perplexity on `ids` (whole windows only)."""
    from bench.evaluations.perplexity import perplexity
    with _body_timer(model) as body:
        t0 = time.perf_counter()
        res = perplexity(model, ids, seq_len=seq_len, include_partial=False,
                         precision="bf16" if autocast else "fp32", desc="ours")
        wall = time.perf_counter() - t0
    scored = res["windows"] * (seq_len - 1)
    label = dtype_label or ("fp32 weights + bf16 autocast" if autocast else str(next(model.parameters()).dtype))
    return SideResult("ours", label, scored, res["tokens"], res["windows"], wall, body["s"], res["ppl"],
                      {"nll_mean_of_window_means": res["nll"], "seq_len": seq_len, "autocast": autocast,
                       "body_calls": body["calls"], "median_full_window_body_s": _median_full(body["calls"], seq_len)})


# ------------------------------------------------------------------------------------------- lm-eval

def write_task(folder: Path, docs_path: Path, task: str = TASK_NAME) -> str:
    """Write the lm-eval wikitext task, reading `docs_path`, into `folder`; return its name."""
    import lm_eval
    src = Path(lm_eval.__file__).parent / "tasks" / "wikitext" / "preprocess_wikitext.py"
    if not src.is_file():
        raise UserError(f"lm-eval {getattr(lm_eval, '__version__', '?')} has no {src}: the wikitext task layout changed.")
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copy(src, folder / "preprocess_wikitext.py")
    (folder / f"{task}.yaml").write_text(_TASK_YAML.format(task=task, docs=json.dumps(str(docs_path.resolve()))))
    return task


def _detokenizer(folder: Path):
    spec = importlib.util.spec_from_file_location("_speed_preprocess_wikitext", folder / "preprocess_wikitext.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.wikitext_detokenizer


def pick_limit(tokenizer, docs_path: Path, target_tokens: int, task_dir: Path) -> tuple[int, list[int]]:
    """How many leading documents lm-eval should score so it scores about `target_tokens` tokens.

    Returns the limit and the planned token count of each document up to it.
    """
    detok = _detokenizer(task_dir)
    counts: list[int] = []
    with open(docs_path, encoding="utf-8") as f:
        for line in f:
            counts.append(len(tokenizer(detok(json.loads(line)), add_special_tokens=False)["input_ids"]))
            if sum(counts) >= target_tokens:
                break
    if not counts:
        raise UserError(f"{docs_path} holds no documents.")
    best, cum = 1, 0
    for k, c in enumerate(counts, 1):
        cum += c
        if abs(cum - target_tokens) <= abs(sum(counts[:best]) - target_tokens):
            best = k
    return best, counts[:best]


def run_lm_eval(model: nn.Module, tokenizer, docs_path: Path, limit: int, task_dir: Path,
                max_length: int = 2048, batch_size: int = 1, dtype_label: str | None = None) -> SideResult:
    """Time lm_eval.simple_evaluate with HFLM(model) on the local wikitext task, `limit` documents."""
    import lm_eval
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    t0 = time.perf_counter()
    task = write_task(task_dir, docs_path)
    tm = TaskManager(include_path=str(task_dir))
    lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size, max_length=max_length,
              device=str(next(model.parameters()).device))
    setup_s = time.perf_counter() - t0

    # Count what lm-eval actually scores and feeds the model: every rolling window passes through here.
    stats = {"scored": 0, "forward": 0, "calls": 0, "scoring_s": 0.0, "nll": 0.0}
    inner = lm._loglikelihood_tokens

    def counted(requests, *args, **kwargs):
        kwargs["disable_tqdm"] = True  # lm-eval opens a progress bar per rolling window
        for _, ctx, cont in requests:
            stats["scored"] += len(cont)
            stats["forward"] += len((ctx + cont)[-(max_length + 1):][:-1])
            stats["calls"] += 1
        t = time.perf_counter()
        out = inner(requests, *args, **kwargs)
        stats["scoring_s"] += time.perf_counter() - t
        stats["nll"] -= sum(ll for ll, _ in out)
        return out

    lm._loglikelihood_tokens = counted
    try:
        with _body_timer(model) as body:
            t0 = time.perf_counter()
            out = lm_eval.simple_evaluate(model=lm, tasks=[task], task_manager=tm, limit=limit, batch_size=batch_size,
                                          bootstrap_iters=0, log_samples=False, verbosity="WARNING")
            wall = time.perf_counter() - t0
    finally:
        del lm._loglikelihood_tokens
    res = out["results"][task]
    metrics = {k.split(",")[0]: v for k, v in res.items() if k.split(",")[0] in
               ("word_perplexity", "byte_perplexity", "bits_per_byte")}
    label = dtype_label or str(next(model.parameters()).dtype)
    ppl = math.exp(stats["nll"] / stats["scored"]) if stats["scored"] else float("nan")
    return SideResult("lm-eval", label, stats["scored"], stats["forward"], stats["calls"], wall, body["s"], ppl,
                      {"limit_docs": limit, "max_length": max_length, "batch_size": batch_size,
                       "scoring_s": stats["scoring_s"], "setup_s": setup_s, "metrics": metrics,
                       "body_calls": body["calls"], "median_full_window_body_s": _median_full(body["calls"], max_length),
                       "softmax_dtype": "model dtype (HFLM default)"})


# ------------------------------------------------------------------------------------------- driver

def _fmt_table(rows: list[SideResult], ref: SideResult) -> str:
    lines = ["| harness | dtype | tokens | wall s | tokens/s | ratio vs lm-eval |",
             "|---|---|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r.harness} | {r.dtype} | {r.tokens} | {r.wall_s:.1f} | {r.tokens_per_s:.0f} | "
                     f"{r.tokens_per_s / ref.tokens_per_s:.2f} |")
    return "\n".join(lines)


def _detail(rows: list[SideResult], seq_len: int) -> str:
    out = []
    for r in rows:
        med = r.extra.get("median_full_window_body_s")
        line = (f"- {r.harness} ({r.dtype}): {r.windows} model calls, {r.forward_tokens} tokens through the model "
                f"({r.forward_tokens / r.wall_s:.0f}/s); decoder body {r.body_s:.1f} s"
                + (f" (median {med:.2f} s per {seq_len}-token call)" if med else "")
                + f", everything else {r.wall_s - r.body_s:.1f} s; token perplexity {r.ppl:.2f}")
        if "setup_s" in r.extra:
            line += f"; set-up before the timed call (TaskManager, HFLM) {r.extra['setup_s']:.1f} s, not counted"
        out.append(line)
    return "\n".join(out)


def measure(model: nn.Module, tokenizer, ids: torch.Tensor, docs_path: Path, max_tokens: int,
            seq_len: int = 2048, default_mode: bool = True, log=print) -> dict:
    """The three runs; `model` is fp32 and left as it is (the bf16 runs use a copy)."""
    n_windows = max(1, max_tokens // seq_len)
    if len(ids) < n_windows * seq_len:
        raise UserError(f"the text has {len(ids)} tokens, fewer than {n_windows} windows of {seq_len}.")
    ids = ids[:n_windows * seq_len]
    target = n_windows * (seq_len - 1)
    with tempfile.TemporaryDirectory(prefix="eval-speed-") as tmp:
        task_dir = Path(tmp)
        write_task(task_dir, docs_path)
        limit, planned = pick_limit(tokenizer, docs_path, target, task_dir)
        log(f"ours: {n_windows} windows of {seq_len} ({target} scored tokens); lm-eval: --limit {limit} documents "
            f"(about {sum(planned)} scored tokens)")
        bf16 = copy.deepcopy(model).to(torch.bfloat16).eval()
        _warm_up(bf16, autocast=False)
        rows = []
        log("running ours, bf16 ...")
        rows.append(run_ours(bf16, ids, seq_len, autocast=False, dtype_label="bf16 weights"))
        log("running lm-eval, bf16 ...")
        rows.append(run_lm_eval(bf16, tokenizer, docs_path, limit, task_dir, max_length=seq_len,
                                dtype_label="bf16 weights"))
        del bf16
        if default_mode:
            _warm_up(model, autocast=True)
            log("running ours, default mode ...")
            rows.append(run_ours(model, ids, seq_len, autocast=True, dtype_label="fp32 weights + bf16 autocast"))
    return {"rows": rows, "reference": rows[1], "n_windows": n_windows, "limit_docs": limit}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.studies.eval_speed", description=__doc__.split("\n\n")[0])
    p.add_argument("--data-dir", default=None, help="data folder (default: $LRQ_BENCH_DATA)")
    p.add_argument("--model", default="smollm2-135m", help="model to load (default: the built-in default model)")
    p.add_argument("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS,
                   help=f"tokens per side, rounded down to whole windows (default {DEFAULT_MAX_TOKENS})")
    p.add_argument("--seq-len", type=int, default=2048, help="window length = lm-eval max_length (default 2048)")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's choice)")
    p.add_argument("--no-default-mode", action="store_true", help="skip the fp32 + bf16-autocast run of ours")
    p.add_argument("--out", default=None, help="write the figures as JSON here")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    try:
        from bench.evaluations.data import eval_text, resolve_data_dir, tokenize
        from bench.common.models import load_model
        from bench.common.provenance import git_revision, hardware, versions

        if args.threads:
            torch.set_num_threads(args.threads)
        data_dir = resolve_data_dir(args.data_dir)
        if data_dir is None or not (data_dir / DOCS_FILE).is_file():
            raise UserError(f"this benchmark reads local files only: pass --data-dir (or set $LRQ_BENCH_DATA) "
                            f"to a folder holding wikitext2/wiki.test.raw and {DOCS_FILE}.")
        loaded = load_model(args.model)
        model, tok = loaded.model.eval(), loaded.tokenizer
        text = eval_text("wikitext2", data_dir)
        ids = tokenize(tok, text.text)
        load0 = os.getloadavg()
        t0 = time.perf_counter()
        out = measure(model, tok, ids, data_dir / DOCS_FILE, args.max_tokens, args.seq_len,
                      default_mode=not args.no_default_mode, log=lambda m: print(m, file=sys.stderr, flush=True))
        total = time.perf_counter() - t0
        load1 = os.getloadavg()
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    rows, ref = out["rows"], out["reference"]
    note = (f"Each side ran once, back to back, in one process on {hardware()['cpu']} "
            f"({torch.get_num_threads()} torch threads; load average {load0[0]:.1f} before, {load1[0]:.1f} after): "
            f"the CPU may be shared with other jobs, so differences of ~10-20 % can be noise. "
            f"tokens = tokens scored; lm-eval scores whole documents in rolling windows "
            f"(--limit {out['limit_docs']}), ours {out['n_windows']} non-overlapping {args.seq_len}-token windows "
            f"of the raw test stream.")
    print(_fmt_table(rows, ref))
    print()
    print(_detail(rows, args.seq_len))
    print()
    print(textwrap.fill(note, 110))
    if args.out:
        report = {
            "model": loaded.name, "model_source": loaded.source, "data_source": text.source,
            "docs_file": str(data_dir / DOCS_FILE), "seq_len": args.seq_len, "max_tokens": args.max_tokens,
            "rows": [r.as_dict() | {"ratio_vs_lm_eval": r.tokens_per_s / ref.tokens_per_s} for r in rows],
            "total_s": total, "loadavg_before": load0, "loadavg_after": load1, "note": note,
            "versions": versions(), "hardware": hardware(), "git_revision": git_revision(),
            "command": " ".join(["python -m bench.studies.eval_speed"] + (argv if argv is not None else sys.argv[1:])),
        }
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(dumps_json(report, indent=2) + "\n")
        print(f"\nwrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
