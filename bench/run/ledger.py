"""Results files: the finished units of a store as one small text file meant to be committed.

A long run outlives the machine it started on (a preemptible instance, a shared box taken back, a session
that ends). Its store (`~/.cache/lrq-bench/results.sqlite`) goes with the machine; a results file does not:
`lrq-bench run ... --sync DIR` reads `DIR/results.jsonl` before it decides what to compute (every unit in it
that the store lacks is added, under the same store key, so a finished cell is never computed again) and
rewrites the file after every unit it stores. `lrq-bench results --save DIR` writes the same file from a
store. On another machine, `git pull` and the same `run` command continue where the last one stopped.

The file is JSON Lines, one unit per line after a header line, sorted (by model, method, scheme, unit
key), so a commit's diff shows exactly the units that finished. A unit is what the store writes
atomically (all metrics of one evaluation, or a quantization's statistics): its key, the fields its rows
share (configuration, seed, versions, git revision, hardware, wall time, memory, when and by which run it
was measured) and its rows' own fields (dataset, metric, value). Everything the store holds travels, so
a row imported elsewhere is the row that was measured, with the configuration and hardware that produced
it; nothing is recomputed or re-labelled on the way.

Only whole units are written (the store never holds half of one); a file that cannot be read whole, a
line that is not a unit, or a non-finite value is refused with the line that is wrong, before anything is
imported: a damaged results file must never become a result.
"""

from __future__ import annotations

import hashlib
import json
import lzma
import math
import shutil
import re
from collections.abc import Iterable
from dataclasses import asdict
from pathlib import Path

from bench.common.store import ResultStore, Row
from lrq.blockwise import BlockCheckpoint
from lrq.errors import UserError
from lrq.io import atomic_write, atomic_write_text, dumps_json

FILE = "results.jsonl"
FORMAT = "lrq-bench results"
VERSION = 1
# fields every row of a unit has in common (written once per unit); the others are per row
_SHARED = ("model", "method", "scheme", "config", "seed", "versions", "git_rev", "hardware", "wall_s",
           "peak_mem_bytes", "run_id", "created_at")
_PER_ROW = ("dataset", "metric", "value")
_KEY = re.compile(r"^[0-9a-f]{16,64}$")


def results_file(path: str | Path) -> Path:
    """A folder means its `results.jsonl`; a file path is taken as it is."""
    p = Path(path).expanduser()
    return p / FILE if p.suffix != ".jsonl" else p


def _units(rows: Iterable[Row]) -> dict[str, list[Row]]:
    """unit key -> the rows of its newest measurement (a unit recomputed with --force is stored again under
    the same key by another run: the last run's rows are the unit). `rows` oldest first."""
    runs: dict[str, dict[str, list[Row]]] = {}
    for r in rows:
        runs.setdefault(r.unit_key, {}).setdefault(r.run_id, []).append(r)
    return {k: list(by_run.values())[-1] for k, by_run in runs.items()}


def encode_unit(key: str, rows: list[Row]) -> dict:
    """One unit as a JSON object: the fields its rows share once, the rest per row."""
    dicts = [asdict(r) for r in rows]
    shared = {f: dicts[0][f] for f in _SHARED if all(d[f] == dicts[0][f] for d in dicts)}
    per_row = [{f: d[f] for f in d if f != "unit_key" and f not in shared} for d in dicts]
    return {"unit": key, "shared": shared, "rows": per_row}


def decode_unit(obj, where: str) -> tuple[str, list[Row]]:
    """A unit object back into its key and rows; anything of the wrong shape is a UserError naming `where`."""
    fields = set(Row.__dataclass_fields__)
    if not isinstance(obj, dict) or not isinstance(obj.get("unit"), str) or not isinstance(obj.get("shared"), dict) \
            or not isinstance(obj.get("rows"), list) or not obj["rows"]:
        raise UserError(f"{where}: not a unit (an object with 'unit', 'shared' and a non-empty 'rows' list).")
    key = obj["unit"]
    if not _KEY.match(key):
        raise UserError(f"{where}: {key!r} is not a unit key (hexadecimal, as the store writes them).")
    rows = []
    for i, r in enumerate(obj["rows"]):
        if not isinstance(r, dict):
            raise UserError(f"{where}: row {i} is not an object.")
        d = obj["shared"] | r
        unknown = set(d) - fields
        missing = [f for f in _PER_ROW + ("model", "method", "scheme") if f not in d]
        if unknown or missing:
            raise UserError(f"{where}: row {i} " + (f"has unknown fields {sorted(unknown)}" if unknown else
                                                    f"lacks {', '.join(missing)}") + ".")
        v = d["value"]
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v)):
            raise UserError(f"{where}: row {i} ({d['metric']}) has the value {v!r}, not a finite number: a results "
                            f"file never holds one, so this file was altered or damaged.")
        for f in ("config", "versions", "hardware"):
            if not isinstance(d.get(f, {}), dict):
                raise UserError(f"{where}: row {i}: {f} is not an object.")
        rows.append(Row(**(d | {"unit_key": key})))
    return key, rows


def read(path: str | Path) -> dict[str, list[Row]]:
    """The units of a results file (unit key -> rows). A missing file is an empty one; anything else that is
    not a whole results file is a UserError naming the file and the line."""
    p = results_file(path)
    if not p.exists():
        return {}
    try:
        lines = p.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"cannot read the results file {str(p)!r} ({type(e).__name__}: {e}).") from None
    if not lines:
        raise UserError(f"the results file {str(p)!r} is empty (a whole one starts with a header line): restore it "
                        f"from version control, or delete it to start a new one.")
    try:
        head = json.loads(lines[0])
    except json.JSONDecodeError:
        head = None
    if not isinstance(head, dict) or head.get("format") != FORMAT:
        raise UserError(f"{p}:1: not an lrq-bench results file (its first line must be the header "
                        f'{{"format": "{FORMAT}", ...}}).')
    if head.get("version") != VERSION:
        raise UserError(f"{p}:1: results file version {head.get('version')!r}; this lrq-bench reads version "
                        f"{VERSION}. Upgrade lrq-bench, or write the file anew with `lrq-bench results --save`.")
    units: dict[str, list[Row]] = {}
    for n, line in enumerate(lines[1:], start=2):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise UserError(f"{p}:{n}: not JSON ({e.msg}); a results file holds one unit per line. The file is "
                            f"damaged (a merge conflict?): restore it from version control.") from None
        key, rows = decode_unit(obj, f"{p}:{n}")
        if key in units:
            raise UserError(f"{p}:{n}: unit {key[:12]} appears twice; a results file holds each unit once.")
        units[key] = rows
    for what, n in (("units", len(units)), ("rows", sum(len(r) for r in units.values()))):
        if head.get(what) is not None and head[what] != n:
            raise UserError(f"{p}: the header says {head[what]} {what} and the file holds {n}: it is truncated or "
                            f"was edited. Restore it from version control.")
    return units


def _order(item: tuple[str, list[Row]]) -> tuple:
    key, rows = item
    r = rows[0]
    return (r.model, r.method != "fp", r.method, r.scheme, r.seed or 0, r.dataset, key)


def write(path: str | Path, units: dict[str, list[Row]]) -> Path:
    """Write `units` as a results file, atomically (a crash leaves the old file or the new one, never half)."""
    p = results_file(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    ordered = sorted(units.items(), key=_order)
    lines = [json.dumps({"format": FORMAT, "version": VERSION, "units": len(ordered),
                         "rows": sum(len(r) for _, r in ordered)}, sort_keys=True)]
    lines += [dumps_json(encode_unit(k, rows), sort_keys=True, separators=(",", ":")) for k, rows in ordered]
    atomic_write_text(p, "\n".join(lines) + "\n")
    return p


def save(store: ResultStore, path: str | Path, keys: set[str] | None = None) -> tuple[Path, int]:
    """Add the store's units (those in `keys`, or all) to the results file at `path`, keeping the units it
    already holds. Returns the file and the number of units it now holds."""
    with _locked(path):   # two runs syncing to one folder (two workers' worth of cells) never drop each other's
        units = read(path)
        units.update({k: v for k, v in _units(store.rows(as_stored=True)).items() if keys is None or k in keys})
        return write(path, units), len(units)


LOCK = ".results.jsonl.lock"   # beside the results file, ignored by git (.gitignore)


def _locked(path: str | Path):
    """An exclusive lock on the results file for a read-modify-write. Its lock file lies in the results file's
    own folder, so two writers whose caches differ (two users, two containers on one shared folder) still take
    the same lock and never drop each other's units."""
    from lrq.io import file_lock
    p = results_file(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    return file_lock(p.parent / LOCK[:-len(".lock")])


def load_into(store: ResultStore, path: str | Path, data_dir: str | Path | None = None) -> tuple[int, int]:
    """Add every unit of the results file that the store lacks, under its own key, with the rows exactly as they
    were measured (run id and time included). Every unit is checked first (bench.run.verify, on this machine's
    model and `data_dir`), and a unit the store holds in another version (another run measured it, or the same
    run's values differ) is an error naming both: nothing is imported unless everything can be. Returns (units
    added, units the store had already)."""
    from bench.evaluations.data import resolve_data_dir
    from bench.run.verify import check_unit
    p = results_file(path)
    units = read(p)
    folder = resolve_data_dir(data_dir) if data_dir is not None else _default_data_dir()
    for key, rows in units.items():
        check_unit(key, rows, f"{p}: unit {key[:12]} ({rows[0].method} {rows[0].scheme} {rows[0].dataset})", folder)
    todo = {}
    for key, rows in units.items():
        local = store.unit_rows(key)
        if not local:
            todo[key] = rows
        else:
            _same_version(key, rows, local, p, store)
    for key, rows in todo.items():
        store.write_unit(rows, key, rows[0].run_id or None, keep_time=True)
    return len(todo), len(units) - len(todo)


def _default_data_dir():
    from bench.evaluations.data import resolve_data_dir
    try:
        return resolve_data_dir(None)
    except UserError:
        return None


def _same_version(key: str, rows: list[Row], local: list[Row], path: Path, store: ResultStore) -> None:
    """The results file's unit and the store's are one measurement (the same run, the same values)."""
    runs = {r.run_id for r in local}
    mine = {(r.dataset, r.metric): r.value for r in local if r.run_id == rows[0].run_id}
    theirs = {(r.dataset, r.metric): r.value for r in rows}
    if rows[0].run_id in runs and mine == theirs:
        return
    newest = max(local, key=lambda r: r.created_at)
    raise UserError(f"{path}: unit {key[:12]} ({rows[0].method} {rows[0].scheme} {rows[0].dataset}) is stored in "
                    f"{store.path} as another version: the file's was measured by run {rows[0].run_id} on "
                    f"{rows[0].created_at} (git {rows[0].git_rev[:12]}), the store's by run {newest.run_id} on "
                    f"{newest.created_at} (git {newest.git_rev[:12]}). Which is right is not for the import to "
                    f"choose: remove one (`--results` another store, or restore the file), then rerun. Nothing was "
                    f"imported.")


# ---- carrying a run between machines ----------------------------------------------------------------------
CHECKPOINTS = "checkpoints"
_STATE = BlockCheckpoint.STATE
# The largest file a carried block is written as: the repository keeps files under 2 MB, so a compressed block
# larger than this goes as numbered parts (<block>.xz.000, .001, ...), joined when it is restored.
CARRY_FILE_BYTES = 1_900_000


def _carried_files(folder: Path, name: str) -> list[Path]:
    """The files a carried block is held in: <name>.xz, or its numbered parts in order ([] when absent)."""
    whole = folder / f"{name}.xz"
    return [whole] if whole.exists() else sorted(folder.glob(f"{name}.xz.[0-9][0-9][0-9]"))


def _write_carried(folder: Path, name: str, compressed: bytes) -> None:
    """Write a compressed block as one file, or as parts of at most CARRY_FILE_BYTES, each atomically; the other
    form and any parts left from a longer earlier copy are removed after."""
    pieces = [compressed[i:i + CARRY_FILE_BYTES] for i in range(0, len(compressed), CARRY_FILE_BYTES)] or [b""]
    names = [f"{name}.xz"] if len(pieces) == 1 else [f"{name}.xz.{j:03d}" for j in range(len(pieces))]
    for part, data in zip(names, pieces):
        atomic_write_bytes(folder / part, data)
    for stale in [folder / f"{name}.xz", *folder.glob(f"{name}.xz.[0-9][0-9][0-9]")]:
        if stale.name not in names:
            stale.unlink(missing_ok=True)
_block = BlockCheckpoint._block_name   # the walk's own names for its files


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class Carry:
    """What `run --sync DIR` keeps in DIR so that another machine continues the run: the results file (every
    unit of the run's cells, rewritten after each stored unit) and, for each block-wise cell still running,
    its finished blocks (`checkpoints/<cell>/`: the blocks' quantized states, xz-compressed, about 1.3 MB a
    block at 3 bits, and the walk's state with a SHA-256 per block; never the 600 MB calibration streams,
    which the walk recomputes from the blocks when it resumes). A cell's carried blocks are dropped when the
    cell is done: its results are in the results file then."""

    def __init__(self, folder: str | Path, store: ResultStore):
        self.folder = Path(folder).expanduser()
        self.store = store
        self.file = results_file(self.folder)
        self._keys: set[str] = set()
        self._mirrored: dict[str, int] = {}   # cell checkpoint -> blocks carried so far

    # results
    def import_results(self, data_dir: str | Path | None = None) -> tuple[int, int]:
        return load_into(self.store, self.file, data_dir)

    def track(self, cells) -> None:
        """The cells whose units this run writes to the results file (units already stored included)."""
        self._keys |= {k for c in cells for k in c.keys.values()}

    def unit_stored(self) -> None:
        save(self.store, self.file, self._keys)   # (a key not stored yet has no rows: it is not written)

    # checkpoints
    def _carried(self, cell) -> Path | None:
        if not cell.checkpoint_dir:
            return None
        return self.folder / CHECKPOINTS / Path(cell.checkpoint_dir).name

    @staticmethod
    def _state(folder: Path) -> dict:
        """The walk's state in `folder` ({} when absent or unreadable), its `done` an int."""
        try:
            state = json.loads((folder / _STATE).read_text(encoding="utf-8"))
            return state | {"done": int(state["done"])} if isinstance(state, dict) else {}
        except (OSError, ValueError, KeyError, TypeError):
            return {}

    def restore(self, cell) -> int:
        """Before a cell starts here: where the carried checkpoint holds more finished blocks than the local
        one, unpack it into the local checkpoint folder. Every carried block is checked first (its SHA-256, and the
        cell identity the carried state records), into a folder beside the local one: a damaged or foreign carry is
        refused before anything local is touched. Then the local checkpoint is replaced (its streams, which belong
        to the local block count, go: the walk recomputes them). Returns the blocks restored (0: nothing carried,
        or the local checkpoint is as far)."""
        src = self._carried(cell)
        if src is None:
            return 0
        local = Path(cell.checkpoint_dir)
        state = self._state(src)
        done = state.get("done", 0)
        if done <= self._state(local).get("done", 0):
            return 0
        label = state.pop("label", None) or {}
        if label.get("identity") not in (None, cell.keys.get("quant")):
            raise UserError(f"the carried checkpoint {src} was made by another cell ({label.get('cell')}, identity "
                            f"{str(label.get('identity'))[:12]}) than {cell.label()} ({cell.keys.get('quant', '')[:12]}): "
                            f"it is not restored. Delete the folder to train the cell from its first block.")
        hashes = state.pop("carried", {})
        staging = local.with_name(local.name + ".restoring")
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        try:
            for i in range(done):
                atomic_write_bytes(staging / _block(i), self._verified_block(src, _block(i), hashes))
            atomic_write_text(staging / _STATE, json.dumps(state, allow_nan=False))
            if local.exists():
                shutil.rmtree(local)
            staging.rename(local)   # the checked blocks replace the local checkpoint at once
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        self._mirrored[local.name] = done
        return done

    @staticmethod
    def _verified_block(src: Path, name: str, hashes: dict) -> bytes:
        try:
            data = lzma.decompress(b"".join(p.read_bytes() for p in _carried_files(src, name)))
        except (OSError, lzma.LZMAError) as e:
            raise UserError(f"the carried checkpoint {src} is incomplete ({name}.xz: {type(e).__name__}: {e}): "
                            f"restore the folder from version control, or delete it to train the cell from "
                            f"its first block. The local checkpoint was left as it was.") from None
        if _sha256(data) != hashes.get(name):
            raise UserError(f"the carried checkpoint {src}: {name}.xz does not match the SHA-256 its state "
                            f"records (altered or from another run): restore the folder from version control, "
                            f"or delete it to train the cell from its first block. The local checkpoint was "
                            f"left as it was.")
        return data

    def mirror(self, cell) -> int:
        """Carry the local checkpoint's newly finished blocks (called as the cell reports progress; cheap when
        nothing changed). Blocks are written first and the state last, each atomically, so a commit taken at
        any moment holds a usable checkpoint. Returns the blocks carried."""
        dst = self._carried(cell)
        if dst is None:
            return 0
        local = Path(cell.checkpoint_dir)
        state, old = self._state(local), self._state(dst)
        done = state.get("done", 0)
        if done <= self._mirrored.get(local.name, old.get("done", 0)):
            return 0
        dst.mkdir(parents=True, exist_ok=True)
        same = old.get("identity") == state.get("identity")
        hashes = dict(old.get("carried", {})) if same else {}
        revisions = dict((old.get("label") or {}).get("revisions", {})) if same else {}
        from bench.common.provenance import git_revision
        rev = git_revision()
        for i in range(done):
            name = _block(i)
            data = (local / name).read_bytes()
            digest = _sha256(data)
            if hashes.get(name) == digest and _carried_files(dst, name):
                continue
            _write_carried(dst, name, lzma.compress(data, preset=6))
            hashes[name] = digest
            revisions.setdefault(name, rev)   # the revision whose walk finished the block
        label = {"cell": cell.label(), "precision": cell.precision.used, "preset": cell.preset,
                 "identity": cell.keys.get("quant"), "revisions": revisions}
        atomic_write_text(dst / _STATE, json.dumps(state | {"carried": hashes, "label": label}, allow_nan=False,
                                                   indent=1))
        self._mirrored[local.name] = done
        return done

    def cell_done(self, cell) -> None:
        """The cell's units are stored (and in the results file, written after each of them): drop its carried
        blocks."""
        dst = self._carried(cell)
        if dst is not None and dst.exists():
            shutil.rmtree(dst, ignore_errors=True)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    atomic_write(path, lambda p: Path(p).write_bytes(data))


def finished_blocks(cell, carry: Carry | None = None) -> tuple[int, bool]:
    """What a block-wise cell's next run will not compute again: (finished blocks, whether the calibration streams
    must be recomputed through them). The local checkpoint counts with its streams where they are there; a
    carried folder holding more blocks replaces it (`Carry.restore`), and its streams are recomputed. (0, False)
    for a cell without a checkpoint folder or without finished blocks. The folder is named by the cell's
    identity, so its state is this cell's; `BlockCheckpoint.completed` checks it again when the walk starts."""
    if not getattr(cell, "checkpoint_dir", None):
        return 0, False
    local_dir = Path(cell.checkpoint_dir)
    local = Carry._state(local_dir).get("done", 0)
    carried_dir = carry._carried(cell) if carry is not None else None
    carried = Carry._state(carried_dir).get("done", 0) if carried_dir is not None else 0
    if carried > local:
        return carried, True
    if not local:
        return 0, False
    return local, not (local_dir / BlockCheckpoint._streams_name(local, "q")).is_file()
