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
import logging
import math
import sqlite3
import uuid
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from lrq.errors import UserError
from lrq.io import dumps_json

log = logging.getLogger("lrq_bench")

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

    @property
    def precision(self) -> str:
        """The compute precision of the cell this row belongs to ("bf16" or "fp32")."""
        return config_precision(self.config)


def config_precision(config) -> str:
    """The precision a row's configuration records. Rows stored before the precision became a choice name
    none: those cells were bf16 (their perplexity ran under bf16 autocast)."""
    c = config if isinstance(config, dict) else {}
    used = c["precision"].get("used") if isinstance(c.get("precision"), dict) else None
    ev = c.get("eval") if isinstance(c.get("eval"), dict) else {}
    return str(used or ev.get("autocast") or "bf16")


_JSON_FIELDS = ("config", "versions", "hardware")
_COLUMNS = [f for f in Row.__dataclass_fields__]


def _reraise(path: Path, e: sqlite3.DatabaseError):
    """A damaged file (sqlite3.DatabaseError itself: malformed image, not a database), a full disk or a read-only
    store is the user's to fix: a UserError. Anything else (constraints, programming errors) propagates."""
    err = _diagnose(path, e)
    if err is not None:
        raise err from None
    raise e


def _diagnose(path: Path, e: sqlite3.DatabaseError, opening: bool = False) -> UserError | None:
    """What an SQLite error on the store means for the user: a full disk, a read-only store, a damaged file
    (only when SQLite's own integrity check, run read-only, fails), or None (not the user's to fix)."""
    from lrq.io import disk_full
    msg = str(e).lower()
    full = None
    if "full" in msg or "disk i/o" in msg or "ioerr" in msg:
        # SQLITE_FULL says it outright; an I/O error is a full disk when the disk is (nearly) full
        full = disk_full(path.parent, e) or (f"SQLite: {e}" if "full" in msg else None)
    if full:
        return UserError(f"disk full: cannot write to the results store {str(path)!r} ({full}). Free some space "
                         f"(or pass --results on another disk); the units stored so far are intact.")
    if "readonly" in msg or "read-only" in msg or (opening and not _writable(path)):
        return _read_only(path, e)
    if type(e) is sqlite3.DatabaseError or (opening and path.is_file() and path.stat().st_size and _fails_check(path)):
        return _damaged(path, e)
    if opening:
        return UserError(f"cannot open the results store {str(path)!r} ({e}): pass --results with a writable file "
                         f"path.")
    return None


def _writable(path: Path) -> bool:
    """Whether the store's file and folder can really be written (root ignores permission bits, not a
    read-only mount or an immutable file)."""
    import os
    import tempfile
    folder = path.parent
    try:
        if os.statvfs(folder).f_flag & os.ST_RDONLY:
            return False
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".lrq-bench-write-check-"):
            pass
        if path.exists():
            with open(path, "r+b"):
                pass
    except OSError:
        return False
    return True


def _read_only(path: Path, e: Exception) -> UserError:
    return UserError(f"the results store {str(path)!r} is read-only ({e}): `run` stores every result it measures, "
                     f"so pass --results with a writable file (or copy the store somewhere writable). `results`, "
                     f"`report` and `compare` read a read-only store as it is.")


def _ro_connect(path: Path, immutable: bool = False) -> sqlite3.Connection:
    from urllib.parse import quote
    uri = f"file:{quote(str(path.resolve()))}?mode=ro" + ("&immutable=1" if immutable else "")
    return sqlite3.connect(uri, uri=True, timeout=120, isolation_level=None)


def _fails_check(path: Path) -> bool:
    """SQLite's quick_check on a read-only connection: True when the file is really damaged."""
    for immutable in (False, True):
        try:
            conn = _ro_connect(path, immutable)
            try:
                return [r[0] for r in conn.execute("PRAGMA quick_check").fetchall()] != ["ok"]
            finally:
                conn.close()
        except sqlite3.DatabaseError as e:
            if type(e) is sqlite3.DatabaseError:
                return True
            continue   # could not open read-only this way (a WAL store in a read-only folder): try immutable
    return False


def _damaged(path: Path, e: Exception) -> UserError:
    return UserError(f"the results store {str(path)!r} is damaged ({type(e).__name__}: {e}); nothing was read from "
                     f"or written to it. Keep a copy, then recover what is readable with `sqlite3 {path} .recover "
                     f"| sqlite3 recovered.sqlite` and pass --results recovered.sqlite, or start a new store.")


OPEN_TRIES = 20   # ResultStore._open_once: how often a store that SQLite says is locked is opened again


class ResultStore:
    """The results store. `readonly=True` (what `results`, `report` and `compare` use) opens the file with
    SQLite's read-only mode, falling back to its immutable mode where even the WAL index cannot be created
    (a read-only mount, an immutable file): nothing is written, no journal switch, no schema."""

    def __init__(self, path: str | Path, check: bool = False, readonly: bool = False):
        self.path = Path(path).expanduser()
        self.readonly = readonly
        self.unreadable = 0   # rows the last rows() call could not decode
        self._immutable = False
        try:
            if not readonly:
                self.path.parent.mkdir(parents=True, exist_ok=True)
            self._open_once()
        except sqlite3.DatabaseError as e:
            raise _diagnose(self.path, e, opening=True) from None
        except OSError as e:
            raise UserError(f"cannot open the results store {str(self.path)!r} ({e}): pass --results with a "
                            f"writable file path.") from None
        if check:
            self.verify()
        self.check_schema()

    def check_schema(self) -> None:
        """The store must be one this lrq-bench writes: its schema version and the results table's columns. A
        store of another version (a newer lrq-bench's) or with a renamed or missing column is refused before any
        work: written into, it would lose a computed cell at write time or mix two layouts."""
        try:
            conn = self._conn()
            try:
                tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}
                if "results" not in tables:
                    return   # a new, empty store (read-only on a file that holds no store yet: rows() says so)
                cols = [r[1] for r in conn.execute("PRAGMA table_info(results)")]
                version = (conn.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()
                           if "meta" in tables else None)
            finally:
                conn.close()
        except sqlite3.DatabaseError as e:
            raise _diagnose(self.path, e, opening=True) from None
        if version is not None and version[0] != str(SCHEMA_VERSION):
            raise UserError(f"the results store {str(self.path)!r} has schema version {version[0]}; this lrq-bench "
                            f"reads and writes version {SCHEMA_VERSION}. Use the lrq-bench that wrote it, or pass "
                            f"--results with another store. Nothing was read from or written to it.")
        missing = [c for c in _COLUMNS if c not in cols]
        if missing:
            raise UserError(f"the results store {str(self.path)!r} is not an lrq-bench store of this version: its "
                            f"results table lacks the column(s) {', '.join(missing)}. Pass --results with another "
                            f"store. Nothing was read from or written to it.")

    def verify(self) -> None:
        """SQLite's quick_check over the whole file: a damaged page is bad input, said before any work."""
        try:
            conn = self._conn()
            try:
                problems = [r[0] for r in conn.execute("PRAGMA quick_check").fetchall()]
            finally:
                conn.close()
        except sqlite3.DatabaseError as e:
            raise _diagnose(self.path, e, opening=True) from None
        if problems != ["ok"]:
            raise _damaged(self.path, RuntimeError("; ".join(problems[:3])))

    def _open_once(self) -> None:
        """Open (and, writable, create) the store once. Two runs starting on one new store at the same moment can
        meet SQLite's "database is locked" while one of them switches it to WAL or writes its schema, returned at
        once rather than after the busy timeout (a lost race, not a fault; the suite's two-run test failed once to
        open its store, the message cut): tried again after a short pause, up to OPEN_TRIES times, before it is an
        error."""
        import random
        import time
        for attempt in range(OPEN_TRIES):
            try:
                self._conn().close()
                return
            except sqlite3.OperationalError as e:
                if attempt == OPEN_TRIES - 1 or not any(w in str(e).lower() for w in ("locked", "busy")):
                    raise
                time.sleep(0.05 + random.random() * 0.2 * (attempt + 1))

    def _conn(self) -> sqlite3.Connection:
        if self.readonly:
            return self._ro_conn()
        conn = sqlite3.connect(self.path, timeout=120, isolation_level=None)
        try:
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA busy_timeout=120000")
            conn.executescript(_SCHEMA)
            conn.execute("INSERT OR IGNORE INTO meta VALUES ('schema_version', ?)", (str(SCHEMA_VERSION),))
        except BaseException:
            conn.close()
            raise
        return conn

    def _ro_conn(self) -> sqlite3.Connection:
        if not self.path.is_file():
            raise UserError(f"results store {str(self.path)!r} does not exist: run `lrq-bench run` first or pass "
                            f"--results.")
        if not self._immutable:
            conn = _ro_connect(self.path)
            try:
                conn.execute("SELECT count(*) FROM sqlite_master").fetchone()
                return conn
            except sqlite3.OperationalError as e:
                conn.close()
                if type(e) is not sqlite3.OperationalError or "unable to open" not in str(e) and "readonly" not in str(e):
                    raise
                # a WAL store whose index cannot be created here (read-only folder or mount): immutable mode,
                # which reads the database file alone; a leftover write-ahead log would be invisible to it
                wal = self.path.with_name(self.path.name + "-wal")
                if wal.exists() and wal.stat().st_size:
                    log.warning("the results store %s is on a read-only medium with a non-empty write-ahead log "
                                "%s: rows only in that log are not shown", self.path, wal)
                self._immutable = True
        return _ro_connect(self.path, immutable=True)

    def has_unit(self, key: str) -> bool:
        try:
            conn = self._conn()
            try:
                return conn.execute("SELECT 1 FROM results WHERE unit_key = ? LIMIT 1", (key,)).fetchone() is not None
            finally:
                conn.close()
        except sqlite3.DatabaseError as e:
            _reraise(self.path, e)

    def unit_rows(self, key: str) -> list[Row]:
        """Every stored row of the unit `key` (all its runs, oldest first), as stored: not renamed."""
        try:
            conn = self._conn()
            conn.row_factory = sqlite3.Row
            try:
                recs = conn.execute(f"SELECT {', '.join(_COLUMNS)} FROM results WHERE unit_key = ? ORDER BY id",
                                    (key,)).fetchall()
            finally:
                conn.close()
        except sqlite3.DatabaseError as e:
            _reraise(self.path, e)
        return [r for r in (_decode(dict(rec)) for rec in recs) if r is not None]

    def write_unit(self, rows: Iterable[Row], key: str, run_id: str | None = None, keep_time: bool = False) -> int:
        """Insert all rows of one unit atomically (all or none); returns the number written. A NaN or
        infinite value is refused (SQLite would store it as NULL, which reads as 'not measured'). `keep_time`:
        the rows keep the time they record (a unit measured elsewhere, read from a results file)."""
        rows = list(rows)
        bad = [r for r in rows if r.value is not None and not math.isfinite(r.value)]
        if bad:
            raise ValueError("refusing to store non-finite values: "
                             + ", ".join(f"{r.method} {r.scheme} {r.dataset} {r.metric} = {r.value}" for r in bad[:5]))
        if self.readonly:
            raise _read_only(self.path, RuntimeError("opened for reading"))
        now = datetime.now(timezone.utc).isoformat(timespec="seconds")
        run_id = run_id or uuid.uuid4().hex[:12]
        records = []
        for r in rows:
            d = asdict(r)
            d.update(unit_key=key, run_id=run_id, created_at=(r.created_at if keep_time and r.created_at else now))
            for f in _JSON_FIELDS:
                d[f] = dumps_json(d[f], sort_keys=True, default=str)   # NaN stored as null
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
                    if conn.in_transaction:   # SQLite has already rolled back after some errors (a full disk)
                        try:
                            conn.execute("ROLLBACK")
                        except sqlite3.Error:
                            pass              # the original error is the one to report
                    raise
            finally:
                conn.close()
        except sqlite3.DatabaseError as e:
            _reraise(self.path, e)
        return len(records)

    def rows(self, latest: bool = False, as_stored: bool = False) -> list[Row]:
        """Every stored row (oldest first), named by identity (`distinct_results`); with latest=True only the newest
        row per cell (model, method, scheme, precision), dataset, metric and seed. Rows whose stored JSON cannot be
        decoded are skipped and counted in `self.unreadable`. `as_stored`: the rows exactly as stored, not renamed (what
        a results file or an export carries: its reader names them by identity itself)."""
        try:
            conn = self._conn()
            conn.row_factory = sqlite3.Row
            try:
                sql = f"SELECT id, {', '.join(_COLUMNS)} FROM results"
                recs = conn.execute(sql + " ORDER BY id").fetchall()
            finally:
                conn.close()
        except sqlite3.DatabaseError as e:
            _reraise(self.path, e)
        out = []
        self.unreadable = 0
        for rec in recs:
            d = dict(rec)
            d.pop("id")
            row = _decode(d)
            if row is None:
                self.unreadable += 1
            else:
                out.append(row)
        if as_stored:
            return out
        out = distinct_results(out)
        return newest(out) if latest else out


def _decode(d: dict) -> Row | None:
    """A stored record as a Row (its JSON fields decoded); None when they cannot be."""
    try:
        for f in _JSON_FIELDS:
            d[f] = json.loads(d[f])
        return Row(**d)
    except (TypeError, ValueError):
        return None


def distinct_results(rows: list[Row]) -> list[Row]:
    """Rows named so that no name holds two identities: two checkpoints of one derived name, two settings, models,
    calibrations, code versions or texts of one cell name (bench.common.identity.distinct) never collapse into one
    row of the leaderboard or one key of the gate."""
    from bench.common.identity import distinct
    return distinct(distinct_checkpoint_names(rows))


def row_key(r: Row) -> tuple:
    """What makes two rows the same measurement: cell (with its precision), dataset, metric and seed. Rows read
    through `ResultStore.rows` or `distinct_results` are named by their identity, so one key holds one identity."""
    return (r.model, r.method, r.scheme, r.precision, r.dataset, r.metric, r.seed or 0)


def newest(rows: list[Row]) -> list[Row]:
    """The newest row per `row_key`, in storage order (`rows` oldest first)."""
    last = {row_key(r): i for i, r in enumerate(rows)}
    return [rows[i] for i in sorted(last.values())]


def distinct_checkpoint_names(rows: list[Row]) -> list[Row]:
    """Cells scored from checkpoints quantized elsewhere are named from the checkpoint (`external:<producer>-w4g128`);
    two different checkpoints of one model can derive the same name and scheme, and would collapse into one row of
    the leaderboard and one key of the gate. Where that happens, each is named by its content too (the name plus
    `@` and the first 8 characters of the checkpoint's fingerprint); unique names are left as they are."""
    from dataclasses import replace

    def fingerprint(r: Row) -> str:
        mc = (r.config or {}).get("method_config") if isinstance(r.config, dict) else None
        return str((mc or {}).get("fingerprint") or "") if isinstance(mc, dict) else ""

    seen: dict[tuple, set[str]] = {}
    for r in rows:
        if r.method.startswith("external:"):
            seen.setdefault((r.model, r.method, r.scheme, r.precision), set()).add(fingerprint(r))
    clash = {k for k, fps in seen.items() if len(fps) > 1}
    if not clash:
        return rows
    return [replace(r, method=f"{r.method}@{fingerprint(r).split(':')[-1][:8]}")
            if (r.model, r.method, r.scheme, r.precision) in clash else r for r in rows]
