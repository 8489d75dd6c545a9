"""What an int8 output head costs in accuracy (lrq.packed.quantize_head), beside what it buys in speed (bench.studies.speed).

    python -m bench.studies.head_int8 [--tokens 65536] [--schemes fp,w4a16-g128] [--data-dir DIR] [--out reports/head-int8]
    python -m bench.studies.head_int8 --format bf16 --precision fp32 ...   # a float32 model's table held in bf16

For the default model as it is (`fp`) and quantized with RTN at each scheme, the same model twice: its output head
as held (tied to the embedding; computed in the run's precision, the logits scored in float32) and packed to 8-bit
levels per output channel by quantize_head, the tied embedding reading the same levels or keeping its own table. Both run the first `--tokens` tokens of WikiText-2 in 2,048-token windows
under the suite's precision (`--precision`, auto by default), the logits scored in float32 as the perplexity
evaluation scores them. Reported per base model: the perplexity with each head, their ratio over paired windows
with its 95 % t-interval, the mean KL divergence of the int8-head model from the model as held and their top-1
agreement. Writes head_int8.json and .md with the configuration, versions, hardware and git revision.
"""

from __future__ import annotations

import argparse
import copy
import math
from pathlib import Path

import torch

from lrq import precision as P


def compare(a: torch.nn.Module, b: torch.nn.Module, wins: list[torch.Tensor], chunk: int = 256,
            names: tuple[str, str] = ("bf16_head", "int8_head")) -> dict:
    """Per-window mean NLL of both models, and the KL divergence KL(a || b) and top-1 agreement per position (the
    keys name a's head names[0], the head as held, and b's names[1])."""
    from bench.evaluations import kl as K
    from bench.evaluations.perplexity import final_hidden
    from lrq.precision import float32_logits, head_weight
    # each head as float32 once per model (lrq.precision.head_logits' values)
    wa, wb = (head_weight(m.get_output_embeddings()).detach().float() for m in (a, b))
    nll_a, nll_b, kls, agree = [], [], [], []
    with torch.no_grad():
        for w in wins:
            ha, t = final_hidden(a, w)
            hb, _ = final_hidden(b, w)
            sa = sb = 0.0
            for i in range(0, len(t), chunk):
                la = torch.log_softmax(float32_logits(ha[i:i + chunk], wa), -1)
                lb = torch.log_softmax(float32_logits(hb[i:i + chunk], wb), -1)
                tt = t[i:i + chunk, None]
                sa -= float(la.gather(1, tt).sum())
                sb -= float(lb.gather(1, tt).sum())
                k, ag, _ = K.kl_exact(la, lb)
                kls.append(k)
                agree.append(ag)
            nll_a.append(sa / len(t))
            nll_b.append(sb / len(t))
    kl, ag = torch.cat(kls).double(), torch.cat(agree).float()
    na, nb = names
    return {f"window_nll_{na}": nll_a, f"window_nll_{nb}": nll_b,
            f"ppl_{na}": math.exp(sum(nll_a) / len(nll_a)), f"ppl_{nb}": math.exp(sum(nll_b) / len(nll_b)),
            "kld_mean": float(kl.mean()), "kld_p99": float(kl.quantile(0.99)) if kl.numel() <= 1 << 24 else None,
            "top1_agree": float(ag.mean()), "positions": int(kl.numel())}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.studies.head_int8", description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=65536)
    p.add_argument("--schemes", default="fp,w4a16-g128", help="comma-separated: fp and/or RTN schemes")
    p.add_argument("--precision", default="auto")
    p.add_argument("--data-dir", default=None)
    p.add_argument("--out", default=None, help="default reports/head-int8 (--format bf16: reports/head-bf16)")
    p.add_argument("--format", default="int8", choices=["int8", "bf16"],
                   help="the head quantize_head makes: int8 levels, or a float32 model's table held in bf16 (give "
                        "--precision fp32: a bf16 model's table is bf16 already)")
    a = p.parse_args(argv)
    import lrq
    from bench.common.models import load_model
    from bench.common.provenance import cpu_label, git_revision, hardware, versions
    from bench.evaluations import data as D
    from bench.evaluations.perplexity import windows
    from bench.evaluations.stats import paired_ppl
    from lrq.errors import UserError
    from lrq.io import atomic_write_text, dumps_json
    from lrq.packed import quantize_head
    loaded = load_model("smollm2-135m")
    ids = D.tokenize(loaded.tokenizer, D.eval_text("wikitext2", D.resolve_data_dir(a.data_dir)).text)[:a.tokens]
    wins = windows(ids, 2048)
    if len(wins) < 2:
        raise UserError(f"--tokens {a.tokens} gives {len(wins)} 2,048-token window(s): the paired interval needs at "
                        f"least two (--tokens 4096 or more)")
    decided = P.Precision.decide(a.precision)
    fmt = a.format
    if fmt == "bf16" and decided.used != "fp32":
        raise UserError(f"--format bf16 holds a float32 model's table in bf16, but this run computes in "
                        f"{decided.used}; add --precision fp32")
    held, other_name = ("bf16_head", "int8_head") if fmt == "int8" else ("float32_head", "bf16_table")
    rows = []
    for name in [s.strip() for s in a.schemes.split(",") if s.strip()]:
        base = copy.deepcopy(loaded.model).eval()
        if name != "fp":
            lrq.quantize(base, "rtn", name)
        if fmt == "bf16":
            base.float()
        for shared in (True, False) if fmt == "int8" else (True,):   # the tied embedding reading the head's table
            other = copy.deepcopy(base)
            sizes = quantize_head(other, fmt, share_embedding=shared)
            with P.use(decided), P.autocast("cpu"):
                r = compare(base, other, wins, names=(held, other_name))
            c = paired_ppl(r[f"window_nll_{other_name}"], r[f"window_nll_{held}"])
            r |= {"base": name, "method": None if name == "fp" else "rtn", "embedding": "shared" if shared else "own",
                  "head_bytes": sizes, "ppl_ratio": c.effect, "ppl_ratio_lo": c.lo, "ppl_ratio_hi": c.hi,
                  "windows": c.n}
            rows.append(r)
            print(f"{name} ({r['embedding']} embedding): ppl {r[f'ppl_{held}']:.3f} -> {r[f'ppl_{other_name}']:.3f}, "
                  f"ratio {c.effect:.4f} [{c.lo:.4f}, {c.hi:.4f}], KLD {r['kld_mean']:.5f}, top-1 "
                  f"{r['top1_agree']:.4f}", flush=True)
            del other
        del base
    hw = hardware()
    doc = {"config": {"model": "smollm2-135m", "tokens": int(len(ids)), "windows": len(wins), "seq_len": 2048,
                      "data": "wikitext2 test", "precision": decided.info(), "threads": torch.get_num_threads(),
                      "format": fmt, "command": f"python -m bench.studies.head_int8 --tokens {a.tokens} --schemes "
                                                  f"{a.schemes} --format {fmt} --precision {a.precision}",
                      "versions": versions(), "hardware": hw, "machine": cpu_label(hw), "git": git_revision()},
           "rows": rows}
    out = Path(a.out or ("reports/head-int8" if fmt == "int8" else "reports/head-bf16"))
    out.mkdir(parents=True, exist_ok=True)
    stem = "head_int8" if fmt == "int8" else "head_bf16"
    atomic_write_text(out / f"{stem}.json", dumps_json(doc, indent=1))
    md = (_bf16_markdown if fmt == "bf16" else _int8_markdown)(doc, decided, held, other_name)
    atomic_write_text(out / f"{stem}.md", "\n".join(md) + "\n")
    print("\n".join(md))
    return 0


def _run_sentence(cfg: dict, precision: str) -> str:
    """What both reports say of the run: model, tokens, precision, machine, versions and command."""
    return (f"smollm2-135m, the first {cfg['tokens']:,} WikiText-2 test tokens ({cfg['windows']} windows of 2,048), "
            f"precision {precision}; {cfg['machine']}; torch {cfg['versions'].get('torch')}, git {cfg['git'][:12]}. "
            f"Command: `{cfg['command']}`. ")


def _base_label(r: dict) -> str:
    return "FP" if r["base"] == "fp" else f"RTN {r['base']}"


def _int8_markdown(doc: dict, decided, held: str, other: str) -> list[str]:
    md = ["# What an int8 output head costs in accuracy", "",
          _run_sentence(doc["config"], f"{decided.used} ({decided.asked}: {decided.why})")
          + "The int8 head: lrq.packed.quantize_head (8-bit levels per output channel on each row's min-max grid; "
          "the tied embedding reading the same levels or keeping its own table). The ratio's interval: 95 % t over "
          "paired windows.", "",
          "| model | input embedding | perplexity, head as held | perplexity, int8 head | ratio (int8 / held) "
          "[95 % CI] | mean KLD | top-1 agreement | head bytes (held -> int8) |", "|---|---|---|---|---|---|---|---|"]
    for r in doc["rows"]:
        hb, emb = r["head_bytes"], ("the head's int8 levels" if r["embedding"] == "shared" else "its own table")
        md.append(f"| {_base_label(r)} | {emb} | {r[f'ppl_{held}']:.3f} | {r[f'ppl_{other}']:.3f} | {r['ppl_ratio']:.4f} "
                  f"[{r['ppl_ratio_lo']:.4f}, {r['ppl_ratio_hi']:.4f}] | {r['kld_mean']:.5f} | {r['top1_agree']:.4f} | "
                  f"{hb['head_bytes'] / 2**20:.1f} -> {hb['head_bytes_packed'] / 2**20:.1f} MiB |")
    return md


def _bf16_markdown(doc: dict, decided, held: str, other: str) -> list[str]:
    md = ["# What a float32 model's table held in bf16 costs in accuracy", "",
          _run_sentence(doc["config"], decided.used)
          + "lrq.packed.quantize_head(model, \"bf16\"): the output head and tied embedding held in bf16, the rest "
          "float32 (lossless for a bf16 checkpoint; this model's table, from a Q8_0 GGUF, has float32 values, rounded "
          "to bf16). The ratio's interval: 95 % t over paired windows.", "",
          "| model | values rounded | perplexity, float32 table | perplexity, bf16 table | ratio (bf16 / float32) "
          "[95 % CI] | mean KLD | top-1 agreement | table bytes |", "|---|---|---|---|---|---|---|---|"]
    for r in doc["rows"]:
        hb = r["head_bytes"]
        md.append(f"| {_base_label(r)} | {hb.get('values_rounded', 0):,} | {r[f'ppl_{held}']:.3f} | {r[f'ppl_{other}']:.3f} | "
                  f"{r['ppl_ratio']:.5f} [{r['ppl_ratio_lo']:.5f}, {r['ppl_ratio_hi']:.5f}] | {r['kld_mean']:.6f} | "
                  f"{r['top1_agree']:.4f} | {hb['head_bytes'] / 2**20:.1f} -> {hb['head_bytes_packed'] / 2**20:.1f} MiB |")
    return md


if __name__ == "__main__":
    raise SystemExit(main())
