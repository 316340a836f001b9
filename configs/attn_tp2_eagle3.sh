#!/usr/bin/env bash
# Llama-3.1-8B shape with dummy (random) weights on 2 GPUs, tensor parallel, with EAGLE3
# (dummy drafter): the drafter runs on both ranks, split like the target.
# A synthetic tokenizer is made once into TOKENIZER (python -m gyrfalcon.bench.synthetic_tokenizer).
# MODEL (benchmarks/models/llama-3.1-8b); DRAFT (benchmarks/models/llama-3.1-8b-eagle3);
# STEPS (3); TOKENIZER (${TMPDIR:-/tmp}/gyrfalcon-tok-llama-3.1-8b);
# PORT (8000); DEVICE (cuda); DTYPE (auto: bfloat16 on CUDA).
# Extra arguments go to `gyrfalcon serve`. benchmarks/run_config.sh benchmarks it.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PYTHON=${PYTHON:-python3}
MODEL=${MODEL:-$ROOT/benchmarks/models/llama-3.1-8b}
DRAFT=${DRAFT:-$ROOT/benchmarks/models/llama-3.1-8b-eagle3}
STEPS=${STEPS:-3}
TOKENIZER=${TOKENIZER:-${TMPDIR:-/tmp}/gyrfalcon-tok-llama-3.1-8b}
PORT=${PORT:-8000}
DEVICE=${DEVICE:-cuda}
DTYPE=${DTYPE:-auto}
[ -f "$TOKENIZER/tokenizer.json" ] \
  || "$PYTHON" -m gyrfalcon.bench.synthetic_tokenizer "$MODEL" "$TOKENIZER" >/dev/null

exec gyrfalcon serve "$MODEL" --load-format dummy --tokenizer "$TOKENIZER" \
  --served-model-name llama-3.1-8b-dummy --port "$PORT" --device "$DEVICE" --dtype "$DTYPE" \
  --speculative-algorithm EAGLE3 --speculative-draft-model-path "$DRAFT" \
  --speculative-num-steps "$STEPS" --tp-size 2 "$@"
