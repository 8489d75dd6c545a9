"""Does an independent loader understand our export, and does our own loader give back the exported model?
Quantize a model, export it in the compressed-tensors pack-quantized layout (lrq.export), then load the folder
with transformers' compressed-tensors integration (in a separate process: this venv's interpreter where it has
compressed-tensors, the `export` extra, else the llm-compressor venv that bench/studies/crosscheck_llmcompressor.py
creates) and with `lrq.load`, and compare their logits with the quantized model's on the same tokens (the first
window of WikiText-2, starting with BOS where the model's protocol says so).

    python -m bench.studies.check_compressed_tensors --data-dir ../shared/data [--schemes w4a16,w8a8] [--method rtn]
    python -m bench.studies.check_compressed_tensors --model gemma3-270m --schemes w4a16-g128,w4a16 --out reports/architectures/export-gemma3-270m.json

Prints one line per scheme and writes a JSON of the figures (with the machine and versions).
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
    ap.add_argument("--llmc-python", default=None, help="the interpreter that loads the export with transformers "
                    "(default: this one where compressed-tensors is installed, else .venv-llmc/bin/python)")
    ap.add_argument("--tokens", type=int, default=512, help="WikiText-2 tokens the logits are compared on")
    ap.add_argument("--out", default="ct_check.json")
    args = ap.parse_args(argv)
    if args.llmc_python is None:
        import importlib.util
        args.llmc_python = (sys.executable if importlib.util.find_spec("compressed_tensors")
                            else str(Path(__file__).resolve().parents[2] / ".venv-llmc/bin/python"))

    import lrq
    from bench.common.models import default_bos, load_model
    from bench.common.provenance import hardware
    from bench.evaluations import data as D
    from lrq.errors import UserError
    from lrq.export import save_compressed
    from lrq.methods import get_method, load_methods
    from lrq.schemes import get_scheme

    if not Path(args.llmc_python).is_file():
        print(f"no interpreter at {args.llmc_python}: create the llm-compressor venv first "
              f"(see docs/crosscheck-llmcompressor.md).", file=sys.stderr)
        return 2
    load_methods()
    results = []
    for name in args.schemes.split(","):
        loaded = load_model(args.model)
        model, tok = loaded.model.float(), loaded.tokenizer
        scheme, method = get_scheme(name), get_method(args.method)
        bos = default_bos(tok)
        data_dir = D.resolve_data_dir(args.data_dir)
        calib = None
        if method.needs_calibration(scheme):
            calib = D.calibration_set(tok, data_dir, "c4", 32, 512, bos=bos is not None)
        method.quantize(model, scheme, method.config("quick"), calib)
        text = D.tokenize(tok, D.eval_text("wikitext2", data_dir).text)
        ids = D.with_bos(text, args.tokens, bos)[:args.tokens].unsqueeze(0)
        with torch.no_grad():
            quantized = model(ids).logits.float()   # the method's model (float32 scales), before export
        with tempfile.TemporaryDirectory() as tmp:
            folder = Path(tmp) / "export"
            try:
                save_compressed(model, folder, tokenizer=tok, metadata={"method": args.method})
            except UserError as e:   # e.g. a group size that does not divide 576: refused, with the reason
                results.append({"scheme": name, "ok": False, "error": f"not exported: {e}"})
                print(f"{name}: not exported: {e}")
                continue
            with torch.no_grad():
                ours = model(ids).logits.float()     # the packed model that was exported (fp16 scales)
                again = lrq.load(folder)(ids).logits.float()   # our loader: the file's float32 scales
            torch.save(ids, Path(tmp) / "ids.pt")
            t0 = time.perf_counter()
            proc = subprocess.run([args.llmc_python, "-c", WORKER, str(folder), str(Path(tmp) / "ids.pt"),
                                   str(Path(tmp) / "theirs.pt")], capture_output=True, text=True)
            if proc.returncode != 0:
                results.append({"scheme": name, "ok": False, "error": proc.stderr[-2000:]})
                print(f"{name}: the compressed-tensors loader FAILED:\n{proc.stderr[-2000:]}")
                continue
            theirs = torch.load(Path(tmp) / "theirs.pt")
        diff = (theirs["logits"] - quantized).abs()

        def dmax(a, b):
            return (a - b).abs().max().item()
        rec = {"scheme": name, "ok": True, "tokens": int(ids.shape[1]), "bos": bos is not None,
               "max_abs_logit_diff": diff.max().item(),   # transformers' load against the quantized model
               "mean_abs_logit_diff": diff.mean().item(), "logit_scale": quantized.abs().mean().item(),
               "max_abs_logit": quantized.abs().max().item(),
               "lrq_load_vs_quantized": dmax(again, quantized), "lrq_load_vs_transformers": dmax(again, theirs["logits"]),
               "packed_fp16_vs_quantized": dmax(ours, quantized),
               "same_argmax": float((theirs["logits"].argmax(-1) == quantized.argmax(-1)).float().mean()),
               "their_loader": theirs["loader"], "their_modules": theirs["modules"],
               "load_s": time.perf_counter() - t0}
        results.append(rec)
        print(f"{name}: transformers' load vs the quantized model: max |logit diff| {rec['max_abs_logit_diff']:.3g} "
              f"(mean {rec['mean_abs_logit_diff']:.3g}, max |logit| {rec['max_abs_logit']:.3g}), same argmax "
              f"{rec['same_argmax']:.3f}, loader {rec['their_loader']}; lrq.load vs the quantized model "
              f"{rec['lrq_load_vs_quantized']:.3g}, vs transformers {rec['lrq_load_vs_transformers']:.3g}; "
              f"the packed model (fp16 scales) {rec['packed_fp16_vs_quantized']:.3g}")
    hw = hardware()
    meta = {"method": args.method, "model": args.model, "precision": "fp32", "cpu": hw.get("cpu"),
            "cpu_kind": hw.get("cpu_kind"), "cpu_bf16_flags": hw.get("cpu_bf16_flags"), "torch": torch.__version__,
            "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "results": results}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(meta, indent=2))
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
