"""Atomic file writes: the one helper every writer of results, checkpoints, exports and caches uses.

A file is written under a temporary name in its own folder, flushed to disk, then renamed over the
target: a reader (or a rerun after a crash, a kill or a full disk) sees the old file or the new one,
never half of one. A failure leaves no temporary file behind and says what to do.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Callable

from lrq.errors import UserError


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


_UMASK = _umask()


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
            mode = 0o666 & ~_UMASK
        os.chmod(tmp, mode)
        if fsync:
            with open(tmp, "rb") as f:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        if tmp is not None:
            tmp.unlink(missing_ok=True)
        raise UserError(f"cannot write {path}: {e.strerror or e} (is the disk full or the folder read-only?); "
                        f"the previous version, if any, is intact.") from e
    except BaseException:
        if tmp is not None:
            tmp.unlink(missing_ok=True)
        raise
    return path


def atomic_write_text(path: str | os.PathLike, text: str, fsync: bool = True) -> Path:
    return atomic_write(path, lambda p: p.write_text(text, encoding="utf-8"), fsync)
