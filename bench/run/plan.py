"""Sweep planning: estimated time and memory of every cell, from a model's shape alone (no weights).

Cost model. Each method's work is written as FLOPs of a few kinds, from its algorithm and settings
(`cell_work`): block forward passes over the calibration set (the block-wise walk), reconstruction
training steps (LRQ, FlexRound, OmniQuant), GPTQ's Hessians and column updates, AWQ's scale and clipping
grids, whole-model forward passes (static activation ranges, SmoothQuant statistics, perplexity, tasks).
Each kind costs `per_call_s x calls + flops / flops_per_s` on this machine: both numbers are *measured*
(`measure_profile`) by running the real methods on random two-block Llama models of two widths and
solving for the per-block overhead and the rate. Estimates scale those measurements by each target
model's shapes. The profile is cached per machine (hardware + torch version) in the lrq-bench cache.

Memory model (`estimate_memory`): host = the resident memory of a worker process before it loads a model
(Python, torch, transformers and the methods imported: measured once per machine, `process_baseline_bytes`)
+ the weights as loaded (fp32) + the calibration activation streams that stay in RAM (three [n, seq, hidden] fp32 buffers within LRQ_RAM_BUDGET_GB, the rest on
disk) + one block's training state; device (CUDA) = one block at a time (offloaded walk) with its
learnables and Adam state plus one batch of activations, or the whole model when it is not offloaded.

What it does not model: process start-up and model loading, lm-eval's set-up, contention with other
processes. Expect the order of magnitude and the ranking of cells, not minutes.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from lrq.errors import UserError
from lrq.io import dumps_json


#: model types whose decoder block the planner's cost model describes as it is (the others are priced as the
#: same widths in that form, and their estimate is labelled rough)
KNOWN_BLOCKS = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "gemma3")


@dataclass(frozen=True)
class ModelShape:
    """A decoder's shape, from its config alone: widths, heads and head_dim (which Gemma sets apart from
    hidden / heads), vocabulary, whether the output head is the embedding (tied: one matrix), the MLP kind
    (gated: gate, up, down; plain: up, down) and the attention kind of each layer (a sliding window attends to
    at most `sliding_window` tokens)."""
    name: str
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int
    head_dim_: int | None = None          # None: hidden // heads
    tied: bool = False
    mlp: str = "gated"
    sliding_window: int | None = None
    sliding_layers: int = 0               # how many of the layers attend through the window
    model_type: str | None = None
    rough: str = ""                       # why the estimate is rough ("" when the block is one the model knows)

    @property
    def head_dim(self) -> int:
        return self.head_dim_ or self.hidden // self.heads

    def linears(self) -> list[tuple[int, int]]:
        """(in, out) of the block's linears: q, k, v, o, then gate, up, down (gated) or up, down (plain)."""
        h, i = self.hidden, self.intermediate
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        mlp = [(h, i), (h, i), (i, h)] if self.mlp == "gated" else [(h, i), (i, h)]
        return [(h, q), (h, kv), (h, kv), (q, h), *mlp]

    def block_params(self) -> int:
        return sum(a * b for a, b in self.linears())

    def params(self) -> int:
        return self.layers * (self.block_params() + 2 * self.hidden) + (1 if self.tied else 2) * self.vocab * self.hidden

    def _attention_flops(self, tokens: float, seq: int, window: int | None) -> float:
        """QK^T and AV of one layer on `tokens` tokens in causal windows of `seq`: 4 x heads x head_dim x the mean
        number of keys a query sees (seq / 2 in full causal attention, about the window when it is shorter)."""
        if window and window < seq:
            keys = window - window * (window - 1) / (2.0 * seq)
        else:
            keys = (seq + 1) / 2.0
        return 4.0 * self.heads * self.head_dim * keys * tokens

    def block_fwd_flops(self, tokens: float, seq: int) -> float:
        """Matmuls of the model's mean block on `tokens` tokens in windows of `seq` (its sliding-window layers
        attend to fewer keys than its full-attention ones)."""
        full = self.layers - self.sliding_layers
        attn = (full * self._attention_flops(tokens, seq, None)
                + self.sliding_layers * self._attention_flops(tokens, seq, self.sliding_window)) / self.layers
        return 2.0 * self.block_params() * tokens + attn

    def model_fwd_flops(self, tokens: float, seq: int) -> float:
        return self.layers * self.block_fwd_flops(tokens, seq) + 2.0 * self.hidden * self.vocab * tokens

    def probe_shape(self) -> list[int]:
        """The widths a measured probe is keyed by (head_dim only where it is not hidden / heads, so keys made
        before it was recorded still hold)."""
        base = [self.hidden, self.intermediate, self.heads, self.kv_heads]
        return base + ([self.head_dim] if self.head_dim_ and self.head_dim_ != self.hidden // self.heads else [])


# Shapes written here (a config is a handful of numbers): Llama-2's published configurations; the built-in models'.
SHAPES: dict[str, ModelShape] = {
    "llama-2-7b": ModelShape("llama-2-7b", 4096, 11008, 32, 32, 32, 32000, model_type="llama"),
    "llama-2-13b": ModelShape("llama-2-13b", 5120, 13824, 40, 40, 40, 32000, model_type="llama"),
    "llama-2-70b": ModelShape("llama-2-70b", 8192, 28672, 80, 64, 8, 32000, model_type="llama"),
    "smollm2-135m": ModelShape("smollm2-135m", 576, 1536, 30, 9, 3, 49152, 64, tied=True, model_type="llama"),
    # 15 of its 18 layers attend through a 512-token window (5 sliding, then 1 full, three times)
    "gemma3-270m": ModelShape("gemma3-270m", 640, 2048, 18, 4, 1, 262144, 256, tied=True, sliding_window=512,
                              sliding_layers=15, model_type="gemma3_text"),
}

#: where other families keep the numbers the planner needs (first present wins)
_ALIASES = {"hidden": ("hidden_size", "n_embd", "d_model", "dim"),
            "layers": ("num_hidden_layers", "n_layer", "num_layers", "n_layers"),
            "heads": ("num_attention_heads", "n_head", "num_heads", "n_heads"),
            "intermediate": ("intermediate_size", "n_inner", "ffn_dim", "ffn_hidden_size", "hidden_dim"),
            "vocab": ("vocab_size", "n_vocab", "padded_vocab_size")}
#: activations of gated MLPs (SwiGLU, GeGLU) in families the planner does not know; GPT-2's gelu_new is a plain MLP's
_GATED_ACTS = ("silu", "swish", "gelu_pytorch_tanh", "geglu", "swiglu")


def shape_from_config(name: str, cfg: Any) -> ModelShape:
    """The shape of any decoder from its config: layers, widths, heads, head_dim, vocabulary, tied head, MLP kind
    and attention kind of each layer. A model type whose block the cost model does not know (`KNOWN_BLOCKS`) is
    priced from the same numbers as a Llama-style block and labelled rough; only a config without the widths
    at all (not a decoder's) is refused."""
    if not isinstance(cfg, dict):
        cfg = cfg.to_dict() if hasattr(cfg, "to_dict") else vars(cfg)
    text = cfg.get("text_config")
    if isinstance(text, dict) and not any(k in cfg for k in _ALIASES["hidden"]):
        cfg = text | {"model_type": text.get("model_type") or cfg.get("model_type"),
                      "tie_word_embeddings": cfg.get("tie_word_embeddings", text.get("tie_word_embeddings"))}

    def num(field: str) -> int | None:
        for k in _ALIASES[field]:
            v = cfg.get(k)
            if isinstance(v, int) and not isinstance(v, bool) and v > 0:
                return v
        return None
    model_type = cfg.get("model_type")
    hidden, layers, heads, vocab = num("hidden"), num("layers"), num("heads"), num("vocab")
    missing = [f for f, v in (("hidden_size", hidden), ("num_hidden_layers", layers), ("num_attention_heads", heads),
                              ("vocab_size", vocab)) if v is None]
    if missing:
        raise UserError(f"{name}: its configuration (model type {model_type!r}) has no usable {', '.join(missing)}, "
                        f"so it is not a decoder the planner can price: give a causal LM's config.json, folder or "
                        f"hub id, or one of {', '.join(SHAPES)}.")
    rough = []
    intermediate = num("intermediate")
    if intermediate is None:
        intermediate = 4 * hidden
        rough.append("no intermediate_size in the config: 4 x hidden assumed")
    kv = cfg.get("num_key_value_heads") or cfg.get("num_kv_heads") or heads
    head_dim = cfg.get("head_dim") if isinstance(cfg.get("head_dim"), int) and cfg.get("head_dim") > 0 else None
    act = str(cfg.get("hidden_act") or cfg.get("hidden_activation") or cfg.get("activation_function") or "silu")
    mlp = "gated" if model_type in KNOWN_BLOCKS or act in _GATED_ACTS else "plain"
    window = cfg.get("sliding_window") if isinstance(cfg.get("sliding_window"), int) else None
    types = cfg.get("layer_types")
    if isinstance(types, list) and len(types) == layers:
        sliding = sum(t == "sliding_attention" for t in types)
    elif window and (cfg.get("use_sliding_window", model_type == "mistral")):
        sliding = max(0, layers - int(cfg.get("max_window_layers") or 0)) if model_type in ("qwen2", "qwen3") else layers
    else:
        sliding = 0
    if model_type not in KNOWN_BLOCKS:
        rough.insert(0, f"model type {model_type!r} is not one whose block the planner knows "
                        f"({', '.join(KNOWN_BLOCKS)}): priced as a {mlp} Llama-style block of the same widths")
    return ModelShape(name, hidden, intermediate, layers, heads, int(kv), vocab, head_dim,
                      tied=bool(cfg.get("tie_word_embeddings", False)), mlp=mlp,
                      sliding_window=window if sliding else None, sliding_layers=sliding if window else 0,
                      model_type=model_type, rough="; ".join(rough))


def load_shape(spec: str) -> ModelShape:
    """A built-in shape name, a config.json file, a model folder, or a hub id (config only, no weights)."""
    if spec in SHAPES:
        return SHAPES[spec]
    path = Path(spec).expanduser()
    if path.is_dir():
        path = path / "config.json"
    if path.is_file():
        try:
            cfg = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, ValueError) as e:
            raise UserError(f"cannot read the model configuration {path} ({type(e).__name__}: {e}).") from None
        if not isinstance(cfg, dict):
            raise UserError(f"{path} is not a model configuration (a JSON object expected).")
        return shape_from_config(spec, cfg)
    try:
        from transformers import AutoConfig
        cfg = AutoConfig.from_pretrained(spec)
    except Exception as e:  # noqa: BLE001 (any failure to find a config is the same bad input)
        raise UserError(f"cannot read a model configuration for {spec!r} ({type(e).__name__}): give one of "
                        f"{', '.join(SHAPES)}, a config.json, a model folder or a reachable hub id.") from None
    return shape_from_config(spec, cfg)


# ---- the work of one cell --------------------------------------------------------------------------------

@dataclass
class CellPlan:
    method: str
    scheme: str
    work: dict[str, tuple[float, float]]   # kind -> (calls, flops)
    seconds: float = 0.0
    host_bytes: int = 0
    device_bytes: int = 0
    stages: dict[str, float] | None = None   # seconds per stage as a run stores them ("quant", each text, "tasks")


def task_requests(task: str, task_limit: int | None) -> tuple[int, int]:
    """(model forwards, tokens per forward) of a task: the catalogue's (bench.evaluations.evals)."""
    from bench.evaluations.evals import task_requests as requests
    return requests(task, task_limit)


def stage_work(shape: ModelShape, method, scheme, cfg: dict, n: int, seq: int, eval_tokens: dict[str, int],
               eval_seq: int, tasks: list[str], task_limit: int | None, measure: bool = False
               ) -> dict[str, dict[str, tuple[float, float]]]:
    """(calls, flops) per kind of work, per stage of one cell as it runs: "quant" (the method's own work,
    `Method.work`; nothing for the FP reference), one stage per perplexity dataset, and "tasks". `measure`: the
    estimate is for this machine's CPU, where a compiled training step and a text window are measured at the
    cell's shape (`measured_training`, `measured_eval`)."""
    from lrq.methods import add_work
    stages: dict[str, dict[str, tuple[float, float]]] = {
        "quant": {} if method is None else dict(method.work(shape, scheme, cfg, n, seq))}
    L = shape.layers
    if method is not None and measure:
        measured_training(stages["quant"], shape, method, scheme, cfg, seq)
        measured_walk(stages["quant"], shape, method, scheme, cfg, n, seq)
    probe = measured_eval(shape, eval_seq) if measure and (eval_tokens or tasks) else None
    for ds, tokens in eval_tokens.items():
        windows = max(1, tokens // eval_seq)
        if probe:
            stages[ds] = {f"probe:{probe}:win_block": (float(windows * L), 0.0),
                          f"probe:{probe}:win_rest": (float(windows), 0.0)}
        else:
            stages[ds] = add_work({}, "fwd", windows * L, shape.model_fwd_flops(windows * eval_seq, eval_seq))
    if tasks:
        w: dict[str, tuple[float, float]] = {}
        for t in tasks:
            calls, toks = task_requests(t, task_limit)
            if probe:   # the measured window's cost per token (its float32 head and NLL dominate short requests)
                add_work(w, "fwd", calls * L, 0.0)                         # per-call overhead, from the profile
                add_work(w, f"probe:{probe}:win_block", calls * toks / eval_seq * L, 0.0)
                add_work(w, f"probe:{probe}:win_rest", calls * toks / eval_seq, 0.0)
            else:
                add_work(w, "fwd", calls * L, calls * shape.model_fwd_flops(toks, toks))
        stages["tasks"] = w
    return stages


def cell_work(shape: ModelShape, method, scheme, cfg: dict, n: int, seq: int, eval_tokens: dict[str, int],
              eval_seq: int, tasks: list[str], task_limit: int | None, measure: bool = False
              ) -> dict[str, tuple[float, float]]:
    """(calls, flops) per kind of work for one cell: every stage of `stage_work` together."""
    from lrq.methods import add_work
    w: dict[str, tuple[float, float]] = {}
    for stage in stage_work(shape, method, scheme, cfg, n, seq, eval_tokens, eval_seq, tasks, task_limit,
                            measure).values():
        for kind, (calls, flops) in stage.items():
            add_work(w, kind, calls, flops)
    return w


def estimate_memory(shape: ModelShape, method, n: int, seq: int, device: str = "cpu", offload: bool = True,
                    ram_budget: int | None = None, baseline: int | None = None) -> tuple[int, int]:
    """(host bytes, device bytes) at the peak of a cell; device bytes are 0 on a CPU-only run. `baseline`: the
    process's own resident memory before it loads the model (default: this machine's, measured)."""
    if ram_budget is None:
        ram_budget = int(os.environ.get("LRQ_RAM_BUDGET_GB", "6")) * 2**30
    m = method   # a Method (instance or class): what it declares about its memory
    weights = 4 * shape.params()
    block = 4 * (shape.block_params() + 2 * shape.hidden)
    stream = n * seq * shape.hidden * 4
    streams = 3 * stream if m.blockwise else 0
    acts_ram = streams if streams <= ram_budget else 0      # otherwise memory-mapped from disk
    # training state of one block: learnables + Adam's two moments + gradients (a full matrix per weight: 1.0)
    train = 4 * m.learnable_fraction * block
    gptq = (m() if isinstance(m, type) else m).extra_memory(shape, n * seq)
    batch_acts = 16 * seq * max(shape.hidden, shape.intermediate) * 4 * 8   # one batch of 8 windows through a block
    if baseline is None:
        baseline = process_baseline_bytes()
    host = baseline + weights + acts_ram + train + gptq + batch_acts
    if device == "cpu":
        return int(host), 0
    dev = (block if offload else weights) + train + gptq + batch_acts
    return int(host), int(dev)


#: the process baseline where it cannot be measured (a 2-core Zen 4, torch 2.13, transformers 5.24: 0.44 GiB)
BASELINE_FALLBACK = 512 * 2**20
BASELINE_FILE = "process-baseline.json"
#: the cache files that hold this machine's measurements (the planner's profiles and the process baseline): a
#: fresh cache given copies of them does not measure the machine again
MEASUREMENT_FILES = ("plan-profile-*.json", BASELINE_FILE)


@functools.cache
def process_baseline_bytes() -> int:
    """Resident memory of a fresh Python process that has imported what a cell runs (torch, transformers, the
    methods and the cell runner), before it loads a model: the floor under every cell's peak, about 0.45 GiB
    with torch 2.13 on x86, which the estimate left out (it was low by 1.8-2.6x on the default model's cells).
    Measured once per machine and package versions in a subprocess, and cached."""
    import platform
    import subprocess
    import sys
    from importlib.metadata import version

    from bench.common.cache import cache_root
    key = "-".join([platform.machine(), platform.python_version(), torch.__version__, version("transformers")])
    path = cache_root() / BASELINE_FILE
    try:
        known = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        known = {}
    if isinstance(known, dict) and isinstance(known.get(key), int):
        return known[key]
    # a model class, as a cell imports one to load its model: transformers' modelling code is half the figure
    code = ("import psutil, torch, transformers, lrq.methods, bench.run.cell\n"
            "from transformers import LlamaForCausalLM\n"
            "lrq.methods.load_methods()\n"
            "print(psutil.Process().memory_info().rss)")
    try:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
        rss = int(out.stdout.strip().splitlines()[-1])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return BASELINE_FALLBACK
    from lrq.io import atomic_write_text
    try:
        atomic_write_text(path, json.dumps((known if isinstance(known, dict) else {}) | {key: rss}, indent=1))
    except OSError:
        pass   # a read-only cache: measured again next time
    return rss


# ---- the machine profile -----------------------------------------------------------------------------------



def _random_model(hidden: int, device: str):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=512, hidden_size=hidden, intermediate_size=hidden * 8 // 3 // 32 * 32,
                      num_hidden_layers=2, num_attention_heads=max(1, hidden // 64), num_key_value_heads=max(1, hidden // 64),
                      max_position_embeddings=4096, tie_word_embeddings=False)
    return LlamaForCausalLM(cfg).eval().to(device), cfg


def measure_profile(device: str = "cpu", widths: tuple[int, int] | None = None, n: int = 8, seq: int = 128,
                    iters: int = 6, precision: str = "auto") -> dict:
    """Time every kind of work on random two-block models of two widths; fit per-call overhead and rate.

    Everything runs at `precision` (lrq.precision: the forwards under bf16 autocast or in float32, as a run at
    that precision will), with the methods' progress bars off. The profile records how busy the machine was
    meanwhile (`load`: the share of the CPUs other processes used, and the load average): a profile measured
    on a busy machine prices every cell too high, and says so wherever it is used.

    On a GPU the widths are larger (1024 and 4096, Llama-2-7B's): a 384-wide block leaves a GPU idle
    between kernel launches, and a rate fitted there would make a 7B-shaped block look many times slower
    than it is. On a CPU, 64 and 384 already run at the machine's matmul rate and keep this under a minute.
    """
    from lrq import precision as P
    prec = P.resolve(precision, device)
    with P.use(prec), _quiet(), _load_meter() as load:
        prof = _measure(device, widths, n, seq, iters)
    return prof | {"precision": prec, "load": load}


class _LoadMeter(dict):
    """How busy the machine was while the code inside ran, besides this process: filled in on exit."""


@contextlib.contextmanager
def _load_meter():
    import psutil
    me = psutil.Process()
    own0, sys0, t0 = me.cpu_times(), psutil.cpu_times(), time.perf_counter()
    meter = _LoadMeter(loadavg_before=_loadavg())
    yield meter
    own1, sys1, wall = me.cpu_times(), psutil.cpu_times(), time.perf_counter() - t0
    busy = lambda t: t.user + t.system + getattr(t, "nice", 0.0) + getattr(t, "irq", 0.0) + getattr(t, "softirq", 0.0)  # noqa: E731
    own = (own1.user - own0.user) + (own1.system - own0.system)
    cpus = psutil.cpu_count() or 1
    others = max(0.0, (busy(sys1) - busy(sys0) - own) / max(wall * cpus, 1e-9))
    meter.update(others_cpu_share=round(others, 3), loadavg_after=_loadavg(), cpus=cpus, seconds=round(wall, 1),
                 busy=others > BUSY_SHARE)


def _loadavg() -> float | None:
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return None


# other processes using more than this share of the CPUs while the profile is measured: "busy"
BUSY_SHARE = 0.25


@contextlib.contextmanager
def _quiet():
    """No progress bars while the profile is measured: the methods' tqdm bars (and anything else they print
    to stderr) are kept and shown only if the measurement fails."""
    import io
    import sys
    buf = io.StringIO()
    try:
        with contextlib.redirect_stderr(buf):
            yield
    except BaseException:
        sys.stderr.write(buf.getvalue()[-4000:])
        raise


def busy_note(profile: dict) -> str | None:
    """A sentence saying the profile was measured on a busy machine, or None."""
    load = profile.get("load") or {}
    if not load.get("busy"):
        return None
    return (f"the machine profile was measured while other processes used {100 * load['others_cpu_share']:.0f} % of "
            f"the {load['cpus']} CPUs (load average {load.get('loadavg_before')}): the rates it measured may be "
            f"slower than this machine's own; `lrq-bench plan --remeasure` on an idle machine measures it again")


def load_note(workers: int, threads: int = 1, busy: float | None = None, cpus: int | None = None) -> str | None:
    """A sentence saying the estimate is too short because the machine is loaded now, or None: the estimate
    assumes each of the run's `workers` (`threads` each) CPUs of its own, and other work already running takes
    its share of the CPUs from them. `busy`: CPUs' worth of other work at normal priority (measured over half a
    second where None; niced work, which yields to the run, is left out)."""
    cpus = cpus or os.cpu_count() or 1
    if busy is None:
        try:
            import psutil
            t = psutil.cpu_times_percent(interval=0.5)
            busy = (t.user + t.system + getattr(t, "irq", 0.0) + getattr(t, "softirq", 0.0)) / 100 * cpus
        except Exception:  # noqa: BLE001 - no reading, no note
            return None
    demand = busy + workers * threads
    if demand <= cpus * 1.1:
        return None
    return (f"the machine is busy now (other processes use {busy:.1f} of its {cpus} CPUs before this run's "
            f"{workers * threads} thread{'s' if workers * threads > 1 else ''} start): the estimate assumes CPUs of "
            f"their own, so it is too short while that load lasts; expect up to about {demand / cpus:.1f}x as long")


def _measure(device: str, widths: tuple[int, int] | None, n: int, seq: int, iters: int) -> dict:
    from lrq import precision as P
    if widths is None:
        widths = (64, 384) if device == "cpu" else (1024, 4096)
    from lrq.methods import Calibration, get_method, load_methods
    from lrq.schemes import get_scheme
    scheme = get_scheme("w4a16")
    points: dict[str, list[tuple[float, float, float]]] = {"fwd": []}   # kind -> (calls, flops, seconds) per width
    for hidden in widths:
        model0, cfg = _random_model(hidden, device)
        shape = shape_from_config(f"random-{hidden}", cfg)
        ids = torch.randint(0, cfg.vocab_size, (n, seq))
        calib = Calibration(ids, {"dataset": "random", "n_samples": n, "seq_len": seq, "seed": 0})

        def timed(fn) -> float:
            t = time.perf_counter()
            fn()
            if device != "cpu":
                torch.cuda.synchronize()
            return time.perf_counter() - t

        with torch.no_grad(), P.autocast(device):     # forwards as evaluation runs them, at the precision
            timed(lambda: model0(ids[:1].to(device)))      # warm-up
            t = timed(lambda: [model0(ids[i:i + 1].to(device)) for i in range(n)])
        points["fwd"].append((n * shape.layers, shape.model_fwd_flops(n * seq, seq), t))
        for name in sorted(load_methods()):   # each method times its own kinds (Method.profile)
            method = get_method(name)

            def run(method=method, **over) -> tuple[float, dict]:
                import copy
                c = method.config("quick", over)
                model = copy.deepcopy(model0)
                return timed(lambda: method.quantize(model, scheme, c, calib)), c

            for kind, point in method.profile(run, shape, scheme, n, seq, iters).items():
                pts = points.setdefault(kind, [])
                if len(pts) < len(points["fwd"]):   # one point per width (the walk is timed by several methods)
                    pts.append(point)
    kinds = {}
    for k, pts in points.items():
        (c1, f1, t1), (c2, f2, t2) = pts
        # t = a*calls + flops/rate through both points; clamp to non-negative overhead and a finite rate
        det = c1 * f2 - c2 * f1
        a = (t1 * f2 - t2 * f1) / det if det else 0.0
        a = max(a, 0.0)
        inv_rate = max((t2 - a * c2) / f2, 1e-15)
        kinds[k] = {"per_call_s": a, "flops_per_s": 1.0 / inv_rate, "points": pts}
    from bench.common.provenance import hardware, versions
    return {"device": device, "hardware": hardware(), "versions": versions(), "kinds": kinds,
            "threads": torch.get_num_threads(), "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}


def profile_path(device: str, precision: str = "auto") -> Path:
    """The cached profile of this machine (hardware, torch, threads) at `precision`."""
    import hashlib

    from bench.common.cache import cache_root
    from bench.common.provenance import hardware
    from lrq import precision as P
    key = hashlib.sha256(json.dumps([device, hardware(), torch.__version__, torch.get_num_threads(),
                                     P.resolve(precision, device)],
                                    sort_keys=True, default=str).encode()).hexdigest()[:16]
    return cache_root() / f"plan-profile-{key}.json"


def load_or_measure_profile(device: str, path: str | None = None, remeasure: bool = False, precision: str = "auto",
                            say=None) -> dict:
    """The machine profile: from `path`, else this machine's cached one at `precision`, else measured now
    (and cached). `say(line)` is told, in one line each, that the machine is being measured and whether
    the profile in use was measured on a busy machine."""
    say = say or (lambda line: None)
    if path:
        try:
            prof = json.loads(Path(path).read_text())
        except (OSError, ValueError) as e:
            raise UserError(f"cannot read the machine profile {path}: {e}.") from None
        if not isinstance(prof, dict) or "kinds" not in prof:
            raise UserError(f"{path} is not a machine profile (`lrq-bench plan --save-profile FILE` writes one).")
        return prof
    p = profile_path(device, precision)
    from lrq.io import file_lock
    with file_lock(p):   # two runs starting together: one measures, the other reads what it cached
        return _load_or_measure(p, device, remeasure, precision, say)


def _load_or_measure(p: Path, device: str, remeasure: bool, precision: str, say) -> dict:
    from lrq import precision as P
    prof = None
    if p.is_file() and not remeasure:
        try:
            prof = json.loads(p.read_text())
        except (OSError, ValueError):
            prof = None   # a damaged cache entry is measured again
    if prof is None:
        prec = P.resolve(precision, device)
        say(f"measuring this machine for the time estimates ({device}, {prec}, {torch.get_num_threads()} "
            f"thread(s); about 15 s on 2 CPU cores, once per machine, precision and thread count) ...")
        prof = measure_profile(device, precision=prec)
        from lrq.io import atomic_write_text
        atomic_write_text(p, dumps_json(prof, indent=1))
        load = prof["load"]
        say(f"measured in {load['seconds']:.0f} s (other processes used {100 * load['others_cpu_share']:.0f} % of "
            f"the CPUs meanwhile); cached in {p}")
    note = busy_note(prof)
    if note:
        say(note[0].upper() + note[1:] + ".")
    return prof


# ---- long training, measured at the cell's own shape ----------------------------------------------------------
# The machine profile times eager training steps of small random blocks (batch 1 x 128 tokens) and scales them
# by FLOPs. That prices the quick preset; the long and paper presets train compiled steps at batch 2 x 1,024 on
# the model's own widths, where a CPU runs several times more FLOP/s: on a Zen 4 the profile priced a long LRQ
# cell at 13.9 h against about 4.5 h measured (reports/long-smollm2-135m/). A cell with this many training steps
# (blocks x steps per block) or more has its step measured instead: the method's own quantize on one random
# block of the model's widths, at the cell's batch, window length, compilation and precision. The engine times
# every step (lrq.engine: `step_s_median`, `train_time_s`), so the step is the median of the probe's own steps
# after the first, and the rest of the block's time (compilation, its check, s1 initialisation, error
# measurements) its per-block overhead. (Until 2026-12-04 the step was the difference of two whole quantize
# calls of 2 and 8 steps divided by 6, where seconds of per-block overhead stand beside six steps of a fraction of
# a second; on an AMX Xeon it priced FlexRound's step at 0.048 s against about 0.24 s in its real blocks, likely
# for that reason, not verified there.)
# Cached per machine; about a minute per method and shape the first time.
MEASURE_TRAINING_FROM_STEPS = 5000
MEASURE_TRAINING_MAX_BLOCK_PARAMS = 50_000_000
_PROBE_STEPS = (2, 16)     # the discarded warm-up run's steps, the measured run's steps


def _say_stderr(line: str) -> None:
    import sys
    print(f"lrq-bench: {line}", file=sys.stderr, flush=True)


def _probe_cache() -> Path:
    from bench.common.cache import cache_root
    return cache_root() / "plan-training-steps.json"


def _machine_key() -> dict:
    """What a probe measured here depends on besides its shape: the precision, threads, torch and the CPU."""
    from bench.common.provenance import hardware
    from lrq import precision as P
    hw = hardware()
    return {"precision": P.current("cpu"), "threads": torch.get_num_threads(), "torch": torch.__version__,
            "cpu": [hw.get("cpu"), hw.get("cpu_kind"), hw.get("torch_cpu_capability")]}


def _probe_key(shape: ModelShape, method, scheme, resolved: dict) -> dict:
    keep = {k: resolved.get(k) for k in method.training_probe_settings}
    return {"method": method.name, "scheme": scheme.name, "shape": shape.probe_shape(),
            "settings": keep, "probe": 2} | _machine_key()   # 2: the median of timed steps (1: two runs' difference)


#: the vocabulary of the probes' random one-block models (their head is not what they measure)
_PROBE_VOCAB = 256


def _probe_model(shape: ModelShape, seq: int):
    """A random one-block Llama of `shape`'s widths (heads, head_dim) and its config, for the probes."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    mc = LlamaConfig(vocab_size=_PROBE_VOCAB, hidden_size=shape.hidden, intermediate_size=shape.intermediate,
                     num_hidden_layers=1, num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads,
                     head_dim=shape.head_dim, max_position_embeddings=max(4096, seq), tie_word_embeddings=False)
    return LlamaForCausalLM(mc).eval(), mc


def _measure_training(shape: ModelShape, method, scheme, cfg: dict, seq: int, compiled: bool) -> dict:
    """Seconds per training step and per block (beyond the steps) of `method` on one random block of `shape`, its
    step compiled as the cell's is."""
    import copy

    from lrq.methods import Calibration
    # a fresh instance without the cell's checkpoint folder: the probe's random block must never be written where
    # the cell resumes from (a --sync folder would commit it)
    method = type(method)(device=method.device)
    model0, mc = _probe_model(shape, seq)
    bs = method.training(cfg)[1]
    n = 2 * bs + 1
    ids = torch.randint(0, mc.vocab_size, (n, seq), generator=torch.Generator().manual_seed(0))
    calib = Calibration(ids, {"dataset": "random", "n_samples": n, "seq_len": seq, "seed": 0})
    times, measured = [], {}
    # the first run compiles from cold (and warms torch's caches): discarded, as a real cell pays that once while
    # its later blocks compile warm
    for steps in _PROBE_STEPS:
        conf = method.training_probe_config(cfg, steps, compiled)
        model = copy.deepcopy(model0)
        t = time.perf_counter()
        measured = method.quantize(model, scheme, conf, calib) or {}
        times.append(time.perf_counter() - t)
    total = times[-1]
    step = measured.get("step_s_median")
    if not step or not math.isfinite(step):   # a method that does not time its steps: the whole run per step
        step = total / _PROBE_STEPS[-1]
    step = max(float(step), 1e-6)
    return {"step_s": step, "block_s": max(total - _PROBE_STEPS[-1] * step, 0.0), "probe_s": times,
            "train_s": measured.get("train_time_s"), "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}


def measured_training(work: dict[str, tuple[float, float]], shape: ModelShape, method, scheme, cfg: dict,
                      seq: int) -> None:
    """Replace the FLOP-scaled training of a long block-wise cell (MEASURE_TRAINING_FROM_STEPS) by its measured
    step: kinds `probe:<key>:step` (calls: blocks x steps) and `probe:<key>:block` (calls: blocks), priced by
    `seconds` from the cache of measured steps."""
    kind = f"train_{method.name}"
    cfg = method.typed(cfg)   # the settings parsed upstream (a cell's, the command line's), never parsed again
    if kind not in work or scheme is None or method.training(cfg) is None:
        return
    steps_per_block, batch = method.training(cfg)
    steps = steps_per_block * shape.layers
    # only compiled steps (the eager profile prices eager ones), only many of them, only a block this machine
    # trains in seconds (a 70B block would take minutes and gigabytes to probe: its FLOP-scaled price stands)
    if steps < MEASURE_TRAINING_FROM_STEPS or shape.block_params() > MEASURE_TRAINING_MAX_BLOCK_PARAMS:
        return
    try:
        resolved = method.resolve(scheme, cfg)
    except Exception:  # noqa: BLE001 - settings the method refuses are said by the run itself
        return
    if not resolved.get("compile"):
        return
    key = _probe_key(shape, method, scheme, resolved) | {"seq": int(seq)}
    digest = _cached_probe(key, lambda: _measure_training(shape, method, scheme, cfg, seq, True),
                           f"measuring a {method.name} training step at this cell's shape (batch "
                           f"{batch} x {seq}, compiled; about a minute, once) ...")
    del work[kind]
    work[f"probe:{digest}:step"] = (float(steps), 0.0)
    work[f"probe:{digest}:block"] = (float(shape.layers), 0.0)


# The cells of a method that walks calibration statistics per block (Method.probe_walk: GPTQ, AWQ) with this many calibration tokens or more (the long and paper presets) have their work
# priced at the model's own widths: the FLOP rates of the profile's narrow random blocks are several times lower
# than a 576-wide block's large matmuls reach (on the Zen 4 the profile priced the long preset's GPTQ w4a8 at
# 4,281 s of quantization against 1,394 s measured for 24 of its 30 blocks).
MEASURE_WALK_FROM_TOKENS = 65536
_WALK_PROBE_WINDOWS = (2, 2, 8)      # a discarded warm-up, then the two measured calibration sizes


def _measure_walk(shape: ModelShape, method, scheme, cfg: dict, seq: int) -> dict:
    """The method's whole quantization of one random block of `shape`'s widths at two calibration sizes, fitted as
    seconds = per_block + flops x flop_s, where flops is the method's own work formula (`Method.work`) for that
    block: the formula scales the work with the calibration size and the method's caps, the probe supplies the
    rate this machine reaches at these widths."""
    import copy
    from dataclasses import replace

    from lrq.methods import Calibration
    method = type(method)(device=method.device)     # never the cell's checkpoint folder (see _measure_training)
    model0, mc = _probe_model(shape, seq)
    one = replace(shape, layers=1, vocab=_PROBE_VOCAB, tied=False, mlp="gated", sliding_window=None,
                  sliding_layers=0)   # the probe's block, as the work formula describes it
    conf = method.typed(cfg)
    points = []
    for n in _WALK_PROBE_WINDOWS:
        ids = torch.randint(0, mc.vocab_size, (n, seq), generator=torch.Generator().manual_seed(n))
        calib = Calibration(ids, {"dataset": "random", "n_samples": n, "seq_len": seq, "seed": 0})
        model = copy.deepcopy(model0)
        t = time.perf_counter()
        method.quantize(model, scheme, conf, calib)
        points.append((sum(f for _, f in method.work(one, scheme, conf, n, seq).values()),
                       time.perf_counter() - t))
    (f1, t1), (f2, t2) = points[1], points[2]
    flop_s = max((t2 - t1) / max(f2 - f1, 1.0), 1e-15)
    return {"flop_s": flop_s, "block_s": max(t1 - f1 * flop_s, 0.0), "points": points,
            "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}


def measured_walk(work: dict[str, tuple[float, float]], shape: ModelShape, method, scheme, cfg: dict, n: int,
                  seq: int) -> None:
    """Replace the FLOP-scaled price of a cell of a method that walks calibration statistics (Method.probe_walk) with many calibration tokens (MEASURE_WALK_FROM_TOKENS)
    by its work formula priced at the rate measured at the model's widths (`_measure_walk`): kinds
    `probe:<key>:flop` (calls: the formula's FLOPs) and `probe:<key>:block` (calls: blocks)."""
    if scheme is None or not method.probe_walk or n * seq < MEASURE_WALK_FROM_TOKENS \
            or shape.block_params() > MEASURE_TRAINING_MAX_BLOCK_PARAMS:
        return
    cfg = method.typed(cfg)   # the settings parsed upstream, never parsed again
    try:
        resolved = method.resolve(scheme, cfg)
    except Exception:  # noqa: BLE001 - settings the method refuses are said by the run itself
        return
    keep = {k: v for k, v in dict(resolved).items() if k not in ("preset",)}
    key = {"method": method.name, "scheme": scheme.name, "shape": shape.probe_shape(), "seq": int(seq),
           "settings": keep, "probe": "walk-1"} | _machine_key()
    digest = _cached_probe(key, lambda: _measure_walk(shape, method, scheme, cfg, seq),
                           f"measuring {method.name}'s quantization of one block at this model's widths ({seq}-token "
                           f"windows; seconds, once) ...")
    flops = sum(f for _, f in work.values())
    work.clear()
    work[f"probe:{digest}:flop"] = (float(flops), 0.0)
    work[f"probe:{digest}:block"] = (float(shape.layers), 0.0)


# a text pass is priced from a forward measured at the model's own shape where its block has at most this many
# parameters (a CPU measures a SmolLM2- or 1B-shaped block in seconds; larger ones keep the FLOP-scaled price)
MEASURE_EVAL_MAX_BLOCK_PARAMS = 50_000_000
# ... and at least this many parameters in all (below it a text pass takes seconds and its FLOP price will do)
MEASURE_EVAL_MIN_PARAMS = 20_000_000


def _eval_probe_key(shape: ModelShape, seq: int) -> dict:
    return {"probe": "eval", "shape": shape.probe_shape() + [shape.vocab],
            "seq": int(seq)} | _machine_key()


def _measure_eval(shape: ModelShape, seq: int, blocks: int = 4) -> dict:
    """Seconds per scored window of `seq` tokens on random models of `shape` (1 and `blocks` blocks, the real
    vocabulary and output head), through the harness's own perplexity pass at the current precision: per block,
    the rest (embedding, float32 head, NLL), what the KL divergence from a reference adds (bench.evaluations.kl), and the
    reference's own pass beyond its blocks. About 20 s for SmolLM2's shape on one core."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from bench.evaluations import kl
    from bench.evaluations.perplexity import perplexity
    win = torch.randint(0, shape.vocab, (seq,), generator=torch.Generator().manual_seed(0))

    def model(layers):
        torch.manual_seed(0)
        mc = LlamaConfig(vocab_size=shape.vocab, hidden_size=shape.hidden, intermediate_size=shape.intermediate,
                         num_hidden_layers=layers, num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads,
                         head_dim=shape.head_dim, max_position_embeddings=max(4096, seq), tie_word_embeddings=False)
        return LlamaForCausalLM(mc).eval()

    def timed(fn) -> float:
        t = time.perf_counter()
        fn()
        return time.perf_counter() - t
    one, many = model(1), model(blocks)
    perplexity(one, win, seq, desc="probe")          # warm-up
    t1 = timed(lambda: perplexity(one, win, seq, desc="probe"))
    tn = timed(lambda: perplexity(many, win, seq, desc="probe"))
    block = max((tn - t1) / (blocks - 1), 1e-6)
    ref = {}
    t_ref = timed(lambda: ref.setdefault("r", kl.compute_reference(one, [win])))
    t_kl = timed(lambda: perplexity(one, win, seq, desc="probe", reference=ref["r"]))
    return {"win_block_s": block, "win_rest_s": max(t1 - block, 0.0), "win_kl_s": max(t_kl - t1, 0.0),
            "ref_rest_s": max(t_ref - block, 0.0), "probe_s": {"ppl1": t1, f"ppl{blocks}": tn, "ref": t_ref,
                                                              "ppl1_kl": t_kl},
            "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}


def measured_eval(shape: ModelShape, seq: int) -> str | None:
    """The digest of this machine's measured text pass at `shape` and `seq` (measured once and cached beside the
    training steps), or None where it is not measured (a block too large to probe quickly)."""
    if shape.block_params() > MEASURE_EVAL_MAX_BLOCK_PARAMS or shape.params() < MEASURE_EVAL_MIN_PARAMS:
        return None
    def measure():
        with _quiet():
            return _measure_eval(shape, seq)
    return _cached_probe(_eval_probe_key(shape, seq), measure,
                         f"measuring a {seq}-token evaluation window at this model's shape (about 20 s, once) ...")


def _cached_probe(key: dict, measure, message: str) -> str:
    """The digest under which the probe cache holds `measure()`'s result for `key`, measured (saying `message`)
    and stored atomically where it is missing; a file lock makes parallel processes measure it once."""
    import hashlib

    from lrq.io import atomic_write_text, file_lock
    digest = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:16]
    path = _probe_cache()
    with file_lock(path):
        try:
            cache = json.loads(path.read_text()) if path.is_file() else {}
        except (OSError, ValueError):
            cache = {}
        if digest not in cache:
            _say_stderr(message)
            cache[digest] = measure() | {"key": key}
            atomic_write_text(path, dumps_json(cache, indent=1))
    return digest


def seconds(work: dict[str, tuple[float, float]], profile: dict) -> float:
    total = 0.0
    probes = None
    for kind, (calls, flops) in work.items():
        if kind.startswith("probe:"):
            if probes is None:
                probes = json.loads(_probe_cache().read_text())
            _, digest, part = kind.split(":")
            total += calls * probes[digest][f"{part}_s"]
            continue
        if kind not in profile["kinds"]:
            raise UserError(f"the machine profile has no timing for {kind!r} work (it predates that method): "
                            f"measure it again with `lrq-bench plan --remeasure`.")
        k = profile["kinds"][kind]
        total += k["per_call_s"] * calls + flops / k["flops_per_s"]
    return total


def schedule(durations: list[float], workers: int) -> float:
    """Wall time of independent cells on `workers` devices, longest first onto the least loaded."""
    loads = [0.0] * max(1, workers)
    for d in sorted(durations, reverse=True):
        i = loads.index(min(loads))
        loads[i] += d
    return max(loads)


def plan_cells(shape: ModelShape, methods: list[str], schemes: list[str], profile: dict, *, preset: str = "quick",
               overrides: dict | None = None, n: int = 128, seq: int = 512, eval_tokens: dict[str, int] | None = None,
               eval_seq: int = 2048, tasks: list[str] | None = None, task_limit: int | None = None,
               offload: bool = True, measure: bool = False) -> list[CellPlan]:
    """The planned cells. `measure`: `profile` is this machine's CPU profile, so compiled training steps may be
    measured here at each cell's shape (`measured_training`)."""
    from lrq.methods import get_method
    from lrq.schemes import get_scheme
    out = []
    eval_tokens = eval_tokens or {}
    for name in methods:   # the planned cells, settled once from their names
        method = get_method(name)
        if method.external:
            raise UserError(f"{name} runs another stack in its own environment: the planner has no cost model "
                            f"for it (time one cell instead).")
        cfg = method.config(preset, overrides or {})
        for s in schemes:
            scheme = get_scheme(s)
            work = cell_work(shape, method, scheme, cfg, n, seq, eval_tokens, eval_seq, tasks or [], task_limit,
                             measure and profile.get("device") == "cpu")
            host, dev = estimate_memory(shape, method, n, seq, profile["device"], offload)
            out.append(CellPlan(name, s, work, seconds(work, profile), host, dev))
    return out


def eval_tokens_for(datasets, max_tokens: int | None) -> dict[str, int]:
    """Tokens scored per dataset at `--max-eval-tokens` (None: the whole text, as the catalogue sizes it)."""
    from bench.evaluations.evals import PERPLEXITY
    full = {d: PERPLEXITY[d].full_tokens if d in PERPLEXITY else 300_000 for d in datasets}
    return {d: min(max_tokens or full[d], full[d]) for d in datasets}


@dataclass
class RunEstimate:
    """Seconds per stage of every cell a run will compute (`stages[i]`: cell index -> stage -> seconds), on
    the machine `profile` describes; cells with no cost model (external adapters) are in `unpriced`."""
    stages: dict[int, dict[str, float]]
    unpriced: list[int]
    profile: dict
    host_bytes: dict[int, int] = field(default_factory=dict)   # cell index -> estimated peak host memory
    done_blocks: dict[int, int] = field(default_factory=dict)  # cell index -> blocks already finished, not priced

    def seconds(self, i: int) -> float:
        return sum(self.stages.get(i, {}).values())

    @property
    def total(self) -> float:
        return sum(self.seconds(i) for i in self.stages)

    def wall(self, workers: int) -> float:
        return schedule([self.seconds(i) for i in self.stages], workers)


@dataclass(frozen=True)
class Priced:
    """What one cell of a run will compute, as the estimate prices it (`price`; a cell with any unit missing is
    quantized again, the model is not stored): built from a settled cell and its missing units by `estimate_run`, and from the command line by `plan_specs` (`lrq-bench plan`), so that
    `plan` and `run` price the same cells the same way."""
    label: str
    method: Any                       # the method class, None for the FP reference
    scheme: Any
    config: dict
    n: int
    seq: int
    ppl: tuple[str, ...]              # texts whose perplexity is computed
    kl: tuple[str, ...]               # texts whose KL divergence from FP is computed (same pass as ppl)
    max_tokens: int | None
    eval_seq: int
    tasks: tuple[str, ...] = ()
    task_limit: int | None = None
    measure: bool = False             # this machine's CPU profile: training steps and text passes measured at the
    #                                   cell's own shape (`measured_training`, `measured_eval`)
    cached_refs: tuple[str, ...] = ()  # texts whose FP KL reference is in the cache already: not computed again
    done_blocks: int = 0              # blocks an earlier run finished (a checkpoint): their work is not priced,
    replay: bool = False              # ... only the calibration streams recomputed through them, where `replay`


def price(shape: ModelShape, specs: dict[int, Priced], profile: dict) -> RunEstimate:
    """Seconds per stage of every cell: the method's work, every text's pass (perplexity and KL together: the
    FP logits recomputed from the stored hidden states by the output head, in float32), the tasks, and the FP
    reference pass over a text, once per run, in the stage of the first cell that needs it (bench.evaluations.kl)."""
    from lrq.methods import add_work
    stages: dict[int, dict[str, float]] = {}
    host_bytes: dict[int, int] = {}
    unpriced = []
    references: set[str] = set()
    for i, sp in specs.items():
        if sp.method is not None and sp.method.external:
            unpriced.append(i)
            continue
        datasets = sorted(set(sp.ppl) | set(sp.kl), key=lambda d: (d not in ("wikitext2", "c4"), d))
        tokens = eval_tokens_for(datasets, sp.max_tokens)
        work = stage_work(shape, sp.method, sp.scheme, sp.config, sp.n, sp.seq, tokens, sp.eval_seq,
                          list(sp.tasks), sp.task_limit, measure=sp.measure)
        if sp.done_blocks and sp.method is not None:
            work["quant"] = resumed_work(work["quant"], shape, sp.scheme, sp.n, sp.seq, sp.done_blocks, sp.replay)
        probe = measured_eval(shape, sp.eval_seq) if sp.measure and datasets else None
        for d in sp.kl:   # scoring KL: the FP logits from the float32 head, and the divergence itself
            windows = max(1, tokens[d] // sp.eval_seq)
            if probe:
                add_work(work[d], f"probe:{probe}:win_kl", windows, 0.0)
            else:
                add_work(work[d], "fwd", windows, 2.0 * shape.hidden * shape.vocab * windows * sp.eval_seq)
        new_refs = set(sp.kl) - references - set(sp.cached_refs)
        if new_refs:   # one FP pass over these texts, before the cell quantizes (none where it is cached)
            references |= new_refs
            ref_tokens = eval_tokens_for(sorted(new_refs), sp.max_tokens)
            ref_work = {} if probe else stage_work(shape, None, None, {}, 1, 1, ref_tokens, sp.eval_seq, [], None)
            for d in new_refs:
                if probe:
                    windows = max(1, ref_tokens[d] // sp.eval_seq)
                    add_work(work["quant"], f"probe:{probe}:win_block", windows * shape.layers, 0.0)
                    add_work(work["quant"], f"probe:{probe}:ref_rest", windows, 0.0)
                    continue
                for kind, (calls, flops) in ref_work[d].items():
                    add_work(work["quant"], kind, calls, flops)
        stages[i] = {name: seconds(w, profile) for name, w in work.items()}
        if sp.method is not None:
            host_bytes[i] = estimate_memory(shape, sp.method, sp.n, sp.seq, profile.get("device", "cpu"))[0]
    done = {i: sp.done_blocks for i, sp in specs.items() if sp.done_blocks and i in stages}
    return RunEstimate(stages, unpriced, profile, host_bytes, done)


def resumed_work(work: dict[str, tuple[float, float]], shape: ModelShape, scheme, n: int, seq: int, done: int,
                 replay: bool) -> dict[str, tuple[float, float]]:
    """The quantization's work where `done` of its blocks are finished already (a resumed block-wise cell): the
    per-block work of the blocks left (everything but W8A8's whole-model range pass, which runs after the walk),
    and, where `replay`, the calibration streams recomputed through the finished blocks (one forward of each
    over the n x seq tokens per stream; two streams where the method trains against FP targets)."""
    from lrq.methods import add_work, static_range_work
    left = max(0, shape.layers - done) / shape.layers
    whole = static_range_work(shape, scheme, n, seq)
    out: dict[str, tuple[float, float]] = {}
    for kind, (calls, flops) in work.items():
        wc, wf = whole.get(kind, (0.0, 0.0))
        add_work(out, kind, (calls - wc) * left + wc, (flops - wf) * left + wf)
    if replay:
        streams = 2 if any(k.startswith("train_") or k.endswith(":step") for k in work) else 1   # trains
        add_work(out, "fwd", done * streams, done * streams * shape.block_fwd_flops(n * seq, seq))
    return out


def estimate_run(shape: ModelShape, cells: dict[int, Any], todo: dict[int, set[str]], profile: dict,
                 carry: Any = None) -> RunEstimate:
    """The planner's estimate of a run about to start: for each settled cell (bench.run.cell.Cell) the stages its
    missing units need. A cell with any unit missing is quantized again (the model is not stored), so its
    "quant" stage always counts; a perplexity or task stage only when that unit is missing. Blocks an earlier
    run finished, in the cell's local checkpoint or in `carry`'s folder (bench.run.ledger.Carry, `run --sync`),
    are not priced again (bench.run.ledger.finished_blocks)."""
    from bench.run.ledger import finished_blocks
    specs = {}
    for i, cell in cells.items():
        units = todo.get(i) or set()
        if not units:
            continue
        done, replay = finished_blocks(cell, carry) if "quant" in units and not cell.is_fp else (0, False)
        specs[i] = Priced(
            f"{cell.method_name} {cell.scheme_name}", None if cell.is_fp else cell.method, cell.scheme,
            cell.config, cell.calib.n_samples, cell.calib.seq_len,
            tuple(d for d in cell.datasets if d in units), tuple(d for d in cell.datasets if f"{d}:kl" in units),
            cell.eval.max_tokens, cell.eval.seq_len, tuple(cell.tasks) if "tasks" in units else (), cell.task_limit,
            measure=profile.get("device") == "cpu", cached_refs=_cached_references(cell), done_blocks=done,
            replay=replay)
    return price(shape, specs, profile)


def _cached_references(cell) -> tuple[str, ...]:
    """The texts of `cell` whose FP KL reference (bench.evaluations.kl) is in the cache: loaded, not computed."""
    from bench.evaluations import kl
    from bench.run.cell import kl_reference_key
    return tuple(ds for ds in cell.datasets if kl.reference_path(kl_reference_key(cell, ds)).is_file())


def plan_specs(methods: list[str], schemes: list[str], calib: Any, *, preset: str, overrides: dict,
               datasets: list[str], max_tokens: int | None, eval_seq: int, tasks: list[str], task_limit: int | None,
               fp: bool = True, measure: bool = False) -> dict[int, Priced]:
    """The cells `lrq-bench run` would compute on an empty store with these options, in its order (FP first),
    as `price` takes them. `calib(method) -> (n, seq)`."""
    from lrq.methods import get_method
    from lrq.schemes import get_scheme
    out: list[Priced] = []
    if fp:
        out.append(Priced("fp fp", None, None, {}, 1, 1, tuple(datasets), (), max_tokens, eval_seq, tuple(tasks),
                          task_limit, measure=measure))
    for name in methods:
        method = get_method(name)
        if method.external:
            raise UserError(f"{name} runs another stack in its own environment: the planner has no cost model "
                            f"for it (time one cell instead).")
        cfg = method.config(preset, overrides or {})
        n, seq = calib(name)
        for s in schemes:
            out.append(Priced(f"{name} {s}", method, get_scheme(s), cfg, n, seq, tuple(datasets), tuple(datasets),
                              max_tokens, eval_seq, tuple(tasks), task_limit, measure=measure))
    return dict(enumerate(out))


def check_fits(shape: ModelShape, method, n: int, seq: int, device: str, host_available: int,
               device_available: int | None = None, offload: bool = True, jobs: int = 1) -> None:
    """Refuse, before any work, a cell whose estimated peak memory exceeds what is available: the host's
    memory shared by `jobs` cells at once (--jobs), the first way out named where fewer would fit."""
    host, dev = estimate_memory(shape, method, n, seq, device, offload)
    gib = 2**30
    problems, hints = [], []
    share = host_available // jobs
    if host > share:
        problems.append(f"about {host / gib:.1f} GiB of host memory, {share / gib:.1f} GiB available"
                        + (f" to each of the --jobs {jobs} cells run at once ({host_available / gib:.1f} GiB in "
                           f"all)" if jobs > 1 else ""))
        if jobs > 1 and host <= host_available:
            hints.append(f"fewer cells at once (--jobs {host_available // host} fits)")
    if device_available is not None and dev > device_available:
        problems.append(f"about {dev / gib:.1f} GiB of device memory, {device_available / gib:.1f} GiB available")
    if not problems:
        return
    fits = [k for k in (n // 2, n // 4, n // 8) if k >= 2 and estimate_memory(shape, method, k, seq, device, offload)[0]
            <= share]
    if fits:
        hints.append(f"fewer calibration samples (--calib-samples {fits[0]} fits)")
    hints.append("shorter calibration sequences (--calib-seq-len)")
    hints.append("calibration activations on disk (a smaller LRQ_RAM_BUDGET_GB)")
    if device != "cpu" and not offload:
        hints.append("block-by-block offloading")
    raise UserError(f"{shape.name} {method.name} with {n} x {seq} calibration tokens needs {' and '.join(problems)}. "
                    f"What would fit: {'; '.join(hints)}.")


def host_memory_available() -> int:
    """Bytes of host memory available now (LRQ_BENCH_HOST_MEMORY_GB declares a smaller limit)."""
    import psutil
    avail = psutil.virtual_memory().available
    limit = os.environ.get("LRQ_BENCH_HOST_MEMORY_GB")
    return min(avail, int(float(limit) * 2**30)) if limit else avail


def as_rows(plans: list[CellPlan]) -> list[dict]:
    return [{"method": p.method, "scheme": p.scheme, "hours": p.seconds / 3600, "seconds": p.seconds,
             "host_gib": p.host_bytes / 2**30, "device_gib": p.device_bytes / 2**30}
            | ({"stages": p.stages} if p.stages is not None else {}) for p in plans]


def describe(shape: ModelShape) -> dict:
    return asdict(shape) | {"params": shape.params()}


def fmt_duration(s: float) -> str:
    """'2 h 31 min', '12 min', '45 s'."""
    if s < 90:
        return f"{s:.0f} s"
    m = round(s / 60)
    return f"{m} min" if m < 60 else f"{m // 60} h {m % 60} min"


def fmt_hours(s: float) -> str:
    return f"{s / 3600:.2f} h" if s >= 360 else f"{s:.0f} s" if s < 600 else f"{s / 60:.0f} min"


__all__ = ["ModelShape", "SHAPES", "load_shape", "plan_cells", "estimate_memory", "check_fits", "measure_profile",
           "load_or_measure_profile", "schedule", "seconds"]
