#!/usr/bin/env bash
# The source trees of older commits, for `gpu_checks.sh ab-decode` (carry .ab): each
# COMMIT's python/ and benchmarks/bench_decode.py into .ab/<commit>/.
#   usage: benchmarks/ab_trees.sh c553f52 [COMMIT...]
set -euo pipefail
cd "$(dirname "$0")/.."
for c in "$@"; do
  short=$(git rev-parse --short "$c")
  rm -rf ".ab/$short" && mkdir -p ".ab/$short"
  git archive "$c" python benchmarks/bench_decode.py | tar x -C ".ab/$short"
  echo ".ab/$short: $(du -sh ".ab/$short" | cut -f1)"
done
