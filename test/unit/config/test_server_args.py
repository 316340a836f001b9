import argparse

import pytest

from gyrfalcon.config.attention import default_attention_backend
from gyrfalcon.config.cli_args import parse_size
from gyrfalcon.config.server_args import ServerArgs


def parse(*argv):
    p = argparse.ArgumentParser()
    ServerArgs.add_cli_args(p)
    return ServerArgs.from_cli_args(p.parse_args(list(argv)))


def test_cli_defaults_come_from_the_dataclass():
    assert parse() == ServerArgs()
    a = parse("m.gguf", "--port", "9000", "--enforce-eager", "--mem-fraction", "0.5")
    assert (a.model, a.port, a.enforce_eager, a.mem_fraction) == ("m.gguf", 9000, True, 0.5)


def test_bad_choice_is_rejected():
    with pytest.raises(SystemExit):
        parse("--dtype", "int3")


def test_parse_size():
    assert parse_size("2GiB") == 2 << 30
    assert parse_size("512MiB") == 512 << 20
    assert parse_size("1.5GB") == 1_500_000_000
    assert parse_size("4096") == 4096


def test_resolved_on_cpu():
    a = ServerArgs(device="cpu").resolved()
    assert (a.dtype, a.attention_backend, a.graph_mode()) == ("float32", "torch_ref", None)
    assert ServerArgs(device="cpu", static_graph_replay=True).resolved().graph_mode() == "static"
    assert ServerArgs(cuda_graph_bs="1, 4,8").graph_batch_sizes() == [1, 4, 8]


def test_decode_backend_resolution():
    cpu = ServerArgs(device="cpu").resolved()
    assert cpu.decode_attention_backend == "torch_ref"
    tri = ServerArgs(device="cpu", attention_backend="triton").resolved()
    assert tri.decode_attention_backend == "triton"
    fi = ServerArgs(device="cuda", dtype="bfloat16", attention_backend="flashinfer").resolved()
    assert fi.decode_attention_backend == "triton"  # faster decode kernels; see the help
    both = ServerArgs(
        device="cuda", attention_backend="flashinfer", decode_attention_backend="flashinfer"
    ).resolved()
    assert both.decode_attention_backend == "flashinfer"


def test_default_backend_never_picks_flashinfer_where_it_has_no_kernels():
    assert default_attention_backend("cpu", "bfloat16", 128) == "torch_ref"
    assert default_attention_backend("cuda", "float32", 128) == "triton"
    assert default_attention_backend("cuda", "bfloat16", 16) == "triton"


def test_step_budgets_default_by_device_and_respect_explicit_values():
    cpu = ServerArgs(device="cpu").resolved()
    assert (cpu.chunked_prefill_size, cpu.max_num_batched_tokens) == (2048, 8192)
    gpu = ServerArgs(device="cuda", dtype="bfloat16").resolved()
    assert (gpu.chunked_prefill_size, gpu.max_num_batched_tokens) == (8192, 16384)
    mine = ServerArgs(device="cuda", chunked_prefill_size=512, max_num_batched_tokens=1024)
    assert mine.resolved().chunked_prefill_size == 512
    assert parse("--chunked-prefill-size", "64").chunked_prefill_size == 64


def test_fp8_kv_cache_resolves_to_backends_that_read_it(monkeypatch):
    import torch

    from gyrfalcon.config import resolve

    fp8 = ServerArgs(device="cuda", dtype="bfloat16", kv_cache_dtype="fp8_e4m3")
    monkeypatch.setattr(resolve, "default_attention_backend", lambda *a: "flashinfer")
    a = fp8.resolved()
    assert (a.attention_backend, a.decode_attention_backend) == ("triton", "triton")
    assert a.kv_dtype(torch.bfloat16) == torch.float8_e4m3fn
    assert ServerArgs().kv_dtype(torch.bfloat16) == torch.bfloat16
    with pytest.raises(ValueError, match="fp8_e4m3"):
        ServerArgs(
            device="cuda", attention_backend="flashinfer", kv_cache_dtype="fp8_e4m3"
        ).resolved()
    assert parse("--kv-cache-dtype", "fp8_e4m3").kv_cache_dtype == "fp8_e4m3"
    with pytest.raises(SystemExit):
        parse("--kv-cache-dtype", "fp8_e5m2")


def test_speculative_flags_resolve_k_and_k_plus_one():
    a = parse("--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", "d")
    r = a.resolved()
    assert (r.speculative_num_steps, r.speculative_num_draft_tokens, r.num_draft_tokens) == (
        3,
        4,
        3,
    )
    r = parse(
        "--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", "d",
        "--speculative-num-draft-tokens", "6",
    ).resolved()  # fmt: skip
    assert (r.speculative_num_steps, r.num_draft_tokens) == (5, 5)
    assert ServerArgs().resolved().num_draft_tokens == 0


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(speculative_algorithm="MEDUSA", speculative_draft_model_path="d"), "only EAGLE3"),
        (dict(speculative_algorithm="EAGLE3"), "--speculative-draft-model-path"),
        (dict(speculative_draft_model_path="d"), "needs --speculative-algorithm"),
        (
            dict(speculative_algorithm="EAGLE3", speculative_draft_model_path="d",
                 speculative_eagle_topk=4),
            "tree drafting",
        ),
        (
            dict(speculative_algorithm="EAGLE3", speculative_draft_model_path="d",
                 speculative_num_steps=3, speculative_num_draft_tokens=8),
            "must be --speculative-num-steps \\+ 1 = 4",
        ),
        (
            dict(speculative_algorithm="EAGLE3", speculative_draft_model_path="d",
                 speculative_num_steps=0),
            "at least 1",
        ),
        (dict(tp_size=0), "--tp-size must be at least 1"),
        (dict(dp_size=0), "--dp-size must be at least 1"),
        (dict(tp_size=2, dist_timeout=0), "--dist-timeout must be positive"),
        (dict(tp_size=2, ep_size=3), "--ep-size 3 must be 1 \\(MoE-TP\\), the tp size 2 or"),
        (dict(ep_size=2), "--ep-size 2 must be 1 \\(MoE-TP\\), the tp size 1 or tp x dp = 1"),
        # values no server runs with: a worker failed after the launch (page size, pages),
        # requests hung (no running slot) or every one got 503 (a negative queue)
        (dict(page_size=0), "--page-size must be at least 1, got 0"),
        (dict(num_kv_pages=1), "--num-kv-pages must be at least 2, got 1"),
        (dict(max_num_seqs=0), "--max-num-seqs must be at least 1, got 0"),
        (dict(max_queue_len=-1), "--max-queue-len must be at least 0, got -1"),
        (dict(max_model_len=0), "--max-model-len must be at least 1, got 0"),
        (dict(max_num_batched_tokens=0), "--max-num-batched-tokens must be at least 1"),
        (dict(chunked_prefill_size=0), "--chunked-prefill-size must be at least 1 \\(or -1"),
        (dict(cuda_graph_max_bs=0), "--cuda-graph-max-bs must be at least 1"),
        (dict(piecewise_cuda_graph_max_tokens=-1), "--piecewise-cuda-graph-max-tokens must be"),
        (dict(mem_fraction=0.0), "--mem-fraction must be in \\(0, 1\\], got 0.0"),
        (dict(mem_fraction=1.5), "--mem-fraction must be in \\(0, 1\\], got 1.5"),
        (dict(schedule_conservativeness=-0.5), "--schedule-conservativeness must be >= 0"),
        (dict(log_stats_interval=-1.0), "--log-stats-interval must be >= 0"),
        (dict(kv_cache_memory="lots"), "--kv-cache-memory takes a size like 2GiB"),
        (dict(max_cpu_kv_memory="8 gigs"), "--max-cpu-kv-memory takes a size like 2GiB"),
        (dict(cuda_graph_bs="0,1"), "--cuda-graph-bs takes batch sizes >= 1"),
        (dict(cuda_graph_bs="1,x"), "--cuda-graph-bs takes batch sizes >= 1"),
        (dict(attention_backend="flashinfer"), "flashinfer attention backend runs on CUDA only"),
    ],
)  # fmt: skip
def test_bad_flag_values_fail_at_start_up(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ServerArgs(device="cpu", **kwargs).resolved()


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--nnodes", "2", "--node-rank", "2", "--dist-init-addr", "h:5000"],
         "--node-rank 2 is not in [0, 2) (--nnodes 2)"),
        (["--node-rank", "-1"], "--node-rank -1 is not in [0, 1)"),
        (["--nnodes", "0"], "--nnodes must be at least 1"),
        (["--tp-size", "3", "--nnodes", "2", "--dist-init-addr", "h:5000"],
         "the 3 worker ranks (--tp-size x --dp-size) do not split evenly over --nnodes 2"),
        (["--tp-size", "2", "--nnodes", "2"], "--nnodes 2 needs --dist-init-addr HOST:PORT"),
        (["--tp-size", "2", "--dist-init-addr", "h"], "--dist-init-addr 'h' is not HOST:PORT"),
        (["--dist-init-addr", "tcp://h:99999"], "'tcp://h:99999' is not HOST:PORT"),
    ],
)  # fmt: skip
def test_bad_node_flags_fail_when_parsed(argv, message, capsys):
    """Before any model loads: the dataclass refuses them, and `gyrfalcon serve` exits
    2 with the message (argparse's usage error)."""
    import re

    from gyrfalcon.cli import main

    with pytest.raises(ValueError, match=re.escape(message)):
        parse(*argv)
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", *argv])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err.splitlines()[-1]


def test_ranks_split_evenly_over_the_nodes():
    a = parse("--tp-size", "4", "--dp-size", "2", "--nnodes", "2", "--node-rank", "1",
              "--dist-init-addr", "10.0.0.1:5000")  # fmt: skip
    assert a.node_ranks() == range(4, 8)
    assert ServerArgs(tp_size=4).node_ranks() == range(0, 4)  # one node: every rank
    r = a.resolved()
    assert r.dist_init_addr == "tcp://10.0.0.1:5000"  # SGLang's form, as torch takes it
    assert parse("--dist-init-addr", "tcp://h:1").resolved().dist_init_addr == "tcp://h:1"
    assert ServerArgs().resolved().dist_init_addr is None


@pytest.mark.parametrize(
    "kw,flag",
    [
        (dict(request_timeout=0), "--request-timeout"),
        (dict(shutdown_timeout=-1), "--shutdown-timeout"),
        (dict(max_request_body_bytes=0), "--max-request-body-bytes"),
    ],
)
def test_serving_limits_are_checked_at_parse_time(kw, flag):
    with pytest.raises(ValueError, match=flag):
        ServerArgs(**kw)


def test_api_server_count_defaults_to_one_a_dp_rank_and_must_be_positive():
    assert ServerArgs().resolved().api_server_count == 1
    assert parse("--dp-size", "2").resolved().api_server_count == 2  # vLLM's default
    assert parse("--dp-size", "4", "--tp-size", "2").num_api_servers == 4
    assert parse("--tp-size", "2").num_api_servers == 1  # one DP group
    assert parse("--api-server-count", "3").resolved().api_server_count == 3
    assert parse("--dp-size", "2", "--api-server-count", "1").resolved().api_server_count == 1
    for bad in ("0", "-2"):
        with pytest.raises(ValueError, match="--api-server-count must be >= 1"):
            parse("--api-server-count", bad)


def test_chunked_prefill_size_minus_one_is_sglangs_no_chunking():
    """A prompt may then take a whole step's token budget."""
    r = ServerArgs(device="cpu", chunked_prefill_size=-1, max_num_batched_tokens=3000).resolved()
    assert r.chunked_prefill_size == 3000


def test_max_model_len_beyond_the_models_positions_is_refused():
    from conftest import tiny_target_config

    cfg = tiny_target_config()
    ServerArgs(device="cpu", max_model_len=cfg.max_position_embeddings).resolved(cfg)
    with pytest.raises(ValueError, match=f"exceeds the model's {cfg.max_position_embeddings}"):
        ServerArgs(device="cpu", max_model_len=cfg.max_position_embeddings + 1).resolved(cfg)
