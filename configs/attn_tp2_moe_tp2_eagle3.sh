#!/usr/bin/env bash
# Qwen3-30B-A3B shape with dummy (random) weights on 2 GPUs: tensor parallel over 2
# GPUs, every expert split by its intermediate dim (MoE-TP).
# With EAGLE3 (a dummy drafter, DRAFT/config.json) on every rank: measures the cost
# of drafting and verifying, not acceptance.
# Variables and defaults: configs/lib/qwen3_30b_dummy_env.sh. Extra arguments go to
# `gyrfalcon serve`. benchmarks/run_config.sh benchmarks it.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib/qwen3_30b_dummy_env.sh"

exec gyrfalcon serve "$MODEL" --load-format dummy --tokenizer "$TOKENIZER" \
  --served-model-name qwen3-30b-a3b-dummy --port "$PORT" --device "$DEVICE" --dtype "$DTYPE" \
  --speculative-algorithm EAGLE3 --speculative-draft-model-path "$DRAFT" \
  --speculative-num-steps "$STEPS" --tp-size 2 "$@"
