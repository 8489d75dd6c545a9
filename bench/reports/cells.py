"""The leaderboard's tables as numbers: each cell's statistics with their intervals and paired comparisons
(`cell_stats`), rankings over seeds, planned against measured time, and the formatting of one value or
interval; bench.reports.report renders them as Markdown sections, bench.reports.html_report as a page."""

from __future__ import annotations


import pandas as pd
from tabulate import tabulate

import html
from collections import defaultdict
from dataclasses import replace

from bench.evaluations import evals as E
from bench.evaluations import stats as S
from bench.common.store import Row
from lrq.io import plain_text
from lrq.schemes import SCHEMES

FP = "fp"
TASK_DATASETS = E.TASK_ROWS      # the task rows the store can hold (the catalogue's tasks and their average)


def rows_frame(rows: list[Row]) -> pd.DataFrame:
    return pd.DataFrame([{"model": r.model, "method": r.method, "scheme": r.scheme, "dataset": r.dataset,
                          "metric": r.metric, "value": r.value, "seed": r.seed or 0, "git_rev": r.git_rev,
                          "created_at": r.created_at, "config": r.config, "precision": r.precision} for r in rows])


STATIC_ACTIVATIONS_NOTE = (
    " One activation range per tensor, fixed at calibration, is the hardest of these schemes: a few outlier "
    "channels set the range and every other channel loses resolution, which is why it can be worse than 4-bit "
    "weight-only schemes, and why SmoothQuant (and the W8A8 smoothing LRQ and FlexRound apply) exists. Compare "
    "methods with each other here.")

PRECISION_TEXT = {"bf16": "bf16, bf16 autocast over float32 weights", "fp32": "fp32, float32 throughout"}


def precision_text(section_precision: str) -> str:
    """A section's precision in words ("bf16" or "bf16, evaluated on ..." where a model's cells were evaluated
    under several settings)."""
    prec, _, rest = section_precision.partition(", ")
    return PRECISION_TEXT.get(prec, prec) + (f"; {rest}" if rest else "")


def eval_setting(r: Row) -> str | None:
    """How a perplexity / KL row's text was evaluated (tokens scored, window length, partial window), None for
    rows of no evaluation text (a quantization's statistics, tasks)."""
    ev = (r.config or {}).get("eval") if isinstance(r.config, dict) else None
    if not isinstance(ev, dict) or r.metric not in E.TEXT_METRICS:
        return None
    tokens = ev.get("max_tokens") or "all"
    return (f"{tokens if tokens == 'all' else f'{tokens:,}'} tokens per text in windows of {ev.get('seq_len', '?')}"
            + (" (+ the partial one)" if ev.get("include_partial") else ""))


def sections(rows: list[Row]) -> dict[tuple[str, str], list[Row]]:
    """The leaderboard's sections: one per (model, precision), in order of first appearance, and within it one per
    evaluation setting when cells were evaluated differently (2,048 and 6,144 tokens per text: never one table
    under one protocol line). A bf16 and an fp32 result of the same cell are different numbers and are never
    ranked against each other. Keys are (model, precision) or, where settings differ, (model, precision and
    setting); rows of no evaluation text (bits, quantization time, tasks) go with each setting of their cell."""
    settings: dict[tuple, set[str]] = {}        # per (model, precision): the evaluation settings its rows used
    cell_settings: dict[tuple, set[str]] = {}   # per cell (and seed): the same
    for r in rows:
        s = eval_setting(r)
        if s is not None:
            settings.setdefault((r.model, r.precision), set()).add(s)
            cell_settings.setdefault((r.model, r.precision, r.method, r.scheme, r.seed or 0), set()).add(s)
    out: dict[tuple[str, str], list[Row]] = {}
    for r in rows:
        if len(settings.get((r.model, r.precision), ())) < 2:
            out.setdefault((r.model, r.precision), []).append(r)
            continue
        own = eval_setting(r)
        mine = [own] if own is not None else sorted(cell_settings.get((r.model, r.precision, r.method, r.scheme,
                                                                        r.seed or 0), set())) or [None]
        for s in mine:
            out.setdefault((r.model, f"{r.precision}, evaluated on {s}" if s else r.precision), []).append(r)
    return out


def section_title(model: str, precision: str) -> str:
    return f"Model: {model}, precision {precision}"


def _seed_values(rows) -> dict[tuple, dict[int, float]]:
    """(method, scheme, dataset, metric) -> {seed: value}, the latest row of each seed, from Rows or a
    rows_frame's itertuples()."""
    out: dict = defaultdict(dict)
    for r in rows:
        out[(r.method, r.scheme, r.dataset, r.metric)][r.seed or 0] = r.value
    return out


def _known(by_seed: dict[int, float] | None) -> list[float]:
    return [v for v in (by_seed or {}).values() if v is not None and not pd.isna(v)]


def _fmt_seeds(metric: str, by_seed: dict[int, float] | None) -> str:
    """One seed (or the same value on every seed): the value; several: mean +-sd over seeds and how many,
    never one seed's value alone."""
    vals = _known(by_seed)
    if not vals:
        return "-"
    m_ = E.metric(metric)
    if len(set(vals)) == 1:       # one seed, or the same on every seed (bits per weight)
        return m_.format(vals[0])
    m, sd = S._mean_sd(vals)
    return f"{m_.format(m)} +-{m_.format(sd)} ({len(vals)} seeds)"


def _seed_mean(by_seed: dict[int, float] | None) -> float | None:
    vals = _known(by_seed)
    return sum(vals) / len(vals) if vals else None


_SCHEME_RANK = {s: i for i, s in enumerate(SCHEMES)}


def _order(df: pd.DataFrame) -> pd.DataFrame:
    df = df.assign(_m=(df["method"] != FP).astype(int), _s=df["scheme"].map(lambda s: _SCHEME_RANK.get(s, -1)))
    return df.sort_values(["_m", "method", "_s"]).drop(columns=["_m", "_s"])


def _fmt(metric: str, v) -> str:
    if v is None or pd.isna(v):
        return "-"
    return E.metric(metric).format(v)


def dataset_table(df: pd.DataFrame, dataset: str, metrics: list[str] | None = None) -> str:
    sub = df[df["dataset"] == dataset]
    if metrics:
        sub = sub[sub["metric"].isin(metrics)]
    if sub.empty:
        return ""
    vals = _seed_values(sub.itertuples())
    wide = _order(sub[["method", "scheme"]].drop_duplicates())
    cols = [c for c in (metrics or sorted(set(sub["metric"]))) if c in set(sub["metric"])]
    fp_ppl = _seed_mean(vals.get((FP, FP, dataset, "ppl")))
    body = []
    for _, r in wide.iterrows():
        line = [r["method"], r["scheme"]] + [_fmt_seeds(c, vals.get((r["method"], r["scheme"], dataset, c)))
                                             for c in cols]
        if fp_ppl is not None:
            ppl = _seed_mean(vals.get((r["method"], r["scheme"], dataset, "ppl")))
            line.append("-" if r["method"] == FP or ppl is None else f"{ppl / fp_ppl:.3f}x")
        body.append(line)
    headers = ["method", "scheme"] + cols + (["ppl / FP"] if fp_ppl is not None else [])
    return tabulate(body, headers=headers, tablefmt="github", disable_numparse=True)


def cell_stats(rows: list[Row]) -> dict[tuple[str, str], dict[tuple[str, str], S.CellStat]]:
    """Per (method, scheme) and column (dataset, metric): the value per seed with its interval and the
    per-window NLLs / KL means / per-example scores it came from (none for rows stored before they were
    kept); and, where the FP cell has per-example scores on the same examples, the flips against it
    (column ("flips", "flips"), and per task (task, "flips"))."""
    from bench.evaluations.tasks import MAIN_METRIC, ZERO_SHOT
    out: dict = defaultdict(dict)
    task_scores: dict = defaultdict(dict)
    averages = {}
    for r in rows:
        if r.value is None:
            continue
        key, seed, cfg = (r.method, r.scheme), r.seed or 0, r.config or {}
        m = E.METRICS.get(r.metric)
        if m is None or m.interval is None or not m.applies_to(r.dataset):
            continue
        if r.dataset == E.ZEROSHOT_AVG:     # the average of the zero-shot tasks: estimated from theirs, below
            if r.metric == E.ZEROSHOT_AVG_METRIC:
                averages[(key, seed)] = r.value
            continue
        per = m.samples_of(cfg)
        cs = out[key].setdefault((r.dataset, r.metric), S.CellStat(m.interval, metric=r.metric))
        cs.seeds[seed] = m.estimate(per, r.value)
        if per:
            cs.samples[seed] = per
            if r.dataset in E.TASKS and r.metric == MAIN_METRIC.get(r.dataset):
                task_scores[(key, seed)][r.dataset] = per
    for (key, seed), value in averages.items():
        lists = [task_scores[(key, seed)].get(t) for t in ZERO_SHOT]
        cs = out[key].setdefault((E.ZEROSHOT_AVG, E.ZEROSHOT_AVG_METRIC),
                                 S.CellStat("avg", metric=E.ZEROSHOT_AVG_METRIC))
        if all(lists):
            cs.seeds[seed], cs.samples[seed] = S.avg_estimate(lists, value), lists
        else:
            cs.seeds[seed] = S.Estimate(value)
    _flip_stats(out, task_scores)
    return out


def _flip_stats(out: dict, task_scores: dict) -> None:
    """Flips of every quantized cell against the FP cell, per task and over the zero-shot tasks (the share of
    examples whose answer changed, right to wrong plus wrong to right; the two apart under (task, kind))."""
    fp = {seed: scores for (key, seed), scores in task_scores.items() if key == (FP, FP)}
    if not fp:
        return
    fp_scores = fp[min(fp)]          # FP is calibration-free: one seed says it all
    for (key, seed), scores in task_scores.items():
        if key == (FP, FP):
            continue
        per_task = {}
        for task, q in scores.items():
            ref = fp_scores.get(task)
            if ref is None or len(ref) != len(q):
                continue
            r2w, w2r = S.flips(ref, q)
            per_task[task] = [a + b for a, b in zip(r2w, w2r)]
            for kind, v in zip(E.FLIP_METRICS, (per_task[task], r2w, w2r)):
                cs = out[key].setdefault((task, kind), S.CellStat(E.METRICS[kind].interval, metric=kind))
                cs.seeds[seed], cs.samples[seed] = S.acc_estimate(v), v
        zs = [per_task[t] for t in E.ZERO_SHOT if t in per_task]
        if len(zs) == len(E.ZERO_SHOT):   # "zero-shot" only when the seven zero-shot tasks all ran
            pooled = [x for v in zs for x in v]   # every example of the seven, one Wilson interval over them
            cs = out[key].setdefault(("flips", "flips"), S.CellStat(E.METRICS["flips"].interval, metric="flips"))
            cs.seeds[seed], cs.samples[seed] = S.acc_estimate(pooled), pooled


def _style(metric: str) -> str:
    """How a comparison of two cells on `metric` reads (the catalogue's `Metric.comparison`): a ratio, points
    (a share), a difference."""
    return E.metric(metric).comparison


def fmt_stat(cs: S.CellStat) -> str:
    """`v (lo-hi)` for one seed, `v +-sd (k seeds)` for several; in the metric's format (shares in %)."""
    f = E.metric(cs.metric).format
    if len(cs.seeds) > 1:
        return f"{f(cs.value)} +-{f(cs.seed_sd)} ({len(cs.seeds)} seeds)"
    e = cs.first()
    return f"{f(e.value)} ({f(e.lo)}-{f(e.hi)})" if e.known else f"{f(e.value)} (?)"


def _fmt_cmp(c: S.Comparison | None, style: str | bool) -> str:
    """A comparison with its interval; `style` "ratio", "pt" (a share, in points) or "diff" (True: "pt")."""
    if c is None:
        return "-"
    style = {True: "pt", False: "ratio"}.get(style, style) if isinstance(style, bool) else style
    if style == "pt":
        body = f"{100 * c.effect:+.1f} pt" + (f" [{100 * c.lo:+.1f}, {100 * c.hi:+.1f}]" if c.lo is not None else "")
    elif style == "diff":
        body = f"{c.effect:+.4f}" + (f" [{c.lo:+.4f}, {c.hi:+.4f}]" if c.lo is not None else "")
    else:
        body = f"{c.effect:.3f}x" + (f" [{c.lo:.3f}, {c.hi:.3f}]" if c.lo is not None else "")
    return body + (" *" if c.separated else "")


def _verdict(header: str, r: S.Ranking, style: str | bool) -> str | None:
    name = lambda k: f"{k[0]} {k[1]}"  # noqa: E731
    if r.status == "separated":
        return (f"- {header}: best {name(r.best)}, separated from the runner-up {name(r.runner_up)} "
                f"({_fmt_cmp(r.comparison, style).rstrip(' *')}).")
    if r.status == "tied":
        tied = [name(k) for k in r.marks if k != r.best]
        return (f"- {header}: no separated best: {name(r.best)} leads, tied with {', '.join(tied)} "
                f"(runner-up {_fmt_cmp(r.comparison, style)}; marked ~).")
    if r.best is not None:
        return (f"- {header}: interval unknown ({_why_unknown(r)}): nothing bold.")
    return None


def _why_unknown(r: S.Ranking) -> str:
    c = r.comparison
    if c is not None and c.n is not None and c.n < 2:
        return f"measured on {c.n} window or example only: an interval needs at least 2"
    return "stored before per-window/per-example data were kept"


def seed_rankings(stats: dict, seedless: set | None = None) -> list[dict]:
    """Per scheme and column where some method has several seeds: the methods in order of their mean over
    seeds (best first), and for each neighbour in that order whether it is ahead on every seed. Seeds are
    matched by number; a cell in `seedless` (calibration-free: RTN without calibration, FP) counts as the
    same on every seed; other cells run with one seed only are left out (listed in "single_seed")."""
    seedless = seedless or set()
    out = []
    by_col: dict = defaultdict(dict)
    for (method, scheme), cols in stats.items():
        for col, cs in cols.items():
            by_col[(scheme, col)][method] = cs
    for (scheme, col), all_cells in sorted(by_col.items()):
        seeds = sorted({sd for cs in all_cells.values() if len(cs.seeds) > 1 for sd in cs.seeds})
        cells = {m: cs for m, cs in all_cells.items() if len(cs.seeds) > 1 or (m, scheme) in seedless}
        single = sorted(set(all_cells) - set(cells))
        if not seeds or len(cells) < 2:
            continue
        lower = E.metric(col[1]).better == "lower" or col[1] in E.FLIP_METRICS

        def per_seed(cs):
            if len(cs.seeds) == 1:
                return {sd: cs.first().value for sd in seeds}
            return {sd: e.value for sd, e in cs.seeds.items() if e.value is not None}

        order = sorted(cells, key=lambda m: cells[m].value if lower else -cells[m].value)
        steps = []
        for a, b in zip(order, order[1:]):
            va, vb = per_seed(cells[a]), per_seed(cells[b])
            common = sorted(set(va) & set(vb))
            gaps = [(vb[sd] - va[sd]) if lower else (va[sd] - vb[sd]) for sd in common]  # > 0: a ahead
            steps.append({"ahead": a, "behind": b, "seeds": common, "gaps": gaps,
                          "holds": bool(common) and all(g > 0 for g in gaps)})
        out.append({"scheme": scheme, "column": col, "order": order, "single_seed": single,
                    "cells": {m: (cells[m].value, cells[m].seed_sd, len(cells[m].seeds)) for m in order},
                    "steps": steps})
    return out


_MD_SPECIAL = str.maketrans({c: "\\" + c for c in "\\|`[]*"})   # (`_` is left: paths are full of it)


def md_text(value) -> str:
    """A stored string as Markdown shows it, never as markup: plain text (lrq.io.plain_text: line breaks made
    spaces, control characters and escape sequences removed), HTML's special characters escaped (a model path
    holding `<script>` stays text), and the characters of links, emphasis and tables escaped."""
    return html.escape(plain_text(value).translate(_MD_SPECIAL), quote=False)


def plain_row(r: Row) -> Row:
    """The row with the stored strings it names its cell by as plain text (`plain_text`), for the terminal and
    the HTML page."""
    return replace(r, model=plain_text(r.model), method=plain_text(r.method), scheme=plain_text(r.scheme),
                   dataset=plain_text(r.dataset), git_rev=plain_text(r.git_rev))


def _escaped(r: Row) -> Row:
    """The row with every stored string the report prints as Markdown-safe text."""
    cfg = dict(r.config or {})
    if cfg.get("model_note"):
        cfg["model_note"] = md_text(cfg["model_note"])
    return replace(r, model=md_text(r.model), method=md_text(r.method), scheme=md_text(r.scheme),
                   dataset=md_text(r.dataset), git_rev=md_text(r.git_rev), config=cfg)


def planned_vs_measured(rows: list[Row]) -> list[dict]:
    """Every stage a run priced before computing it (its `planned_time_s` row, bench.run.sweep.planned_rows)
    beside the wall time its unit took (the wall_s of the unit's other rows), in the rows' order."""
    from bench.run.sweep import PLANNED
    walls: dict[str, float] = {}
    resumed: dict[str, float] = {}
    peaks: dict[str, float] = {}
    for r in rows:
        if r.metric != PLANNED and r.wall_s is not None and r.unit_key:
            walls.setdefault(r.unit_key, float(r.wall_s))
        if r.metric == "resumed_blocks" and r.value:
            resumed[r.unit_key] = r.value
        if r.metric == "quant_peak_rss_bytes" and r.value:
            peaks[r.unit_key] = float(r.value)
    out = []
    for r in rows:
        if r.metric != PLANNED or r.value is None:
            continue
        plan = (r.config or {}).get("planned") or {}
        wall = walls.get(r.unit_key)
        out.append({"method": r.method, "scheme": r.scheme, "stage": plan.get("stage", r.dataset),
                    "planned_s": float(r.value), "measured_s": wall,
                    "ratio": wall / r.value if wall is not None and r.value > 0 else None,
                    "workers": plan.get("workers"), "machine": plan.get("machine"),
                    "resumed_blocks": resumed.get(r.unit_key), "priced_done": plan.get("done_blocks") or 0,
                    "planned_host_bytes": plan.get("host_bytes"), "measured_host_bytes": peaks.get(r.unit_key)})
    return out
