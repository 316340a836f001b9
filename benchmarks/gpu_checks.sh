#!/usr/bin/env bash
# One GPU-machine session: install the carried wheels, then `tests` (pytest -m gpu)
# or `bench` (decode benchmarks). Results and logs go to $OUT.
#   usage (on the GPU machine, from the repo root): benchmarks/gpu_checks.sh tests|bench
set -uo pipefail
OUT=${OUT:-/tmp/gyr-out}; mkdir -p "$OUT"
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
N=$(nvidia-smi -L | wc -l)
case "$GPU" in
  *H100*) KIND=${DEVICE_KIND:-nvidia-h100-x$N} ;;
  *H200*) KIND=${DEVICE_KIND:-nvidia-h200$([ "$N" -gt 1 ] && echo "-x$N")} ;;
  *) KIND=${DEVICE_KIND:-unknown} ;;
esac
echo "device kind: $KIND ($GPU)"
if [ ! -f /tmp/site/.installed ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
  touch /tmp/site/.installed
fi
export PYTHONPATH=$PWD/python:/tmp/site
export GYRFALCON_SMOLLM2_GGUF=${GYRFALCON_SMOLLM2_GGUF:-/tmp/SmolLM2-135M-Instruct.Q4_1.gguf}
export GYRFALCON_CACHE=/tmp/gyr-cache
case "${1:-tests}" in
  tests)
    nvidia-smi -L
    python3 -m pytest -m gpu test/gpu -q -p no:cacheprovider -rA --durations=10 \
      > "$OUT/gpu_tests.log" 2>&1
    echo "pytest exit $?"; tail -40 "$OUT/gpu_tests.log" ;;
  bench)
    B="python3 benchmarks/bench_decode.py --device-kind $KIND"
    $B --model benchmarks/models/llama-3.1-8b --load-format dummy --batch-sizes "${BS:-1,8,32,64,128,256}" \
      --output-json "$OUT/decode_llama8b.json" 2>&1 | tail -12
    $B --model "$GYRFALCON_SMOLLM2_GGUF" --batch-sizes 1 --context 1024 \
      --output-json "$OUT/decode_smollm2_graphs.json" 2>&1 | tail -4
    $B --model "$GYRFALCON_SMOLLM2_GGUF" --batch-sizes 1 --context 1024 --enforce-eager \
      --output-json "$OUT/decode_smollm2_eager.json" 2>&1 | tail -4 ;;
esac
