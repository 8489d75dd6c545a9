"""Every GPU kernel configuration compiled ahead of time for sm_90 (H100/H200) and sm_80 (A100) on this
CPU-only machine: shared memory within the per-block limit, no register spills, tensor cores used by the
GEMMs. The table is printed (pytest -s) and written to $LRQ_BENCH_ARTIFACTS when set."""

import json
import os
from pathlib import Path

import pytest

from lrq.kernels import aot
from lrq.kernels.gemv import GEMV_CONFIGS
from lrq.kernels.int8_gemm import INT8_BUCKETS
from lrq.kernels.wq_gemm import WQ_BUCKETS


@pytest.fixture(scope="module")
def rows():
    return aot.run((90, 80), jobs=2, unaligned=True)


def test_every_kernel_configuration_fits_sm90_and_sm80(rows):
    table, summary = aot.format_table(rows), aot.summary(rows)
    print("\n" + table + "\n" + json.dumps(summary))
    art = os.environ.get("LRQ_BENCH_ARTIFACTS")
    if art:
        Path(art).mkdir(parents=True, exist_ok=True)
        (Path(art) / "kernel_aot.md").write_text(table + "\n\n" + json.dumps(summary) + "\n")
    bad = [f"{r['kernel']} {r['config']} {r['variant']} {r['target']}: {'; '.join(aot.violations(r))}"
           for r in rows if aot.violations(r)]
    assert not bad, "\n".join(bad)
    # coverage: every configuration of every bucket, on both targets, with bits 3/4/8, both group modes
    # and both activation dtypes, and the odd-shape specialisation
    for kernel, buckets in (("wq_gemm", WQ_BUCKETS), ("int8_gemm", INT8_BUCKETS)):
        for c in buckets.all():
            mine = [r for r in rows if r["kernel"] == kernel and r["config"] == str(c)]
            assert {r["target"] for r in mine} == {"sm_90", "sm_80"}, (kernel, str(c))
            assert {v for r in mine for v in ("P0=4", "P0=8", "P1=1") if v in r["variant"]} == {"P0=4", "P0=8", "P1=1"}
            assert any(not r["aligned"] for r in mine)
            if kernel == "wq_gemm":
                assert {("GROUP=0" in r["variant"], "DT=bf16" in r["variant"]) for r in mine} == \
                       {(True, True), (True, False), (False, True), (False, False)}
    assert {r["kernel"] for r in rows} == {"wq_gemm", "int8_gemm", "wq_dequant", "act_quant", "gemv"}
    # the decode GEMV: both configurations on both targets, bits 3/4/8, per channel and group 128, split K and
    # not; its 16-token configuration on the tensor cores (mma.sync on both)
    for gc in GEMV_CONFIGS.values():
        mine = [r for r in rows if r["kernel"] == "gemv" and r["config"].startswith(f"{gc.block_m}x{gc.block_n}x")]
        assert {r["target"] for r in mine} == {"sm_90", "sm_80"}
        assert {(b, g) for r in mine for b in (3, 4, 8) for g in (0, 128)
                if f"BITS={b} " in r["variant"] and f"GROUP={g} " in r["variant"]} == \
               {(b, g) for b in (3, 4, 8) for g in (0, 128)}
        assert {"ATOMIC=True" in r["variant"] for r in mine} == {True, False}
        # odd sizes run the 16-token kernel (lrq.kernels.gemv._config), so only it has the odd-shape build
        assert any(not r["aligned"] for r in mine) == (gc.block_m > 1)
        assert all(r["spill_stores"] == 0 == r["spill_loads"] for r in mine)
        assert all(r["needs_tensor_cores"] == (gc.block_m > 1) for r in mine)
        assert all(r["loop"]["instructions"] > 0 for r in mine)
    # the M = 1 kernel's loop, from its machine code: no shuffle or int-to-float conversion, and few instructions
    # a weight where a shape is even (the H200 issues about 35 weights a clock and SM at 4 bits to keep up with its
    # memory: 128 lanes / 3.6 instructions); the old M = 1 path read 8.5 (4 bits, sm_90). Its only barriers are
    # the two of its 2-stage copy pipeline, in a one-warp program (a warp waiting on itself), and where groups
    # straddle K blocks (3 bits' 160 columns, groups of 128) the pipelined zero points' and scales' four
    one = [r for r in rows if r["kernel"] == "gemv" and r["config"].startswith("1x")]
    assert one and all(r["loop"]["shuffles"] == r["loop"]["int_to_float"] == 0 for r in one)
    assert all(r["loop"]["barriers"] <= (6 if "BITS=3 " in r["variant"] and "GROUP=128 " in r["variant"] else 2)
               and "STAGES=2" in r["variant"] and r["config"].endswith("w1 s2") for r in one), \
        [(r["variant"], r["loop"]) for r in one]
    even4 = [r["loop"]["per_weight"] for r in one if "EVEN=True" in r["variant"] and "BITS=4" in r["variant"]
             and r["target"] == "sm_90" and "DT=bf16" in r["variant"]]
    assert even4 and max(even4) <= 4.5, even4
    # the 16-token kernel reads its words straight into the tensor cores' operand layout on LLM shapes: two
    # barriers an iteration per channel (the software pipeline's), two more where a K block's group takes its
    # zero points and scale (4 bits, groups of 128: their per-column vectors change layout once a block); a change
    # that makes Triton stage the dequantized weights through shared memory shows as two more a pair (10 at 4
    # bits). Its 16-bit pair path (one LOP3 and one HFMA2 for two weights, the weights as the MMA's A operand)
    # stays near 2.5 instructions a weight at 4 bits per channel on sm_90 (6.9 with a float conversion a weight
    # and the weights as the B operand, the kernel before it)
    sixteen = [r for r in rows if r["kernel"] == "gemv" and r["config"].startswith("16x") and r["aligned"]]
    assert sixteen and all(r["loop"]["barriers"] <= 2 for r in sixteen if "GROUP=0 " in r["variant"]), \
        [r["loop"] for r in sixteen]
    g128 = [r["loop"]["barriers"] for r in sixteen if "BITS=4 " in r["variant"] and "GROUP=128 " in r["variant"]]
    assert g128 and max(g128) <= 4, g128
    pairs4 = [r["loop"]["per_weight"] for r in sixteen if "BITS=4 " in r["variant"] and "GROUP=0 " in r["variant"]
              and r["target"] == "sm_90" and "FAST=True" in r["variant"]]
    assert pairs4 and max(pairs4) <= 3.0, pairs4
    assert all(r["tensor_cores"] for r in rows if r["needs_tensor_cores"])
    assert summary["failed"] == 0 and summary["max_shared"]["sm_90"] <= aot.LIMITS[90]


def test_an_oversized_configuration_is_caught():
    """The check is not vacuous: a deliberately oversized tile fails it on the A100 (and is refused)."""
    ce = {**aot._planes(4), "HAS_BIAS": True, "ATOMIC": False, "BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 128,
          "DT": "bf16", "GROUP": 0, "UPCAST": False, "PREC": "tf32"}
    v = aot.Variant("wq_gemm", (128, 256, 128, 8, 4), tuple(sorted(ce.items())))
    (row,) = aot.run((80,), jobs=1, only=[v])
    problems = aot.violations(row)
    assert any(p.startswith("shared memory") and "over the sm_80 limit 166,912 B" in p for p in problems), row
    assert row["shared_bytes"] > aot.LIMITS[80]
    assert "FAIL: shared memory" in aot.format_table([row])


def test_violations_name_what_is_wrong():
    base = {"kernel": "wq_gemm", "config": "x", "variant": "v", "target": "sm_90", "cc": 90, "aligned": True,
            "shared_bytes": 1000, "shared_limit": aot.LIMITS[90], "registers": 128, "stack_bytes": 0,
            "spill_stores": 0, "spill_loads": 0, "tensor_cores": True, "needs_tensor_cores": True, "compile_s": 1.0}
    assert aot.violations(base) == []
    assert aot.violations({**base, "spill_stores": 8, "spill_loads": 4}) == ["spills registers (8 B stored, 4 B loaded)"]
    assert aot.violations({**base, "tensor_cores": False}) == ["the GEMM does not use the tensor cores"]
    assert aot.violations({**base, "shared_bytes": 232_449})[0].startswith("shared memory 232,449 B over")
    assert aot.violations({**base, "error": "OutOfResources"})[0].startswith("does not compile")
    assert aot.main(["--targets", "75"]) == 2
