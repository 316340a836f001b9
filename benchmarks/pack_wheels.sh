#!/usr/bin/env bash
# Fill .whl/ for the GPU machine (run here, from the repo root, before the first device
# call of a session): ../shared/gpu/pack-wheels.sh's server, flashinfer, gguf and xgrammar
# packages, then what they leave out: prometheus-client (/metrics) and xgrammar's
# jsonschema stack (structured output; its apache-tvm-ffi comes with flashinfer's). gpu_checks.sh refuses a .whl without them (a fresh checkout's first
# call lost ~100 s of device time to that, stop 49). ~43 MiB: carry it beside the tree
# alone or with .ab / .data, not with a .stage part.
#   usage: benchmarks/pack_wheels.sh
set -euo pipefail
cd "$(dirname "$0")/.."
bash ../shared/gpu/pack-wheels.sh server flashinfer gguf xgrammar
# NOTE: what the shared groups leave out (they download without dependencies)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
  -d .whl prometheus-client jsonschema attrs referencing jsonschema-specifications rpds-py \
  uvloop httptools 2>&1 | grep -v '^WARNING: Location' || true
# NOTE: nothing on the GPU machine imports the openai client (tests and benchmarks speak
# HTTP themselves): its ~2.8 MiB make room for uvloop's within the 64 MiB a call carries
rm -f .whl/openai-*.whl .whl/jiter-*.whl
for p in prometheus_client xgrammar uvloop httptools; do
  compgen -G ".whl/$p-*.whl" >/dev/null || { echo "no $p wheel in .whl" >&2; exit 1; }
done
echo ".whl: $(ls .whl | wc -l) wheels, $(du -sh .whl | cut -f1)"
