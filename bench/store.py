"""Results store: one embedded SQLite file, one row per (model, method, scheme, dataset, metric) value.

Every row carries the full configuration that produced it, the seeds, package versions, git revision,
hardware, wall time and peak memory. Rows are written in units (all metrics of one evaluation) inside
one transaction, so a killed run never leaves half a unit; WAL mode and a busy timeout let several
processes write to one file. A unit is identified by `unit_key`, a hash of everything that determines
its numbers; a unit already stored is reused instead of recomputed.
"""

from __future__ import annotations

import hashlib
import json
import math
import sqlite3
import uuid
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from lrq.errors import UserError

SCHEMA_VERSION = 1

_SCHEMA = """
CREATE TABLE IF NOT EXISTS results (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    unit_key TEXT NOT NULL,
    run_id TEXT NOT NULL,
    model TEXT NOT NULL,
    method TEXT NOT NULL,
    scheme TEXT NOT NULL,
    dataset TEXT NOT NULL,
    metric TEXT NOT NULL,
    value REAL,
    config TEXT NOT NULL,
    seed INTEGER,
    versions TEXT NOT NULL,
    git_rev TEXT NOT NULL,
    hardware TEXT NOT NULL,
    wall_s REAL,
    peak_mem_bytes INTEGER,
    created_at TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS results_unit ON results(unit_key);
CREATE INDEX IF NOT EXISTS results_cell ON results(model, method, scheme, dataset, metric);
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT);
"""


def unit_key(identity: dict) -> str:
    """Stable hash of a JSON-serialisable description of everything that determines a unit's numbers."""
    blob = json.dumps(identity, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(blob.encode()).hexdigest()


@dataclass
class Row:
    model: str
    method: str
    scheme: str
    dataset: str
    metric: str
    value: float | None
    config: dict = field(default_factory=dict)
    seed: int | None = None
    versions: dict = field(default_factory=dict)
    git_rev: str = "unknown"
    hardware: dict = field(default_factory=dict)
    wall_s: float | None = None
    peak_mem_bytes: int | None = None
    unit_key: str = ""
    run_id: str = ""
    created_at: str = ""


_JSON_FIELDS = ("config", "versions", "hardware")
_COLUMNS = [f for f in Row.__dataclass_fields__]


def _reraise(path: Path, e: sqlite3.DatabaseError):
    """A damaged file (sqlite3.DatabaseError itself: malformed image, not a database) or a full disk is the
    user's to fix: a UserError. Anything else (constraints, programming errors) propagates as it is."""
    if type(e) is sqlite3.DatabaseError:
        raise _damaged(path, e) from None
    if isinstance(e, sqlite3.OperationalError) and "full" in str(e):
        raise UserError(f"cannot write to the results store {str(path)!r}: {e}. Free some space (or pass --results "
                        f"on another disk); the units stored so far are intact.") from None
    raise e


def _damaged(path: Path, e: Exception) -> UserError:
    return UserError(f"the results store {str(path)!r} is damaged ({type(e).__name__}: {e}); nothing was read from "
                     f"or written to it. Keep a copy, then recover what is readable with `sqlite3 {path} .recover "
                     f"| sqlite3 recovered.sqlite` and pass --results recovered.sqlite, or start a new store.")


class ResultStore:
    def __init__(self, path: str | Path, check: bool = False):
        self.path = Path(path).expanduser()
        self.unreadable = 0   # rows the last rows() call could not decode
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._conn().close()
        except sqlite3.DatabaseError as e:
            if self.path.is_file() and self.path.stat().st_size:
                raise _damaged(self.path, e) from None
            raise UserError(f"cannot open the results store {str(self.path)!r} ({e}): pass --results with a "
                            f"writable file path.") from None
        except (OSError, sqlite3.Error) as e:
            raise UserError(f"cannot open the results store {str(self.path)!r} ({e}): pass --results with a "
                            f"writable file path.") from None
        if check:
            self.verify()

    def verify(self) -> None:
        """SQLite's quick_check over the whole file: a damaged page is bad input, said before any work."""
        try:
            conn = self._conn()
            try:
                problems = [r[0] for r in conn.execute("PRAGMA quick_check").fetchall()]
            finally:
                conn.close()
        except sqlite3.DatabaseError as e:
            raise _damaged(self.path, e) from None
        if problems != ["ok"]:
            raise _damaged(self.path, RuntimeError("; ".join(problems[:3])))

    def _conn(self) -> sqlite3.Connection:
        conn = sqlite3.connect(self.path, timeout=120, isolation_level=None)
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA busy_timeout=120000")
        conn.executescript(_SCHEMA)
        conn.execute("INSERT OR IGNORE INTO meta VALUES ('schema_version', ?)", (str(SCHEMA_VERSION),))
        return conn

    def has_unit(self, key: str) -> bool:
        try:
            conn = self._conn()
            try:
                return conn.execute("SELECT 1 FROM results WHERE unit_key = ? LIMIT 1", (key,)).fetchone() is not None
            finally:
                conn.close()
        except sqlite3.DatabaseError as e:
            _reraise(self.path, e)

    def write_unit(self, rows: Iterable[Row], key: str, run_id: str | None = None) -> int:
        """Insert all rows of one unit atomically (all or none); returns the number written. A NaN or
        infinite value is refused (SQLite would store it as NULL, which reads as 'not measured')."""
        rows = list(rows)
        bad = [r for r in rows if r.value is not None and not math.isfinite(r.value)]
        if bad:
            raise ValueError("refusing to store non-finite values: "
                             + ", ".join(f"{r.method} {r.scheme} {r.dataset} {r.metric} = {r.value}" for r in bad[:5]))
        now = datetime.now(timezone.utc).isoformat(timespec="seconds")
        run_id = run_id or uuid.uuid4().hex[:12]
        records = []
        for r in rows:
            d = asdict(r)
            d.update(unit_key=key, run_id=run_id, created_at=now)
            for f in _JSON_FIELDS:
                d[f] = json.dumps(d[f], sort_keys=True, default=str)
            records.append(tuple(d[c] for c in _COLUMNS))
        try:
            conn = self._conn()
            try:
                conn.execute("BEGIN IMMEDIATE")
                try:
                    conn.executemany(f"INSERT INTO results ({', '.join(_COLUMNS)}) VALUES "
                                     f"({', '.join('?' * len(_COLUMNS))})", records)
                    conn.execute("COMMIT")
                except BaseException:
                    conn.execute("ROLLBACK")
                    raise
            finally:
                conn.close()
        except sqlite3.DatabaseError as e:
            _reraise(self.path, e)
        return len(records)

    def rows(self, latest: bool = False) -> list[Row]:
        """Every stored row (oldest first); with latest=True only the newest row per cell, seed and metric. Rows
        whose stored JSON cannot be decoded are skipped and counted in `self.unreadable`."""
        try:
            conn = self._conn()
            conn.row_factory = sqlite3.Row
            try:
                sql = f"SELECT {', '.join(_COLUMNS)} FROM results"
                if latest:
                    sql += (" WHERE id IN (SELECT MAX(id) FROM results "
                            "GROUP BY model, method, scheme, dataset, metric, seed)")
                recs = conn.execute(sql + " ORDER BY id").fetchall()
            finally:
                conn.close()
        except sqlite3.DatabaseError as e:
            _reraise(self.path, e)
        out = []
        self.unreadable = 0
        for rec in recs:
            d = dict(rec)
            try:
                for f in _JSON_FIELDS:
                    d[f] = json.loads(d[f])
                out.append(Row(**d))
            except (TypeError, ValueError):
                self.unreadable += 1
        return out
