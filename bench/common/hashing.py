"""Content hashes of files, streamed, computed once per file version.

A file's SHA-256 is cached under its path, size, modification and status-change times (ns) and inode, in
this process and in `<lrq-bench cache>/file-hashes.json`, so an unchanged 14 GB model folder is hashed once,
not on every run, while a file rewritten in place (same name and size, new contents, even with its mtime
set back) gets a new status-change time and is hashed again. Writers of the cache file replace it atomically; two processes racing lose at most an entry.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from lrq.errors import UserError
from lrq.io import atomic_write_text

CHUNK = 16 << 20
_MEMO: dict[str, str] = {}


def _cache_file() -> Path:
    from bench.common.cache import cache_root
    return cache_root() / "file-hashes.json"


def _key(path: Path) -> str:
    """A file version: path, size, modification time, inode and status-change time. The last is set by the
    kernel on every write and cannot be set back by a user (`touch -d` restores mtime, not ctime), so a file
    rewritten in place with its size and mtime restored is still hashed again."""
    st = path.stat()
    return f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}|{st.st_ino}|{st.st_ctime_ns}"


def _load() -> dict[str, str]:
    try:
        data = json.loads(_cache_file().read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _store(key: str, digest: str) -> None:
    path = _cache_file()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        data = _load()
        data[key] = digest
        if len(data) > 20_000:   # forget the oldest entries of a long-lived cache
            data = dict(list(data.items())[-10_000:])
        atomic_write_text(path, json.dumps(data), fsync=False)
    except (OSError, UserError):
        pass   # a read-only or full cache only costs re-hashing


def file_sha256(path: str | os.PathLike) -> str:
    """Hex SHA-256 of the file's contents (streamed; cached per file version)."""
    p = Path(path)
    key = _key(p)
    if key in _MEMO:
        return _MEMO[key]
    digest = _load().get(key)
    if digest is None:
        h = hashlib.sha256()
        with open(p, "rb") as f:
            while chunk := f.read(CHUNK):
                h.update(chunk)
        digest = h.hexdigest()
        _store(key, digest)
    _MEMO[key] = digest
    return digest


def folder_sha256(folder: str | os.PathLike, files: list[Path]) -> str:
    """One hash over the names and contents of `files` (relative to `folder`)."""
    h = hashlib.sha256()
    for p in sorted(files):
        h.update(f"{p.relative_to(folder).as_posix()}\0{file_sha256(p)}\n".encode())
    return h.hexdigest()
