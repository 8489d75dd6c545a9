"""Markdown leaderboard from the results store: a summary of every cell, one table per scheme (FP row
first), then the details (perplexity protocol, paired comparisons with FP and RTN, seeds, quantization
cost, block reconstruction errors, accuracy per task, speed).

Every perplexity and accuracy is shown with its 95 % interval (bench.evaluations.stats); a column's best quantized
value is bold only when its paired comparison with the runner-up excludes no difference, otherwise the
tied leaders are marked ~ and a line under the table says so."""

from __future__ import annotations


import pandas as pd
from tabulate import tabulate

import statistics

from bench.reports.cells import (_escaped, _fmt_cmp, _fmt_seeds, _known, _order, _SCHEME_RANK, _seed_values,
                                 _style, _verdict, cell_stats, dataset_table, fmt_stat, FP, md_text, plain_row,
                                 planned_vs_measured, PRECISION_TEXT, precision_text, rows_frame,
                                 section_title, sections, seed_rankings, STATIC_ACTIVATIONS_NOTE,
                                 TASK_DATASETS)
from bench.evaluations import evals as E
from bench.evaluations import stats as S
from bench.common.store import Row
from lrq.errors import UserError
from lrq.schemes import SCHEMES


def _blocks_worse_lines(rows: list[Row]) -> list[str]:
    """The blocks whose training ended above its RTN start on the calibration samples it was trained on: a sign
    that the steps or the learning rate do not suit the model (a reader must not take such a cell as the
    method at its best). One line per cell that has any."""
    from lrq.engine import made_worse
    lines, seen = [], set()
    for r in rows:
        be = ((r.config or {}).get("method_stats") or {}).get("block_errors")
        if not be or (r.method, r.scheme) in seen:
            continue
        seen.add((r.method, r.scheme))
        ratio = {i: b["calib_after"] / max(b["calib_before"], 1e-30) for i, b in enumerate(be) if made_worse(b)}
        if ratio:
            w = max(ratio, key=ratio.get)
            lines.append(f"- {r.method} {r.scheme}: training ended with a higher calibration error than its RTN "
                         f"start in {len(ratio)} of {len(be)} blocks ({', '.join(map(str, ratio))}); the worst, "
                         f"block {w}: {be[w]['calib_before']:.4g} before, {be[w]['calib_after']:.4g} after "
                         f"({ratio[w]:.2f}x). Its steps or learning rate do not suit this model "
                         f"(`--set lr=...`, `--set iters=...`).")
    return ["Blocks that training made worse:", ""] + lines + [""] if lines else []


def _param_ratio(recon: pd.DataFrame) -> list[str]:
    """Learnable parameters of each method against the one it declares itself compared with
    (`Method.compare_learnables_with`), per scheme where both ran."""
    from lrq.methods import load_methods
    n = recon[recon["metric"] == "n_learnable"].groupby(["method", "scheme"])["value"].last()
    pairs = [(name, cls.compare_learnables_with) for name, cls in sorted(load_methods().items())
             if cls.compare_learnables_with]
    lines = []
    for scheme in sorted({s for _, s in n.index}):
        for a, b in pairs:
            if (a, scheme) in n.index and (b, scheme) in n.index:
                lines.append(f"- {scheme}: {a} / {b} learnable parameters = {n[(a, scheme)]:.0f} / "
                             f"{n[(b, scheme)]:.0f} = {n[(a, scheme)] / n[(b, scheme)]:.3f}")
    return lines + [""] if lines else []


def _task_section(mdf: pd.DataFrame, stats: dict) -> list[str]:
    """Accuracy per lm-eval task (the paper's metric per task), the zero-shot average, MMLU, each with its
    95 % interval; the best quantized value of a column bold only when separated from the runner-up."""
    from bench.evaluations.tasks import ALL_TASKS, MAIN_METRIC
    sub = mdf[mdf["dataset"].isin(TASK_DATASETS)]
    if sub.empty:
        return []
    tasks = [t for t in ALL_TASKS + ("zeroshot_avg",) if t in set(sub["dataset"])]
    cols = [(t, MAIN_METRIC.get(t, "acc") if t != "zeroshot_avg" else "acc",
             f"{t} ({MAIN_METRIC.get(t, 'acc')})" if t != "zeroshot_avg" else "zero-shot avg", "high") for t in tasks]
    table, verdicts = _leaderboard_table(_seed_values(sub.itertuples()), stats, sub[["method", "scheme"]].drop_duplicates(), cols)
    cfg = sub.iloc[-1]["config"].get("tasks", {})
    limit = cfg.get("limit")
    scope = "all examples" if not limit else f"the first {limit} examples per task" + (
        " (MMLU: per subject)" if "mmlu" in tasks else "")
    mmlu = ("; MMLU 5-shot, shots dropped last first while the prompt exceeds the max length"
            if "mmlu" in tasks else "")
    return ["### Task accuracy (lm-eval)", "",
            f"Accuracy in % with its 95 % interval, the LRQ paper's metric per task; bold only when separated "
            f"from the runner-up over the same examples, tied leaders ~. Batch size {cfg.get('batch_size', '?')}, "
            f"BOS token {'added' if cfg.get('add_bos_token') else 'not added'}, "
            f"max length {cfg.get('max_length', '?')}, {scope}{mmlu}.", "", table, "", *verdicts, ""]


def _speed_sections(mdf: pd.DataFrame) -> list[str]:
    """Inference speed (bench/studies/speed.py): end-to-end tokens/s and per-layer latency vs bf16."""
    parts: list[str] = []
    e2e = mdf[mdf["dataset"] == "speed_e2e"]
    if not e2e.empty:
        hw = e2e.iloc[-1]["config"]
        wide = e2e.pivot_table(index="scheme", columns="metric", values="value", aggfunc="last")
        def mib(v, digits):
            return "-" if v is None or v != v else f"{v / 2**20:.{digits}f} MiB"
        body = [[sch, f"{r.get('prefill_tok_s', float('nan')):.1f}", f"{r.get('decode_tok_s', float('nan')):.2f}",
                 mib(r.get("resident_weight_bytes"), 1), mib(r.get("peak_gpu_bytes"), 0)] for sch, r in wide.iterrows()]
        parts += ["### Inference speed (end to end)", "",
                  f"Prefill and greedy decode of the packed model vs bf16 ({md_text(hw.get('device', '?'))}); "
                  "weights held = every parameter and buffer plus the copies the GPU kernels made for themselves "
                  "(bench.studies.speed_e2e), peak = torch's allocator over the run.", "",
                  tabulate(body, headers=["scheme", "prefill tok/s", "decode tok/s", "weights held", "peak GPU memory"],
                           tablefmt="github", disable_numparse=True), ""]
    parts += _cpu_speed_section(mdf[mdf["dataset"] == "speed_e2e_cpu"])
    lay = mdf[(mdf["dataset"] == "speed_layers") & mdf["metric"].str.endswith(" ms")]
    if not lay.empty:
        body = []
        for _, r in lay.iterrows():
            c = r["config"]
            body.append([md_text(c.get("shape")), c.get("M"), r["scheme"], f"{r['value']:.3f}", f"{c.get('bf16_ms', 0):.3f}",
                         f"{c.get('bf16_ms', 0) / r['value']:.2f}x"])
        parts += ["### Per-layer latency", "", "Median forward time of one packed layer vs the bf16 linear it "
                  "replaces (ms); > 1x means faster than bf16.", "",
                  tabulate(body, headers=["shape", "M", "scheme", "ms", "bf16 ms", "speed-up"], tablefmt="github",
                           disable_numparse=True), ""]
    return parts


def _cpu_runtime(cfg: dict) -> str:
    """How a CPU speed row ran: its runtime (lean, hf eager; rows before it was recorded: hf eager), and a float32
    4-bit model's decode where it was not exact: through the bf16 kernel, or lrq.native's 16-bit integer one
    (`--fp32-decode bf16 / i16`)."""
    extra = {"bf16": " (4-bit float32 decode via bf16)",
             "i16": " (4-bit float32 decode: 16-bit integer activations)"}.get(cfg.get("float32_decode"), "")
    return cfg.get("runtime", "hf eager") + extra


def _cpu_speed_section(e2e: pd.DataFrame) -> list[str]:
    """The CPU speed study (bench.studies.speed_cpu): every format beside the dense model, interleaved."""
    if e2e.empty:
        return []
    cfg = e2e.iloc[-1]["config"]
    wide = e2e.pivot_table(index="scheme", columns="metric", values="value", aggfunc="last")
    how = {sch: c for sch, c in zip(e2e["scheme"], e2e["config"])}       # each scheme's last row: how it ran
    body = [[md_text(sch), md_text(how[sch].get("dtype", "?")), md_text(_cpu_runtime(how[sch])),
             f"{r.get('decode_ms', float('nan')):.1f}", f"{r.get('decode_vs_dense', float('nan')):.2f}x",
             f"{r.get('prefill_tok_s', float('nan')):.0f}", f"{r.get('prefill_vs_dense', float('nan')):.2f}x",
             f"{r.get('weight_rss_bytes', float('nan')) / 2**20:.0f} MiB"] for sch, r in wide.iterrows()]
    return ["### Inference speed on the CPU (end to end, interleaved)", "",
            f"Every format and the dense model in one process, measured in rotating rounds (medians), "
            f"{cfg.get('threads', '?')} thread(s); ratios against the faster dense model per measure; weight memory "
            f"as resident in the process (`python -m bench.studies.speed e2e`).", "",
            tabulate(body, headers=["candidate", "held in", "runtime", "decode ms/token", "decode vs dense",
                                    "prefill tok/s", "prefill vs dense", "weight memory"], tablefmt="github",
                     disable_numparse=True), ""]


def _leaderboard_cols(mdf: pd.DataFrame, stats: dict | None = None) -> list[tuple[str, str, str, str | None]]:
    """The summary's columns (bench.evaluations.evals.summary_columns) as (dataset, metric, header, "low"/"high"/None)."""
    present = set(zip(mdf["dataset"], mdf["metric"]))
    present |= {col for cols in (stats or {}).values() for col in cols}      # derived columns: flips
    better = {"lower": "low", "higher": "high", None: None}
    return [(c.dataset, c.metric, c.header, better[c.better]) for c in E.summary_columns(present)]


def _leaderboard_table(value: dict, stats: dict, keys: pd.DataFrame, cols) -> tuple[str, list[str]]:
    """One row per (method, scheme) of `keys`, FP first; every value with its interval where it has one,
    the best quantized value of a column bold only when separated from the runner-up, tied leaders ~.
    Returns the table and one verdict line per ranked column."""
    keys = _order(keys)
    ranked, verdicts = {}, []
    for ds, metric, header, better in cols:
        if better is None or not E.metric(metric).ranked:
            continue
        column = {(k["method"], k["scheme"]): stats.get((k["method"], k["scheme"]), {}).get((ds, metric))
                  for _, k in keys.iterrows() if k["method"] != FP}
        r = S.rank(column, better == "low")
        ranked[(ds, metric)] = r.marks
        line = _verdict(header, r, _style(metric))
        if line:
            verdicts.append(line)
    body, resumed = [], []
    for _, k in keys.iterrows():
        key = (k["method"], k["scheme"])
        line = [k["method"], k["scheme"]]
        for ds, metric, _, _ in cols:
            cs = stats.get(key, {}).get((ds, metric))
            txt = fmt_stat(cs) if cs is not None else _fmt_seeds(metric, value.get((*key, ds, metric)))
            mark = ranked.get((ds, metric), {}).get(key)
            if (ds, metric) == ("quant", "quant_time_s") and (marked := _quant_time_note(value, key)):
                txt += f" {marked[0]}"
                resumed.append(marked[1])
            line.append(f"**{txt}**" if mark == "best" else (f"{txt} ~" if mark == "tie" else txt))
        body.append(line)
    table = tabulate(body, headers=["method", "scheme"] + [c[2] for c in cols], tablefmt="github",
                     disable_numparse=True)
    return table, resumed + verdicts


RESUMED_MARK = "†"
UNRECORDED_MARK = "‡"


def _quant_time_note(value: dict, key: tuple[str, str]) -> tuple[str, str] | None:
    """(mark, note) for a cell whose quant time is not, or may not be, what the cell cost: resumed (†, with every
    block's time) or stored before resuming was recorded (‡); None for any other cell."""
    if note := _resumed_note(value, key):
        return RESUMED_MARK, note
    if note := _unrecorded_resume_note(value, key):
        return UNRECORDED_MARK, note
    return None


def _unrecorded_resume_note(value: dict, key: tuple[str, str]) -> str | None:
    """For a cell of a method that resumes from its finished blocks but whose result predates recording whether
    it did (no resumed_blocks): its quant time may be the last run's alone. None for any other cell."""
    from lrq.methods import method_class
    try:
        checkpoints = method_class(key[0]).checkpoints
    except UserError:   # a method this version does not know (or FP): nothing to say about it
        return None
    if not checkpoints or value.get((*key, "quant", "resumed_blocks")) \
            or not value.get((*key, "quant", "quant_time_s")):
        return None
    return (f"- {UNRECORDED_MARK} {key[0]} {key[1]}: stored before its cells recorded whether they resumed from "
            f"an earlier run's blocks (resumed_blocks), so its quant time may cover only the last run's blocks.")


def _resumed_note(value: dict, key: tuple[str, str]) -> str | None:
    """For a cell that continued from blocks an earlier run finished: why its quant time is not its cost, and
    the sum of every block's time over all the runs (lrq.blockwise.walk_time_stats); None for any other cell."""
    carried = value.get((*key, "quant", "resumed_blocks")) or {}
    per_seed = sorted(s for s, v in carried.items() if _known({s: v}) and v)
    if not per_seed:
        return None
    blocks = value.get((*key, "quant", "blocks_time_s")) or {}
    parts = []
    for seed in per_seed:
        total = blocks.get(seed)
        run = (value.get((*key, "quant", "quant_time_s")) or {}).get(seed)
        parts.append((f"seed {seed}: " if len(carried) > 1 else "")
                     + f"{carried[seed]:.0f} blocks came from earlier runs (possibly on other machines); "
                     + ("every block's time summed over all the runs: "
                        f"{total:,.0f} s" if total is not None and not pd.isna(total)
                        else "their times were not stored (a result from before blocks_time_s)")
                     + (f", the last run {run:,.0f} s" if run is not None and not pd.isna(run) else ""))
    return (f"- {RESUMED_MARK} {key[0]} {key[1]}: a resumed cell, so its quant time is the last run's alone, "
            f"not what the cell cost: " + "; ".join(parts) + ".")


def _leaderboard_sections(mdf: pd.DataFrame, stats: dict) -> list[str]:
    cols = _leaderboard_cols(mdf, stats)
    if not cols:
        return []
    cells = mdf[~mdf["dataset"].str.startswith("speed_")][["method", "scheme"]].drop_duplicates()
    evaluated = set(zip(*[mdf.loc[mdf["dataset"] != "quant", c] for c in ("method", "scheme")]))
    leftover = [f"{m} {s}" for m, s in cells.itertuples(index=False) if (m, s) not in evaluated]
    cells = cells[[(m, s) in evaluated for m, s in cells.itertuples(index=False)]]
    if cells.empty:
        return []
    fp = cells[cells["method"] == FP]
    value = _seed_values(mdf.itertuples())
    table, verdicts = _leaderboard_table(value, stats, cells, cols)
    parts = ["### Summary", "", "Every cell. " + E.method_text() + " The evaluation settings are under Details.", "",
             table, "", *verdicts, ""]
    if leftover:
        parts += [f"Not shown: {', '.join(leftover)}: quantized, but no evaluation of theirs is stored (an "
                  f"interrupted run; rerunning the same command completes them).", ""]
    schemes = sorted({s for s in cells["scheme"] if s != FP}, key=lambda s: (_SCHEME_RANK.get(s, 99), s))
    for scheme in schemes:
        keys = pd.concat([fp, cells[cells["scheme"] == scheme]])
        desc = SCHEMES[scheme].description + "." if scheme in SCHEMES else ""
        if scheme in SCHEMES and SCHEMES[scheme].static_activations:
            desc += STATIC_ACTIVATIONS_NOTE
        table, verdicts = _leaderboard_table(value, stats, keys, cols)
        parts += [f"### Scheme {scheme}", ""] + ([desc, ""] if desc else []) + [table, ""] + verdicts + [""]
    return parts


def _paired_section(stats: dict, datasets: list[str]) -> list[str]:
    """Each quantized cell against FP and against RTN at the same scheme, over the same windows / examples."""
    cols = [(d, "ppl") for d in datasets] + ([("zeroshot_avg", "acc")] if any(
        ("zeroshot_avg", "acc") in v for v in stats.values()) else [])
    if not cols:
        return []
    fp = stats.get((FP, FP), {})
    body = []
    for key in sorted(k for k in stats if k[0] != FP):
        rtn = stats.get(("rtn", key[1]), {})
        line = [key[0], key[1]]
        for col in cols:
            cs = stats[key].get(col)
            pct = col[1] != "ppl"
            line.append(_fmt_cmp(S.compare(cs, fp[col]) if cs and col in fp else None, pct))
            line.append("-" if key[0] == "rtn" else _fmt_cmp(S.compare(cs, rtn[col]) if cs and col in rtn else None, pct))
        body.append(line)
    heads = ["method", "scheme"]
    for d, m in cols:
        name = "zero-shot avg" if d == "zeroshot_avg" else f"{d} ppl"
        heads += [f"{name} vs FP", f"{name} vs RTN"]
    return ["### Paired comparisons with FP and RTN", "",
            "Perplexity: the ratio to FP and to RTN at the same scheme over the same windows; zero-shot average: "
            "the difference in points over the same examples; 95 % intervals; * marks an interval that excludes "
            "no difference. With several seeds on both sides the comparison is over seeds.", "",
            tabulate(body, headers=heads, tablefmt="github", disable_numparse=True), ""]


def _kl_section(mdf: pd.DataFrame, stats: dict, datasets: list[str]) -> list[str]:
    """Every quantized cell's KL divergence from the FP model on each text: mean (with its interval over
    windows), median and 99th percentile over positions, top-1 agreement; and the paired KLD difference to RTN
    at the same scheme."""
    kl = mdf[mdf["metric"].isin(E.KL_METRICS)]
    if kl.empty:
        return []
    vals = _seed_values(kl.itertuples())
    body = []
    for key in sorted(k for k in stats if k[0] != FP):
        line = [key[0], key[1]]
        for d in datasets:
            for m in E.KL_METRICS:   # the catalogue's order: with an interval where it has one, else over seeds
                st = stats[key].get((d, m)) if E.METRICS[m].interval else None
                line.append(fmt_stat(st) if st else "-" if E.METRICS[m].interval else
                            _fmt_seeds(m, vals.get((*key, d, m))))
            cs, rtn = stats[key].get((d, "kld")), stats.get(("rtn", key[1]), {}).get((d, "kld"))
            line.append("-" if key[0] == "rtn" or not (cs and rtn) else _fmt_cmp(S.compare(cs, rtn), "diff"))
        body.append(line)
    heads = ["method", "scheme"]
    for d in datasets:
        heads += [f"{d} {E.METRICS[m].column}" for m in E.KL_METRICS] + [f"{d} KLD - RTN's"]
    cfg = kl.iloc[-1]["config"].get("kl", {})
    return ["### KL divergence from the FP model", "",
            f"Per predicted position, KL(P_FP || P_quantized) over the whole vocabulary in nats, on the perplexity "
            f"windows, exact: the FP logits are recomputed from the FP model's stored final hidden states and output "
            f"head with the same operations (approximation: {cfg.get('approximation', '?')}; against KL from both "
            f"models side by side: reports/kl/kl_approx.md). Mean with its 95 % interval over "
            f"windows (positions inside a window are correlated: each window's mean is one observation), median and "
            f"99th percentile over positions, top-1 agreement = the share of positions where both models' most "
            f"likely next token is the same. The last column: the paired difference to RTN at the same scheme over "
            f"the same windows; * marks an interval that excludes no difference.", "",
            tabulate(body, headers=heads, tablefmt="github", disable_numparse=True), ""]


def _flips_section(stats: dict) -> list[str]:
    """Flips against the FP model per task: the share of examples whose answer changed, right to wrong and
    wrong to right apart, with Wilson intervals."""
    from bench.evaluations.tasks import MAIN_METRIC
    tasks = [t for t in E.ALL_TASKS if any((t, "flips") in v for v in stats.values())]
    if not tasks:
        return []
    body = []
    seven = any(("flips", "flips") in v for v in stats.values())
    for key in sorted(k for k in stats if k[0] != FP):
        if not any((t, "flips") in stats[key] for t in tasks):
            continue
        line = [key[0], key[1]]
        for t in tasks:
            a, b, tot = (stats[key].get((t, k)) for k in E.FLIP_KINDS + (E.FLIPS,))
            if a and b and tot:
                e, n = tot.first(), tot.first().n
                line.append(f"{100 * e.value:.1f} [{100 * e.lo:.1f}, {100 * e.hi:.1f}] "
                            f"({round(a.value * n)} r->w, {round(b.value * n)} w->r of {n})")
            else:
                line.append("-")
        zs = stats[key].get(("flips", "flips"))
        if seven:
            e = zs.first() if zs else None
            line.append("-" if e is None else fmt_stat(zs) if len(zs.seeds) > 1 else
                        f"{100 * e.value:.1f} [{100 * e.lo:.1f}, {100 * e.hi:.1f}] (n={e.n})")
        body.append(line)
    metric_note = ", ".join(f"{t}: {MAIN_METRIC.get(t, 'acc')}" for t in tasks)
    return ["### Flips against the FP model", "",
            "Per task, the share of examples (%) whose answer changed against the FP model on the same examples, "
            "with its 95 % Wilson interval, and the counts right to wrong (r->w) and wrong to right (w->r) (Dutta et "
            "al., \"Accuracy is Not All You Need\", 2024): flips move even where accuracy does not. An answer is "
            f"each task's main metric's ({metric_note}); on the other metric the same examples can flip otherwise."
            + (" Last column: the flips of all examples of the seven zero-shot tasks pooled, with its Wilson "
               "interval." if seven else ""), "",
            tabulate(body, headers=["method", "scheme"] + tasks + (["zero-shot flips %"] if seven else []),
                     tablefmt="github", disable_numparse=True), ""]


def _seeds_section(stats: dict) -> list[str]:
    body = []
    for key in sorted(stats):
        for (ds, metric), cs in sorted(stats[key].items()):
            if len(cs.seeds) > 1:
                per = "; ".join(f"seed {sd}: {fmt_stat(S.CellStat(cs.kind, {sd: e}, metric=cs.metric))}" for sd, e in sorted(cs.seeds.items()))
                body.append([key[0], key[1], f"{ds} {metric}", fmt_stat(cs), per])
    if not body:
        return []
    return ["### Seeds", "", "Cells run with several seeds (independent calibration draws and initialisations): the "
            "mean +- standard deviation over seeds beside each seed's own value and 95 % interval.", "",
            tabulate(body, headers=["method", "scheme", "column", "over seeds", "per seed"], tablefmt="github",
                     disable_numparse=True), ""]


def _seed_rankings_section(stats: dict, seedless: set) -> list[str]:
    ranks = seed_rankings(stats, seedless)
    if not ranks:
        return []
    body = []
    for r in ranks:
        metric = r["column"][1]
        f = E.metric(metric).format
        cells = []
        for m in r["order"]:
            v, sd, k = r["cells"][m]
            cells.append(f"{m} {f(v)}" + (f" +-{f(sd)}" if sd is not None else " (1 seed)"))
        links = []
        for st in r["steps"]:
            g = st["gaps"]
            mean = sum(g) / len(g) if g else float("nan")
            sd = (sum((x - mean) ** 2 for x in g) / (len(g) - 1)) ** 0.5 if len(g) > 1 else None
            gap = f"{f(mean)}" + (f" +-{f(sd)}" if sd is not None else "")
            links.append(f"{st['ahead']} > {st['behind']}: {gap} ({'all' if st['holds'] else 'not all'} "
                         f"{len(st['seeds'])} seeds)")
        name = "zero-shot avg %" if r["column"][0] == "zeroshot_avg" else f"{r['column'][0]} {r['column'][1]}"
        body.append([r["scheme"], name, "; ".join(cells), "; ".join(links), ", ".join(r["single_seed"]) or "-"])
    return ["### Rankings across seeds", "",
            "Per scheme and column, the methods in order of their mean over seeds (+- standard deviation over "
            "seeds), and for each neighbour the gap to the next one (mean +- sd of the per-seed gaps, seeds matched "
            "by number; positive: ahead) and whether it is ahead on all seeds. A calibration-free cell has one "
            "seed and counts as the same on every seed; cells that depend on calibration but ran with one seed "
            "are left out of the order (last column).", "",
            tabulate(body, headers=["scheme", "column", "order (mean over seeds)", "gap to the next, over seeds",
                                    "left out (one seed)"],
                     tablefmt="github", disable_numparse=True), ""]


def _ppl_protocol(mdf: pd.DataFrame, ds: str) -> str:
    ev = mdf[(mdf["dataset"] == ds) & (mdf["metric"] == "ppl")].iloc[-1]["config"].get("eval", {})
    n = ev.get('windows', '?')
    start = ("each starting with the model's BOS token, then the next tokens of the text" if ev.get("bos") else
             "cut from the text's token stream, no BOS")
    return (f"- {ds}: {n} window{'' if n == 1 else 's'} of {ev.get('seq_len', '?')} tokens {start} "
            f"({ev.get('tokens', '?')} tokens in all, last partial window "
            f"{'included' if ev.get('include_partial') else 'dropped'}, "
            f"{PRECISION_TEXT.get(ev.get('autocast'), ev.get('autocast', '?'))}), exp(mean window NLL).")


def markdown_report(rows: list[Row]) -> str:
    if not rows:
        return "# lrq-bench leaderboard\n\nThe results store is empty: run `lrq-bench run` first.\n"
    rows = [_escaped(r) for r in rows]
    parts = ["# lrq-bench leaderboard", ""]
    for (model, prec), srows in sections(rows).items():
        parts += [f"## {section_title(model, prec)}", ""] + markdown_section(srows, prec)
    return "\n".join(parts)


def markdown_section(srows: list[Row], prec: str) -> list[str]:
    """One model and precision's part of the leaderboard as Markdown lines, below its title: the notes, where
    it was measured, the summary and per-scheme tables, then "## Details". The HTML leaderboard renders the same
    lines, so that it shows everything the Markdown shows. `srows` are Markdown-escaped rows (`_escaped`)."""
    mdf = rows_frame(srows)
    parts: list[str] = []
    notes = {r["config"].get("model_note") for _, r in mdf.iterrows() if r["config"].get("model_note")}
    parts += [f"> {n}" for n in sorted(notes)] + ([""] if notes else [])
    from bench.common.provenance import cpu_label
    machines = sorted({md_text(cpu_label(r.hardware)) for r in srows if isinstance(r.hardware, dict)
                       and r.hardware.get("cpu") and not r.hardware.get("gpu")}
                      | {md_text(r.hardware["gpu"]) for r in srows if isinstance(r.hardware, dict) and r.hardware.get("gpu")})
    if machines:
        parts += [f"Measured on: {'; '.join(machines)}.", ""]
    why = {(r.config.get("precision") or {}).get("why") for r in srows if isinstance(r.config.get("precision"), dict)}
    parts += [f"Precision of every number in this section: {precision_text(prec)}"
              + (f" ({'; '.join(sorted(md_text(w) for w in why if w))})" if any(why) else
                 " (stored before the precision was recorded: perplexity under bf16 autocast)") + ".", ""]
    parts += older_versions(srows)
    stats = cell_stats(srows)
    parts += _leaderboard_sections(mdf, stats)
    from bench.run.sweep import PLANNED
    measured = set(mdf.loc[mdf["metric"] != PLANNED, "dataset"])   # a price alone is no text
    ppl_sets = [d for d in ("wikitext2", "c4") if d in measured] + sorted(
        d for d in measured - {"wikitext2", "c4", "quant"} if not d.startswith("speed_") and d not in TASK_DATASETS)
    parts += [DETAILS, ""]
    with_ppl = [d for d in ppl_sets if d in set(mdf.loc[mdf["metric"] == "ppl", "dataset"])]
    if with_ppl:
        parts += ["### Perplexity protocol", ""] + [_ppl_protocol(mdf, d) for d in with_ppl] + [""]
    parts += _kl_section(mdf, stats, [d for d in ppl_sets if (d, "kld") in set(zip(mdf["dataset"], mdf["metric"]))])
    parts += _paired_section(stats, with_ppl)
    parts += _seeds_section(stats)
    calibrated = {(r.method, r.scheme) for r in srows if (r.config or {}).get("calibration")}
    seedless = {(r.method, r.scheme) for r in srows} - calibrated
    parts += _seed_rankings_section(stats, seedless)
    if "quant" in set(mdf["dataset"]):
        parts += ["### Quantization cost", "", "Wall time and peak resident memory of the quantization step; "
                  "bits per weight include scales and zero points. For block-wise methods, blocks_time_s sums "
                  "every block's time, including blocks an interrupted earlier run finished (resumed_blocks).",
                  "", dataset_table(mdf, "quant", E.table_metrics("cost")), ""]
    parts += planned_section(srows)
    recon = mdf[(mdf["dataset"] == "quant") & mdf["metric"].isin(E.table_metrics("recon"))]
    if not recon.empty:
        parts += ["### Block reconstruction (LRQ paper, Figure 2)", "",
                  "Learnable scale parameters, and each block's output error (the reconstruction loss) averaged "
                  "over blocks, on the calibration samples it was trained on and on held-out samples it never "
                  "saw, before (RTN start) and after training. FlexRound should fit the calibration set better; "
                  "LRQ should generalize better.", "",
                  dataset_table(mdf, "quant", E.table_metrics("recon")), ""]
        parts += _param_ratio(recon)
        parts += _blocks_worse_lines(srows)
    parts += _task_section(mdf, stats)
    parts += _flips_section(stats)
    parts += _speed_sections(mdf)
    from bench.common.provenance import short_revision
    revs = sorted(set(mdf["git_rev"]))
    parts += [f"Git revisions: {', '.join(short_revision(r) for r in revs)}. Full configuration of every number: "
              f"`lrq-bench results --json`.", ""]
    return parts + _block_revisions(srows)


def _block_revisions(rows: list[Row]) -> list[str]:
    """Per block-wise cell whose blocks recorded what made them: every revision its blocks came from (a cell
    resumed across machines and code revisions), with the blocks each made."""
    from bench.common.provenance import short_revision
    lines = []
    for r in rows:
        made = ((r.config or {}).get("method_stats") or {}).get("block_revisions")
        if r.dataset == "quant" and r.metric == "bits_per_weight" and isinstance(made, dict) and made:
            spans = "; ".join(f"{short_revision(md_text(rev))} (blocks {_spans(blocks)})" for rev, blocks in made.items())
            lines.append(f"- {r.method} {r.scheme}: {spans}")
    return (["Revisions the blocks of block-wise cells came from:", "", *lines, ""]) if lines else []


def _spans(blocks: list[int]) -> str:
    """1, 2, 3, 7 -> '1-3, 7'."""
    out, start = [], None
    for i, b in enumerate(blocks):
        if start is None:
            start = b
        if i + 1 == len(blocks) or blocks[i + 1] != b + 1:
            out.append(f"{start}-{b}" if b != start else f"{b}")
            start = None
    return ", ".join(out)


DETAILS = "## Details"


def planned_section(rows: list[Row]) -> list[str]:
    """The planner's price of each stage beside the time it took, with the share within 25 %."""
    from bench.run.plan import fmt_duration
    items = planned_vs_measured(rows)
    if not items:
        return []
    order = {"quant": 0, "tasks": 2}
    items.sort(key=lambda it: (it["method"] != "fp", it["method"], it["scheme"], order.get(it["stage"], 1)))
    dur = lambda x: f"{x:.2g} s" if x < 10 else fmt_duration(x)    # noqa: E731
    body, ratios = [], []
    for it in items:
        ratio, carried = it["ratio"], it["resumed_blocks"] or 0
        # a resumed stage compares with its price only where the price left out the blocks it did not compute
        if ratio is not None and carried == it["priced_done"]:
            ratios.append(ratio)
        body.append([it["method"], it["scheme"], it["stage"], dur(it["planned_s"]),
                     "-" if it["measured_s"] is None else dur(it["measured_s"]),
                     "-" if ratio is None else f"{ratio:.2f}"
                     + ((f" (resumed: {carried:.0f} blocks came from an earlier run"
                         + (", priced as such)" if carried == it["priced_done"] else
                            f"; priced with {it['priced_done']:.0f} of them done, so not comparable)"))
                        if carried else ""),
                     _planned_memory(it), it["workers"] or "-", md_text(it["machine"] or "-")])
    within = sum(0.8 <= x <= 1.25 for x in ratios)
    median = statistics.median(ratios) if ratios else None
    head = ("The planner's estimate of each stage, announced before the run computed it and stored with its "
            "result, beside the wall time the stage took (measured / planned: above 1, slower than planned). Wall "
            "time also counts the time other processes held the cores: with several workers or other work on the "
            "machine, expect ratios above 1. Not priced: process start-up, model loading and lm-eval's set-up, "
            "which dominate stages of seconds (a small model's). The quantization stage of the first cell that "
            "needs a text's KL reference is priced with that reference's FP pass, which costs nothing where it is "
            "cached. Host memory: the planner's estimate of the quantization's peak (what `run` checks before "
            "starting a cell) beside the peak resident memory measured during it, which also holds whatever the "
            "process kept from the steps before (the model, the KL reference pass).")
    summary = (f"{within} of {len(ratios)} stages within 25 % of their estimate (measured / planned between 0.8 "
               f"and 1.25); median ratio {median:.2f}." if ratios else "")
    return (["### Planned and measured time", "", head, ""] + ([summary, ""] if summary else [])
            + [tabulate(body, headers=["method", "scheme", "stage", "planned", "measured", "measured / planned",
                                       "host memory: planned / measured", "workers", "planned on"],
                        tablefmt="github", disable_numparse=True), ""])


def _planned_memory(item: dict) -> str:
    """'planned / measured GiB (ratio)' of a quantization stage's peak host memory, '-' where either is missing."""
    planned, measured = item.get("planned_host_bytes"), item.get("measured_host_bytes")
    if not planned or not measured:
        return "-"
    gib = 2**30
    return f"{planned / gib:.2f} / {measured / gib:.2f} GiB ({measured / planned:.2f})"


def older_versions(rows: list[Row]) -> list[str]:
    """A warning naming the cells computed by an older version of their method's or evaluation's code than this
    checkout's (a row without a recorded version is version 1: stored before versions existed). Their numbers
    are shown as they were measured, marked as older; a rerun computes them anew (another version is another
    cell)."""
    from bench.run.cell import eval_versions
    from lrq.methods import method_class
    now_eval = eval_versions()
    older: dict[tuple[str, str], set[str]] = {}
    for r in rows:
        cfg = r.config if isinstance(r.config, dict) else {}
        what = set()
        if r.method != "fp":
            try:
                current = method_class(r.method).version
            except Exception:   # a name derived from a checkpoint (external:...), or a method no longer here
                current = None
            stored = cfg.get("method_version") or 1
            if current is not None and stored != current:
                what.add(f"{r.method} v{stored}, now v{current}")
        for name, v in (cfg.get("eval_versions") or {"perplexity": 1, "tasks": 1}).items():
            kind = "tasks" if r.dataset in TASK_DATASETS else E.metric(r.metric).evaluation
            if name == kind and name in now_eval and v != now_eval[name]:
                what.add(f"{name} v{v}, now v{now_eval[name]}")
        if what:
            older.setdefault((r.method, r.scheme), set()).update(what)
    if not older:
        return []
    cells = "; ".join(f"{m} {s} ({', '.join(sorted(w))})" for (m, s), w in sorted(older.items()))
    return [f"> **Older code versions:** {cells}. These numbers were computed by an earlier version of the code "
            f"named, and are shown as measured then; `lrq-bench run` with the same options computes them with "
            f"this version (another version is another cell).", ""]


def terminal_summary(rows: list[Row], width: int = 120) -> str:
    """What `run` prints at its end: one line per cell (method, scheme, precision, bits per weight, then per text
    KLD, top-1 agreement and perplexity with their 95 % intervals), as narrow as the values allow and never wider
    than `width` (texts beyond what fits are left to the leaderboard files, and the summary says so). The
    leaderboard files hold everything else (tasks, flips, paired comparisons, block errors, provenance)."""
    from tabulate import tabulate
    if not rows:
        return "no results for this run's cells."
    rows = [plain_row(r) for r in rows]
    stats = cell_stats(rows)
    bits = {(r.method, r.scheme): r.value for r in rows if r.metric == "bits_per_weight" and r.value is not None}
    prec = {(r.method, r.scheme): r.precision for r in rows}
    texts = [d for d in E.PERPLEXITY if any(r.dataset == d and r.metric == "ppl" for r in rows)]
    keys = sorted({(r.method, r.scheme) for r in rows}, key=lambda k: (k[0] != "fp", k[1], k[0]))

    def cell(cs, kind):
        if cs is None:
            return "-"
        if kind == "ppl":
            f = lambda v: f"{v:.2f}" if v < 1000 else f"{v:.4g}"  # noqa: E731
        elif kind == "top1":
            f = lambda v: f"{100 * v:.1f}"  # noqa: E731
        else:
            f = lambda v: f"{v:.4f}" if v < 10 else f"{v:.3g}"  # noqa: E731
        if len(cs.seeds) > 1:   # several seeds: their mean and spread, never one seed's value as the cell's
            return f"{f(cs.value)} +-{f(cs.seed_sd)} ({len(cs.seeds)} seeds)"
        e = cs.first()
        return f"{f(e.value)} [{f(e.lo)}, {f(e.hi)}]" if e.known and e.lo is not None else f(e.value)

    def table(shown):
        head = ["method", "scheme", "prec", "bits"]
        for d in shown:
            head += [f"{d} KLD", f"{d} top-1 %", f"{d} ppl"]
        body = []
        for k in keys:
            st = stats.get(k, {})
            line = [k[0], k[1], prec.get(k, ""), f"{bits[k]:.2f}" if k in bits else "-"]
            for d in shown:
                line += [cell(st.get((d, "kld")), "kld"), cell(st.get((d, "top1_agree")), "top1"),
                         cell(st.get((d, "ppl")), "ppl")]
            body.append(line)
        return tabulate(body, headers=head, tablefmt="simple", disable_numparse=True)

    shown = list(texts)
    out = table(shown)
    while len(shown) > 1 and max(len(line) for line in out.splitlines()) > width:
        shown.pop()
        out = table(shown)
    left = [d for d in texts if d not in shown]
    note = "95 % intervals over windows in brackets; +- a standard deviation over seeds"
    if left:
        note += f"; {', '.join(left)} in the leaderboard files (too wide for {width} columns)"
    import textwrap
    return out + "\n" + textwrap.fill(note + ".", width=width)
