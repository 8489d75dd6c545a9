"""Real low-bit storage and a CPU execution path for any method's output.

`PackedLinear` holds what a deployment holds: weights densely bit-packed into int32 words in the
planar layout (lrq.packing.pack_planar; 4-bit = 8 per word, 8-bit = 4 per word, both exactly
compressed-tensors' stream; 3-bit = a 2-bit plane of 16 per word and a 1-bit plane of 32 per word, which
the exporter turns back into the stream), fp16 scales (a checkpoint read back keeps its own) and uint8
zero points per row or group, the static activation range (w8a8) and the scheme. `pack_model` swaps
every QuantLinear (whatever method chose its integers: RTN, GPTQ, AWQ, OmniQuant, LRQ and FlexRound
alike, since their scales are folded) for a PackedLinear, and the weight memory really falls.

CPU execution (no GPU needed): when packed or loaded on the CPU, a PackedLinear converts its weights once into
the layout of the torch CPU kernel for its format (lrq.cpu_kernels) and holds only that: weights of 4 bits or
fewer through the int4 GEMM, 5 to 8 bits through the int8 weight GEMM, W8A8 and W4A8 through torch._int_mm on the
activation levels (per-tensor static or per-token, exactly the grid of the fake-quant path), where this CPU's
torch._int_mm is exact (int_mm_ok); elsewhere their activations are fake-quantized and the weights take the
weight-only kernels. Nothing is unpacked or dequantized at decode; at prefill sizes the weight-only forms
dequantize a transient copy of one layer for the dense GEMM, which is faster there (lrq.cpu_kernels). The planar
words come back (lrq.packing) for the state dict, the export and a move to the GPU.
On a GPU the kernels of lrq.kernels run instead (w8a8/w4a8: the activation-quantization kernel and the int8
tensor-core GEMM, reading the same buffers). Weight-only formats go through the process-wide dispatcher
(lrq.kernels.dispatch.default_dispatcher): per (device, scheme, M, N, K, dtype) it picks the decode GEMV
(lrq.kernels.gemv, M <= 16), the fused GEMM (lrq.kernels.wq_gemm, which reads the planar buffers as they are) or
torch's int4 kernel, measured once on a GPU, by the static rule elsewhere (GEMV at M <= 16, else the GEMM). Each
layer keeps the runners it built (`PackedLinear.runners`): weights converted once per kernel and device, never
per call, remade when a buffer moves or changes (data_ptr / _version, like `kernel_scale`).

Memory: the GEMV (and torch's int4 kernel) read their own layout, so a layer that runs one holds a SECOND copy of
its weights beside the planar words (about the same bytes at 4 and 8 bits, 3.2/3 of them at 3 bits, plus
transposed scales and zero points). The planar words are kept: the GEMM (prefill, M > 16) and the state dict read
them. Runners no call chose are dropped after a measured choice; `runner_bytes()` counts what is held and
`storage_bytes()` includes it. Under CUDA graphs: choose (warm up) every shape before capturing; a captured graph
reads the converted copies, so capture again after changing the weights.
"""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F
from torch import nn

from lrq.arch import iter_linears, set_submodule, decoder_blocks
import lrq.native as native
from lrq.cpu_kernels import (NATIVE_INT8_MAX_M, Int4Int8Weights, Int4Weights, Int8GemmWeights, Int8Weights,  # noqa: F401
                              _int_mm_available, cpu_weights, int4_form, int_mm_ok)
from lrq.errors import UserError
from lrq.packing import pack_planar, planar_words, unpack_planar
from lrq.qlinear import QuantLinear
from lrq.quant import (SCALE_EPS, dequantize, n_groups, per_tensor_fake_quant, per_token_dequantized,
                       per_token_fake_quant, per_token_qparams)
from lrq.schemes import Scheme


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
        self.cpu_weights = None           # the CPU kernel's form of the weights, held instead of weight_packed
        self._static_grid = None          # static activations: their grid in float32, kept between calls
        self._scale16: tuple[tuple[int, int], torch.Tensor] | None = None
        self._kernels: dict | None = None  # weight-only GPU path: {"key", "runners": kernel -> Runner, "chosen"}

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
        m = m.to(q.qweight.device)
        if m.scale.device.type == "cpu":
            m.convert_for_cpu(q.qweight)
        return m

    # ---- storage ------------------------------------------------------------------------------
    def levels(self) -> torch.Tensor:
        """The unsigned integer levels [out, in] (uint8)."""
        if self.cpu_weights is not None:
            return self.cpu_weights.levels()
        return unpack_planar(self.weight_packed, self.bits, self.in_features)

    def planar_words(self) -> torch.Tensor:
        """The planar words (lrq.packing.pack_planar), held or, on the CPU, rebuilt from the kernel's form."""
        return self.weight_packed if self.cpu_weights is None else pack_planar(self.levels(), self.bits)

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize(self.levels(), self.scale, self.zero, self.group_size, dtype)

    def storage_bytes(self) -> int:
        """Bytes held: the buffers, the CPU kernel's form of the weights where it replaced the planar words, and
        the GPU kernels' converted copies (runner_bytes) beside them."""
        held = self.cpu_weights.nbytes() if self.cpu_weights is not None else 0
        return sum(b.numel() * b.element_size() for b in self.buffers()) + held + self.runner_bytes()

    def runner_bytes(self) -> int:
        """Bytes of the weight copies the GPU kernels' runners converted for themselves (a second copy of the
        weights when the GEMV runs; 0 for the GEMM, which reads the planar buffers)."""
        return sum(r.nbytes for r in self.runners.values())

    @property
    def runners(self) -> dict:
        """kernel name -> lrq.kernels.dispatch.Runner, as built for the current buffers (empty before the first GPU
        call or after they moved or changed)."""
        return self._kernels["runners"] if self._kernels is not None and self._kernels["key"] == self._runner_key() \
            else {}

    # ---- the CPU kernels' form ----------------------------------------------------------------
    def integer_activations(self) -> bool:
        """Whether the CPU form multiplies activation levels (torch._int_mm): per-channel weights, activations of
        8 bits or fewer on a grid known as integers (static, or a mode with integer_qparams), and an exact integer
        product: torch's _int_mm where it is exact, else lrq.native's decode kernel (exact on AVX2 too) with an exact
        float32 product at prefill (lrq.cpu_kernels._int_mm)."""
        s = self.scheme
        known = s.a_bits is not None and (s.static_activations or s.activations.integer_qparams is not None)
        return (known and s.a_bits <= 8 and self.group_size is None
                and (int_mm_ok() or native.library() is not None))

    @torch.no_grad()
    def convert_for_cpu(self, levels: torch.Tensor | None = None):
        """Hold the weights in the CPU kernel's layout (lrq.cpu_kernels) instead of the planar words: once, when
        packed or loaded (a module built by hand: at its first CPU forward)."""
        q = self.levels() if levels is None else levels
        self.cpu_weights = cpu_weights(q.cpu(), self.scale, self.zero, self.bits, self.group_size,
                                       self.integer_activations())
        int4 = int4_form(self.cpu_weights)
        if int4 is not None:
            int4.float32_decode = getattr(self, "float32_decode", "exact")
        self._buffers["weight_packed"] = None
        return self.cpu_weights

    def _apply(self, fn, *args, **kwargs):
        self._scale16 = self._static_grid = self._kernels = None
        if self.cpu_weights is None:
            return super()._apply(fn, *args, **kwargs)
        q = self.levels()                  # planar words move (every device reads them); the CPU form is rebuilt
        self._buffers["weight_packed"], self.cpu_weights = pack_planar(q, self.bits), None
        out = super()._apply(fn, *args, **kwargs)
        if self.weight_packed.device.type == "cpu":
            self.convert_for_cpu(q)
        return out

    def __getstate__(self):
        """Pickles and deep copies leave the runners behind (closures over this layer's tensors): remade at first use."""
        return {**self.__dict__, "_kernels": None}

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if self.cpu_weights is not None:   # the portable form, whatever this module holds
            destination[prefix + "weight_packed"] = self.planar_words()

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        self._kernels = None
        if self.cpu_weights is not None and prefix + "weight_packed" in state_dict:   # converted again when run
            self._buffers["weight_packed"] = torch.empty(self.out_features, planar_words(self.in_features, self.bits),
                                                         dtype=torch.int32)
            self.cpu_weights = None
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    # ---- forward ------------------------------------------------------------------------------
    def kernel_scale(self) -> torch.Tensor:
        """The scales as the GPU kernels read them: fp16, the one pointer type their configurations are compiled
        and checked for (lrq.kernels.aot). A model whose scales are float32 (a checkpoint saved with float32
        scales and read back) computes with an fp16 copy on the GPU, made once per device; on the CPU it
        computes with its own scales."""
        if self.scale.dtype == torch.float16:
            return self.scale
        key = _tensor_state(self.scale)   # remade whenever the scales move or change
        if self._scale16 is None or self._scale16[0] != key:
            self._scale16 = (key, self.scale.to(torch.float16))
        return self._scale16[1]

    def _runner_key(self) -> tuple:
        """What the runners were converted from: the buffers' device, storage and version (remade on any change)."""
        return (None if self.weight_packed is None else self.weight_packed.device,
                _tensor_state(self.weight_packed), _tensor_state(self.scale), _tensor_state(self.zero))

    def _runner(self, x: torch.Tensor):
        """The weight-only runner for this call: the kernel this layer chose for (M, dtype), else the process-wide
        dispatcher's choice (measured on a GPU before any capture; see lrq.kernels.dispatch); runners built once."""
        from lrq.kernels import dispatch as D
        key = self._runner_key()
        if self._kernels is None or self._kernels["key"] != key:
            self._kernels = {"key": key, "runners": {}, "chosen": {}}
        runners, chosen = self._kernels["runners"], self._kernels["chosen"]
        m = x.numel() // max(x.shape[-1], 1)
        kernel = chosen.get((m, x.dtype))
        if kernel is None:
            c = D.default_dispatcher().choose(x, self.weight_packed, self.kernel_scale(), self.zero, self.bits,
                                              self.group_size, self.in_features, runners=runners)
            kernel = chosen[(m, x.dtype)] = c.kernel
            for name in [r for r in runners if r not in chosen.values()]:   # built for measuring, not chosen
                del runners[name]
        run = runners.get(kernel)
        if run is None:
            run = runners[kernel] = D.build_runner(kernel, self.weight_packed, self.kernel_scale(), self.zero,
                                                   self.bits, self.group_size, self.in_features)
        return run

    def _int8_gpu(self, x: torch.Tensor) -> torch.Tensor:
        from lrq.kernels.int8_gemm import int8_matmul, weight_sums
        if getattr(self, "_wsum", None) is None or self._wsum.device != x.device:
            self._wsum = weight_sums(self.weight_packed, self.zero, self.bits, self.in_features)
        static = (self.act_scale, self.act_zero) if self.scheme.static_activations else None
        return int8_matmul(x, self.weight_packed, self.kernel_scale(), self.zero, self.bits, self.in_features, self.bias,
                           static, self._wsum)

    def _float_activations(self, x: torch.Tensor) -> torch.Tensor:
        s = self.scheme
        if s.a_bits is None:
            return x
        if s.static_activations:
            return per_tensor_fake_quant(x, self.act_scale, self.act_zero, s.a_bits)
        if self.per_token_dequantized_activations() and not (x.requires_grad and torch.is_grad_enabled()):
            return per_token_dequantized(x, s.a_bits)        # the same values, fewer operations
        return s.activations.quantize(x, s.a_bits)

    def per_token_dequantized_activations(self) -> bool:
        """Whether this layer's float activations (inference) are per_token_dequantized's: a dynamic per-token
        grid (W4A8), the values lrq.native's per-token kernel computes too."""
        s = self.scheme
        return (s.a_bits is not None and not s.static_activations
                and s.activations.integer_qparams is per_token_qparams)

    def _int8_activations(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The activation levels - 128 (int8) on the fake-quant path's grid, their zero point(s) - 128, scale(s)
        (float32; static ones kept, see _static_grid_now) and row sums (float32 [m, 1]: the zero-point correction
        of asymmetric weights, computed once for the linears sharing these levels)."""
        native_rows = self._native_int8_activations(x)
        return self._int8_activations_torch(x) if native_rows is None else native_rows

    def _int8_activations_torch(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """_int8_activations with torch's ops."""
        s, xf = self.scheme, x.float()
        if s.static_activations:
            _, scale, zero, _ = self._static_grid_now()
        else:
            scale, zero = s.activations.integer_qparams(xf, s.a_bits)
            zero = zero - 128
        xq = torch.div(xf, scale).round_().add_(zero).clamp_(-128, 2**s.a_bits - 129).to(torch.int8)
        return xq, zero, scale, xq.sum(dim=1, keepdim=True, dtype=torch.float32)

    def _native_int8_activations(self, x: torch.Tensor, any_build: bool = False) -> tuple[torch.Tensor, ...] | None:
        """_int8_activations' four tensors from one lrq.native call (lrq_int8_activations: the same operations in
        the same order, bit for bit, a test checks), where it is built with AVX-512 (its plain-C loop is slower than
        torch's ops) and takes x (bf16 or float32 rows of unit stride, a static or per_token_qparams grid); else
        None (`any_build`: the plain-C loop too, for the tests)."""
        s, lib = self.scheme, native.library()
        per_token = not s.static_activations
        if (lib is None or not (any_build or lib.lrq_int8_activations_vectorized()) or x.device.type != "cpu"
                or x.dtype not in (torch.bfloat16, torch.float32)
                or x.stride(-1) != 1 or x.shape[0] == 0
                or (per_token and not self.per_token_dequantized_activations())):
            return None
        m, k = x.shape
        xq, rowsum = torch.empty(m, k, dtype=torch.int8), torch.empty(m, 1)
        if per_token:
            zero, scale, grid = torch.empty(m, 1), torch.empty(m, 1), (1.0, 0.0)
        else:
            _, scale, zero, _ = self._static_grid_now()
            grid = (scale.item(), zero.item())
        lib.lrq_int8_activations(x.data_ptr(), x.dtype == torch.bfloat16, x.stride(0), m, k, per_token, s.a_bits,
                                 grid[0], grid[1], SCALE_EPS, xq.data_ptr(), zero.data_ptr() if per_token else None,
                                 scale.data_ptr() if per_token else None, rowsum.data_ptr(),
                                 torch.get_num_threads())
        return xq, zero, scale, rowsum

    def _static_grid_now(self) -> tuple:
        """(key, scale, zero - 128, (scale, zero) as floats) of the calibrated static grid, kept between calls and
        made again when the calibrated range changes."""
        key = (_tensor_state(self.act_scale), _tensor_state(self.act_zero))
        if self._static_grid is None or self._static_grid[0] != key:
            scale, zero = self.act_scale.detach().float().clone(), self.act_zero.detach().float()
            self._static_grid = (key, scale, zero - 128, (scale.item(), zero.item()))
        return self._static_grid

    def _shared(self, x: torch.Tensor, form: str, compute):
        """`compute()`, or what the previous packed layer computed for the very same input tensor (unchanged since:
        same object, same version counter) on the same activation grid (dynamic: same mode and bits; static: the
        same calibrated scale and zero point, as q/k/v and gate/up calibrated on one input have): q/k/v and gate/up
        read one input, so a decode step quantizes it once instead of three and two times. A tensor without a
        version counter (inference mode) is not shared."""
        s = self.scheme
        try:
            version = x._version
        except RuntimeError:   # an inference-mode tensor: nothing says it was not changed in place
            return compute()
        key = (form, s.a_mode, s.a_bits) + (self._static_grid_now()[3] if s.static_activations else ())
        last = _LAST_ACTIVATIONS[0]
        if last is not None and last[0]() is x and last[1] == version and last[2] == key:
            return last[3]
        value = compute()
        _LAST_ACTIVATIONS[0] = (weakref.ref(x), version, key, value)
        return value

    def _forward_cpu(self, x: torch.Tensor) -> torch.Tensor:
        w = self.cpu_weights or self.convert_for_cpu()
        x2 = x.reshape(-1, x.shape[-1])
        if isinstance(w, Int4Int8Weights) and not w.integer_call(x2.shape[0], x.dtype):
            y = w.int4.mm(self._shared(x, "dequantized", lambda: self._float_activations(x2)))
        elif self._native_static(w, x2.shape[0]):
            xr = x2 if x2.dtype in (torch.bfloat16, torch.float32) and x2.stride(-1) == 1 else x2.float().contiguous()
            y = w.native_static_mm(xr, *self.native_static_grid()).to(x.dtype)
        elif isinstance(w, (Int8GemmWeights, Int4Int8Weights)):
            y = w.mm(*self._shared(x, "int8", lambda: self._int8_activations(x2)), out_dtype=x.dtype).to(x.dtype)
        else:
            y = w.mm(self._float_activations(x2))
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.reshape(*x.shape[:-1], self.out_features)

    def _native_static(self, w, m: int) -> bool:
        """Whether a call of m tokens is a W8A8 decode step on a static grid that lrq's own kernel takes whole
        (activation quantization, integer product and corrections in one call; lrq.native)."""
        return (isinstance(w, Int8GemmWeights) and self.scheme.static_activations
                and m <= NATIVE_INT8_MAX_M and native.library() is not None)

    def native_static_grid(self) -> tuple[float, float, float]:
        """(scale, zero point - 128, highest level - 128) of the calibrated static grid, as lrq.native's W8A8
        kernel takes them (Int8GemmWeights.native_static_mm, the lean runtime's fused layers)."""
        _, _, zero, (scale, _) = self._static_grid_now()
        return scale, zero.item(), 2 ** self.scheme.a_bits - 129

    def _forward_gpu(self, x: torch.Tensor) -> torch.Tensor:
        if self.scheme.a_bits == 8 and self.group_size is None:   # int8 tensor-core GEMM
            return self._int8_gpu(x)
        if self.scheme.static_activations:
            return F.linear(self._float_activations(x), self.dequantized_weight(x.dtype),
                            None if self.bias is None else self.bias.to(x.dtype))
        x = self._float_activations(x)
        return self._runner(x)(x, self.bias)   # the dispatcher's kernel (GEMV, GEMM or torch int4), see _runner

    def _one_bf16_token(self, x: torch.Tensor) -> torch.Tensor | None:
        """A bf16 decode step (one token) of a 4-bit layer without integer corrections (weight-only, or W4A8 on its
        dequantized activations): the int4 kernel straight away, the same calls _forward_cpu makes and the same bits (a
        test checks), without its Python around them (about 5 us of a 25 us call). None: take the general path."""
        w = self.cpu_weights
        int4 = int4_form(w)
        if (int4 is None or x.dtype != torch.bfloat16 or self.quantize_output
                or not x.numel() == int4.k == int4.packed.shape[1] * 2 or not x.is_contiguous()):
            return None
        if int4 is w and self.scheme.a_bits is None:
            xq = x.view(1, w.k)
        elif int4 is not w:
            xq = self._shared(x, "dequantized", lambda: self._float_activations(x.view(1, int4.k)))
        else:
            return None
        if int4.native_for(1, torch.bfloat16):
            y = int4.native_mm(xq)
        else:
            y = torch._weight_int4pack_mm_for_cpu(xq, int4.packed, int4.group, int4.scales)
        return self._shortcut_output(y, x, int4.n)

    def _shortcut_output(self, y: torch.Tensor, x: torch.Tensor, n: int) -> torch.Tensor:
        """A shortcut's kernel output [m, n_pad] as the module returns it: n features, the bias added, x's shape."""
        y = y if y.shape[1] == n else y[:, :n]
        return (y if self.bias is None else y + self.bias.to(y.dtype)).view(*x.shape[:-1], n)

    def _amx_prefill(self, x: torch.Tensor) -> torch.Tensor | None:
        """A bf16 prefill call of a 4-bit weight-only layer straight to its AMX tile kernel (Int4Weights._amx_mm),
        the call _forward_cpu would make, without the Python around it (about 10 us of each of a prefill's 210
        calls on SmolLM2-135M). None: take the general path."""
        w = self.cpu_weights
        if (type(w) is not Int4Weights or self.scheme.a_bits is not None or self.quantize_output
                or x.dtype != torch.bfloat16 or not x.is_contiguous() or x.shape[-1] != w.k
                or w.packed.shape[1] * 2 != w.k):
            return None
        m = x.numel() // w.k
        if m < w.dequantize_from(torch.bfloat16) or not w.decodable:
            return None
        y = w._amx_mm(x.view(m, w.k))
        return None if y is None else self._shortcut_output(y, x, w.n)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self._one_bf16_token(x) if self.cpu_weights is not None else None
        if y is not None:
            return y
        y = self._amx_prefill(x) if self.cpu_weights is not None else None
        if y is not None:
            return y
        y = self._forward_cpu(x) if x.device.type == "cpu" else self._forward_gpu(x)
        if self.quantize_output:
            y = per_token_fake_quant(y, self.scheme.kv_bits)
        return y

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, out={self.out_features}, scheme={self.scheme.name}, "
                f"bits={self.bits}, group={self.group_size}, packed")


# (weak reference to the input, its version, (form, activation mode, bits), the quantized activations) of the last
# quantization of activations a packed layer made on the CPU: PackedLinear._shared
_LAST_ACTIVATIONS: list = [None]


def _tensor_state(t: torch.Tensor | None) -> tuple | None:
    """(storage pointer, version counter) of a tensor: what a copy made from it is keyed by, so that the copy is
    remade when the tensor moves or changes in place. An inference-mode tensor has no version counter (nor can it
    change outside inference mode): its pointer alone."""
    if t is None:
        return None
    try:
        return t.data_ptr(), t._version
    except RuntimeError:
        return t.data_ptr(), None


def set_float32_decode(model: nn.Module, mode: str) -> int:
    """How the model's 4-bit CPU layers run a float32 decode step (lrq.cpu_kernels.FLOAT32_DECODE: "exact", the
    default, "bf16" or "i16"); returns how many layers it set."""
    from lrq.cpu_kernels import FLOAT32_DECODE
    if mode not in FLOAT32_DECODE:
        raise UserError(f"float32 decode mode {mode!r}: choose one of {', '.join(FLOAT32_DECODE)}")
    n = 0
    for m in model.modules():
        if isinstance(m, PackedLinear):
            m.float32_decode = mode          # kept when the CPU form is rebuilt (a cast, a move and back)
            w = int4_form(m.cpu_weights)
            if w is not None:
                w.float32_decode, n = mode, n + 1
                if w.native_args is not None:   # its kernel struct (a fused decoder layer's too) reads the new mode
                    w._native_layer()
    return n


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


HEAD_FORMATS = ("int8", "bf16")   # what quantize_head holds an output head in


class PackedEmbedding(nn.Module):
    """The input embedding of a model whose tied output head quantize_head packed: each looked-up row dequantized
    from the head's own int8 levels, (q - z) * s in float32 rounded once to `dtype`, so the one table is held once
    (as llama.cpp holds a tied Q8_0 token embedding). The head is referred to, not a submodule: its buffers are
    counted and saved once."""

    def __init__(self, head: nn.Module, dtype: torch.dtype, padding_idx: int | None = None,
                 embed_scale: torch.Tensor | None = None):
        """`head`: the PackedLinear (TableEmbedding: the TableHead) whose table it reads; `embed_scale`: the factor a
        scaled embedding (Gemma's) multiplies its rows by, in `dtype`, as it does."""
        super().__init__()
        self._head, self.dtype, self.padding_idx = [head], dtype, padding_idx
        self.num_embeddings, self.embedding_dim = head.out_features, head.in_features
        self.embed_scale = None if embed_scale is None else embed_scale.detach().clone()

    @property
    def head(self) -> nn.Module:
        return self._head[0]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        head, k, flat = self.head, self.embedding_dim, ids.reshape(-1)
        if head.cpu_weights is None and head.weight_packed.device.type != "cpu":   # moved to a GPU: the planar words
            rows = head.dequantized_weight(torch.float32)[flat]
        else:
            w = head.cpu_weights or head.convert_for_cpu()
            (levels,) = w.chunks
            rows = levels[flat, :k].float().mul_(w.scales[0, flat, None]).add_(w.zero_term[0, flat, None])
        rows = rows.to(self.dtype)
        if self.embed_scale is not None:
            rows = rows * self.embed_scale.to(self.dtype)
        return rows.view(*ids.shape, k)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, int8 levels of the output head, dtype={self.dtype}"


class TableHead(nn.Module):
    """A float32 model's output head whose weight is held in bf16: lossless for a checkpoint stored in bf16 (every value
    a bf16 value), else each value rounded to bf16 (nearest even, as the dense bf16 model rounds it: quantize_head
    reports how many). Products and sums in float32 on the weight widened exactly:
    several tokens through torch's GEMM on float32 slices of the table (the float32 head's logits bit for bit), up to
    NATIVE_MAX_M through lrq.native's GEMV a token at a time (the sums it makes on the float32 table: the lean
    runtime's decode steps keep their bits; against torch's GEMV, float rounding). Half the bytes a decode step
    streams, half the memory. quantize_head(model, "bf16") makes it."""

    ROWS_A_SLICE = 8192   # a prefill's transient float32 slice of the table (8192 x 576: 19 MB)
    NATIVE_MAX_M = 4      # tokens a call runs through lrq.native's GEMV, one row at a time

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.register_buffer("weight", weight.detach().to(torch.bfloat16).contiguous())
        self.register_buffer("bias", None if bias is None else bias.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.bfloat16:
            return F.linear(x, self.weight, None if self.bias is None else self.bias.to(x.dtype))
        shape, k, n = x.shape[:-1], self.in_features, self.out_features
        rows = x.reshape(-1, k)
        lib = native.library() if x.dtype == torch.float32 and x.device.type == "cpu" else None
        if lib is not None and rows.shape[0] <= self.NATIVE_MAX_M and not (x.requires_grad and torch.is_grad_enabled()):
            y = torch.empty(rows.shape[0], n, dtype=x.dtype)
            rows = rows.contiguous()
            for i in range(rows.shape[0]):
                native.checked(lib.lrq_dense_gemv(self.weight.data_ptr(), rows[i].data_ptr(), y[i].data_ptr(), 2, n,
                                                  k, torch.get_num_threads()), "bf16-held head")
        else:
            y = torch.cat([F.linear(rows, self.weight[c0:c0 + self.ROWS_A_SLICE].to(x.dtype))
                           for c0 in range(0, n, self.ROWS_A_SLICE)], dim=1)
        if self.bias is not None:
            y = y + self.bias.to(x.dtype)
        return y.view(*shape, n)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, weight held in bf16 (lossless)"


class TableEmbedding(PackedEmbedding):
    """The tied input embedding of a TableHead: rows of its bf16 table widened to `dtype` (exact; Gemma's scale as
    PackedEmbedding applies it), so the table is held once."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = F.embedding(ids, self.head.weight).to(self.dtype)
        return rows * self.embed_scale.to(self.dtype) if self.embed_scale is not None else rows

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, the output head's bf16 table, dtype={self.dtype}"


def _hold_table_bf16(model: nn.Module, head: nn.Linear, emb: nn.Module, tied: bool) -> dict[str, int]:
    """quantize_head's "bf16": the head (and a tied embedding) as TableHead / TableEmbedding; `values_rounded` counts
    the values bf16 could not hold (0 for a bf16 checkpoint: lossless)."""
    w = head.weight
    if w.dtype != torch.float32:
        raise UserError(f"quantize_head(model, 'bf16') holds a float32 model's table in bf16; this head is "
                        f"{str(w.dtype).replace('torch.', '')} already")
    table_w = w.bfloat16()
    rounded = int((table_w.float() != w).sum())   # 0 for a bf16 checkpoint
    before = w.numel() * w.element_size()
    table = TableHead(table_w, head.bias)
    model.set_output_embeddings(table)
    if tied:
        scale = getattr(emb, "embed_scale", None)
        model.set_input_embeddings(TableEmbedding(table, emb.weight.dtype, emb.padding_idx,
                                                  None if scale is None else torch.as_tensor(scale)))
    model._lrq_head = "bf16"
    return {"head_bytes": before, "head_bytes_packed": table.weight.numel() * 2, "embedding_shared": int(tied),
            "values_rounded": rounded}


@torch.no_grad()
def quantize_head(model: nn.Module, fmt: str = "int8", share_embedding: bool = True) -> dict[str, int]:
    """Hold the output head as 8-bit levels per output channel (round to nearest on each row's min-max grid, the
    w8a16 scheme's; the CPU form lrq.cpu_kernels.Int8Weights, run by lrq.native's int8 weight-only kernel at decode)
    instead of in the model's dtype. A tied input embedding then reads the same levels (PackedEmbedding), so the table
    is held once at a quarter of float32's bytes or half of bf16's; `share_embedding=False` keeps the embedding's own
    table (the head alone quantized, the table held twice).

    `fmt="bf16"` instead holds a float32 model's head (and tied embedding) in bf16 (TableHead and TableEmbedding,
    half the bytes): lossless for a bf16 checkpoint cast to float32 (the float32 head's logits up to float rounding),
    else the table rounded as the dense bf16 model rounds it (`values_rounded` says how many values changed).

    A deployment choice beside the method, not part of it: every method leaves the head unquantized (METHOD.md) and
    the export (lrq.export, compressed-tensors) ignores lm_head, so a model with a packed head is not exported.
    It changes the logits (and, tied, the embeddings): measure what it costs (bench.studies.speed's `+int8 head`
    candidates, docs/packed-weights-and-export.md). CPU models only. Returns the head's bytes before and after."""
    from lrq.quant import minmax_qparams
    from lrq.schemes import get_scheme
    if fmt not in HEAD_FORMATS:
        raise UserError(f"output head format {fmt!r}: choose one of {', '.join(HEAD_FORMATS)}")
    head, emb = model.get_output_embeddings(), model.get_input_embeddings()
    if isinstance(head, (PackedLinear, TableHead)):
        raise UserError("the output head is already packed (quantize_head ran on this model)")
    if type(head) is not nn.Linear or head.weight.device.type != "cpu":
        raise UserError(f"quantize_head takes a model whose output head is an nn.Linear on the CPU, not "
                        f"{type(head).__name__} on {getattr(getattr(head, 'weight', None), 'device', '?')}")
    before = head.weight.numel() * head.weight.element_size()
    # a tied embedding reads the head's levels where its forward is a plain lookup, or a lookup times its
    # embed_scale (Gemma); any other kind keeps its own table (held as before)
    tied = (share_embedding and isinstance(emb, nn.Embedding) and emb.weight is head.weight and head.bias is None
            and (type(emb) is nn.Embedding or isinstance(getattr(emb, "embed_scale", None), (torch.Tensor, float))))
    if fmt == "bf16":
        return _hold_table_bf16(model, head, emb, tied)
    scheme = get_scheme("w8a16")
    scale, zero = minmax_qparams(head.weight, scheme.w_bits, scheme.group_size)
    packed = PackedLinear.from_quant_linear(QuantLinear.from_linear(head, scheme, scale, zero))
    if not isinstance(packed.cpu_weights, Int8Weights) or not packed.cpu_weights.per_channel:
        raise RuntimeError("quantize_head expected an int8 per-channel CPU form; a bug, please report")
    model.set_output_embeddings(packed)
    if tied:
        scale = getattr(emb, "embed_scale", None)
        model.set_input_embeddings(PackedEmbedding(packed, emb.weight.dtype, emb.padding_idx,
                                                   None if scale is None else torch.as_tensor(scale)))
    model._lrq_head = fmt
    return {"head_bytes": before, "head_bytes_packed": packed.storage_bytes(), "embedding_shared": int(tied)}
