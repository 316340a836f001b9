#!/usr/bin/env bash
# The source trees of older commits, for `gpu_checks.sh ab-decode` and `ab-spec` (carry
# .ab): each COMMIT's python/, the benchmarks those modes run and the model configs into
# .ab/<commit>/. COMMIT:PATCH makes a variant: that tree with PATCH (git diff format,
# paths from the repository root) applied, in .ab/<commit>_<patch file's stem>/ (an A/B
# of one change switched off, say, without a flag for it in the code; '_', not '+': files
# whose names hold a '+' do not come back from the device).
#   usage: benchmarks/ab_trees.sh c553f52 [COMMIT[:PATCH]...]
set -euo pipefail
cd "$(dirname "$0")/.."
for arg in "$@"; do
  c=${arg%%:*} patch=""
  [ "$arg" = "$c" ] || patch=$(realpath "${arg#*:}")
  name=$(git rev-parse --short "$c")${patch:+_$(basename "${patch%.*}")}
  rm -rf ".ab/$name" && mkdir -p ".ab/$name"
  # NOTE: the paths the commit has (c553f52, the floors' tree, predates the spec benchmarks)
  paths=()
  for p in python benchmarks/bench_decode.py benchmarks/bench_spec.py \
    benchmarks/bench_spec_step.py benchmarks/models; do
    git cat-file -e "$c:$p" 2>/dev/null && paths+=("$p")
  done
  git archive "$c" "${paths[@]}" | tar x -C ".ab/$name"
  [ -z "$patch" ] || (cd ".ab/$name" && patch -p1 -s < "$patch")
  echo ".ab/$name: $(du -sh ".ab/$name" | cut -f1)"
done
