"""Regression gate: compare current results with a baseline under per-metric tolerances.

Inputs are results stores (.sqlite) or JSON exports (`lrq-bench results --json`, or the committed
reference files under reports/reference/). Rows are matched on (model, method, scheme, dataset, metric),
newest row per key. Tolerances come from a TOML file (reports/tolerances.toml by default):

    [metrics.ppl]
    direction = "lower"     # lower is better; "higher" for accuracy; "both" for values that must not move
    rel = 0.01              # allowed worsening, relative to the baseline value ...
    abs = 0.0               # ... or absolute, whichever is larger

A metric missing from the tolerances is reported but never fails the gate (timings, throughput).
A key present in the baseline but absent now is a regression (a cell silently disappeared), unless
`--allow-missing`.
"""

from __future__ import annotations

import json
import tomllib
from dataclasses import dataclass
from pathlib import Path

from bench.store import ResultStore, Row
from lrq.errors import UserError

DEFAULT_TOLERANCES = Path(__file__).resolve().parent.parent / "reports" / "tolerances.toml"
Key = tuple[str, str, str, str, str]


@dataclass
class Diff:
    key: Key
    base: float | None
    cur: float | None
    status: str          # ok, regressed, improved, missing, new, untracked
    allowed: float | None = None

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
        return [Row(**{k: v for k, v in d.items() if k in fields}) for d in data]
    store = ResultStore(p, check=True)
    rows = store.rows(latest=True)
    if store.unreadable:
        raise UserError(f"{p}: {store.unreadable} stored row(s) cannot be decoded; the gate will not compare a "
                        f"partly readable store. Recover it or compare JSON exports.")
    return rows


def latest(rows: list[Row]) -> dict[Key, float | None]:
    out: dict[Key, float | None] = {}
    for r in rows:   # oldest first: later rows win
        out[(r.model, r.method, r.scheme, r.dataset, r.metric)] = r.value
    return out


def load_tolerances(path: str | Path | None) -> dict[str, dict]:
    p = Path(path) if path else DEFAULT_TOLERANCES
    try:
        tol = tomllib.loads(p.read_text()).get("metrics", {})
    except FileNotFoundError:
        raise UserError(f"tolerance file {p} does not exist.") from None
    except tomllib.TOMLDecodeError as e:
        raise UserError(f"tolerance file {p} is not valid TOML ({e}).") from None
    for name, t in tol.items():
        if t.get("direction", "lower") not in ("lower", "higher", "both"):
            raise UserError(f"{p}: metric {name!r} has direction {t.get('direction')!r}; use lower, higher or both.")
    return tol


def compare(base: dict[Key, float | None], cur: dict[Key, float | None], tol: dict[str, dict],
            allow_missing: bool = False) -> list[Diff]:
    diffs = []
    for key in sorted(set(base) | set(cur)):
        b, c = base.get(key), cur.get(key)
        t = tol.get(key[4])
        if key not in cur:
            diffs.append(Diff(key, b, None, "ok" if allow_missing or t is None else "missing"))
            continue
        if key not in base:
            diffs.append(Diff(key, None, c, "new"))
            continue
        if t is None:
            diffs.append(Diff(key, b, c, "untracked"))
            continue
        if b is None or c is None:
            diffs.append(Diff(key, b, c, "ok" if b is None and c is None else "regressed"))
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
    lines = [head, "", "| model | method | scheme | dataset | metric | baseline | current | delta | allowed | status |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    fmt = lambda v: "-" if v is None else f"{v:.6g}"  # noqa: E731
    for d in shown:
        lines.append("| " + " | ".join(list(d.key) + [fmt(d.base), fmt(d.cur), fmt(d.delta), fmt(d.allowed),
                                                        d.status]) + " |")
    return "\n".join(lines) + "\n"


def gate(baseline: str | Path, current: str | Path, tolerances: str | Path | None = None,
         allow_missing: bool = False, show_all: bool = False) -> tuple[int, str]:
    """(exit code, Markdown): 1 when anything regressed or went missing, else 0."""
    diffs = compare(latest(load_rows(baseline)), latest(load_rows(current)), load_tolerances(tolerances),
                    allow_missing)
    bad = any(d.status in ("regressed", "missing") for d in diffs)
    return (1 if bad else 0), markdown(diffs, show_all)
