"""pytest-benchmark suite (not part of the test suite; run explicitly):

    python -m pytest bench/benchmarks --benchmark-only --benchmark-columns=median,iqr,rounds

Each case times one packed layer forward (every scheme) or the bf16 nn.Linear it replaces, on SmolLM2
shapes, on the CPU (or the GPU when present). `python -m bench.studies.speed layers` prints the same figures
as a speed-up table and stores them.
"""

import pytest
import torch

from bench.studies.speed import LAYER_SCHEMES, SHAPES, random_packed

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
MS = (1, 16, 64, 256, 2048)


@pytest.mark.parametrize("m", MS)
@pytest.mark.parametrize("shape", list(SHAPES["smollm2"]))
@pytest.mark.parametrize("scheme", ("bf16",) + LAYER_SCHEMES)
def test_layer_forward(benchmark, scheme, shape, m):
    n, k = SHAPES["smollm2"][shape]
    x = torch.randn(m, k, dtype=torch.bfloat16, device=DEVICE)
    if scheme == "bf16":
        layer = torch.nn.Linear(k, n, bias=False, dtype=torch.bfloat16, device=DEVICE)
    else:
        layer, _ = random_packed(n, k, scheme, DEVICE)
    benchmark.extra_info.update({"scheme": scheme, "N": n, "K": k, "M": m, "device": DEVICE,
                                 "threads": torch.get_num_threads()})
    with torch.no_grad():
        y = benchmark(layer, x)
    assert y.shape == (m, n)
