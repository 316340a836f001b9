"""benchmarks/run_config.sh end to end on the CPU: it serves a config (a tiny model,
two DP groups), benchmarks it at each concurrency, writes the JSON and the markdown
rows, checks that every KV page came back on every rank, and stops the server. Every
concurrency's prompts are its own, so no burst finds an earlier one's in the cache."""

import json
import os
import subprocess
import sys
from pathlib import Path

from conftest import make_tiny_hf_model

ROOT = Path(__file__).resolve().parents[2]


def test_run_config_benchmarks_a_config_and_finds_every_page_back(tmp_path):
    from gyrfalcon.bench.synthetic_tokenizer import make_synthetic_tokenizer

    model, tok = tmp_path / "model", tmp_path / "tok"
    make_tiny_hf_model(str(model), "llama")
    make_synthetic_tokenizer(str(model), str(tok))
    config = tmp_path / "tiny_dp2.sh"
    config.write_text(
        "#!/usr/bin/env bash\nset -euo pipefail\n"
        f'exec gyrfalcon serve {model} --tokenizer {tok} --port "$PORT" --device cpu '
        '--dtype float32 --dp-size 2 --cpu-threads 1 --check-invariants "$@"\n'
    )
    out = tmp_path / "results"
    env = {
        **os.environ, "PYTHON": sys.executable, "PORT": "0", "CONCURRENCIES": "1 2",
        "INPUT_LEN": "24", "OUTPUT_LEN": "6", "NUM_PROMPTS": "4", "DEVICE_KIND": "cpu-test",
        "BENCH_FLAGS": f"--tokenizer {tok}", "CONFIG_ARGS": "--served-model-name tiny-x",
    }  # fmt: skip
    from gyrfalcon.utils import free_port

    env["PORT"] = str(free_port())
    run = subprocess.run(
        ["bash", str(ROOT / "benchmarks" / "run_config.sh"), str(config), str(out)],
        env=env, capture_output=True, text=True, timeout=600, cwd=tmp_path,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
    assert "free on all ranks, integrity ok" in run.stdout, run.stdout
    for c in (1, 2):
        report = json.loads((out / f"tiny_dp2_c{c}_cpu-test.json").read_text())
        assert report["summary"]["completed"] == 4 and report["summary"]["failed"] == 0
        assert report["model"] == "tiny-x"  # CONFIG_ARGS reached the server
        # each concurrency sends prompts of its own: none found computed by an earlier one
        assert report["summary"]["total_cached_input_tokens"] == 0, report["per_request"]
    rows = (out / "run_config.md").read_text().splitlines()
    assert sum(row.startswith("| tiny_dp2 | cpu-test |") for row in rows) == 2
    server_log = (out / "tiny_dp2_cpu-test_server.log").read_text()
    assert "2 worker rank(s)" in server_log
