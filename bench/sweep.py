"""Running many cells: what is missing from the store, which executor runs it, where each unit goes.

`run_cells` takes settled cells (bench.cell), skips those whose every unit is stored, hands the rest to
an executor (bench.executor: in this process, worker processes, or Ray) together with the function that
runs one cell (`bench.cell.execute`), and writes each unit atomically the moment it arrives: a crash in
hour three loses nothing already measured, and a rerun computes only what is missing.
"""

from __future__ import annotations

import shutil
import uuid
from dataclasses import dataclass

from bench.cell import Cell, execute
from bench.executor import Job, LocalExecutor
from bench.store import ResultStore, Row


@dataclass
class CellOutcome:
    cell: Cell
    status: str            # "reused", "done" or "failed"
    error: str = ""
    wall_s: float = 0.0


class StoreSink:
    """Writes each unit to the store the moment it arrives, and collects the outcomes."""

    def __init__(self, store: ResultStore, run_id: str):
        self.store, self.run_id = store, run_id
        self.outcomes: dict[int, CellOutcome] = {}

    def unit(self, job: Job, unit: str, rows: list[Row]) -> None:
        self.store.write_unit(rows, job.cell.keys[unit], self.run_id)

    def done(self, job: Job, wall_s: float) -> None:
        if job.cell.checkpoint_dir:
            shutil.rmtree(job.cell.checkpoint_dir, ignore_errors=True)   # results are safe: drop the resume state
        self.outcomes[job.index] = CellOutcome(job.cell, "done", wall_s=wall_s)

    def failed(self, job: Job, error: str) -> None:
        self.outcomes[job.index] = CellOutcome(job.cell, "failed", error)


def cost_rank(cell: Cell) -> int:
    """A coarse order of cell cost, so that parallel workers start the longest cells first (the sweep's
    wall time is then close to total work / workers instead of ending on one long straggler)."""
    if cell.is_fp:
        return 0
    return cell.method.cost_rank + (1 if cell.uses_calibration else 0)


def run_cells(cells: list[Cell], store: ResultStore, force: bool = False, executor=None) -> list[CellOutcome]:
    """Run every cell not already in the store (on `executor`, default: in this process, one by one);
    a failing cell is reported and the others go on. Returns one outcome per cell, in order."""
    executor = executor or LocalExecutor(jobs=1)
    sink = StoreSink(store, uuid.uuid4().hex[:12])
    jobs = []
    for i, cell in enumerate(cells):
        todo = frozenset(u for u, k in cell.keys.items() if force or not store.has_unit(k))
        if todo:
            jobs.append(Job(i, cell, todo))
        else:
            sink.outcomes[i] = CellOutcome(cell, "reused")
    executor.run(sorted(jobs, key=lambda j: -cost_rank(j.cell)), sink, execute)
    return [sink.outcomes[i] for i in range(len(cells))]
