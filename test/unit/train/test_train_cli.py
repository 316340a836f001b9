"""`gyrfalcon train-eagle3` end to end on a tiny random target with a synthetic
tokenizer (its chat template included): answers from the engine, features, a few
dozen steps of TTT training; the loss falls, the checkpoint and training_args.json
are written, and `build_draft_model` loads the checkpoint against the target."""

from __future__ import annotations

import json
import os
import random

import pytest
import torch
from conftest import make_tiny_hf_model

from gyrfalcon.bench.synthetic_tokenizer import make_synthetic_tokenizer
from gyrfalcon.cli import main as cli_main
from gyrfalcon.config.draft_config import DraftConfig
from gyrfalcon.config.model_config import ModelConfig
from gyrfalcon.layers.context import LayerContext
from gyrfalcon.loader.hf_weights import iter_hf_weights
from gyrfalcon.models.registry import build_draft_model, build_model

CPU = torch.device("cpu")
STEPS = 60


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("train-eagle3")
    target, tok = str(root / "target"), str(root / "tokenizer")
    model = make_tiny_hf_model(target, "llama", num_hidden_layers=4)  # aux layers (2, 2, 1)
    with torch.no_grad():  # NOTE: a peaked target (entropy ~0.9 nats, not ~4.3): learnable
        model.lm_head.weight.mul_(4)
    model.save_pretrained(target)
    make_synthetic_tokenizer(target, tok)
    rng = random.Random(0)
    with open(root / "prompts.jsonl", "w") as f:
        for _ in range(28):
            words = " ".join(f"<{rng.randint(3, 255)}>" for _ in range(rng.randint(3, 10)))
            f.write(json.dumps({"prompt": words}) + "\n")
    return root, target, tok


@pytest.fixture
def one_thread():
    """NOTE: tiny tensors: one torch thread is as fast alone and many times faster on a
    busy 2-core machine (threads spinning against other processes)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_train_eagle3_end_to_end(setup, one_thread):
    root, target_dir, tok = setup
    out = str(root / "drafter")
    argv = [
        "train-eagle3", "--target-model", target_dir, "--tokenizer", tok,
        "--prompts", str(root / "prompts.jsonl"), "--num-prompts", "0", "--holdout", "4",
        "--max-new-tokens", "20", "--max-steps", str(STEPS), "--batch-size", "4",
        "--lr", "1e-2", "--ttt-steps", "3", "--draft-vocab-size", "64", "--eval-every", "30",
        "--device", "cpu", "--kv-cache-memory", "16MiB", "--output-dir", out,
    ]  # fmt: skip
    assert cli_main(argv) == 0
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors", "training_args.json"]
    with open(os.path.join(out, "training_args.json")) as f:
        record = json.load(f)
    results = record["results"]
    assert record["args"]["max_steps"] == STEPS and record["args"]["prompts"].endswith(".jsonl")
    assert results["final_loss"] < 0.7 * results["initial_loss"], results
    assert [e["step"] for e in results["evaluations"]] == [30, 60]
    for e in results["evaluations"]:  # each evaluation's window of steps, before clipping
        assert e["grad_norm_median"] > 0 and 0.0 <= e["clipped_share"] <= 1.0
    assert len(results["acceptance"]) == 3 and results["mean_acceptance_length"] >= 1.0
    assert results["held_out_sequences"] == 4 and results["aux_layers"] == [2, 2, 1]
    # the features line up with the engine's answers (float32: the same argmax)
    assert results["greedy_agreement"] == 1.0

    # the server's loading path accepts it for this target (validate_draft included)
    target_cfg = ModelConfig.from_dir(target_dir)
    cfg = DraftConfig.from_dir(out)
    assert cfg.draft_vocab_size == 64 and cfg.eagle_aux_layer_ids is None
    assert (cfg.hidden_size, cfg.layer.num_heads, cfg.layer.num_kv_heads) == (64, 4, 2)
    assert cfg.layer.intermediate_size == target_cfg.intermediate_size
    ctx = LayerContext()
    target = build_model(target_cfg, target_dir, torch.float32, CPU, ctx, show_progress=False)
    drafter = build_draft_model(
        cfg, target_cfg, out, torch.float32, CPU, ctx, target.embed_tokens, show_progress=False
    )
    tensors = dict(iter_hf_weights(out, show_progress=False))
    assert tensors["fc.weight"].dtype == torch.float32  # CPU: float32 (CUDA: bfloat16)
    hot = torch.arange(64) + tensors["d2t"]
    assert torch.equal(drafter.to_target_ids(torch.arange(64)), hot)
    assert hot.tolist() == sorted(set(hot.tolist()))


def short_run(setup, name: str, *flags: str) -> dict:
    """A few training steps with `flags` on the setup's 28 prompts (4 held out); the
    run's training_args.json."""
    root, target_dir, tok_dir = setup
    out = str(root / f"drafter-{name}")
    argv = [
        "train-eagle3", "--target-model", target_dir, "--tokenizer", tok_dir,
        "--prompts", str(root / "prompts.jsonl"), "--num-prompts", "0", "--holdout", "4",
        "--max-new-tokens", "12", "--max-steps", "4", "--batch-size", "4", "--ttt-steps", "2",
        "--draft-vocab-size", "64", "--eval-every", "0", *flags,
        "--device", "cpu", "--kv-cache-memory", "16MiB", "--output-dir", out,
    ]  # fmt: skip
    assert cli_main(argv) == 0
    with open(os.path.join(out, "training_args.json")) as f:
        return json.load(f)


def test_follow_up_turns_add_second_answers(setup, one_thread):
    """--follow-up-turns N: N training prompts get a second turn (the target's answer,
    then a generic follow-up) answered by the target: N more training sequences whose
    trained part is the second answer; the held-out ones are unchanged."""
    from transformers import AutoTokenizer

    from gyrfalcon.train.data import FOLLOW_UPS, follow_up_conversations

    root, target_dir, tok_dir = setup
    tok = AutoTokenizer.from_pretrained(tok_dir)
    answer = tok.encode("<9> <11>", add_special_tokens=False)
    (conv,) = follow_up_conversations(tok, ["<5> <7>"], [answer], seed=0)

    def rendered(follow_up: str) -> list[int]:
        turns = [("user", "<5> <7>"), ("assistant", "<9> <11>"), ("user", follow_up)]
        messages = [{"role": r, "content": c} for r, c in turns]
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return tok.encode(text, add_special_tokens=False)

    assert any(conv == rendered(f) for f in FOLLOW_UPS)
    results = short_run(setup, "follow-up", "--follow-up-turns", "6")["results"]
    assert results["train_sequences"] == 24 + 6 and results["held_out_sequences"] == 4


def test_self_instructions_join_the_prompts(setup, one_thread, capsys):
    """--self-instructions N: the target writes N instructions first; the kept ones
    (logged, with examples) are answered as more prompts, held-out split included."""
    record = short_run(setup, "self-instructions", "--self-instructions", "24")
    kept = record["results"]["self_instructions"]
    assert record["args"]["self_instructions"] == 24 and 1 <= kept < 24
    sequences = record["results"]["train_sequences"] + record["results"]["held_out_sequences"]
    assert sequences == 28 + kept and record["results"]["held_out_sequences"] == 4
    assert f"{kept} of 24 self-written instructions kept (dropped: " in capsys.readouterr().err


def test_max_train_seconds_stops_early_and_saves(setup, one_thread):
    """--max-train-seconds: a run that would take 10,000 steps stops at the first
    check past the limit (every 10 steps), evaluates there and still writes a
    checkpoint the record names with its step count."""
    root, target_dir, tok_dir = setup
    out = str(root / "drafter-timed")
    argv = [
        "train-eagle3", "--target-model", target_dir, "--tokenizer", tok_dir,
        "--prompts", str(root / "prompts.jsonl"), "--num-prompts", "0", "--holdout", "4",
        "--max-new-tokens", "12", "--max-steps", "10000", "--batch-size", "4",
        "--ttt-steps", "2", "--draft-vocab-size", "64", "--eval-every", "0",
        "--max-train-seconds", "0.001",
        "--device", "cpu", "--kv-cache-memory", "16MiB", "--output-dir", out,
    ]  # fmt: skip
    assert cli_main(argv) == 0
    assert "model.safetensors" in os.listdir(out)
    with open(os.path.join(out, "training_args.json")) as f:
        results = json.load(f)["results"]
    assert results["steps"] == 10 and [e["step"] for e in results["evaluations"]] == [10]
    assert len(results["acceptance"]) == 2


def test_data_cache_keeps_the_generated_text_for_the_next_run(setup, one_thread, capsys):
    """--data-cache FILE: the first run generates and saves; a run with the same
    generation arguments loads the same text (so it trains to the same losses); a
    run with another --max-new-tokens generates again and says why."""
    cache = str(setup[0] / "data-cache.pt")
    first = short_run(setup, "cache-a", "--data-cache", cache)["results"]
    err = capsys.readouterr().err
    assert "generating: " in err and f"saved the generated text to {cache}" in err
    second = short_run(setup, "cache-b", "--data-cache", cache)["results"]
    err = capsys.readouterr().err
    assert f"28 sequences and 0 instructions from {cache}" in err and "generating" not in err
    assert second["train_sequences"] == first["train_sequences"] == 24
    assert second["initial_loss"] == pytest.approx(first["initial_loss"], rel=1e-6)
    assert second["final_loss"] == pytest.approx(first["final_loss"], rel=1e-6)
    short_run(setup, "cache-c", "--data-cache", cache, "--max-new-tokens", "10")
    err = capsys.readouterr().err
    assert "other arguments (max_new_tokens differ)" in err


def test_draft_intermediate_size_widens_the_midlayer_mlp(setup, one_thread):
    """--draft-intermediate-size: the checkpoint's MLP has that width, and the
    server's loader builds it against the target."""
    root, target_dir, _ = setup
    record = short_run(setup, "wide", "--draft-intermediate-size", "96")
    assert record["args"]["draft_intermediate_size"] == 96
    out = str(root / "drafter-wide")
    cfg = DraftConfig.from_dir(out)
    target_cfg = ModelConfig.from_dir(target_dir)
    assert cfg.layer.intermediate_size == 96 != target_cfg.intermediate_size
    ctx = LayerContext()
    target = build_model(target_cfg, target_dir, torch.float32, CPU, ctx, show_progress=False)
    drafter = build_draft_model(
        cfg, target_cfg, out, torch.float32, CPU, ctx, target.embed_tokens, show_progress=False
    )
    down = dict(drafter.named_parameters())["midlayer.mlp.down_proj.weight"]
    assert down.shape == (cfg.hidden_size, 96)


def test_aux_layer_ids_and_norm_before_residual_reach_the_served_drafter(setup, one_thread, capsys):
    """--aux-layer-ids (outputs of target layers, eagle_config's convention) and
    --norm-before-residual: the features come from those layers, the config says so,
    and the server's loader reads the drafter back with the same aux layers; ids the
    target lacks fail before any generation with the flag named."""
    root, target_dir, _ = setup
    record = short_run(setup, "aux", "--aux-layer-ids", "0,1,2", "--norm-before-residual")
    assert record["results"]["aux_layers"] == [1, 2, 3]  # inputs of layers j + 1
    out = str(root / "drafter-aux")
    with open(os.path.join(out, "config.json")) as f:
        hf = json.load(f)
    assert hf["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 1, 2]
    assert hf["norm_before_residual"] is True
    target_cfg = ModelConfig.from_dir(target_dir)
    ctx = LayerContext()
    target = build_model(target_cfg, target_dir, torch.float32, CPU, ctx, show_progress=False)
    drafter = build_draft_model(
        DraftConfig.from_dir(out), target_cfg, out, torch.float32, CPU, ctx,
        target.embed_tokens, show_progress=False,
    )  # fmt: skip
    assert drafter.aux_layer_ids(target_cfg.num_layers) == (1, 2, 3)
    assert drafter.cfg.norm_before_residual

    argv = [
        "train-eagle3", "--target-model", target_dir, "--prompts", str(root / "prompts.jsonl"),
        "--device", "cpu", "--output-dir", str(root / "drafter-bad"), "--aux-layer-ids", "0,1,4",
    ]  # fmt: skip
    capsys.readouterr()
    assert cli_main(argv) == 2
    err = capsys.readouterr().err
    assert "eagle_aux_hidden_state_layer_ids names the output of layer 4" in err
    assert "target engine ready" not in err and not os.path.exists(root / "drafter-bad")
    assert cli_main(argv[:-1] + ["1,2"]) == 2
    assert "--aux-layer-ids takes three layer ids" in capsys.readouterr().err


def test_the_server_accepts_what_the_trainer_estimates(setup, one_thread):
    """The trainer's acceptance "in rounds as served" is what a server gets: a drafter
    trained with --aux-layer-ids and --norm-before-residual, served with EAGLE3 (k = 3,
    greedy, float32) over prompts it never saw, takes exactly the verify steps that
    `evaluate` walks over the plain engine's answers to them. A server that read other
    aux layers or another residual layout than training would draft other tokens here:
    fewer accepted, the same output (silent, the losslessness tests cannot see it)."""
    import dataclasses

    from spec_util import engine, prompts, run

    from gyrfalcon.ipc.messages import SamplingParams
    from gyrfalcon.train.args import TrainArgs
    from gyrfalcon.train.data import generate_answers
    from gyrfalcon.train.evaluate import evaluate
    from gyrfalcon.train.features import compute_features
    from gyrfalcon.train.trainer import target_runner

    root, target_dir, _ = setup
    flags = ("--max-steps", "60", "--lr", "1e-2", "--ttt-steps", "3", "--max-new-tokens", "20")
    short_run(setup, "served", *flags, "--aux-layer-ids", "0,2,1", "--norm-before-residual")
    out = str(root / "drafter-served")
    asked = prompts(7, [6, 11, 4, 9, 15, 7])  # token ids: not the training prompts

    plain = engine(target_dir, page_size=4)
    seqs = generate_answers(plain, asked, 24)
    runner = target_runner(plain)
    drafter = build_draft_model(
        DraftConfig.from_dir(out), plain.model_cfg, out, torch.float32, CPU, LayerContext(),
        runner.model.embed_tokens, show_progress=False,
    )  # fmt: skip
    aux = drafter.aux_layer_ids(plain.model_cfg.num_layers)
    assert aux == (1, 3, 2) and drafter.cfg.norm_before_residual
    feats = compute_features(runner, seqs, aux, CPU)
    args = dataclasses.replace(TrainArgs(), ttt_steps=3, batch_size=4)
    estimate = evaluate(drafter, runner.model, feats, args, CPU)

    served = run(
        engine(target_dir, out, 3, page_size=4),
        asked,
        SamplingParams(temperature=0.0, max_tokens=24),
    )
    assert served.ids == [s.ids[s.prompt_len :] for s in seqs]  # lossless, as always
    emitted = sum(len(ids) - 1 for ids in served.ids)  # the prefill emits the first
    assert served.accepted > 0 and served.verify_steps < emitted
    assert emitted / served.verify_steps == pytest.approx(estimate.served_length, rel=1e-9)


def test_ema_decay_exports_the_average_and_trains_alike(setup, one_thread):
    """--ema-decay: the same training (the same losses), but the checkpoint holds the
    weights' average, not the last weights."""
    from safetensors.torch import load_file

    root = setup[0]
    plain = short_run(setup, "ema-off")
    averaged = short_run(setup, "ema-on", "--ema-decay", "0.5")
    assert averaged["args"]["ema_decay"] == 0.5
    for key in ("initial_loss", "final_loss"):
        assert averaged["results"][key] == pytest.approx(plain["results"][key], rel=1e-6)
    last = load_file(str(root / "drafter-ema-off" / "model.safetensors"))
    mean = load_file(str(root / "drafter-ema-on" / "model.safetensors"))
    assert last.keys() == mean.keys()
    assert torch.equal(last["d2t"], mean["d2t"])
    assert not torch.allclose(last["fc.weight"], mean["fc.weight"])


def test_kernel_profile_of_training_steps(setup, one_thread, monkeypatch, tmp_path):
    """GYRFALCON_KERNEL_PROFILE=DIR:FIRST:COUNT profiles those training steps (what a
    step's device time goes to), as it does a served worker's plans."""
    monkeypatch.setenv("GYRFALCON_KERNEL_PROFILE", f"{tmp_path}:2:2")
    short_run(setup, "kernel-profile")  # 4 steps: the window holds steps 2 and 3
    text = (tmp_path / "kernels_train_eagle3.txt").read_text()
    assert text.startswith("train_eagle3: plans 2 .. 3") and "aten::" in text


def test_eval_drafter_measures_several_drafters_on_one_set_of_answers(setup, one_thread, tmp_path):
    """benchmarks/eval_drafter.py with two drafters of different aux layers: one set of
    answers (their rounds pair prompt by prompt), and each drafter's figures exactly
    what it gets measured alone (its own features, nothing carried over)."""
    import importlib.util
    from pathlib import Path

    root, target_dir, tok_dir = setup
    flags = ("--max-steps", "30", "--lr", "1e-2", "--ttt-steps", "3")
    short_run(setup, "eval-a", *flags)
    short_run(setup, "eval-b", *flags, "--aux-layer-ids", "0,2,1")
    path = Path(__file__).resolve().parents[3] / "benchmarks" / "eval_drafter.py"
    spec = importlib.util.spec_from_file_location("eval_drafter", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    common = [
        "--target-model", target_dir, "--tokenizer", tok_dir, "--prompts",
        str(root / "prompts.jsonl"), "--num-prompts", "8", "--max-new-tokens", "16",
        "--kv-cache-memory", "16MiB",
    ]  # fmt: skip
    a, b = str(root / "drafter-eval-a"), str(root / "drafter-eval-b")
    both = [str(tmp_path / "a.json"), str(tmp_path / "b.json")]
    assert script.main([*common, "--draft-model", a, b, "--output-json", *both]) == 0
    alone = str(tmp_path / "b-alone.json")
    assert script.main([*common, "--draft-model", b, "--output-json", alone]) == 0
    ra, rb, rb_alone = (json.loads(Path(p).read_text()) for p in (*both, alone))
    assert ra["draft_model"] == a and rb["draft_model"] == b
    assert [r[1] for r in ra["rounds_per_sequence"]] == [r[1] for r in rb["rounds_per_sequence"]]
    assert rb == rb_alone
    assert ra["rounds_per_sequence"] != rb["rounds_per_sequence"]  # two drafters, two walks
    with pytest.raises(SystemExit):  # one output path for two drafters
        script.main([*common, "--draft-model", a, b, "--output-json", both[0]])
