# Sourced by the Qwen3-30B-A3B-shape MoE configs (dummy weights): their variables and
# the synthetic tokenizer, made once into TOKENIZER (python -m gyrfalcon.bench.synthetic_tokenizer).
# MODEL (benchmarks/models/qwen3-30b-a3b); DRAFT (benchmarks/models/qwen3-30b-a3b-eagle3);
# STEPS (3); TOKENIZER (${TMPDIR:-/tmp}/gyrfalcon-tok-qwen3-30b-a3b); PORT (8000);
# DEVICE (cuda); DTYPE (auto: bfloat16 on CUDA).
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
PYTHON=${PYTHON:-python3}
MODEL=${MODEL:-$ROOT/benchmarks/models/qwen3-30b-a3b}
DRAFT=${DRAFT:-$ROOT/benchmarks/models/qwen3-30b-a3b-eagle3}
STEPS=${STEPS:-3}
TOKENIZER=${TOKENIZER:-${TMPDIR:-/tmp}/gyrfalcon-tok-qwen3-30b-a3b}
PORT=${PORT:-8000}
DEVICE=${DEVICE:-cuda}
DTYPE=${DTYPE:-auto}
[ -f "$TOKENIZER/tokenizer.json" ] \
  || "$PYTHON" -m gyrfalcon.bench.synthetic_tokenizer "$MODEL" "$TOKENIZER" >/dev/null
