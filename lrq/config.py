"""Typed method settings: one frozen dataclass per method, parsed once.

A method's settings are a `MethodConfig` subclass declared beside the method's code, its presets instances of it:

    @dataclass(frozen=True)
    class LRQConfig(ReconConfig):
        rank_rule: Literal["official", "llama2-7b-like", "uniform", "fraction"] = "fraction"
        rank: int = setting(1024, lo=1)

`parse(preset_instance, overrides)` is the one place a value given as text (`--set rank=64`, a profile's
settings) or in Python (`lrq.quantize(..., iters=200)`) becomes a typed value: converted by the field's
annotation, checked against its range or words, normalised (`lr=5e-4` and `lr=0.0005` are the same float,
so the same cell), and checked as a whole (`MethodConfig.validate`). A bad value is a UserError (exit 2)
naming the setting and what it takes, before any work. Words are exact: `rank_rule=Official` is refused
with the nearest valid word, never lowered silently in one place and not in another; only the spellings of
true and false (on/off, yes/no, 1/0) are case-free.

What a result's identity hashes (`keyed`) is the settings as a plain dict, without the execution settings
(how a cell runs, not what it computes: torch.compile of the block step) and without settings added after
results were stored while they sit at the value that computes what those results computed (`neutral`).
The dicts are the ones earlier releases hashed, so their stores and checkpoints are still found.

A config is also a read-only Mapping (`cfg["iters"]`, `dict(cfg)`, `cfg == {...}`), for records and for code
reading stored rows, and `cfg | {"iters": 3}` is a parsed copy.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from decimal import Decimal
from functools import lru_cache
from typing import Any, Literal, Union

from lrq.errors import UserError

AUTO = "auto"
TRUE_WORDS, FALSE_WORDS = ("true", "1", "yes", "on"), ("false", "0", "no", "off")
_UNSET = object()


def setting(default: Any, *, lo: float | None = None, hi: float | None = None, lo_open: bool = False,
            execution: bool = False, fixed: bool = False, neutral: Any = _UNSET, doc: str = "") -> Any:
    """A dataclass field with what the parser needs beyond the annotation: a numeric range ([lo, hi], lo
    excluded where lo_open), whether it is an execution setting, whether it is not a --set value (`fixed`:
    the preset), and its neutral value (a setting added after results were stored)."""
    meta = {"lo": lo, "hi": hi, "lo_open": lo_open, "execution": execution, "fixed": fixed, "doc": doc}
    if neutral is not _UNSET:
        meta["neutral"] = neutral
    return field(default=default, metadata=meta)


@dataclass(frozen=True, eq=False)
class MethodConfig(Mapping):
    """The settings of a method (subclasses add the fields). Immutable; build with `parse`."""

    # ---- the Mapping view (records, stored rows, tests) ----------------------------------------------------
    def __getitem__(self, key: str) -> Any:
        if key not in _names(type(self)):
            raise KeyError(key)
        return getattr(self, key)

    def __iter__(self):
        return iter(_names(type(self)))

    def __len__(self) -> int:
        return len(_names(type(self)))

    def __or__(self, other: Mapping) -> "MethodConfig":
        return parse(self, other)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(f'{k}={getattr(self, k)!r}' for k in self)})"

    def as_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self}

    def replace(self, **changes: Any) -> "MethodConfig":
        """A copy with `changes` taken as they are (typed values decided in code, e.g. by `resolve`)."""
        return dataclasses.replace(self, **changes)

    # ---- identity ------------------------------------------------------------------------------------------
    @classmethod
    def keyed(cls, config: Mapping) -> dict[str, Any]:
        """`config` (this class's config, or a stored dict of its settings) as a result's identity hashes it:
        without the execution settings and without the later settings at their neutral value."""
        meta = _meta(cls)
        out = {}
        for k, v in config.items():
            m = meta.get(k, {})
            if m.get("execution") or ("neutral" in m and v == m["neutral"]):
                continue
            out[k] = v
        return out

    @classmethod
    def execution_settings(cls) -> tuple[str, ...]:
        return tuple(k for k, m in _meta(cls).items() if m.get("execution"))

    @classmethod
    def fixed_settings(cls) -> tuple[str, ...]:
        return tuple(k for k, m in _meta(cls).items() if m.get("fixed"))

    # ---- checks across settings ----------------------------------------------------------------------------
    def validate(self, method: str) -> None:
        """Refuse (UserError) a combination of values that cannot work; subclasses extend."""

    @classmethod
    def describe(cls, key: str) -> str:
        """What setting `key` takes, in words ("an integer >= 1", "one of on, off, auto")."""
        return _describe(_hints(cls)[key], _meta(cls)[key])


@lru_cache(maxsize=None)
def _names(cls: type) -> tuple[str, ...]:
    return tuple(f.name for f in fields(cls))


@lru_cache(maxsize=None)
def _meta(cls: type) -> dict[str, Mapping]:
    """Each setting's `setting(...)` metadata (range, execution, fixed, neutral)."""
    return {f.name: f.metadata for f in fields(cls)}


@lru_cache(maxsize=None)
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _options(tp: Any) -> list[Any]:
    """The alternatives of a union (X | Y, Optional) or [tp]."""
    if typing.get_origin(tp) in (Union, types.UnionType):
        return list(typing.get_args(tp))
    return [tp]


def _words(tp: Any) -> list[str]:
    return [w for o in _options(tp) if typing.get_origin(o) is Literal for w in typing.get_args(o)]


def _describe(tp: Any, meta: Mapping) -> str:
    parts = []
    kinds = [o for o in _options(tp) if typing.get_origin(o) is not Literal]
    for k in kinds:
        if k is bool:
            parts.append("true or false")
        elif k in (int, float):
            what = "an integer" if k is int else "a number"
            lo, hi, open_ = meta.get("lo"), meta.get("hi"), meta.get("lo_open")
            if lo is not None and hi is not None:
                what += f" in {'(' if open_ else '['}{lo:g}, {hi:g}]"
            elif lo is not None:
                what += f" {'>' if open_ else '>='} {lo:g}"
            parts.append(what)
        elif k is str:
            parts.append("a word")
        elif k is type(None):
            parts.append("none")
    words = _words(tp)
    if words and not kinds:
        return "one of " + ", ".join(words)
    if kinds == [bool]:   # a switch: its words, as the command line writes them
        return "on, off" + "".join(f" or {w}" for w in words) if words else "true or false"
    return " or ".join(parts + words)


def _bad(method: str, key: str, value: Any, cls: type, hint: str = "", in_range: bool = False) -> UserError:
    kinds = [o for o in _options(_hints(cls)[key]) if typing.get_origin(o) is not Literal]
    what = ("valid" if in_range or not kinds else
            {bool: "a boolean", int: "a valid int", float: "a valid float"}.get(kinds[0], "valid"))
    return UserError(f"{method}: --set {key}={value!r} is not {what}: {key} takes {cls.describe(key)}{hint}.")


def _number(value: Any, kind: type) -> int | float | None:
    """`value` as a finite number of `kind`, or None. A float's zero has one sign (`alpha=-0` is `alpha=0`: one
    cell, one store key); an integer is read exactly, never through a float (`rank=9007199254740993` is that
    integer, not ...992; `1e3` and `64.0` are integers too)."""
    if isinstance(value, bool):
        return None
    if kind is float:
        try:
            num = float(value)
        except (TypeError, ValueError):
            return None
        return num + 0.0 if math.isfinite(num) else None   # -0.0 + 0.0 is 0.0
    if isinstance(value, int):
        return value
    try:
        exact = Decimal(str(value).strip())
    except ArithmeticError:   # not a number
        return None
    if not exact.is_finite() or not math.isfinite(float(exact)) or exact != exact.to_integral_value():
        return None
    return int(exact)


def _convert(method: str, cls: type, key: str, value: Any) -> Any:
    """`value` as setting `key` of `cls` takes it, or UserError."""
    tp, meta = _hints(cls)[key], _meta(cls)[key]
    words = _words(tp)
    if isinstance(value, str) and value in words:
        return value
    kinds = [o for o in _options(tp) if typing.get_origin(o) is not Literal]
    text = value.strip() if isinstance(value, str) else None
    for k in kinds:
        if k is bool:
            if isinstance(value, bool):
                return value
            if text is not None and text.lower() in TRUE_WORDS + FALSE_WORDS:
                return text.lower() in TRUE_WORDS
        elif k in (int, float):
            num = _number(value, k)
            if num is None:
                continue
            lo, hi = meta.get("lo"), meta.get("hi")
            if (lo is not None and (num < lo or (meta.get("lo_open") and num == lo))) or (hi is not None and num > hi):
                raise _bad(method, key, value, cls, in_range=True)
            return num
        elif k is str:
            return str(value)
        elif k is type(None) and value is None:
            return None
    close = difflib.get_close_matches(text.lower(), words, n=1, cutoff=0.6) if text and words else []
    if not close and text and words:
        close = [w for w in words if w.lower() == text.lower()]
    raise _bad(method, key, value, cls, f" (words are exact: did you mean {close[0]!r}?)" if close else "")


def parse(base: MethodConfig, overrides: Mapping[str, Any] | None, method: str = "", strict: bool = False
          ) -> MethodConfig:
    """`base` (a preset) with `overrides` converted, checked and normalised: the one place settings are parsed.
    A key `base` lacks is skipped (a --set value meant for another of the selected methods; the caller checks
    the keys against all of them, lrq.methods.check_settings) unless `strict`. Returns a new config."""
    cls = type(base)
    method = method or cls.__name__
    names = _names(cls)
    fixed = cls.fixed_settings()
    changes = {}
    for k, v in (overrides or {}).items():
        if k not in names:
            if strict:
                raise UserError(f"{method}: no setting {k!r}; valid keys: {', '.join(n for n in names if n not in fixed)}.")
            continue
        if k in fixed:
            if v == getattr(base, k):
                continue
            raise UserError(f"{method}: {k} is not a --set value: choose it with --{k}.")
        changes[k] = _convert(method, cls, k, v)
    cfg = dataclasses.replace(base, **changes) if changes else base
    cfg.validate(method)
    return cfg
