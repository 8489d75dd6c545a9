"""Regression gate: compare current results with a baseline under per-metric tolerances.

Inputs are results stores (.sqlite) or JSON exports (`lrq-bench results --json`, or the committed
reference files under reports/reference/). Rows are matched on (model, method, scheme, precision, dataset,
metric, seed), newest row per key. Tolerances come from a TOML file (reports/tolerances.toml by default):

    [metrics.ppl]
    rel = 0.01              # allowed worsening, relative to the baseline value ...
    abs = 0.0               # ... or absolute, whichever is larger

Which way is worse comes from the catalogue (bench.evaluations.evals: lower for perplexity and KLD, higher for accuracy
and top-1 agreement, "both" for what must not move, such as bits per weight); a `direction` key is needed only
for a metric the catalogue does not know (a method's own statistic), and must agree with it otherwise.

A row the gate cannot trust is bad input (exit 2), never a verdict: a value its metric cannot take (the
catalogue's bounds: a negative perplexity), a value the windows or examples stored with it cannot give, a
null or non-finite baseline, a file nested deeper than any export.

A metric missing from the tolerances is reported but never fails the gate (timings, throughput).
A key present in the baseline but absent now is a regression (a cell silently disappeared), unless
`--allow-missing`.

Beside each compared value the report shows its 95 % interval where the stored rows carry their windows
(perplexity) or examples (accuracy), and, for a change, the paired interval of current against baseline
over the same windows/examples: a regression is named by the tolerance alone, and the report says
whether the change is also outside the paired interval (i.e. more than noise of that much text).
Rows are keyed by (model, method, scheme, precision, dataset, metric, seed): a bf16 and an fp32 result are
different cells, never compared with each other.
"""

from __future__ import annotations

import json
import math
import tomllib
from dataclasses import dataclass
from pathlib import Path

from bench.common.store import ResultStore, Row, row_key
from lrq.errors import UserError

def _default_tolerances() -> Path:
    """reports/tolerances.toml, packaged with the project (an installed wheel carries it too)."""
    from importlib.resources import files
    return Path(str(files("reports") / "tolerances.toml"))


DEFAULT_TOLERANCES = _default_tolerances()

def known_metrics() -> set[str]:
    """Metrics the suite stores (bench.evaluations.evals): a tolerance may name one of these or any metric present in the
    compared results (a method's own statistics); anything else is a typo."""
    from bench.evaluations.evals import METRICS
    return set(METRICS)
Key = tuple[str, str, str, str, str, str, int]   # model, method, scheme, precision, dataset, metric, seed


@dataclass
class Diff:
    key: Key
    base: float | None
    cur: float | None
    status: str          # ok, regressed, improved, missing, new, untracked
    allowed: float | None = None
    base_ci: str = ""    # the values' 95 % intervals and the paired change (bench.evaluations.stats), where known
    cur_ci: str = ""
    paired: str = ""
    outside: bool | None = None

    @property
    def delta(self) -> float | None:
        return None if self.base is None or self.cur is None else self.cur - self.base


_REQUIRED = ("model", "method", "scheme", "dataset", "metric", "value")


def load_rows(path: str | Path) -> list[Row]:
    """Rows of a results store or a JSON export; anything unreadable or of the wrong shape is bad input
    (exit 2), never a traceback with the gate's 'regression' exit code 1."""
    p = Path(path)
    if not p.exists():
        raise UserError(f"{p} does not exist: pass a results store (.sqlite) or a JSON export of one.")
    if p.is_dir():
        raise UserError(f"{p} is a folder: pass a results store (.sqlite) or a JSON export of one.")
    if p.suffix == ".json":
        try:
            data = json.loads(p.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise UserError(f"{p} is not readable JSON ({type(e).__name__}: {e}).") from None
        except RecursionError:
            raise UserError(f"{p} is not readable JSON: it is nested deeper than Python's parser goes, which no "
                            f"results export is (a row is an object of a few levels). Export the results again "
                            f"with `lrq-bench results --json`.") from None
        fields = Row.__dataclass_fields__
        if not isinstance(data, list) or not all(isinstance(d, dict) for d in data):
            raise UserError(f"{p} is not a results export: a JSON list of rows (objects) is expected, as "
                            f"`lrq-bench results --json` writes; got {type(data).__name__}.")
        for i, d in enumerate(data):
            missing = [k for k in _REQUIRED if k not in d]
            value = d.get("value")
            if missing or not (value is None or (isinstance(value, (int, float)) and not isinstance(value, bool))):
                raise UserError(f"{p}: row {i} is not a result row ("
                                + (f"missing {', '.join(missing)}" if missing else f"value {value!r} is not a number")
                                + "); a results export has model, method, scheme, dataset, metric and value per row.")
        rows = [Row(**{k: v for k, v in d.items() if k in fields}) for d in data]
        check_rows(rows, str(p))
        from bench.common.store import distinct_results
        return distinct_results(rows)
    store = ResultStore(p, check=True, readonly=True)
    rows = store.rows(latest=True)
    if store.unreadable:
        raise UserError(f"{p}: {store.unreadable} stored row(s) cannot be decoded; the gate will not compare a "
                        f"partly readable store. Recover it or compare JSON exports.")
    check_rows(rows, str(p))
    return rows


def _numbers(v) -> bool:
    return isinstance(v, list) and all(isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
                                       for x in v)


def check_rows(rows: list[Row], source: str) -> None:
    """Every field the gate reads, of the type it reads it as; the same measurement given twice refused (which
    would win is an accident of order). Bad input is exit 2 naming the row and the field, never a traceback
    with the gate's 'regression' exit 1."""
    seen: set = set()
    for i, r in enumerate(rows):
        where = f"{source}: row {i} ({r.method} {r.scheme} {r.dataset} {r.metric})"
        for f in ("model", "method", "scheme", "dataset", "metric"):
            if not isinstance(getattr(r, f), str):
                raise UserError(f"{source}: row {i}: {f} is {getattr(r, f)!r}, not a string.")
        for f in ("config", "versions", "hardware"):
            if not isinstance(getattr(r, f), dict):
                raise UserError(f"{where}: {f} is a {type(getattr(r, f)).__name__}, not an object.")
        if r.seed is not None and (isinstance(r.seed, bool) or not isinstance(r.seed, int)):
            raise UserError(f"{where}: seed is {r.seed!r}, not an integer.")
        c = r.config
        for section in ("kl", "eval", "precision"):
            if section in c and c[section] is not None and not isinstance(c[section], dict):
                raise UserError(f"{where}: config {section} is a {type(c[section]).__name__}, not an object.")
        samples = _samples(r)
        if samples is not None and not _numbers(samples):
            raise UserError(f"{where}: its per-window or per-example values are not a list of finite numbers.")
        _check_value(r, samples, where)
        key = (row_key(r), r.run_id, r.created_at)
        if key in seen:
            raise UserError(f"{where} appears twice (the same measurement: same run and time); which one the gate "
                            f"should read is not clear. Remove the duplicate.")
        seen.add(key)


def _check_value(r: Row, samples, where: str) -> None:
    """A value its metric cannot take (a negative perplexity, top-1 agreement over 100 %), or that the windows
    or examples stored with it cannot have given, is a damaged or edited row: exit 2, never a verdict on it."""
    from bench.evaluations.evals import metric
    m = metric(r.metric)
    if r.value is None:
        return
    if m.outside_bounds(r.value):
        raise UserError(f"{where}: value {r.value!r} is outside what {m.label} can take ({m.bounds_text()}): the "
                        f"row is damaged or was edited. Export it again from its results store.")
    why = m.unexplained(samples, r.value) if m.applies_to(r.dataset) else ""
    if why:
        raise UserError(f"{where}: {why}: the value or its windows were edited, or come from different "
                        f"measurements. Export the row again from its results store.")


def latest(rows: list[Row]) -> dict[Key, float | None]:
    return {k: r.value for k, r in latest_rows(rows).items()}


def latest_rows(rows: list[Row]) -> dict[Key, Row]:
    """The newest row per key (bench.common.store.row_key: a bf16 and an fp32 result are different cells)."""
    out: dict[Key, Row] = {}
    for r in rows:   # oldest first: later rows win
        out[row_key(r)] = r
    return out


def _samples(r: Row):
    """The per-window / per-example values a row keeps, where its metric's declaration says (bench.evaluations.evals)."""
    from bench.evaluations.evals import metric
    return metric(r.metric).samples_of(r.config or {})


def annotate(diffs: list[Diff], base: dict[Key, Row], cur: dict[Key, Row]) -> None:
    """Fill each diff's intervals and paired change from the rows' windows/examples (where stored)."""
    from bench.evaluations.evals import metric
    for d in diffs:
        b, c = base.get(d.key), cur.get(d.key)
        m = metric(d.key[5])
        if m.interval is None or not m.applies_to(d.key[4]):
            continue
        pct = m.comparison == "pt"
        f = (lambda v: f"{100 * v:.1f}") if pct else (lambda v: f"{v:.4g}")
        for row, attr in ((b, "base_ci"), (c, "cur_ci")):
            if row is not None and row.value is not None:
                e = m.estimate(_samples(row), row.value)
                setattr(d, attr, f"{f(e.lo)}-{f(e.hi)}" if e.known else "?")
        if b is not None and c is not None:
            p = m.paired(_samples(c), _samples(b))
            if p is not None and p.lo is not None:
                d.paired = (f"{100 * p.effect:+.1f} pt [{100 * p.lo:+.1f}, {100 * p.hi:+.1f}]" if pct else
                            f"{p.effect:.4f}x [{p.lo:.4f}, {p.hi:.4f}]" if m.comparison == "ratio" else
                            f"{p.effect:+.5f} [{p.lo:+.5f}, {p.hi:+.5f}]")
                d.outside = p.separated


_TOL_KEYS = {"direction", "rel", "abs"}


def load_tolerances(path: str | Path | None) -> dict[str, dict]:
    """The [metrics.<name>] tables of a tolerance file, every value checked: bad input is exit 2 naming the
    offending key (never a traceback that would read as the gate's 'regression' exit 1)."""
    p = Path(path) if path else DEFAULT_TOLERANCES
    try:
        doc = tomllib.loads(p.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UserError(f"tolerance file {p} does not exist.") from None
    except IsADirectoryError:
        raise UserError(f"tolerance file {p} is a folder: pass the .toml file (e.g. reports/tolerances.toml).") from None
    except UnicodeDecodeError as e:
        raise UserError(f"tolerance file {p} is not UTF-8 text ({e.reason} at byte {e.start}).") from None
    except OSError as e:
        raise UserError(f"cannot read the tolerance file {p}: {e.strerror or e}.") from None
    except tomllib.TOMLDecodeError as e:
        raise UserError(f"tolerance file {p} is not valid TOML ({e}).") from None
    tol = doc.get("metrics", {})
    if not isinstance(tol, dict):
        raise UserError(f"{p}: `metrics` must be a table of [metrics.<name>] tables, got {type(tol).__name__} "
                        f"{tol!r}.")
    for name, t in tol.items():
        where = f"{p}: [metrics.{name}]"
        if not isinstance(t, dict):
            raise UserError(f"{where} must be a table (direction, rel, abs), got {type(t).__name__} {t!r}: write "
                            f"[metrics.{name}] then direction = \"lower\" and rel = ... on their own lines.")
        unknown = set(t) - _TOL_KEYS
        if unknown:
            raise UserError(f"{where} has unknown key(s) {', '.join(sorted(unknown))}: use rel and abs (and direction "
                            f"for a metric the catalogue does not know).")
        from bench.evaluations.evals import METRICS
        if name in METRICS:
            catalogue = METRICS[name].gate_direction
            if t.get("direction", catalogue) != catalogue:
                raise UserError(f"{where}.direction = {t.get('direction')!r}, but {name} is {catalogue} is better "
                                f"(bench.evaluations.evals): leave direction out.")
            t = tol[name] = dict(t, direction=catalogue)
        elif t.get("direction", "lower") not in ("lower", "higher", "both"):
            raise UserError(f"{where}.direction = {t.get('direction')!r}: use lower, higher or both.")
        for key in ("rel", "abs"):
            v = t.get(key, 0.0)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise UserError(f"{where}.{key} = {v!r}: a tolerance is a finite number >= 0 (e.g. {key} = 0.01).")
    return tol


def check_tolerance_names(tol: dict[str, dict], rows_metrics: set[str], source: str) -> None:
    """A tolerance for a metric nobody stores is a typo that would switch the gate off for the metric meant;
    tolerances that cover none of the compared metrics leave the gate checking nothing: both exit 2."""
    import difflib
    known = known_metrics() | rows_metrics
    for name in tol:
        if name not in known:
            close = difflib.get_close_matches(name, sorted(known), n=1)
            raise UserError(f"{source}: [metrics.{name}] names no metric the suite stores"
                            + (f"; did you mean {close[0]!r}?" if close else ".")
                            + f" Metrics in these results: {', '.join(sorted(rows_metrics)) or 'none'}.")
    if rows_metrics and not set(tol) & rows_metrics:
        raise UserError(f"{source} covers none of the {len(rows_metrics)} metrics in these results "
                        f"({', '.join(sorted(rows_metrics))}): the gate would check nothing. Add a [metrics.<name>] "
                        f"table for the metrics to gate.")


def compare(base: dict[Key, float | None], cur: dict[Key, float | None], tol: dict[str, dict],
            allow_missing: bool = False) -> list[Diff]:
    diffs = []
    for key in sorted(set(base) | set(cur)):
        b, c = base.get(key), cur.get(key)
        t = tol.get(key[5])
        if key not in cur:
            diffs.append(Diff(key, b, None, "ok" if allow_missing or t is None else "missing"))
            continue
        if key not in base:
            diffs.append(Diff(key, None, c, "new"))
            continue
        if t is None:
            diffs.append(Diff(key, b, c, "untracked"))
            continue
        if b is None or not math.isfinite(b):   # a gate against nothing passes everything (or fails anything)
            raise UserError(f"the baseline value of {' '.join(map(str, key))} is {'null' if b is None else b}: a "
                            f"baseline must be finite, never null or NaN (regenerate it from a results store, which "
                            f"holds neither).")
        if c is None:
            diffs.append(Diff(key, b, c, "regressed"))
            continue
        if not math.isfinite(c):   # NaN compares false with everything: it must fail, never pass as "ok"
            diffs.append(Diff(key, b, c, "regressed"))
            continue
        allowed = max(float(t.get("abs", 0.0)), float(t.get("rel", 0.0)) * abs(b))
        direction = t.get("direction", "lower")
        worse = {"lower": c - b, "higher": b - c, "both": abs(c - b)}[direction]
        better = {"lower": b - c, "higher": c - b, "both": 0.0}[direction]
        status = "regressed" if worse > allowed else ("improved" if better > allowed else "ok")
        diffs.append(Diff(key, b, c, status, allowed))
    return diffs


def markdown(diffs: list[Diff], show_all: bool = False) -> str:
    shown = [d for d in diffs if show_all or d.status in ("regressed", "improved", "missing", "new")]
    counts = {s: sum(d.status == s for d in diffs) for s in ("ok", "regressed", "improved", "missing", "new",
                                                             "untracked")}
    head = ("**REGRESSION**" if counts["regressed"] or counts["missing"] else "no regression") + ": " + ", ".join(
        f"{v} {k}" for k, v in counts.items() if v)
    if not shown:
        return head + "\n"
    lines = [head, "", "| model | method | scheme | precision | dataset | metric | seed | baseline (95 %) | current (95 %) | "
             "delta | allowed | status | paired change (95 %) | outside the paired interval |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    fmt = lambda v: "-" if v is None else f"{v:.6g}"  # noqa: E731
    with_ci = lambda v, ci: fmt(v) + (f" ({ci})" if ci else "")  # noqa: E731
    for d in shown:
        outside = "-" if d.outside is None else ("yes" if d.outside else "no")
        lines.append("| " + " | ".join([*map(str, d.key), with_ci(d.base, d.base_ci), with_ci(d.cur, d.cur_ci),
                                        fmt(d.delta), fmt(d.allowed), d.status, d.paired or "-", outside]) + " |")
    return "\n".join(lines) + "\n"


def identity_changes(base: dict[Key, Row], cur: dict[Key, Row]) -> dict[Key, list[str]]:
    """Per key both sides hold: the parts of the two results' identities (bench.common.identity) that differ, the
    code version aside (a code change is what the gate is for). Parts a row never recorded are not compared."""
    from bench.common.identity import COMPARABLE_ACROSS, of_row
    out = {}
    for k in sorted(set(base) & set(cur)):
        diff = [p for p in of_row(base[k]).differences(of_row(cur[k])) if p not in COMPARABLE_ACROSS]
        if diff:
            out[k] = diff
    return out


def _describe_change(b: Row, c: Row, parts: list[str]) -> str:
    from bench.common.identity import of_row, settings_label
    out = []
    for p in parts:
        if p == "settings":
            sb, sc = (json.loads(of_row(r)["settings"]) for r in (b, c))
            out.append(f"settings {settings_label([sb, sc], sb) or '?'} -> {settings_label([sb, sc], sc) or '?'}")
        else:
            out.append(p)
    return "; ".join(out)


def _differing_parts(changes: dict[Key, list[str]]) -> str:
    return ", ".join(sorted({p for parts in changes.values() for p in parts}))


def _refuse_identity_changes(changes: dict[Key, list[str]], base: dict[Key, Row], cur: dict[Key, Row]) -> None:
    cells: dict[tuple, str] = {}
    for k, parts in changes.items():
        cells.setdefault(k[:4] + (k[6],), _describe_change(base[k], cur[k], parts))
    listed = "; ".join(f"{' '.join(map(str, c[:3]))} ({c[3]}, seed {c[4]}): {d}" for c, d in list(cells.items())[:5])
    raise UserError(f"the baseline and the current results of {len(cells)} cell(s) come from different identities "
                    f"(they differ in {_differing_parts(changes)}), so a change between them is not a regression of the code: "
                    f"{listed}{' ...' if len(cells) > 5 else ''}. Compare results of the same settings, model, data "
                    f"and evaluation, or pass --allow-settings-change to compare them on purpose (the output says so).")


def gate(baseline: str | Path, current: str | Path, tolerances: str | Path | None = None,
         allow_missing: bool = False, show_all: bool = False, allow_settings_change: bool = False
         ) -> tuple[int, str]:
    """(exit code, Markdown): 1 when anything regressed or went missing, else 0. Values whose results differ in
    identity (other settings, model, data, evaluation) are refused (exit 2) unless `allow_settings_change`."""
    base, cur = latest_rows(load_rows(baseline)), latest_rows(load_rows(current))
    changes = identity_changes(base, cur)
    if changes and not allow_settings_change:
        _refuse_identity_changes(changes, base, cur)
    tol = load_tolerances(tolerances)
    check_tolerance_names(tol, {k[5] for k in base} | {k[5] for k in cur},
                          str(tolerances or "the default tolerances (reports/tolerances.toml)"))
    if not set(base) & set(cur):
        raise UserError(f"nothing to compare: {baseline} ({len(base)} values) and {current} ({len(cur)} values) share "
                        f"no cell, metric and seed" + (" (--allow-missing hides missing values; it cannot make an "
                                                       "empty comparison pass)" if allow_missing else "")
                        + ". Check that both name the same model, methods, schemes and precision.")
    diffs = compare({k: r.value for k, r in base.items()}, {k: r.value for k, r in cur.items()}, tol, allow_missing)
    annotate(diffs, base, cur)
    bad = any(d.status in ("regressed", "missing") for d in diffs)
    text = markdown(diffs, show_all)
    if changes:
        text += (f"\nCompared across different identities on purpose (--allow-settings-change): {len(changes)} "
                 f"value(s) whose results differ in {_differing_parts(changes)}, so their changes are not the code's alone.\n")
    return (1 if bad else 0), text
