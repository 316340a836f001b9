"""benchmarks/bench_decode.py on CPU: its JSON, and its hand-built plans against LocalEngine."""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest
import torch

from gyrfalcon.bench.decode_driver import Driver
from gyrfalcon.bench.roofline import kv_read_bytes, roofline_step_ms, weight_bytes
from gyrfalcon.config.model_config import ModelConfig
from gyrfalcon.config.server_args import ServerArgs
from gyrfalcon.engine import LocalEngine
from gyrfalcon.ipc.messages import SamplingParams
from gyrfalcon.worker.bootstrap import build_worker

ROOT = Path(__file__).resolve().parents[3]
SMOL = ROOT / "benchmarks" / "models" / "smollm2-135m"


@pytest.fixture(scope="module")
def bench() -> Iterator[ModuleType]:
    name = "gyrfalcon_bench_decode_script"
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / "bench_decode.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # dataclasses look their module up there
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a shared CI core is slower to contend for than to give up
    try:
        spec.loader.exec_module(mod)
        yield mod
    finally:
        torch.set_num_threads(threads)
        sys.modules.pop(name, None)


def test_main_writes_decode_json(bench: ModuleType, tmp_path: Path) -> None:
    out = tmp_path / "sub" / "decode.json"
    argv = [
        "--model", str(SMOL), "--load-format", "dummy", "--device", "cpu",
        "--batch-sizes", "1,2", "--context", "20", "--steps", "2", "--warmup", "1",
        "--prefill-tokens", "32", "--bandwidth-bytes", "8MiB", "--device-kind", "cpu-test",
        "--output-json", str(out), "--page-size", "8", "--log-level", "warning",
        "--profile-dir", str(tmp_path / "prof"),
    ]  # fmt: skip
    assert bench.main(argv) == 0
    res = json.loads(out.read_text())
    assert "(submit)" in (tmp_path / "prof" / "host_profile_bs2.txt").read_text()
    for key in ("bench", "device_kind", "model", "commit", "dtype", "attention_backend"):
        assert isinstance(res[key], str) and res[key]
    assert res["bench"] == "decode" and res["device_kind"] == "cpu-test"
    assert res["model"] == "smollm2-135m" and res["dtype"] == "float32"
    assert res["attention_backend"] == "torch_ref"
    assert res["bandwidth_bytes_per_s"] > 0 and res["bandwidth_source"] == "measured"
    # the ServerArgs flag went through; KV pages sized for the largest batch
    assert res["server_args"]["page_size"] == 8
    assert res["server_args"]["num_kv_pages"] == 1 + 2 * 5  # ceil((20 + 1 + 2 * 2 + 2 + 8) / 8)
    assert [r["batch_size"] for r in res["rows"]] == [1, 2]
    cfg = ModelConfig.from_dir(str(SMOL))
    for r in res["rows"]:
        assert r["context"] == 20 and r["step_ms"] > 0 and r["prefill_s"] > 0
        assert r["tok_s"] == pytest.approx(r["batch_size"] * 1e3 / r["step_ms"])
        assert 0 < r["step_ms_sync_min"] <= r["step_ms_sync_median"] <= r["step_ms_sync"] * 2
        assert r["mean_kv_len"] == 20 + 1 + 1.5
        kv = kv_read_bytes(cfg, r["batch_size"], 1, 4) * r["mean_kv_len"]
        want = roofline_step_ms(weight_bytes(cfg, 4), kv, res["bandwidth_bytes_per_s"])
        assert r["roofline_step_ms"] == pytest.approx(want)


def test_given_bandwidth_and_bad_flags(bench: ModuleType, tmp_path: Path) -> None:
    ns = argparse.Namespace(
        load_format="dummy", dtype="auto", attention_backend="auto", device="cpu", seed=3
    )
    args = bench.server_args(ns, ["--enforce-eager", "--max-num-seqs", "7"], str(SMOL))
    assert args.enforce_eager and args.max_num_seqs == 7 and args.seed == 3
    assert args.dtype == "float32" and args.model == str(SMOL)
    with pytest.raises(SystemExit):
        bench.server_args(ns, ["stray"], str(SMOL))
    with pytest.raises(SystemExit):
        bench.main(["--model", str(SMOL), "--no-such-flag"])
    with pytest.raises(SystemExit):  # a config-only directory needs --load-format dummy
        bench.main(["--model", str(SMOL), "--device", "cpu"])
    with pytest.raises(SystemExit):  # graph buffers would be too short for the run
        bench.main(["--model", str(SMOL), "--load-format", "dummy", "--max-model-len", "16"])
    with pytest.raises(SystemExit):  # past the model's 8192 positions
        bench.main(["--model", str(SMOL), "--load-format", "dummy", "--context", "8190"])


TINY = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 96,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-5,
    "eos_token_id": 95,
}


def test_driver_plans_match_local_engine(tmp_path: Path) -> None:
    """Chunked prefill + decode through hand-built plans gives the engine's greedy tokens."""
    (tmp_path / "config.json").write_text(json.dumps(TINY))
    args = ServerArgs(
        model=str(tmp_path), device="cpu", dtype="float32", load_format="dummy", page_size=4,
        num_kv_pages=40, max_model_len=64,
    ).resolved()  # fmt: skip
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 90, (n,), generator=gen).tolist() for n in (9, 3, 6)]
    steps = 5
    cfg = ModelConfig.from_dir(str(tmp_path))
    runner = build_worker(args, str(tmp_path), cfg, rank=0)[0]
    driver = Driver(runner, args.page_size, args.num_kv_pages)
    free_before = sorted(driver.free_pages)
    driver.prefill(prompts, token_cap=4)  # chunks split prompts across plans
    assert driver.step_id == 5  # 18 prompt tokens in plans of at most 4
    got = [[s.last] for s in driver.seqs]
    for _ in range(steps):
        driver.decode()
        for out, s in zip(got, driver.seqs):
            out.append(s.last)
    assert [s.kv_len for s in driver.seqs] == [n + steps for n in (9, 3, 6)]
    assert [len(s.pages) for s in driver.seqs] == [4, 2, 3]
    driver.release()
    assert sorted(driver.free_pages) == free_before and not runner.requests

    engine = LocalEngine(args, str(tmp_path))
    sampling = SamplingParams(temperature=0.0, max_tokens=steps + 1, ignore_eos=True)
    assert engine.generate(prompts, sampling) == got

    # pages handed out in random order (as a long-running server's): same tokens
    shuffled = Driver(runner, args.page_size, args.num_kv_pages, shuffle_seed=3)
    assert shuffled.free_pages != driver.free_pages
    shuffled.prefill(prompts, token_cap=4)
    again = [[s.last] for s in shuffled.seqs]
    for _ in range(steps):
        shuffled.decode()
        for out, s in zip(again, shuffled.seqs):
            out.append(s.last)
    assert again == got
    shuffled.release()

    # overlapped: inputs filled on the device from the previous step; same tokens
    driver.prefill(prompts, token_cap=4)
    driver.decode_overlapped(steps)  # two steps in flight at a time
    assert [s.last for s in driver.seqs] == [g[steps] for g in got]
    driver.release()
    assert sorted(driver.free_pages) == free_before


def test_main_through_static_graph_replay(bench: ModuleType, tmp_path: Path) -> None:
    """A graph flag of ServerArgs reaches the runner; batch 3 is padded into a graph of 4."""
    out = tmp_path / "decode.json"
    (tmp_path / "config.json").write_text(json.dumps(TINY))
    argv = [
        "--model", str(tmp_path), "--load-format", "dummy", "--device", "cpu", "--batch-sizes", "3",
        "--context", "8", "--steps", "2", "--warmup", "1", "--bandwidth", "1e10",
        "--static-graph-replay", "--cuda-graph-max-bs", "4", "--output-json", str(out),
    ]  # fmt: skip
    assert bench.main(argv) == 0
    res = json.loads(out.read_text())
    assert res["graph_mode"] == "static" and max(res["graph_batch_sizes"]) == 4
    assert res["bandwidth_source"] == "given" and res["bandwidth_bytes_per_s"] == 1e10
    assert res["server_args"]["max_model_len"] == 8 + 1 + 2 * 2  # overlapped + synced steps
    assert res["rows"][0]["step_ms"] > 0 and res["rows"][0]["graph_steps"] == 2
