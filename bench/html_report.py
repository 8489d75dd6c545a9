"""Self-contained HTML leaderboard (Jinja2): sortable tables, inline SVG charts, provenance on every number.

No network is needed to view it: styles, the table-sorting script and the charts (SVG drawn here) are
inline. Every value cell carries its configuration (method settings, calibration, scheme, versions,
hardware, git revision) in a `title` tooltip and, for the perplexity tables, in a <details> block.
Charts: perplexity against bits per weight per dataset; the per-block calibration vs held-out error of
block reconstruction (LRQ paper, Figure 2); inference speed-up per scheme when bench/studies/speed.py stored it.
A history table shows every stored value of each perplexity across git revisions.
"""

from __future__ import annotations

import html
import math
from collections import defaultdict
from pathlib import Path

from jinja2 import Environment, select_autoescape

from bench.store import Row
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
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    if metric.endswith("_bytes"):
        return f"{v / 2**20:.0f} MiB"
    if metric == "ppl":
        return f"{v:.2f}"
    if metric in ("bits_per_weight",):
        return f"{v:.3f}"
    return f"{v:.4g}"


def scatter_svg(points: list[tuple], xlabel: str, ylabel: str, logy: bool = True,
                width: int = 600, height: int = 340, zero_line: str | None = None) -> str:
    """points: (series, x, y) or (series, x, y, lo, hi) with a 95 % interval drawn as an error bar. A small
    inline SVG scatter with axes, ticks and a legend. Points of different series at the same x are dodged
    sideways so that none hides another; x labels that would overprint their neighbour go on a second row
    (3.028 beside 3.161), and the axis title sits below both rows. `zero_line` (linear y only): a dashed
    reference line at y = 0 with that label (the FP model for a divergence from it)."""
    pts = [(p[0], p[1], p[2], *(p[3:5] if len(p) >= 5 else (None, None))) for p in points]
    pts = [p for p in pts if p[1] is not None and p[2] is not None and (p[2] > 0 or not logy)]
    if not pts:
        return ""
    series = sorted({p[0] for p in pts})
    color = {s: PALETTE[i % len(PALETTE)] for i, s in enumerate(series)}
    tx = lambda v: math.log10(v) if logy else v  # noqa: E731
    xs = [p[1] for p in pts]
    ys = [tx(v) for p in pts for v in (p[2], p[3], p[4]) if v is not None and (v > 0 or not logy)]
    if zero_line is not None and not logy:
        ys.append(0.0)
    x0, x1 = min(xs) - 0.5, max(xs) + 0.5
    y0, y1 = min(ys), max(ys)
    if y1 - y0 < 1e-9:
        y0, y1 = y0 - 0.5, y1 + 0.5
    pad = (y1 - y0) * 0.08
    y0, y1 = y0 - pad, y1 + pad
    L, R, T, B = 64, 150, 15, 58
    sx = lambda v: L + (v - x0) / (x1 - x0) * (width - L - R)  # noqa: E731
    sy = lambda v: height - B - (v - y0) / (y1 - y0) * (height - T - B)  # noqa: E731
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" role="img" '
           f'aria-label="{html.escape(ylabel)} vs {html.escape(xlabel)}">',
           f'<rect x="{L}" y="{T}" width="{width - L - R}" height="{height - T - B}" fill="none" stroke="#999"/>']
    ticks = [y0 + (y1 - y0) * i / 4 for i in range(5)] if logy else nice_ticks(y0, y1)
    for v in ticks:
        lab = f"{10 ** v:.3g}" if logy else f"{v:g}"
        out.append(f'<text x="{L - 6}" y="{sy(v) + 4:.1f}" font-size="10" text-anchor="end">{lab}</text>')
        out.append(f'<line x1="{L - 3}" x2="{L}" y1="{sy(v):.1f}" y2="{sy(v):.1f}" stroke="#999"/>')
    last = [-1e9, -1e9]             # the right end of the last label on each of two rows
    for v in sorted({round(x, 3) for x in xs}):
        out.append(f'<line x1="{sx(v):.1f}" x2="{sx(v):.1f}" y1="{height - B}" y2="{height - B + 4}" stroke="#999"/>')
        w = 6.2 * len(f"{v:g}")
        row = next((r for r in (0, 1) if sx(v) - w / 2 >= last[r] + 4), None)
        if row is None:            # both rows taken here: the tooltip of each point still says its x
            continue
        out.append(f'<text class="xtick" x="{sx(v):.1f}" y="{height - B + 15 + 12 * row}" font-size="10" '
                   f'text-anchor="middle">{v:g}</text>')
        last[row] = sx(v) + w / 2
    out.append(f'<text x="{(L + width - R) / 2}" y="{height - 8}" font-size="11" text-anchor="middle">'
               f'{html.escape(xlabel)}</text>')
    out.append(f'<text x="13" y="{(T + height - B) / 2}" font-size="11" text-anchor="middle" '
               f'transform="rotate(-90 13 {(T + height - B) / 2})">{html.escape(ylabel)}{" (log)" if logy else ""}'
               f'</text>')
    if zero_line is not None and not logy:
        out.append(f'<line class="zero" x1="{L}" x2="{width - R}" y1="{sy(0):.1f}" y2="{sy(0):.1f}" stroke="#555" '
                   f'stroke-dasharray="5 4"/><text x="{width - R - 4}" y="{sy(0) - 4:.1f}" font-size="10" '
                   f'text-anchor="end">{html.escape(zero_line)}</text>')
    for s, x, y, lo, hi in pts:
        dx = (series.index(s) - (len(series) - 1) / 2) * 7     # dodge: each series its own lane around x
        cx = sx(x) + dx
        if lo is not None and hi is not None and (lo > 0 or not logy):
            out.append(f'<line class="errorbar" x1="{cx:.1f}" x2="{cx:.1f}" y1="{sy(tx(lo)):.1f}" '
                       f'y2="{sy(tx(hi)):.1f}" stroke="{color[s]}" stroke-width="1.2"/>')
        ci = f" (95 %: {lo:.4g}-{hi:.4g})" if lo is not None and hi is not None else ""
        out.append(f'<circle cx="{cx:.1f}" cy="{sy(tx(y)):.1f}" r="4" fill="{color[s]}">'
                   f'<title>{html.escape(s)}: {y:.4g}{ci} at {x:g}</title></circle>')
    for i, s in enumerate(series):
        out.append(f'<circle cx="{width - R + 12}" cy="{T + 10 + 16 * i}" r="4" fill="{color[s]}"/>'
                   f'<text x="{width - R + 20}" y="{T + 14 + 16 * i}" font-size="11">{html.escape(s)}</text>')
    out.append("</svg>")
    return "".join(out)


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


def lines_svg(series: dict[str, list[float]], xlabel: str, ylabel: str, width: int = 560, height: int = 300) -> str:
    """series name -> y per block index; log-scale y."""
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
    for i in range(5):
        v = y0 + (y1 - y0) * i / 4
        out.append(f'<text x="{L - 5}" y="{sy(10 ** v) + 4:.1f}" font-size="10" text-anchor="end">{10 ** v:.3g}</text>')
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
body{font-family:system-ui,sans-serif;margin:24px;max-width:1100px;color:#222}
table{border-collapse:collapse;margin:8px 0 20px}th,td{border:1px solid #ccc;padding:3px 8px;text-align:right}
th{background:#f3f3f3;cursor:pointer;user-select:none}td:first-child,td:nth-child(2){text-align:left}
tr.fp td{background:#f7fbff}td.best{font-weight:bold;background:#eaf7ea}td.tie{background:#fff8e1}details{margin:2px 0}
pre{font-size:11px;background:#fafafa;padding:6px;overflow:auto;max-height:240px}.note{color:#555;font-size:13px}
</style></head><body>
<h1>lrq-bench leaderboard</h1>
<p class="note">Generated from {{ n_rows }} stored rows. Hover any number for the configuration that produced it;
click a column header to sort. Lower perplexity is better. {{ method_text }}</p>
{% for m in models %}
<h2>{{ m.title }}</h2>
<p class="note">{{ m.precision_note }}</p>
{% for note in m.notes %}<p class="note">{{ note }}</p>{% endfor %}
{% for k in m.kl_charts %}
<h3>{{ k.dataset }}: KL divergence from the FP model</h3>
<p class="note">Mean KL(P_FP || P_quantized) per predicted position on the perplexity windows, with its 95 % interval over
windows, against bits per weight; the FP model is the dashed line at 0. Points of one bit width are set side by side.</p>
<div>{{ k.chart|safe }}</div>
{% endfor %}
{% for t in m.ppl_tables %}
<h3>{{ t.dataset }} perplexity</h3>
<p class="note">{{ t.protocol }}</p>
<table class="grid" data-grid="{{ t.dataset }}"><thead><tr><th>method</th>{% for s in t.schemes %}<th>{{ s }}</th>{% endfor %}</tr></thead><tbody>
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
<div>{{ t.chart|safe }}</div>
{% endfor %}
{% if m.cost %}<h3>Quantization cost</h3>
<table class="sortable"><thead><tr><th>method</th><th>scheme</th><th>time (s)</th><th>peak memory</th>
<th>learnable parameters</th></tr></thead><tbody>
{% for r in m.cost %}<tr><td>{{ r.method }}</td><td>{{ r.scheme }}</td><td title="{{ r.prov }}" data-value="{{ r.t }}">{{ r.time }}</td>
<td>{{ r.mem }}</td><td>{{ r.nl }}</td></tr>{% endfor %}</tbody></table>{% endif %}
{% for f in m.fig2 %}<h3>Block reconstruction error, {{ f.scheme }} (LRQ paper, Figure 2)</h3>
<p class="note">Each block's output error after training, on the calibration samples it was trained on (solid) and on held-out
samples (dashed). FlexRound should fit the calibration set better; LRQ should generalize better.</p>
<div>{{ f.chart|safe }}</div>{% endfor %}
{% if m.speed %}<h3>Inference speed</h3>
<table class="sortable"><thead><tr><th>scheme</th><th>prefill tok/s</th><th>decode tok/s</th><th>model size</th></tr></thead><tbody>
{% for r in m.speed %}<tr><td>{{ r.scheme }}</td><td title="{{ r.prov }}">{{ r.prefill }}</td><td>{{ r.decode }}</td><td>{{ r.size }}</td></tr>{% endfor %}
</tbody></table>{% endif %}
{% if m.history %}<h3>History across git revisions</h3>
<table class="sortable"><thead><tr><th>method</th><th>scheme</th><th>dataset</th><th>revision</th><th>when</th><th>ppl</th></tr></thead><tbody>
{% for h in m.history %}<tr><td>{{ h.method }}</td><td>{{ h.scheme }}</td><td style="text-align:left">{{ h.dataset }}</td>
<td style="text-align:left">{{ h.rev }}</td><td style="text-align:left">{{ h.when }}</td><td>{{ h.ppl }}</td></tr>{% endfor %}</tbody></table>{% endif %}
{% endfor %}
<script>
document.querySelectorAll("table.sortable th").forEach(function (th) {
  th.addEventListener("click", function () {
    var table = th.closest("table"), idx = Array.prototype.indexOf.call(th.parentNode.children, th);
    var body = table.tBodies[0], rows = Array.prototype.slice.call(body.rows);
    var asc = th.dataset.order !== "asc"; th.dataset.order = asc ? "asc" : "desc";
    function key(r) { var c = r.cells[idx], v = c.dataset.value !== undefined ? c.dataset.value : c.textContent;
      var f = parseFloat(v); return isNaN(f) ? v : f; }
    rows.sort(function (a, b) { var x = key(a), y = key(b); return (x > y ? 1 : x < y ? -1 : 0) * (asc ? 1 : -1); });
    rows.forEach(function (r) { body.appendChild(r); });
  });
});
</script>
</body></html>
"""


def _model_section(name: str, precision: str, rows: list[Row], history_rows: list[Row]) -> dict:
    from bench import stats as S
    from bench.report import _fmt_cmp, precision_text, _verdict, cell_stats, section_title
    stats = cell_stats(rows)
    by = defaultdict(dict)   # (method, scheme) -> metric/dataset -> row (the lowest seed's)
    for r in sorted(rows, key=lambda r: -(r.seed or 0)):
        by[(r.method, r.scheme)][(r.dataset, r.metric)] = r
    notes = sorted({r.config.get("model_note") for r in rows if r.config.get("model_note")})
    datasets = [d for d in ("wikitext2", "c4") if any(r.dataset == d and r.metric == "ppl" for r in rows)]
    datasets += sorted({r.dataset for r in rows if r.metric == "ppl"} - set(datasets))
    tables = []
    for ds in datasets:
        col = (ds, "ppl")
        fp_stat = stats.get(("fp", "fp"), {}).get(col)
        fp = fp_stat.value if fp_stat else None
        entries = [(k, v[col], v.get(("quant", "bits_per_weight"))) for k, v in by.items() if col in v]
        entries.sort(key=lambda e: (e[0][0] != "fp", e[0][0], e[0][1]))
        overall = S.rank({k: stats[k].get(col) for k, _, _ in entries if k[0] != "fp"}, True)
        trs, pts = [], []
        for (method, scheme), r, b in entries:
            cs = stats[(method, scheme)].get(col)
            e = cs.first() if cs else None
            ci = (f"{e.lo:.2f}-{e.hi:.2f}" if e and e.known else "unknown") if len(cs.seeds) == 1 else \
                f"+-{cs.seed_sd:.2f} over {len(cs.seeds)} seeds"
            vs_fp = S.compare(cs, fp_stat) if cs and fp_stat and method != "fp" else None
            mark = overall.marks.get((method, scheme), "")
            trs.append({"method": method, "scheme": scheme, "bits": _fmt("bits_per_weight", b.value if b else None),
                        "ppl": _fmt("ppl", cs.value if cs else r.value), "value": cs.value if cs else r.value,
                        "prov": _prov(r), "ci": ci, "mark": mark,
                        "ratio": "-" if vs_fp is None else _fmt_cmp(vs_fp, False)})
            if b is not None and method != "fp":
                pts.append((method, b.value, cs.value, e.lo if e and len(cs.seeds) == 1 else None,
                            e.hi if e and len(cs.seeds) == 1 else None))
        schemes = scheme_order({k[1] for k, _, _ in entries if k[0] != "fp"})
        methods = sorted({k[0] for k, _, _ in entries})
        grid, verdicts = [], [v for v in [_verdict("all schemes", overall, False)] if v]
        per_scheme = {}
        for s_name in schemes:
            rk = S.rank({k: stats[k].get(col) for k, _, _ in entries if k[1] == s_name and k[0] != "fp"}, True)
            per_scheme[s_name] = rk
            v = _verdict(s_name, rk, False)
            if v:
                verdicts.append(v)
        from bench.report import fmt_stat
        for m in methods:
            cells = []
            for s_name in (["fp"] if m == "fp" else schemes):
                cs = stats.get((m, s_name), {}).get(col)
                cells.append({"text": fmt_stat(cs) if cs else "-", "title": f"{m} {s_name}",
                              "mark": per_scheme.get(s_name).marks.get((m, s_name), "") if s_name in per_scheme else ""})
            if m == "fp":
                cells += [{"text": "", "title": "", "mark": ""}] * (len(schemes) - 1)
            grid.append({"method": m, "cells": cells})
        ev = entries[-1][1].config.get("eval", {}) if entries else {}
        n = ev.get('windows', '?')
        protocol = (f"{n} window{'' if n == 1 else 's'} of {ev.get('seq_len', '?')} tokens ({ev.get('tokens', '?')} "
                    f"tokens), exp(mean window NLL); FP = {_fmt('ppl', fp)}.")
        tables.append({"dataset": ds, "rows": trs, "protocol": protocol, "schemes": schemes, "grid": grid,
                       "verdicts": verdicts,
                       "chart": scatter_svg(pts, "bits per weight", f"{ds} perplexity (95 % interval)")})
    from bench.report import _fmt_seeds, _seed_mean, _seed_values
    per_seed = _seed_values(r for r in rows if r.dataset == "quant")   # several seeds show mean +- sd
    cost = []
    for (method, scheme), v in sorted(by.items()):
        t = v.get(("quant", "quant_time_s"))
        if t is None:
            continue
        nl = v.get(("quant", "n_learnable"))
        times = per_seed[(method, scheme, "quant", "quant_time_s")]
        cost.append({"method": method, "scheme": scheme, "t": _seed_mean(times), "prov": _prov(t),
                     "time": _fmt_seeds("quant_time_s", times),
                     "mem": _fmt_seeds("quant_peak_rss_bytes", per_seed.get((method, scheme, "quant", "quant_peak_rss_bytes"))),
                     "nl": f"{nl.value:,.0f}" if nl else "-"})
    kl_charts = []
    for ds in datasets:
        pts = []
        for (method, scheme), v in by.items():
            cs = stats.get((method, scheme), {}).get((ds, "kld"))
            b = v.get(("quant", "bits_per_weight"))
            if cs is None or b is None or method == "fp":
                continue
            e = cs.first()
            one = len(cs.seeds) == 1 and e.known
            pts.append((method, b.value, cs.value, e.lo if one else None, e.hi if one else None))
        if pts:
            kl_charts.append({"dataset": ds, "chart": scatter_svg(pts, "bits per weight (with scales and zero points)",
                                                                   f"{ds} KL divergence from FP (nats/token)",
                                                                   logy=False, zero_line="FP (KLD = 0)")})
    fig2 = []
    for scheme in sorted({k[1] for k in by}):
        series = {}
        for (method, sch), v in by.items():
            q = v.get(("quant", "bits_per_weight"))
            errs = ((q.config or {}).get("method_stats") or {}).get("block_errors") if q else None
            if sch != scheme or not errs:
                continue
            series[f"{method} calibration"] = [e.get("calib_after") for e in errs]
            series[f"{method} held-out"] = [e.get("heldout_after") for e in errs]
        if series:
            fig2.append({"scheme": scheme, "chart": lines_svg(series, "block", "block output error")})
    speed = []
    for (method, scheme), v in sorted(by.items()):
        p = v.get(("speed_e2e", "prefill_tok_s"))
        if p is None:
            continue
        d, s = v.get(("speed_e2e", "decode_tok_s")), v.get(("speed_e2e", "model_bytes"))
        speed.append({"scheme": scheme, "prefill": f"{p.value:.1f}", "decode": f"{d.value:.2f}" if d else "-",
                      "size": _fmt("model_bytes", s.value if s else None), "prov": _prov(p)})
    history = []
    for r in history_rows:
        if r.model == name and r.precision == precision and r.metric == "ppl":
            history.append({"method": r.method, "scheme": r.scheme, "dataset": r.dataset, "rev": r.git_rev[:12],
                            "when": r.created_at, "ppl": _fmt("ppl", r.value)})
    return {"name": name, "title": section_title(name, precision), "kl_charts": kl_charts,
            "precision_note": f"Precision of every number in this section: {precision_text(precision)}.",
            "notes": notes, "ppl_tables": tables, "cost": cost, "fig2": fig2, "speed": speed,
            "history": history}


def html_report(latest_rows: list[Row], all_rows: list[Row] | None = None) -> str:
    env = Environment(autoescape=select_autoescape(default=True, default_for_string=True))
    from bench.report import sections
    models = [_model_section(name, prec, srows, all_rows or []) for (name, prec), srows in sections(latest_rows).items()]
    from bench.stats import METHOD_TEXT
    return env.from_string(TEMPLATE).render(models=models, n_rows=len(latest_rows), method_text=METHOD_TEXT)


def write_report(store, out_dir) -> Path:
    """leaderboard.md and the self-contained leaderboard.html, each written atomically (report.py writes the
    Markdown, this module the HTML; the writer lives here so that neither module imports the other's caller)."""
    from bench.report import markdown_report
    from lrq.io import atomic_write_text
    latest = store.rows(latest=True)
    path = Path(out_dir) / "leaderboard.md"
    atomic_write_text(path, markdown_report(latest))
    atomic_write_text(Path(out_dir) / "leaderboard.html", html_report(latest, store.rows()))
    return path
