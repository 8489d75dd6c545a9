"""The method interface and registry.

A method turns a floating-point model into one whose seven linears per block are QuantLinear modules
for a given scheme. It is described entirely by (scheme, config, calibration data): no state is kept
between calls, so every (model, method, scheme) cell is an independent job.

Methods register themselves with `@register`; `load_methods()` imports every module of the `baselines`
package and the LRQ/FlexRound modules, so a new method is a new file, not a change to the harness.
"""

from __future__ import annotations

import importlib
import math
import pkgutil
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar

import torch
from torch import nn

from lrq.errors import UserError
from lrq.schemes import Scheme


@dataclass
class Calibration:
    """Calibration token windows [n_samples, seq_len] and how they were drawn (recorded with results);
    `tokenizer`, when known, is the one that produced them (a method running another stack needs it)."""
    input_ids: torch.Tensor
    description: dict[str, Any] = field(default_factory=dict)
    tokenizer: Any = None


@dataclass(frozen=True)
class Rule:
    """What values a setting takes: a type (int, float, bool or str), a range, a set of words, and whether
    'auto' (decided per scheme by `resolve`) is allowed. `Method.config` checks every setting against its
    rule, so a bad --set value is exit 2 naming the setting and what it takes, before any work."""
    kind: type = str
    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False          # lo itself excluded
    choices: tuple[str, ...] | None = None
    auto: bool = False
    label: str | None = None       # how to say what it takes, where the choices are many spellings of few values

    def describe(self) -> str:
        if self.label:
            return self.label
        if self.choices:
            return "one of " + ", ".join(self.choices + (("auto",) if self.auto else ()))
        what = {int: "an integer", float: "a number", bool: "true or false", str: "a word"}[self.kind]
        if self.lo is not None and self.hi is not None:
            what += f" in {'(' if self.lo_open else '['}{self.lo:g}, {self.hi:g}]"
        elif self.lo is not None:
            what += f" {'>' if self.lo_open else '>='} {self.lo:g}"
        return what + (" or auto" if self.auto else "")

    def check(self, method: str, key: str, value: Any) -> Any:
        """`value` (as given on the command line or in Python) converted to the setting's type, or UserError."""
        if self.auto and isinstance(value, str) and value.strip().lower() == "auto":
            return "auto"
        bad = UserError(f"{method}: --set {key}={value!r} is not valid: {key} takes {self.describe()}.")
        if self.kind is bool:
            if isinstance(value, bool):
                return value
            word = str(value).strip().lower()
            if word in TRUE_WORDS + FALSE_WORDS:
                return word in TRUE_WORDS
            raise bad
        if self.choices:
            word = str(value).strip().lower()
            if word not in self.choices:
                raise bad
            return word
        if self.kind in (int, float):
            if isinstance(value, bool):
                raise bad
            try:
                num = float(value)
            except (TypeError, ValueError):
                raise bad from None
            if not math.isfinite(num) or (self.kind is int and num != int(num)):
                raise bad
            if self.lo is not None and (num < self.lo or (self.lo_open and num == self.lo)):
                raise bad
            if self.hi is not None and num > self.hi:
                raise bad
            return int(num) if self.kind is int else num
        return str(value)


def rules_for(defaults: dict[str, dict[str, Any]]) -> dict[str, Rule]:
    """A rule from each setting's default value where a method declares none: its type, nothing more."""
    out = {}
    for preset in defaults.values():
        for k, v in preset.items():
            if v is not None and k not in out:
                out[k] = Rule(type(v) if type(v) in (int, float, bool) else str)
    return out


class Method:
    """Base class. Subclasses set `name`, `defaults` (per preset) and implement `quantize`; what the harness
    needs to know about a method (calibration defaults, whether it checkpoints, its cost and memory for the
    planner, the report sections it feeds) it declares here, so the harness never names a method.

    An instance is configured once, at construction: `device` (where block-wise methods compute; when the
    model stays on the CPU and this is a CUDA device, the walk moves one block at a time to it and back,
    so device memory is bounded by one block plus a batch of activations; None: wherever the model is) and
    `checkpoint_dir` (where a resumable method keeps its per-block checkpoints; None: no checkpoints)."""

    name: ClassVar[str]
    summary: ClassVar[str] = ""
    # Settings by preset; every key can be overridden from the CLI (--set key=value) and is recorded.
    defaults: ClassVar[dict[str, dict[str, Any]]] = {"quick": {}, "paper": {}}
    # What each setting takes (type, range, words); settings without a rule are checked by their default's type.
    rules: ClassVar[dict[str, Rule]] = {}
    # Settings that are not --set values (the preset is its own option, --preset).
    fixed_settings: ClassVar[tuple[str, ...]] = ("preset",)
    # Settings that choose how the same computation runs, not what it computes (e.g. torch.compile): recorded
    # with every row like the others, but left out of the store key and the checkpoint identity, so turning
    # one on or off reuses and resumes earlier results (as running on another device does).
    execution_settings: ClassVar[tuple[str, ...]] = ()

    # Settings added after results were stored, at the value that computes what those results computed: a
    # setting at that value is left out of the identity, so the earlier results keep their keys.
    neutral_settings: ClassVar[dict[str, Any]] = {}

    @classmethod
    def keyed_settings(cls, config: dict[str, Any]) -> dict[str, Any]:
        """`config` without the execution settings (and the later settings at their neutral value): what a
        result's identity (store key, checkpoint) hashes."""
        return {k: v for k, v in config.items() if k not in cls.execution_settings
                and not (k in cls.neutral_settings and v == cls.neutral_settings[k])}
    # Calibration settings per preset that differ from the suite's (dataset, n_samples, seq_len, sampling).
    calib_defaults: ClassVar[dict[str, dict[str, Any]]] = {}
    # Coarse relative cost of one cell (1: no search, 5: a per-layer search, 10: block-wise training); parallel
    # executors start costly cells first.
    cost_rank: ClassVar[int] = 1
    # Resumes at the next block from `checkpoint_dir` after a crash.
    checkpoints: ClassVar[bool] = False
    # the method's output carries its own static activation ranges (a checkpoint read as it is): a static-activation
    # scheme then needs no calibration data to observe them
    provides_activation_ranges: ClassVar[bool] = False
    # Walks the model block by block with the calibration activations in memory (the planner's memory model).
    blockwise: ClassVar[bool] = False
    # Training state of one block (learnables; Adam doubles it twice more), as a fraction of its weights.
    learnable_fraction: ClassVar[float] = 0.0
    # The report shows this method's learnable-parameter count against the named method's, per scheme.
    compare_learnables_with: ClassVar[str | None] = None
    # Runs another stack in its own environment (an adapter): never in the default sweep, not priced by
    # the planner; named explicitly (`--methods llmc-gptq`).
    external: ClassVar[bool] = False

    def __init__(self, device: torch.device | str | None = None, checkpoint_dir: str | None = None):
        self.device = torch.device(device) if isinstance(device, str) else device
        self.checkpoint_dir = checkpoint_dir if self.checkpoints else None

    def display_name(self, config: dict[str, Any]) -> str:
        """The method's name in results (a method reading a checkpoint names it after the checkpoint)."""
        return self.name

    def compute_device(self, model: nn.Module) -> torch.device:
        return self.device if self.device is not None else next(model.parameters()).device

    # ---- what the planner needs (bench.plan): no method names there -----------------------------------
    def work(self, shape, scheme: Scheme | None, cfg: dict[str, Any], n: int, seq: int
             ) -> dict[str, tuple[float, float]]:
        """(calls, flops) per kind of work to quantize a model of `shape` (bench.plan.ModelShape) with n x seq
        calibration tokens. Kinds are timed by the planner's machine profile: "fwd" (whole-model forwards)
        and the kinds `profile` measures. The default: the static activation ranges of W8A8, if any."""
        return static_range_work(shape, scheme, n, seq)

    def profile(self, run: Callable[..., tuple[float, dict]], shape, scheme: Scheme, n: int, seq: int,
                steps: int = 6) -> dict[str, tuple[float, float, float]]:
        """(calls, flops, seconds) points of this method's own kinds of work; `run(**settings)` quantizes a
        copy of a small random model with the quick preset plus `settings` and returns (seconds, config);
        `steps`: training steps to time where the method trains."""
        return {}

    def extra_memory(self, shape) -> int:
        """Bytes beyond the weights, activation streams and training state at the method's peak."""
        return 0

    def resolve(self, scheme: Scheme, config: dict[str, Any]) -> dict[str, Any]:
        """The configuration with every 'auto' decided for `scheme` (what `quantize` will use)."""
        return dict(config)

    def config(self, preset: str, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
        """The preset's settings with `overrides` applied, every value checked against its rule (exit 2 on a
        bad one, before any work). A method without settings of its own for a preset takes its fallback's
        (PRESET_FALLBACK: the long preset is the paper settings for methods that do not train)."""
        preset_of = preset if preset in self.defaults else PRESET_FALLBACK.get(preset)
        if preset_of not in self.defaults:
            raise UserError(f"unknown preset {preset!r} for method {self.name}: choose from {', '.join(self.defaults)}.")
        cfg = dict(self.defaults[preset_of])
        rules = rules_for(self.defaults) | self.rules
        for k, v in (overrides or {}).items():
            if k not in cfg:
                continue  # an override meant for another method
            if k in self.fixed_settings:
                raise UserError(f"{self.name}: {k} is not a --set value: choose it with --{k} "
                                f"({', '.join(self.defaults)}).")
            # the value is kept as the default's type makes it (what earlier releases stored and hashed, so their
            # results are still found); the rule only refuses what cannot work
            cfg[k] = _coerce(self.name, k, cfg[k], v)
            if k in rules:
                rules[k].check(self.name, k, cfg[k])
        return cfg

    def check_calibration(self, config: dict[str, Any], n_samples: int, seq_len: int) -> None:
        """Refuse (UserError) settings that cannot work with n_samples x seq_len calibration windows."""

    def needs_calibration(self, scheme: Scheme) -> bool:
        """Whether the result depends on calibration data (it then becomes part of the cell's identity)."""
        return scheme.static_activations

    def quantize(self, model: nn.Module, scheme: Scheme, config: dict[str, Any],
                 calib: Calibration | None) -> dict[str, Any]:
        """Quantize `model` in place; return statistics worth storing (e.g. learnable-parameter counts)."""
        raise NotImplementedError


def static_range_work(shape, scheme: Scheme | None, n: int, seq: int, passes: int = 1) -> dict[str, tuple[float, float]]:
    """The whole-model forwards that observe W8A8's static activation ranges on n x seq tokens."""
    if scheme is None or not scheme.static_activations:
        return {}
    return {"fwd": (n * shape.layers, shape.model_fwd_flops(n * seq, seq) * passes)}


def add_work(work: dict[str, tuple[float, float]], kind: str, calls: float, flops: float) -> dict:
    c, f = work.get(kind, (0.0, 0.0))
    work[kind] = (c + calls, f + flops)
    return work


TRUE_WORDS, FALSE_WORDS = ("true", "1", "yes", "on"), ("false", "0", "no", "off")
PRESET_FALLBACK = {"long": "paper"}
# calibration of a preset for every method that has none of its own for it (the long preset: the same windows
# for LRQ, FlexRound, GPTQ and AWQ, so their cells compare on one calibration)
PRESET_CALIB: dict[str, dict[str, Any]] = {"long": {"dataset": "c4", "n_samples": 128, "seq_len": 1024,
                                                    "sampling": "sequential"}}


def _coerce(method: str, key: str, default: Any, value: Any) -> Any:
    """Convert a --set value to the type of the setting's default (booleans need explicit words)."""
    if default is None or isinstance(value, type(default)):
        return value
    if isinstance(default, bool):
        word = str(value).strip().lower()
        if word in TRUE_WORDS:
            return True
        if word in FALSE_WORDS:
            return False
        raise UserError(f"{method}: --set {key}={value!r} is not a boolean: use true or false.")
    try:
        return type(default)(value)
    except (TypeError, ValueError):
        raise UserError(f"{method}: --set {key}={value!r} is not a valid {type(default).__name__}.") from None


METHODS: dict[str, type[Method]] = {}
_LOADED = False


def register(cls: type[Method]) -> type[Method]:
    if cls.name in METHODS and METHODS[cls.name] is not cls:
        raise RuntimeError(f"two methods registered under the name {cls.name!r}")
    METHODS[cls.name] = cls
    return cls


def load_methods() -> dict[str, type[Method]]:
    global _LOADED
    if not _LOADED:
        import baselines
        for info in pkgutil.iter_modules(baselines.__path__):
            importlib.import_module(f"baselines.{info.name}")
        for mod in ("lrq.lrq", "lrq.flexround"):
            try:
                importlib.import_module(mod)
            except ModuleNotFoundError as e:
                if e.name != mod:
                    raise
        _LOADED = True
    return METHODS


def check_settings(keys, methods: list[str]) -> None:
    """Every key a setting of at least one of `methods` (any preset): an unknown key (a typo such as
    iter=5000) is a UserError naming the valid keys and the closest one, never silently ignored."""
    import difflib
    known: dict[str, list[str]] = {}
    for m in methods:
        for preset in method_class(m).defaults.values():
            for k in preset:
                if m not in known.setdefault(k, []):
                    known[k].append(m)
    for k in keys:
        if k not in known:
            close = difflib.get_close_matches(k, list(known), n=1)
            raise UserError(
                f"--set {k}=...: none of the selected methods ({', '.join(methods) or 'none'}) has a setting "
                f"{k!r}" + (f"; did you mean {close[0]!r}?" if close else ".")
                + (f" Valid keys: {', '.join(sorted(known))}." if known else " They take no settings."))


def method_class(name: str) -> type[Method]:
    methods = load_methods()
    try:
        return methods[name.strip().lower()]
    except KeyError:
        raise UserError(f"unknown method {name!r}: choose from {', '.join(sorted(methods))}.") from None


def get_method(name: str, device: torch.device | str | None = None, checkpoint_dir: str | None = None) -> Method:
    """An instance of the registered method `name` (case-insensitive), configured once."""
    return method_class(name)(device=device, checkpoint_dir=checkpoint_dir)
