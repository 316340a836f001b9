#!/usr/bin/env bash
# Qwen3-30B-A3B shape with dummy (random) weights on 2 GPUs: DP attention over 2 groups
# of one GPU, the experts split whole over all 2 GPUs (expert parallel).
# Variables and defaults: configs/lib/qwen3_30b_dummy_env.sh. Extra arguments go to
# `gyrfalcon serve`. benchmarks/run_config.sh benchmarks it.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib/qwen3_30b_dummy_env.sh"

exec gyrfalcon serve "$MODEL" --load-format dummy --tokenizer "$TOKENIZER" \
  --served-model-name qwen3-30b-a3b-dummy --port "$PORT" --device "$DEVICE" --dtype "$DTYPE" \
  --dp-size 2 --ep-size 2 "$@"
