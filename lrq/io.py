"""Atomic file writes: the one helper every writer of results, checkpoints, exports and caches uses.

A file is written under a temporary name in its own folder, flushed to disk, then renamed over the
target: a reader (or a rerun after a crash, a kill or a full disk) sees the old file or the new one,
never half of one. A failure leaves no temporary file behind and says what to do.
"""

from __future__ import annotations

import os
import re
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Callable

from lrq.errors import UserError


def cache_root() -> Path:
    """Where lrq-bench keeps what it can recompute: $LRQ_BENCH_CACHE (a leading ~ is the home folder, as in a
    shell), else ~/.cache/lrq-bench. Said here, in lrq, so that the kernels' dispatch table (lrq.kernels.dispatch)
    and the harness (bench.common.cache) name one folder."""
    root = os.environ.get("LRQ_BENCH_CACHE")
    return Path(root).expanduser() if root else Path.home() / ".cache" / "lrq-bench"


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


_UMASK = _umask()


# an escape sequence whole (CSI, OSC up to its terminator, a two-character escape), so that no parameter of one
# (a terminal title, a colour) is left behind as text when its control characters go
_ESCAPE = re.compile(r"(?:\x1b\[|\x9b)[0-?]*[ -/]*[@-~]|(?:\x1b\]|\x9d)[^\x07\x1b\x9c]*(?:\x07|\x1b\\|\x9c)?"
                     r"|\x1b[ -/]*[0-~]")
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def plain_text(value) -> str:
    """A stored string (a model path, a method or checkpoint name, a note, a checkpoint's config value) as plain
    text for the terminal, Markdown or HTML: line breaks and tabs become spaces (a newline would start a heading,
    a table row or a list), escape sequences (colours, a screen clear, a terminal title) and every other control
    character (C0, DEL, C1) are removed."""
    text = " ".join(_ESCAPE.sub("", str(value)).splitlines()).replace("\t", " ")
    return _CONTROL.sub("", text)


def default_mode(directory: bool = False) -> int:
    """The permissions a plain open() or mkdir() gives a new file or folder: 0666 or 0777 less the umask."""
    return (0o777 if directory else 0o666) & ~_UMASK


def atomic_write(path: str | os.PathLike, write: Callable[[Path], object], fsync: bool = True) -> Path:
    """Call `write(tmp_path)` to produce the file, then move it to `path` in one rename. The file gets the
    permissions a plain open() would give it (those of the file it replaces, else 0666 less the umask),
    not the temporary file's private 0600."""
    path = Path(path)
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        os.close(fd)
        tmp = Path(name)
        write(tmp)
        try:
            mode = path.stat().st_mode & 0o7777
        except FileNotFoundError:
            mode = default_mode()
        os.chmod(tmp, mode)
        if fsync:
            with open(tmp, "rb") as f:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except Exception as e:
        full = disk_full(path.parent, e)   # judged before the partial file is removed (it holds the space)
        if tmp is not None:
            tmp.unlink(missing_ok=True)
        if full:
            raise UserError(f"disk full: cannot write {path} ({full}). Free some space there (or point the "
                            f"cache, checkpoints or --out elsewhere) and rerun; the previous version, if any, is "
                            f"intact and finished results are kept.") from e
        if isinstance(e, OSError):
            raise UserError(f"cannot write {path}: {e.strerror or e} (is the folder read-only?); the previous "
                            f"version, if any, is intact.") from e
        raise
    except BaseException:
        if tmp is not None:
            tmp.unlink(missing_ok=True)
        raise
    return path


def disk_full(folder: str | os.PathLike, error: BaseException | None = None, margin: int = 1 << 20) -> str | None:
    """Why a failed write was a full disk ("N bytes free on <folder>"), or None. Writers of other libraries
    say it in their own words (torch: 'enforce fail ... unexpected pos', safetensors: an I/O error), so
    besides ENOSPC in the error the free space itself is asked."""
    import errno
    import shutil
    chain, e = [], error
    while e is not None and len(chain) < 8:
        chain.append(e)
        e = e.__cause__ or e.__context__
    if any(getattr(x, "errno", None) in (errno.ENOSPC, errno.EDQUOT) or "No space left" in str(x) for x in chain):
        why = "no space left on the device"
    else:
        why = None
    try:
        free = shutil.disk_usage(folder).free
    except OSError:
        return why
    if why is None and free >= margin:
        return None
    return f"{why or 'almost no space left'}: {free:,} bytes free in {folder}"


@contextmanager
def file_lock(path: str | os.PathLike):
    """An exclusive advisory lock on `<path>.lock` for the code inside (fcntl.flock; where flock does not
    exist, no lock): so that two processes about to compute the same cached file compute it once."""
    try:
        import fcntl
    except ImportError:
        yield
        return
    lock = Path(f"{path}.lock")
    lock.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def json_safe(obj):
    """`obj` with every non-finite float (NaN, inf) as None, tuples as lists, numpy/torch scalars as Python
    numbers: what standard JSON can say. A NaN in a file the suite writes would be invalid JSON to every
    other parser (and SQLite's json functions call it malformed)."""
    import math
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k if isinstance(k, str) else str(k): json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    if obj is None or isinstance(obj, (str, bool, int)):
        return obj
    item = getattr(obj, "item", None)          # numpy / torch scalars
    if callable(item) and getattr(obj, "ndim", 0) == 0:
        return json_safe(item())
    return obj


def dumps_json(obj, **kw) -> str:
    """json.dumps of `json_safe(obj)` that refuses NaN: never a bare NaN in the suite's JSON (null instead)."""
    import json
    return json.dumps(json_safe(obj), allow_nan=False, **kw)


def atomic_write_text(path: str | os.PathLike, text: str, fsync: bool = True) -> Path:
    return atomic_write(path, lambda p: p.write_text(text, encoding="utf-8"), fsync)
