"""pytest-benchmark cases for the CPU decode step and the 4-bit prefill operand (not part of the test suite; run
explicitly):

    python -m pytest bench/benchmarks/test_decode_step.py --benchmark-only --benchmark-columns=median,iqr,rounds

- one greedy decode step of a SmolLM2-135M-shaped model (random weights, built in memory: no download), dense bf16
  and packed w4a16-g128 and w4a8 (RTN, no calibration needed), through lrq.runtime.LeanDecoder with its decoder layers
  fused (lrq.native: the whole stack one call a step) and through its modules (`fused` False), at a fixed cache length
  of 64 positions;
- a prefill of 256 tokens of the same models from an empty cache (the last position's logits), with the norms,
  residual adds, SiLU products and RoPE as lrq.native row kernels (`rows`) and as torch's operations;
- the 4-bit form's transient prefill operand (Int4Weights.dequantized_t) made by lrq.native and by torch's ops;
- the output head of SmolLM2-135M (49,152 x 576) for one token: bf16 through lrq's dense GEMV, int8 levels per channel
  (lrq.packed.quantize_head's form) through lrq's int8 kernel and through torch's `_weight_int8pack_mm`.

The end-to-end comparison with interleaved rounds, the real model and llama.cpp is `python -m bench.studies.speed
e2e --device cpu` (reports/speed-cpu/); these cases are for tracking one kernel or one step across commits.
"""

import pytest
import torch

from lrq import native

SMOLLM2 = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
               num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=2048, rms_norm_eps=1e-5,
               tie_word_embeddings=True, hidden_act="silu")
CACHED = 64   # positions in the cache when the timed step runs


@pytest.fixture(scope="module", params=["dense", "w4a16-g128", "w4a8"])
def model(request):
    from transformers import LlamaConfig, LlamaForCausalLM
    from lrq.methods import get_method, load_methods
    from lrq.packed import pack_model
    from lrq.schemes import get_scheme
    torch.manual_seed(0)
    m = LlamaForCausalLM(LlamaConfig(**SMOLLM2)).eval()
    if request.param != "dense":
        load_methods()
        rtn = get_method("rtn")
        rtn.quantize(m, get_scheme(request.param), rtn.config("quick"), None)
        pack_model(m)
    return request.param, m.to(torch.bfloat16)


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "modules"])
def test_decode_step(benchmark, model, fused):
    from lrq.runtime import LeanDecoder
    if fused and native.library() is None:
        pytest.skip(f"lrq.native is not built here: {native.status()}")
    name, m = model
    lean = LeanDecoder(m, CACHED + 8)
    lean.fused = fused
    lean.forward(torch.arange(CACHED)[None] % 1000)
    token = torch.tensor([[17]])

    def step():
        lean.length = CACHED          # the same position every round: the same attention length
        return lean.forward(token)

    benchmark.extra_info.update({"model": f"SmolLM2-135M shape, random weights, {name}", "fused": fused,
                                 "cached": CACHED, "threads": torch.get_num_threads(), "native": native.status()})
    logits = benchmark(step)
    assert logits.shape == (1, 1, SMOLLM2["vocab_size"]) and torch.isfinite(logits).all()


PREFILL = 256   # tokens of the timed prefill


@pytest.mark.parametrize("rows", [True, False], ids=["rows", "torch-ops"])
def test_prefill(benchmark, model, rows):
    from lrq.runtime import LeanDecoder
    if rows and native.library() is None:
        pytest.skip(f"lrq.native is not built here: {native.status()}")
    name, m = model
    lean = LeanDecoder(m, PREFILL)
    lean.rows_native = rows
    ids = torch.arange(PREFILL)[None] % 1000

    def prefill():
        lean.reset()
        return lean.forward(ids)

    benchmark.extra_info.update({"model": f"SmolLM2-135M shape, random weights, {name}", "rows_native": rows,
                                 "tokens": PREFILL, "threads": torch.get_num_threads(), "native": native.status()})
    logits = benchmark(prefill)
    assert logits.shape == (1, 1, SMOLLM2["vocab_size"]) and torch.isfinite(logits).all()


@pytest.mark.parametrize("maker", ["native", "torch"])
@pytest.mark.parametrize("shape", [(1536, 576), (576, 1536)])
def test_prefill_operand(benchmark, maker, shape):
    from lrq.cpu_kernels import Int4Weights
    if maker == "native" and native.library() is None:
        pytest.skip(f"lrq.native is not built here: {native.status()}")
    n, k = shape
    g = torch.Generator().manual_seed(0)
    w = Int4Weights.build(torch.randint(0, 16, (n, k), generator=g), torch.rand(n, k // 128, generator=g) * 0.01,
                          torch.randint(0, 16, (n, k // 128), generator=g).float(), 128)
    make = w.dequantized_t if maker == "native" else w.dequantized_t_torch
    benchmark.extra_info.update({"N": n, "K": k, "group": 128, "maker": maker})
    out = benchmark(make, torch.bfloat16)
    assert out.shape == (k, n) and out.dtype == torch.bfloat16


@pytest.mark.parametrize("head", ["bf16 lrq", "int8 lrq", "int8 torch"])
def test_output_head(benchmark, head):
    from lrq.cpu_kernels import Int8Weights
    if "lrq" in head and native.library() is None:
        pytest.skip(f"lrq.native is not built here: {native.status()}")
    n, k = SMOLLM2["vocab_size"], SMOLLM2["hidden_size"]
    g = torch.Generator().manual_seed(0)
    weight = (torch.randn(n, k, generator=g) * 0.05).bfloat16()
    x = torch.randn(1, k, generator=g).bfloat16()
    if head == "bf16 lrq":
        y = torch.empty(1, n, dtype=torch.bfloat16)

        def run():
            native.checked(native.library().lrq_dense_gemv(weight.data_ptr(), x.data_ptr(), y.data_ptr(), 1, n, k,
                                                           torch.get_num_threads()), "head")
            return y
    else:
        from lrq.quant import minmax_qparams, quantize
        s, z = minmax_qparams(weight.float(), 8)
        w = Int8Weights.build(quantize(weight.float(), s, z, 8), s, z, 8, None)
        (levels,), unit = w.chunks, w.unit[torch.bfloat16]
        run = (lambda: w.native_mm(x)) if head == "int8 lrq" else (lambda: torch._weight_int8pack_mm(x, levels, unit))
    benchmark.extra_info.update({"N": n, "K": k, "head": head})
    out = benchmark(run)
    assert out.shape == (1, n) and out.dtype == torch.bfloat16
