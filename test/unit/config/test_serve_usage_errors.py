"""`gyrfalcon serve` with a model, a tokenizer or a flag value it cannot serve with ends
as argparse ends on a bad flag: one line `gyrfalcon serve: error: <reason>`, exit code 2,
no traceback and no process started. Before, these were tracebacks (a missing model or
tokenizer path), a worker's failure after the launch (--page-size 0), or a server that
took requests and never answered them (--max-num-seqs 0)."""

from __future__ import annotations

import subprocess
import sys

import pytest
from conftest import make_tiny_hf_model


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("tiny"))
    make_tiny_hf_model(path, "llama")
    return path


@pytest.mark.parametrize(
    "args, reason",
    [
        (["{tmp}/missing"], "model path '{tmp}/missing' does not exist"),
        (["{tmp}"], "model directory '{tmp}' has no config.json"),
        (["{model}", "--tokenizer", "{tmp}/no-tokenizer"],
         "--tokenizer '{tmp}/no-tokenizer': no such directory"),
        (["{model}", "--max-num-seqs", "0"], "--max-num-seqs must be at least 1, got 0"),
        (["{model}", "--page-size", "0"], "--page-size must be at least 1, got 0"),
        (["{model}", "--max-model-len", "100000"], "--max-model-len 100000 exceeds the model's"),
    ],
)  # fmt: skip
def test_serve_exits_2_with_the_reason(model, tmp_path, args, reason):
    fill = dict(model=model, tmp=str(tmp_path))
    argv = [a.format(**fill) for a in args]
    cmd = [sys.executable, "-m", "gyrfalcon.cli", "serve", *argv, "--device", "cpu"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr[-2000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("gyrfalcon serve: error: " + reason.format(**fill)), last
    assert "Traceback" not in done.stderr and "worker" not in done.stderr
