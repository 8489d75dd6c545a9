"""Which gate sees a small regression: perplexity or KL divergence from FP, at the CI sweep's size.

    python -m bench.studies.kl_gate [--layer model.layers.15.mlp.down_proj] [--out reports/kl]

The CI sweep's RTN w4a16-g128 cell of the default model (or RTN at `--scheme`: calibration-free, so any change
is the injected one)
is evaluated on the CI sweep's text (WikiText-2's first 8,192 tokens, 4 windows of 2,048) at the machine's
precision, then again with Gaussian noise added to one layer's quantized weights: W_q + E, E ~ N(0, (s * rms(W_q))^2)
for relative sizes s, three noise seeds each. Each perturbed model is judged by the regression gate's own
tolerances (reports/tolerances.toml: perplexity may worsen by 0.5 %, KLD by 1 % + 1e-5): the table gives the
perplexity and KLD changes and which gate flags each, and the smallest size each gate flags on every seed.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
import torch.nn.functional as F

from bench.common.provenance import short_revision

SIZES = (0.01, 0.02, 0.05, 0.1, 0.2, 0.5)
SEEDS = (0, 1, 2)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layer", default="model.layers.15.mlp.down_proj")
    ap.add_argument("--scheme", default="w4a16-g128", help="the RTN cell's scheme (calibration-free: w4a16-g128, "
                                                          "w8a16, w3a16, ...)")
    ap.add_argument("--sizes", default=",".join(map(str, SIZES)))
    ap.add_argument("--out", default="reports/kl")
    ap.add_argument("--data-dir", default=None)
    args = ap.parse_args(argv)
    import copy

    import lrq
    from bench.evaluations import data as D
    from bench.evaluations import kl
    from bench.reports.compare import load_tolerances
    from bench.common.models import load_model
    from bench.evaluations.perplexity import perplexity, windows
    from bench.common.provenance import git_revision, hardware, versions
    from lrq import precision as P
    from lrq.qlinear import QuantLinear
    sizes = [float(x) for x in args.sizes.split(",")]
    tol = load_tolerances(None)
    prec = P.resolve("auto")
    loaded = load_model("smollm2-135m")
    fp, tok = loaded.model, loaded.tokenizer
    ids = D.tokenize(tok, D.eval_text("wikitext2", D.resolve_data_dir(args.data_dir)).text)[:8192]
    wins = windows(ids, 2048)
    ref = kl.compute_reference(fp, wins, prec)
    q = copy.deepcopy(fp)
    lrq.quantize(q, "rtn", args.scheme, precision=prec)
    layer = q.get_submodule(args.layer)
    assert isinstance(layer, QuantLinear), f"{args.layer} is not a quantized linear"
    w = layer.dequantized_weight().detach().float()
    rms = float(w.pow(2).mean().sqrt())

    def evaluate() -> tuple[float, float]:
        res = perplexity(q, ids, 2048, precision=prec, desc="kl gate", reference=ref)
        return res["ppl"], kl.summary(res["token_kl"], res["token_top1"])["kld"]

    t0 = time.perf_counter()
    base_ppl, base_kld = evaluate()
    ppl_allowed = max(tol["ppl"].get("abs", 0.0), tol["ppl"].get("rel", 0.0) * base_ppl)
    kld_allowed = max(tol["kld"].get("abs", 0.0), tol["kld"].get("rel", 0.0) * base_kld)
    rows = []
    for s in sizes:
        for seed in SEEDS:
            e = torch.randn(w.shape, generator=torch.Generator().manual_seed(seed)) * (s * rms)
            hook = layer.register_forward_hook(lambda m, a, out, e=e: out + F.linear(a[0], e.to(a[0].dtype)))
            try:
                p, k = evaluate()
            finally:
                hook.remove()
            rows.append({"size": s, "seed": seed, "ppl": p, "kld": k, "ppl_change": p / base_ppl - 1,
                         "kld_change": k / base_kld - 1, "ppl_flags": p - base_ppl > ppl_allowed,
                         "kld_flags": k - base_kld > kld_allowed})
            print(f"s={s:g} seed {seed}: ppl {p:.4f} ({p / base_ppl - 1:+.3%}), KLD {k:.5f} ({k / base_kld - 1:+.2%})",
                  flush=True)
    smallest = {g: next((s for s in sizes if all(r[f"{g}_flags"] for r in rows if r["size"] == s)), None)
                for g in ("ppl", "kld")}
    doc = {"cell": f"rtn {args.scheme}", "layer": args.layer, "weight_rms": rms, "precision": prec, "tokens": len(ids),
           "windows": len(wins), "base_ppl": base_ppl, "base_kld": base_kld, "ppl_allowed": ppl_allowed,
           "kld_allowed": kld_allowed, "tolerances": {"ppl": tol["ppl"], "kld": tol["kld"]}, "rows": rows,
           "smallest_flagged_on_every_seed": smallest, "seconds": time.perf_counter() - t0,
           "hardware": hardware(), "versions": versions(), "git": git_revision()}
    from bench.studies import write_study
    write_study(args.out, "kl_gate" if args.scheme == "w4a16-g128" else f"kl_gate-{args.scheme}", doc, markdown(doc))
    return 0


def markdown(doc: dict) -> str:
    lines = ["| relative noise size | perplexity change (3 seeds) | ppl gate flags | KLD change (3 seeds) | KLD gate flags |",
             "|---|---|---|---|---|"]
    pct = lambda v, d: f"{100 * v:+.{d}f} %"  # noqa: E731
    for s in sorted({r["size"] for r in doc["rows"]}):
        rs = [r for r in doc["rows"] if r["size"] == s]
        ppl = ", ".join(pct(r["ppl_change"], 2) for r in rs)
        kld = ", ".join(pct(r["kld_change"], 1) for r in rs)
        lines.append(f"| {s:g} | {ppl} | {sum(r['ppl_flags'] for r in rs)} of {len(rs)} | {kld} | "
                     f"{sum(r['kld_flags'] for r in rs)} of {len(rs)} |")
    sm = doc["smallest_flagged_on_every_seed"]
    hw = doc["hardware"]
    lines += ["", f"Cell {doc['cell']}, noise on {doc['layer']} (weight rms {doc['weight_rms']:.4g}); {doc['tokens']} "
              f"WikiText-2 tokens in {doc['windows']} windows, precision {doc['precision']}; baseline ppl "
              f"{doc['base_ppl']:.3f}, KLD {doc['base_kld']:.5f}; the gate allows ppl +{doc['ppl_allowed']:.4f} and KLD "
              f"+{doc['kld_allowed']:.6f}. Smallest size flagged on every seed: perplexity gate "
              f"{sm['ppl'] if sm['ppl'] is not None else 'none tried'}, KLD gate "
              f"{sm['kld'] if sm['kld'] is not None else 'none tried'}. {hw.get('cpu')}, git {short_revision(doc['git'])}."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
