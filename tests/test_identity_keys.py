"""Typed method configs (issue R): the same store keys and checkpoint identities as before, settings parsed once."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.run.cell import Request, settle
from lrq.errors import UserError
from lrq.methods import get_method

DATA = Path(__file__).parent / "data"
sys.path.insert(0, str(DATA))
import make_identity_keys as M  # noqa: E402

# f10fffb ignored lr_schedule for LRQ (not one of its settings then): today it is honoured, so that request is
# another cell now, as it must be
IGNORED_BEFORE = {"lr_schedule"}
# settings added since, at a neutral default that is kept out of every key (the resolved settings list them)
ADDED_SINCE = {"lowrank_product": "autocast"}


def test_every_key_and_checkpoint_identity_is_the_one_f10fffb_gave():
    pinned = json.loads((DATA / "identity_keys.json").read_text())["cells"]
    requests = list(M.requests())
    assert len(pinned) == len(requests) == 508
    same = changed = 0
    for old, req in zip(pinned, requests):
        assert old["request"]["method"] == req.method and old["request"]["overrides"] == req.overrides
        cell = settle(req)
        new = M.record(req, cell)
        for k, neutral in ADDED_SINCE.items():
            if k in new.get("resolved", {}) and k not in old.get("resolved", {}):
                assert new["resolved"].pop(k) == neutral
        if req.tasks:   # since issue V the tasks unit hashes every task file: the key f10fffb gave is the legacy one
            assert new["keys"]["tasks"] != old["keys"]["tasks"]
            assert _legacy_tasks_key(req, cell) == old["keys"]["tasks"]
            new["keys"]["tasks"] = old["keys"]["tasks"]
        if IGNORED_BEFORE & set(req.overrides) and req.method == "lrq":
            assert new["keys"]["quant"] != old["keys"]["quant"]
            assert json.loads(new["checkpoint_settings"])["lr_schedule"] == req.overrides["lr_schedule"]
            changed += 1
            continue
        assert new == old, req
        same += 1
    assert same == 480 and changed == 28


def _legacy_tasks_key(req, cell) -> str:
    """The tasks unit's key as results stored before issue V were keyed (WikiText-2's file hash in place of the
    task files'): what `bench.run.verify` accepts for such a stored unit."""
    from bench.common.store import unit_key
    from bench.evaluations.data import resolve_data_dir
    from bench.run.cell import tasks_identity
    return unit_key(tasks_identity(cell.identity, req.tasks, req.task_limit, resolve_data_dir(req.data_dir),
                                   cell.eval.bos, cell.precision.used, legacy=True))[:20]


def _key(**over):
    return settle(Request(model="smollm2-135m", method="lrq", scheme="w3a16", preset="long", overrides=over,
                          device="cpu")).keys["quant"]


def test_one_value_one_cell_and_words_are_exact():
    assert _key(lr="5e-4") == _key(lr="0.0005") == _key(lr=5e-4)
    assert _key(iters="1000") == _key(iters=1000) == _key(iters="1e3") == _key()
    with pytest.raises(UserError, match="did you mean 'official'"):
        _key(rank_rule="Official")
    with pytest.raises(UserError, match=r"rank takes an integer >= 1"):
        _key(rank="0")
    cfg = get_method("lrq").config("long", {"rank_rule": "uniform", "rank": "64", "lr": "6e-4", "compile": "off"})
    assert (cfg.rank_rule, cfg.rank, cfg.lr, cfg.compile) == ("uniform", 64, 6e-4, False)
    assert type(cfg.rank) is int and type(cfg.lr) is float
    with pytest.raises(UserError, match="not a --set value"):
        get_method("lrq").config("long", {"preset": "quick"})


def test_a_bad_word_is_exit_2_before_any_work(tmp_path):
    r = subprocess.run([sys.executable, "-m", "bench.cli", "run", "--methods", "lrq", "--schemes", "w3a16",
                        "--set", "rank_rule=Official", "--results", str(tmp_path / "r.sqlite")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert "rank_rule" in r.stderr and "official" in r.stderr
    assert "Traceback" not in r.stderr and "cells 0/" not in r.stderr   # refused before the run starts


def test_the_worker_receives_the_parsed_config():
    cell = settle(Request(model="smollm2-135m", method="lrq", scheme="w3a16", preset="long",
                          overrides={"rank": "64"}, device="cpu"))
    assert type(cell.config).__name__ == "LRQConfig" and cell.config.rank == 64
    assert cell.resolved.lr == 6e-4 and cell.resolved.s1_init == "search"
    import pickle
    assert pickle.loads(pickle.dumps(cell)).config == cell.config
