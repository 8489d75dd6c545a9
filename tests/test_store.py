"""Results store: reuse, atomic units, concurrent writers, a writer killed mid-transaction."""

import multiprocessing as mp
import signal
import sqlite3
import subprocess
import sys
import textwrap

import pytest

from bench.common.store import ResultStore, Row, unit_key


def _rows(n=3, method="rtn", value=1.0):
    return [Row(model="m", method=method, scheme="w4a16", dataset="wikitext2", metric=f"k{i}", value=value + i,
                config={"a": i}, seed=0) for i in range(n)]


def test_write_and_read_back(tmp_path):
    store = ResultStore(tmp_path / "r.sqlite")
    key = unit_key({"x": 1})
    assert not store.has_unit(key)
    assert store.write_unit(_rows(), key) == 3
    assert store.has_unit(key)
    got = store.rows()
    assert [r.metric for r in got] == ["k0", "k1", "k2"] and got[1].value == 2.0 and got[1].config == {"a": 1}
    assert all(r.unit_key == key and r.created_at for r in got)


def test_unit_key_is_order_independent():
    assert unit_key({"a": 1, "b": [1, 2]}) == unit_key({"b": [1, 2], "a": 1})
    assert unit_key({"a": 1}) != unit_key({"a": 2})


def test_latest_keeps_newest_per_metric(tmp_path):
    store = ResultStore(tmp_path / "r.sqlite")
    store.write_unit(_rows(value=1.0), "k1")
    store.write_unit(_rows(value=5.0), "k2")
    assert len(store.rows()) == 6
    assert sorted(r.value for r in store.rows(latest=True)) == [5.0, 6.0, 7.0]


def test_failed_unit_leaves_no_rows(tmp_path):
    store = ResultStore(tmp_path / "r.sqlite")
    bad = _rows() + [Row(model=None, method="rtn", scheme="w4a16", dataset="d", metric="m", value=1.0)]
    with pytest.raises(sqlite3.IntegrityError):
        store.write_unit(bad, "k")
    assert store.rows() == [] and not store.has_unit("k")


def _writer(path, worker, units):
    store = ResultStore(path)
    for u in range(units):
        store.write_unit(_rows(method=f"w{worker}"), f"{worker}-{u}")


def test_concurrent_writers(tmp_path):
    path = tmp_path / "r.sqlite"
    ResultStore(path)
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_writer, args=(path, w, 25)) for w in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    rows = ResultStore(path).rows()
    assert len(rows) == 4 * 25 * 3
    assert len({r.unit_key for r in rows}) == 100


def test_process_killed_mid_transaction_leaves_no_rows(tmp_path):
    path = tmp_path / "r.sqlite"
    store = ResultStore(path)
    store.write_unit(_rows(), "before")
    script = textwrap.dedent(f"""
        import os, signal, sqlite3
        conn = sqlite3.connect({str(path)!r}, isolation_level=None)
        conn.execute("BEGIN IMMEDIATE")
        conn.execute("INSERT INTO results (unit_key, run_id, model, method, scheme, dataset, metric, value, config,"
                     " versions, git_rev, hardware, created_at) VALUES ('half','r','m','x','s','d','k',1,'{{}}','{{}}','g','{{}}','t')")
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    proc = subprocess.run([sys.executable, "-c", script])
    assert proc.returncode == -signal.SIGKILL
    rows = ResultStore(path).rows()
    assert len(rows) == 3 and not ResultStore(path).has_unit("half")


def test_a_store_locked_at_opening_is_opened_again(tmp_path, monkeypatch):
    """Two runs opening one new store at once can meet "database is locked" from SQLite at once (its WAL switch):
    the opening is tried again and succeeds; a store that stays locked is still an error naming it."""
    import bench.common.store as S
    from lrq.errors import UserError
    monkeypatch.setattr(S, "OPEN_TRIES", 4)
    real, calls = ResultStore._conn, []

    def flaky(self):
        calls.append(1)
        if len(calls) <= 2:
            raise sqlite3.OperationalError("database is locked")
        return real(self)
    monkeypatch.setattr(ResultStore, "_conn", flaky)
    store = ResultStore(tmp_path / "r.sqlite")
    assert len(calls) >= 3 and store.rows() == []
    monkeypatch.setattr(ResultStore, "_conn", lambda self: (_ for _ in ()).throw(sqlite3.OperationalError("database is locked")))
    with pytest.raises(UserError, match="cannot open the results store .*database is locked"):
        ResultStore(tmp_path / "s.sqlite")


def test_unwritable_store_is_a_user_error(tmp_path):
    from lrq.errors import UserError
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(UserError, match="cannot open the results store"):
        ResultStore(blocker / "sub" / "r.sqlite")
