"""Where a benchmark result came from: the commit of the code that produced it."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path


def git_commit() -> str:
    """Short commit of this checkout, or $GYRFALCON_COMMIT in a copy without .git
    (the GPU machine), or "unknown"."""
    if os.environ.get("GYRFALCON_COMMIT"):
        return os.environ["GYRFALCON_COMMIT"]
    try:
        cmd = ["git", "rev-parse", "--short", "HEAD"]
        here = Path(__file__).resolve().parent
        return subprocess.check_output(cmd, cwd=here, text=True, stderr=subprocess.DEVNULL).strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
