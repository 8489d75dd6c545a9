#!/usr/bin/env bash
# The one prepared script for a lent GPU machine (<= 8 minutes): the GPU check (<= 5 min from a cold
# Triton cache), then the end-to-end benchmark on a Llama-2-7B-shaped random model (8 blocks, static KV
# cache, CUDA graphs). Results go to $OUT (the device tool brings it back) and reports/gpu/, with the
# machine's versions; each step writes its JSON as it goes, so a cut run still leaves numbers.
#
#   run(command="bash bench/studies/gpu_session.sh", carry=["wheels"], timeout_s=540)
#
# The machine has its own torch/Triton and no registry: the project runs from the source tree
# (PYTHONPATH=.), and pure-Python extras come as wheels under wheels/ (e.g. gemlite:
# `pip wheel --no-deps gemlite==0.6.0.post2 -w wheels/` here, then carry=["wheels"]).
set -u
cd "$(dirname "$0")/../.."
DEST=${OUT:-reports/gpu}
mkdir -p "$DEST"
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TQDM_DISABLE=1
if compgen -G "wheels/*.whl" >/dev/null; then
  python -m pip install -q --no-index --no-deps wheels/*.whl 2>&1 | tail -2 || true
fi
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; python -c \
  "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"; \
  } > "$DEST/machine.txt" 2>&1
start=$(date +%s)
timeout 320 python -m bench.studies.gpu_check --out "$DEST/gpu_check.json" --budget-s 290 2>&1 | tee "$DEST/gpu_check.log"
echo "gpu_check: exit ${PIPESTATUS[0]}, $(( $(date +%s) - start )) s" | tee -a "$DEST/machine.txt"
start=$(date +%s)
timeout 170 python -m bench.studies.speed e2e --device cuda --shape llama-2-7b --layers 8 --prefill 512 --decode 64 \
  --out "$DEST/e2e.json" 2>&1 | tee "$DEST/e2e.log"
echo "e2e: exit ${PIPESTATUS[0]}, $(( $(date +%s) - start )) s" | tee -a "$DEST/machine.txt"
if [ "$DEST" != reports/gpu ]; then mkdir -p reports/gpu && cp "$DEST"/* reports/gpu/ 2>/dev/null || true; fi
