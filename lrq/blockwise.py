"""Walking a model block by block over calibration data: the calibration pipeline every block-wise
method (GPTQ, AWQ, LRQ, FlexRound, OmniQuant) plugs into, kept apart from the algorithms.

The calibration set runs through the embeddings once; block inputs are captured at the first decoder
block. Then, for block l:
  fp_target = FP block l applied to the FP chain's input       (what reconstruction aims for)
  q_input   = output of the already-quantized blocks 1..l-1    (what the block will really see)
`process(ctx)` quantizes block l in place; the engine then recomputes the quantized chain's output
through the frozen block for block l+1 (METHOD.md section 2).

Activations live in RAM when they fit a budget, otherwise in memory-mapped files on disk.
"""

from __future__ import annotations

import json
import logging
import contextlib
import math
import os
import time
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm

from lrq import precision, progress
from lrq.arch import decoder_blocks
from lrq.io import atomic_write, atomic_write_text

log = logging.getLogger("lrq_bench")

DEFAULT_RAM_BUDGET = int(os.environ.get("LRQ_RAM_BUDGET_GB", "6")) * 2**30


class ActivationBuffer:
    """[n, seq, hidden] float32 activations, in RAM or memory-mapped from a file."""

    def __init__(self, shape: tuple[int, ...], on_disk: bool = False, directory: str | Path | None = None):
        self.shape = tuple(shape)
        self.path: Path | None = None
        if on_disk:
            fd, name = tempfile.mkstemp(prefix="lrq-acts-", suffix=".f32", dir=directory)
            os.close(fd)
            self.path = Path(name)
            numel = 1
            for s in shape:
                numel *= s
            self.data = torch.from_file(name, shared=True, size=numel, dtype=torch.float32).view(*shape)
        else:
            self.data = torch.empty(shape, dtype=torch.float32)

    @property
    def nbytes(self) -> int:
        return self.data.numel() * 4

    def __len__(self) -> int:
        return self.shape[0]

    def close(self) -> None:
        if self.path is not None:
            self.data = None
            self.path.unlink(missing_ok=True)
            self.path = None

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


class _Stop(Exception):
    pass


class _Catcher(nn.Module):
    """In place of the first block: keeps its input hidden states and stops the forward there."""
    def __init__(self, block: nn.Module, sink: list):
        super().__init__()
        self.block, self.sink = block, sink

    def forward(self, hidden_states, *args, **kwargs):
        self.sink.append(hidden_states.detach().float().cpu())
        raise _Stop


class _Recorder(nn.Module):
    """In place of a block for one forward: keeps the keyword arguments the model calls this block with (its
    own layer's rotary embeddings and attention mask), then runs the block; the last one stops the forward."""
    def __init__(self, block: nn.Module, sink: list, last: bool):
        super().__init__()
        self.block, self.sink, self.last = block, sink, last
        if hasattr(block, "attention_type"):      # read by some models' forward to choose the layer's mask
            self.attention_type = block.attention_type

    def forward(self, hidden_states, *args, **kwargs):
        self.sink.append(kwargs)
        if self.last:
            raise _Stop
        return self.block(hidden_states, *args, **kwargs)


def block_kwargs_for(kwargs: dict, device: torch.device, memo: dict | None = None) -> dict:
    """Keyword arguments a decoder block is called with (rotary embeddings, mask), minus the KV cache. `memo`
    (id -> moved tensor) keeps tensors that several layers share shared after the move."""
    memo = {} if memo is None else memo

    def move(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in memo:
            memo[id(t)] = (t, t.to(device))     # the source kept alive: its id stays unique meanwhile
        return memo[id(t)][1]
    out = {}
    for k, v in kwargs.items():
        if k in ("cache", "past_key_values", "past_key_value", "use_cache"):
            continue
        if isinstance(v, torch.Tensor):
            v = move(v)
        elif isinstance(v, tuple) and all(isinstance(t, torch.Tensor) for t in v):
            v = tuple(move(t) for t in v)
        out[k] = v
    out["use_cache"] = False
    return out


def layer_kwargs_for(per_layer: list[dict], device: torch.device) -> list[dict]:
    """Every layer's keyword arguments on `device`, tensors shared between layers moved once."""
    memo: dict = {}
    return [block_kwargs_for(kw, device, memo) for kw in per_layer]


def new_buffer(n: int, seq: int, hidden: int, ram_budget: int, streams: int = 2) -> ActivationBuffer:
    """A buffer in RAM if `streams` buffers of this size fit the budget, else on disk."""
    nbytes = n * seq * hidden * 4
    return ActivationBuffer((n, seq, hidden), on_disk=nbytes * streams > ram_budget,
                            directory=os.environ.get("LRQ_ACT_DIR"))


@torch.no_grad()
def capture_block_inputs(model: nn.Module, input_ids: torch.Tensor, ram_budget: int = DEFAULT_RAM_BUDGET
                         ) -> tuple[ActivationBuffer, list[dict]]:
    """Inputs to the first decoder block for every calibration window, and every block's own call kwargs
    (list index = block index): layers differ in them where a model mixes sliding-window and full-attention
    layers (their masks) or rotary bases (Gemma 3), so each block is replayed with what the model gives it.
    The kwargs come from one forward of the first window through every block but the last."""
    layers = decoder_blocks(model)
    device = next(model.parameters()).device
    n, seq = input_ids.shape
    buf = new_buffer(n, seq, model.config.hidden_size, ram_budget)
    per_layer: list[dict] = []
    originals = list(layers)
    for i, block in enumerate(originals):
        layers[i] = _Recorder(block, per_layer, last=i == len(originals) - 1)
    try:
        try:
            model(input_ids[:1].to(device), use_cache=False)
        except _Stop:
            pass
    finally:
        for i, block in enumerate(originals):
            layers[i] = block
    if len(per_layer) != len(originals):
        raise RuntimeError(f"the model called {len(per_layer)} of its {len(originals)} decoder blocks")
    sink: list = []
    layers[0] = _Catcher(originals[0], sink)
    try:
        for i in range(n):
            try:
                model(input_ids[i:i + 1].to(device), use_cache=False)
            except _Stop:
                pass
            buf.data[i] = sink.pop()[0]
    finally:
        layers[0] = originals[0]
    return buf, layer_kwargs_for(per_layer, device)


@torch.no_grad()
def run_block(block: nn.Module, inputs: ActivationBuffer | torch.Tensor, kwargs: dict,
              out: ActivationBuffer | torch.Tensor | None = None, batch_size: int = 8,
              autocast: bool = False) -> ActivationBuffer | torch.Tensor:
    """block(inputs) in batches; writes into `out` (may be `inputs` itself) and returns it. `autocast`: under
    bf16 autocast when the run's precision is bf16 (lrq.precision), else float32."""
    src = inputs.data if isinstance(inputs, ActivationBuffer) else inputs
    dst = out.data if isinstance(out, ActivationBuffer) else out
    if dst is None:
        out = dst = torch.empty_like(src)
    device = next(block.parameters(), next(block.buffers(), torch.empty(0))).device
    with precision.autocast(device, enabled=autocast):
        for i in range(0, src.shape[0], batch_size):
            y = block(src[i:i + batch_size].to(device), **kwargs)
            y = y[0] if isinstance(y, tuple) else y
            dst[i:i + batch_size] = y.float().cpu()
    return out


@dataclass
class BlockContext:
    index: int
    n_blocks: int
    block: nn.Module
    q_inputs: ActivationBuffer            # inputs from the already-quantized chain
    fp_targets: ActivationBuffer | None   # FP block output on the FP chain's input
    kwargs: dict
    stats: dict = field(default_factory=dict)


class CheckpointDamaged(Exception):
    """A checkpoint file that cannot be read back (truncated, empty, garbage): the walk starts afresh."""


def _encode_floats(obj):
    """JSON without NaN: a non-finite float becomes {"float": "nan" | "inf" | "-inf"} (decoded back exactly)."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return {"float": repr(obj)}
    if isinstance(obj, dict):
        return {k: _encode_floats(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_encode_floats(v) for v in obj]
    return obj


def _decode_floats(d: dict):
    return float(d["float"]) if d.keys() == {"float"} else d


def _npy_data_offset(path: Path, target: torch.Tensor) -> int:
    """Where the data of a float32 .npy file of `target`'s shape starts (ValueError when the file's header
    or length does not match `target`, or `target` cannot be read into)."""
    import numpy as np
    fmt = np.lib.format
    if target.dtype != torch.float32 or not target.is_contiguous() or target.device.type != "cpu":
        raise ValueError("the target is not a contiguous float32 CPU tensor")
    with open(path, "rb") as f:
        major, _ = fmt.read_magic(f)
        shape, fortran, dtype = (fmt.read_array_header_1_0 if major == 1 else fmt.read_array_header_2_0)(f)
        offset = f.tell()
    if tuple(shape) != tuple(target.shape) or fortran or dtype != np.dtype("<f4"):
        raise ValueError(f"holds {dtype} {tuple(shape)}{' (Fortran order)' if fortran else ''}, "
                         f"not float32 {tuple(target.shape)}")
    size, want = path.stat().st_size - offset, target.numel() * 4
    if size != want:
        raise ValueError(f"holds {size:,} bytes of data where {want:,} were expected")
    return offset


def _read_into(path: Path, offset: int, target: torch.Tensor) -> None:
    """Read the bytes of `path` from `offset` straight into `target`'s memory."""
    view = memoryview(target.numpy()).cast("B")
    with open(path, "rb") as f:
        f.seek(offset)
        got = f.readinto(view)
    if got != view.nbytes:
        raise OSError(f"{path}: read {got:,} of {view.nbytes:,} bytes")


class BlockCheckpoint:
    """Resumable state of a block walk, saved atomically after every block in `directory`: the finished
    blocks' state dicts (safetensors: tensors only, nothing in them is ever executed), the two calibration
    streams entering the next block (.npy, named with the block count they follow, written from the walk's
    buffers without a copy) and the per-block statistics and progress (JSON, written last: it is what makes a
    block count as done). A run killed at any point resumes at the next unfinished block and ends with exactly
    the result of an uninterrupted run (streams are saved bit-exactly; training randomness is seeded per block).
    `identity` guards against resuming a different configuration. A block or state file that cannot be read
    back (truncated by a crash of the machine, emptied, replaced by garbage) is reported once and the walk
    starts afresh: a damaged checkpoint costs the blocks it held, never a wedged cell. Damaged or missing
    streams cost less: they are recomputed from the finished blocks."""

    STATE = "state.json"
    # streams written before 2026-12-04, under one name for every block count: a crash between them and the
    # state could leave the streams of block k+1 beside a state that says k blocks, so they are never trusted
    LEGACY_STREAMS = "streams.safetensors"

    def __init__(self, directory: str | Path, identity: str):
        self.dir = Path(directory)
        self.identity = identity
        self.dir.mkdir(parents=True, exist_ok=True)

    @staticmethod
    def _block_name(index: int) -> str:
        return f"block{index:04d}.safetensors"

    def _save_tensors(self, state: dict, name: str) -> None:
        """Tensors into safetensors; anything else in a state dict (a module's extra state, such as whether
        its activation range was calibrated) as JSON in the file's metadata."""
        from safetensors.torch import save_file
        # safetensors refuses views sharing storage: every tensor is written as its own contiguous copy
        flat = {k: v.detach().to("cpu").contiguous().clone() for k, v in state.items() if torch.is_tensor(v)}
        extra = json.dumps(_encode_floats({k: v for k, v in state.items() if not torch.is_tensor(v)}), allow_nan=False)
        atomic_write(self.dir / name, lambda p: save_file(flat, str(p), metadata={"lrq_extra": extra}))

    def _load_tensors(self, name: str) -> dict:
        from safetensors import safe_open
        try:
            with safe_open(str(self.dir / name), framework="pt") as f:
                out = {k: f.get_tensor(k) for k in f.keys()}
                extra = (f.metadata() or {}).get("lrq_extra", "{}")
            return out | json.loads(extra, object_hook=_decode_floats)
        except Exception as e:  # noqa: BLE001 - any unreadable file is the same damage
            raise CheckpointDamaged(f"{self.dir / name}: {type(e).__name__}: {e}") from None

    def _state(self) -> dict | None:
        path = self.dir / self.STATE
        if not path.exists():
            return None
        try:
            state = json.loads(path.read_text(encoding="utf-8"), object_hook=_decode_floats)
            if not isinstance(state, dict) or not isinstance(state.get("done"), int):
                raise ValueError("not a checkpoint state")
            return state
        except (OSError, UnicodeDecodeError, ValueError) as e:
            raise CheckpointDamaged(f"{path}: {type(e).__name__}: {e}") from None

    def completed(self) -> int:
        """Number of finished blocks recorded here for this identity (0 when none or another identity). A
        damaged state file is reported and the folder's files removed: the walk starts afresh."""
        try:
            state = self._state()
        except CheckpointDamaged as e:
            self.discard(str(e))
            return 0
        if state is None:
            return 0
        return state["done"] if state.get("identity") == self.identity else 0

    def discard(self, why: str) -> None:
        """Report a damaged checkpoint once and remove it, so that the next run does not meet it again."""
        log.warning("checkpoint %s is damaged (%s): it is discarded and the blocks it held are computed again",
                    self.dir, why)
        for p in self.dir.iterdir():
            if p.is_file():
                p.unlink(missing_ok=True)

    @staticmethod
    def _streams_name(done: int, which: str) -> str:
        return f"streams-{done:04d}-{which}.npy"

    def save(self, index: int, block: nn.Module, q_next: torch.Tensor, fp_next: torch.Tensor | None,
             stats: list[dict]) -> None:
        done = index + 1
        self._save_tensors(block.state_dict(), self._block_name(index))
        streams = {"q": q_next} | ({} if fp_next is None else {"fp": fp_next})
        for which, t in streams.items():
            self._save_stream(t, self._streams_name(done, which))
        # written last: it is what makes the block count as done
        state = {"identity": self.identity, "done": done, "streams": sorted(streams), "stats": _encode_floats(stats)}
        atomic_write_text(self.dir / self.STATE, json.dumps(state, allow_nan=False))
        keep = {self._streams_name(done, w) for w in streams}
        for p in self.dir.iterdir():   # the streams of earlier blocks (and the legacy file) now serve nothing
            if p.is_file() and p.name.startswith("streams") and p.name not in keep:
                p.unlink(missing_ok=True)

    def _save_stream(self, t: torch.Tensor, name: str) -> None:
        """One [n, seq, hidden] float32 stream as a .npy file, written from the buffer itself: no copy in
        memory (safetensors serialises through a bytes copy of every tensor, which at Llama-2-7B's 128 x 2,048
        calibration tokens is 4.3 GB per stream, twice per block)."""
        import numpy as np
        arr = t.detach()
        if arr.device.type != "cpu" or arr.dtype != torch.float32 or not arr.is_contiguous():
            arr = arr.to("cpu", torch.float32).contiguous()

        def write(p: Path) -> None:
            with open(p, "wb") as f:
                np.save(f, arr.numpy(), allow_pickle=False)
        atomic_write(self.dir / name, write)

    def stats(self) -> list[dict]:
        """The finished blocks' statistics."""
        return self._state()["stats"]

    def read_streams(self, q: torch.Tensor, fp: torch.Tensor | None) -> bool:
        """Read the streams entering the next block into `q` and `fp` (the walk's buffers, in place: no second
        copy in memory). False when this folder does not hold them for its block count (a checkpoint carried
        from another machine, where the streams did not travel; streams of the legacy format; a crash between
        the streams and the state): the walk then recomputes them from the finished blocks
        (`replay_streams`). Streams that cannot be read (truncated, another shape) are reported, removed and
        recomputed the same way: they cost a replay, never the finished blocks."""
        state = self._state()
        done, names = state["done"], state.get("streams", [])
        targets = {"q": q} | ({} if fp is None else {"fp": fp})
        if not set(targets) <= set(names):
            if (self.dir / self.LEGACY_STREAMS).exists():
                log.info("checkpoint %s: its streams are of the earlier format, which does not say after which "
                         "block they were saved; they are recomputed from the %d finished blocks", self.dir, done)
            return False
        layout = {}
        for which, target in targets.items():   # every file checked before any buffer is overwritten
            path = self.dir / self._streams_name(done, which)
            if not path.exists():
                return False
            try:
                layout[which] = (path, _npy_data_offset(path, target))
            except (OSError, ValueError) as e:
                log.warning("checkpoint %s: its %s stream is damaged (%s: %s): the streams are computed again from "
                            "the %d finished blocks", self.dir, which, type(e).__name__, e, done)
                path.unlink(missing_ok=True)
                return False
        for which, (path, offset) in layout.items():
            _read_into(path, offset, targets[which])
        return True

    def block_state(self, index: int) -> dict:
        return self._load_tensors(self._block_name(index))


def method_checkpoint(method, scheme, config, calib) -> BlockCheckpoint | None:
    """The per-block checkpoint of one quantize call of `method` (an lrq.methods.Method) in its `checkpoint_dir`,
    or None without one. Its identity names the method, its version, the scheme, the keyed settings of `config`
    and the calibration windows, so a checkpoint of another configuration is never resumed. (LRQ, FlexRound and
    OmniQuant name theirs in lrq.engine, unchanged since their checkpoints were first carried between machines.)"""
    if method.checkpoint_dir is None:
        return None
    import hashlib
    ident = {"m": method.name, "v": method.version, "s": scheme.name, "c": method.keyed_settings(config),
             "calib": calib.description}
    return BlockCheckpoint(method.checkpoint_dir,
                           hashlib.sha256(json.dumps(ident, sort_keys=True, default=str).encode()).hexdigest())


def replay_streams(layers, states: list[dict], restore: Callable[[int, nn.Module, dict], None],
                   q_in: ActivationBuffer, fp_in: ActivationBuffer | None, fp_out: ActivationBuffer | None,
                   kwargs: list[dict], batch_size: int, device: torch.device | None):
    """The calibration streams entering block len(states), recomputed from the captured block inputs and the
    finished blocks' states, with the walk's own operations in the walk's order: the FP stream through each FP
    block (before it is restored), the quantized stream through each restored block. Deterministic kernels on
    the same kind of CPU and thread count give the streams a walk would have saved, bit for bit (checked by
    the tests); returns the (fp_in, fp_out) pair as the walk swaps it."""
    n = len(states)
    for i, state in enumerate(states):
        progress.update(f"recomputing the streams after block {i + 1}/{n} (checkpoint without streams)",
                        None, force=True)
        block = layers[i]
        home = next(block.parameters()).device
        if device is not None and home != device:
            block.to(device)
        if fp_in is not None:
            run_block(block, fp_in, kwargs[i], fp_out, batch_size)
            fp_in, fp_out = fp_out, fp_in
        restore(i, block, state)
        # a restore that loads weights into the block's own parameters (AWQ's scaled FP block) must not be read
        # through autocast's cached low-precision copies of the old values (made while the inputs were captured)
        torch.clear_autocast_cache()
        run_block(layers[i], q_in, kwargs[i], q_in, batch_size)
        if device is not None and home != device:
            layers[i].to(home)
    return fp_in, fp_out


def walk_blocks(model: nn.Module, input_ids: torch.Tensor, process: Callable[[BlockContext], Any], *,
                need_targets: bool = True, batch_size: int = 8, ram_budget: int = DEFAULT_RAM_BUDGET,
                desc: str = "blocks", checkpoint: BlockCheckpoint | None = None,
                restore: Callable[[int, nn.Module, dict], None] | None = None,
                device: torch.device | str | None = None) -> list[dict]:
    """Call `process` on every decoder block in order with its calibration streams; returns per-block stats.

    `device`: where each block computes. A block that lives elsewhere (the model kept on the CPU) is moved
    there for its turn and moved back afterwards, so the device holds one block at a time; the
    calibration streams stay in host memory (or on disk) and travel to the device batch by batch.

    With a checkpoint, blocks already finished are restored by `restore(index, block, state_dict)`
    (which must turn the block into its quantized form and load the state) instead of recomputed."""
    layers = decoder_blocks(model)
    q_in, kwargs = capture_block_inputs(model, input_ids, ram_budget)
    device = torch.device(device) if device is not None else None
    if device is not None:
        kwargs = layer_kwargs_for(kwargs, device)
    fp_in = None
    if need_targets:
        fp_in = new_buffer(*q_in.shape, ram_budget)
        fp_in.data.copy_(q_in.data)
    fp_out = new_buffer(*q_in.shape, ram_budget) if need_targets else None
    all_stats: list[dict] = []
    start = checkpoint.completed() if checkpoint is not None else 0
    if start:
        if restore is None:
            raise ValueError("resuming from a checkpoint needs a restore function")
        try:
            all_stats = checkpoint.stats()
            states = [checkpoint.block_state(i) for i in range(start)]
        except CheckpointDamaged as e:
            checkpoint.discard(str(e))
            start, all_stats = 0, []
        else:
            for st in all_stats:
                st["restored"] = True   # finished by an earlier (interrupted) run
            if checkpoint.read_streams(q_in.data, fp_in.data if need_targets else None):
                for i, state in enumerate(states):
                    restore(i, layers[i], state)
            else:
                fp_in, fp_out = replay_streams(layers, states, restore, q_in, fp_in, fp_out, kwargs, batch_size, device)
            del states
    try:
        for i in tqdm(range(start, len(layers)), desc=desc, leave=False, initial=start, total=len(layers)):
            block = layers[i]
            progress.update(f"block {i + 1}/{len(layers)}", i / len(layers), force=True)
            t0 = time.perf_counter()
            home = next(block.parameters()).device
            if device is not None and home != device:
                block.to(device)
            if need_targets:
                run_block(block, fp_in, kwargs[i], fp_out, batch_size)
            ctx = BlockContext(i, len(layers), block, q_in, fp_out, kwargs[i])
            process(ctx)
            all_stats.append(ctx.stats)
            run_block(layers[i], q_in, kwargs[i], q_in, batch_size)  # quantized chain advances in place
            if device is not None and home != device:
                layers[i].to(home)   # offload: the device holds one block at a time
            ctx.stats["block_s"] = time.perf_counter() - t0
            if MADE_BY:
                ctx.stats["made_by"] = MADE_BY
            if need_targets:
                fp_in, fp_out = fp_out, fp_in
            if checkpoint is not None:
                checkpoint.save(i, layers[i], q_in.data, fp_in.data if need_targets else None, all_stats)
    finally:
        for b in (q_in, fp_in, fp_out):
            if b is not None:
                b.close()
    return all_stats


# What computes the blocks of this process's walks (the harness sets it to its code revision for the length of a
# quantization: `made_by`): recorded with each finished block, so a cell resumed across machines and revisions
# names every revision its blocks came from.
MADE_BY: str | None = None


@contextlib.contextmanager
def made_by(revision: str | None):
    """Walks inside record `revision` with each block they finish (`walk_time_stats`' `block_revisions`)."""
    global MADE_BY
    before, MADE_BY = MADE_BY, revision
    try:
        yield
    finally:
        MADE_BY = before


def walk_time_stats(per_block: list[dict]) -> dict:
    """What a walk cost, for the cell's stats: every block's wall time summed, including the blocks an earlier
    (interrupted) run finished, possibly on another machine (their times travel in the checkpoint), and how
    many blocks came from such a run. A resumed cell's own wall time covers only the blocks it computed. Where
    blocks recorded what made them (`MADE_BY`), `block_revisions` maps each to the blocks it made."""
    out: dict = {"blocks_time_s": sum(b.get("block_s", 0.0) for b in per_block),
                 "resumed_blocks": sum(bool(b.get("restored")) for b in per_block)}
    made: dict[str, list[int]] = {}
    for i, b in enumerate(per_block):
        made.setdefault(str(b.get("made_by") or "unrecorded"), []).append(i + 1)
    if set(made) != {"unrecorded"}:
        out["block_revisions"] = made
    return out
