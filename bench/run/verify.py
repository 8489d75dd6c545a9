"""A results file read like input from a stranger (`run --sync DIR`): every unit checked before any is imported.

A unit in `DIR/results.jsonl` becomes a result on this machine the moment it is imported: a finished cell is not
computed again, and the leaderboard shows it. So before anything is imported, each unit must be what its key says
and say nothing it could not have measured:

- its key follows from its configuration: a unit that records its identity (every unit stored since identities
  were recorded) hashes to its key and names the rows' model, method, settings, scheme, seed and text; an older
  unit's key is recomputed by settling the request its configuration describes, on this machine's model and data
  (`bench.run.cell.derived_keys`), and a unit whose key does not follow is refused;
- every value that is a function of the per-window or per-example values it keeps equals that function of them
  (perplexity = exp of the mean window NLL, KL divergence and top-1 agreement = the token-weighted means of the
  windows', an accuracy = the mean of its examples' scores);
- no NaN, null or infinity anywhere (arrays included), no value outside its metric's range (a perplexity below 1,
  a negative KL divergence or time, an agreement or accuracy outside [0, 1]), and no unit missing a metric its kind
  always has.

Any failure is a UserError naming the file's line and what is wrong; nothing is imported then.
"""

from __future__ import annotations

import math
from pathlib import Path

from bench.common.store import Row, unit_key
from bench.evaluations import evals as E
from lrq.errors import UserError

_REL = 1e-6   # window means are stored from float32 sums: a recomputation agrees to about 1e-7


def check_unit(key: str, rows: list[Row], where: str, data_dir: Path | None) -> None:
    """Every check of the module docstring on one unit; UserError naming `where` at the first failure."""
    for i, r in enumerate(rows):
        _finite_everywhere(r.config, f"{where}: row {i} ({r.dataset} {r.metric}) config")
        if r.value is None:
            raise UserError(f"{where}: row {i} ({r.dataset} {r.metric}) has no value (null): a stored result always "
                            f"has one, so this file was altered or damaged. Restore it from version control.")
        m = E.METRICS.get(r.metric)
        if m is not None and m.outside_bounds(r.value):   # the catalogue's bounds: one declaration per metric
            raise UserError(f"{where}: row {i}: {r.dataset} {r.metric} = {r.value!r} is outside the range such a value "
                            f"can take ({m.bounds_text()}): this file was altered or damaged. Restore it from version "
                            f"control.")
        _recomputed(r, f"{where}: row {i}")
    _complete(rows, where)
    _key_follows(key, rows, where, data_dir)


def _finite_everywhere(obj, where: str, depth: int = 0) -> None:
    """No NaN or infinity anywhere in `obj`, and no null among the numbers of an array."""
    if depth > 64:
        raise UserError(f"{where} is nested more than 64 levels deep: not a configuration the suite writes.")
    if isinstance(obj, float) and not math.isfinite(obj):
        raise UserError(f"{where} holds {obj!r}: a results file never holds a non-finite number.")
    if isinstance(obj, dict):
        for k, v in obj.items():
            _finite_everywhere(v, f"{where}.{k}", depth + 1)
    elif isinstance(obj, list):
        if None in obj and any(isinstance(v, (int, float)) and not isinstance(v, bool) for v in obj):
            raise UserError(f"{where} holds a null among its numbers (a NaN written as JSON): this file was altered "
                            f"or damaged. Restore it from version control.")
        for v in obj:
            _finite_everywhere(v, where, depth + 1)


def _weighted(values, weights) -> float | None:
    if not isinstance(values, list) or not values:
        return None
    if not isinstance(weights, list) or len(weights) != len(values) or not sum(weights):
        weights = [1] * len(values)
    return sum(v * w for v, w in zip(values, weights)) / sum(weights)


def _recomputed(r: Row, where: str) -> None:
    """A value that is a function of the windows or examples its row keeps (the catalogue's `samples`) equals it:
    a perplexity exp of the mean window NLL, a window mean (KLD, top-1 agreement) the token-weighted mean of the
    windows', an accuracy the mean of its examples' scores."""
    m = E.METRICS.get(r.metric)
    samples = m.samples_of(r.config or {}) if m is not None else None
    if not isinstance(samples, list) or not samples:
        return
    ev = (r.config or {}).get("eval")
    weights = ev.get("window_tokens") if m.interval == "mean" and isinstance(ev, dict) else None
    expected = _weighted(samples, weights)
    if m.interval == "ppl":
        expected = math.exp(expected)
    if abs(expected - r.value) > _REL * max(1.0, abs(expected)):
        raise UserError(f"{where}: {r.dataset} {r.metric} = {r.value!r}, but the per-window or per-example values it "
                        f"keeps give {expected!r}: the value or its windows were altered. Restore the file from "
                        f"version control.")


def _complete(rows: list[Row], where: str) -> None:
    """A unit holds every metric its kind always has."""
    from bench.evaluations.tasks import MAIN_METRIC
    metrics = {(r.dataset, r.metric) for r in rows}
    datasets = {r.dataset for r in rows}
    need: set[tuple[str, str]] = set()
    for ds in datasets:
        names = {m for d, m in metrics if d == ds}
        if ds == "quant":
            need |= {(ds, "bits_per_weight")} | ({(ds, "quant_time_s"), (ds, "quant_peak_rss_bytes")}
                                                 if rows[0].method != "fp" else set())
        elif ds in MAIN_METRIC:
            need.add((ds, MAIN_METRIC[ds]))
        elif names & set(text := (E.PERPLEXITY[ds] if ds in E.PERPLEXITY else E.Perplexity).metrics):
            need |= {(ds, m) for m in text}
        elif names & set(E.KL_METRICS):
            need |= {(ds, m) for m in E.KL_METRICS}
    missing = sorted(need - metrics)
    if missing:
        raise UserError(f"{where}: the unit lacks {', '.join(f'{d} {m}' for d, m in missing)}, which every unit of "
                        f"its kind holds: this file was altered or damaged. Restore it from version control.")


def _key_follows(key: str, rows: list[Row], where: str, data_dir: Path | None) -> None:
    cfg = rows[0].config or {}
    ident = cfg.get("identity")
    if ident is None:
        from bench.run.cell import derived_keys
        if key not in derived_keys(cfg, rows[0].dataset, data_dir).get(_unit_of(rows), ()):
            raise UserError(f"{where}: unit {key[:12]} does not follow from its configuration on this machine (its "
                            f"model, settings, data files and evaluation give other keys): it was altered, or "
                            f"measured on another model or other data than this machine has. Nothing was imported; "
                            f"restore the file from version control, or pass the --data-dir and model it was "
                            f"measured with.")
        return
    if not isinstance(ident, dict) or unit_key(ident) != key:
        raise UserError(f"{where}: unit {key[:12]}'s recorded identity does not hash to its key: the unit was altered. "
                        f"Nothing was imported; restore the file from version control.")
    _names_agree(ident, rows, where)


def _unit_of(rows: list[Row]) -> str:
    """Which unit of its cell a unit's rows are (bench.run.cell's names: quant, a text, a text's KL, tasks)."""
    from bench.evaluations.evals import TASK_ROWS
    from bench.run.cell import kl_unit
    r = rows[0]
    if r.dataset in TASK_ROWS:
        return "tasks"
    if any(x.metric in E.KL_METRICS for x in rows):
        return kl_unit(r.dataset)
    return r.dataset


def _names_agree(ident: dict, rows: list[Row], where: str) -> None:
    """The identity a unit records describes the rows it holds (their method, scheme, seed, settings, text)."""
    from bench.common.identity import canonical, of_row
    r = rows[0]
    cfg = r.config or {}
    wrong = []
    if ident.get("method") != r.method:
        wrong.append(f"method {ident.get('method')!r} against {r.method!r}")
    if ident.get("scheme") != r.scheme:
        wrong.append(f"scheme {ident.get('scheme')!r} against {r.scheme!r}")
    if ident.get("seed") != (r.seed or 0):
        wrong.append(f"seed {ident.get('seed')!r} against {r.seed!r}")
    if r.method != "fp" and canonical(ident.get("config")) != of_row(r)["settings"]:
        wrong.append("the settings")
    if "dataset" in ident and any(x.dataset != ident["dataset"] for x in rows):
        wrong.append(f"text {ident['dataset']!r}")
    if cfg.get("model") != r.model:
        wrong.append(f"model {cfg.get('model')!r} against {r.model!r}")
    if wrong:
        raise UserError(f"{where}: the unit's identity and its rows disagree ({'; '.join(wrong)}): the unit was "
                        f"altered. Nothing was imported; restore the file from version control.")
