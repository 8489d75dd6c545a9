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
import json
import math
from collections import defaultdict

from jinja2 import Environment, select_autoescape

from bench.store import Row

PALETTE = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf", "#7f7f7f"]


def _prov(r: Row) -> str:
    c = r.config or {}
    keep = {k: c.get(k) for k in ("method_config", "calibration", "scheme_def", "eval", "preset", "seed")
            if c.get(k) is not None}
    keep.update({"git_rev": r.git_rev, "versions": {k: v for k, v in (r.versions or {}).items()
                                                      if k in ("torch", "transformers", "lrq-bench", "python")},
                 "hardware": {k: (r.hardware or {}).get(k) for k in ("cpu", "cpu_count", "gpu")},
                 "created_at": r.created_at})
    return json.dumps(keep, indent=1, default=str)


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


def scatter_svg(points: list[tuple[str, float, float]], xlabel: str, ylabel: str, logy: bool = True,
                width: int = 560, height: int = 320) -> str:
    """points: (series, x, y). A small inline SVG scatter with axes, ticks and a legend."""
    pts = [(s, x, y) for s, x, y in points if x is not None and y is not None and y > 0]
    if not pts:
        return ""
    series = sorted({s for s, _, _ in pts})
    color = {s: PALETTE[i % len(PALETTE)] for i, s in enumerate(series)}
    tx = lambda v: math.log10(v) if logy else v  # noqa: E731
    xs, ys = [p[1] for p in pts], [tx(p[2]) for p in pts]
    x0, x1 = min(xs) - 0.5, max(xs) + 0.5
    y0, y1 = min(ys), max(ys)
    if y1 - y0 < 1e-9:
        y0, y1 = y0 - 0.5, y1 + 0.5
    pad = (y1 - y0) * 0.08
    y0, y1 = y0 - pad, y1 + pad
    L, R, T, B = 60, 150, 15, 45
    sx = lambda v: L + (v - x0) / (x1 - x0) * (width - L - R)  # noqa: E731
    sy = lambda v: height - B - (v - y0) / (y1 - y0) * (height - T - B)  # noqa: E731
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" role="img" '
           f'aria-label="{html.escape(ylabel)} vs {html.escape(xlabel)}">',
           f'<rect x="{L}" y="{T}" width="{width - L - R}" height="{height - T - B}" fill="none" stroke="#999"/>']
    for i in range(5):
        v = y0 + (y1 - y0) * i / 4
        lab = f"{10 ** v:.3g}" if logy else f"{v:.3g}"
        out.append(f'<text x="{L - 5}" y="{sy(v) + 4:.1f}" font-size="10" text-anchor="end">{lab}</text>')
    for v in sorted({round(x, 3) for x in xs}):
        out.append(f'<text x="{sx(v):.1f}" y="{height - B + 14}" font-size="10" text-anchor="middle">{v:g}</text>')
    out.append(f'<text x="{(L + width - R) / 2}" y="{height - 8}" font-size="11" text-anchor="middle">'
               f'{html.escape(xlabel)}</text>')
    out.append(f'<text x="12" y="{(T + height - B) / 2}" font-size="11" text-anchor="middle" '
               f'transform="rotate(-90 12 {(T + height - B) / 2})">{html.escape(ylabel)}{" (log)" if logy else ""}'
               f'</text>')
    for s, x, y in pts:
        out.append(f'<circle cx="{sx(x):.1f}" cy="{sy(tx(y)):.1f}" r="4" fill="{color[s]}">'
                   f'<title>{html.escape(s)}: {y:.4g} at {x:g}</title></circle>')
    for i, s in enumerate(series):
        out.append(f'<circle cx="{width - R + 12}" cy="{T + 10 + 16 * i}" r="4" fill="{color[s]}"/>'
                   f'<text x="{width - R + 20}" y="{T + 14 + 16 * i}" font-size="11">{html.escape(s)}</text>')
    out.append("</svg>")
    return "".join(out)


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
tr.fp td{background:#f7fbff}td.best{font-weight:bold;background:#eaf7ea}details{margin:2px 0}
pre{font-size:11px;background:#fafafa;padding:6px;overflow:auto;max-height:240px}.note{color:#555;font-size:13px}
</style></head><body>
<h1>lrq-bench leaderboard</h1>
<p class="note">Generated from {{ n_rows }} stored rows. Hover any number for the configuration that produced it;
click a column header to sort. Lower perplexity is better; the best quantized value per column is bold.</p>
{% for m in models %}
<h2>Model: {{ m.name }}</h2>
{% for note in m.notes %}<p class="note">{{ note }}</p>{% endfor %}
{% for t in m.ppl_tables %}
<h3>{{ t.dataset }} perplexity</h3>
<p class="note">{{ t.protocol }}</p>
<table class="sortable" data-dataset="{{ t.dataset }}"><thead><tr><th>method</th><th>scheme</th><th>bits/weight</th>
<th>ppl</th><th>ppl / FP</th></tr></thead><tbody>
{% for r in t.rows %}<tr class="{{ 'fp' if r.method == 'fp' else '' }}" data-method="{{ r.method }}" data-scheme="{{ r.scheme }}">
<td>{{ r.method }}</td><td>{{ r.scheme }}</td><td>{{ r.bits }}</td>
<td class="{{ 'best' if r.best else '' }}" title="{{ r.prov }}" data-value="{{ r.value }}">{{ r.ppl }}</td><td>{{ r.ratio }}</td></tr>
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


def _model_section(name: str, rows: list[Row], history_rows: list[Row]) -> dict:
    by = defaultdict(dict)   # (method, scheme) -> metric/dataset -> row
    for r in rows:
        by[(r.method, r.scheme)][(r.dataset, r.metric)] = r
    notes = sorted({r.config.get("model_note") for r in rows if r.config.get("model_note")})
    datasets = [d for d in ("wikitext2", "c4") if any(r.dataset == d and r.metric == "ppl" for r in rows)]
    datasets += sorted({r.dataset for r in rows if r.metric == "ppl"} - set(datasets))
    tables = []
    for ds in datasets:
        fp = next((v[(ds, "ppl")].value for (m, _), v in by.items() if m == "fp" and (ds, "ppl") in v), None)
        entries = [(k, v[(ds, "ppl")], v.get(("quant", "bits_per_weight"))) for k, v in by.items() if (ds, "ppl") in v]
        entries.sort(key=lambda e: (e[0][0] != "fp", e[0][0], e[0][1]))
        best = min((e[1].value for e in entries if e[0][0] != "fp" and e[1].value is not None), default=None)
        trs, pts = [], []
        for (method, scheme), r, b in entries:
            trs.append({"method": method, "scheme": scheme, "bits": _fmt("bits_per_weight", b.value if b else None),
                        "ppl": _fmt("ppl", r.value), "value": r.value, "prov": _prov(r),
                        "ratio": "-" if method == "fp" or not fp or r.value is None else f"{r.value / fp:.3f}x",
                        "best": method != "fp" and r.value == best})
            if b is not None and method != "fp":
                pts.append((method, b.value, r.value))
        ev = entries[-1][1].config.get("eval", {}) if entries else {}
        protocol = (f"{ev.get('windows', '?')} windows of {ev.get('seq_len', '?')} tokens ({ev.get('tokens', '?')} "
                    f"tokens), exp(mean window NLL); FP = {_fmt('ppl', fp)}.")
        tables.append({"dataset": ds, "rows": trs, "protocol": protocol,
                       "chart": scatter_svg(pts, "bits per weight", f"{ds} perplexity")})
    cost = []
    for (method, scheme), v in sorted(by.items()):
        t = v.get(("quant", "quant_time_s"))
        if t is None:
            continue
        mem, nl = v.get(("quant", "quant_peak_rss_bytes")), v.get(("quant", "n_learnable"))
        cost.append({"method": method, "scheme": scheme, "t": t.value, "time": f"{t.value:.1f}", "prov": _prov(t),
                     "mem": _fmt("quant_peak_rss_bytes", mem.value if mem else None),
                     "nl": f"{nl.value:,.0f}" if nl else "-"})
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
        if r.model == name and r.metric == "ppl":
            history.append({"method": r.method, "scheme": r.scheme, "dataset": r.dataset, "rev": r.git_rev[:12],
                            "when": r.created_at, "ppl": _fmt("ppl", r.value)})
    return {"name": name, "notes": notes, "ppl_tables": tables, "cost": cost, "fig2": fig2, "speed": speed,
            "history": history}


def html_report(latest_rows: list[Row], all_rows: list[Row] | None = None) -> str:
    env = Environment(autoescape=select_autoescape(default=True, default_for_string=True))
    models = []
    for name in dict.fromkeys(r.model for r in latest_rows):
        models.append(_model_section(name, [r for r in latest_rows if r.model == name], all_rows or []))
    return env.from_string(TEMPLATE).render(models=models, n_rows=len(latest_rows))
