"""The identity of a stored result: everything that produced its number, read back from its row.

A row's name (model, method, scheme, precision, dataset, metric, seed) is what a reader sees; its identity is what
made the number: the model's fingerprint (every weight file the loader could read), the method and its typed
settings, the scheme, the precision, the calibration (settings and the SHA-256 of the tokens drawn), the seed, the
evaluation settings and the fingerprints of the data the unit read, and the code versions. Two results of one name
whose identities differ are different results: the store, the leaderboard, `compare` and the claims page keep them
apart (`distinct`) and say what differs (`smoothquant w8a8 (alpha=0.3)`), never show the newest as if it were the
other.

Rows written since identities were recorded carry the unit's identity exactly as its store key hashes it
(`config["identity"]`); older rows are read from the configuration they store (settings, calibration, evaluation),
and a part they never recorded (a folder model's fingerprint, a text's hash) is unknown: it never separates two
results, and `differences` does not name it.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Any

# parts that make a cell (shared by its units) and parts of one unit (an evaluation of the cell)
CELL_PARTS = ("model", "method", "settings", "scheme", "precision", "calibration", "seed", "code")
UNIT_PARTS = ("evaluation", "data")
PARTS = CELL_PARTS + UNIT_PARTS
# what `compare` lets differ between a baseline and the current results: the gate's purpose is a code change
COMPARABLE_ACROSS = ("code",)

_CALIB_FIELDS = ("dataset", "n_samples", "seq_len", "sampling", "tokens_sha256", "bos")
_EVAL_FIELDS = ("seq_len", "include_partial", "max_tokens", "head", "bos")
_TASK_FIELDS = ("names", "limit", "batch_size", "max_length", "add_bos_token")


def canonical(value: Any) -> str:
    """One text per value (sorted keys, -0.0 as 0.0, integral floats as integers): the parts' comparison form."""
    def norm(v):
        if isinstance(v, float) and v.is_integer():
            return int(v)
        if isinstance(v, dict):
            return {str(k): norm(x) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return [norm(x) for x in v]
        return v
    return json.dumps(norm(value), sort_keys=True, separators=(",", ":"), default=str)


def digest(value: Any, n: int = 8) -> str:
    return hashlib.sha256(canonical(value).encode()).hexdigest()[:n]


@lru_cache(maxsize=4096)
def _keyed(method: str, settings: str) -> str:
    """The settings a method's identity hashes (its execution settings left out), as canonical text."""
    cfg = json.loads(settings)
    try:
        from lrq.methods import method_class
        cfg = method_class(method.split("@")[0]).keyed_settings(cfg)
    except Exception:  # noqa: BLE001 - a checkpoint's derived name, a method no longer here: its settings as stored
        pass
    return canonical(cfg)


def _model(row, ident: dict) -> str | None:
    if "model" in ident:
        return str(ident["model"])
    cfg = row.config if isinstance(row.config, dict) else {}
    source = cfg.get("model_source")
    from bench.common.models import BUILTINS, model_fingerprint
    if row.model in BUILTINS and source == f"pypi:{model_fingerprint(row.model)}":
        return model_fingerprint(row.model)   # a built-in's fingerprint is its pinned release, as its source says
    return f"source:{source}" if source else None


def _unit_parts(cfg: dict, ident: dict) -> tuple[str | None, str | None]:
    """(evaluation settings, data fingerprints) of the unit a row belongs to, canonical; None where unknown."""
    ev = cfg.get("eval") if isinstance(cfg.get("eval"), dict) else None
    tasks = cfg.get("tasks") if isinstance(cfg.get("tasks"), dict) else None
    evaluation = None
    if ev is not None:
        evaluation = canonical({k: ev.get(k) for k in _EVAL_FIELDS if k in ev})
    elif tasks is not None:
        evaluation = canonical({k: tasks.get(k) for k in _TASK_FIELDS if k in tasks})
    data = ident.get("task_data") or (ident.get("data") if ("dataset" in ident or "tasks" in ident) else None)
    return evaluation, (canonical(data) if data is not None else None)


@dataclass(frozen=True)
class Identity:
    """A result's identity: part -> canonical text (None: not recorded by the row)."""
    parts: tuple[tuple[str, str | None], ...]

    def __getitem__(self, part: str) -> str | None:
        return dict(self.parts)[part]

    def cell(self) -> tuple:
        return tuple(v for k, v in self.parts if k in CELL_PARTS)

    def differences(self, other: "Identity", parts=PARTS) -> list[str]:
        """The parts known on both sides that differ (evaluation settings: on the fields both rows record; a row
        stored before a field existed, the output head's precision or BOS, says nothing about it)."""
        a, b = dict(self.parts), dict(other.parts)
        out = []
        for p in parts:
            if a.get(p) is None or b.get(p) is None or a[p] == b[p]:
                continue
            if p == "evaluation":
                x, y = json.loads(a[p]), json.loads(b[p])
                if all(x[k] == y[k] for k in set(x) & set(y)):
                    continue
            out.append(p)
        return out


def of_row(row) -> Identity:
    """The identity of a stored row (see the module docstring)."""
    cfg = row.config if isinstance(row.config, dict) else {}
    ident = cfg.get("identity") if isinstance(cfg.get("identity"), dict) else {}
    settings = cfg.get("method_config") if isinstance(cfg.get("method_config"), dict) else {}
    calib = cfg.get("calibration") if isinstance(cfg.get("calibration"), dict) else None
    # the method's code version (an evaluation's version is in its unit's store key, and the leaderboard marks
    # results of older evaluation code: `bench.reports.report.older_versions`)
    code = {"method": cfg.get("method_version") or 1} if row.method != "fp" else {}
    evaluation, data = _unit_parts(cfg, ident)
    parts = {
        "model": _model(row, ident),
        "method": row.method,
        "settings": _keyed(row.method, canonical(settings)) if row.method != "fp" else canonical({}),
        "scheme": row.scheme,
        "precision": row.precision,
        "calibration": canonical({k: calib.get(k) for k in _CALIB_FIELDS if k in calib}) if calib else canonical(None),
        "seed": str(row.seed or 0),
        "code": canonical(code),
        "evaluation": evaluation,
        "data": data,
    }
    return Identity(tuple(parts.items()))


def settings_label(settings: list[dict], mine: dict) -> str:
    """The settings in which `mine` differs from the others of `settings` (`alpha=0.3, steps=100`)."""
    keys = sorted({k for s in settings for k in s})
    differing = [k for k in keys if len({canonical(s.get(k)) for s in settings}) > 1]
    return ", ".join(f"{k}={_short(mine.get(k, 'default'))}" for k in differing)


def _short(v) -> str:
    if isinstance(v, float):
        return f"{v:g}"
    text = v if isinstance(v, str) else canonical(v)
    return text if len(text) <= 24 else text[:21] + "..."


def _fingerprint_tag(fp: str) -> str:
    tail = fp.rsplit(":", 1)[-1]
    return tail[:8] if len(tail) >= 8 and all(c in "0123456789abcdef" for c in tail[:8]) else digest(fp)


def distinct(rows: list) -> list:
    """`rows` with the names of results of different identities made different, so that nothing keyed by a row's
    name (`bench.common.store.row_key`: the newest value per name, a leaderboard row, the gate's key) mixes two
    identities:

    - a model name whose rows carry several model fingerprints: each becomes `name@<fingerprint>` (an FP row pairs
      only with cells of its own weights: they share a section);
    - a cell name (model, method, scheme, precision, seed) with several cell identities: the method is named with
      what differs, `smoothquant (alpha=0.3)`, `lrq (calibration 3a4b5c6d)`, `gptq (v2)`;
    - a unit of one cell measured on two versions of a text: `method (wikitext2 data 1a2b3c4d)`.

    Names that are not ambiguous are left as they are, so a store of one identity per name renders as before."""
    if not rows:
        return rows
    ids = [of_row(r) for r in rows]
    rows = _split_models(rows, ids)
    rows = _split_cells(rows, ids)
    return _split_data(rows, ids)


def _split_models(rows: list, ids: list[Identity]) -> list:
    fps: dict[str, set[str]] = {}
    for r, i in zip(rows, ids):
        if i["model"] is not None:
            fps.setdefault(r.model, set()).add(i["model"])
    clash = {m for m, s in fps.items() if len(s) > 1}
    if not clash:
        return rows
    return [replace(r, model=f"{r.model}@{_fingerprint_tag(i['model'])}") if r.model in clash and i["model"] else r
            for r, i in zip(rows, ids)]


def _cell_name(r) -> tuple:
    return (r.model, r.method, r.scheme, r.precision, r.seed or 0)


def _split_cells(rows: list, ids: list[Identity]) -> list:
    groups: dict[tuple, dict[tuple, Identity]] = {}
    for r, i in zip(rows, ids):
        groups.setdefault(_cell_name(r), {})[i.cell()] = i
    clash = {name: list(cells.values()) for name, cells in groups.items() if len(cells) > 1}
    if not clash:
        return rows
    labels: dict[tuple, dict[tuple, str]] = {name: _cell_labels(cells) for name, cells in clash.items()}
    return [replace(r, method=f"{r.method} ({labels[_cell_name(r)][i.cell()]})") if _cell_name(r) in labels else r
            for r, i in zip(rows, ids)]


def _cell_labels(cells: list[Identity]) -> dict[tuple, str]:
    """A short label per cell identity of one name: what differs among them."""
    settings = [json.loads(c["settings"]) for c in cells]
    out = {}
    for c, s in zip(cells, settings):
        bits = []
        if len({x["settings"] for x in cells}) > 1:
            bits.append(settings_label(settings, s) or "settings " + digest(c["settings"]))
        if len({x["calibration"] for x in cells}) > 1:
            bits.append("calibration " + digest(c["calibration"]))
        if len({x["code"] for x in cells}) > 1:
            bits.append(f"v{json.loads(c['code']).get('method', 1)}")
        out[c.cell()] = ", ".join(bits)
    if len(set(out.values())) < len(out):   # two identities the label does not tell apart: name them by digest
        out = {k: (v + " " if v else "") + digest(k) for k, v in out.items()}
    return out


def _split_data(rows: list, ids: list[Identity]) -> list:
    seen: dict[tuple, set[str]] = {}
    for r, i in zip(rows, ids):
        if i["data"] is not None:
            seen.setdefault(_cell_name(r) + (r.dataset,), set()).add(i["data"])
    clash = {k for k, s in seen.items() if len(s) > 1}
    if not clash:
        return rows
    return [replace(r, method=f"{r.method} ({r.dataset} data {digest(i['data'])})")
            if _cell_name(r) + (r.dataset,) in clash and i["data"] is not None else r for r, i in zip(rows, ids)]
