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


class ResultStore:
    def __init__(self, path: str | Path):
        self.path = Path(path).expanduser()
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._conn().close()
        except (OSError, sqlite3.Error) as e:
            raise UserError(f"cannot open the results store {str(self.path)!r} ({e}): pass --results with a "
                            f"writable file path.") from None

    def _conn(self) -> sqlite3.Connection:
        conn = sqlite3.connect(self.path, timeout=120, isolation_level=None)
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA busy_timeout=120000")
        conn.executescript(_SCHEMA)
        conn.execute("INSERT OR IGNORE INTO meta VALUES ('schema_version', ?)", (str(SCHEMA_VERSION),))
        return conn

    def has_unit(self, key: str) -> bool:
        conn = self._conn()
        try:
            return conn.execute("SELECT 1 FROM results WHERE unit_key = ? LIMIT 1", (key,)).fetchone() is not None
        finally:
            conn.close()

    def write_unit(self, rows: Iterable[Row], key: str, run_id: str | None = None) -> int:
        """Insert all rows of one unit atomically (all or none); returns the number written."""
        rows = list(rows)
        now = datetime.now(timezone.utc).isoformat(timespec="seconds")
        run_id = run_id or uuid.uuid4().hex[:12]
        records = []
        for r in rows:
            d = asdict(r)
            d.update(unit_key=key, run_id=run_id, created_at=now)
            for f in _JSON_FIELDS:
                d[f] = json.dumps(d[f], sort_keys=True, default=str)
            records.append(tuple(d[c] for c in _COLUMNS))
        conn = self._conn()
        try:
            conn.execute("BEGIN IMMEDIATE")
            try:
                conn.executemany(f"INSERT INTO results ({', '.join(_COLUMNS)}) VALUES ({', '.join('?' * len(_COLUMNS))})",
                                 records)
                conn.execute("COMMIT")
            except BaseException:
                conn.execute("ROLLBACK")
                raise
        finally:
            conn.close()
        return len(records)

    def rows(self, latest: bool = False) -> list[Row]:
        """Every stored row (oldest first); with latest=True only the newest row per unit and metric."""
        conn = self._conn()
        conn.row_factory = sqlite3.Row
        try:
            sql = f"SELECT {', '.join(_COLUMNS)} FROM results"
            if latest:
                sql += (" WHERE id IN (SELECT MAX(id) FROM results GROUP BY model, method, scheme, dataset, metric)")
            recs = conn.execute(sql + " ORDER BY id").fetchall()
        finally:
            conn.close()
        out = []
        for rec in recs:
            d = dict(rec)
            for f in _JSON_FIELDS:
                d[f] = json.loads(d[f])
            out.append(Row(**d))
        return out
