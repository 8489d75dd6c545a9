"""The machine profile the planner (bench.run.plan) prices with: per-call overhead and FLOP rate of each kind of work,
measured by running the real methods on random two-block Llama models of two widths, cached per machine (hardware,
torch version, precision) in the lrq-bench cache; and the notes that say when the machine was busy while measuring."""

from __future__ import annotations

import contextlib
import json
import os
import time
from pathlib import Path

import torch

from lrq.errors import UserError
from lrq.io import dumps_json

from bench.run.shapes import shape_from_config


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
