"""The KL reference (bench.evaluations.kl: the FP model's final hidden states and output head, the FP logits recomputed
at scoring time) against the exact KL divergence computed from both models side by side, on real cells of the
default model; beside it the top-k summary that was rejected for it (the FP model's k most likely tokens'
log-probabilities plus the tail's mass), and what the KL costs the evaluation.

    python -m bench.studies.kl_approx [--windows 4] [--ks 64,256] [--out reports/kl]

For each cell (RTN at every standard scheme, GPTQ w4a16-g128 with 32 x 512 C4 calibration tokens) the FP
model and the quantized copy run side by side on the first `--windows` WikiText-2 windows of 2048 tokens at
the machine's precision (lrq.precision auto); at every position the exact KL(P_fp || P_q) over all 49,152
tokens. Against it: the harness's own pass (bench.evaluations.perplexity with the stored reference: the relative error of
the mean and the largest per-position difference) and the top-k + tail summary for each k (a lower bound by
the log-sum inequality). The cost: the evaluation of the quantized model without and with the KL (median of
`--reps` timings each, one thread) and the reference's computation.
"""

from __future__ import annotations

import argparse
import copy
import sys
import time

import torch

CELLS = [("rtn", "w8a8"), ("rtn", "w4a8"), ("rtn", "w4a16"), ("rtn", "w4a16-g128"), ("rtn", "w3a16"),
         ("rtn", "w3a16-g128"), ("gptq", "w4a16-g128")]


def kl_top_k(lq: torch.Tensor, ref_idx: torch.Tensor, ref_lp: torch.Tensor) -> torch.Tensor:
    """The rejected summary: KL between the two distributions with every token outside the FP model's top k
    merged into one outcome (`ref_idx`, `ref_lp` [n, k]: the FP top-k tokens and log-probabilities)."""
    lq_top = lq.gather(1, ref_idx.long())
    p = ref_lp.exp()
    kl = (p * (ref_lp - lq_top)).sum(1)
    p_tail = (1.0 - p.sum(1)).clamp(min=0.0)
    q_tail = (1.0 - lq_top.exp().sum(1)).clamp(min=1e-30)
    tail = torch.where(p_tail > 0, p_tail * (torch.log(p_tail.clamp(min=1e-30)) - torch.log(q_tail)),
                       torch.zeros_like(p_tail))
    return (kl + tail).clamp(min=0.0)


@torch.no_grad()
def compare(fp, q, wins, ks, autocast: bool) -> dict:
    from bench.evaluations.perplexity import _logit_chunks
    exact, approx = [], {k: [] for k in ks}
    from lrq import precision as P
    with P.use("bf16" if autocast else "fp32"), P.autocast("cpu"):
        for w in wins:
            for (lp_logits, _), (lq_logits, _) in zip(_logit_chunks(fp, w), _logit_chunks(q, w)):
                lp, lq = torch.log_softmax(lp_logits, -1), torch.log_softmax(lq_logits, -1)
                exact.append((lp.exp() * (lp - lq)).sum(1).clamp(min=0))
                for k in ks:
                    top = lp.topk(k, dim=-1)
                    approx[k].append(kl_top_k(lq, top.indices, top.values))
    e = torch.cat(exact).double()
    out = {"positions": int(e.numel()), "exact_kld": float(e.mean()), "exact": e, "k": {}}
    for k in ks:
        a = torch.cat(approx[k]).double()
        rel = ((e - a) / e.clamp(min=1e-12)).clamp(min=0)
        out["k"][str(k)] = {"approx_kld": float(a.mean()), "rel_error_of_mean": float((e.mean() - a.mean()) / e.mean()),
                            "rel_error_p99": float(torch.quantile(rel, 0.99)), "never_above": bool((a <= e + 1e-6).all())}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--windows", type=int, default=4)
    ap.add_argument("--ks", default="64,256")
    ap.add_argument("--reps", type=int, default=3, help="timings of the evaluation without and with the KL")
    ap.add_argument("--out", default="reports/kl")
    ap.add_argument("--data-dir", default=None)
    args = ap.parse_args(argv)
    import lrq
    from bench.evaluations import data as D
    from bench.evaluations import kl
    from bench.common.models import load_model
    from bench.evaluations.perplexity import perplexity, windows
    from bench.common.provenance import git_revision, hardware, versions
    from bench.studies.precision import _median_time
    from lrq import precision as P
    torch.set_num_threads(1)
    ks = [int(k) for k in args.ks.split(",")]
    loaded = load_model("smollm2-135m")
    fp, tok = loaded.model, loaded.tokenizer
    data_dir = D.resolve_data_dir(args.data_dir)
    ids = D.tokenize(tok, D.eval_text("wikitext2", data_dir).text)
    wins = windows(ids, 2048)[: args.windows]
    ids = ids[: 2048 * args.windows]
    calib = D.calibration_set(tok, data_dir, "c4", 32, 512)
    prec = P.resolve("auto")
    bf16 = prec == "bf16"
    t = time.perf_counter()
    ref = kl.compute_reference(fp, wins, prec, "kl_approx")
    ref_s = time.perf_counter() - t
    rows, cost = [], None
    for method, scheme in CELLS:
        t = time.perf_counter()
        q = copy.deepcopy(fp)
        lrq.quantize(q, method, scheme, calibration=calib, precision=prec)
        res = compare(fp, q, wins, ks, bf16)
        exact = res.pop("exact")
        ours = perplexity(q, ids, 2048, precision=prec, desc="kl", reference=ref)["token_kl"].double()
        res["harness"] = {"kld": float(ours.mean()), "rel_error_of_mean": float((ours.mean() - exact.mean()) / exact.mean()),
                          "max_abs_diff": float((ours - exact).abs().max())}
        if cost is None:   # the evaluation's cost, without and with the KL, on the first cell
            plain = _median_time(lambda: perplexity(q, ids, 2048, precision=prec, desc="ppl"), args.reps)
            with_kl = _median_time(lambda: perplexity(q, ids, 2048, precision=prec, desc="kl", reference=ref),
                                   args.reps)
            cost = {"cell": f"{method} {scheme}", "eval_s": plain, "eval_with_kl_s": with_kl,
                    "reference_s": ref_s, "tokens": len(ids), "reps": args.reps}
        rows.append({"method": method, "scheme": scheme, **res, "seconds": time.perf_counter() - t})
        print(f"{method} {scheme}: exact KLD {res['exact_kld']:.5f}, harness {res['harness']['rel_error_of_mean']:.2e}, "
              + ", ".join(f"k={k}: {v['rel_error_of_mean']:.2%}" for k, v in res["k"].items()), flush=True)
        del q
    doc = {"cells": rows, "windows": args.windows, "seq_len": 2048, "precision": prec, "ks": ks, "cost": cost,
           "threads": torch.get_num_threads(), "hardware": hardware(), "versions": versions(), "git": git_revision(),
           "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    from bench.studies import write_study
    write_study(args.out, "kl_approx", doc, markdown(doc))
    return 0


def markdown(doc: dict) -> str:
    ks = doc["ks"]
    lines = ["# The KL reference against the exact KL divergence", "",
             "| cell | exact KLD (nats/token) | the harness (stored reference): error of the mean, max per-position "
             "difference | " + " | ".join(f"rejected top-{k} + tail: error of the mean (p99 per position)" for k in ks)
             + " |", "|---" * (3 + len(ks)) + "|"]
    for r in doc["cells"]:
        h = r["harness"]
        lines.append(f"| {r['method']} {r['scheme']} | {r['exact_kld']:.5f} | {h['rel_error_of_mean']:+.2e}, "
                     f"{h['max_abs_diff']:.1e} nats | " +
                     " | ".join(f"{100 * r['k'][str(k)]['rel_error_of_mean']:.2f} % "
                                f"({100 * r['k'][str(k)]['rel_error_p99']:.1f} %)" for k in ks) + " |")
    hw, c = doc["hardware"], doc["cost"]
    lines += ["", f"{doc['windows']} WikiText-2 windows of {doc['seq_len']} tokens ({doc['cells'][0]['positions']} "
              f"positions), precision {doc['precision']}, {doc['threads']} thread, {hw.get('cpu')} (native bf16: "
              f"{hw.get('native_bf16')}, torch at {hw.get('torch_cpu_capability')}), git {doc['git'][:12]}, "
              f"{doc['measured_at']}. Errors are (approximate - exact) / exact for the harness, (exact - approximate) "
              f"/ exact for the top-k summaries (a lower bound).", "",
              f"Cost ({c['cell']}, {c['tokens']} tokens, median of {c['reps']}): the evaluation {c['eval_s']:.2f} s "
              f"without the KL, {c['eval_with_kl_s']:.2f} s with it (x{c['eval_with_kl_s'] / c['eval_s']:.2f}); the FP "
              f"reference, once per model and text, {c['reference_s']:.2f} s."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
