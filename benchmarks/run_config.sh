#!/usr/bin/env bash
# Serve one configs/*.sh, benchmark it with `gyrfalcon bench serve` (random token-id
# prompts) at each concurrency, stop it.
#   usage: benchmarks/run_config.sh CONFIG [OUT_DIR]        (OUT_DIR: benchmarks/results)
# Environment: DEVICE_KIND (the machine, e.g. nvidia-h100-x1; default unknown), PORT (8100),
#   CONCURRENCIES ("1 16 64"), INPUT_LEN (1024), OUTPUT_LEN (256), NUM_PROMPTS (default
#   max(8, PROMPTS_PER_CONCURRENCY x concurrency), PROMPTS_PER_CONCURRENCY 4), IGNORE_EOS (1: every request runs OUTPUT_LEN tokens),
#   HEALTH_TIMEOUT (1200 s), STOP_TIMEOUT (120 s), BENCH_FLAGS (more bench flags),
#   LOG_DIR (OUT_DIR), CONFIG_ARGS (more `gyrfalcon serve` flags, e.g. "--attention-backend
#   triton"); the config's own variables (MODEL, DRAFT, DEVICE, ...) pass through.
# Writes OUT_DIR/<config>_c<C>_<DEVICE_KIND>.json per concurrency and the server's log
# LOG_DIR/<config>_<DEVICE_KIND>_server.log, and appends one row per concurrency to
# OUT_DIR/run_config.md. Then asks /server_info whether every KV page came back on
# every rank (the scheduler's invariant checks included) and exits 1 if not.
set -euo pipefail
CONFIG=${1:?usage: benchmarks/run_config.sh CONFIG [OUT_DIR]}
OUT=${2:-benchmarks/results}
DEVICE_KIND=${DEVICE_KIND:-unknown}
PORT=${PORT:-8100}
CONCURRENCIES=${CONCURRENCIES:-1 16 64}
INPUT_LEN=${INPUT_LEN:-1024}
OUTPUT_LEN=${OUTPUT_LEN:-256}
IGNORE_EOS=${IGNORE_EOS:-1}
HEALTH_TIMEOUT=${HEALTH_TIMEOUT:-1200}
STOP_TIMEOUT=${STOP_TIMEOUT:-120}
PYTHON=${PYTHON:-python3}
NAME=$(basename "$CONFIG" .sh)
LOG_DIR=${LOG_DIR:-$OUT}
LOG=$LOG_DIR/${NAME}_${DEVICE_KIND}_server.log
MD=$OUT/run_config.md
[ -f "$CONFIG" ] || { echo "error: no config $CONFIG" >&2; exit 2; }
mkdir -p "$OUT" "$LOG_DIR"
export PORT PYTHON

SERVER=
SHIM=
stop_server() {
  [ -n "$SERVER" ] && kill -0 "$SERVER" 2>/dev/null || return 0
  kill -TERM "$SERVER"
  for ((i = 0; i < STOP_TIMEOUT; i++)); do
    kill -0 "$SERVER" 2>/dev/null || break
    sleep 1
  done
  if kill -0 "$SERVER" 2>/dev/null; then
    echo "server still running ${STOP_TIMEOUT} s after SIGTERM: SIGKILL" >&2
    kill -KILL -- "-$SERVER" 2>/dev/null || kill -KILL "$SERVER"
  fi
  local rc=0
  wait "$SERVER" || rc=$?
  echo "server exited with $rc (log: $LOG)"
}
trap 'stop_server; [ -z "$SHIM" ] || rm -rf "$SHIM"' EXIT

if ! command -v gyrfalcon >/dev/null; then  # NOTE: e.g. the package on PYTHONPATH only
  SHIM=$(mktemp -d)
  printf '#!/bin/sh\nexec %s -m gyrfalcon.cli "$@"\n' "$(command -v "$PYTHON")" >"$SHIM/gyrfalcon"
  chmod +x "$SHIM/gyrfalcon"
  export PATH=$SHIM:$PATH
fi

healthy() {
  "$PYTHON" -c "import urllib.request as u; u.urlopen('http://127.0.0.1:$PORT/health', timeout=2)" \
    2>/dev/null
}
if healthy; then
  echo "error: something already answers on port $PORT; pick another PORT" >&2
  exit 2
fi

# NOTE: setsid gives the server its own process group, so a SIGKILL reaches its children
LAUNCH=$(command -v setsid || true)
read -r -a CONFIG_EXTRA <<<"${CONFIG_ARGS:-}"
$LAUNCH bash "$CONFIG" ${CONFIG_EXTRA[@]+"${CONFIG_EXTRA[@]}"} >"$LOG" 2>&1 &
SERVER=$!

echo "serving $CONFIG on port $PORT (log: $LOG)"
START=$SECONDS
until healthy; do
  if ! kill -0 "$SERVER" 2>/dev/null; then
    echo "error: the server of $CONFIG exited before it was healthy; end of $LOG:" >&2
    tail -n 40 "$LOG" >&2
    exit 1
  fi
  if ((SECONDS - START >= HEALTH_TIMEOUT)); then
    echo "error: $CONFIG not healthy after $HEALTH_TIMEOUT s; end of $LOG:" >&2
    tail -n 40 "$LOG" >&2
    exit 1
  fi
  sleep 1
done
echo "healthy after $((SECONDS - START)) s"

EOS_FLAG=()
[ "$IGNORE_EOS" = 1 ] && EOS_FLAG=(--ignore-eos)
read -r -a EXTRA <<<"${BENCH_FLAGS:-}"
# NOTE: each concurrency's prompts from a seed of its own: one seed for all made a
# burst's first prompts the earlier bursts' ones, found in the prefix cache (stop 49)
for C in $CONCURRENCIES; do
  PER=${PROMPTS_PER_CONCURRENCY:-4}
  N=${NUM_PROMPTS:-$((PER * C > 8 ? PER * C : 8))}
  JSON=$OUT/${NAME}_c${C}_${DEVICE_KIND}.json
  gyrfalcon bench serve --port "$PORT" --dataset random --num-prompts "$N" \
    --random-input-len "$INPUT_LEN" --random-output-len "$OUTPUT_LEN" --max-concurrency "$C" \
    --seed "$C" --disable-tqdm --device-kind "$DEVICE_KIND" --output-json "$JSON" \
    ${EOS_FLAG[@]+"${EOS_FLAG[@]}"} ${EXTRA[@]+"${EXTRA[@]}"}
  "$PYTHON" - "$JSON" "$NAME" "$MD" <<'PY'
import json
import os
import sys

path, name, md = sys.argv[1:4]
report = json.load(open(path))
s, a, per = report["summary"], report.get("args", {}), report.get("per_request", {})
# spec accept length: a summary figure if the client reports one, else the mean of the
# requests' usage.spec_accept_length if it keeps them
accept = s.get("mean_spec_accept_length", s.get("spec_accept_length"))
lengths = [x for x in per.get("spec_accept_length") or [] if x is not None]
if accept is None and lengths:
    accept = sum(lengths) / len(lengths)


def num(x, digits):
    return "" if x is None else f"{x:,.{digits}f}"


header = (
    "| config | device kind | concurrency | prompts | in / out tokens | output tok/s "
    "| median TTFT ms | median TPOT ms | spec accept length | failed | input tokens found cached "
    "| commit | JSON |\n"
    "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |\n"
)
row = (
    f"| {name} | {report.get('device_kind')} | {a.get('max_concurrency')} "
    f"| {report.get('num_prompts')} | {a.get('random_input_len')} / {a.get('random_output_len')} "
    f"| {num(s['output_throughput'], 1)} | {num(s.get('median_ttft_ms'), 1)} "
    f"| {num(s.get('median_tpot_ms'), 2)} | {num(accept, 2)} | {s['failed']} "
    f"| {num(s.get('total_cached_input_tokens'), 0)} "
    f"| {report.get('commit')} | {os.path.basename(path)} |\n"
)
new = not os.path.exists(md)
with open(md, "a", encoding="utf-8") as f:
    f.write(("# benchmarks/run_config.sh\n\n" + header) if new else "")
    f.write(row)
print(row, end="")
PY
done
# NOTE: the free pages summed over the ranks equal the total only if every rank's do
"$PYTHON" - "$PORT" <<'PY'
import sys

from gyrfalcon.bench.server_proc import pages_after

p = pages_after(f"http://127.0.0.1:{sys.argv[1]}")
integrity = "ok" if p["integrity_ok"] else f"FAILED ({p['integrity_error']})"
print(f"pages after the runs: {p['free']} of {p['total']} free on all ranks, integrity {integrity}")
sys.exit(0 if p["ok"] else 1)
PY
