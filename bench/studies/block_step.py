"""What one block-reconstruction step costs: FlexRound and LRQ on one decoder block, step by step.

    python -m bench.studies.block_step                                  # quick regime: batch 1 x 512, bf16
    python -m bench.studies.block_step --batch 2 --seq 1024 --fp32      # the paper's regime (fp32, batch 2)
    python -m bench.studies.block_step --profile 15                     # plus torch.profiler's top operators
    python -m bench.studies.block_step --batch 2 --seq 1024 --fp32 --compile   # eager vs torch.compile

The loop body is the engine's (lrq/engine.py, `_Training.step`): the block's forward under the same
autocast, the authors' loss, backward, Adam. The steps alternate (plain, FlexRound, LRQ, plain, ...) so
all see the same machine; "plain" is the floor, the block's own weights trained with no quantizer. Medians
of `--steps` steps after `--warmup`, split into forward, backward and optimizer. Inputs are the block's
real inputs for random token ids (the cost does not depend on the values); quantization parameters are
min/max at `--scheme`; LRQ's rank follows its quick preset (a quarter of min(Cout, Cin)) unless `--rank`.
Writes `--out`/block_step.json and .md with versions, hardware, threads, git revision and the load average
around the run; the 5,000-step projection is
5,000 x the median step (training only: the block walk and the error measurements come on top).

`--compile` adds each method's step under torch.compile (`lrq.engine.compiled_step`, what the engine runs
from `COMPILE_MIN_ITERS` steps per block, `--set compile=...`) to the same alternation: the eager step is
the engine's step as it was before compilation existed, so "before" and "after" come from one run on one
machine. The first compiled call (tracing and compiling, or loading torch's on-disk cache) is reported
apart as `compile_s`, not in the medians.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from lrq import precision as P
from lrq.errors import UserError
from lrq.io import atomic_write_text
from lrq.io import dumps_json

METHODS = ("flexround", "lrq")
PLAIN = "plain"   # the floor: the same block with trainable weights and no quantizer


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.studies.block_step", description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--block", type=int, default=0)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--fp32", action="store_true", help="no bf16 autocast (the paper preset's setting)")
    p.add_argument("--scheme", default="w4a16")
    p.add_argument("--rank", type=int, default=0, help="LRQ rank (0: a quarter of min(Cout, Cin), the quick preset)")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--profile", type=int, default=0, help="print torch.profiler's top N operators per method")
    p.add_argument("--compile", action="store_true", help="also time each method's step under torch.compile")
    p.add_argument("--out", default="reports/block-step")
    a = p.parse_args(argv)
    if a.steps < 1 or a.batch < 1 or a.seq < 2:
        p.error("--steps, --batch must be >= 1 and --seq >= 2")
    return a


def build(block0, method: str, scheme, rank: int):
    """The block with `method`'s learnable linears (or, for "plain", its own weights made trainable: the
    block's forward and backward with nothing of a quantizer), its learnables and their Adam."""
    from lrq.arch import block_linears, set_submodule
    from lrq.flexround import FlexRoundLinear
    from lrq.lrq import LRQLinear, choose_rank
    from lrq.quant import minmax_qparams
    block = copy.deepcopy(block0)
    if method == PLAIN:
        block.float()
        for q in block.parameters():
            q.requires_grad_(False)
        params = [lin.weight for lin in block_linears(block).values()]
        for q in params:
            q.requires_grad_(True)
        return block, params, torch.optim.Adam([{"params": params, "lr": 1e-3}])
    learn = {}
    for name, lin in block_linears(block).items():
        s, z = minmax_qparams(lin.weight.detach().float(), scheme.w_bits, scheme.group_size)
        if method == "lrq":
            r = choose_rank(lin.out_features, lin.in_features, "uniform" if rank else "fraction", rank, 0.25)
            m = LRQLinear(lin, scheme, s, z, rank=r, generator=torch.Generator().manual_seed(0))
        else:
            m = FlexRoundLinear(lin, scheme, s, z)
        set_submodule(block, name, m)
        learn[name] = m
    for q in block.parameters():
        q.requires_grad_(False)
    params = [q for m in learn.values() for q in m.learnables()]
    for q in params:
        q.requires_grad_(True)
    return block, params, torch.optim.Adam([{"params": params, "lr": 1e-3}])


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    from bench.common.models import load_model
    from bench.common.provenance import git_revision, hardware, versions
    from lrq.arch import decoder_blocks
    from lrq.blockwise import capture_block_inputs
    from lrq.engine import block_loss, compiled_step
    from lrq.schemes import get_scheme

    load_before = [round(x, 2) for x in os.getloadavg()]
    model = load_model(args.model).model
    blocks = decoder_blocks(model)
    if not 0 <= args.block < len(blocks):
        raise UserError(f"--block {args.block}: the model has blocks 0..{len(blocks) - 1}.")
    ids = torch.randint(0, model.config.vocab_size, (args.batch, args.seq), generator=torch.Generator().manual_seed(0))
    # the chosen block's real inputs: the chain of full-precision blocks before it
    buf, kw = capture_block_inputs(model, ids)
    x = buf.data[:].clone()
    with torch.no_grad():
        for i, b in enumerate(blocks[:args.block]):
            o = b(x, **kw[i])
            x = o[0] if isinstance(o, tuple) else o
        o = blocks[args.block](x, **kw[args.block])
        y = (o[0] if isinstance(o, tuple) else o).clone()
    scheme = get_scheme(args.scheme)
    variants = [PLAIN, *METHODS, *(f"{m}+compile" for m in (PLAIN, *METHODS) if args.compile)]
    built = {v: build(blocks[args.block], v.split("+")[0], scheme, args.rank) for v in variants}
    calls = {v: (compiled_step(built[v][0], True, torch.device("cpu")) if v.endswith("+compile") else built[v][0])
             for v in variants}
    autocast = P.autocast("cpu", precision="fp32" if args.fp32 else "bf16")

    def step(v):
        _, _, opt = built[v]
        t0 = time.perf_counter()
        with torch.enable_grad(), autocast:
            out = calls[v](x, **kw[args.block])
            out = out[0] if isinstance(out, tuple) else out
            loss = block_loss(out, y)
        loss.item()
        t1 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        t2 = time.perf_counter()
        opt.step()
        t3 = time.perf_counter()
        return {"forward": t1 - t0, "backward": t2 - t1, "optimizer": t3 - t2, "step": t3 - t0}

    # the first call of a compiled step traces and compiles it (or loads torch's cache): timed apart
    compile_s = {v: step(v)["step"] for v in variants if v.endswith("+compile")}
    times = {v: {k: [] for k in ("forward", "backward", "optimizer", "step")} for v in variants}
    for i in range(args.warmup + args.steps):
        for v in variants:
            t = step(v)
            if i >= args.warmup:
                for k, val in t.items():
                    times[v][k].append(val)
    med = {v: {k: statistics.median(vals) for k, vals in times[v].items()} for v in variants}
    result = {"config": {"model": args.model, "block": args.block, "batch": args.batch, "seq": args.seq,
                         "autocast": "off (fp32)" if args.fp32 else "bf16", "scheme": args.scheme,
                         "lrq_rank": args.rank or "quarter of min(Cout, Cin)", "steps": args.steps,
                         "warmup": args.warmup, "threads": torch.get_num_threads(), "compile": args.compile,
                         "command": " ".join(["python -m bench.studies.block_step",
                                              *(argv if argv is not None else sys.argv[1:])]),
                         "versions": versions(), "hardware": hardware(), "git": git_revision(),
                         "load_before": load_before, "load_after": [round(x, 2) for x in os.getloadavg()]},
              "learnables": {v: sum(q.numel() for q in built[v][1]) for v in variants},
              "median_s": med, "times_s": {v: {k: [round(t, 5) for t in ts] for k, ts in times[v].items()}
                                           for v in variants},
              "lrq_over_flexround": med["lrq"]["step"] / med["flexround"]["step"],
              "projected_5000_steps_min": {v: 5000 * med[v]["step"] / 60 for v in variants}}
    if args.compile:
        result["compile_s"] = compile_s
        result["lrq_over_flexround_compiled"] = med["lrq+compile"]["step"] / med["flexround+compile"]["step"]
        result["eager_over_compiled"] = {m: med[m]["step"] / med[f"{m}+compile"]["step"] for m in (PLAIN, *METHODS)}
    if args.profile:
        from torch.profiler import ProfilerActivity, profile
        result["profile"] = {}
        for m in variants:
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                for _ in range(2):
                    step(m)
            table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.profile)
            result["profile"][m] = table
            print(f"{m}: two steps\n{table}")
    c = result["config"]
    md = ["# One block-reconstruction step: FlexRound vs LRQ", "",
          f"{c['model']} block {c['block']}, batch {c['batch']} x {c['seq']} tokens, autocast {c['autocast']}, "
          f"{c['scheme']}, LRQ rank {c['lrq_rank']}; {c['threads']} thread(s); medians of {c['steps']} alternating "
          f"steps after {c['warmup']} warm-up. Command: `{c['command']}`.",
          f"{c['hardware']['cpu']} x{c['hardware']['cpu_count']}; torch {c['versions'].get('torch')}; git {c['git']}; "
          f"load average before / after: {c['load_before']} / {c['load_after']}.", "",
          "| method | step | learnables | forward s | backward s | optimizer s | step s | 5,000 steps (min) |",
          "|---|---|---|---|---|---|---|---|"]
    for v in variants:
        t = med[v]
        m, mode = (v.split("+")[0], "torch.compile") if "+" in v else (v, "eager")
        md.append(f"| {m} | {mode} | {result['learnables'][v]:,} | {t['forward']:.4f} | {t['backward']:.4f} | "
                  f"{t['optimizer']:.4f} | {t['step']:.4f} | {result['projected_5000_steps_min'][v]:.1f} |")
    md += ["", f"plain: the block's own weights trained, no quantizer (the floor for both methods' steps). "
           f"LRQ / FlexRound step time: {result['lrq_over_flexround']:.2f} eager"
               + (f", {result['lrq_over_flexround_compiled']:.2f} compiled" if args.compile else "") + "."]
    if args.compile:
        md += ["Eager / compiled step time: " + ", ".join(f"{m} {r:.2f}x" for m, r in
                                                            result["eager_over_compiled"].items())
               + "; first compiled call (compiling or loading the cache, not in the medians): "
               + ", ".join(f"{v.split('+')[0]} {t:.1f} s" for v, t in compile_s.items()) + "."]
    md.append("")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tag = (f"b{args.batch}x{args.seq}-{'fp32' if args.fp32 else 'bf16'}-t{torch.get_num_threads()}"
           + ("-compile" if args.compile else ""))
    atomic_write_text(out / f"block_step-{tag}.json", dumps_json(result, indent=1))
    atomic_write_text(out / f"block_step-{tag}.md", "\n".join(md))
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    from bench.studies import run_main
    run_main(main, "python -m bench.studies.block_step")
