"""Executors: where cells run.

The sweep (bench/run/sweep.py) decides *what* to run (the cells with units missing from the store) and owns
the store: every unit of results reaches the driver and is written there, the moment it is measured, so
no worker ever opens the SQLite file. An executor decides *where* cells run, with the function it is
given (`run(jobs, sink, cell_fn)`, cell_fn = bench.run.cell.execute): it imports neither the sweep nor the
cell code itself.

- `LocalExecutor(jobs=1)`: in this process, one after the other (the default on one device);
- `LocalExecutor(jobs=N)`: N worker processes on this machine, each with its share of the CPU threads.
  A 135M-parameter model does not keep two cores busy with one process, so on a small CPU machine two
  single-threaded workers finish a sweep much sooner than one process with two threads.

A failing cell (an exception, or a worker that dies: killed, out of memory) is reported as failed and the
others go on; bad input (`UserError`) stops the whole run, as it would stop every cell.

The terminal shows one bar (`ProgressBoard`): cells done, what each running cell is doing now (its stage
and where in it: "lrq w3a16: block 12/30 step 5/20", "rtn w8a8: wikitext2 window 3/8", from lrq.progress
reports that workers send up their pipes), failures, elapsed time and an ETA. The bar counts the planner's
estimated seconds of each stage (bench.run.plan.estimate_run), so the ETA moves with the work inside cells and
corrects itself by the machine's real pace; without an estimate every stage weighs the same.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import multiprocessing.connection as mp_connection
import os
import re
import signal
import sys
import time
import traceback
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Protocol

from tqdm.auto import tqdm

from lrq.errors import UserError

log = logging.getLogger("lrq_bench")


@dataclass
class Job:
    """One cell to run (a settled bench.run.cell.Cell) and the units still missing."""
    index: int
    cell: object
    todo: frozenset[str]


CellFn = Callable[[object, set, Callable[[str, list], None]], object]
Weights = dict[int, dict[str, float]]   # job index -> stage -> estimated seconds (bench.run.plan.RunEstimate.stages)


class ProgressBoard:
    """The one terminal bar of a run: cells done of all, the running cells' current stage and progress,
    failures, elapsed time and ETA. Its unit is estimated seconds of work (`weights`), so a long LRQ cell
    moves the bar block by block and a short RTN cell barely; the ETA is tqdm's, elapsed x remaining / done,
    shown only once a first unit of work (a cell's stage) has finished: before that it would extrapolate from
    the first seconds (model loading, a reference pass), which once read 286 hours after 4 minutes."""

    FORMAT = "{desc} {percentage:3.0f}%|{bar:16}| [{elapsed}<{remaining}]{postfix}"
    FORMAT_NO_ETA = "{desc} {percentage:3.0f}%|{bar:16}| [{elapsed}, ETA after the first unit]{postfix}"

    def __init__(self, jobs: list[Job], weights: Weights | None = None, file=None):
        weights = weights or {}
        known = [sum(w.values()) for w in weights.values() if w]
        fallback = (sum(known) / len(known)) if known else 1.0
        self.weights: dict[int, dict[str, float]] = {}
        for j in jobs:
            w = {k: v for k, v in (weights.get(j.index) or {}).items() if v > 0}
            if not w:   # no estimate (an unpriced method): the mean cell's, split evenly over its units
                units = ["quant"] + sorted({u.split(":")[0] for u in j.todo} - {"quant"})   # ppl + KL: one stage
                w = {u: fallback / len(units) for u in units}
            self.weights[j.index] = w
        self.labels = {j.index: f"{j.cell.method_name} {j.cell.scheme_name}" for j in jobs}
        self.state: dict[int, dict[str, float]] = {}     # running job -> stage -> fraction done
        self.where: dict[int, str] = {}                  # running job -> "stage detail"
        self.finished: set[int] = set()
        self.n_jobs, self.failed = len(jobs), 0
        self.waiting: set[str] = set()                   # cells another run is computing
        self.bar = tqdm(total=round(sum(sum(w.values()) for w in self.weights.values()), 3), desc=self._desc(),
                        unit="s", smoothing=0, dynamic_ncols=True, file=file or sys.stderr,
                        bar_format=self.FORMAT_NO_ETA)
        self.eta = False
        self.stage_done = False                          # a stage of some cell has reported "done"
        self._done = 0.0

    def _desc(self) -> str:
        return f"cells {len(self.finished)}/{self.n_jobs}"

    def start(self, idx: int) -> None:
        self.state[idx] = {}
        self.where[idx] = "starting"
        self.refresh()

    def update(self, idx: int, stage: str, detail: str, fraction: float | None) -> None:
        if idx in self.finished:
            return
        st = self.state.setdefault(idx, {})
        if fraction is not None:
            st[stage] = max(st.get(stage, 0.0), fraction)
        self.where[idx] = f"{stage} {detail}".strip() if detail != "done" else f"{stage} done"
        self.stage_done |= detail == "done"
        self.refresh()

    def finish(self, idx: int, failed: bool = False) -> None:
        self.finished.add(idx)
        self.failed += failed
        self.state.pop(idx, None)
        self.where.pop(idx, None)
        self.refresh()

    def done_seconds(self) -> float:
        total = sum(sum(self.weights[i].values()) for i in self.finished)
        for i, st in self.state.items():
            w = self.weights.get(i, {})
            total += sum(w.get(stage, 0.0) * f for stage, f in st.items())
        return total

    def postfix(self) -> str:
        running = " | ".join(f"{self.labels[i]}: {w}" for i, w in self.where.items())
        waiting = f"waiting for another run: {', '.join(sorted(self.waiting))}" if self.waiting else ""
        return " | ".join(p for p in (running, waiting, f"failed: {self.failed}" if self.failed else "") if p)

    def refresh(self) -> None:
        # never backwards: a stage's fraction only grows, and finished cells keep their weight
        if not self.eta and (self.finished or self.stage_done):
            self.eta = True            # a first unit has finished: from now on the rate means something
            self.bar.bar_format = self.FORMAT
        self._done = min(max(self._done, self.done_seconds()), self.bar.total)
        self.bar.n = round(self._done, 3)
        self.bar.set_description_str(self._desc(), refresh=False)
        self.bar.set_postfix_str(self.postfix(), refresh=False)
        self.bar.refresh()

    def close(self) -> None:
        self.bar.close()


class Sink(Protocol):
    """What an executor reports to the runner (called in the driver process only). A sink may also have
    `claim(job) -> "run" | "wait" | "skip"` (bench.run.sweep.StoreSink: another run computing the same cell)."""
    def unit(self, job: Job, unit: str, rows: list) -> None: ...
    def done(self, job: Job, wall_s: float) -> None: ...
    def failed(self, job: Job, error: str) -> None: ...


WAIT_POLL_S = 2.0   # how often a run waiting on another run's cells looks again


class JobQueue:
    """The jobs still to start, in order; `next()` is the first one the sink lets this run start now (jobs
    another process is computing stay queued and are asked again later; jobs finished meanwhile by another
    run leave the queue as done)."""

    def __init__(self, jobs: list[Job], sink: Sink, board: "ProgressBoard"):
        self.pending = deque(jobs)
        self.sink, self.board = sink, board
        self.waiting: set[int] = set()

    def __bool__(self) -> bool:
        return bool(self.pending)

    def next(self) -> Job | None:
        claim = getattr(self.sink, "claim", None)
        for _ in range(len(self.pending)):
            job = self.pending.popleft()
            verdict = claim(job) if claim is not None else "run"
            if verdict == "run":
                self.waiting.discard(job.index)
                self.board.waiting = {self.board.labels[i] for i in self.waiting}
                return job
            if verdict == "skip":
                self.waiting.discard(job.index)
                self.board.finish(job.index)
                continue
            self.waiting.add(job.index)
            self.pending.append(job)
        self.board.waiting = {self.board.labels[i] for i in self.waiting}
        return None


def _on_progress(board: "ProgressBoard", sink: Sink, job: Job, stage: str, detail: str, fraction) -> None:
    """A cell's progress report: the bar moves, and a sink that carries checkpoints (`progress(job)`) looks
    whether a block finished."""
    board.update(job.index, stage, detail, fraction)
    hook = getattr(sink, "progress", None)
    if hook is not None:
        hook(job)


def available_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def run_job(job: Job, emit: Callable[[str, list], None], cell_fn: CellFn) -> float:
    """Run one cell here with `cell_fn(cell, todo, emit)`; return its wall time. In-process and in workers."""
    from lrq.measure import measure
    with measure() as m:
        cell_fn(job.cell, set(job.todo), emit)
    return m.wall_s


class LocalExecutor:
    def __init__(self, jobs: int = 1, threads: int | None = None, log_dir: str | os.PathLike | None = None):
        if jobs < 1:
            raise UserError(f"--jobs must be at least 1, got {jobs}.")
        self.jobs = jobs
        # worker processes write their own output (progress bars, warnings) to one file per cell here, so
        # that the terminal shows one readable progress line instead of N interleaved sets of bars
        self.log_dir = log_dir
        # threads per worker: an explicit OMP_NUM_THREADS wins, else the machine's CPUs shared out
        env = os.environ.get("OMP_NUM_THREADS")
        self.threads = threads or (int(env) if env and env.isdigit() else max(1, available_cpus() // jobs))

    def describe(self) -> dict:
        return {"executor": "local", "jobs": self.jobs, "threads_per_job": self.threads if self.jobs > 1 else None}

    def run(self, jobs: list[Job], sink: Sink, cell_fn: CellFn, weights: Weights | None = None) -> None:
        if not jobs:   # everything is stored already: no progress bar at cells 0/0
            return
        if self.jobs == 1 or len(jobs) <= 1:
            self._run_inline(jobs, sink, cell_fn, weights)
        else:
            self._run_processes(jobs, sink, cell_fn, weights)

    # ---- in this process ---------------------------------------------------------------------------
    def _run_inline(self, jobs: list[Job], sink: Sink, cell_fn: CellFn, weights: Weights | None = None) -> None:
        import contextlib

        from lrq import progress
        log_dir = self._log_dir()
        # the cells' own output (the methods' progress bars, lm-eval's, warnings) goes to one file per cell, as a
        # worker's does; the terminal keeps the one bar
        tqdm.write(f"output (progress, warnings) of each cell: {log_dir}/", file=sys.stderr)
        board = ProgressBoard(jobs, weights, file=sys.stderr)
        queue = JobQueue(jobs, sink, board)
        try:
            while queue:
                job = queue.next()
                if job is None:          # every cell left is being computed by another run: wait for it
                    board.refresh()
                    time.sleep(WAIT_POLL_S)
                    continue
                board.start(job.index)
                try:
                    with open(log_dir / _log_name(job), "a", encoding="utf-8") as out, \
                            contextlib.redirect_stdout(out), contextlib.redirect_stderr(out), \
                            progress.reporting(lambda st, d, f, j=job: _on_progress(board, sink, j, st, d, f)):
                        wall = run_job(job, lambda unit, rows, job=job: sink.unit(job, unit, rows), cell_fn)
                except UserError:
                    raise
                except Exception as e:  # a crash in one cell must not lose the others
                    log.error("cell %s failed:\n%s", job.cell.label(), traceback.format_exc())
                    board.finish(job.index, failed=True)
                    sink.failed(job, f"{type(e).__name__}: {e} (cell output: {log_dir / _log_name(job)})")
                    continue
                board.finish(job.index)
                sink.done(job, wall)
        finally:
            board.close()

    # ---- worker processes --------------------------------------------------------------------------
    # Each worker gets its own one-way pipe. A shared multiprocessing.Queue would be simpler, but its
    # writers share one lock: a worker killed (OOM, SIGKILL) while its feeder thread held that lock would
    # leave every other worker blocked on it forever, and the run would hang. With one pipe per worker a
    # death breaks only that worker's pipe, which the driver sees as end-of-file.
    def _run_processes(self, jobs: list[Job], sink: Sink, cell_fn: CellFn, weights: Weights | None = None) -> None:
        log_dir = self._log_dir()
        logs = {j.index: log_dir / _log_name(j) for j in jobs}
        tqdm.write(f"worker output (progress, warnings) of each cell: {log_dir}/", file=sys.stderr)
        _WorkerProcesses(jobs, sink, cell_fn, self.jobs, self.threads, logs, ProgressBoard(jobs, weights)).run()


    def _log_dir(self) -> Path:
        if self.log_dir is not None:
            d = Path(self.log_dir)
        else:
            from bench.common.cache import cache_root
            d = cache_root() / "logs" / time.strftime("%Y%m%d-%H%M%S")
        d.mkdir(parents=True, exist_ok=True)
        return d


class _WorkerProcesses:
    """One run of `LocalExecutor._run_processes`: a spawned worker process per cell, at most `slots` at a time,
    each with its own one-way pipe to the driver; the driver reads the pipes, stores what arrives and notices
    a worker that died."""

    def __init__(self, jobs: list[Job], sink: Sink, cell_fn: CellFn, slots: int, threads: int,
                 logs: dict[int, Path], board: ProgressBoard):
        self.ctx = mp.get_context("spawn")  # a clean interpreter per cell: no inherited threads or torch state
        self.sink, self.cell_fn, self.slots, self.threads, self.logs, self.board = \
            sink, cell_fn, slots, threads, logs, board
        self.running: dict[int, tuple] = {}        # job index -> (process, job, reader)
        self.ended: set[int] = set()               # jobs whose final message arrived
        self.by_index = {j.index: j for j in jobs}
        self.queue = JobQueue(jobs, sink, board)

    def run(self) -> None:
        try:
            while self.queue or self.running:
                self._start_more()
                if not self.running:         # nothing of ours running: waiting on another run's cells
                    self.board.refresh()
                    time.sleep(WAIT_POLL_S)
                    continue
                self._receive()
                self._reap_silent()
                self.board.refresh()   # elapsed time and ETA move even while no message arrives
        except BaseException:
            self._stop()
            raise
        finally:
            for _, _, r in self.running.values():
                r.close()
            self.board.close()

    def _start_more(self) -> None:
        """Start queued cells while a slot is free and the sink lets one start."""
        while self.queue and len(self.running) < self.slots:
            job = self.queue.next()
            if job is None:      # the cells left are being computed by another run: later
                break
            reader, writer = self.ctx.Pipe(duplex=False)
            p = self.ctx.Process(target=_worker, args=(job, writer, self.threads, str(self.logs[job.index]),
                                                       self.cell_fn, os.getpid()),
                                 daemon=True, name=f"lrq-bench cell {job.cell.label()}")
            p.start()
            writer.close()  # the worker holds the only write end: its exit is our end-of-file
            self.running[job.index] = (p, job, reader)
            self.board.start(job.index)

    def _receive(self) -> None:
        """Take the messages that arrive within a second; a pipe that closed ends its worker."""
        readers = {r: idx for idx, (_, _, r) in self.running.items()}
        for r in mp_connection.wait(list(readers), timeout=1.0):
            idx = readers[r]
            try:
                msg = r.recv()
            except (EOFError, OSError):  # closed, or cut mid-message by a killed worker
                self._finish(idx)
                continue
            self._handle(msg)

    def _reap_silent(self) -> None:
        """A worker whose pipe stays open after it ended (a stray child holding the write end)."""
        for idx, (p, _, r) in list(self.running.items()):
            if not p.is_alive() and not r.poll():
                self._finish(idx)

    def _handle(self, msg) -> None:
        kind, idx, payload = msg
        job = self.by_index[idx]
        if kind == "unit":
            self.sink.unit(job, *payload)
            return
        if kind == "progress":
            _on_progress(self.board, self.sink, job, *payload)
            return
        self.ended.add(idx)
        if kind == "done":
            self.board.finish(idx)
            self.sink.done(job, payload)
        elif kind == "user_error":
            raise UserError(payload)
        else:
            self.board.finish(idx, failed=True)
            error, tb = payload
            log.error("cell %s failed:\n%s", job.cell.label(), tb)
            self.sink.failed(job, f"{error} (worker output: {self.logs[idx]})")

    def _finish(self, idx: int) -> None:
        """The worker's pipe is closed: it exited after its final message, or it died."""
        p, job, reader = self.running.pop(idx)
        reader.close()
        p.join(timeout=30)
        if idx not in self.ended:
            self.ended.add(idx)
            self.board.finish(idx, failed=True)
            code = p.exitcode
            why = (f"killed by signal {-code}" if code is not None and code < 0 else f"exit code {code}")
            self.sink.failed(job, f"the worker process died ({why}); out of memory? Units it had "
                                  f"finished are stored; rerun the same command to finish the cell (worker "
                                  f"output: {self.logs[idx]})")

    def _stop(self) -> None:
        """Interrupted or failed: end every running worker, SIGTERM first, then SIGKILL."""
        for p, _, _ in self.running.values():
            p.terminate()
        for p, _, _ in self.running.values():
            p.join(timeout=10)
            if p.is_alive():         # a worker that ignores SIGTERM: SIGKILL
                p.kill()
                p.join(timeout=5)


def _log_name(job: Job) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", f"{job.index:02d}-{job.cell.method_name}-{job.cell.scheme_name}") + ".log"


def end_with_parent(parent_pid: int) -> None:
    """Make this process end when `parent_pid` (the driver) ends, however it ends (SIGKILL included): Linux's
    parent-death signal, checked once against a driver that ended before it was set. Elsewhere a no-op: the
    driver still terminates its workers when it is interrupted or terminated (SIGINT, SIGTERM)."""
    if sys.platform.startswith("linux"):
        import ctypes
        try:
            libc = ctypes.CDLL("libc.so.6", use_errno=True)
            libc.prctl(1, signal.SIGTERM, 0, 0, 0)    # PR_SET_PDEATHSIG = 1
        except OSError:
            return
    if os.getppid() != parent_pid:                   # the driver is already gone
        os._exit(143)


def _worker(job: Job, conn, threads: int, log_path: str | None, cell_fn: CellFn, parent_pid: int | None = None
            ) -> None:
    """Entry point of a worker process: run one cell, send each unit and the outcome to the driver."""
    if parent_pid is not None:
        end_with_parent(parent_pid)
    if log_path:  # this process's stdout and stderr (ours, tqdm's, lm-eval's, C libraries') go to the cell's log
        fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    import torch
    torch.set_num_threads(threads)
    logging.basicConfig(level=os.environ.get("LRQ_BENCH_LOG", "WARNING"), format="%(levelname)s %(message)s")
    from lrq import progress
    try:
        with progress.reporting(lambda st, d, f: conn.send(("progress", job.index, (st, d, f)))):
            wall = run_job(job, lambda unit, rows: conn.send(("unit", job.index, (unit, rows))), cell_fn)
        conn.send(("done", job.index, wall))
    except UserError as e:
        conn.send(("user_error", job.index, str(e)))
    except BaseException as e:  # noqa: BLE001 (reported to the driver, which decides)
        conn.send(("failed", job.index, (f"{type(e).__name__}: {e}", traceback.format_exc())))
    finally:
        conn.close()


# ---- Ray ----------------------------------------------------------------------------------------------

class RayExecutor:
    """Cells as Ray tasks on a cluster (`ray start` on each node, or a local cluster when no address is
    given). Each cell declares its resources: one GPU (and one CPU) when the cluster has GPUs, else
    `cpus_per_cell` CPUs. Units travel to the driver through an inbox actor as they are measured and the
    driver writes them (SQLite on a shared disk is not safe across nodes). A failed attempt is retried up
    to `retries` times without the units already received; then the cell is reported as failed. Every
    node needs the model and the data folder at the same paths (a shared disk) and this package installed.
    """

    LAST_MESSAGE_TIMEOUT_S = 120.0

    def __init__(self, address: str | None = None, retries: int = 2, cpus_per_cell: int = 1,
                 num_cpus: int | None = None):
        if retries < 0 or cpus_per_cell < 1:
            raise UserError("--retries must be >= 0 and --cpus-per-cell >= 1.")
        self.address, self.retries, self.cpus_per_cell, self.num_cpus = address, retries, cpus_per_cell, num_cpus
        self.jobs = None  # set from the cluster's resources at run time
        self.intervals: list[tuple[float, float]] = []  # (start, end) wall-clock times of finished attempts

    def describe(self) -> dict:
        return {"executor": "ray", "address": self.address or "local cluster", "retries": self.retries,
                "cpus_per_cell": self.cpus_per_cell}

    def _init(self):
        try:
            import ray
        except ImportError:
            raise UserError("--executor ray needs Ray: pip install 'lrq-bench[ray]' (or pip install ray).") from None
        started = False
        if not ray.is_initialized():
            kw = {"include_dashboard": False, "log_to_driver": False, "configure_logging": False}
            if self.address:
                kw["address"] = self.address
            else:
                kw["num_cpus"] = self.num_cpus or available_cpus()
            try:
                ray.init(**kw)
            except ConnectionError as e:
                raise UserError(f"cannot reach the Ray cluster at {self.address!r}: {e}. Start it with `ray start "
                                f"--head` (and `ray start --address ...` on the other nodes), or leave out "
                                f"--ray-address for a local cluster.") from None
            started = True
        return ray, started

    @property
    def max_running(self) -> int:
        """The most cells that ran at the same time, from the start and end times the cells reported."""
        iv = self.intervals
        return max((sum(1 for s2, e2 in iv if s2 <= s < e2) for s, _ in iv), default=0)

    def run(self, jobs: list[Job], sink: Sink, cell_fn: CellFn, weights: Weights | None = None) -> None:
        if not jobs:
            return
        ray, started = self._init()
        try:
            res = ray.cluster_resources()
            gpus = int(res.get("GPU", 0))
            opts = {"num_gpus": 1, "num_cpus": 1} if gpus else {"num_cpus": self.cpus_per_cell}
            threads = 1 if gpus else self.cpus_per_cell
            self.jobs = gpus or max(1, int(res.get("CPU", 1)) // self.cpus_per_cell)
            _RayCells(self, ray, jobs, sink, cell_fn, opts, threads, weights).run()
        finally:
            if started:
                ray.shutdown()


class _RayCells:
    """One run of `RayExecutor.run` on a started cluster: cells submitted as Ray tasks, their messages taken from
    the inbox actor, each outcome stored, retried or reported."""

    def __init__(self, ex: RayExecutor, ray, jobs: list[Job], sink: Sink, cell_fn: CellFn, opts: dict, threads: int,
                 weights: Weights | None):
        self.ex, self.ray, self.sink, self.cell_fn, self.threads = ex, ray, sink, cell_fn, threads
        self.inbox = ray.remote(num_cpus=0)(_Inbox).remote()
        self.remote = ray.remote(_ray_cell).options(max_retries=0, **opts)  # retries are ours: counted, reported
        self.by_index = {j.index: j for j in jobs}
        self.received: dict[int, set[str]] = {j.index: set() for j in jobs}
        self.attempts: dict[int, int] = {}
        self.starts: dict[tuple[int, int], float] = {}  # (cell, attempt) running -> its start time
        self.finished: set[tuple[int, int]] = set()    # (cell, attempt) whose last message arrived
        self.refs: dict = {}
        self.board = ProgressBoard(jobs, weights)
        self.queue = JobQueue(jobs, sink, self.board)

    def run(self) -> None:
        try:
            while self.refs or self.queue:
                while (job := self.queue.next()) is not None:
                    self._submit(job)
                if not self.refs:         # the cells left are being computed by another run
                    self.board.refresh()
                    time.sleep(WAIT_POLL_S)
                    continue
                ready, _ = self.ray.wait(list(self.refs), num_returns=1, timeout=0.5)
                self._drain()
                for ref in ready:
                    job = self.refs.pop(ref)
                    self._settle(job, *self._outcome(ref, job))
        finally:
            for ref in self.refs:
                self.ray.cancel(ref, force=True)
            self.board.close()

    def _submit(self, job: Job) -> None:
        self.attempts[job.index] = self.attempts.get(job.index, 0) + 1
        todo = frozenset(job.todo - self.received[job.index])
        ref = self.remote.remote(Job(job.index, job.cell, todo), self.inbox, self.threads, self.attempts[job.index],
                                 self.cell_fn)
        self.refs[ref] = job

    def _drain(self) -> None:
        """Take the inbox's messages: progress, attempts' start and end times, units not stored yet."""
        for kind, idx, payload in self.ray.get(self.inbox.take.remote()):
            if kind == "progress":
                self.board.update(idx, *payload)
            elif kind == "start":
                self.starts[(idx, payload[0])] = payload[1]
                self.board.start(idx)
            elif kind == "end":
                self.finished.add((idx, payload[0]))
                self.ex.intervals.append((self.starts.pop((idx, payload[0]), payload[1]), payload[1]))
            elif kind == "unit" and payload[0] not in self.received[idx]:
                self.received[idx].add(payload[0])
                self.sink.unit(self.by_index[idx], *payload)
        self.board.refresh()

    def _outcome(self, ref, job: Job) -> tuple[str, object]:
        """The finished attempt's (kind, payload), once its last message is here (else it failed)."""
        attempt = (job.index, self.attempts[job.index])
        try:
            kind, payload = self.ray.get(ref)
        except Exception as e:  # the worker or its node died
            kind, payload = "failed", (f"{type(e).__name__}: {e}", traceback.format_exc())
            self.starts.pop(attempt, None)
        else:
            # the cell's messages were sent before it returned: wait until the last one is here
            deadline = time.monotonic() + self.ex.LAST_MESSAGE_TIMEOUT_S
            while attempt not in self.finished and time.monotonic() < deadline:
                time.sleep(0.05)
                self._drain()
            if attempt not in self.finished:
                self.starts.pop(attempt, None)
                kind, payload = "failed", (f"its last results did not reach the driver within "
                                           f"{self.ex.LAST_MESSAGE_TIMEOUT_S:.0f} s", "")
        return kind, payload

    def _settle(self, job: Job, kind: str, payload) -> None:
        """Store a done cell, stop on bad input, retry a failed one while attempts are left, else report it."""
        if kind == "done":
            self.board.finish(job.index)
            self.sink.done(job, payload)
        elif kind == "user_error":
            raise UserError(payload)
        elif self.attempts[job.index] <= self.ex.retries:
            log.warning("cell %s failed (attempt %d of %d), retrying: %s", job.cell.label(),
                        self.attempts[job.index], self.ex.retries + 1, payload[0])
            self._submit(job)
        else:
            self.board.finish(job.index, failed=True)
            log.error("cell %s failed after %d attempts:\n%s", job.cell.label(), self.attempts[job.index],
                      payload[1])
            self.sink.failed(job, f"{payload[0]} (after {self.attempts[job.index]} attempts)")

class _Inbox:
    """A Ray actor holding the messages cells send to the driver until it takes them."""

    def __init__(self):
        self.msgs: list = []

    def put(self, msg) -> None:
        self.msgs.append(msg)

    def take(self) -> list:
        out, self.msgs = self.msgs, []
        return out


def _ray_cell(job: Job, inbox, threads: int, attempt: int, cell_fn: CellFn):
    """A Ray task: run one cell, send each unit to the driver's inbox; returns (kind, payload).

    Messages are sent without waiting on them (`inbox.put.remote`, never `ray.get`): a task blocked in
    `ray.get` lends its CPU back to the scheduler, which starts another cell on it, so a task that waited
    on each message (as `ray.util.queue.Queue.put` does) made the cluster run more cells than it has
    CPUs. The last message, "end", tells the driver that every unit before it has been sent.
    """
    import torch
    torch.set_num_threads(threads)
    from lrq import progress
    inbox.put.remote(("start", job.index, (attempt, time.time())))
    try:
        with progress.reporting(lambda st, d, f: inbox.put.remote(("progress", job.index, (st, d, f)))):
            wall = run_job(job, lambda unit, rows: inbox.put.remote(("unit", job.index, (unit, rows))), cell_fn)
        out = "done", wall
    except UserError as e:
        out = "user_error", str(e)
    except Exception as e:  # noqa: BLE001 (reported to the driver, which retries or reports)
        out = "failed", (f"{type(e).__name__}: {e}", traceback.format_exc())
    inbox.put.remote(("end", job.index, (attempt, time.time())))
    return out
