#!/usr/bin/env bash
# Qwen3-30B-A3B shape with dummy (random) weights on 2 GPUs: tensor parallel over 2
# GPUs, every expert split by its intermediate dim (MoE-TP).
# Variables and defaults: configs/lib/qwen3_30b_dummy_env.sh. Extra arguments go to
# `gyrfalcon serve`. benchmarks/run_config.sh benchmarks it.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib/qwen3_30b_dummy_env.sh"

exec gyrfalcon serve "$MODEL" --load-format dummy --tokenizer "$TOKENIZER" \
  --served-model-name qwen3-30b-a3b-dummy --port "$PORT" --device "$DEVICE" --dtype "$DTYPE" \
  --tp-size 2 "$@"
