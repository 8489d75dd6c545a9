"""The two architecture checks on a real model (issue U): the block-by-block chain and every fold.

    python -m bench.studies.fold_chain --model gemma3-270m [--tokens 512] [--out reports/architectures]

1. Block chain: the FP hidden states that `lrq.blockwise.walk_blocks` hands each block (the chain every
   block-wise method trains on, each block replayed with its own layer's mask and rotary embeddings) against
   the model's own hidden states (`output_hidden_states`) on the first WikiText-2 window of `--tokens` tokens
   (with BOS where the model's protocol has it): max |difference| / max |hidden state| per layer, in float32.
2. Folds: per pair, `lrq.smooth.fold_error` (a random 0.5-2 scale folded into every block's copy, the largest
   relative change of a block's output), then the whole FP model smoothed as SmoothQuant does (alpha 0.5,
   every pair, calibration maxima from 4 C4 windows of 512) against the unsmoothed model: the largest
   logit difference relative to the largest logit, on the same window.

Writes `<out>/<model>.json` and prints a Markdown summary. Float32 throughout, one thread.
"""

from __future__ import annotations

import argparse
import copy
import json
import time
from pathlib import Path

import torch


@torch.no_grad()
def chain_errors(model, ids: torch.Tensor) -> list[float]:
    from lrq.blockwise import walk_blocks
    real = model(ids, output_hidden_states=True).hidden_states
    seen: list[torch.Tensor] = []
    walk_blocks(model, ids, lambda ctx: seen.append(ctx.q_inputs.data[:].clone()), need_targets=False)
    return [float((x - real[i]).abs().max() / real[i].abs().max()) for i, x in enumerate(seen)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--data-dir", default=None)
    ap.add_argument("--out", default="reports/architectures")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    from bench.common.models import load_model, model_bos
    from bench.common.provenance import cpu_label, git_revision, hardware, versions
    from bench.evaluations import data as D
    from lrq import precision as P
    from lrq.smooth import PAIRS, check_model_folds, fold_error, smooth_model  # noqa: F401
    loaded = load_model(args.model)
    model, tok = loaded.model.float().eval(), loaded.tokenizer
    data_dir = D.resolve_data_dir(args.data_dir)
    bos = model_bos(args.model)
    ids = D.tokenize(tok, D.eval_text("wikitext2", data_dir).text)
    ids = D.with_bos(ids, args.tokens, tok.bos_token_id if bos else None)[:args.tokens].unsqueeze(0)
    t = time.perf_counter()
    with P.use("fp32"):
        chain = chain_errors(model, ids)
        folds_ok, _ = check_model_folds(model, list(PAIRS), ids, "check")
        from lrq.arch import decoder_blocks
        from lrq.blockwise import capture_block_inputs, run_block
        buf, per_layer = capture_block_inputs(model, ids[:, :64])
        x, per_pair = buf.data[:].clone(), {p: 0.0 for p in PAIRS}
        for i, block in enumerate(decoder_blocks(model)):
            for p in PAIRS:
                per_pair[p] = max(per_pair[p], fold_error(block, p, x, per_layer[i]))
            x = run_block(block, x, per_layer[i])
        calib = D.calibration_set(tok, data_dir, "c4", 4, 512, bos=bos).input_ids
        ref = model(ids).logits
        smoothed = copy.deepcopy(model)
        stats = smooth_model(smoothed, calib, alpha=0.5, pairs=list(PAIRS))
        got = smoothed(ids).logits
    out = {"model": args.model, "tokens": int(ids.shape[1]), "bos": bos, "chain_rel_error": chain,
           "fold_error": per_pair, "exact_pairs": folds_ok, "smoothed_logit_rel_diff":
               float((got - ref).abs().max() / ref.abs().max()), "smooth_stats": stats,
           "seconds": time.perf_counter() - t, "hardware": hardware(), "versions": versions(),
           "git_rev": git_revision()}
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / f"{args.model}.json").write_text(json.dumps(out, indent=1, default=str) + "\n")
    print(f"## {args.model} ({cpu_label(out['hardware'])}, float32, {out['tokens']} tokens, BOS {bos})\n")
    print("block-chain max rel. difference per layer: " + ", ".join(f"{e:.1e}" for e in chain))
    print("fold error per pair (largest over blocks): " + ", ".join(f"{p} {e:.1e}" for p, e in per_pair.items()))
    print(f"smoothed FP model (alpha 0.5, pairs {', '.join(folds_ok)}): max logit difference "
          f"{out['smoothed_logit_rel_diff']:.1e} of the largest logit; {out['seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
