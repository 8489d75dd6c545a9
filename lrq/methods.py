"""The method interface and registry.

A method turns a floating-point model into one whose seven linears per block are QuantLinear modules
for a given scheme. It is described entirely by (scheme, config, calibration data): no state is kept
between calls, so every (model, method, scheme) cell is an independent job.

Methods register themselves with `@register`; `load_methods()` imports every module of the `baselines`
package and the LRQ/FlexRound modules, so a new method is a new file, not a change to the harness.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, ClassVar

import torch
from torch import nn

from lrq.config import FALSE_WORDS, TRUE_WORDS, MethodConfig, parse  # noqa: F401  (the words: re-exported)
from lrq.errors import UserError
from lrq.schemes import Scheme


@dataclass
class Calibration:
    """Calibration token windows [n_samples, seq_len] and how they were drawn (recorded with results);
    `tokenizer`, when known, is the one that produced them (a method running another stack needs it)."""
    input_ids: torch.Tensor
    description: dict[str, Any] = field(default_factory=dict)
    tokenizer: Any = None


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
    # The method's settings (a MethodConfig dataclass beside its code) and its presets as instances of it; every
    # setting but the fixed ones (the preset) can be overridden from the CLI (--set key=value) and is recorded.
    settings: ClassVar[type[MethodConfig]] = MethodConfig
    presets: ClassVar[dict[str, MethodConfig]] = {"quick": MethodConfig(), "paper": MethodConfig()}
    # The version of what the method computes: bump it with any change that changes its numbers (a rank rule, a
    # rounding, an initialisation). It is recorded in every row (`method_version`) and is part of every result's
    # identity, so a result of another version is never reused as current (tests/test_method_versions.py pins
    # each method's output on a tiny fixed model to its version). Version 1 is what every result stored before
    # versions existed computed: it is left out of the identity, so those results keep their keys.
    version: ClassVar[int] = 1

    @classmethod
    def keyed_settings(cls, config: Mapping) -> dict[str, Any]:
        """`config` (a config of this method or a stored dict of its settings) without the execution settings
        (and the later settings at their neutral value): what a result's identity (store key, checkpoint) hashes."""
        return cls.settings.keyed(config)

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

    # ---- what the planner needs (bench.run.plan): no method names there -----------------------------------
    def work(self, shape, scheme: Scheme | None, cfg: dict[str, Any], n: int, seq: int
             ) -> dict[str, tuple[float, float]]:
        """(calls, flops) per kind of work to quantize a model of `shape` (bench.run.plan.ModelShape) with n x seq
        calibration tokens. Kinds are timed by the planner's machine profile: "fwd" (whole-model forwards)
        and the kinds `profile` measures. The default: the static activation ranges of W8A8, if any."""
        return static_range_work(shape, scheme, n, seq)

    def profile(self, run: Callable[..., tuple[float, dict]], shape, scheme: Scheme, n: int, seq: int,
                steps: int = 6) -> dict[str, tuple[float, float, float]]:
        """(calls, flops, seconds) points of this method's own kinds of work; `run(**settings)` quantizes a
        copy of a small random model with the quick preset plus `settings` and returns (seconds, config);
        `steps`: training steps to time where the method trains."""
        return {}

    # Its quantization of a block walks calibration statistics (Hessians, activation scales) at a rate that grows
    # with the block's widths: the planner prices a cell with many calibration tokens by measuring one block at
    # the model's own widths (bench.run.plan.measured_walk).
    probe_walk: ClassVar[bool] = False
    # The resolved settings that a measured training step depends on (bench.run.plan.measured_training keys its
    # cache of measured steps by them; a method that trains declares them).
    training_probe_settings: ClassVar[tuple[str, ...]] = ()

    def training(self, cfg: MethodConfig) -> tuple[int, int] | None:
        """(training steps per block, calibration windows per step) of a method that trains block by block with
        the settings `cfg`; None for one that does not train (the planner then measures no training step)."""
        return None

    def training_probe_config(self, cfg: MethodConfig, steps: int, compiled: bool) -> MethodConfig:
        """`cfg` as the planner's probe of one training step runs it: `steps` steps per block, the fewest held-out
        and error windows, the step `compiled` or not. Only a method whose `training` is not None needs it."""
        raise NotImplementedError(f"{self.name} declares no training (Method.training), so no training probe")

    def extra_memory(self, shape, tokens: int = 0) -> int:
        """Bytes beyond the weights, activation streams and training state at the method's peak, for a model of
        `shape` calibrated on `tokens` tokens."""
        return 0

    def resolve(self, scheme: Scheme, config: MethodConfig) -> MethodConfig:
        """The configuration with every 'auto' decided for `scheme` (what `quantize` will use)."""
        return config

    def config(self, preset: str, overrides: Mapping[str, Any] | None = None) -> MethodConfig:
        """The preset's settings with `overrides` parsed (lrq.config.parse: converted, checked, normalised once;
        exit 2 on a bad value, before any work). A method without settings of its own for a preset takes its
        fallback's (PRESET_FALLBACK: the long preset is the paper settings for methods that do not train)."""
        preset_of = preset if preset in self.presets else PRESET_FALLBACK.get(preset)
        if preset_of not in self.presets:
            raise UserError(f"unknown preset {preset!r} for method {self.name}: choose from {', '.join(self.presets)}.")
        return parse(self.presets[preset_of], overrides, self.name)

    def typed(self, config: Mapping[str, Any], preset: str = "quick") -> MethodConfig:
        """`config` as this method's config: itself where it is one, else parsed onto `preset` (a dict of settings
        from Python, e.g. a stored row's)."""
        if isinstance(config, self.settings):
            return config
        return self.config(config.get("preset", preset), config)   # parse skips the preset where it is the same

    def check_calibration(self, config: MethodConfig, n_samples: int, seq_len: int) -> None:
        """Refuse (UserError) settings that cannot work with n_samples x seq_len calibration windows."""

    def needs_calibration(self, scheme: Scheme) -> bool:
        """Whether the result depends on calibration data (it then becomes part of the cell's identity)."""
        return scheme.static_activations

    def quantize(self, model: nn.Module, scheme: Scheme, config: MethodConfig | Mapping[str, Any],
                 calib: Calibration | None) -> dict[str, Any]:
        """Quantize `model` in place; return statistics worth storing (e.g. learnable-parameter counts).
        `config` is this method's config, or a mapping of settings parsed onto its preset here: the one place
        a method's settings become typed before it computes (each method implements `_quantize`)."""
        return self._quantize(model, scheme, self.typed(config), calib)

    def _quantize(self, model: nn.Module, scheme: Scheme, config: MethodConfig,
                  calib: Calibration | None) -> dict[str, Any]:
        """The method itself, on a typed config."""
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


PRESET_FALLBACK = {"long": "paper"}
# calibration of a preset for every method that has none of its own for it (the long preset: the same windows
# for LRQ, FlexRound, GPTQ and AWQ, so their cells compare on one calibration)
PRESET_CALIB: dict[str, dict[str, Any]] = {"long": {"dataset": "c4", "n_samples": 128, "seq_len": 1024,
                                                    "sampling": "sequential"}}


METHODS: dict[str, type[Method]] = {}
_LOADED = False


def register(cls: type[Method]) -> type[Method]:
    if cls.name in METHODS and METHODS[cls.name] is not cls:
        raise RuntimeError(f"two methods registered under the name {cls.name!r}")
    METHODS[cls.name] = cls
    return cls


ENTRY_POINTS = "lrq_bench.methods"   # the entry-point group of modules that register methods (pyproject.toml)


def load_methods() -> dict[str, type[Method]]:
    """Every registered method: the modules named by the installed packages' `lrq_bench.methods` entry points
    (this project's: lrq.lrq, lrq.flexround and the baselines/ modules) are imported once, each registering
    its methods. lrq/ imports nothing above itself: the baselines are found as any plug-in would be."""
    global _LOADED
    if not _LOADED:
        from importlib.metadata import entry_points
        eps = [(e.name, e.value) for e in entry_points(group=ENTRY_POINTS)] or list(_source_tree_entry_points().items())
        if not eps:
            raise UserError(f"no quantization methods are installed (no '{ENTRY_POINTS}' entry points): install "
                            f"the project with `pip install -e .` (or `pip install .`), which declares them.")
        for name, value in sorted(eps):
            try:
                importlib.import_module(value.split(":")[0])
            except ImportError as e:
                raise UserError(f"the method plug-in {name!r} ({value}) cannot be imported: {e}") from e
        _LOADED = True
    return METHODS


def _source_tree_entry_points() -> dict[str, str]:
    """The project's own method modules when it runs from its source tree without being installed
    (`PYTHONPATH=.` on a lent GPU machine, which has no registry to install from): read from the
    pyproject.toml beside the lrq package, the same declaration an install would register."""
    import tomllib
    pyproject = Path(__file__).resolve().parents[1] / "pyproject.toml"
    try:
        doc = tomllib.loads(pyproject.read_text())
    except (OSError, tomllib.TOMLDecodeError):
        return {}
    return dict(doc.get("project", {}).get("entry-points", {}).get(ENTRY_POINTS, {}))


def check_settings(keys, methods: list[str]) -> None:
    """Every key a setting of at least one of `methods` (any preset): an unknown key (a typo such as
    iter=5000) is a UserError naming the valid keys and the closest one, never silently ignored."""
    import difflib
    known: dict[str, list[str]] = {}
    for m in methods:
        cls = method_class(m)
        for preset in cls.presets.values():
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


def method_of_row(display: str) -> str:
    """The registered method that names its rows `display` (Method.display_name): the name itself, or for a method
    naming its rows `<method>:<label>` (one reading a checkpoint names it after the checkpoint) the part before
    the colon."""
    head = display.split(":", 1)[0]
    return head if ":" in display and head.strip().lower() in load_methods() else display


def get_method(name: str, device: torch.device | str | None = None, checkpoint_dir: str | None = None) -> Method:
    """An instance of the registered method `name` (case-insensitive), configured once."""
    return method_class(name)(device=device, checkpoint_dir=checkpoint_dir)
