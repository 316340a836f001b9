#!/usr/bin/env bash
# The source trees of older commits, for `gpu_checks.sh ab-decode` and `ab-spec` (carry
# .ab): each COMMIT's python/, the benchmarks those modes run and the model configs into
# .ab/<commit>/. COMMIT:PATCH makes a variant: that tree with PATCH (git diff format,
# paths from the repository root) applied, in .ab/<commit>+<patch file's stem>/ (an A/B
# of one change switched off, say, without a flag for it in the code).
#   usage: benchmarks/ab_trees.sh c553f52 [COMMIT[:PATCH]...]
set -euo pipefail
cd "$(dirname "$0")/.."
for arg in "$@"; do
  c=${arg%%:*} patch=""
  [ "$arg" = "$c" ] || patch=$(realpath "${arg#*:}")
  name=$(git rev-parse --short "$c")${patch:++$(basename "${patch%.*}")}
  rm -rf ".ab/$name" && mkdir -p ".ab/$name"
  git archive "$c" python benchmarks/bench_decode.py benchmarks/bench_spec.py \
    benchmarks/bench_spec_step.py benchmarks/models | tar x -C ".ab/$name"
  [ -z "$patch" ] || (cd ".ab/$name" && patch -p1 -s < "$patch")
  echo ".ab/$name: $(du -sh ".ab/$name" | cut -f1)"
done
