"""Does an independent loader understand our export? Quantize the default model, export it in the
compressed-tensors pack-quantized layout (lrq.export), then load the folder with transformers'
compressed-tensors integration in a separate virtual environment (the one bench/studies/crosscheck_llmcompressor.py
creates, which holds compressed-tensors) and compare its logits with ours on the same tokens.

    python -m bench.studies.check_compressed_tensors --data-dir ../shared/data [--schemes w4a16,w8a8] [--method rtn]

Prints one line per scheme and writes a JSON of the figures. The other venv's interpreter is taken from
--llmc-python (default .venv-llmc/bin/python).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

WORKER = r"""
import json, sys, torch
from transformers import AutoModelForCausalLM
folder, ids_path, out_path = sys.argv[1:4]
model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
model.eval()
ids = torch.load(ids_path)
with torch.no_grad():
    logits = model(ids).logits.float()
qc = getattr(model.config, "quantization_config", None)
torch.save({"logits": logits, "loader": type(qc).__name__ if qc is not None else None,
            "modules": sorted({type(m).__name__ for m in model.modules()})}, out_path)
"""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--schemes", default="w4a16,w3a16,w4a8,w8a8,w4a16-g128")
    ap.add_argument("--method", default="rtn")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--data-dir", default=None)
    ap.add_argument("--llmc-python", default=str(Path(__file__).resolve().parents[2] / ".venv-llmc/bin/python"))
    ap.add_argument("--out", default="ct_check.json")
    args = ap.parse_args(argv)

    from bench.evaluations import data as D
    from bench.common.models import load_model
    from lrq.errors import UserError
    from lrq.export import save_compressed
    from lrq.methods import get_method, load_methods
    from lrq.schemes import get_scheme

    if not Path(args.llmc_python).is_file():
        print(f"no interpreter at {args.llmc_python}: create the llm-compressor venv first "
              f"(see README, 'Cross-check against llm-compressor').", file=sys.stderr)
        return 2
    load_methods()
    results = []
    for name in args.schemes.split(","):
        loaded = load_model(args.model)
        model, tok = loaded.model.float(), loaded.tokenizer
        scheme, method = get_scheme(name), get_method(args.method)
        calib = None
        if method.needs_calibration(scheme):
            calib = D.calibration_set(tok, D.resolve_data_dir(args.data_dir), "c4", 32, 512)
        method.quantize(model, scheme, method.config("quick"), calib)
        ids = torch.randint(0, model.config.vocab_size, (2, 64), generator=torch.Generator().manual_seed(0))
        with tempfile.TemporaryDirectory() as tmp:
            folder = Path(tmp) / "export"
            try:
                save_compressed(model, folder, tokenizer=tok, metadata={"method": args.method})
            except UserError as e:   # e.g. a group size that does not divide 576: refused, with the reason
                results.append({"scheme": name, "ok": False, "error": f"not exported: {e}"})
                print(f"{name}: not exported: {e}")
                continue
            with torch.no_grad():
                ours = model(ids).logits.float()     # the packed model that was exported
            torch.save(ids, Path(tmp) / "ids.pt")
            t0 = time.perf_counter()
            proc = subprocess.run([args.llmc_python, "-c", WORKER, str(folder), str(Path(tmp) / "ids.pt"),
                                   str(Path(tmp) / "theirs.pt")], capture_output=True, text=True)
            if proc.returncode != 0:
                results.append({"scheme": name, "ok": False, "error": proc.stderr[-2000:]})
                print(f"{name}: the compressed-tensors loader FAILED:\n{proc.stderr[-2000:]}")
                continue
            theirs = torch.load(Path(tmp) / "theirs.pt")
        diff = (theirs["logits"] - ours).abs()
        rec = {"scheme": name, "ok": True, "max_abs_logit_diff": diff.max().item(),
               "mean_abs_logit_diff": diff.mean().item(), "logit_scale": ours.abs().mean().item(),
               "same_argmax": float((theirs["logits"].argmax(-1) == ours.argmax(-1)).float().mean()),
               "their_loader": theirs["loader"], "their_modules": theirs["modules"],
               "load_s": time.perf_counter() - t0}
        results.append(rec)
        print(f"{name}: max |logit diff| {rec['max_abs_logit_diff']:.3g} (mean {rec['mean_abs_logit_diff']:.3g}, "
              f"mean |logit| {rec['logit_scale']:.3g}), same argmax {rec['same_argmax']:.3f}, "
              f"loader {rec['their_loader']}")
    Path(args.out).write_text(json.dumps({"method": args.method, "model": args.model, "results": results}, indent=2))
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
