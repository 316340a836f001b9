#!/usr/bin/env bash
# One GPU-machine session: install the carried wheels, then `tests` (pytest -m gpu)
# or `bench` (decode benchmarks). Results and logs go to $OUT.
#   usage (on the GPU machine, from the repo root): benchmarks/gpu_checks.sh tests|bench|sglang|sweep|startup
#   sglang: Llama-3.1-8B shape (dummy weights, synthetic tokenizer) served, start-up time,
#           then SGLang's serving check (500 prompts, input U[1,4096], output U[1,2048],
#           EOS ignored, all at once) and the KV accounting after it;
#   sweep:  the same server, random 1024 in / 512 out at concurrency 1, 16, 64, 256.
#   ranks:  several GPUs (NCCL): the same server at tp 1 and tp 2 (batch-1 decode), then
#           dp 2 against one GPU at concurrency 256.
#   moe:    two GPUs: the Qwen3-30B-A3B shape as DP 2 + EP 2 and as MoE-TP 2 (MOE_CONC,
#           MOE_FLAGS).
#   rank-spec: two GPUs: configs/*.sh plain and _eagle3 through run_config.sh, pages checked,
#           the spec step's cost on every rank (RANK_CONFIGS, RS_CONC, RS_PROMPTS).
#   fi-cache: pack flashinfer's compiled modules (the .so files only, those restored and
#           those built here) into $OUT/fi-aot.tgz.part* (15 MiB parts); put them in
#           .fi-cache/ here and send that folder along (carry): restored into flashinfer's
#           AOT folder, they load without ninja, so a fresh machine compiles nothing
#           flashinfer has already built.
#   stage:  copy the carried .stage*/ parts to /tmp/stage (before the wheels: the parts
#           and .whl do not fit one transfer), join the SmolLM2 GGUF once all are there;
#           carry each part alone (.stage1 is 48 MiB: with the tree's ~13 MiB, even .data
#           beside it went over the 64 MiB a call takes, stop 43);
#   train-drafter: train the SmolLM2 EAGLE3 drafter (docs/train_eagle3.md; prompts from
#           .data/train_prompts.jsonl, carried) into drafters/smollm2-eagle3, sent back
#           as $OUT/drafter.tgz.part* (15 MiB parts), then its offline acceptance on
#           MT-Bench's first turns (benchmarks/eval_drafter.py); NUM_PROMPTS, SELF_INSTRUCTIONS,
#           FOLLOW_UPS, MAX_STEPS, BATCH, LR, EVAL_EVERY, TRAIN_SECONDS (the time guard),
#           GEN_WORKERS (engines generating at once, --generate-workers), DATA_CACHE (a
#           file keeping the generated text for the next run on this machine, --data-cache),
#           DRAFT_INTER (--draft-intermediate-size), DRAFT_VOCAB (--draft-vocab-size, 16384),
#           RECIPE_FLAGS (the recipe's "--norm-before-residual --ema-decay 0.999"), TRAIN_FLAGS
#           (more train-eagle3 flags, e.g. "--step-loss-decay 0.6"), TTT
#           (--ttt-steps, 3), KPROF=FIRST:COUNT (the kernels of those training steps,
#           $OUT/kprof/kernels_train_eagle3.txt), DRAFTER_DIR (where the checkpoint goes):
#           two recipes at once on a two-GPU machine, each on its own GPU, OUT and
#           DRAFTER_DIR (and DATA_CACHE) apart:
#             OUT=$OUT/a DRAFTER_DIR=/tmp/da CUDA_VISIBLE_DEVICES=0 ... train-drafter &
#             OUT=$OUT/b DRAFTER_DIR=/tmp/db CUDA_VISIBLE_DEVICES=1 ... train-drafter & wait
#           (4 files each come back; $OUT sends back 8 at most; SEND_DRAFTER=0: only the log
#           and the MT-Bench JSON, so four recipes fit, two a GPU on an H200 with one
#           DATA_CACHE each written by an earlier call, EVAL=0, then one eval_drafter.py
#           --draft-model DIR... --output-json F... over them all once all have finished);
#   spec:   bench_spec.py (MT-Bench first turns, .data/mt_bench_dev.jsonl) with the drafter
#           in drafters/smollm2-eagle3 (or staged: .drafter/drafter.tgz.part* carried with a
#           stage part), then bench_spec_step.py for the 8B and SmolLM2 shapes (dummy
#           weights) with host profiles of the first batch size. BENCH_SPEC=0 / STEP=0 skip
#           either half (STEP_8B=0: the SmolLM2 shape only); SPEC_FLAGS go to both servers,
#           SPEC_ONLY_FLAGS to the EAGLE3 server alone; SPEC_TAG names the run's files;
#           their logs come back in spec_logs/. The profiles hold the kernels of 20 steps too.
#           SPEC_WAVES=W: at concurrency C, max(40, W * C) requests (--min-waves; 40 at C = 16
#           last ~1 s on an H100, mostly ramp and tail: the c16 speed-up swung 1.22x-1.72x).
#           SPEC_ROUNDS=R: both servers up at once (8 GiB of KV each), R rounds per
#           concurrency alternating between them (--rounds; a spec server's c1 figure moved
#           13% between back-to-back runs on one machine).
#   ab-decode: decode tokens/s of this tree against older ones, in turns on one machine
#           (host-bound steps vary ~10% run to run, so one run of each says little): the
#           trees `git archive` put in .ab/<commit>/ (carry .ab; `benchmarks/ab_trees.sh
#           COMMIT...` makes them), AB_ROUNDS (5) turns of bench_decode.py at AB_BS (1) on
#           AB_MODEL (the SmolLM2 shape, dummy), then each tree's median; JSONs in $OUT/ab/.
#   ab-spec: the served EAGLE3 A/B (`spec`, BENCH_SPEC only) of this tree and every
#           .ab/<tree>/ (`benchmarks/ab_trees.sh`), all servers up at once and sent each
#           round in turn (bench_spec.py --ab-trees; SPEC_ROUNDS, default 3): one plain
#           server, an EAGLE3 one per tree. Trees run one after the other moved 10% apart
#           on one machine (stop 39). Carry .ab and .data, the SmolLM2 GGUF and the drafter
#           staged; files tagged SPEC_TAG (default ab); SPEC_WAVES, SPEC_FLAGS, SPEC_SECTIONS
#           as for spec.
#   ab-step: bench_spec_step's steady steps (SmolLM2 shape) of this tree against every
#           .ab/<tree>/ in turns, with this tree's sections and profiles (AB_ROUNDS, STEP_BS);
#   gemv:   the skinny GEMM's tile sweep on this GPU and the table entries it suggests
#           (GEMV_MODELS), then its GPU tests;
#   multiturn: the multi-turn chat benchmark with and without prefix caching (8B shape);
#   structured: structured output's decode cost (SmolLM2 staged, batch 64) and its GPU tests;
#   PYTEST_K selects tests (pytest -k), e.g. "not flashinfer_matches_torch_ref" skips the
#   slowest (~4 min) when flashinfer is unchanged.
#   CPU_SAMPLE=1: each served run also names the server's busy threads (serve_bench).
#   SERVER_FLAGS adds server flags (e.g. "--kv-cache-dtype fp8_e4m3"); TAG suffixes the
#   sglang/sweep output names (e.g. TAG=_fp8kv).
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
if [ "${1:-}" = stage ]; then
  mkdir -p /tmp/stage && cp .stage*/* /tmp/stage/ 2>/dev/null; ls -la /tmp/stage
  if compgen -G ".drafter/drafter.tgz.part*" >/dev/null; then  # a drafter staged with a part
    mkdir -p /tmp/drafters && cat .drafter/drafter.tgz.part* | tar xzf - -C /tmp/drafters
    ls /tmp/drafters/*
  fi
  # NOTE: joined again on every call from the second part on: a part left by an earlier
  # split of other sizes made a wrong file once, which a join-once rule then kept
  if [ "$(ls /tmp/stage | wc -l)" -ge 2 ]; then
    cat /tmp/stage/SmolLM2-135M-Instruct.Q4_1.gguf.part* > /tmp/SmolLM2-135M-Instruct.Q4_1.gguf
    sha256sum /tmp/SmolLM2-135M-Instruct.Q4_1.gguf
  fi
  exit 0
fi
if [ ! -f /tmp/site/.installed ]; then
  # NOTE: benchmarks/pack_wheels.sh adds both to ../shared/gpu/pack-wheels.sh's set
  for p in prometheus_client xgrammar uvloop httptools; do
    compgen -G ".whl/$p-*.whl" >/dev/null \
      || { echo ".whl lacks $p: fill it with benchmarks/pack_wheels.sh"; exit 1; }
  done
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
  touch /tmp/site/.installed
fi
export PYTHONPATH=$PWD/python:/tmp/site
FI_AOT=/tmp/site/flashinfer/data/aot  # flashinfer loads <name>/<name>.so here as is
if compgen -G ".fi-cache/fi-aot.tgz.part*" >/dev/null && [ ! -f "$FI_AOT/.restored" ]; then
  # NOTE: a module in its JIT cache goes through ninja on every load, which judges by
  # timestamps (restored ones were rebuilt); AOT modules are loaded as they are
  mkdir -p "$FI_AOT" && cat .fi-cache/fi-aot.tgz.part* | tar xzf - -C "$FI_AOT" \
    && touch "$FI_AOT/.restored" && echo "flashinfer modules restored: $(ls "$FI_AOT" | wc -l)"
fi
export GYRFALCON_SMOLLM2_GGUF=${GYRFALCON_SMOLLM2_GGUF:-/tmp/SmolLM2-135M-Instruct.Q4_1.gguf}
export GYRFALCON_CACHE=/tmp/gyr-cache
# NOTE: the device's copy may carry a stale .git; results name the commit given here
export GYRFALCON_COMMIT=${GYRFALCON_COMMIT:-unknown}
# NOTE: NVLink multicast off in every mode (the device notes ask it of several GPUs)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
start_server() {  # dummy $MODEL (the 8B) with a synthetic tokenizer; records the start-up time
  local model=${MODEL:-benchmarks/models/llama-3.1-8b} name
  name=$(basename "$model")
  python3 -m gyrfalcon.bench.synthetic_tokenizer "$model" "/tmp/tok-$name" >/dev/null
  local t0=$(date +%s.%N)
  python3 -m gyrfalcon.cli serve "$model" --load-format dummy \
    --tokenizer "/tmp/tok-$name" --port 8100 --served-model-name "$name-dummy" ${SERVER_FLAGS:-} \
    > "$OUT/server_$1.log" 2>&1 &
  SERVER=$!
  until python3 -c "import urllib.request as u; u.urlopen('http://127.0.0.1:8100/health')" 2>/dev/null; do
    kill -0 $SERVER 2>/dev/null || { echo "server died"; tail -30 "$OUT/server_$1.log"; exit 1; }
    sleep 0.5
  done
  echo "{\"bench\": \"startup\", \"device_kind\": \"$KIND\", \"model\": \"$name dummy\", \"commit\": \"${GYRFALCON_COMMIT:-unknown}\", \"seconds_to_healthy\": $(python3 -c "print(round($(date +%s.%N) - $t0, 1))")}" > "$OUT/startup_$1.json"
  cat "$OUT/startup_$1.json"; grep -a "captured" "$OUT/server_$1.log"
}
pages_after() {  # the running server's page accounting once drained, one line
  python3 -c "from gyrfalcon.bench.server_proc import pages_after as p; i = p('http://127.0.0.1:8100')
print('pages after the runs:', i['free'], 'of', i['total'], 'free, integrity', i['integrity_ok'])"
}
parse_run() {  # "name[@tree]:flags" (MOE_RUNS, MT_RUNS) -> N (name), T (tree, . for this one), FLAGS
  N=${1%%:*} T=. FLAGS=${1#*:}
  [ "$N" = "${N#*@}" ] || T=${N#*@}
  N=${N%%@*}
}
serve_bench() {  # name, then bench_serving flags; CPU_SAMPLE=1: every server thread's CPU
  # over the run (gyrfalcon.bench.proc_cpu, $OUT/cpu_<name>.json): which one the GPU waits on
  local name=$1 wrap=(); shift
  [ "${CPU_SAMPLE:-0}" = 1 ] && wrap=(python3 -m gyrfalcon.bench.proc_cpu --root "$SERVER" \
    --output-json "$OUT/cpu_$name.json" --)
  "${wrap[@]}" python3 -m gyrfalcon.cli bench serve --port 8100 --disable-tqdm --device-kind "$KIND" \
    --output-json "$OUT/serving_$name.json" "$@" 2>&1 \
    | grep -aE "Successful|Failed|throughput|Median TTFT|Median TPOT|threads of|share of one| / "
}
case "${1:-tests}" in
  sglang)
    start_server "sglang${TAG:-}"
    serve_bench "sglang_protocol${TAG:-}" --num-prompts 500 --random-input-len 4096 --random-output-len 2048 \
      --random-range-ratio 0 --ignore-eos --seed 1
    python3 -c "import urllib.request as u; print(u.urlopen('http://127.0.0.1:8100/server_info').read().decode())" \
      | tee "$OUT/server_info_after_sglang${TAG:-}.json"
    kill -TERM $SERVER; wait $SERVER; echo "server exit $?" ;;
  startup)  # start-up to healthy only
    start_server "startup${TAG:-}"; grep -a "warm-up" "$OUT/server_startup${TAG:-}.log"
    kill -TERM $SERVER; wait $SERVER; echo "server exit $?" ;;
  sweep)  # SWEEP_CONC: the concurrencies (default 1 16 64 256); TREE=.ab/<commit> serves
    # an older tree (benchmarks/ab_trees.sh, carried)
    PYTHONPATH=${TREE:-.}/python:/tmp/site start_server "sweep${TAG:-}"
    # NOTE: a seed per concurrency: with one seed c64 and c256 sent c16's 500 prompts
    # again, every one found in the prefix cache
    for C in ${SWEEP_CONC:-1 16 64 256}; do
      N=$(( C == 1 ? 16 : 500 ))
      echo "concurrency $C"
      serve_bench "c$C${TAG:-}" --num-prompts $N --random-input-len 1024 --random-output-len 512 \
        --ignore-eos --max-concurrency $C --seed $((2 + C))
    done
    pages_after
    kill -TERM $SERVER; wait $SERVER; echo "server exit $?"
    grep -a "target forwards" "$OUT/server_sweep${TAG:-}.log" | cut -c1-400 ;;
  ranks)  # several GPUs: the 8B shape on triton (no flashinfer build per rank) at tp 1 and
    # 2 (one-shot all-reduce, then NCCL only), batch-1 decode (1024 in / 256 out,
    # concurrency 1); then dp 2 against one GPU on the random 1024 / 512 set at
    # concurrency 256 (NUM_DP prompts, default 512); RANKS_TP=0 or RANKS_DP=0 skips either
    # part; DP_SIZES picks the dp runs (default "1 2"); DP_HALF=1 adds one GPU serving
    # NUM_DP / 2 prompts at concurrency 128, one DP 2 rank's share alone: with the weights
    # on every rank, the most a dp 2 server can do is two of those at once; TREE=.ab/<commit>
    # serves the dp runs from an older tree, TAG suffixes their files, DP_FLAGS adds flags to
    # them (e.g. "--api-server-count 1": one API server for every rank, the default until stop 56)
    TP_RUNS=() DP_RUNS=()  # NOTE: arrays: each "name:flags[:prompts:concurrency]" is one word
    # NOTE: tp2nccl: every all-reduce through NCCL (--disable-custom-all-reduce)
    [ "${RANKS_TP:-1}" = 1 ] && TP_RUNS=("tp1:--tp-size 1" "tp2:--tp-size 2"
      "tp2nccl:--tp-size 2 --disable-custom-all-reduce")
    if [ "${RANKS_DP:-1}" = 1 ]; then
      for D in ${DP_SIZES:-1 2}; do DP_RUNS+=("dp$D:--dp-size $D:${NUM_DP:-512}:256"); done
      [ "${DP_HALF:-0}" = 1 ] && DP_RUNS+=("dp1half:--dp-size 1:$(( ${NUM_DP:-512} / 2 )):128")
    fi
    for R in "${TP_RUNS[@]}"; do
      # NOTE: KPROF=FIRST:COUNT: every rank's kernels over those plans (profiling.KernelWindow)
      [ -n "${KPROF:-}" ] && export GYRFALCON_KERNEL_PROFILE="$OUT/kprof/${R%%:*}:$KPROF"
      SERVER_FLAGS="--attention-backend triton ${R#*:}" start_server "${R%%:*}"
      serve_bench "decode_${R%%:*}" --num-prompts 8 --random-input-len 1024 \
        --random-output-len 256 --random-range-ratio 1 --ignore-eos --max-concurrency 1 --seed 3
      kill -TERM $SERVER; wait $SERVER; echo "server exit $?"
    done
    [ -d "$OUT/kprof" ] && tar czf "$OUT/kprof.tgz" -C "$OUT" kprof && rm -rf "$OUT/kprof"
    for R in "${DP_RUNS[@]}"; do
      IFS=: read -r NAME FLAGS NUM CONC <<< "$R"
      PYTHONPATH=${TREE:-.}/python:/tmp/site SERVER_FLAGS="--attention-backend triton $FLAGS ${DP_FLAGS:-}" \
        start_server "$NAME${TAG:-}"
      serve_bench "c${CONC}_$NAME${TAG:-}" --num-prompts "$NUM" --random-input-len 1024 \
        --random-output-len 512 --ignore-eos --max-concurrency "$CONC" --seed 2
      kill -TERM $SERVER; wait $SERVER; echo "server exit $?"
      grep -a "target forwards" "$OUT/server_$NAME${TAG:-}.log" | tail -2
    done ;;
  moe)  # the Qwen3-30B-A3B shape (dummy) as DP attention + EP and as MoE-TP: MOE_RUNS
    # ("name:flags;name:flags", default DP 2 + EP 2 and TP 2; "name@.ab/<commit>:flags"
    # serves an older tree from benchmarks/ab_trees.sh, carried), random 1024 in / 512 out
    # at each concurrency of MOE_CONC (one wave of prompts each, after one warm-up request,
    # as run_config.sh sends: stop 41's runs sent none, and TP 4's c256 read 18-20% under
    # 0c81a1d's, which had one; not yet told apart from a change since).
    # KPROF="FIRST:COUNT[,FIRST:COUNT]": every rank's kernels over those plans
    # (profiling.KernelWindow; no warm-up request, so that the windows' plans are the
    # burst's on every rank), sent back as kprof.tgz; the server logs as moe_logs.tgz, the
    # benchmarks' JSONs as moe_serving.tgz.
    # MOE_IN / MOE_OUT: other prompt and answer lengths (1024 / 512); MOE_RATE: requests a
    # second (Poisson arrivals, bench serve's --request-rate; all at once without), e.g.
    # MOE_IN=128 MOE_OUT=256 MOE_RATE=16 MOE_CONC=64 for small prompts arriving one by one.
    # MOE_REPEAT=N: N bursts of each concurrency (files _r2 .. _rN; one DP 4 server's c256
    # read 10,664 and 12,001 tok/s in two single-burst runs). Every burst has prompts of
    # its own (a seed per concurrency and repeat): stop 48's c64 and c16 bursts were the
    # c256 burst's first prompts, which TP 4 found in its prefix cache (c16 first tokens
    # 47 ms; cold, 158-190 ms at stop 49), while DP 4 + EP 4 read 288 ms.
    export MODEL=benchmarks/models/qwen3-30b-a3b
    IFS=';' read -ra RUNS <<< "${MOE_RUNS:-dp2ep2:--dp-size 2 --ep-size 2;tp2:--tp-size 2}"
    for R in "${RUNS[@]}"; do
      parse_run "$R"
      NAME="moe_${N}_$([ "$T" = . ] && echo head || basename "$T")"
      unset GYRFALCON_KERNEL_PROFILE  # NOTE: this tree's windows (older trees read one)
      [ -n "${KPROF:-}" ] && [ "$T" = . ] && export GYRFALCON_KERNEL_PROFILE="$OUT/kprof/$NAME:$KPROF"
      PYTHONPATH=$T/python:/tmp/site SERVER_FLAGS="--attention-backend triton $FLAGS ${MOE_FLAGS:-}" \
        start_server "$NAME"
      for C in ${MOE_CONC:-16 64 256}; do
        for I in $(seq "${MOE_REPEAT:-1}"); do
          serve_bench "${NAME}_c$C$([ "$I" = 1 ] || echo "_r$I")" --num-prompts "$C" \
            --random-input-len "${MOE_IN:-1024}" --random-output-len "${MOE_OUT:-512}" --ignore-eos \
            --max-concurrency "$C" ${MOE_RATE:+--request-rate "$MOE_RATE"} \
            --seed $((3 + I + 1000 * C)) --warmup-requests "$([ -n "${KPROF:-}" ] && echo 0 || echo 1)"
        done
      done
      PAGES=$(pages_after)
      kill -TERM $SERVER; wait $SERVER; echo "server exit $?"
      # NOTE: also in the log (appended once the server is gone): four servers' output
      # outgrew the call's returned tail, and two servers' accounting with it (stop 48)
      echo "$PAGES" | tee -a "$OUT/server_$NAME.log"
      grep -a "target forwards" "$OUT/server_$NAME.log" | tail -4
    done
    unset GYRFALCON_KERNEL_PROFILE
    [ -d "$OUT/kprof" ] && tar czf "$OUT/kprof.tgz" -C "$OUT" kprof && rm -rf "$OUT/kprof"
    # NOTE: one archive each: $OUT sends back 8 files at most
    tar czf "$OUT/moe_logs.tgz" -C "$OUT" $(cd "$OUT" && ls server_moe_*.log) && rm -f "$OUT"/server_moe_*.log
    tar czf "$OUT/moe_serving.tgz" -C "$OUT" $(cd "$OUT" && ls serving_moe_*.json startup_moe_*.json) \
      && rm -f "$OUT"/serving_moe_*.json "$OUT"/startup_moe_*.json ;;
  rank-spec)  # EAGLE3 over several GPUs: each config of RANK_CONFIGS (default the MoE pair
    # attn_dp2_moe_ep2 and attn_tp2_moe_tp2) served plain and as its _eagle3 variant (dummy
    # drafter) by benchmarks/run_config.sh (triton attention, GYRFALCON_STEP_TIMES=1, at each
    # concurrency of RS_CONC (16; RS_SPEC_ONLY=1: the _eagle3 variant alone), RS_PROMPTS prompts (default 2 x concurrency; RS_PER_C sets
    # the multiple) of 1024 in / RS_OUT (256) out), which checks that every page came back on
    # every rank; then the spec step's device cost against the plain step's on every rank
    # (gyrfalcon.bench.rank_steps). Sent back as rank_spec.tgz. The 4-GPU runs (issue of
    # the wide machines): RANK_CONFIGS="attn_dp4_moe_ep4 attn_tp4_moe_tp4" RS_CONC="16 64 256"
    # RS_PER_C=1 RS_OUT=512; their GPU tests: GYRFALCON_GPU_RANKS=4 PYTEST_K=ranks ... tests
    export GYRFALCON_STEP_TIMES=1 DEVICE_KIND=$KIND CONFIG_ARGS="--attention-backend triton"
    RS=$OUT/rank_spec; mkdir -p "$RS"
    for C in ${RANK_CONFIGS:-attn_dp2_moe_ep2 attn_tp2_moe_tp2}; do
      VARIANTS="$C ${C}_eagle3"; [ "${RS_SPEC_ONLY:-0}" = 1 ] && VARIANTS="${C}_eagle3"
      for V in $VARIANTS; do
        CONCURRENCIES=${RS_CONC:-16} PROMPTS_PER_CONCURRENCY=${RS_PER_C:-2} \
          NUM_PROMPTS=${RS_PROMPTS:-} OUTPUT_LEN=${RS_OUT:-256} PORT=8100 \
          bash benchmarks/run_config.sh "configs/$V.sh" "$RS" 2>&1 \
          | grep -aE "^\| $V |pages after|error|Error" | tail -8
        grep -aE "rank [0-9]: [0-9]+ steps" "$RS/${V}_${KIND}_server.log" | cut -c1-400
      done
      [ -f "$RS/${C}_${KIND}_server.log" ] && python3 -m gyrfalcon.bench.rank_steps --plain "$RS/${C}_${KIND}_server.log" \
        --spec "$RS/${C}_eagle3_${KIND}_server.log" --name "${C}_c${RS_CONC// /-}" \
        --device-kind "$KIND" --commit "$GYRFALCON_COMMIT" --output-json "$RS/${C}_spec_step.json"
    done
    tar czf "$OUT/rank_spec.tgz" -C "$OUT" rank_spec && rm -rf "$RS" ;;
  structured)  # structured output's cost: bench_structured.py (SmolLM2 staged, batch 64,
    # every row under a json_schema against the same rows free), then the GPU tests of it
    python3 benchmarks/bench_structured.py --model "$GYRFALCON_SMOLLM2_GGUF" --device cuda \
      --batch-size ${SO_BS:-64} --steps ${SO_STEPS:-200} --rounds ${SO_ROUNDS:-3} \
      --device-kind "$KIND" --output-json "$OUT/structured_smollm2_bs${SO_BS:-64}.json" ${SO_FLAGS:-} 2>&1 | tail -8
    # NOTE: the 8B shape on dummy weights writes random tokens (SmolLM2's tokenizer): the
    # masks' costly case, beside a step ~5x SmolLM2's
    [ "${SO_8B:-1}" = 1 ] && python3 benchmarks/bench_structured.py --model benchmarks/models/llama-3.1-8b \
      --load-format dummy --tokenizer "$GYRFALCON_SMOLLM2_GGUF" --device cuda \
      --batch-size ${SO_BS:-64} --steps ${SO_STEPS:-200} --rounds ${SO_ROUNDS:-3} \
      --device-kind "$KIND" --output-json "$OUT/structured_llama8b_dummy_bs${SO_BS:-64}.json" ${SO_FLAGS:-} 2>&1 | tail -8
    [ "${SO_TESTS:-1}" = 1 ] && python3 -m pytest -m gpu test/gpu/test_structured_gpu.py -q -p no:cacheprovider -rA \
      > "$OUT/gpu_tests_structured.log" 2>&1; echo "pytest exit $?"; tail -8 "$OUT/gpu_tests_structured.log" ;;
  ab-spec)
    SPEC_AB_TREES=$(ls -d "$PWD"/.ab/* | paste -sd,) SPEC_ROUNDS=${SPEC_ROUNDS:-3} STEP=0 \
      SPEC_TAG=${SPEC_TAG:-ab} bash "$0" spec
    grep -aH "target forwards" "$OUT"/spec_logs_"${SPEC_TAG:-ab}"/*.log \
      | sed 's|.*/server_||; s|\.log:.*rank 0: |: |' ;;
  ab-decode)
    AB=$OUT/ab; mkdir -p "$AB"
    MODEL_DIR=${AB_MODEL:-benchmarks/models/smollm2-135m}
    for r in $(seq 1 "${AB_ROUNDS:-5}"); do
      for tree in . .ab/*; do
        name=$([ "$tree" = . ] && echo "$GYRFALCON_COMMIT" || basename "$tree")
        # NOTE: the models come from this tree, the code from `tree`
        GYRFALCON_COMMIT=$name PYTHONPATH=$tree/python:/tmp/site python3 "$tree/benchmarks/bench_decode.py" \
          --device-kind "$KIND" --model "$MODEL_DIR" --load-format dummy \
          --batch-sizes "${AB_BS:-1}" --steps 256 --output-json "$AB/${name}_r$r.json" 2>&1 \
          | tail -1 | sed "s/^/$name round $r: /"
      done
    done
    python3 - "$AB" <<'PY'
import glob, json, statistics, sys
runs = {}
for f in sorted(glob.glob(f"{sys.argv[1]}/*_r*.json")):
    name = f.rsplit("/", 1)[1].rsplit("_r", 1)[0]
    for row in json.load(open(f))["rows"]:
        runs.setdefault((name, row["batch_size"]), []).append(row["tok_s"])
for (name, bs), tok in sorted(runs.items()):
    print(f"{name} batch {bs}: median {statistics.median(tok):.1f} tok/s over {len(tok)} runs "
          f"(min {min(tok):.1f}, max {max(tok):.1f})")
PY
    ;;
  ab-step)  # bench_spec_step (SmolLM2 shape, dummy, triton) of this tree and every .ab/<tree>/
    # (each with its own copy of the script) in turns: AB_ROUNDS (2), STEP_BS (1,16),
    # STEP_FLAGS (more flags, to every tree); the first round of this tree with
    # --time-sections and the host and kernel profiles (PROFILE=0: none; PROFILE=all:
    # every tree's first round); each tree's median step per batch size at the end
    AB=$OUT/ab_step; mkdir -p "$AB"
    for r in $(seq 1 "${AB_ROUNDS:-2}"); do
      for tree in . .ab/*; do
        name=$([ "$tree" = . ] && echo "$GYRFALCON_COMMIT" || basename "$tree") extra=()
        [ "$r.${PROFILE:-1}" = 1.all ] || [ "$tree.$r.${PROFILE:-1}" = "..1.1" ] \
          && extra=(--time-sections --profile-dir "$AB/prof_$name")
        GYRFALCON_COMMIT=$name PYTHONPATH=$tree/python:/tmp/site python3 "$tree/benchmarks/bench_spec_step.py" \
          benchmarks/models/smollm2-135m benchmarks/models/smollm2-135m-eagle3 --load-format dummy \
          --attention-backend triton --steps 200 --batch-sizes "${STEP_BS:-1,16}" --kv-cache-memory 4GiB \
          --device-kind "$KIND" --output-dir "$AB/$name" --tag "_r$r" "${extra[@]}" ${STEP_FLAGS:-} 2>&1 \
          | grep -a "^| [0-9]\|steady steps: gc" | sed "s/^/$name round $r: /"
      done
    done
    python3 - "$AB" <<'PY'
import glob, json, statistics, sys
runs = {}
for f in sorted(glob.glob(f"{sys.argv[1]}/*/spec_step_*_r*.json")):
    for row in json.load(open(f))["rows"]:
        key = (f.split("/")[-2], row["batch_size"])
        runs.setdefault(key, []).append((row["spec_step_ms"], row["plain_step_ms"]))
for (name, bs), ms in sorted(runs.items()):
    spec, plain = statistics.median(m[0] for m in ms), statistics.median(m[1] for m in ms)
    print(f"{name} batch {bs}: spec step median {spec:.3f} ms, plain {plain:.3f} ms over {len(ms)} runs "
          f"(spec min {min(m[0] for m in ms):.3f}, max {max(m[0] for m in ms):.3f})")
PY
    (cd "$AB" && tar czf ../ab_step.tgz . && cd .. && rm -rf "$AB") ;;
  multiturn)  # prefix caching: benchmarks/bench_multiturn.py (shared 1024-token system
    # prompt, 4 turns, 64 conversations at once) on the 8B shape ($MODEL: another), with
    # the cache and without. MT_RUNS as MOE_RUNS ("name:flags;name:flags";
    # "name@.ab/<commit>:flags" serves an older tree from benchmarks/ab_trees.sh,
    # carried), e.g. "dp2:--dp-size 2" alone. Each server's step kinds and pages are
    # printed; the logs come back as multiturn_logs.tgz.
    IFS=';' read -ra RUNS <<< "${MT_RUNS:-cache:;nocache:--disable-prefix-caching}"
    for R in "${RUNS[@]}"; do
      parse_run "$R"
      NAME="$N$([ "$T" = . ] || echo "_$(basename "$T")")"
      PYTHONPATH=$T/python:/tmp/site SERVER_FLAGS="--attention-backend triton $FLAGS" \
        start_server "multiturn_$NAME"
      python3 benchmarks/bench_multiturn.py --port 8100 --device-kind "$KIND" --tag "$NAME" \
        --num-conversations ${MT_CONV:-64} --concurrency ${MT_CONC:-64} \
        --output-json "$OUT/multiturn_$NAME.json" 2>&1 | tail -25
      pages_after
      kill -TERM $SERVER; wait $SERVER; echo "server exit $?"
      grep -a "target forwards" "$OUT/server_multiturn_$NAME.log" | tail -8
    done
    tar czf "$OUT/multiturn_logs.tgz" -C "$OUT" $(cd "$OUT" && ls server_multiturn_*.log) \
      && rm -f "$OUT"/server_multiturn_*.log ;;
  fi-cache)
    mkdir -p /tmp/fi-pack && cp -r "$FI_AOT"/. /tmp/fi-pack/ && rm -f /tmp/fi-pack/.restored
    for so in ~/.cache/flashinfer/*/*/cached_ops/*/*.so; do  # built on this machine
      [ -f "$so" ] && mkdir -p "/tmp/fi-pack/$(basename "$(dirname "$so")")" \
        && cp "$so" "/tmp/fi-pack/$(basename "$(dirname "$so")")/"
    done
    ls /tmp/fi-pack
    tar czf - -C /tmp/fi-pack . | split -b 15M - "$OUT/fi-aot.tgz.part"
    ls -la "$OUT" ;;
  train-drafter)
    D=${DRAFTER_DIR:-drafters/smollm2-eagle3}; rm -rf "$D"
    [ -n "${KPROF:-}" ] && export GYRFALCON_KERNEL_PROFILE="$OUT/kprof:$KPROF"
    # NOTE: the defaults are docs/train_eagle3.md's recipe (stop 47); RECIPE_FLAGS="" drops
    # its two flags, TRAIN_FLAGS adds others
    /usr/bin/time -v python3 -m gyrfalcon.cli train-eagle3 --prompts .data/train_prompts.jsonl \
      --target-model "$GYRFALCON_SMOLLM2_GGUF" \
      --device cuda --output-dir "$D" --num-prompts ${NUM_PROMPTS:-3000} \
      --holdout 64 --max-new-tokens 256 --max-steps ${MAX_STEPS:-8000} --batch-size ${BATCH:-128} \
      --lr ${LR:-2e-3} --ttt-steps ${TTT:-3} --draft-vocab-size ${DRAFT_VOCAB:-16384} --eval-every ${EVAL_EVERY:-1000} \
      --self-instructions ${SELF_INSTRUCTIONS:-24000} --follow-up-turns ${FOLLOW_UPS:-7000} \
      --max-train-seconds ${TRAIN_SECONDS:-200} --generate-workers ${GEN_WORKERS:-8} \
      ${DATA_CACHE:+--data-cache "$DATA_CACHE"} ${DRAFT_INTER:+--draft-intermediate-size "$DRAFT_INTER"} \
      ${RECIPE_FLAGS---norm-before-residual --ema-decay 0.999} ${TRAIN_FLAGS:-} \
      > "$OUT/train_drafter.log" 2>&1
    echo "train exit $?"; grep -aE "Elapsed|acceptance|accept|loss|phase|summary|kept|sequences|generation with|engine ready" "$OUT/train_drafter.log" | tail -25
    # NOTE: measured only (never trained on): the offline acceptance on MT-Bench's first
    # turns, to set beside the held-out estimate and the served figure; EVAL=0 skips it
    # (two trainers a GPU: the first to finish sized its engine beside the other's ~120 GiB
    # and failed, stop 47; evaluate the DRAFTER_DIRs after `wait` instead, in one
    # eval_drafter.py run: one set of answers for all)
    [ "${EVAL:-1}" = 1 ] && python3 benchmarks/eval_drafter.py --device cuda --target-model "$GYRFALCON_SMOLLM2_GGUF" \
      --draft-model "$D" --prompts .data/mt_bench_dev.jsonl \
      --output-json "$OUT/eval_drafter_mt_bench.json" 2>&1 | tail -1
    # NOTE: SEND_DRAFTER=0 keeps the checkpoint on the machine: 2 files a recipe, so
    # four recipes fit the 8 files a call sends back
    [ "${SEND_DRAFTER:-1}" = 1 ] && tar czf - -C "$(dirname "$D")" "$(basename "$D")" \
      | split -b 15M - "$OUT/drafter.tgz.part"
    ls -la "$OUT" ;;
  spec)
    DRAFTER=drafters/smollm2-eagle3
    [ -d "$DRAFTER" ] || DRAFTER=/tmp/drafters/smollm2-eagle3  # staged (mode stage)
    if [ ! -d "$DRAFTER" ] && compgen -G ".drafter/drafter.tgz.part*" >/dev/null; then
      mkdir -p /tmp/drafters && cat .drafter/drafter.tgz.part* | tar xzf - -C /tmp/drafters
    fi
    if [ "${BENCH_SPEC:-1}" = 1 ]; then  # SPEC_ONLY_FLAGS: flags of the EAGLE3 server alone;
      # SPEC_TAG names this run's files (two runs in one $OUT)
      T=${SPEC_TAG:+_$SPEC_TAG}
      # SPEC_SECTIONS=1: every served worker's step sections (GYRFALCON_SECTION_TIMES)
      ${SPEC_SECTIONS:+env GYRFALCON_SECTION_TIMES=$OUT/sections$T} \
      python3 benchmarks/bench_spec.py --model "$GYRFALCON_SMOLLM2_GGUF" \
        --draft-model "$DRAFTER" --dataset .data/mt_bench_dev.jsonl --device cuda \
        --concurrency ${CONCURRENCY:-1,16} --min-waves ${SPEC_WAVES:-0} --device-kind "$KIND" --output-dir "$OUT" \
        --rounds ${SPEC_ROUNDS:-1} $([ "${SPEC_ROUNDS:-1}" -gt 1 ] && echo "--kv-cache-memory 8GiB") \
        ${SPEC_TAG:+--tag "smollm2$T"} --spec-flags="${SPEC_ONLY_FLAGS:-}" \
        ${SPEC_AB_TREES:+--ab-trees "$SPEC_AB_TREES"} \
        --log-dir "$OUT/spec_logs$T" --log-stats-interval 2 ${SPEC_FLAGS:-} \
        > "$OUT/bench_spec$T.log" 2>&1; echo "bench_spec exit $?"; tail -15 "$OUT/bench_spec$T.log"
      for f in "$OUT"/spec_logs"$T"/*.log; do  # NOTE: the stats lines, not every request's
        grep -avE "HTTP/1.1|it/s\]" "$f" | tail -c 4000000 > "$f.tmp" && mv "$f.tmp" "$f"
      done
    fi
    if [ "${STEP:-1}" = 1 ]; then
      S="python3 benchmarks/bench_spec_step.py --device-kind $KIND --output-dir $OUT --load-format dummy"
      S="$S --attention-backend triton"  # NOTE: no flashinfer module build (~90 s) for decode steps
      [ "${STEP_8B:-1}" = 1 ] && $S benchmarks/models/llama-3.1-8b benchmarks/models/llama-3.1-8b-eagle3 \
        --steps 40 --kv-cache-memory 16GiB --profile-dir "$OUT/host_profile_8b" 2>&1 | tail -6
      $S benchmarks/models/smollm2-135m benchmarks/models/smollm2-135m-eagle3 --steps 200 \
        --batch-sizes 1,16 --kv-cache-memory 4GiB --profile-dir "$OUT/host_profile_smollm2" \
        2>&1 | tail -5
      (cd "$OUT" && tar czf host_profiles.tgz host_profile_* && rm -rf host_profile_*)
    fi ;;
  gemv)  # the skinny GEMM's tiles on this GPU: bench_gemv over GEMV_MODELS (default the 8B,
    # its tp-2 share and SmolLM2) with the fused down swept over every FMA tile; it prints
    # the table entries that beat the engine's pick by > 3% (kernels/gemv_config.py _TUNED_BY_GPU:
    # add them, then A/B in the model with ab-decode), then the GPU gemv tests
    python3 benchmarks/bench_gemv.py --device-kind "$KIND" --fused-grid --ms 1,4,16 --sweep-ms 1,4 \
      --models "${GEMV_MODELS:-llama-3.1-8b,llama-3.1-8b-tp2,smollm2-135m}" --time-budget 240 \
      --output-json "$OUT/gemv_$KIND.json" > "$OUT/gemv.log" 2>&1; echo "bench_gemv exit $?"
    sed -n '/^swept bests/,$p' "$OUT/gemv.log"
    python3 -m pytest -m gpu test/gpu/test_gemv_gpu.py -q -p no:cacheprovider > "$OUT/gpu_tests_gemv.log" 2>&1
    echo "pytest exit $?"; tail -2 "$OUT/gpu_tests_gemv.log" ;;
  tests)
    nvidia-smi -L
    python3 -m pytest -m gpu test/gpu ${PYTEST_K:+-k "$PYTEST_K"} -q -p no:cacheprovider -rA --durations=10 \
      > "$OUT/gpu_tests.log" 2>&1
    echo "pytest exit $?"; tail -40 "$OUT/gpu_tests.log" ;;
  bench)  # PROFILE=0 skips the kernel profiles, EAGER=0 the eager SmolLM2 run, PDL_BS=1,64
    # adds the 8B with --disable-pdl
    B="python3 benchmarks/bench_decode.py --device-kind $KIND"
    P8="" PS=""
    if [ "${PROFILE:-1}" = 1 ]; then
      P8="--profile-dir $OUT/profile_llama8b" PS="--profile-dir $OUT/profile_smollm2"
    fi
    $B --model benchmarks/models/llama-3.1-8b --load-format dummy --batch-sizes "${BS:-1,8,32,64,128,256}" \
      --output-json "$OUT/decode_llama8b.json" $P8 2>&1 | tail -12
    if [ -n "${PDL_BS:-}" ]; then  # the 8B with --disable-pdl at these batch sizes
      $B --model benchmarks/models/llama-3.1-8b --load-format dummy --batch-sizes "$PDL_BS" \
        --disable-pdl --output-json "$OUT/decode_llama8b_nopdl.json" 2>&1 | tail -8
    fi
    # NOTE: the first SmolLM2 run on a fresh machine JIT-builds flashinfer's head-dim-64
    # prefill module; the two runs that did read the launch-bound figure 36-52% low (889 at 67ca719,
    # 1,181 at 69a382f): one short untimed run builds it first
    $B --model benchmarks/models/smollm2-135m --load-format dummy --batch-sizes 1 --steps 8 \
      --output-json /tmp/decode_smollm2_warm.json >/dev/null 2>&1
    $B --model benchmarks/models/smollm2-135m --load-format dummy --batch-sizes 1 --steps 256 \
      --output-json "$OUT/decode_smollm2_graphs.json" $PS 2>&1 | tail -4
    $B --model benchmarks/models/smollm2-135m --load-format dummy --batch-sizes 1 --steps 256 \
      --disable-pdl --output-json "$OUT/decode_smollm2_graphs_nopdl.json" ${PS:+${PS}_nopdl} 2>&1 | tail -2
    if [ "${EAGER:-1}" = 1 ]; then
      $B --model benchmarks/models/smollm2-135m --load-format dummy --batch-sizes 1 --steps 64 \
        --enforce-eager --output-json "$OUT/decode_smollm2_eager.json" 2>&1 | tail -4
    fi
    if [ -n "$P8" ]; then (cd "$OUT" && tar czf profiles.tgz profile_* && rm -rf profile_*); fi ;;
esac
