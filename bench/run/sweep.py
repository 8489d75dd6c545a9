"""Running many cells: what is missing from the store, which executor runs it, where each unit goes.

`run_cells` takes settled cells (bench.run.cell), skips those whose every unit is stored, hands the rest to
an executor (bench.run.executor: in this process, worker processes, or Ray) together with the function that
runs one cell (`bench.run.cell.execute`), and writes each unit atomically the moment it arrives: a crash in
hour three loses nothing already measured, and a rerun computes only what is missing.

Several runs may share one store (two terminals, two users). Before a cell starts, the run claims it with
an advisory lock beside the store (`<store>.locks/`, one file per cell, held by the driver process until
the cell ends; the operating system releases it if that process dies): a cell another run is computing is
not computed twice; this run does its other cells meanwhile, then reuses what the other stored, or
computes what is still missing.
"""

from __future__ import annotations

import logging
import os
import shutil
import uuid
from dataclasses import dataclass, replace
from pathlib import Path

from bench.run.cell import Cell, execute
from bench.run.executor import Job, LocalExecutor
from bench.common.store import ResultStore, Row

log = logging.getLogger("lrq_bench")


@dataclass
class CellOutcome:
    cell: Cell
    status: str            # "reused", "done" or "failed"
    error: str = ""
    wall_s: float = 0.0


class CellLock:
    """An advisory lock on one cell of one store (fcntl.flock on `<store>.locks/<cell key>.lock`), taken without
    waiting. Where flock does not exist, every claim succeeds (no sharing protection, nothing breaks)."""

    def __init__(self, store_path: Path, key: str):
        self.path = Path(f"{store_path}.locks") / f"{key[:32]}.lock"
        self.fd: int | None = None

    def acquire(self) -> bool:
        try:
            import fcntl
        except ImportError:
            return True
        self.path.parent.mkdir(parents=True, exist_ok=True)
        for _ in range(5):
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o666)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                return False
            if _same_file(fd, self.path):
                break
            os.close(fd)   # the file was removed by its releasing holder between our open and our lock: again
        else:
            return False
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())   # who holds it, for a curious user
        self.fd = fd
        return True

    def release(self) -> None:
        """Remove the lock file, then release the lock (a waiting process that opened the removed file sees it
        is gone and opens the path again): no lock file outlives its cell."""
        if self.fd is not None:
            try:
                if _same_file(self.fd, self.path):
                    self.path.unlink()
            except OSError:
                pass
            os.close(self.fd)   # closing the descriptor releases the lock
            self.fd = None


def _same_file(fd: int, path: Path) -> bool:
    try:
        a, b = os.fstat(fd), os.stat(path)
    except OSError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def remove_stale_locks(store_path: Path) -> int:
    """Lock files whose holder is gone (a run killed with SIGKILL, a machine that crashed: the lock itself died
    with the process, the file did not): removed, each under its own lock so a live holder is never touched.
    Returns the number removed."""
    try:
        import fcntl
    except ImportError:
        return 0
    folder = Path(f"{store_path}.locks")
    removed = 0
    if not folder.is_dir():
        return 0
    for p in folder.glob("*.lock"):
        try:
            fd = os.open(p, os.O_RDWR)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            if _same_file(fd, p):
                p.unlink()
                removed += 1
        except (BlockingIOError, OSError):
            pass   # held by a live run
        finally:
            os.close(fd)
    return removed


class StoreSink:
    """Writes each unit to the store the moment it arrives, collects the outcomes, and claims each cell
    before it starts (`claim`: "run", "wait" while another run holds it, "skip" when nothing is missing any
    more)."""

    def __init__(self, store: ResultStore, run_id: str, force: bool = False, carry=None, estimate=None,
                 workers: int = 1):
        self.store, self.run_id, self.force, self.workers = store, run_id, force, workers
        self.carry = carry   # bench.run.ledger.Carry (run --sync): results file and carried checkpoints
        self.estimate = estimate   # bench.run.plan.RunEstimate: each unit stores its stage's price beside it
        self.outcomes: dict[int, CellOutcome] = {}
        self.locks: dict[int, CellLock] = {}

    def claim(self, job: Job) -> str:
        lock = CellLock(self.store.path, job.cell.keys.get("quant") or next(iter(job.cell.keys.values())))
        if not lock.acquire():
            return "wait"
        if not self.force:   # another run may have stored some units since this run looked
            todo = frozenset(u for u in job.todo if not self.store.has_unit(job.cell.keys[u]))
            if not todo:
                lock.release()
                self.outcomes[job.index] = CellOutcome(job.cell, "reused")
                return "skip"
            job.todo = todo
        self.locks[job.index] = lock
        if self.carry is not None and "quant" in job.todo:
            n = self.carry.restore(job.cell)
            if n:
                log.warning("%s: %d finished block(s) restored from %s; the calibration streams are recomputed "
                            "from them", job.cell.label(), n, self.carry.folder)
        return "run"

    def _release(self, job: Job) -> None:
        lock = self.locks.pop(job.index, None)
        if lock is not None:
            lock.release()

    def unit(self, job: Job, unit: str, rows: list[Row]) -> None:
        planned = planned_rows(self.estimate, job, unit, rows, self.workers)
        self.store.write_unit(rows + planned, job.cell.keys[unit], self.run_id)
        if self.carry is not None:
            self.carry.unit_stored()

    def progress(self, job: Job) -> None:
        """The cell reported progress (a block may have finished): carry its new blocks."""
        if self.carry is not None:
            self.carry.mirror(job.cell)

    def done(self, job: Job, wall_s: float) -> None:
        if self.carry is not None:
            self.carry.cell_done(job.cell)
        if job.cell.checkpoint_dir:
            shutil.rmtree(job.cell.checkpoint_dir, ignore_errors=True)   # results are safe: drop the resume state
        self.outcomes[job.index] = CellOutcome(job.cell, "done", wall_s=wall_s)
        self._release(job)

    def failed(self, job: Job, error: str) -> None:
        self.outcomes[job.index] = CellOutcome(job.cell, "failed", error)
        self._release(job)

    def release_all(self) -> None:
        for i in list(self.locks):
            self.locks.pop(i).release()


def cost_rank(cell: Cell) -> int:
    """A coarse order of cell cost, so that parallel workers start the longest cells first (the sweep's
    wall time is then close to total work / workers instead of ending on one long straggler)."""
    if cell.is_fp:
        return 0
    return cell.method.cost_rank + (1 if cell.uses_calibration else 0)


#: the metric of the planner's price of a unit's stage, stored in the unit beside what was measured (its rows'
#: wall_s), so that every result says how far the estimate the run announced was from the time it took
PLANNED = "planned_time_s"


def unit_stage(unit: str) -> str:
    """The planner's stage a unit is computed in (bench.run.plan.stage_work): a text's perplexity and its KL
    divergence from FP are one pass (stage <text>); the quantization and the tasks are their own stages."""
    return unit.split(":", 1)[0]


def planned_rows(estimate, job: Job, unit: str, rows: list[Row], workers: int = 1) -> list[Row]:
    """The row that stores the price of `unit`'s stage (`PLANNED`) with it, or none: where the run had no
    estimate or the unit no rows, and for a text's KL unit when the text's perplexity unit carries the price (a
    stage is priced once)."""
    stage = unit_stage(unit)
    seconds = (estimate.stages.get(job.index) or {}).get(stage) if estimate is not None else None
    if seconds is None or not rows or (unit != stage and stage in job.todo):
        return []
    from bench.common.provenance import cpu_label
    hw = (estimate.profile or {}).get("hardware") or {}
    plan = {"stage": stage, "machine": hw.get("gpu") or (cpu_label(hw) if hw else None),
            "threads": (estimate.profile or {}).get("threads"), "workers": workers}
    host = estimate.host_bytes.get(job.index)
    if stage == "quant" and host is not None:   # the memory estimate is of the quantization's peak
        plan["host_bytes"] = int(host)
    if stage == "quant" and estimate.done_blocks.get(job.index):   # priced as resumed: the blocks left only
        plan["done_blocks"] = int(estimate.done_blocks[job.index])
    r = rows[0]
    return [replace(r, dataset="tasks" if stage == "tasks" else r.dataset, metric=PLANNED, value=float(seconds),
                    config=dict(r.config or {}) | {"planned": plan}, wall_s=None, peak_mem_bytes=None)]


def missing_units(cells: list[Cell], store: ResultStore, force: bool = False) -> dict[int, frozenset[str]]:
    """Per cell index, the units not yet in the store (every unit with `force`)."""
    return {i: frozenset(u for u, k in cell.keys.items() if force or not store.has_unit(k))
            for i, cell in enumerate(cells)}


def run_cells(cells: list[Cell], store: ResultStore, force: bool = False, executor=None,
              estimate=None, carry=None) -> list[CellOutcome]:
    """Run every cell not already in the store (on `executor`, default: in this process, one by one);
    a failing cell is reported and the others go on. Returns one outcome per cell, in order.
    `estimate` (bench.run.plan.RunEstimate, by cell index): weighs the progress bar's stages. `carry`
    (bench.run.ledger.Carry): also keep the run's results file and carried checkpoints up to date."""
    executor = executor or LocalExecutor(jobs=1)
    remove_stale_locks(store.path)
    sink = StoreSink(store, uuid.uuid4().hex[:12], force, carry, estimate, workers=getattr(executor, "jobs", 1))
    if carry is not None:
        carry.track(cells)
        carry.unit_stored()   # units stored before (or imported) are in the file from the start
    jobs = []
    for i, todo in missing_units(cells, store, force).items():
        if todo:
            jobs.append(Job(i, cells[i], todo))
        else:
            sink.outcomes[i] = CellOutcome(cells[i], "reused")
    weights = estimate.stages if estimate is not None else None
    try:
        executor.run(sorted(jobs, key=lambda j: -cost_rank(j.cell)), sink, execute, weights)
    finally:
        sink.release_all()
    return [sink.outcomes[i] for i in range(len(cells))]
