"""The decode GEMV (lrq.kernels.gemv) under Triton's interpreter (conftest sets TRITON_INTERPRET=1) against the
float reference (the dequantized planar weight times x): w4a16 per channel, w4a16-g128, w3a16, w8a16; M = 1, 3, 16;
K not a multiple of the K block, N odd, split K (float32 atomics) and not, bias; refusals of what does not fit."""

import pytest
import torch

import lrq.kernels.gemv as G
import lrq.kernels.wq_gemm as WQ

from test_kernels import TOL, _layer, _rel   # the other kernels' layer maker, tolerances and error measure


@pytest.mark.parametrize("bits,group", [(4, None), (4, 128), (3, None), (8, None)])
@pytest.mark.parametrize("m", [1, 3, 16])
def test_gemv_equals_the_float_reference(bits, group, m):
    # K = 300: not a multiple of any K block (128 / 160 / 64 columns), a ragged last group; N = 37: odd, < a tile
    n, k = 37, 300
    packed, scale, zero, _ = _layer(n, k, bits, group, bits * 10 + m)
    w = G.repack_gemv(packed, scale, zero, bits, group, k)
    b = torch.randn(n)
    for dtype, split in ((torch.float32, 1), (torch.float16, 2), (torch.bfloat16, 3)):
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(dtype)
        y = G.gemv_matmul(x, w, b if split != 1 else None, split=split)
        ref = WQ.reference_wq_matmul(x, packed, scale, zero, bits, group, k, b if split != 1 else None)
        assert y.dtype == dtype and y.shape == (m, n)
        assert _rel(y, ref) < TOL[dtype], (dtype, split)


@pytest.mark.parametrize("m", [1, 3])
def test_gemv_on_even_and_uneven_shapes_and_groups_that_straddle_blocks(m):
    """M = 1 runs the one-row kernel on sizes that are multiples of 16: N a multiple of its 128-column tile and K
    of the K block (the unclamped EVEN path, as LLM layers are at 4 and 8 bits), or not (N = 48, 144; K = 304,
    656: the masked path); 3 bits with groups of 32 and 128 against its 160-column blocks (a group's scale
    applied where the group ends, inside a block or at a split's end); 8 bits' groups of two whole blocks;
    splits that cut the K blocks unevenly. Odd sizes go to the 16-token kernel."""
    t = G.GEMV_CONFIGS[1].block_n
    for n, bits, group, k, split in ((2 * t, 4, None, 512, 3), (2 * t, 4, 64, 512, 1), (2 * t, 8, 128, 512, 3),
                                     (2 * t, 3, 32, 640, 3), (2 * t, 3, 128, 640, 3), (48, 4, None, 304, 3),
                                     (48, 3, 128, 656, 2), (144, 8, 128, 336, 3), (144, 4, 32, 304, 2)):
        assert G._config(1, n, k).block_m == 1
        packed, scale, zero, _ = _layer(n, k, bits, group, bits + k + split)
        w = G.repack_gemv(packed, scale, zero, bits, group, k)
        b = torch.randn(n)
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.randn(m, k, generator=torch.Generator().manual_seed(k)).to(dtype)
            y = G.gemv_matmul(x, w, b, split=split)
            ref = WQ.reference_wq_matmul(x, packed, scale, zero, bits, group, k, b)
            assert _rel(y, ref) < TOL[dtype], (n, bits, group, k, split, dtype)
    assert G._config(1, 37, 300).block_m == 16 and G._config(1, 48, 300).block_m == 16


@pytest.mark.parametrize("m", [1, 3])
def test_gemv_reads_no_group_past_k(m):
    """The last K block's steps past K belong to no group (here K = 300 or 304, groups of 32: 10 groups, blocks of
    128 columns reach 384): their scale and zero point must not be read. The scales and zero points sit in larger
    buffers poisoned with NaN / 255 right after their end, so a read past them shows in the output."""
    bits, group = 4, 32
    for n, k in ((37, 300), (48, 304)):   # the 16-token kernel at M = 1 too; the one-row kernel
        packed, scale, zero, _ = _layer(n, k, bits, group, 5)
        w = G.repack_gemv(packed, scale, zero, bits, group, k)
        ng = w.scale.shape[0]
        s_big = torch.full((ng + 4, n), float("nan"), dtype=torch.float16)
        z_big = torch.full((ng + 4, n), 255, dtype=torch.uint8)
        s_big[:ng], z_big[:ng] = w.scale, w.zero
        poisoned = G.GemvWeights(w.words, s_big[:ng], z_big[:ng], bits, group, k)
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(1))
        for split in (1, 2):
            y = G.gemv_matmul(x, poisoned, split=split)
            assert torch.isfinite(y).all(), (n, k, split)
            assert _rel(y, WQ.reference_wq_matmul(x, packed, scale, zero, bits, group, k)) < TOL[torch.float32]


def test_the_split_one_row_kernel_finishes_itself_and_leaves_its_workspace_zero():
    """M = 1 with split K: the last split of each tile writes y (in the activations' dtype) from the float32
    workspace and zeroes it and the tile's counter, so calls after calls (and CUDA-graph replays) start clean."""
    n, k, bits = 2 * G.GEMV_CONFIGS[1].block_n, 512, 4
    packed, scale, zero, _ = _layer(n, k, bits, 128, 11)
    w = G.repack_gemv(packed, scale, zero, bits, 128, k)
    b = torch.randn(n)
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    ref = WQ.reference_wq_matmul(x, packed, scale, zero, bits, 128, k, b)
    ws, cnt = G.split_workspace(x.device, n, 2)
    first = None
    for split in (2, 3, 4, 3):
        y = G.gemv_matmul(x, w, b, split=split)
        assert y.dtype == torch.bfloat16 and _rel(y, ref) < TOL[torch.bfloat16], split
        assert not ws.any() and not cnt.any(), split
        if split == 3:
            first = y if first is None else first
            assert torch.equal(y, first)


def test_gemv_layout_is_what_the_docstring_says():
    """4 bits, K = 300: blocks of 8 * 16 = 128 columns, 3 blocks -> 48 words per row, transposed [48, N]; inside
    a block, column r = h * 32 + 2 j + t (pair h, word j, half t) sits in word j at bit 4 h + 16 t; 3 bits hold
    10 levels a word (5 a half), 6 bits 4 (2 a half: 8 bits a weight), 8 bits 4."""
    q = torch.randint(0, 16, (5, 300), generator=torch.Generator().manual_seed(0))
    words = G.repack_levels(q, 4)
    assert words.shape == (48, 5) and words.dtype == torch.int32 and words.is_contiguous()
    for n, kk in ((0, 0), (0, 1), (4, 17), (2, 129), (3, 299), (1, 127)):
        blk, r = divmod(kk, 128)
        h, rr = divmod(r, 32)
        j, t = divmod(rr, 2)
        word = int(words[blk * 16 + j, n]) & 0xFFFFFFFF
        assert (word >> (4 * h + 16 * t)) & 15 == q[n, kk], (n, kk)
    assert G.repack_levels(torch.zeros(2, 300, dtype=torch.long), 3).shape == (2 * 16, 2)   # 160-column blocks
    assert [G.elems_per_word(b) for b in range(2, 9)] == [16, 10, 8, 6, 4, 4, 4]
    assert G.fast_pairs(7, torch.bfloat16) and not G.fast_pairs(8, torch.bfloat16) and G.fast_pairs(8, torch.float16)
    assert not G.fast_pairs(4, torch.float32)


def test_gemv_refuses_what_does_not_fit():
    packed, scale, zero, _ = _layer(8, 96, 4, 24, 0)
    with pytest.raises(ValueError, match="multiple of 32"):
        G.repack_gemv(packed, scale, zero, 4, 24, 96)
    packed, scale, zero, _ = _layer(8, 96, 4, 16, 0)
    with pytest.raises(ValueError, match="multiple of 32"):
        G.repack_gemv(packed, scale, zero, 4, 16, 96)
    packed, scale, zero, _ = _layer(8, 64, 4, None, 0)
    w = G.repack_gemv(packed, scale, zero, 4, None, 64)
    with pytest.raises(ValueError, match="at most 16 tokens"):
        G.gemv_matmul(torch.randn(17, 64), w)
    with pytest.raises(ValueError, match="input features"):
        G.gemv_matmul(torch.randn(1, 65), w)
    with pytest.raises(ValueError, match="bf16, fp16 or fp32"):
        G.gemv_matmul(torch.randn(1, 64).double(), w)
    with pytest.raises(ValueError, match="2- to 8-bit"):
        G.repack_levels(torch.zeros(2, 8, dtype=torch.long), 9)


def test_gemv_split_k_rule():
    c = G.GEMV_CONFIGS[1]
    assert (c.block_n, c.num_warps) == (128, 1)
    assert G.gemv_split(1, 4096, 4096, 4, 0, c) == 1                  # no GPU: no split
    assert G.gemv_split(1, 4096, 11008, 4, 132, c) == 32              # 32 one-warp tiles, 86 K blocks: capped
    assert G.gemv_split(1, 11008, 4096, 4, 132, c) == 13              # 86 tiles -> 8 warps per SM
    assert G.gemv_split(1, 4096, 256, 4, 132, c) == 2                 # never more splits than K blocks
    assert G.gemv_split(16, 4096, 256, 4, 132, G.GEMV_CONFIGS[16]) == 1   # two K blocks: nothing to share


def test_every_gemv_launch_at_the_gpu_shapes_is_compiled_offline():
    """What the GPU session launches (decode shapes, M = 1..16, the four schemes, H200's 132 SMs) is among the
    variants tests/test_kernel_aot.py compiles for sm_90/sm_80 (same configuration and constexprs, bf16)."""
    from lrq.kernels import aot
    checked = {(v.config, tuple((k, x) for k, x in v.constexprs if k != "DT"))
               for v in aot.variants() if v.kernel == "gemv" and dict(v.constexprs)["DT"] == "bf16"}
    for n, k in ((4096, 11008), (11008, 4096), (4096, 4096)):
        for bits, group in ((4, None), (4, 128), (3, None), (8, None)):
            for m in (1, 2, 4, 8, 16):
                (kernel, c, ce), = G.compilations(m, n, k, bits, group, torch.bfloat16)
                key = ((c.block_m, c.block_n, 0, c.num_warps, c.num_stages), tuple(sorted(ce.items())))
                assert kernel == "gemv" and key in checked, (m, n, k, bits, group, ce)


def _as_float(bits16: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """16-bit patterns (ints in [0, 2^16)) read as bf16 / fp16 values, in float32."""
    return bits16.to(torch.int32).to(torch.int16).view(dtype).float()   # int32 -> int16 wraps: the same 16 bits


def test_the_pair_ptx_leaves_lev_minus_z_exactly():
    """The 16-token kernel's inline PTX (G.pair_asm) runs only on a GPU (the interpreter runs no PTX and takes the
    same values through Triton operations), so its arithmetic is emulated here bit for bit with the PTX's own
    constants: LOP3 0xEA = (word & mask) | magic on the word shifted to pair h, then the packed FMA t * one +
    (-(2^p + z)), -(2^p + z) rounded to the activations' type as `_zero_operands` does. For every width the pair
    path takes, every pair of a word, every level (a different one in each half) and every zero point, both
    halves come out as lev - z exactly."""
    import re
    for dtype, widths in ((torch.bfloat16, range(2, 8)), (torch.float16, range(2, 9))):
        asm = G.pair_asm(dtype)
        one, magic = (int(v, 16) for v in re.search(
            r"mov\.b32 o, 0x([0-9A-F]{8}); lop3\.b32 t, \$1, \$3, 0x([0-9A-F]{8}), 0xEA;", asm).groups())
        assert G.PAIR_FLOATS[dtype][2] in asm and one & 0xFFFF == one >> 16 and magic & 0xFFFF == magic >> 16
        assert _as_float(torch.tensor([one & 0xFFFF]), dtype).item() == 1.0
        base = _as_float(torch.tensor([magic & 0xFFFF]), dtype).item()     # 2^p: 128 in bf16, 1024 in fp16
        for bits in widths:
            assert G.fast_pairs(bits, dtype) and (16 // bits) * bits <= 16
            top = 1 << bits
            lev, z = (t.flatten() for t in torch.meshgrid(torch.arange(top), torch.arange(top), indexing="ij"))
            lev_hi = (lev * 5 + 3) % top
            zneg = (-(z.float() + base)).to(dtype).view(torch.int16).to(torch.int64) & 0xFFFF
            for h in range(16 // bits):
                word = (lev << (h * bits)) | (lev_hi << (16 + h * bits))
                for other in range(16 // bits):   # the word's other pairs hold levels too
                    if other != h:
                        word |= ((lev + other) % top << (other * bits)) | ((z + other) % top << (16 + other * bits))
                t = ((word >> (h * bits)) & (((1 << bits) - 1) * 65537)) | magic
                for half, want in ((0, lev - z), (1, lev_hi - z)):
                    got = _as_float((t >> 16 * half) & 0xFFFF, dtype) * 1.0 + _as_float(zneg, dtype)
                    assert torch.equal(got.to(dtype).float(), want.float()), (dtype, bits, h, half)
    assert not G.fast_pairs(8, torch.bfloat16)   # 128 + 255 has 9 significant bits: bf16 rounds it
