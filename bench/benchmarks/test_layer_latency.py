"""pytest-benchmark suite (not part of the test suite; run explicitly):

    python -m pytest bench/benchmarks --benchmark-only --benchmark-columns=median,iqr,rounds

Each case times one packed layer forward (every scheme) or the dense nn.Linear it replaces, on SmolLM2
shapes, on the CPU (or the GPU when present), with bf16 and float32 activations (a packed model runs in bf16 where
the CPU has it natively, else float32: lrq.cpu_kernels). `python -m bench.studies.speed layers` prints the same figures
as a speed-up table and stores them.
"""

import pytest
import torch

from bench.studies.speed import LAYER_SCHEMES, SHAPES, random_packed

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
MS = (1, 16, 64, 256, 512, 2048)
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("m", MS)
@pytest.mark.parametrize("shape", list(SHAPES["smollm2"]))
@pytest.mark.parametrize("scheme", ("dense",) + LAYER_SCHEMES)
def test_layer_forward(benchmark, scheme, shape, m, dtype):
    n, k = SHAPES["smollm2"][shape]
    x = torch.randn(m, k, dtype=DTYPES[dtype], device=DEVICE)
    if scheme == "dense":
        layer = torch.nn.Linear(k, n, bias=False, dtype=DTYPES[dtype], device=DEVICE)
    else:
        layer, _ = random_packed(n, k, scheme, DEVICE)
        if DEVICE == "cpu":
            layer.convert_for_cpu()   # as lrq.pack / lrq.load do: the kernel's layout, made once
    benchmark.extra_info.update({"scheme": scheme, "dtype": dtype, "N": n, "K": k, "M": m, "device": DEVICE,
                                 "threads": torch.get_num_threads()})
    with torch.no_grad():
        y = benchmark(layer, x)
    assert y.shape == (m, n)
