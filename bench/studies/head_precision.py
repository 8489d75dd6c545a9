"""The output head's precision where logits are scored: bf16 (what autocast did before) against float32.

    python -m bench.studies.head_precision [--tokens 8192] [--scheme w4a16] [--out reports/precision]

The default model and RTN at `--scheme`, the first `--tokens` tokens of WikiText-2 in 2,048-token windows, the
body of both models under bf16 autocast. From the same final hidden states the logits are computed twice: by
the head under bf16 autocast (the head's matmul in bf16, its output cast to float32: the suite before
2026-12-02) and by the head in float32 (lrq.precision.head_logits, the suite now). For each: the positions
where the FP or the quantized model's top token is an exact tie, top-1 agreement, mean KL divergence and
perplexity; and the time of the head projections (medians of alternating repetitions). Writes
head_precision.json and .md with versions, hardware and git revision.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from pathlib import Path

import torch

from lrq import precision as P


def _scores(lp_chunks, lq_chunks, targets):
    from bench.evaluations import kl as K
    kls, agree, ties_fp, ties_q, nll = [], [], 0, 0, 0.0
    for lp, lq, t in zip(lp_chunks, lq_chunks, targets):
        k, a, _ = K.kl_exact(lp, lq)
        p2, q2 = lp.topk(2, 1).values, lq.topk(2, 1).values
        ties_fp += int((p2[:, 0] == p2[:, 1]).sum())
        ties_q += int((q2[:, 0] == q2[:, 1]).sum())
        kls.append(k)
        agree.append(a)
        nll -= float(lq.gather(1, t.unsqueeze(1)).sum())
    n = sum(len(t) for t in targets)
    return {"top1_agree": float(torch.cat(agree).float().mean()), "kld": float(torch.cat(kls).double().mean()),
            "ties_fp": ties_fp, "ties_q": ties_q, "positions": n, "ppl_over_windows_pooled": float(torch.tensor(nll / n).exp())}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.studies.head_precision", description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--scheme", default="w4a16")
    p.add_argument("--data-dir", default=None)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--out", default="reports/precision")
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    import lrq
    from bench.evaluations import data as D
    from bench.common.models import load_model
    from bench.evaluations.perplexity import final_hidden, windows
    from bench.common.provenance import git_revision, hardware, versions
    from lrq.io import atomic_write_text, dumps_json
    from lrq.precision import head_logits
    loaded = load_model("smollm2-135m")
    fp = loaded.model
    q = copy.deepcopy(fp)
    lrq.quantize(q, "rtn", a.scheme)
    ids = D.tokenize(loaded.tokenizer, D.eval_text("wikitext2", D.resolve_data_dir(a.data_dir)).text)[:a.tokens]
    wins = windows(ids, 2048)
    hidden = {"fp": [], "q": []}
    targets = []
    with torch.no_grad(), P.autocast("cpu", precision="bf16"):
        for w in wins:
            for name, m in (("fp", fp), ("q", q)):
                h, t = final_hidden(m, w)
                hidden[name].append(h)
            targets.append(t)
    heads = {"fp": fp.get_output_embeddings(), "q": q.get_output_embeddings()}

    def logits(name: str, mode: str):
        out = []
        with torch.no_grad():
            for h in hidden[name]:
                if mode == "bf16":
                    with P.autocast("cpu", precision="bf16"):
                        out.append(torch.log_softmax(heads[name](h).float(), -1))
                else:
                    out.append(torch.log_softmax(head_logits(heads[name], h), -1))
        return out

    res, times = {}, {"bf16": [], "fp32": []}
    for mode in ("bf16", "fp32"):
        res[mode] = _scores(logits("fp", mode), logits("q", mode), targets)
    for _ in range(a.reps):   # alternating repetitions of the quantized model's head projections alone
        for mode in ("bf16", "fp32"):
            t0 = time.perf_counter()
            with torch.no_grad():
                for h in hidden["q"]:
                    if mode == "bf16":
                        with P.autocast("cpu", precision="bf16"):
                            heads["q"](h).float()
                    else:
                        head_logits(heads["q"], h)
            times[mode].append(time.perf_counter() - t0)
    med = {m: statistics.median(v) for m, v in times.items()}
    doc = {"config": {"model": "smollm2-135m", "method": "rtn", "scheme": a.scheme, "tokens": int(len(ids)),
                      "windows": len(wins), "body": "bf16 autocast", "threads": 1, "reps": a.reps,
                      "versions": versions(), "hardware": hardware(), "git": git_revision()},
           "results": res, "head_seconds_median": med, "head_seconds": times}
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / "head_precision.json", dumps_json(doc, indent=1))
    hw = doc["config"]["hardware"]
    md = ["# The output head in bf16 or float32 where logits are scored", "",
          f"smollm2-135m FP vs RTN {a.scheme}, the first {len(ids):,} WikiText-2 tokens ({len(wins)} windows of 2,048), "
          f"the body under bf16 autocast, one thread; {hw.get('cpu')} (bf16 flags: "
          f"{', '.join(hw.get('cpu_bf16_flags') or []) or 'none'}), "
          f"torch {doc['config']['versions'].get('torch')}, git {doc['config']['git'][:12]}. "
          f"Command: `python -m bench.studies.head_precision --tokens {a.tokens} --scheme {a.scheme}`.", "",
          "| head | exact top-1 ties, FP | ties, quantized | top-1 agreement | mean KLD | perplexity (pooled) |",
          "|---|---|---|---|---|---|"]
    for mode in ("bf16", "fp32"):
        r = res[mode]
        md.append(f"| {mode} | {r['ties_fp']} of {r['positions']} | {r['ties_q']} | {r['top1_agree']:.4f} | "
                  f"{r['kld']:.5f} | {r['ppl_over_windows_pooled']:.3f} |")
    md += ["", f"Head projections of the quantized model over the {len(wins)} windows (median of {a.reps} alternating "
           f"repetitions): bf16 {med['bf16']:.2f} s, float32 {med['fp32']:.2f} s ({med['fp32'] / med['bf16']:.2f}x)."]
    atomic_write_text(out / "head_precision.md", "\n".join(md) + "\n")
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
