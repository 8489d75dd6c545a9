"""lrq.hugepages: the weights a CPU decode step streams, copied into one region marked for transparent huge pages,
and LeanDecoder's use of it (the same logits, the tensors moved in the order a step reads them)."""

from __future__ import annotations

import pytest
import torch

from lrq import hugepages
from lrq.methods import get_method, load_methods
from lrq.packed import pack_model
from lrq.runtime import LeanDecoder
from lrq.schemes import get_scheme
from conftest import random_calibration, tiny_model


def _vm_flags(address: int) -> set[str]:
    """The VmFlags of the mapping of this process that holds `address` (/proc/self/smaps)."""
    inside = False
    for line in open("/proc/self/smaps"):
        head = line.split()[0]
        if "-" in head and all(c in "0123456789abcdef-" for c in head):
            lo, hi = (int(v, 16) for v in head.split("-"))
            inside = lo <= address < hi
        elif inside and line.startswith("VmFlags:"):
            return set(line.split()[1:])
    raise AssertionError(f"no mapping holds {address:#x}")


@pytest.fixture
def thp(monkeypatch):
    """Huge pages asked for whatever this kernel's THP mode (`never` still takes the madvise; the region then has
    4 KB pages): the tests check what is copied where, not what the kernel grants."""
    monkeypatch.setattr(hugepages, "available", lambda: True)


def test_gather_copies_into_one_region_marked_for_huge_pages(thp):
    """Copies with the originals' values, dtypes and shapes, one after the other on cache lines (in the order given),
    in a 2 MB-aligned mapping the kernel was asked to back with huge pages (its VmFlags say `hg`)."""
    g = torch.Generator().manual_seed(0)
    ts = [torch.randn(3, 100, generator=g).bfloat16(), torch.randint(0, 255, (1000,), dtype=torch.uint8, generator=g),
          torch.randn(2, 7, 5, generator=g)]
    copies = hugepages.gather(ts)
    assert copies is not None
    for t, c in zip(ts, copies):
        assert torch.equal(t, c) and c.dtype == t.dtype and c.shape == t.shape and c.data_ptr() != t.data_ptr()
    ptrs = [c.data_ptr() for c in copies]
    assert ptrs[0] % hugepages.HUGE == 0
    assert ptrs[1] == ptrs[0] + 640 and ptrs[2] == ptrs[1] + 1024   # 600 and 1000 bytes, each on 64
    assert "hg" in _vm_flags(ptrs[0])
    region = copies[0]
    del copies, ts
    assert region.float().sum().isfinite()   # the region outlives the list: a view holds the mapping


def test_without_huge_pages_nothing_is_copied(tmp_path, monkeypatch):
    """A kernel whose THP setting is `never` (or none at all): no region, gather returns None, LeanDecoder's weights
    stay where they are."""
    setting = tmp_path / "enabled"
    setting.write_text("always madvise [never]\n")
    monkeypatch.setattr(hugepages, "THP_SETTING", setting)
    assert not hugepages.available() and hugepages.arena(1 << 20) is None
    assert hugepages.gather([torch.ones(4)]) is None
    model = tiny_model("llama", hidden=64).to(torch.bfloat16)
    before = model.lm_head.weight.data_ptr()
    lean = LeanDecoder(model, 16)
    assert lean._huge_page_weights() == 0 and model.lm_head.weight.data_ptr() == before
    monkeypatch.setattr(hugepages, "THP_SETTING", tmp_path / "missing")
    assert not hugepages.available()


@pytest.mark.parametrize("scheme", [None, "w4a16", "w4a8", "w8a8", "w8a16"])
def test_lean_decoder_moves_the_weights_a_step_reads_and_gives_the_same_logits(scheme, thp):
    """The first forward moves each layer's linears (dense weights, or a packed model's CPU forms: W8A8's int8 levels
    with their per-row terms; the int8 weight-only form's per-group chunks stay) and the head into one region in the
    order a step reads them; prefill and decode logits and greedy tokens are the same bits as with the weights left
    where they were (huge_pages False); a tied embedding moves with the head. The key and value caches stay where
    they are (zeros the kernel maps as they are first written: moved into huge pages they would be resident whole,
    however few positions a run uses)."""
    model = tiny_model("llama", hidden=192)
    if scheme:
        load_methods()
        rtn = get_method("rtn")
        rtn.quantize(model, get_scheme(scheme), rtn.config("quick"),
                     random_calibration() if get_scheme(scheme).static_activations else None)   # W8A8: a static grid
        pack_model(model)
    model = model.to(torch.bfloat16)
    ids = torch.randint(0, 128, (1, 9), generator=torch.Generator().manual_seed(1))
    runs = []
    for huge in (False, True):
        lean = LeanDecoder(model, 32)
        lean.huge_pages = huge
        caches = [lean.k_layers[0].data_ptr(), lean.v_layers[0].data_ptr()]
        logits = [lean.forward(ids)]
        nxt = logits[-1][:, -1:].argmax(-1)
        for _ in range(4):
            logits.append(lean.forward(nxt))
            nxt = logits[-1][:, -1:].argmax(-1)
        runs.append((torch.cat([x[:, -1] for x in logits]), lean.greedy(ids, 5)))
        assert [lean.k_layers[0].data_ptr(), lean.v_layers[0].data_ptr()] == caches
    assert torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][1], runs[1][1])
    moved = []
    for layer in model.model.layers:
        a, mlp = layer.self_attn, layer.mlp
        for mod in (a.q_proj, a.k_proj, a.v_proj, a.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj):
            if scheme is None:
                moved.append(mod.weight)
            else:
                from lrq.cpu_kernels import int4_form
                int4 = int4_form(mod.cpu_weights)
                w = mod.cpu_weights
                moved += ([int4.packed, int4.scale_zero] if int4 is not None else
                          [w.weight, w.wsum, w.col_term, w.zero_term, w.scale] if scheme == "w8a8" else
                          [w.weight] if hasattr(w, "weight") else [])   # w8a16: none
    moved.append(model.lm_head.weight)
    ptrs = [t.data_ptr() for t in moved]
    sizes = [-(-t.numel() * t.element_size() // 64) * 64 for t in moved]
    assert all(p + s == q for p, s, q in zip(ptrs, sizes, ptrs[1:]))   # one region, in a step's order
    assert "hg" in _vm_flags(ptrs[0])
    if model.config.tie_word_embeddings:
        assert model.model.embed_tokens.weight.data_ptr() == ptrs[-1]


def test_the_old_copies_are_freed_and_a_second_decoder_does_not_copy_again(thp):
    """After the first forward nothing refers to the weights' old storage any more (the process holds one copy:
    the packed kernels' cached arguments are made again), and a second LeanDecoder of the same model reads the
    region the first made instead of copying the weights again."""
    import weakref
    load_methods()
    model = tiny_model("llama", hidden=192)
    rtn = get_method("rtn")
    rtn.quantize(model, get_scheme("w4a16"), rtn.config("quick"), None)
    pack_model(model)
    model = model.to(torch.bfloat16)
    layer = model.model.layers[0]
    int4 = layer.mlp.down_proj.cpu_weights or layer.mlp.down_proj.convert_for_cpu()
    int4._native_layer()   # cached kernel arguments that point into the old storage
    old = [weakref.ref(int4.packed), weakref.ref(int4.scale_zero)]
    old_head = model.lm_head.weight.data_ptr()
    lean = LeanDecoder(model, 16)
    lean.forward(torch.arange(5)[None])
    lean.forward(torch.tensor([[3]]))
    import gc
    gc.collect()
    assert all(r() is None for r in old) and model.lm_head.weight.data_ptr() != old_head
    where = (int4.packed.data_ptr(), model.lm_head.weight.data_ptr())
    second = LeanDecoder(model, 16)
    assert second._huge_page_weights() == 0
    second.forward(torch.arange(5)[None])
    assert (int4.packed.data_ptr(), model.lm_head.weight.data_ptr()) == where
