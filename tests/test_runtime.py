"""The lean generation runtime (lrq.runtime) computes what the model's own forward computes."""

import pytest
import torch

from lrq.errors import UserError
from lrq.methods import get_method, load_methods
from lrq.packed import pack_model
from lrq.runtime import LeanDecoder, lean_support
from lrq.schemes import get_scheme
from conftest import random_calibration, tiny_config, tiny_model

load_methods()


def _qwen3(seed: int = 0):
    from transformers import AutoModelForCausalLM, Qwen3Config
    torch.manual_seed(seed)
    cfg = Qwen3Config(**{k: v for k, v in tiny_config("llama").to_dict().items()
                         if k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                                  "num_attention_heads", "num_key_value_heads", "max_position_embeddings")},
                      head_dim=24, tie_word_embeddings=False)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.08)
    return model


def _model(arch: str):
    return _qwen3() if arch == "qwen3" else tiny_model(arch)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_prefill_chunks_and_decode_steps_give_the_models_logits(arch):
    model = _model(arch)
    ids = torch.randint(0, 128, (2, 14), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = model(ids).logits
    lean = LeanDecoder(model, max_len=32, batch=2)
    got = [lean.forward(ids[:, :6], keep=6),         # from an empty cache: causal
           lean.forward(ids[:, 6:11], keep=5)]       # a chunk after cached tokens: the offset mask
    got += [lean.forward(ids[:, j:j + 1]) for j in range(11, 14)]   # one token at a time
    torch.testing.assert_close(torch.cat(got, dim=1), ref, rtol=1e-4, atol=1e-4)
    assert lean.length == 14
    lean.reset()
    torch.testing.assert_close(lean.forward(ids, keep=1), ref[:, -1:], rtol=1e-4, atol=1e-4)


def test_greedy_tokens_equal_the_models_own_greedy_loop():
    model = tiny_model("llama", seed=3)
    prompt = torch.randint(0, 128, (1, 9), generator=torch.Generator().manual_seed(2))
    seq = prompt
    with torch.no_grad():
        for _ in range(12):
            seq = torch.cat([seq, model(seq).logits[:, -1:].argmax(-1)], dim=1)
    assert torch.equal(LeanDecoder(model, 32).greedy(prompt, 12), seq[:, 9:])


@pytest.mark.parametrize("scheme", ["w4a16-g128", "w4a8", "w8a16"])
def test_a_packed_model_runs_its_packed_layers_through_the_lean_runtime(scheme):
    model = tiny_model("llama", hidden=192)
    rtn = get_method("rtn")
    rtn.quantize(model, get_scheme(scheme), rtn.config("quick"), None)
    pack_model(model)
    ids = torch.randint(0, 128, (1, 20), generator=torch.Generator().manual_seed(4))
    calls = []
    for m in model.modules():
        if type(m).__name__ == "PackedLinear":
            m.register_forward_hook(lambda *a: calls.append(1))
    with torch.no_grad():   # the model's own prefill and decode step (its cache): the kernels the lean steps run
        first = model(ids[:, :19], use_cache=True)
        ref = model(ids[:, 19:], cache=first.cache).logits[:, -1:]
    n_hf = len(calls)
    lean = LeanDecoder(model, 32)
    lean.fused = False   # its modules at every step (the fused C layer: test_fused_layers_*)
    torch.testing.assert_close(lean.forward(ids[:, :19]).float()[:, -1:], first.logits[:, -1:], rtol=1e-4, atol=1e-4)
    got = lean.forward(ids[:, 19:])
    if get_scheme(scheme).a_bits is None:
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
    else:   # the runtimes' float rounding (attention, norms: ~1e-6) can move an activation across a rounding
        # boundary of its 8-bit grid (measured: the lean step a level apart at one gate input, 1 % of the logits)
        assert (got - ref).abs().max() <= 0.03 * ref.abs().max() and torch.equal(got.argmax(-1), ref.argmax(-1))
    assert len(calls) == 4 * n_hf // 2   # every packed layer ran in each of the four forwards (two of them lean)


def test_bf16_model_agrees_within_bf16_rounding():
    model = tiny_model("llama", seed=5).to(torch.bfloat16)
    ids = torch.randint(0, 128, (1, 16), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        ref = model(ids).logits[:, -1:].float()
    got = LeanDecoder(model, 16).forward(ids).float()
    assert got.dtype == ref.dtype and (got - ref).abs().max() <= 0.02 * ref.abs().max()


def test_what_it_cannot_run_is_refused_with_the_reason():
    assert "gemma3_text" in lean_support(tiny_model("gemma3"), 16)
    mistral = tiny_model("mistral")   # an 8-token sliding window
    assert lean_support(mistral, 8) is None
    with pytest.raises(UserError, match="sliding window \\(8\\).*--runtime hf"):
        LeanDecoder(mistral, 64)
    dyn = tiny_model("llama")
    dyn.config.rope_parameters = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
    assert "changes with the length" in lean_support(dyn, 16)
    lean = LeanDecoder(tiny_model("llama"), 8)
    with pytest.raises(UserError, match="exceed the lean cache's 8"):
        lean.forward(torch.zeros(1, 9, dtype=torch.long))
    with pytest.raises(UserError, match="batch 1, got 2"):
        lean.forward(torch.zeros(2, 3, dtype=torch.long))


def test_decode_steps_run_without_onednn_and_restore_it():
    """One-token steps run with oneDNN off (its bf16 matrix-vector product is the slower one), prefill with it as
    the process had it; the setting is restored after each step, an error included; onednn_decode keeps it."""
    model = tiny_model("llama", seed=7).to(torch.bfloat16)
    seen = []
    model.lm_head.register_forward_hook(lambda *a: seen.append(torch.backends.mkldnn.enabled))
    lean = LeanDecoder(model, 16)
    lean.fused = False   # the head as a module at every step (fused steps run it in C)
    before = torch.backends.mkldnn.enabled
    lean.forward(torch.arange(4)[None])
    lean.forward(torch.tensor([[5]]))
    lean.onednn_decode = True
    lean.forward(torch.tensor([[6]]))
    assert seen == [before, False, before] and torch.backends.mkldnn.enabled == before
    with pytest.raises(UserError):
        lean.forward(torch.arange(20)[None])
    assert torch.backends.mkldnn.enabled == before


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_norms_and_attention_equal_torchs(arch, dtype):
    """One-token steps through lrq.native's RMSNorm and attention kernels (Qwen3's per-head q/k norms included)
    give torch's logits: float32 to float rounding, bf16 within its rounding; several steps, so the cache they
    read grows."""
    from lrq import native
    assert native.library() is not None, native.status()
    model = tiny_model(arch, seed=11).to(dtype)
    ids = torch.randint(0, 128, (1, 12), generator=torch.Generator().manual_seed(12))
    outs = []
    for use in (True, False):
        lean = LeanDecoder(model, 16)
        assert (lean._lib is not None) is True
        lean._lib = lean._lib if use else None
        lean.forward(ids[:, :8])
        outs.append(torch.cat([lean.forward(ids[:, j:j + 1]).float() for j in range(8, 12)], dim=1))
    tol = 1e-5 if dtype == torch.float32 else 3e-2 * outs[1].abs().max().item()
    assert (outs[0] - outs[1]).abs().max().item() <= tol


def _packed_tiny(arch: str, scheme: str | None, dtype: torch.dtype):
    """A tiny model of `arch` (hidden 192; Qwen3's own config), RTN-quantized and packed under `scheme` (None: dense),
    cast to `dtype`."""
    model = _qwen3() if arch == "qwen3" else tiny_model(arch, hidden=192)
    if scheme:
        rtn = get_method("rtn")
        rtn.quantize(model, get_scheme(scheme), rtn.config("quick"),
                     random_calibration() if get_scheme(scheme).static_activations else None)
        pack_model(model)
    return model.to(dtype)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scheme", [None, "w4a16", "w4a8", "w8a8", "w8a16"])
def test_fused_layers_give_the_module_paths_logits(arch, dtype, scheme):
    """A one-token step with each decoder layer in one lrq.native call (lrq_decoder_layer_step) gives the logits
    of the same step through the modules: packed layers run the same C kernels with the same roundings (bf16: every
    bit, the few ulps of float32 otherwise), dense layers lrq's GEMV (float rounding). Every layer is fused (w8a16's
    int8 weight-only form too) and the greedy tokens agree over several steps, so the cache the fused layers write
    is the one the next step reads."""
    from lrq import native
    assert native.library() is not None, native.status()
    model = _packed_tiny(arch, scheme, dtype)
    ids = torch.randint(0, 128, (1, 8), generator=torch.Generator().manual_seed(4))
    outs, tokens = [], []
    for fused in (True, False):
        lean = LeanDecoder(model, 32)
        lean.fused = fused
        nxt, steps, toks = lean.forward(ids)[:, -1:].argmax(-1), [], []
        for _ in range(6):
            logits = lean.forward(nxt)
            steps.append(logits.float())
            nxt = logits[:, -1:].argmax(-1)
            toks.append(nxt)
        if fused:
            n_fused = sum(f is not None for f in lean._fused)
            assert n_fused == len(lean.layers)
        outs.append(torch.cat(steps, 1))
        tokens.append(torch.cat(toks, 1))
    a, b = outs
    if scheme and dtype == torch.bfloat16:
        assert torch.equal(a, b)
    else:
        assert (a - b).abs().max() <= (1e-5 if dtype == torch.float32 else 2e-2) * b.abs().max()
    assert torch.equal(tokens[0], tokens[1])


def test_float32_i16_decode_reaches_the_fused_layers():
    """float32_decode "i16" set on a model whose fused layers were already made reaches them at once (their kernel
    structs are updated in place): the fused step gives the module path's i16 logits, within the 16-bit rounding of
    the exact ones and the same greedy tokens; where this build has an integer kernel for the packing they differ from
    the exact logits (it ran), and "exact" gives those back bit for bit."""
    from lrq.cpu_kernels import int4_form
    from lrq.packed import PackedLinear, set_float32_decode
    from tests.test_native import _integer_blocks
    model = _packed_tiny("llama", "w4a16", torch.float32)
    ids = torch.randint(0, 128, (1, 8), generator=torch.Generator().manual_seed(4))
    lean = LeanDecoder(model, 32)

    def run(fused: bool) -> tuple[torch.Tensor, torch.Tensor]:
        lean.fused = fused
        lean.length = 0                        # a new sequence, the fused layers' arguments kept
        nxt, steps, toks = lean.forward(ids)[:, -1:].argmax(-1), [], []
        for _ in range(4):
            logits = lean.forward(nxt)
            steps.append(logits.float())
            nxt = logits[:, -1:].argmax(-1)
            toks.append(nxt)
        return torch.cat(steps, 1), torch.cat(toks, 1)

    exact, exact_tokens = run(True)
    made = lean._fused
    assert all(f is not None for f in made)
    assert set_float32_decode(model, "i16") > 0
    structs = [part[1][0][0] for f in made for part in f[1][1]]   # each fused linear's int4_layer, before any call
    assert structs and all(st.x16 == 1 for st in structs)
    fused, fused_tokens = run(True)
    assert lean._fused is made                 # the same fused structs, made before the mode changed
    modules, _ = run(False)
    assert (fused - modules).abs().max() <= 1e-5 * modules.abs().max()
    assert (fused - exact).abs().max() <= 1e-3 * exact.abs().max() and torch.equal(fused_tokens, exact_tokens)
    w = int4_form(next(m for m in model.modules() if isinstance(m, PackedLinear)).cpu_weights)
    assert torch.equal(fused, exact) == (_integer_blocks(w) == 0)
    set_float32_decode(model, "exact")
    assert torch.equal(run(True)[0], exact)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scheme", [None, "w4a16", "w8a8"])
def test_prefill_rows_through_native_kernels_give_torchs_logits(arch, dtype, scheme, monkeypatch):
    """A prefill (several tokens, batch 1 and 2) with each residual add, the norm after it, the MLP's SiLU product
    and (batch 1) RoPE with the cache write as lrq.native row kernels (LeanDecoder.rows_native) gives the logits of
    torch's operations for them: float32 to float rounding, bf16 (and W8A8's activation levels) within its rounding;
    the kernels ran (two norms a layer, four with Qwen3's q/k norms, a SiLU product and a RoPE call, the last
    residual added), decode steps after it agree, and the greedy tokens are the same."""
    import lrq.runtime as R
    from lrq import native
    assert native.library() is not None, native.status()
    model = _packed_tiny(arch, scheme, dtype)
    calls = []
    real = R._native
    monkeypatch.setattr(R, "_native", lambda name, fn, *a: calls.append(name) or real(name, fn, *a))
    for batch in (1, 2):
        ids = torch.randint(0, 128, (batch, 10), generator=torch.Generator().manual_seed(7))
        outs, tokens = [], []
        for rows in (True, False):
            lean = LeanDecoder(model, 32, batch=batch)
            lean.rows_native = rows
            calls.clear()
            logits = lean.forward(ids, keep=10).float()
            n_layers, norms = len(lean.layers), 4 if lean.qk_norm else 2   # Qwen3's q/k norms too
            assert calls.count("rms_norm_rows") == (norms * n_layers + 1 if rows else 0)
            assert calls.count("silu_mul") == (n_layers if rows else 0)
            assert calls.count("rope_cache_rows") == (n_layers if rows and batch == 1 else 0)
            steps = [logits]
            nxt = logits[:, -1:].argmax(-1)
            toks = [nxt]
            for _ in range(3):
                step = lean.forward(nxt).float()
                steps.append(step)
                nxt = step[:, -1:].argmax(-1)
                toks.append(nxt)
            outs.append(torch.cat(steps, 1))
            tokens.append(torch.cat(toks, 1))
        a, b = outs
        # W8A8's static grid: a norm output one float32 ulp apart may sit on the other side of a level's edge
        exact = dtype == torch.float32 and scheme != "w8a8"
        assert (a - b).abs().max() <= (1e-5 if exact else 3e-2) * b.abs().max()
        assert torch.equal(tokens[0], tokens[1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 48])
def test_rope_cache_rows_are_torchs_rope_and_cache_write(dtype, head_dim):
    """lrq_rope_cache_rows (a prefill's RoPE and cache write, batch 1) gives what torch's operations gave on that
    path (x cos rounded, then r sin' added in one fused multiply-add: bit for bit against torch 2.13's AVX-512
    kernels on the Intel Xeon it was written on; here within the rounding a build that does not fuse would differ
    by): q roped in place, k roped into the key cache and v copied (exactly) into the value cache at the tokens'
    positions (here 5..41 of a cache of 64), nothing else written; head_dim 64 takes the AVX-512 lanes where built,
    48 (half not a multiple of 16) the plain loop; one and two threads."""
    from lrq import native
    from transformers import LlamaConfig, LlamaForCausalLM
    lib = native.library()
    assert lib is not None, native.status()
    cfg = LlamaConfig(vocab_size=64, hidden_size=4 * head_dim, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim, max_position_embeddings=64)
    lean = LeanDecoder(LlamaForCausalLM(cfg).to(dtype).eval(), 64)
    t, start, g = 37, 5, torch.Generator().manual_seed(8)
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            q, k, v = (torch.randn(1, t, h, head_dim, generator=g).to(dtype) for h in (4, 2, 2))
            cos, sin = lean.cos[start:start + t, None], lean.sin[start:start + t, None]
            want_q, want_k = lean._rope(q, cos, sin), lean._rope(k, cos, sin)
            kc, vc = lean.k_layers[0], lean.v_layers[0]
            kc.fill_(7)
            vc.fill_(7)
            rc = lib.lrq_rope_cache_rows(q.data_ptr(), k.data_ptr(), v.data_ptr(), lean.cos.data_ptr(),
                                         lean.sin.data_ptr(), kc.data_ptr(), vc.data_ptr(), kc.stride(1), start, t,
                                         4, 2, head_dim, dtype == torch.bfloat16, n)
            assert rc == 0
            for got, want in ((q, want_q), (kc[0, :, start:start + t], want_k[0].transpose(0, 1))):
                if dtype == torch.float32:   # torch's own build may or may not fuse its addcmul's multiply-add
                    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
                else:
                    ulps = (got.contiguous().view(torch.int16).int() - want.contiguous().view(torch.int16).int()).abs()
                    assert ulps.max() <= 1 and (got == want).float().mean() >= 0.99
            assert torch.equal(vc[0, :, start:start + t], v[0].transpose(0, 1))
            outside = torch.cat([kc[0, :, :start], kc[0, :, start + t:], vc[0, :, :start], vc[0, :, start + t:]], 1)
            assert (outside == 7).all()
    finally:
        torch.set_num_threads(threads)


def test_fused_layers_are_remade_after_reset_and_refuse_bad_arguments():
    """reset() drops the fused layers' arguments (a weight replaced between generations is read afresh; until then
    the old storage is kept alive, never read after it is freed), and a position beyond the cache is refused by the
    C step with an error, not written out of bounds."""
    from lrq import native
    model = tiny_model("llama", hidden=192).to(torch.bfloat16)
    lean = LeanDecoder(model, 16)
    lean.forward(torch.arange(4)[None])
    first = lean.forward(torch.tensor([[5]]))
    assert lean._fused is not None and all(f is not None for f in lean._fused)
    import gc
    down = model.model.layers[0].mlp.down_proj.weight
    down.data = torch.zeros_like(down)   # a new tensor: the old storage stays alive for the fused step
    gc.collect()
    lean.length = 4
    assert torch.equal(lean.forward(torch.tensor([[5]])), first)   # the arguments made before: no dangling read
    lean.reset()
    assert lean._fused is None
    lean.forward(torch.arange(4)[None])
    assert not torch.equal(lean.forward(torch.tensor([[5]])), first)   # made again: the new weight
    x = torch.zeros(1, 1, 192, dtype=torch.bfloat16)
    assert native.library().lrq_decoder_layer_step(lean._fused[0][0], x.data_ptr(), 16, 1) == 1


def test_a_model_off_the_cpu_keeps_torchs_operations():
    """lrq.native reads host memory: a model on another device (here `meta`, as a GPU's would be) never gets the C
    kernels or fused layers, whose pointers would not be host addresses."""
    lean = LeanDecoder(tiny_model("llama").to("meta"), 16)
    assert lean._lib is None
    assert LeanDecoder(tiny_model("llama"), 16)._lib is not None
