#!/usr/bin/env python3
"""Serving load generator; same as ``gyrfalcon bench serve ARGS``.

Example::

    python benchmarks/bench_serving.py --num-prompts 200 --request-rate 8 \
        --random-input-len 512 --random-output-len 128 --output-json out.json
"""

from __future__ import annotations

import sys
from pathlib import Path

try:
    from gyrfalcon.bench.serving import main
except ImportError:  # running from a checkout without an installed package
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))
    from gyrfalcon.bench.serving import main

if __name__ == "__main__":
    sys.exit(main())
