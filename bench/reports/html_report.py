"""Self-contained HTML leaderboard (Jinja2): everything the Markdown leaderboard shows, plus charts and
provenance tooltips.

No network is needed to view it: styles, the table-sorting script and the charts (SVG drawn here) are
inline. The Markdown leaderboard's lines of each model (summary, per-scheme tables, KLD and top-1, paired
comparisons, tasks, flips, seeds, cost, block errors, speed, all with their intervals) are rendered here by
markdown-it, so the page cannot drift from it. Added: charts per scheme (perplexity, KLD, top-1 agreement,
one colour per method, the FP model as a reference line), per-text perplexity tables whose every value
carries its configuration (method settings, calibration, scheme, versions, hardware, git revision) in a
`title` tooltip, the per-block calibration vs held-out error of block reconstruction (LRQ paper, Figure 2),
and, where a cell was measured by several git revisions, its history.
"""

from __future__ import annotations

import html
import math
from collections import defaultdict
from pathlib import Path

from jinja2 import Environment, select_autoescape

from bench.evaluations import evals as E
from bench.common.provenance import short_revision
from bench.common.store import Row
from lrq.io import dumps_json

PALETTE = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf", "#7f7f7f"]


def _prov(r: Row) -> str:
    c = r.config or {}
    keep = {k: c.get(k) for k in ("method_config", "calibration", "scheme_def", "eval", "preset", "seed", "precision")
            if c.get(k) is not None}
    keep.update({"git_rev": r.git_rev, "versions": {k: v for k, v in (r.versions or {}).items()
                                                      if k in ("torch", "transformers", "lrq-bench", "python")},
                 "hardware": {k: (r.hardware or {}).get(k) for k in ("cpu", "cpu_kind", "cpu_count", "gpu")},
                 "created_at": r.created_at})
    return dumps_json(keep, indent=1, default=str)


def _fmt(metric: str, v) -> str:
    """A value in its metric's format (the catalogue: bench.evaluations.evals)."""
    return E.metric(metric).format(v)


def scheme_chart(points: list[tuple], schemes: list[tuple[str, float | None]], ylabel: str, logy: bool = True,
                 ref: tuple[float, str] | None = None, width: int = 720, height: int = 360) -> str:
    """A small inline SVG chart of one value per (method, scheme): schemes along x in the given order (each
    labelled with its name and bits per weight: w4a16 and w4a8 share 4.029 bits and would hide each other on a
    bits axis), methods side by side inside a scheme, one colour per method with a legend; a 95 % interval as
    an error bar; every point's tooltip names the method, the scheme, its bits and the value with its interval.
    points: (method, scheme, y) or (method, scheme, y, lo, hi). `ref` (value, label): a dashed reference line
    (the FP model: its perplexity, or KLD 0). Ticks are round numbers on either axis."""
    pts = [(p[0], p[1], p[2], *(p[3:5] if len(p) >= 5 else (None, None))) for p in points]
    pts = [p for p in pts if p[2] is not None and math.isfinite(p[2]) and (p[2] > 0 or not logy)]
    order = [s for s, _ in schemes if any(p[1] == s for p in pts)]
    bits = dict(schemes)
    if not pts or not order:
        return ""
    methods = sorted({p[0] for p in pts}, key=lambda m: (m != "fp", m))
    color = {m: PALETTE[i % len(PALETTE)] for i, m in enumerate(methods)}
    tx = (lambda v: math.log10(v)) if logy else (lambda v: v)  # noqa: E731
    vals = [v for p in pts for v in (p[2], p[3], p[4]) if v is not None and (v > 0 or not logy)]
    if ref is not None and (ref[0] > 0 or not logy):
        vals.append(ref[0])
    lo_v, hi_v = min(vals), max(vals)
    y0, y1 = tx(lo_v), tx(hi_v)
    if y1 - y0 < 1e-9:
        y0, y1 = y0 - 0.5, y1 + 0.5
    pad = (y1 - y0) * 0.06
    y0, y1 = y0 - pad, y1 + pad
    L, R, T, B = 64, 120, 15, 52
    pw = width - L - R
    slot = pw / len(order)
    sy = lambda v: height - B - (tx(v) - y0) / (y1 - y0) * (height - T - B)  # noqa: E731
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" role="img" '
           f'aria-label="{html.escape(ylabel)} per scheme">',
           f'<rect x="{L}" y="{T}" width="{pw}" height="{height - T - B}" fill="none" stroke="#999"/>']
    ticks = log_ticks(10 ** y0, 10 ** y1) if logy else nice_ticks(y0, y1, 6)
    for v in ticks:
        out.append(f'<text class="ytick" x="{L - 6}" y="{sy(v) + 4:.1f}" font-size="10" text-anchor="end">{v:g}</text>'
                   f'<line x1="{L - 3}" x2="{L + pw}" y1="{sy(v):.1f}" y2="{sy(v):.1f}" stroke="#eee"/>')
    for i, s in enumerate(order):
        cx = L + slot * (i + 0.5)
        if i:
            out.append(f'<line x1="{L + slot * i:.1f}" x2="{L + slot * i:.1f}" y1="{T}" y2="{height - B}" stroke="#ddd"/>')
        out.append(f'<text class="xtick" x="{cx:.1f}" y="{height - B + 15}" font-size="11" text-anchor="middle">'
                   f'{html.escape(s)}</text>')
        if bits.get(s) is not None:
            out.append(f'<text x="{cx:.1f}" y="{height - B + 28}" font-size="10" fill="#555" text-anchor="middle">'
                       f'{bits[s]:.3f} b/w</text>')
    out.append(f'<text x="{L + pw / 2}" y="{height - 6}" font-size="11" text-anchor="middle">scheme (bits per '
               f'weight, with scales and zero points)</text>')
    out.append(f'<text x="13" y="{(T + height - B) / 2}" font-size="11" text-anchor="middle" '
               f'transform="rotate(-90 13 {(T + height - B) / 2})">{html.escape(ylabel)}{" (log)" if logy else ""}'
               f'</text>')
    if ref is not None and (ref[0] > 0 or not logy):
        out.append(f'<line class="ref" x1="{L}" x2="{L + pw}" y1="{sy(ref[0]):.1f}" y2="{sy(ref[0]):.1f}" '
                   f'stroke="#555" stroke-dasharray="5 4"><title>{html.escape(ref[1])}</title></line>'
                   f'<text x="{L + pw - 4}" y="{sy(ref[0]) - 4:.1f}" font-size="10" text-anchor="end">'
                   f'{html.escape(ref[1])}</text>')
    step = min(14.0, slot / (len(methods) + 1))
    for m, s, y, lo, hi in pts:
        if s not in order:
            continue
        cx = L + slot * (order.index(s) + 0.5) + (methods.index(m) - (len(methods) - 1) / 2) * step
        if lo is not None and hi is not None and (lo > 0 or not logy):
            out.append(f'<line class="errorbar" x1="{cx:.1f}" x2="{cx:.1f}" y1="{sy(lo):.1f}" y2="{sy(hi):.1f}" '
                       f'stroke="{color[m]}" stroke-width="1.2"/>')
        ci = f" (95 %: {lo:.4g}-{hi:.4g})" if lo is not None and hi is not None else ""
        b = f", {bits[s]:.3f} bits/weight" if bits.get(s) is not None else ""
        out.append(f'<circle class="pt" cx="{cx:.1f}" cy="{sy(y):.1f}" r="4" fill="{color[m]}" data-method="'
                   f'{html.escape(m)}" data-scheme="{html.escape(s)}"><title>{html.escape(m)} {html.escape(s)}{b}: '
                   f'{y:.4g}{ci}</title></circle>')
    for i, m in enumerate(methods):
        out.append(f'<circle cx="{width - R + 14}" cy="{T + 10 + 16 * i}" r="4" fill="{color[m]}"/>'
                   f'<text x="{width - R + 22}" y="{T + 14 + 16 * i}" font-size="11">{html.escape(m)}</text>')
    out.append("</svg>")
    return "".join(out)


def log_ticks(lo: float, hi: float) -> list[float]:
    """Round ticks for a log axis over [lo, hi] (> 0): 1, 2, 5 x 10^k where at least three fall inside, else
    round linear steps (13.5 to 20 gives 14, 16, 18, 20, not 13.5, 15.1, 16.9)."""
    if lo <= 0 or hi <= lo:
        return [lo] if lo > 0 else []
    k0, k1 = math.floor(math.log10(lo)), math.ceil(math.log10(hi))
    ticks = [m * 10.0 ** k for k in range(k0, k1 + 1) for m in (1, 2, 5) if lo <= m * 10.0 ** k <= hi]
    if len(ticks) >= 3:
        return [float(f"{t:.12g}") for t in ticks]
    return [t for t in nice_ticks(lo, hi) if t > 0]


def nice_ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    """Round tick values (steps of 1, 2 or 5 x 10^k) inside [lo, hi], about n of them."""
    span = hi - lo
    if span <= 0:
        return [lo]
    raw = span / max(n - 1, 1)
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 5, 10) if m * mag >= raw)
    first = math.ceil(lo / step) * step
    return [round(first + i * step, 12) for i in range(int((hi - first) / step + 1e-9) + 1)]


def scheme_order(names) -> list[str]:
    """Schemes by weight bits, then group size (per channel first), then activation bits (not alphabetically)."""
    from lrq.schemes import SCHEMES

    def key(name):
        sc = SCHEMES.get(name)
        return (sc.w_bits, sc.group_size or 0, sc.a_bits or 16, name) if sc else (99, 0, 99, name)
    return sorted(names, key=key)


def lines_svg(series: dict[str, list[float]], xlabel: str, ylabel: str, width: int = 560, height: int = 300,
              index_ticks: bool = False) -> str:
    """series name -> y per index (a block, a recorded step); log-scale y with round ticks; `index_ticks`: label
    the x axis with round indices (where x is the index itself, as for blocks)."""
    vals = [v for ys in series.values() for v in ys if v and v > 0]
    if not vals:
        return ""
    names = sorted(series)
    color = {s: PALETTE[i % len(PALETTE)] for i, s in enumerate(names)}
    n = max(len(v) for v in series.values())
    y0, y1 = math.log10(min(vals)), math.log10(max(vals))
    if y1 - y0 < 1e-9:
        y0, y1 = y0 - 0.5, y1 + 0.5
    L, R, T, B = 60, 220, 15, 40
    sx = lambda i: L + i / max(n - 1, 1) * (width - L - R)  # noqa: E731
    sy = lambda v: height - B - (math.log10(v) - y0) / (y1 - y0) * (height - T - B)  # noqa: E731
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" role="img">',
           f'<rect x="{L}" y="{T}" width="{width - L - R}" height="{height - T - B}" fill="none" stroke="#999"/>']
    for v in log_ticks(10 ** y0, 10 ** y1):
        out.append(f'<text x="{L - 5}" y="{sy(v) + 4:.1f}" font-size="10" text-anchor="end">{v:g}</text>')
    for i in (nice_ticks(0, n - 1, 8) if n > 1 else [0]) if index_ticks else []:
        if float(i).is_integer():
            out.append(f'<text class="xtick" x="{sx(i):.1f}" y="{height - B + 14}" font-size="10" '
                       f'text-anchor="middle">{int(i)}</text>')
    out.append(f'<text x="{(L + width - R) / 2}" y="{height - 8}" font-size="11" text-anchor="middle">'
               f'{html.escape(xlabel)}</text>')
    out.append(f'<text x="12" y="{(T + height - B) / 2}" font-size="11" text-anchor="middle" '
               f'transform="rotate(-90 12 {(T + height - B) / 2})">{html.escape(ylabel)} (log)</text>')
    for k, s in enumerate(names):
        ys = series[s]
        dash = ' stroke-dasharray="4 3"' if "held-out" in s else ""
        path = " ".join(f"{'M' if i == 0 else 'L'}{sx(i):.1f},{sy(v):.1f}" for i, v in enumerate(ys) if v and v > 0)
        out.append(f'<path d="{path}" fill="none" stroke="{color[s]}" stroke-width="1.5"{dash}>'
                   f'<title>{html.escape(s)}</title></path>')
        out.append(f'<line x1="{width - R + 8}" x2="{width - R + 24}" y1="{T + 10 + 16 * k}" y2="{T + 10 + 16 * k}" '
                   f'stroke="{color[s]}" stroke-width="2"{dash}/><text x="{width - R + 28}" y="{T + 14 + 16 * k}" '
                   f'font-size="11">{html.escape(s)}</text>')
    out.append("</svg>")
    return "".join(out)


TEMPLATE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>lrq-bench leaderboard</title>
<style>
body{font-family:system-ui,sans-serif;margin:24px;max-width:1200px;color:#222}
table{border-collapse:collapse;margin:8px 0 20px}th,td{border:1px solid #ccc;padding:3px 8px;text-align:right}
th{background:#f3f3f3;cursor:pointer;user-select:none}td:first-child,td:nth-child(2){text-align:left}
tr.fp td{background:#f7fbff}td.best,td strong{font-weight:bold}td.best{background:#eaf7ea}td.tie{background:#fff8e1}
td.ref{text-align:center;font-style:italic}details{margin:2px 0}blockquote{color:#555;margin:8px 0 8px 12px}
pre{font-size:11px;background:#fafafa;padding:6px;overflow:auto;max-height:240px}.note,.md p{color:#444;font-size:13px}
.md table{font-size:13px}
</style></head><body>
<h1>lrq-bench leaderboard</h1>
<p class="note">Generated from {{ n_rows }} stored rows. Every table of the Markdown leaderboard is here; the perplexity
tables below the charts carry the configuration behind each number in a tooltip (hover it); click a column header to sort.
{{ method_text }}</p>
{% for m in models %}
<section class="model" data-model="{{ m.name }}">
<h2>{{ m.title }}</h2>
<div class="md summary">{{ m.head|safe }}</div>
{% if m.kl_charts or m.ppl_tables %}<h3>Charts</h3>
<p class="note">One colour per method; schemes along the x axis (their bits per weight below the name); 95 % intervals as
error bars; the FP model is the dashed line. Hover a point for its method, scheme and value.</p>{% endif %}
{% for k in m.kl_charts %}
<h4>{{ k.title }}</h4>
<div class="chart" data-chart="{{ k.id }}">{{ k.chart|safe }}</div>
{% endfor %}
{% for t in m.ppl_tables %}
<h3>{{ t.dataset }} perplexity</h3>
<p class="note">{{ t.protocol }}</p>
<div class="chart" data-chart="ppl-{{ t.dataset }}">{{ t.chart|safe }}</div>
<table class="grid" data-grid="{{ t.dataset }}"><thead><tr><th>method</th>{% for s in t.schemes %}<th>{{ s }}</th>{% endfor %}</tr></thead><tbody>
{% if t.fp_text %}<tr class="fp"><td>fp</td><td class="ref" colspan="{{ t.schemes|length }}" title="the FP model, the reference of every scheme">FP reference, every scheme: {{ t.fp_text }}</td></tr>{% endif %}
{% for g in t.grid %}<tr><td>{{ g.method }}</td>{% for c in g.cells %}<td class="{{ c.mark }}" title="{{ c.title }}">{{ c.text }}</td>{% endfor %}</tr>
{% endfor %}</tbody></table>
<p class="note">Method x scheme: perplexity (95 % interval). Per scheme, bold: the best, separated from the runner-up; shaded: tied with the best.
{% for v in t.verdicts %}<br>{{ v }}{% endfor %}</p>
<table class="sortable" data-dataset="{{ t.dataset }}"><thead><tr><th>method</th><th>scheme</th><th>bits/weight</th>
<th>ppl</th><th>95 % interval</th><th>ppl / FP (95 %)</th></tr></thead><tbody>
{% for r in t.rows %}<tr class="{{ 'fp' if r.method == 'fp' else '' }}" data-method="{{ r.method }}" data-scheme="{{ r.scheme }}">
<td>{{ r.method }}</td><td>{{ r.scheme }}</td><td>{{ r.bits }}</td>
<td class="{{ r.mark }}" title="{{ r.prov }}" data-value="{{ r.value }}">{{ r.ppl }}</td><td>{{ r.ci }}</td><td>{{ r.ratio }}</td></tr>
{% endfor %}</tbody></table>
{% endfor %}
<div class="md details">{{ m.details|safe }}</div>
{% for f in m.fig2 %}<h3>Block reconstruction error, {{ f.scheme }} (LRQ paper, Figure 2)</h3>
<p class="note">Each block's output error after training, on the calibration samples it was trained on (solid) and on held-out
samples (dashed). FlexRound should fit the calibration set better; LRQ should generalize better.</p>
<div>{{ f.chart|safe }}</div>{% endfor %}
{% if m.history %}<h3>History across git revisions</h3>
<p class="note">Cells whose perplexity was stored by {{ m.n_revs }} different revisions: every stored value, oldest first.</p>
<table class="sortable history"><thead><tr><th>method</th><th>scheme</th><th>dataset</th><th>revision</th><th>when</th><th>ppl</th></tr></thead><tbody>
{% for h in m.history %}<tr><td>{{ h.method }}</td><td>{{ h.scheme }}</td><td style="text-align:left">{{ h.dataset }}</td>
<td style="text-align:left">{{ h.rev }}</td><td style="text-align:left">{{ h.when }}</td><td>{{ h.ppl }}</td></tr>{% endfor %}</tbody></table>{% endif %}
</section>
{% endfor %}
<script>
document.querySelectorAll("table.sortable th").forEach(function (th) {
  th.addEventListener("click", function () {
    var table = th.closest("table"), idx = Array.prototype.indexOf.call(th.parentNode.children, th);
    var body = table.tBodies[0], rows = Array.prototype.slice.call(body.rows);
    var asc = th.dataset.order !== "asc"; th.dataset.order = asc ? "asc" : "desc";
    function key(r) { var c = r.cells[idx]; if (!c) return ""; var v = c.dataset.value !== undefined ? c.dataset.value : c.textContent;
      var f = parseFloat(v); return isNaN(f) ? v : f; }
    rows.sort(function (a, b) { var x = key(a), y = key(b);
      if (typeof x !== typeof y) { x = String(x); y = String(y); }
      return (x > y ? 1 : x < y ? -1 : 0) * (asc ? 1 : -1); });
    rows.forEach(function (r) { body.appendChild(r); });
  });
});
</script>
</body></html>
"""


def markdown_html(lines: list[str]) -> str:
    """Markdown lines of the leaderboard as HTML (markdown-it, GitHub tables): every table sortable, headings one
    level down (the model is this page's <h2>). Raw HTML in the text stays text (`md_text` escaped it)."""
    from markdown_it import MarkdownIt
    text = "\n".join(("#" + ln) if ln.startswith("#") else ln for ln in lines)
    out = MarkdownIt("commonmark", {"html": False}).enable("table").render(text)
    return out.replace("<table>", '<table class="sortable md">')


def _model_section(name: str, precision: str, rows: list[Row], history_rows: list[Row]) -> dict:
    from bench.reports.report import DETAILS, _escaped, cell_stats, markdown_section, section_title
    md = markdown_section([_escaped(r) for r in rows], precision)
    cut = md.index(DETAILS) if DETAILS in md else len(md)
    stats = cell_stats(rows)
    by = _rows_by_cell(rows)
    schemes_all = _schemes_with_bits(by)
    datasets = _ppl_datasets(rows)
    tables = [_ppl_table(ds, by, stats, schemes_all) for ds in datasets]
    kl_charts = _kl_charts(datasets, stats, schemes_all)
    fig2 = _block_error_charts(by)
    history, n_revs = _history(name, precision, datasets, history_rows)
    return {"name": name, "title": section_title(name, precision), "kl_charts": kl_charts,
            "head": markdown_html(md[:cut]), "details": markdown_html(md[cut:]),
            "ppl_tables": tables, "fig2": fig2, "history": history, "n_revs": n_revs}


def _rows_by_cell(rows: list[Row]) -> dict:
    """(method, scheme) -> (dataset, metric) -> row (the lowest seed's)."""
    by = defaultdict(dict)
    for r in sorted(rows, key=lambda r: -(r.seed or 0)):
        by[(r.method, r.scheme)][(r.dataset, r.metric)] = r
    return by


def _schemes_with_bits(by: dict) -> list[tuple[str, float | None]]:
    """The quantized schemes in order, each with its bits per weight (None where no row records them)."""
    bits = {}
    for (m, s), v in by.items():
        b = v.get(("quant", "bits_per_weight"))
        if b is not None and m != "fp":
            bits.setdefault(s, b.value)
    return [(s, bits.get(s)) for s in scheme_order({k[1] for k in by if k[0] != "fp"})]


def _ppl_datasets(rows: list[Row]) -> list[str]:
    """The texts with perplexities: WikiText-2 and C4 first, then the others by name (tasks apart)."""
    from bench.reports.report import TASK_DATASETS
    datasets = [d for d in ("wikitext2", "c4") if any(r.dataset == d and r.metric == "ppl" for r in rows)]
    datasets += sorted({r.dataset for r in rows if r.metric == "ppl" and r.dataset not in TASK_DATASETS}
                       - set(datasets))
    return datasets


def _point(method, scheme, cs):
    """A chart point of a cell's statistic: its interval only where one seed measured it."""
    e = cs.first()
    one = len(cs.seeds) == 1 and e.known
    return (method, scheme, cs.value, e.lo if one else None, e.hi if one else None)


def _ppl_table(ds: str, by: dict, stats: dict, schemes_all: list[tuple[str, float | None]]) -> dict:
    """One text's perplexity table, its method x scheme grid with verdicts, its protocol line and chart."""
    from bench.evaluations import stats as S
    from bench.reports.report import fmt_stat
    col = (ds, "ppl")
    fp_stat = stats.get(("fp", "fp"), {}).get(col)
    fp = fp_stat.value if fp_stat else None
    entries = [(k, v[col], v.get(("quant", "bits_per_weight"))) for k, v in by.items() if col in v]
    entries.sort(key=lambda e: (e[0][0] != "fp", e[0][0], e[0][1]))
    overall = S.rank({k: stats[k].get(col) for k, _, _ in entries if k[0] != "fp"}, True)
    trs, pts = _ppl_rows(entries, stats, col, fp_stat, overall)
    schemes = scheme_order({k[1] for k, _, _ in entries if k[0] != "fp"})
    grid, verdicts = _ppl_grid(entries, stats, col, schemes, overall)
    ev = entries[-1][1].config.get("eval", {}) if entries else {}
    n = ev.get('windows', '?')
    protocol = (f"{n} window{'' if n == 1 else 's'} of {ev.get('seq_len', '?')} tokens ({ev.get('tokens', '?')} "
                f"tokens), exp(mean window NLL); FP = {_fmt('ppl', fp)}.")
    return {"dataset": ds, "rows": trs, "protocol": protocol, "schemes": schemes, "grid": grid,
            "verdicts": verdicts, "fp_text": fmt_stat(fp_stat) if fp_stat else "",
            "chart": scheme_chart(pts, schemes_all, f"{ds} perplexity",
                                  ref=(fp, f"FP {fp:.2f}") if fp else None)}


def _ppl_rows(entries: list, stats: dict, col: tuple[str, str], fp_stat, overall) -> tuple[list[dict], list[tuple]]:
    """The table's rows (value, interval, rank mark, ratio to FP, provenance) and the chart's points."""
    from bench.evaluations import stats as S
    from bench.reports.report import _fmt_cmp
    trs, pts = [], []
    for (method, scheme), r, b in entries:
        cs = stats[(method, scheme)].get(col)
        e = cs.first() if cs else None
        ci = (f"{e.lo:.2f}-{e.hi:.2f}" if e and e.known else "unknown") if len(cs.seeds) == 1 else \
            f"+-{cs.seed_sd:.2f} over {len(cs.seeds)} seeds"
        vs_fp = S.compare(cs, fp_stat) if cs and fp_stat and method != "fp" else None
        trs.append({"method": method, "scheme": scheme, "bits": _fmt("bits_per_weight", b.value if b else None),
                    "ppl": _fmt("ppl", cs.value if cs else r.value), "value": cs.value if cs else r.value,
                    "prov": _prov(r), "ci": ci, "mark": overall.marks.get((method, scheme), ""),
                    "ratio": "-" if vs_fp is None else _fmt_cmp(vs_fp, False)})
        if cs and method != "fp":
            pts.append(_point(method, scheme, cs))
    return trs, pts


def _ppl_grid(entries: list, stats: dict, col: tuple[str, str], schemes: list[str], overall
              ) -> tuple[list[dict], list[str]]:
    """The method x scheme grid, each cell marked by its rank within its scheme, and the verdicts (all schemes
    together, then each scheme)."""
    from bench.evaluations import stats as S
    from bench.reports.report import _verdict, fmt_stat
    grid, verdicts = [], [v for v in [_verdict("all schemes", overall, False)] if v]
    per_scheme = {}
    for s_name in schemes:
        rk = S.rank({k: stats[k].get(col) for k, _, _ in entries if k[1] == s_name and k[0] != "fp"}, True)
        per_scheme[s_name] = rk
        v = _verdict(s_name, rk, False)
        if v:
            verdicts.append(v)
    for m in sorted({k[0] for k, _, _ in entries} - {"fp"}):
        cells = []
        for s_name in schemes:
            cs = stats.get((m, s_name), {}).get(col)
            cells.append({"text": fmt_stat(cs) if cs else "-", "title": f"{m} {s_name}",
                          "mark": per_scheme[s_name].marks.get((m, s_name), "")})
        grid.append({"method": m, "cells": cells})
    return grid, verdicts


def _kl_charts(datasets: list[str], stats: dict, schemes_all: list[tuple[str, float | None]]) -> list[dict]:
    """Per text, the KL divergence and top-1 agreement (in %) of each quantized cell against the FP model."""
    kl_charts = []
    for ds in datasets:
        for metric, title, ylabel, ref in (
                ("kld", f"{ds}: KL divergence from the FP model", f"{ds} KLD (nats/token)", (0.0, "FP (KLD = 0)")),
                ("top1_agree", f"{ds}: top-1 agreement with the FP model", f"{ds} top-1 agreement (%)",
                 (100.0, "FP (100 %)"))):
            scale = 100.0 if metric == "top1_agree" else 1.0
            pts = [tuple(x * scale if isinstance(x, float) else x for x in _point(m, s, v[(ds, metric)]))
                   for (m, s), v in stats.items() if m != "fp" and (ds, metric) in v]
            if pts:
                kl_charts.append({"id": f"{metric}-{ds}", "title": title,
                                  "chart": scheme_chart(pts, schemes_all, ylabel, logy=False, ref=ref)})
    return kl_charts


def _block_error_charts(by: dict) -> list[dict]:
    """Figure 2 per scheme: each method's per-block calibration and held-out output error."""
    fig2 = []
    for scheme in scheme_order({k[1] for k in by}):
        series = {}
        for (method, sch), v in by.items():
            q = v.get(("quant", "bits_per_weight"))
            errs = ((q.config or {}).get("method_stats") or {}).get("block_errors") if q else None
            if sch != scheme or not errs:
                continue
            series[f"{method} calibration"] = [e.get("calib_after") for e in errs]
            series[f"{method} held-out"] = [e.get("heldout_after") for e in errs]
        if series:
            fig2.append({"scheme": scheme, "chart": lines_svg(series, "block (index from 0)", "block output error",
                                                                index_ticks=True)})
    return fig2


def _history(name: str, precision: str, datasets: list[str], history_rows: list[Row]) -> tuple[list[dict], int]:
    """The perplexities of the cells that several git revisions measured, and how many revisions those are."""
    mine = [r for r in history_rows if r.model == name and r.precision == precision and r.metric == "ppl"
            and r.dataset in datasets]
    revs_of = defaultdict(set)
    for r in mine:
        revs_of[(r.method, r.scheme, r.dataset)].add(r.git_rev)
    several = {k for k, v in revs_of.items() if len(v) > 1}
    history = [{"method": r.method, "scheme": r.scheme, "dataset": r.dataset, "rev": short_revision(r.git_rev),
                "when": r.created_at, "ppl": _fmt("ppl", r.value)}
               for r in sorted(mine, key=lambda r: (r.method, r.scheme, r.dataset, str(r.created_at)))
               if (r.method, r.scheme, r.dataset) in several]
    return history, len({r.git_rev for r in mine if (r.method, r.scheme, r.dataset) in several})


def html_report(latest_rows: list[Row], all_rows: list[Row] | None = None) -> str:
    env = Environment(autoescape=select_autoescape(default=True, default_for_string=True))
    from bench.reports.report import plain_row, sections
    latest_rows, all_rows = [plain_row(r) for r in latest_rows], [plain_row(r) for r in all_rows or []]
    models = [_model_section(name, prec, srows, all_rows or []) for (name, prec), srows in sections(latest_rows).items()]
    from bench.evaluations.evals import method_text
    return env.from_string(TEMPLATE).render(models=models, n_rows=len(latest_rows), method_text=method_text())


def write_report(store, out_dir) -> Path:
    """leaderboard.md and the self-contained leaderboard.html, each written atomically (report.py writes the
    Markdown, this module the HTML; the writer lives here so that neither module imports the other's caller)."""
    from bench.reports.report import markdown_report
    from lrq.io import atomic_write_text
    latest = store.rows(latest=True)
    path = Path(out_dir) / "leaderboard.md"
    atomic_write_text(path, markdown_report(latest))
    atomic_write_text(Path(out_dir) / "leaderboard.html", html_report(latest, store.rows()))
    return path
