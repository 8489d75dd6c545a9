"""Work the planner (bench.run.plan) measures at a cell's own shape instead of scaling the machine profile by FLOPs:
long training steps, the calibration walk of GPTQ/AWQ-like methods, and the evaluation's text pass. Each probe is
measured once per machine and key and cached (`plan-training-steps.json` in the lrq-bench cache)."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import torch

from lrq.io import dumps_json

from bench.run.profile import _quiet
from bench.run.shapes import ModelShape


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
