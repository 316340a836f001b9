#!/usr/bin/env bash
# The source trees of older commits, for `gpu_checks.sh ab-decode` and `ab-spec` (carry
# .ab): each COMMIT's python/, the benchmarks those modes run and the model configs into
# .ab/<commit>/.
#   usage: benchmarks/ab_trees.sh c553f52 [COMMIT...]
set -euo pipefail
cd "$(dirname "$0")/.."
for c in "$@"; do
  short=$(git rev-parse --short "$c")
  rm -rf ".ab/$short" && mkdir -p ".ab/$short"
  git archive "$c" python benchmarks/bench_decode.py benchmarks/bench_spec.py \
    benchmarks/bench_spec_step.py benchmarks/models | tar x -C ".ab/$short"
  echo ".ab/$short: $(du -sh ".ab/$short" | cut -f1)"
done
