"""Studies: one-off investigations and checks built on the harness (each a `python -m bench.studies.<name>`
entry point), kept apart from the product (bench/: cli, cell, sweep, executor, store, report, plan).

- ci_sweep: the small deterministic sweep CI reruns against reports/reference/;
- gpu_check, gpu_session.sh: the bounded GPU check and the prepared GPU-machine script;
- speed, speed_e2e: per-layer and end-to-end latency and memory of packed models;
- eval_speed: our perplexity evaluation against lm-eval's, same tokens;
- crosscheck_llmcompressor, awq_gap: our GPTQ/AWQ/SmoothQuant against llm-compressor's;
- check_compressed_tensors: our export loaded by transformers' compressed-tensors integration.
"""
