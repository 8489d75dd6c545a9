"""Studies: one-off investigations and checks built on the harness (each a `python -m bench.studies.<name>`
entry point), kept apart from the product (bench/: cli, cell, sweep, executor, store, report, plan).

- ci_sweep: the small deterministic sweep CI reruns against reports/reference/;
- gpu_check, gpu_session.sh: the bounded GPU check and the prepared GPU-machine script;
- speed, speed_e2e: per-layer and end-to-end latency and memory of packed models;
- eval_speed: our perplexity evaluation against lm-eval's, same tokens;
- crosscheck_llmcompressor, awq_gap: our GPTQ/AWQ/SmoothQuant against llm-compressor's;
- check_compressed_tensors: our export loaded by transformers' compressed-tensors integration;
- s1_search: the s1 clipping search, naive loop vs exhaustive vs fast, side by side;
- block_step: one block-reconstruction step of FlexRound and LRQ, timed and profiled;
- figure2: the paper's Figure 2 (calibration vs held-out block error while training) in its regime;
- paper_claims: the paper's claims from a results store, one row each with a verdict;
- precision: fp32 against bf16 on this machine (and under the no-bf16 emulation), and what `auto` picks;
- kl_approx, kl_gate, separation: the KL reference against exact KL, the KLD gate against the perplexity gate, and
  which pairs of cells each metric separates;
- gpu_stage, llmc_checkpoint: the GPU session's paper-regime stage; a checkpoint written by llm-compressor.
"""

import sys
from typing import Callable


def write_study(out: str, name: str, doc, markdown: str) -> None:
    """A study's results: out/<name>.json (every number, NaN as null) and out/<name>.md, each written atomically;
    the Markdown is printed too."""
    from pathlib import Path

    from lrq.io import atomic_write_text, dumps_json
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    atomic_write_text(folder / f"{name}.json", dumps_json(doc, indent=1, default=str) + "\n")
    atomic_write_text(folder / f"{name}.md", markdown)
    print(markdown)


def run_main(main: Callable[[], int], prog: str) -> None:
    """A study's entry point: its exit code, or exit 2 with a one-line message on bad input (UserError)."""
    from lrq.errors import UserError
    try:
        sys.exit(main())
    except UserError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        sys.exit(2)
