"""Write a checkpoint with llm-compressor itself, as its users do, for `lrq-bench run --model <folder>` to score.

    python -m bench.studies.llmc_checkpoint --out /tmp/llmc-gptq-w4g64            # here: calibration + the call
    <.venv-llmc>/bin/python bench/studies/llmc_checkpoint.py --worker JOB.json     # what it runs there

The harness side writes the default model's folder and the calibration windows (C4, 32 x 512, the default
sweep's draw) and runs this file under llm-compressor's own environment (`.venv-llmc`, baselines/llmc.py):
`oneshot` with a GPTQModifier on every decoder Linear (lm_head kept), 4-bit symmetric weights in groups of
64 (llm-compressor's W4A16 preset with the group size the default model's 576 and 1,536 columns allow; the
preset's 128 does not divide 576), then `save_pretrained(out, save_compressed=True)`: a compressed-tensors
`pack-quantized` folder, the format vLLM and transformers read. The folder names no reference model of ours:
score it with `--reference-model smollm2-135m`.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def worker(job_path: str) -> int:
    """In llm-compressor's environment: oneshot GPTQ on the given windows, save compressed."""
    import torch
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from llmcompressor import oneshot
    from llmcompressor.modifiers.gptq import GPTQModifier
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer
    job = json.loads(Path(job_path).read_text())
    torch.set_num_threads(int(job.get("threads", 2)))
    model = AutoModelForCausalLM.from_pretrained(job["model_dir"], dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(job["model_dir"])
    ids = load_file(job["calib_path"])["input_ids"].long()
    from datasets import Dataset
    ds = Dataset.from_dict({"input_ids": ids.tolist(), "attention_mask": torch.ones_like(ids).tolist()})
    weights = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=64)
    scheme = QuantizationScheme(targets=["Linear"], weights=weights)
    recipe = GPTQModifier(config_groups={"group_0": scheme}, ignore=["lm_head"], block_size=128,
                          dampening_frac=0.01)
    oneshot(model=model, dataset=ds, recipe=recipe, max_seq_length=ids.shape[1], num_calibration_samples=len(ids))
    model.save_pretrained(job["out"], save_compressed=True)
    tok.save_pretrained(job["out"])
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--out", default="llmc-gptq-w4g64")
    ap.add_argument("--venv", default=str(ROOT / ".venv-llmc"))
    ap.add_argument("--data-dir", default=None)
    args = ap.parse_args(argv)
    if args.worker:
        return worker(args.worker)
    import torch
    from safetensors.torch import save_file

    from baselines.llmc import llmc_python
    from bench.evaluations.data import calibration_set, resolve_data_dir
    from bench.common.models import load_model
    py = llmc_python(args.venv)
    loaded = load_model("smollm2-135m")
    calib = calibration_set(loaded.tokenizer, resolve_data_dir(args.data_dir), "c4", 32, 512, seed=0)
    with tempfile.TemporaryDirectory(prefix="lrq-llmc-ckpt-") as tmp:
        work = Path(tmp)
        loaded.model.save_pretrained(work / "model", safe_serialization=True)
        loaded.tokenizer.save_pretrained(str(work / "model"))
        save_file({"input_ids": calib.input_ids.to(torch.int64).contiguous()}, str(work / "calib.safetensors"))
        job = {"model_dir": str(work / "model"), "calib_path": str(work / "calib.safetensors"),
               "out": str(Path(args.out).resolve()), "threads": torch.get_num_threads()}
        (work / "job.json").write_text(json.dumps(job))
        res = subprocess.run([str(py), str(Path(__file__).resolve()), "--worker", str(work / "job.json")],
                             env={"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "PATH": "/usr/bin:/bin"})
    if res.returncode == 0:
        print(f"llm-compressor checkpoint written to {args.out}; score it with: lrq-bench run --model {args.out} "
              f"--reference-model smollm2-135m")
    return res.returncode


if __name__ == "__main__":
    sys.exit(main())
