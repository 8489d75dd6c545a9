"""The fast s1 clipping search returns exactly the exhaustive search's scales and zero points.

`search_qparams_exhaustive` scores all grid x 2^b candidates of every row or group (the definition, equal
to the authors'); `search_qparams` scores only those its lower bounds cannot rule out. Equality here is
bitwise (torch.equal), on random shapes chosen to hit the edge cases and on real default-model weights.
"""

import math

import pytest
import torch

from lrq.quant import _row_lists, _score_bounds, _score_candidates, _search_error, _search_groups, \
    _sorted_groups, search_qparams, search_qparams_exhaustive, SCALE_EPS


def _same(w, bits, group, grid=100, norm=2.4):
    s0, z0 = search_qparams_exhaustive(w, bits, group, grid, norm)
    s1, z1 = search_qparams(w, bits, group, grid, norm)
    assert s0.shape == s1.shape and z0.shape == z1.shape
    bad = ((s0 != s1) | (z0 != z1)).nonzero().tolist()
    assert not bad, f"{len(bad)} of {s0.numel()} rows/groups differ, first {bad[:3]}"
    return s1, z1


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("group", [None, 16, 24])   # 24: a ragged last group (40 = 24 + 16)
def test_random_weights(bits, group):
    torch.manual_seed(bits * 100 + (group or 0))
    w = torch.randn(12, 40) * torch.logspace(-3, 0.5, 12)[:, None]
    w[1, 5] = 8.0          # an outlier worth clipping
    w[2] = w[2].abs()      # one-signed rows: lo or hi is clamped to 0
    w[3] = -w[3].abs()
    w[4, :20] = 0.0        # half a row of zeros
    _same(w, bits, group, grid=40)


def test_long_rows():   # rows past 256 columns bound their clamped tails apart
    torch.manual_seed(7)
    w = torch.randn(6, 700) * 0.02
    w[0, :3] = torch.tensor([0.4, -0.3, 0.25])
    w[1] = torch.rand(700) * 0.1
    for bits in (3, 4):
        _same(w, bits, None, grid=50)


def test_long_rows_of_other_shapes():   # heavy tails, weights on the grid, a wide flat band: split bounds and
    g = torch.Generator().manual_seed(3)   # the coarse widths' pruning of the widths between them
    w = torch.empty(8, 520)
    w[0] = torch.distributions.StudentT(2.0).sample((520,)) * 0.01
    w[1] = torch.randint(-3, 4, (520,), generator=g) * 0.125          # exactly on a 3-bit grid
    w[2] = torch.rand(520, generator=g) * 2 - 1                        # uniform: many near-ties in width
    w[3] = torch.randn(520, generator=g) * 1e-4
    w[3, 7] = 0.5
    w[4] = torch.randn(520, generator=g).sign() * (1 + torch.rand(520, generator=g) * 1e-3)   # two clusters
    w[5] = torch.linspace(-2, 3, 520)
    w[6] = torch.randn(520, generator=g) * 0.05
    w[7] = torch.randn(520, generator=g).exp() * 0.01                  # one-signed, skewed
    for bits in (2, 3, 4):
        _same(w, bits, None)
    _same(w, 3, 260)


def test_scoring_in_blocks_equals_the_definition():
    """`_score_candidates` (in place, in cache-sized blocks) gives `_search_error`'s float32 scores bitwise,
    with and without padding, for any block size, a lone last candidate included. Groups are laid out in a
    multiple of 32 columns, so that every |e|^p goes through torch's vector routine whatever the layout."""
    torch.manual_seed(4)
    w = torch.randn(10, 70) * torch.rand(10, 1)
    for group in (None, 32, 35):               # 70 columns padded to 96; 32 + 32 + 6; 35 + 35: no ragged group
        flat, valid, lo, hi, _ = _search_groups(w, group)
        assert flat.shape[1] % 32 == 0 and valid.sum() == w.numel()
        K = 37
        rows = torch.randint(0, len(flat), (K,))
        delta = ((hi - lo)[rows] * torch.rand(K) / 7).clamp(min=SCALE_EPS)
        zp = torch.randint(0, 8, (K,)).float()
        ref = _search_error(flat[rows][:, None, :], valid[rows][:, None, :], delta[:, None, None], zp[:, None, None],
                            7, 2.4)[:, 0]
        pad = None if bool(valid.all()) else valid
        for block in (1, 70 * 3, 2**16):
            assert torch.equal(_score_candidates(flat, pad, rows, delta, zp, 7, 2.4, block_elems=block), ref)


def test_squared_errors_move_slowly_with_the_step():
    """The pruning of widths between the coarse ones: for the best levels k at step d', the squared error at
    step d obeys sqrt(S(d)) <= sqrt(S(d')) + |d - d'| ||k||, with ||k|| <= (||x|| + sqrt(S(d'))) / d'."""
    torch.manual_seed(5)
    w = torch.randn(16, 300) * torch.rand(16, 1)
    w[0, 0] = 4.0
    qmax, grid = 7, 100
    flat, valid, lo, hi, _ = _search_groups(w, None)
    delta = torch.stack([((hi - lo) * i / grid / qmax).clamp(min=SCALE_EPS) for i in range(1, grid + 1)], 1)
    sq = _score_bounds(_sorted_groups(flat, valid), delta, qmax, 2.4, False, squares=True)   # [N, G, Z]
    x = flat.double()
    zps = torch.arange(qmax + 1, dtype=torch.float64)
    for i in (10, 40, 70):                     # d' = delta[:, i]; the levels k it rounds to, exactly
        d1 = delta[:, i].double()[:, None, None]
        k = (torch.round(x[:, None, :] / d1) + zps[None, :, None]).clamp(0, qmax) - zps[None, :, None]
        s1 = ((k * d1 - x[:, None, :]) ** 2).sum(-1)                                        # [N, Z]
        assert torch.allclose(s1, sq[:, i], rtol=1e-6, atol=1e-12)
        kn = k.norm(dim=-1)
        assert (kn <= (x.norm(dim=-1)[:, None] + s1.sqrt()) / d1[:, :, 0] * (1 + 1e-9)).all()
        for j in (i - 4, i - 1, i + 1, i + 4):
            dj = delta[:, j].double()[:, None]
            assert (sq[:, j].sqrt() <= s1.sqrt() + (dj - d1[:, :, 0]).abs() * kn + 1e-9).all()


def test_row_lists():
    m = torch.tensor([[0, 1, 0, 1], [0, 0, 0, 0], [1, 1, 1, 0]], dtype=torch.bool)
    assert _row_lists(m).tolist() == [[1, 3, 1], [0, 0, 0], [0, 1, 2]]
    assert _row_lists(torch.zeros(2, 3, dtype=torch.bool)) is None


def test_degenerate_rows_and_ties():
    w = torch.zeros(6, 32)
    w[1] = 0.5                                  # constant row
    w[2, 0] = -1e-3                             # one non-zero weight
    w[3] = torch.tensor([-1.0, 1.0] * 16)       # many candidates score the same
    w[4] = torch.linspace(-1, 1, 32)            # weights exactly on rounding boundaries
    w[5] = torch.arange(32) % 4 - 1.5
    for bits in (2, 3, 4):
        for group in (None, 8):
            _same(w, bits, group, grid=30)


def test_other_norms_and_grids():
    torch.manual_seed(0)
    w = torch.randn(8, 64) * 0.05
    for norm in (2.0, 3.0, 1.5):                # 1.5 has no power-mean bound: the exhaustive path
        _same(w, 3, None, grid=20, norm=norm)
    _same(w, 4, 32, grid=7)


def test_the_bound_is_below_every_score():
    torch.manual_seed(1)
    w = torch.randn(10, 48) * torch.rand(10, 1)
    w[0, 0] = 5.0
    for bits, group in ((3, None), (4, 16), (2, 20)):
        qmax, grid = 2**bits - 1, 30
        flat, valid, lo, hi, _ = _search_groups(w, group)
        delta = torch.stack([((hi - lo) * i / grid / qmax).clamp(min=SCALE_EPS) for i in range(1, grid + 1)], 1)
        zps = torch.arange(qmax + 1, dtype=torch.float32)[None, :, None]
        scores = torch.stack([_search_error(flat[:, None, :], valid[:, None, :], delta[:, i, None, None], zps,
                                            qmax, 2.4) for i in range(grid)], 1)             # [N, G, Z]
        for split in (True, False):
            bound = _score_bounds(_sorted_groups(flat, valid), delta, qmax, 2.4, split)
            assert bound.shape == scores.shape
            ratio = scores.double() / bound.double()
            assert ratio[bound > 0].min() >= 1 - 1e-5, (bits, group, split, ratio.min().item())
            # and it is a useful bound: within a factor 2 of the score for the best candidates
            best = scores.reshape(len(flat), -1).argmin(1)
            assert (ratio.reshape(len(flat), -1).gather(1, best[:, None]) < 2).all()


def test_non_finite_weights_take_the_exhaustive_path():
    w = torch.randn(4, 16)
    w[0, 3] = math.inf
    s0, z0 = search_qparams_exhaustive(w, 3)
    s1, z1 = search_qparams(w, 3)
    assert torch.equal(s0, s1) and torch.equal(z0, z1)


@pytest.mark.slow
def test_identical_on_default_model_weights():
    """Rows of the default model's q/k/down projections (first, middle, last block), bits 3, 4 and 8,
    per channel and in groups of 128 (k_proj's 576 columns end in a ragged group of 64)."""
    from bench.common.models import load_model

    model = load_model().model
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        checked = 0
        for layer, name, rows in ((0, "mlp.down_proj", slice(0, 48)), (15, "self_attn.k_proj", slice(16, 64)),
                                  (29, "self_attn.q_proj", slice(500, 540))):
            w = model.get_submodule(f"model.layers.{layer}.{name}").weight.detach().float()[rows]
            for bits, group in ((3, None), (3, 128), (4, None), (4, 128), (8, None)):
                s, z = _same(w[:8] if bits == 8 else w, bits, group)   # 8 bits: 25,600 candidates a row
                assert torch.isfinite(s).all() and (s > 0).all() and (z >= 0).all() and (z <= 2**bits - 1).all()
                checked += s.numel()
        assert checked > 1000
    finally:
        torch.set_num_threads(before)


def test_the_study_runs_and_checks_identity(tmp_path):
    """`python -m bench.studies.s1_search --smoke`: all three implementations, one table, identical results."""
    import json

    from bench.studies.s1_search import main, naive_search

    assert main(["--smoke", "--bits", "3", "--groups", "channel,64", "--out", str(tmp_path)]) == 0
    res = json.loads((tmp_path / "s1_search.json").read_text())
    assert [r["groups"] for r in res["rows"]] == ["per channel", "g64"]
    for r in res["rows"]:
        assert r["identical"] and set(r["median_s"]) == {"naive", "exhaustive", "fast"}
        assert 4 <= r["scored_mean"] <= r["candidates"] == 800
    md = (tmp_path / "s1_search.md").read_text()
    assert "| 3 | per channel | 800 |" in md and res["config"]["git"] in md
    # the naive loop is the definition too
    w = torch.randn(5, 30)
    assert all(torch.equal(a, b) for a, b in zip(naive_search(w, 3, 10, grid=20), search_qparams(w, 3, 10, grid=20)))



def test_the_search_of_a_revision_loads():
    """`--against REV` loads `lrq/quant.py` as it was at REV, a module of its own (one with dataclasses too);
    HEAD's searches as the imported one does (skipped outside a git checkout)."""
    import subprocess
    from pathlib import Path

    from bench.studies.s1_search import search_at_revision
    root = Path(__file__).resolve().parents[1]
    if subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True).returncode != 0:
        pytest.skip("not a git checkout")
    name, search = search_at_revision("HEAD")
    w = torch.randn(6, 300, generator=torch.Generator().manual_seed(1))
    assert name.startswith("fast@")
    assert all(torch.equal(a, b) for a, b in zip(search(w, 3, 64), search_qparams(w, 3, 64)))
