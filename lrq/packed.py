"""Real low-bit storage and a CPU execution path for any method's output.

`PackedLinear` holds what a deployment holds: weights densely bit-packed into int32 words in the
planar layout (lrq.packing.pack_planar; 4-bit = 8 per word, 8-bit = 4 per word, both exactly
compressed-tensors' stream; 3-bit = a 2-bit plane of 16 per word and a 1-bit plane of 32 per word, which
the exporter turns back into the stream), fp16 scales (a checkpoint read back keeps its own) and uint8
zero points per row or group, the static activation range (w8a8) and the scheme. `pack_model` swaps
every QuantLinear (whatever method chose its integers: RTN, GPTQ, AWQ, OmniQuant, LRQ and FlexRound
alike, since their scales are folded) for a PackedLinear, and the weight memory really falls.

CPU execution (no GPU needed):
* weight-only and w4a8: unpack + dequantize to the activation dtype inside forward (no float copy of
  the weight is kept), then the BLAS matmul; w4a8 quantizes activations per token first;
* w8a8: integer arithmetic: the activation is quantized with its static scale, both operands are
  shifted to int8 and multiplied by torch._int_mm (int8 x int8 -> int32); the zero-point terms are
  corrected exactly in the epilogue with row/column sums:
      sum_k (xq_k - az)(wq_k - wz) = sum xa*wa + (128 - wz) sum xa + (128 - az) sum wa + K (128 - az)(128 - wz)
  where xa = xq - 128 and wa = wq - 128 are the int8 operands.
On a GPU the fused kernels of lrq.kernels run instead (weight-only: the dequantize-GEMM; w8a8/w4a8:
the activation-quantization kernel and the int8 tensor-core GEMM), reading the same buffers.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lrq.arch import iter_linears, set_submodule, decoder_blocks
from lrq.packing import pack_planar, planar_words, unpack_planar
from lrq.qlinear import QuantLinear
from lrq.quant import dequantize, n_groups, per_token_fake_quant
from lrq.schemes import Scheme


def _int_mm_available() -> bool:
    """Whether torch._int_mm exists here and is exact over the full int8 range. Without AVX-512 VNNI/AMX
    (an AMD Zen 3, or any CPU at AVX2) oneDNN multiplies u8 x s8 pairs with vpmaddubsw, whose int16 sums
    saturate: products of large activations and weights come out wrong with no error. So the probe uses
    extreme values and a depth like a real layer's, and compares with an exact int64 product."""
    try:
        g = torch.Generator().manual_seed(0)
        a = torch.randint(-128, 128, (33, 576), dtype=torch.int8, generator=g)
        b = torch.randint(-128, 128, (576, 40), dtype=torch.int8, generator=g)
        a[:, :64], b[:64, :] = 127, 127            # the worst case on AVX2: (127 + 128) * 127 * 2 > 32767
        a[0, 64:], b[64:, 0] = -128, -128
        return torch.equal(torch._int_mm(a, b).long(), a.long() @ b.long())
    except Exception:  # noqa: BLE001 - any failure means: use the float path
        return False


_INT_MM = None


def int_mm_ok() -> bool:
    global _INT_MM
    if _INT_MM is None:
        _INT_MM = _int_mm_available()
    return _INT_MM


class PackedLinear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool, scheme: Scheme,
                 quantize_output: bool = False, scale_dtype: torch.dtype = torch.float16,
                 bias_dtype: torch.dtype = torch.float16):
        """`scale_dtype`/`bias_dtype`: fp16 when packing a quantized model (the deployment format, what the GPU
        kernels read); a checkpoint read back (lrq.export.load_compressed) keeps the precision it was saved in, so
        the loaded model computes what the exported one did (and what transformers' load of the same file does)."""
        super().__init__()
        self.in_features, self.out_features, self.scheme = in_features, out_features, scheme
        self.bits, self.group_size = scheme.w_bits, scheme.group_size
        ng = n_groups(in_features, scheme.group_size)
        # the planar layout (lrq.packing.pack_planar): compressed-tensors' stream itself at 2, 4 and 8 bits
        self.register_buffer("weight_packed", torch.zeros(out_features, planar_words(in_features, self.bits),
                                                          dtype=torch.int32))
        self.register_buffer("scale", torch.ones(out_features, ng, dtype=scale_dtype))
        self.register_buffer("zero", torch.zeros(out_features, ng, dtype=torch.uint8))
        self.register_buffer("bias", torch.zeros(out_features, dtype=bias_dtype) if bias else None)
        static = scheme.static_activations
        self.register_buffer("act_scale", torch.ones((), dtype=torch.float32) if static else None)
        self.register_buffer("act_zero", torch.zeros((), dtype=torch.float32) if static else None)
        self.quantize_output = quantize_output and scheme.kv_bits is not None
        self.use_int_mm = True
        self.use_cpu_int4 = True          # torch's CPU int4 GEMM for small M (built on first use)
        self._cpu_int4: tuple[torch.Tensor, torch.Tensor, int] | None = None
        self._scale16: tuple[tuple[int, int], torch.Tensor] | None = None

    @classmethod
    @torch.no_grad()
    def from_quant_linear(cls, q: QuantLinear) -> "PackedLinear":
        if q.scheme.static_activations and not q.act_calibrated:
            raise ValueError("a w8a8 layer must have calibrated static activation scales before packing")
        m = cls(q.in_features, q.out_features, q.bias is not None, q.scheme, q.quantize_output)
        m.weight_packed.copy_(pack_planar(q.qweight, q.bits))
        m.scale.copy_(q.scale.to(torch.float16))
        m.zero.copy_(q.zero.round().clamp(0, 2**q.bits - 1).to(torch.uint8))
        if q.bias is not None:
            m.bias.copy_(q.bias.to(torch.float16))
        if m.act_scale is not None:
            m.act_scale.copy_(q.act_scale.float())
            m.act_zero.copy_(q.act_zero.float())
        return m.to(q.qweight.device)

    # ---- storage ------------------------------------------------------------------------------
    def levels(self) -> torch.Tensor:
        """The unsigned integer levels [out, in] (uint8)."""
        return unpack_planar(self.weight_packed, self.bits, self.in_features)

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize(self.levels(), self.scale, self.zero, self.group_size, dtype)

    def storage_bytes(self) -> int:
        """Bytes held: the packed format plus, once built, the CPU int4 kernel's copy."""
        extra = sum(t.numel() * t.element_size() for t in self._cpu_int4[:2]) if self._cpu_int4 else 0
        return sum(b.numel() * b.element_size() for b in self.buffers()) + extra

    # ---- forward ------------------------------------------------------------------------------
    def _w8a8_int(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1]).float()
        az = self.act_zero
        xq = torch.clamp(torch.round(x2 / self.act_scale) + az, 0, 255)
        xa = (xq - 128).to(torch.int8)
        wa = (self.levels() ^ 128).view(torch.int8)   # q - 128 as int8, one pass
        acc = torch._int_mm(xa, wa.t()).to(torch.float64)   # [M, N] int32 -> exact in fp64
        wz = self.zero[:, 0].double()
        k = self.in_features
        acc += xa.sum(dim=1, dtype=torch.int64).double().unsqueeze(1) * (128 - wz).unsqueeze(0)
        acc += (128 - az.double()) * wa.sum(dim=1, dtype=torch.int64).double().unsqueeze(0)
        acc += k * (128 - az.double()) * (128 - wz).unsqueeze(0)
        y = (acc * (self.act_scale.double() * self.scale[:, 0].double()).unsqueeze(0)).to(x.dtype)
        if self.bias is not None:
            y = y + self.bias.to(x.dtype)
        return y.reshape(*shape[:-1], self.out_features)

    def kernel_scale(self) -> torch.Tensor:
        """The scales as the GPU kernels read them: fp16, the one pointer type their configurations are compiled
        and checked for (lrq.kernels.aot). A model whose scales are float32 (a checkpoint saved with float32
        scales and read back) computes with an fp16 copy on the GPU, made once per device; on the CPU it
        computes with its own scales."""
        if self.scale.dtype == torch.float16:
            return self.scale
        key = (self.scale.data_ptr(), self.scale._version)   # remade whenever the scales move or change
        if self._scale16 is None or self._scale16[0] != key:
            self._scale16 = (key, self.scale.to(torch.float16))
        return self._scale16[1]

    def _int8_gpu(self, x: torch.Tensor) -> torch.Tensor:
        from lrq.kernels.int8_gemm import int8_matmul, weight_sums
        if getattr(self, "_wsum", None) is None or self._wsum.device != x.device:
            self._wsum = weight_sums(self.weight_packed, self.zero, self.bits, self.in_features)
        static = (self.act_scale, self.act_zero) if self.scheme.static_activations else None
        return int8_matmul(x, self.weight_packed, self.kernel_scale(), self.zero, self.bits, self.in_features, self.bias,
                           static, self._wsum)

    CPU_INT4_MAX_M = 64   # beyond this, dequantize + BLAS is faster on the CPU

    def _apply(self, fn, *args, **kwargs):
        self._cpu_int4 = self._scale16 = None   # rebuilt on the new device/dtype when needed
        return super()._apply(fn, *args, **kwargs)

    # Shapes each fast path takes (anything else runs the general path: dequantize + BLAS):
    # * torch's CPU int4 GEMM (`_weight_int4pack_mm_for_cpu`): 4-bit weights, bf16 activations, M <= 64,
    #   N a multiple of 16, and a group size of 32/64/128/256 dividing K and our own groups;
    # * torch._int_mm on the CPU (w8a8): per-channel weights and M > 16 (any K, N);
    # * the GPU kernels (lrq.kernels): any M, N, K, bits 2-8, any group size (masked tiles).
    CPU_INT4_N_MULTIPLE = 16

    def _cpu_int4_group(self) -> int | None:
        """A group size torch's CPU int4 kernel accepts that represents our grouping exactly (every one of
        our groups, the ragged last one included, is a whole number of its groups)."""
        k = self.in_features
        ours = self.group_size or k
        return next((g for g in (256, 128, 64, 32) if k % g == 0 and ours % g == 0), None)

    def _cpu_int4_mm(self, x: torch.Tensor) -> torch.Tensor:
        if self._cpu_int4 is None:
            g = self._cpu_int4_group()
            q = self.levels().to(torch.int32)
            rep = (self.group_size or self.in_features) // g
            s = self.scale.float().repeat_interleave(rep, dim=1)[:, :self.in_features // g]
            z = self.zero.float().repeat_interleave(rep, dim=1)[:, :self.in_features // g]
            # ours: (q - z) * s  =  (q - 8) * s + (8 - z) * s  (torch's kernel: (q - 8) * scale + zero)
            sz = torch.stack([s.t(), ((8 - z) * s).t()], dim=-1).to(torch.bfloat16).contiguous()
            w = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.contiguous(), 2)
            self._cpu_int4 = (w, sz, g)
        w, sz, g = self._cpu_int4
        shape = x.shape
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x.reshape(-1, shape[-1]).contiguous(), w, g, sz)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.reshape(*shape[:-1], self.out_features)

    def _use_cpu_int4(self, x: torch.Tensor) -> bool:
        return (self.use_cpu_int4 and self.bits == 4 and x.device.type == "cpu" and x.dtype == torch.bfloat16
                and x.numel() // x.shape[-1] <= self.CPU_INT4_MAX_M and self.out_features % self.CPU_INT4_N_MULTIPLE == 0
                and self._cpu_int4_group() is not None and hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = self.scheme
        if x.is_cuda and s.a_bits == 8 and self.group_size is None:   # int8 tensor-core GEMM
            y = self._int8_gpu(x)
            return per_token_fake_quant(y, s.kv_bits) if self.quantize_output else y
        if s.static_activations:
            if self.use_int_mm and self.group_size is None and x.reshape(-1, x.shape[-1]).shape[0] > 16 \
                    and x.device.type == "cpu" and int_mm_ok():
                y = self._w8a8_int(x)
            else:
                qmax = 2**s.a_bits - 1
                xq = torch.clamp(torch.round(x.float() / self.act_scale) + self.act_zero, 0, qmax)
                xd = ((xq - self.act_zero) * self.act_scale).to(x.dtype)
                y = F.linear(xd, self.dequantized_weight(x.dtype), None if self.bias is None else self.bias.to(x.dtype))
        else:
            if s.a_bits is not None:
                x = s.activations.quantize(x, s.a_bits)
            if self._use_cpu_int4(x):   # bf16 on the CPU at decode sizes: torch's int4 GEMM (bf16 scales)
                y = self._cpu_int4_mm(x)
            elif x.is_cuda:   # the fused dequantize-GEMM (lrq.kernels.wq_gemm), which dispatches large M itself
                from lrq.kernels.wq_gemm import wq_matmul
                y = wq_matmul(x, self.weight_packed, self.kernel_scale(), self.zero, self.bits, self.group_size,
                              self.in_features, self.bias)
            else:
                y = F.linear(x, self.dequantized_weight(x.dtype),
                             None if self.bias is None else self.bias.to(x.dtype))
        if self.quantize_output:
            y = per_token_fake_quant(y, s.kv_bits)
        return y

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, out={self.out_features}, scheme={self.scheme.name}, "
                f"bits={self.bits}, group={self.group_size}, packed")


@torch.no_grad()
def pack_model(model: nn.Module) -> dict[str, int]:
    """Swap every QuantLinear for a PackedLinear; returns the weight bytes before and after."""
    blocks = decoder_blocks(model)
    before = after = 0
    for i, name, lin in list(iter_linears(model)):
        if isinstance(lin, QuantLinear):
            before += lin.in_features * lin.out_features * 2   # the bf16 weight it replaces
            p = PackedLinear.from_quant_linear(lin)
            after += p.storage_bytes()
            set_submodule(blocks[i], name, p)
    return {"linear_bytes_bf16": before, "linear_bytes_packed": after}
