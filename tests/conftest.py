"""Shared fixtures: tiny random Llama/Qwen2 models built in memory, a tiny model folder with a real
(trained-here) tokenizer, and the data folder at ../shared/data."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
SHARED_DATA = (ROOT.parent / "shared" / "data").resolve()

# Never wait on an unreachable hub in tests; point data at the shared folder unless told otherwise.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
if SHARED_DATA.is_dir():
    os.environ.setdefault("LRQ_BENCH_DATA", str(SHARED_DATA))
os.environ.setdefault("TRITON_INTERPRET", "1")
# Tiny models gain nothing from threads and lose a lot when the machine is shared; the real-model test
# asks for more itself.
torch.set_num_threads(1)


def cache_with_measurements(cache: Path) -> Path:
    """A fresh cache folder holding this machine's measurements (the planner's profiles and the process baseline,
    bench.run.plan.MEASUREMENT_FILES), so that a subprocess run does not spend its first seconds measuring the
    machine again."""
    import shutil

    from bench.common.cache import cache_root
    from bench.run.plan import MEASUREMENT_FILES
    cache.mkdir(parents=True, exist_ok=True)
    for pattern in MEASUREMENT_FILES:
        for p in cache_root().glob(pattern):
            shutil.copy(p, cache / p.name)
    return cache


def tiny_config(arch: str = "llama", vocab_size: int = 128, hidden: int = 64, layers: int = 2):
    """Tiny random configs: llama; qwen2 (q/k/v biases); qwen2-sliding (full attention in layer 0, an 8-token
    sliding window from layer 1 on); mistral with an 8-token sliding window; gemma3 with sliding (8 tokens,
    rotary base 1e4) and full-attention (1e6) layers alternating from a sliding one, q/k norms, pre/post
    feed-forward norms, (1 + weight) RMSNorm, GeGLU, head_dim 32 apart from hidden / heads, tied and scaled
    embeddings; qwen3 (q/k norms per head)."""
    from transformers import Gemma3TextConfig, LlamaConfig, MistralConfig, Qwen2Config
    common = dict(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden + 32,
                  num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=512, tie_word_embeddings=False)
    if arch == "llama":
        return LlamaConfig(**common)
    if arch == "qwen2":
        return Qwen2Config(**common)
    if arch == "qwen2-sliding":
        return Qwen2Config(**common, use_sliding_window=True, sliding_window=8, max_window_layers=1)
    if arch == "mistral":
        return MistralConfig(**common, sliding_window=8)
    if arch == "qwen3":   # per-head q/k RMSNorm
        from transformers import Qwen3Config
        return Qwen3Config(**common, head_dim=16)
    if arch == "gemma3":
        return Gemma3TextConfig(**(common | {"tie_word_embeddings": True}), head_dim=32, sliding_window=8,
                                layer_types=[("sliding_attention", "full_attention")[i % 2] for i in range(layers)])
    raise ValueError(arch)


def onednn_bf16_prepack() -> bool:
    """Whether this torch's oneDNN lays a bf16 linear weight out for its own kernels here (the speed study's
    "dense bf16 [oneDNN prepacked]"): not on a CPU without AVX512-BF16-capable oneDNN paths (an AMD Zen 3, or an
    AVX-512 CPU held to AVX2), where torch refuses the reorder and the study leaves that candidate out, saying why."""
    from lrq.cpu_kernels import OneDNNOperand   # the reorder the study's PrepackedLinear makes
    try:
        OneDNNOperand.reorder("bf16", torch.zeros(32, 32, dtype=torch.bfloat16), 4)
    except (RuntimeError, AttributeError):
        return False
    return True


def tiny_model(arch: str = "llama", seed: int = 0, **kw):
    from transformers import AutoModelForCausalLM
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(arch, **kw), dtype=torch.float32).eval()
    # Random init gives near-uniform outputs; larger weights make quantization error visible.
    with torch.no_grad():
        for n, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0, 0.08)
    return model


def random_calibration(n: int = 4, t: int = 16):
    """A stand-in calibration set (random token ids) for the schemes with static activations."""
    from types import SimpleNamespace
    ids = torch.randint(0, 128, (n, t), generator=torch.Generator().manual_seed(1))
    return SimpleNamespace(input_ids=ids, attention_mask=torch.ones_like(ids))


@pytest.fixture(params=["llama", "qwen2"])
def arch(request):
    return request.param


@pytest.fixture(scope="session")
def data_dir() -> Path:
    if not SHARED_DATA.is_dir():
        pytest.fail(f"the shared data folder {SHARED_DATA} is missing: tests need ../shared/data beside the repo")
    return SHARED_DATA


def _train_tokenizer(vocab_size: int = 384):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    text = (SHARED_DATA / "wikitext2" / "wiki.valid.raw").read_text(encoding="utf-8")[:200_000]
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(text.split("\n"), trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", bos_token="<|endoftext|>")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, data_dir):
    """A saved tiny Llama with a real byte-level BPE tokenizer: loadable by path like any HF model."""
    d = tmp_path_factory.mktemp("tiny-llama")
    tok = _train_tokenizer()
    model = tiny_model("llama", vocab_size=len(tok), hidden=64, layers=2)
    model.save_pretrained(d)
    tok.save_pretrained(d)
    return d
