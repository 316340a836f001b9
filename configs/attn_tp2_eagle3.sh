#!/usr/bin/env bash
# Llama-3.1-8B shape with dummy (random) weights on 2 GPUs, tensor parallel, with EAGLE3
# (dummy drafter): the drafter runs on both ranks, split like the target.
# Variables and defaults: configs/lib/llama8b_dummy_env.sh. Extra arguments go to
# `gyrfalcon serve`. benchmarks/run_config.sh benchmarks it.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib/llama8b_dummy_env.sh"

exec gyrfalcon serve "$MODEL" --load-format dummy --tokenizer "$TOKENIZER" \
  --served-model-name llama-3.1-8b-dummy --port "$PORT" --device "$DEVICE" --dtype "$DTYPE" \
  --speculative-algorithm EAGLE3 --speculative-draft-model-path "$DRAFT" \
  --speculative-num-steps "$STEPS" --tp-size 2 "$@"
