"""How far the stored KL reference (the FP model's top-k log-probabilities + tail mass, bench.kl) is from the
exact KL divergence over the whole vocabulary, on real cells of the default model.

    python -m bench.studies.kl_approx [--windows 4] [--ks 16,32,64,128,256] [--out reports/kl]

For each cell (RTN at every standard scheme, GPTQ w4a16-g128 with 32 x 512 C4 calibration tokens) the FP
model and the quantized copy run side by side on the first `--windows` WikiText-2 windows of 2048 tokens at
the machine's precision (lrq.precision auto); at every position the exact KL(P_fp || P_q) over all 49,152
tokens and the top-k approximation for each k are computed from the same log-probabilities. Reports, per
cell and k, the mean KL both ways, the relative error of the mean (the stored metric), and the 99th percentile
of the per-position relative error; the approximation never exceeds the exact value (log-sum inequality).
"""

from __future__ import annotations

import argparse
import copy
import sys
import time

import torch

CELLS = [("rtn", "w8a8"), ("rtn", "w4a8"), ("rtn", "w4a16"), ("rtn", "w4a16-g128"), ("rtn", "w3a16"),
         ("rtn", "w3a16-g128"), ("gptq", "w4a16-g128")]


@torch.no_grad()
def compare(fp, q, wins, ks, autocast: bool) -> dict:
    from bench.kl import kl_top_k
    from bench.perplexity import _logit_chunks
    exact, approx, top1 = [], {k: [] for k in ks}, []
    ctx = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else torch.autocast("cpu", enabled=False)
    with ctx:
        for w in wins:
            for (lp_logits, _), (lq_logits, _) in zip(_logit_chunks(fp, w), _logit_chunks(q, w)):
                lp, lq = torch.log_softmax(lp_logits, -1), torch.log_softmax(lq_logits, -1)
                exact.append((lp.exp() * (lp - lq)).sum(1).clamp(min=0))
                for k in ks:
                    top = lp.topk(k, dim=-1)
                    kl, agree = kl_top_k(lq, top.indices, top.values)
                    approx[k].append(kl)
                    if k == ks[0]:
                        top1.append(agree)
    e = torch.cat(exact).double()
    out = {"positions": int(e.numel()), "exact_kld": float(e.mean()), "top1_agree": float(torch.cat(top1).float().mean()),
           "k": {}}
    for k in ks:
        a = torch.cat(approx[k]).double()
        rel = ((e - a) / e.clamp(min=1e-12)).clamp(min=0)
        out["k"][str(k)] = {"approx_kld": float(a.mean()), "rel_error_of_mean": float((e.mean() - a.mean()) / e.mean()),
                       "rel_error_p99": float(torch.quantile(rel, 0.99)), "never_above": bool((a <= e + 1e-6).all())}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--windows", type=int, default=4)
    ap.add_argument("--ks", default="16,32,64,128,256")
    ap.add_argument("--out", default="reports/kl")
    ap.add_argument("--data-dir", default=None)
    args = ap.parse_args(argv)
    import lrq
    from bench import data as D
    from bench.models import load_model
    from bench.perplexity import windows
    from bench.provenance import git_revision, hardware, versions
    from lrq import precision as P
    ks = [int(k) for k in args.ks.split(",")]
    loaded = load_model("smollm2-135m")
    fp, tok = loaded.model, loaded.tokenizer
    data_dir = D.resolve_data_dir(args.data_dir)
    ids = D.tokenize(tok, D.eval_text("wikitext2", data_dir).text)
    wins = windows(ids, 2048)[: args.windows]
    calib = D.calibration_set(tok, data_dir, "c4", 32, 512)
    prec = P.resolve("auto")
    rows = []
    for method, scheme in CELLS:
        t = time.perf_counter()
        q = copy.deepcopy(fp)
        lrq.quantize(q, method, scheme, calibration=calib, precision=prec)
        res = compare(fp, q, wins, ks, prec == "bf16")
        rows.append({"method": method, "scheme": scheme, **res, "seconds": time.perf_counter() - t})
        print(f"{method} {scheme}: exact KLD {res['exact_kld']:.5f}, " + ", ".join(
            f"k={k}: {v['rel_error_of_mean']:.2%}" for k, v in res["k"].items()), flush=True)
        del q
    doc = {"cells": rows, "windows": args.windows, "seq_len": 2048, "precision": prec, "ks": ks,
           "hardware": hardware(), "versions": versions(), "git": git_revision(),
           "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    from bench.studies import write_study
    write_study(args.out, "kl_approx", doc, markdown(doc))
    return 0


def markdown(doc: dict) -> str:
    ks = doc["ks"]
    lines = ["| cell | exact KLD (nats/token) | top-1 agreement | " + " | ".join(
        f"k={k}: error of the mean (p99 per position)" for k in ks) + " |", "|---" * (3 + len(ks)) + "|"]
    for r in doc["cells"]:
        lines.append(f"| {r['method']} {r['scheme']} | {r['exact_kld']:.5f} | {100 * r['top1_agree']:.2f} % | " +
                     " | ".join(f"{100 * r['k'][str(k)]['rel_error_of_mean']:.3f} % "
                                f"({100 * r['k'][str(k)]['rel_error_p99']:.2f} %)" for k in ks) + " |")
    hw = doc["hardware"]
    lines += ["", f"{doc['windows']} WikiText-2 windows of {doc['seq_len']} tokens ({doc['cells'][0]['positions']} "
              f"positions), precision {doc['precision']}, {hw.get('cpu')}, git {doc['git'][:12]}. The error is "
              f"(exact - approximate) / exact: the approximation is a lower bound."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
