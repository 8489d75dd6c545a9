"""Evaluation and calibration text: WikiText-2 (raw test) and C4 (validation sample).

Two routes, tried in order: a data folder (--data-dir or $LRQ_BENCH_DATA, laid out like ../shared/data)
and `datasets.load_dataset` from the Hugging Face hub. When neither works the error names both.

Offline, the C4 validation sample has no train split beside it, so it is split in two disjoint parts:
the first 1100 documents are the perplexity text (as in GPTQ), the rest are the calibration pool.
Online, calibration draws from C4 train shard 0 and perplexity reads validation shard 0, as GPTQ does.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import posixpath
import random
from dataclasses import dataclass
from pathlib import Path

import torch

from bench.common.hashing import file_sha256
from lrq.errors import UserError
from lrq.methods import Calibration

DATA_ENV = "LRQ_BENCH_DATA"
C4_EVAL_DOCS = 1100


class TextReader:
    """How one text is read: rows from its file in the data folder (`local`) or from the hub (`hub`), the
    evaluation text made of them (`eval_text`), and the calibration pool (`calibration`)."""
    fmt = "UTF-8 text"

    def local(self, path: Path) -> list[str]:
        raise NotImplementedError

    def hub(self, part: str) -> list[str]:
        raise NotImplementedError

    def eval_text(self, name: str, rows: list[str], src: str) -> Text:
        raise NotImplementedError

    def calibration(self, rows: list[str], src: str, offline: bool) -> tuple[list[str], str]:
        return rows, src + " (WARNING: the evaluation text itself)"


class WikiText2Reader(TextReader):
    def local(self, path: Path) -> list[str]:
        # Rows as the hub's wikitext-2-raw-v1 test split has them: one per line with its newline kept,
        # blank lines (" \n" in the raw file) as empty rows.
        lines = path.read_text(encoding="utf-8").split("\n")[:-1]
        return ["" if line.strip() == "" else line + "\n" for line in lines]

    def hub(self, part: str) -> list[str]:
        from datasets import load_dataset
        return load_dataset("wikitext", "wikitext-2-raw-v1", split="test")["text"]

    def eval_text(self, name: str, rows: list[str], src: str) -> Text:
        return Text(name, "\n\n".join(rows), src)


class C4Reader(TextReader):
    """Offline the data folder's 2000-document validation sample: the first 1100 documents are the perplexity
    text (GPTQ's), the rest the calibration pool; online the validation and train shards 0."""
    fmt = "gzip of JSON lines with a text field"

    def local(self, path: Path) -> list[str]:
        with gzip.open(path, "rt", encoding="utf-8") as f:
            return [json.loads(line)["text"] for line in f]

    def hub(self, part: str) -> list[str]:
        from datasets import load_dataset
        shard = {"validation": "en/c4-validation.00000-of-00008.json.gz",
                 "train": "en/c4-train.00000-of-01024.json.gz"}[part]
        return load_dataset("allenai/c4", data_files={part: shard}, split=part)["text"]

    def eval_text(self, name: str, rows: list[str], src: str) -> Text:
        return Text(name, " ".join(rows[:C4_EVAL_DOCS]), f"{src}[:{C4_EVAL_DOCS}]")

    def calibration(self, rows: list[str], src: str, offline: bool) -> tuple[list[str], str]:
        return (rows[C4_EVAL_DOCS:], f"{src}[{C4_EVAL_DOCS}:]") if offline else (rows, src)


READERS: dict[str, TextReader] = {"wikitext2": WikiText2Reader(), "c4": C4Reader()}


def _entry(dataset: str):
    from bench.evaluations.evals import PERPLEXITY
    if dataset not in PERPLEXITY:
        raise UserError(f"unknown dataset {dataset!r}: choose from {', '.join(PERPLEXITY)}.")
    return PERPLEXITY[dataset]


@dataclass
class Text:
    dataset: str
    text: str
    source: str


def resolve_data_dir(data_dir: str | os.PathLike | None) -> Path | None:
    """The data folder from the option or the environment; None means 'use the hub'."""
    raw = data_dir if data_dir is not None else os.environ.get(DATA_ENV)
    if raw in (None, ""):
        return None
    p = Path(raw).expanduser()
    if not p.is_dir():
        origin = "--data-dir" if data_dir is not None else f"${DATA_ENV}"
        raise UserError(f"data folder {str(p)!r} (from {origin}) does not exist: point it at a folder laid out "
                        f"like ../shared/data (wikitext2/wiki.test.raw, c4/...), or unset it to read from the hub.")
    return p


def _hub(dataset: str, part: str):
    os.environ.setdefault("HF_HUB_ETAG_TIMEOUT", "10")
    return READERS[_entry(dataset).reader].hub(part)


_ROWS: dict[tuple[str, str], list[str]] = {}


def _read_local(dataset: str, data_dir: Path) -> list[str]:
    entry = _entry(dataset)
    reader = READERS[entry.reader]
    path = data_dir / entry.file
    if not path.is_file():
        raise FileNotFoundError(path)
    verify_file(data_dir, entry.file)
    key = (str(path), file_sha256(path))
    if key in _ROWS:
        return list(_ROWS[key])
    try:
        rows = reader.local(path)
    except (OSError, EOFError, UnicodeDecodeError, ValueError, KeyError, TypeError) as e:
        raise UserError(
            f"cannot read data file {path}: {type(e).__name__}: {str(e)[:200] or 'no detail'}. The file is "
            f"damaged or not in the expected format ({reader.fmt}); "
            f"restore it from its source (see {data_dir / 'SOURCES.md'}) or copy the data folder again.") from None
    if not any(r.strip() for r in rows):   # empty, or only blank lines
        raise UserError(f"data file {path} holds no text: restore it from its source (see {data_dir / 'SOURCES.md'}). "
                        f"Nothing was run.")
    _ROWS[key] = rows
    return list(rows)


def load_rows(dataset: str, data_dir: Path | None, part: str = "validation") -> tuple[list[str], str]:
    """Rows of `dataset` and a description of where they came from."""
    entry = _entry(dataset)
    if data_dir is not None:   # never the hub's text instead: it is not the same text (C4: other documents)
        try:
            return _read_local(dataset, data_dir), f"{data_dir / entry.file}"
        except FileNotFoundError as e:
            raise UserError(
                f"{dataset} data is not available: file {e.args[0]} not found in the data folder {data_dir} "
                f"(--data-dir or ${DATA_ENV}). Restore it (see {data_dir / 'SOURCES.md'}), or leave the data folder "
                f"out to read every text from the Hugging Face hub with datasets.load_dataset. The hub's text is "
                f"not read in its place: it is another text, and its numbers would be another cell's.") from None
    try:
        return list(_hub(dataset, part)), f"hub:{dataset}:{part}"
    except Exception as e:
        why = f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
    raise UserError(f"{dataset} data is not available: no data folder given (--data-dir or ${DATA_ENV}); "
                    f"datasets.load_dataset failed ({why}). Either pass --data-dir (or set ${DATA_ENV}) to a folder "
                    f"holding {entry.file}, or connect to the Hugging Face hub so datasets.load_dataset can fetch it.")


def check_available(datasets: list[str], data_dir: Path | None) -> None:
    """Fail before any model work when a dataset is in neither the data folder nor reachable on the hub, or
    when its local file is damaged (checksum, unreadable): every file is read once here."""
    for ds in datasets:
        load_rows(ds, data_dir)


def eval_text(dataset: str, data_dir: Path | None) -> Text:
    """The text perplexity is measured on, joined as GPTQ does."""
    rows, src = load_rows(dataset, data_dir, "validation")
    return READERS[_entry(dataset).reader].eval_text(dataset, rows, src)


def eval_token_cap(dataset: str) -> int | None:
    """The tokens the dataset's protocol keeps (GPTQ's C4: 256 x 2048); None: the whole text."""
    return _entry(dataset).token_cap


def tokenize(tokenizer, text: str) -> torch.Tensor:
    """1-D token ids of a long text (no special tokens: windows are cut from one stream)."""
    return torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"], dtype=torch.long)


def with_bos(ids: torch.Tensor, seq_len: int, bos: int | None) -> torch.Tensor:
    """The token stream with `bos` before every `seq_len - 1` tokens, so that the non-overlapping windows of
    `seq_len` cut from it each start with BOS followed by the next `seq_len - 1` tokens of the text (the BOS
    position is never scored: a window's targets are its positions 1..L-1). `bos` None: the stream as it is."""
    if bos is None:
        return ids
    step = seq_len - 1
    chunks = [torch.cat([ids.new_tensor([bos]), ids[i:i + step]]) for i in range(0, len(ids), step)]
    return torch.cat(chunks) if chunks else ids


def calibration_pool(dataset: str, data_dir: Path | None) -> Text:
    """The text calibration windows are cut from: C4 documents held apart from the evaluation slice (or, when
    asked, WikiText-2 itself), joined with blank lines."""
    from bench.evaluations.evals import PERPLEXITY
    if dataset not in PERPLEXITY:
        raise UserError(f"unknown calibration dataset {dataset!r}: choose from {', '.join(PERPLEXITY)}.")
    rows, src = load_rows(dataset, data_dir, "validation" if data_dir is not None else "train")
    rows, src = READERS[PERPLEXITY[dataset].reader].calibration(rows, src, data_dir is not None)
    return Text(dataset, "\n\n".join(rows), src)


def calibration_set(tokenizer, data_dir: Path | None, dataset: str = "c4", n_samples: int = 128,
                    seq_len: int = 512, seed: int = 0, sampling: str = "random", bos: bool = False) -> Calibration:
    """Calibration windows [n_samples, seq_len] from a held-apart pool of text, drawn reproducibly.

    The pool is joined with blank lines and cut into non-overlapping windows; `random` picks n of them
    with a seeded permutation, `sequential` takes the first n (the authors' LRQ code takes them in order).
    `bos`: every window starts with the tokenizer's BOS (`with_bos`), as the model's evaluation windows do.
    """
    pool = calibration_pool(dataset, data_dir)
    src = pool.source
    ids = tokenize(tokenizer, pool.text)
    if bos:
        ids = with_bos(ids, seq_len, tokenizer.bos_token_id)
    n_windows = len(ids) // seq_len
    if n_samples > n_windows:
        raise UserError(f"the calibration pool ({src}) holds {len(ids)} tokens, only {n_windows} windows of "
                        f"{seq_len}; asked for {n_samples}. Use fewer samples (--calib-samples) or shorter "
                        f"windows (--calib-seq-len).")
    if sampling == "random":
        order = list(range(n_windows))
        random.Random(seed).shuffle(order)
        picks = sorted(order[:n_samples])
    elif sampling == "sequential":
        picks = list(range(n_samples))
    else:
        raise UserError(f"unknown calibration sampling {sampling!r}: choose random or sequential.")
    windows = torch.stack([ids[i * seq_len:(i + 1) * seq_len] for i in picks])
    digest = hashlib.sha256(windows.numpy().tobytes()).hexdigest()[:16]
    return Calibration(windows, {"dataset": dataset, "source": src, "n_samples": n_samples, "seq_len": seq_len,
                                 "seed": seed, "sampling": sampling, "tokens_sha256": digest}
                       | ({"bos": True} if bos else {}), tokenizer)


def data_fingerprint(dataset: str, data_dir: Path | None) -> str:
    """Identifies the text a number was computed on (sha256 of the local file, or the hub route)."""
    if data_dir is not None and (data_dir / _entry(dataset).file).is_file():
        return "sha256:" + file_sha256(data_dir / _entry(dataset).file)
    return f"hub:{dataset}"


def _checksums(data_dir: Path) -> dict[str, str]:
    """The data folder's SHA256SUMS (relative path -> hex digest), or {} when it has none."""
    path = data_dir / "SHA256SUMS"
    if not path.is_file():
        return {}
    out = {}
    try:
        for line in path.read_text(encoding="utf-8").splitlines():
            parts = line.strip().split(None, 1)
            if len(parts) == 2 and len(parts[0]) == 64:   # `sha256sum` writes "./wikitext2/..." when asked so
                out[posixpath.normpath(parts[1].lstrip("*").strip())] = parts[0].lower()
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"cannot read {path} ({e}): restore the data folder's checksum file.") from None
    return out


def verify_file(data_dir: Path, rel: str) -> Path:
    """The data file `rel`, checked against the folder's SHA256SUMS when it lists the file (hashed once per
    file version, bench.common.hashing). A mismatch is bad input: the file is damaged or not the one documented."""
    path = data_dir / rel
    sums = _checksums(data_dir)
    expected = sums.get(posixpath.normpath(rel))
    if expected is not None and path.is_file():
        actual = file_sha256(path)
        if actual != expected:
            raise UserError(
                f"data file {path} does not match {data_dir / 'SHA256SUMS'}: sha256 {actual[:16]}... instead of "
                f"{expected[:16]}... ({path.stat().st_size:,} bytes). The file is damaged (cut short, edited or "
                f"replaced); restore it from its source (see {data_dir / 'SOURCES.md'}) or copy the data folder "
                f"again. Nothing was computed from it.")
    return path
