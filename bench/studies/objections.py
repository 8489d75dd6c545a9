"""Issue Z's objections to the long preset's verdict, answered at block level, for the claims page's last section
("What would change this verdict").

    python -m bench.studies.paper_claims ... --objections reports/objections-smollm2-135m

reads every `python -m bench.studies.figure2` output folder below DIR (one (scheme, method, setting) each, e.g.
`w3a16-lrq-lr1x/`, `w3a16-flexround-lr2x/`, `w3a16-lrq-lr1x-fp32product/`; the folder names are for people, the
figures come from each figure2.json's configuration) and answers:

- **Learning rate**: each method's held-out block error after training at each rate it was run at, as a factor of
  its authors' rate (the run without `--set lr=` is 1x); each method's best rate (the lowest geometric mean over the
  blocks, among rates run on every block); and LRQ / FlexRound at their best rates, paired window by window, beside
  the same at 1x: does the verdict change?
- **Precision**: LRQ with L @ U formed in float32 under autocast (`lowrank_product=fp32`) against the same run with
  the product at the autocast precision, paired window by window per block.

What was not run is listed as not tested, with the folder that would answer it; so is what the suite cannot test
here (REGIME_NOT_TESTED).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from bench.evaluations import stats as S
from lrq.errors import UserError

METHODS = ("lrq", "flexround")
SCHEMES = ("w3a16", "w4a8")
FACTORS = (0.5, 1.0, 2.0, 4.0)
#: what the suite does not test, and why (the regime's differences from the authors' that no study here varies)
REGIME_NOT_TESTED = (
    "the paper's 5,000 steps on every block of a whole model (a GPU job: about 15 h per cell on these CPUs); the "
    "Figure 2 study ran 5,000 steps on single blocks in float32",
    "512 calibration windows from C4 train (the data folder holds C4 validation only)",
    "a model with genuinely floating-point weights (the default model is a dequantized Q4_1 GGUF; none other is "
    "installable from the registries here)",
    "more than one seed at the long preset (the quick sweep has three)",
    "models of the paper's size (7B-70B)",
)


@dataclass
class Variant:
    """One method at one setting and scheme: the held-out windows' errors after training, per block."""
    scheme: str
    method: str
    product: str                  # LRQ's L @ U precision: "autocast" or "fp32" ("-" for FlexRound)
    lr: float | None              # the rate given with --set lr=, None: the authors'
    authors_lr: float | None      # the resolved rate of a run without --set lr=
    regime: str
    folder: str
    blocks: dict = field(default_factory=dict)      # block -> held-out windows' errors at the end
    steps: dict = field(default_factory=dict)       # block -> steps trained

    def factor(self, authors: float | None) -> float | None:
        if self.lr is None:
            return 1.0
        return self.lr / authors if authors else None


def _regime(cfg: dict, precision: str) -> str:
    s = cfg["settings"]
    return (f"{s['iters']} steps/block, batch {s['batch_size']}, calibration {cfg['train_windows']} x "
            f"{cfg['calibration']['seq_len']} ({cfg['heldout_windows']} held out), {precision}")


def load(path: str) -> list[Variant]:
    """Every finished (block, method) below `path`, grouped into variants (scheme, method, product, rate)."""
    root = Path(path)
    if not root.is_dir():
        raise UserError(f"--objections {path!r} is not a folder: give the folder holding the Figure-2 study runs "
                        f"(e.g. reports/objections-smollm2-135m).")
    variants: dict = {}
    for f in sorted(root.glob("*/figure2.json")):
        res = json.loads(f.read_text())
        cfg = res["config"]
        given = cfg["settings"]
        for r in res["results"].values():
            resolved = r.get("resolved", {})
            method = r["method"]
            last = r["curve"][-1]
            windows = last.get("heldout_windows") or []
            if method not in METHODS or not windows or any(not (w > 0 and math.isfinite(w)) for w in windows):
                continue
            product = resolved.get("lowrank_product", given.get("lowrank_product", "autocast")) \
                if method == "lrq" else "-"
            lr = float(given["lr"]) if "lr" in given else None
            regime = _regime(cfg, "bf16 autocast" if "bf16" in cfg.get("precision", "") else "fp32")
            key = (cfg["scheme"], method, product, lr, regime)
            v = variants.setdefault(key, Variant(cfg["scheme"], method, product, lr,
                                                 resolved.get("lr") if lr is None else None, regime, f.parent.name))
            v.blocks[r["block"]] = windows
            v.steps[r["block"]] = last["step"]
    return list(variants.values())


def _heldout(v: Variant, blocks) -> float:
    """A variant's held-out block error after training: the geometric mean over `blocks` of each block's mean
    over its windows."""
    return math.exp(sum(math.log(sum(v.blocks[b]) / len(v.blocks[b])) for b in blocks) / len(blocks))


def _paired(a: Variant, b: Variant, blocks) -> list[tuple[int, tuple | None]]:
    """a / b per block: the geometric mean of per-window ratios with its 95 % interval (None: windows differ)."""
    out = []
    for blk in blocks:
        x, y = a.blocks.get(blk), b.blocks.get(blk)
        out.append((blk, S.ratio_interval(x, y) if x and y and len(x) == len(y) else None))
    return out


def _verdict(pairs) -> tuple[str, str]:
    """LRQ / FlexRound per block: how many blocks each method is separated ahead in, and the words for it."""
    known = [p for _, p in pairs if p]
    lrq_ahead = sum(p[2] < 1 for p in known)
    fr_ahead = sum(p[1] > 1 for p in known)
    text = (f"LRQ separated ahead in {lrq_ahead}, FlexRound in {fr_ahead}, not separated in "
            f"{len(known) - lrq_ahead - fr_ahead} of {len(known)} blocks")
    verdict = ("LRQ ahead" if lrq_ahead == len(known) else "FlexRound ahead" if fr_ahead == len(known) else
               "not separated" if lrq_ahead == fr_ahead == 0 else "mixed")
    return verdict, text


def _pairs_text(pairs) -> str:
    return "; ".join(f"block {b} {p[0]:.3f} [{p[1]:.3f}, {p[2]:.3f}]" if p else f"block {b}: windows differ"
                     for b, p in pairs)


def _factor_text(f: float | None, v: Variant) -> str:
    return f"{f:g}x" if f is not None else f"lr {v.lr:g}"


def answer(path: str) -> dict:
    """The section's content: `tested` (lines with the numbers, per objection) and `not_tested` (lines)."""
    variants = load(path)
    tested, not_tested, tables = [], [], []
    where = Path(path).name
    for scheme in SCHEMES:
        vs = [v for v in variants if v.scheme == scheme]
        blocks = sorted({b for v in vs for b in v.blocks})
        authors = {m: next((v.authors_lr for v in vs if v.method == m and v.lr is None and v.product in
                            ("autocast", "-")), None) for m in METHODS}
        # one regime per scheme: the 1x runs' (the sweep compares like with like)
        rate_runs = {m: sorted((v for v in vs if v.method == m and v.product in ("autocast", "-")),
                               key=lambda v: (v.factor(authors[m]) or 0)) for m in METHODS}
        complete = {m: [v for v in rate_runs[m] if blocks and all(b in v.blocks for b in blocks)] for m in METHODS}
        # learning rate
        only_authors = all(len(complete[m]) == 1 and complete[m][0].lr is None for m in METHODS)
        if all(complete[m] for m in METHODS) and only_authors:
            # no sweep yet: the authors' rates only, the comparison a context, not an answer
            at_one = _paired(complete["lrq"][0], complete["flexround"][0], blocks)
            not_tested.append(f"learning rate at {scheme.upper()}: only the authors' rates have run (LRQ / FlexRound "
                              f"held-out block error at 1x: {_pairs_text(at_one)}: {_verdict(at_one)[1]}); the other "
                              f"rates ({', '.join(f'{f:g}x' for f in FACTORS if f != 1.0)}) go to "
                              f"{where}/{scheme}-<method>-lr<f>x/")
        elif all(complete[m] for m in METHODS):
            rows = []
            for m in METHODS:
                cells = {_factor_text(v.factor(authors[m]), v): _heldout(v, blocks)
                         for v in complete[m]}
                rows.append((m, cells))
            best = {m: min(complete[m], key=lambda v: _heldout(v, blocks))
                    for m in METHODS}
            one = {m: next((v for v in complete[m] if v.lr is None), None) for m in METHODS}
            tables.append({"scheme": scheme, "blocks": blocks, "rows": rows, "regime": one["lrq"].regime
                           if one["lrq"] else complete["lrq"][0].regime})
            at_best = _paired(best["lrq"], best["flexround"], blocks)
            v_best, t_best = _verdict(at_best)
            missing = {m: [f"{f:g}x" for f in FACTORS if all(v.factor(authors[m]) != f for v in complete[m])]
                       for m in METHODS}
            partial = any(missing.values())
            line = (f"Learning rate, {scheme.upper()}: best rates {'so far ' if partial else ''}"
                    f"LRQ {_factor_text(best['lrq'].factor(authors['lrq']), best['lrq'])}, "
                    f"FlexRound {_factor_text(best['flexround'].factor(authors['flexround']), best['flexround'])} of "
                    f"the authors' (rates run: LRQ "
                    f"{', '.join(_factor_text(v.factor(authors['lrq']), v) for v in complete['lrq'])}; FlexRound "
                    f"{', '.join(_factor_text(v.factor(authors['flexround']), v) for v in complete['flexround'])}). "
                    f"LRQ / FlexRound held-out block error at the best rates: {_pairs_text(at_best)}: {t_best}")
            if one["lrq"] and one["flexround"]:
                at_one = _paired(one["lrq"], one["flexround"], blocks)
                v_one, t_one = _verdict(at_one)
                change = ("the verdict does not change." if v_one == v_best else
                          f"the verdict changes: {v_one} at the authors' rates, {v_best} at the best.")
                line += (f". At the authors' rates: {_pairs_text(at_one)}: {t_one}. "
                         + ("So far " + change if partial else change[0].upper() + change[1:]))
            if partial:
                line += " Not yet run: " + "; ".join(f"{m} at {', '.join(fs)}" for m, fs in missing.items() if fs) + "."
            tested.append(line)
        else:
            have = ", ".join(f"{m}: blocks {sorted(b for v in rate_runs[m] for b in v.blocks) or 'none'}"
                             for m in METHODS)
            not_tested.append(f"learning rate at {scheme.upper()}: no method has finished every block at its "
                              f"authors' rate and another yet ({have}); the runs go to {where}/{scheme}-<method>-lr<f>x/")
        # precision
        lrq_one = next((v for v in vs if v.method == "lrq" and v.lr is None and v.product == "autocast"), None)
        lrq_fp32 = next((v for v in vs if v.method == "lrq" and v.lr is None and v.product == "fp32"), None)
        common = sorted(set(lrq_one.blocks) & set(lrq_fp32.blocks)) if lrq_one and lrq_fp32 else []
        if common:
            pairs = _paired(lrq_fp32, lrq_one, common)
            known = [p for _, p in pairs if p]
            moved = [b for b, p in pairs if p and (p[1] > 1 or p[2] < 1)]
            line = (f"Precision, {scheme.upper()}: LRQ with L @ U in float32 / in the autocast precision, "
                    f"held-out block error: {_pairs_text(pairs)}: "
                    + (f"separated in blocks {', '.join(map(str, moved))}" if moved else
                       f"not separated in any of {len(known)} blocks"))
            # the objection's question: with its product in float32, does LRQ catch FlexRound (both at 1x)?
            fr_one = next((v for v in vs if v.method == "flexround" and v.lr is None), None)
            both = sorted(set(common) & set(fr_one.blocks)) if fr_one else []
            if both:
                vs_fr = _paired(lrq_fp32, fr_one, both)
                v_fp32, t_fp32 = _verdict(vs_fr)
                v_auto = _verdict(_paired(lrq_one, fr_one, both))[0]
                line += (f". LRQ with the float32 product / FlexRound, both at the authors' rates: "
                         f"{_pairs_text(vs_fr)}: {t_fp32}; "
                         + ("the verdict does not change" if v_fp32 == v_auto else
                            f"the verdict changes: {v_auto} with the autocast product, {v_fp32} with float32"))
            tested.append(line)
        else:
            not_tested.append(f"precision at {scheme.upper()}: LRQ with L @ U in float32 and at the autocast "
                              f"precision have no finished block in common yet "
                              f"({where}/{scheme}-lrq-lr1x/ and {scheme}-lrq-lr1x-fp32product/)")
    return {"folder": where, "tested": tested, "not_tested": not_tested, "tables": tables}


def markdown(section: dict | None, tested_elsewhere: list[str] = (), not_yet: list[str] = ()) -> list[str]:
    """The claims page's last section, as Markdown lines; `tested_elsewhere` / `not_yet`: lines of the page's other
    rows that answer an objection (a second model's long run) / would once they are measured."""
    out = ["", "## What would change this verdict", "",
           "The objections a reader who wants LRQ to win can raise, and what the suite measured. Block level: the "
           "Figure 2 study's machinery (held-out block error after training, paired window by window)"
           + (f", runs in `{section['folder']}`." if section else "; no objection study was given (--objections)."),
           "", "**Tested**", ""]
    tested = (section or {}).get("tested", []) + list(tested_elsewhere)
    out += [f"- {t}" for t in tested] or ["- nothing yet"]
    for t in (section or {}).get("tables", []):
        labels = sorted({k for _, cells in t["rows"] for k in cells}, key=lambda k: float(k.rstrip("x"))
                        if k.endswith("x") else math.inf)
        out += ["", f"Held-out block error after training at {t['scheme'].upper()} (geometric mean over blocks "
                f"{', '.join(map(str, t['blocks']))}; {t['regime']}), by learning rate as a factor of the authors':", "",
                "| method | " + " | ".join(labels) + " |", "|---" * (len(labels) + 1) + "|"]
        for m, cells in t["rows"]:
            out.append(f"| {m} | " + " | ".join(f"{cells[k]:.4g}" if k in cells else "-" for k in labels) + " |")
    out += ["", "**Not tested**", ""]
    out += [f"- {t}" for t in [*(section or {}).get("not_tested", []), *not_yet]]
    out += [f"- {t}" for t in REGIME_NOT_TESTED]
    return out
