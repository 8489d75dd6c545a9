"""Progress of the work running in this process, for whoever shows it (lrq-bench's one terminal bar).

The code doing the work says where it is: the harness names the stage of a cell (`stage("quant")`,
`stage("wikitext2")`, ...), the block walk and the training loop say which block and step
(`update("block 12/30", 0.37)`), perplexity which window. A sink set by the harness (`reporting(fn)`)
receives `(stage, detail, fraction of the stage done or None)`; without one, reports cost a function
call. Updates are throttled (at most one per `INTERVAL` seconds, besides the start and end of a stage), so
the training loop can report every step.
"""

from __future__ import annotations

import contextlib
import time
from contextvars import ContextVar
from typing import Callable

Sink = Callable[[str, str, "float | None"], None]
INTERVAL = 0.5

_sink: ContextVar[Sink | None] = ContextVar("lrq_progress_sink", default=None)
_stage: ContextVar[str] = ContextVar("lrq_progress_stage", default="")
_last = [0.0]


@contextlib.contextmanager
def reporting(sink: Sink | None):
    """Send the progress of the code inside to `sink(stage, detail, fraction)`."""
    token = _sink.set(sink)
    try:
        yield
    finally:
        _sink.reset(token)


@contextlib.contextmanager
def stage(name: str, detail: str = ""):
    """The code inside is stage `name` (reported at its start, and as done when it ends normally: a stage
    stopped by an error, Ctrl-C or SIGTERM is not shown as done; its caller reports why it stopped)."""
    token = _stage.set(name)
    _send(name, detail, 0.0)
    try:
        yield
        _send(name, "done", 1.0)
    finally:
        _stage.reset(token)


def update(detail: str, fraction: float | None = None, force: bool = False) -> None:
    """Where the current stage is: `detail` ("block 12/30") and the fraction of it done (None: unknown)."""
    sink = _sink.get()
    if sink is None:
        return
    now = time.monotonic()
    if not force and now - _last[0] < INTERVAL:
        return
    _last[0] = now
    sink(_stage.get(), detail, None if fraction is None else min(max(float(fraction), 0.0), 1.0))


def _send(name: str, detail: str, fraction: float) -> None:
    sink = _sink.get()
    if sink is not None:
        _last[0] = time.monotonic()
        sink(name, detail, fraction)
