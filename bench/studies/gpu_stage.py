"""The paper's regime on a GPU: LRQ and FlexRound on every block of the default model, within a time budget.

    python -m bench.studies.gpu_stage pack                 # here: what the GPU machine needs, in two parcels
    python -m bench.studies.gpu_stage run --budget-s 420   # there (bench/studies/gpu_session.sh calls it)

A lent GPU machine reaches no registry and gets only the working tree plus at most 64 MiB of carried files
per call, while the default model's GGUF file is 98 MB. `pack` writes two parcels under gpu_carry/ (ignored
by git), each below that limit: part-a holds the first half of the GGUF file; part-b the second half, the
calibration windows (C4, in order, 1,024 tokens each: 384 to train on and 32 held out, the
Figure-2 study's default, tokenized here since the data folder does not travel) and the `gguf` wheel
transformers needs to read the file. Two device calls bring them (the machine keeps what an earlier call
left while it stays warm):

    run(command="true", carry=["gpu_carry/part-a"])
    run(command="bash bench/studies/gpu_session.sh", carry=["gpu_carry/part-b"], timeout_s=...)

`run` joins the halves (checking the file's SHA-256), then trains, block after block, LRQ and FlexRound in the
paper's regime (the paper preset: 5,000 steps, batch 2, the authors' learning rates and s1 initialisation,
fp32) with the Figure-2 study (bench/studies/figure2.py: each block on the full-precision chain's inputs, the
calibration and held-out errors recorded every 250 steps): the first, middle and last blocks first, then all
others in order, as many as the budget allows. The results go to $OUT/figure2-gpu/figure2.json after every
(block, method), so a cut run keeps what it finished, and the next GPU session continues from the committed
reports/figure2-gpu/figure2.json: it copies it to $OUT first and the study skips what is there.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CARRY = ROOT / "gpu_carry"
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
TRAIN, HELDOUT, SEQ = 384, 32, 1024


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    return h.hexdigest()


def pack(out: Path = CARRY, data_dir: str | None = None) -> dict:
    """The two parcels (module docstring); returns what they hold."""
    from safetensors.torch import save_file

    from bench.evaluations.data import calibration_set, resolve_data_dir
    from bench.common.models import BUILTINS, _find_builtin_gguf, load_model
    gguf = _find_builtin_gguf(BUILTINS["smollm2-135m"])
    a, b = out / "part-a", out / "part-b"
    for d in (a, b):
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir(parents=True)
    data = gguf.read_bytes()
    half = len(data) // 2
    (a / f"{GGUF}.0").write_bytes(data[:half])
    (b / f"{GGUF}.1").write_bytes(data[half:])
    loaded = load_model("smollm2-135m")
    calib = calibration_set(loaded.tokenizer, resolve_data_dir(data_dir), "c4", TRAIN + HELDOUT, SEQ, seed=0,
                            sampling="sequential")
    save_file({"input_ids": calib.input_ids.to(dtype=__import__("torch").int32).contiguous()},
              str(b / "calibration.safetensors"), metadata={"description": json.dumps(calib.description)})
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(b / "wheels"), "gguf"],
                   check=True)
    manifest = {"gguf": GGUF, "sha256": _sha256(gguf), "bytes": len(data), "calibration": calib.description}
    (b / "manifest.json").write_text(json.dumps(manifest, indent=1))
    sizes = {d.name: sum(f.stat().st_size for f in d.rglob("*") if f.is_file()) for d in (a, b)}
    if max(sizes.values()) > 64 * 2**20:
        raise RuntimeError(f"a parcel exceeds the 64 MiB a device call carries: {sizes}")
    return manifest | {"parcels_bytes": sizes}


def assemble(carry: Path = CARRY) -> tuple[Path, Path]:
    """(the GGUF file, the calibration windows) from the two parcels, checked."""
    a, b = carry / "part-a", carry / "part-b"
    manifest = json.loads((b / "manifest.json").read_text())
    target = carry / "model" / manifest["gguf"]
    if not target.exists() or _sha256(target) != manifest["sha256"]:
        missing = [p for p in (a / f"{manifest['gguf']}.0", b / f"{manifest['gguf']}.1") if not p.exists()]
        if missing:
            raise SystemExit(f"gpu_stage: parcel file(s) missing: {', '.join(map(str, missing))}: carry "
                             f"gpu_carry/part-a in one call and gpu_carry/part-b in the next, while the machine is warm.")
        target.parent.mkdir(parents=True, exist_ok=True)
        with open(target, "wb") as f:
            for p in (a / f"{manifest['gguf']}.0", b / f"{manifest['gguf']}.1"):
                f.write(p.read_bytes())
        if _sha256(target) != manifest["sha256"]:
            raise SystemExit("gpu_stage: the joined GGUF file does not match its SHA-256: carry the parcels again.")
    return target, b / "calibration.safetensors"


def stage(model: str, calib_file: str, out: Path, budget_s: float, device: str, iters: int = 5000, every: int = 250,
          blocks_first: str = "first,middle,last", methods: str = "lrq,flexround", extra: list[str] = ()) -> dict:
    """Figure 2 in the paper's regime on as many blocks as `budget_s` allows: the first, middle and last blocks,
    then every block; results after every (block, method) in out/figure2.json."""
    from bench.studies import figure2
    out.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    common = ["--model", model, "--calib-file", calib_file, "--methods", methods, "--iters", str(iters),
              "--every", str(every), "--device", device, "--out", str(out), *extra]
    for blocks in (blocks_first, "all"):
        left = budget_s - (time.monotonic() - start)
        if left <= 0:
            break
        figure2.main(common + ["--blocks", blocks, "--budget-s", str(left)])
    res = json.loads((out / "figure2.json").read_text()) if (out / "figure2.json").exists() else {"results": {}}
    return {"done": sorted(res["results"]), "seconds": time.monotonic() - start}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("pack")
    p.add_argument("--data-dir", default=None)
    r = sub.add_parser("run")
    r.add_argument("--budget-s", type=float, default=420)
    r.add_argument("--device", default="cuda")
    r.add_argument("--out", default=os.environ.get("OUT", "reports") + "/figure2-gpu")
    r.add_argument("--resume-from", default=str(ROOT / "reports" / "figure2-gpu" / "figure2.json"))
    args = ap.parse_args(argv)
    if args.cmd == "pack":
        print(json.dumps(pack(data_dir=args.data_dir), indent=1))
        return 0
    gguf, calib = assemble()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if Path(args.resume_from).is_file() and not (out / "figure2.json").exists():
        shutil.copy(args.resume_from, out / "figure2.json")     # continue where the last GPU session stopped
    print(json.dumps(stage(str(gguf), str(calib), out, args.budget_s, args.device)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
