"""`gyrfalcon train-eagle3`: the phases in order and the training loop.

generate (with --self-instructions, instructions the target writes itself,
`instructions`; the target's greedy answers, `data`) -> features (the target's hidden
states, `features`) -> train (TTT unroll, `ttt` + `objective`; AdamW, warm-up then
cosine decay, gradient clipping) with acceptance on held-out prompts every
--eval-every steps and at the end (`evaluate`) -> checkpoint (`drafter.export_drafter`) and
training_args.json (the arguments and the results).
"""

from __future__ import annotations

import gc
import json
import math
import os
import random
import sys
import time
from collections.abc import Iterator
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from tqdm.auto import tqdm

from gyrfalcon.config.draft_config import DraftConfig
from gyrfalcon.config.model_config import ModelConfig
from gyrfalcon.config.server_args import ServerArgs
from gyrfalcon.engine import LocalEngine
from gyrfalcon.ipc.messages import ForwardMode
from gyrfalcon.loader.resolve import resolve_model
from gyrfalcon.models.llama_eagle3 import LlamaForCausalLMEagle3
from gyrfalcon.profiling import KernelWindow
from gyrfalcon.train.args import TrainArgs, parse_aux_layer_ids
from gyrfalcon.train.data import (
    EngineCopies,
    TrainSequence,
    build_draft_vocab,
    encode_prompts,
    follow_up_conversations,
    generate_answers,
    load_prompts,
    prompts_by_source,
)
from gyrfalcon.train.data_cache import data_key, load_data, save_data
from gyrfalcon.train.drafter import (
    build_drafter,
    draft_config_for,
    export_drafter,
    trainable_parameters,
)
from gyrfalcon.train.ema import WeightAverage
from gyrfalcon.train.evaluate import Acceptance, evaluate, report, run_batch
from gyrfalcon.train.features import Features, TargetRunner, compute_features
from gyrfalcon.train.grad_stats import grad_norm_stats
from gyrfalcon.train.instructions import write_instructions
from gyrfalcon.train.objective import (
    greedy_agreement,
)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
MIN_LR_RATIO = 0.1  # the cosine decays to this fraction of --lr
BUCKET_BATCHES = 32  # batches drawn together and sorted by length (less padding)
ADAM_BETAS = (0.9, 0.95)
POSTFIX_EVERY = 10  # steps between progress-bar updates (each reads the loss: a sync)
# NOTE: a CUDA run's host work is small tensors and launches; torch's default of a
# thread a core spun ~11 cores a trainer (OpenMP workers waiting between small ops),
# and two trainers on one 32-core machine ran ~7 steps/s each where 4 threads gave ~30
HOST_THREADS = 4


_STARTED = time.perf_counter()


def log(msg: str) -> None:
    """A line above the progress bars, with the seconds since the trainer was loaded."""
    tqdm.write(f"[train-eagle3 {time.perf_counter() - _STARTED:6.1f}s] {msg}", file=sys.stderr)


def lr_factor(step: int, warmup: int, total: int, time_share: float = 0.0) -> float:
    """Linear warm-up over `warmup` steps, then cosine from 1 to MIN_LR_RATIO as
    training progresses: by steps (of `total`) or by time (`time_share`, the share of
    --max-train-seconds spent), whichever is further, so a run the time guard stops
    still ends on the decayed rate."""
    if step < warmup:
        return (step + 1) / warmup
    t = max((step - warmup) / max(1, total - warmup), time_share)
    return MIN_LR_RATIO + (1 - MIN_LR_RATIO) * 0.5 * (1 + math.cos(math.pi * min(t, 1.0)))


def limit_host_threads(device: torch.device) -> None:
    """On CUDA, HOST_THREADS CPU threads for this process and the engine copies it
    spawns (they read OMP_NUM_THREADS), unless OMP_NUM_THREADS is set already; a CPU
    run keeps torch's default (its threads do the training's arithmetic)."""
    if device.type == "cuda" and "OMP_NUM_THREADS" not in os.environ:
        os.environ["OMP_NUM_THREADS"] = str(HOST_THREADS)
        torch.set_num_threads(HOST_THREADS)


def time_done(t0: float, limit: float | None) -> float:
    """The share of the training phase's time guard spent (0 without one)."""
    return 0.0 if limit is None else (time.perf_counter() - t0) / limit


def out_of_time_at(step: int, t0: float, limit: float | None) -> bool:
    """Whether training stops after `step` for the time guard (checked every
    POSTFIX_EVERY steps: the clock read costs nothing, but a stop mid-burst would)."""
    return step % POSTFIX_EVERY == 0 and time_done(t0, limit) > 1


def batches(features: Features, batch_size: int, seed: int) -> Iterator[list[int]]:
    """Endless batches of sequence indices: each epoch shuffled, then sorted by length
    within groups of BUCKET_BATCHES batches, the batches shuffled again."""
    rng = random.Random(seed)
    order = list(range(len(features)))
    while True:
        rng.shuffle(order)
        out = []
        span = batch_size * BUCKET_BATCHES
        for lo in range(0, len(order), span):
            chunk = sorted(order[lo : lo + span], key=lambda i: features.lengths[i])
            out += [chunk[i : i + batch_size] for i in range(0, len(chunk), batch_size)]
        rng.shuffle(out)
        yield from out


@dataclass
class Generated:
    model_dir: str  # the target's directory
    engine: LocalEngine  # holding it (its model and KV cache serve the features)
    seqs: list[TrainSequence]  # answered sequences, the held-out ones last
    instructions: list[str]  # the kept self-written instructions (among the prompts)


def _generate_with(
    engine: LocalEngine,
    copies: EngineCopies,
    tokenizer: Any,
    args: TrainArgs,
    prompts: list[str],
) -> tuple[list[str], list[TrainSequence]]:
    """`generate`'s phases on the engine and its copies: (the kept instructions, the
    answered sequences with the held-out ones last)."""
    instructions: list[str] = []
    if args.self_instructions:
        pools = prompts_by_source(args.prompts, prompts) if args.instruction_examples else []
        written = write_instructions(
            engine,
            tokenizer,
            args.self_instructions,
            args.seed,
            prompts,
            copies,
            pools,
            args.instruction_examples,
        )
        log(written.summary())
        instructions = written.kept
        prompts = prompts + instructions
        random.Random(args.seed).shuffle(prompts)
    prompt_ids = encode_prompts(tokenizer, prompts, chat_template=not args.no_chat_template)
    seqs = generate_answers(engine, prompt_ids, args.max_new_tokens, copies)
    if args.follow_up_turns:
        # NOTE: second turns of training prompts only; the held-out sequences stay last
        text_of = {tuple(ids): text for ids, text in zip(prompt_ids, prompts)}
        base = seqs[: len(seqs) - args.holdout][: args.follow_up_turns]
        convs = follow_up_conversations(
            tokenizer,
            [text_of[tuple(s.ids[: s.prompt_len])] for s in base],
            [s.ids[s.prompt_len :] for s in base],
            args.seed,
        )
        second = generate_answers(engine, convs, args.max_new_tokens, copies)
        cut = len(seqs) - args.holdout
        seqs = seqs[:cut] + second + seqs[cut:]
    return instructions, seqs


def generate(args: TrainArgs, prompts: list[str]) -> Generated:
    """The target's own text: instructions it writes (--self-instructions) join the
    prompts, shuffled together with --seed (so the held-out ones are drawn from both),
    then its greedy answers and second turns."""
    from transformers import AutoTokenizer

    model_dir = resolve_model(args.target_model, args.cache_dir)
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer or model_dir)
    server_args = ServerArgs(
        model=model_dir,
        device=args.device,
        dtype=args.dtype,  # type: ignore[arg-type]
        kv_cache_memory=args.kv_cache_memory,
        max_num_seqs=args.max_num_seqs,
        seed=args.seed,
        # NOTE: triton on CUDA: flashinfer builds its prefill module on a fresh machine
        # (~90 s of the run); the answers are decode-bound, the features one pass
        attention_backend="triton" if args.device.startswith("cuda") else "auto",
    )
    engine = LocalEngine(server_args, model_dir, check_invariants=False)  # NOTE: big pool
    log("target engine ready")
    key = data_key(args, model_dir, prompts)
    cached = load_data(args.data_cache, key) if args.data_cache else "no --data-cache"
    if isinstance(cached, tuple):
        instructions, seqs = cached
        log(f"{len(seqs)} sequences and {len(instructions)} instructions from {args.data_cache}")
    else:
        if args.data_cache:
            log(f"generating: {cached}")
        with EngineCopies(engine, args.generate_workers) as copies:
            instructions, seqs = _generate_with(engine, copies, tokenizer, args, prompts)
        if copies.calls:
            log(f"generation with {copies.workers} engines: {copies.summary()}")
        if args.data_cache:
            save_data(args.data_cache, key, instructions, seqs)
            log(f"saved the generated text to {args.data_cache}")
    if len(seqs) <= args.holdout:
        raise ValueError(f"{len(seqs)} answered prompts; --holdout {args.holdout} leaves none")
    return Generated(model_dir, engine, seqs, instructions)


def drafter_config(args: TrainArgs, target_cfg: ModelConfig, draft_vocab: int) -> DraftConfig:
    """The drafter's config from the arguments; ValueError if the target lacks an aux
    layer they name."""
    aux = parse_aux_layer_ids(args.aux_layer_ids) if args.aux_layer_ids else None
    return draft_config_for(
        target_cfg,
        draft_vocab,
        args.dtype,
        args.draft_intermediate_size,
        aux,
        args.norm_before_residual,
    )


def target_runner(engine: LocalEngine) -> TargetRunner:
    """The engine's target, KV cache (free once generation is done) and extend backend."""
    executor = engine.worker.executor
    assert executor.kv_cache is not None
    budget = engine.args.max_num_batched_tokens
    assert budget is not None, "resolved server args"
    backend = executor.backend_for(ForwardMode.PREFILL)
    return TargetRunner(executor.model, executor.kv_cache, backend, executor.page_size, budget)


def train_loop(
    drafter: LlamaForCausalLMEagle3,
    target: torch.nn.Module,
    train_feats: Features,
    held_feats: Features,
    args: TrainArgs,
    device: torch.device,
) -> tuple[list[float], list[dict[str, Any]]]:
    """(the loss of every step, the held-out evaluations)."""
    params = trainable_parameters(drafter)
    opt = torch.optim.AdamW(params, lr=args.lr, betas=ADAM_BETAS, weight_decay=0.0)
    average = WeightAverage(params, args.ema_decay) if args.ema_decay else None
    warmup = args.warmup_steps or 1
    order = batches(train_feats, args.batch_size, args.seed)
    losses: list[torch.Tensor] = []
    norms: list[torch.Tensor] = []  # each step's total gradient norm since the last eval
    evals: list[dict[str, Any]] = []
    bar = tqdm(range(args.max_steps), desc="training", unit="step")
    kernels = KernelWindow("train_eagle3")  # NOTE: GYRFALCON_KERNEL_PROFILE=DIR:FIRST:COUNT
    t0 = time.perf_counter()
    for step in bar:
        kernels.plan(device)
        factor = lr_factor(step, warmup, args.max_steps, time_done(t0, args.max_train_seconds))
        for group in opt.param_groups:
            group["lr"] = args.lr * factor
        batch = train_feats.batch(next(order), args.seq_bucket, args.ttt_steps)
        loss, results = run_batch(drafter, target, batch, args, device)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(params, args.max_grad_norm).detach())
        opt.step()
        if average is not None:
            average.update()
        losses.append(loss.detach())
        done = step + 1
        if done % POSTFIX_EVERY == 0:
            acc0 = int(results[0].hits) / max(1, results[0].rows)
            bar.set_postfix(loss=f"{float(losses[-1]):.3f}", acc0=f"{acc0:.2f}", refresh=False)
        out_of_time = out_of_time_at(done, t0, args.max_train_seconds)
        if (
            done == args.max_steps
            or out_of_time
            or (args.eval_every and done % args.eval_every == 0)
        ):
            with average.applied() if average is not None else nullcontext():
                acc = evaluate(drafter, target, held_feats, args, device)
            since = evals[-1]["step"] if evals else 0
            grads = grad_norm_stats(torch.stack(norms).float().tolist(), args.max_grad_norm)
            norms.clear()
            evals.append(
                {"step": done, "acceptance": acc.rates, "served_length": acc.served_length,
                 "grad_norm_median": grads.median, "clipped_share": grads.clipped_share}
            )  # fmt: skip
            log(
                f"{report(done, acc)}; since step {since}: gradient norm median "
                f"{grads.median:.3g}, {grads.clipped_share:.0%} of steps clipped"
            )
        if out_of_time:
            log(f"stopped at step {done} of {args.max_steps}: --max-train-seconds reached")
            break
    bar.close()
    if average is not None:
        average.store()  # NOTE: the exported drafter is the average (what was evaluated)
    return torch.stack(losses).tolist(), evals


def train(args: TrainArgs, prompts: list[str]) -> dict[str, Any]:
    """Every phase; returns the results written to training_args.json."""
    assert args.output_dir is not None
    torch.manual_seed(args.seed)
    device = torch.device(args.device)
    limit_host_threads(device)
    times: dict[str, float] = {}
    t0 = time.perf_counter()
    generated = generate(args, prompts)
    model_dir, engine, seqs = generated.model_dir, generated.engine, generated.seqs
    num_instructions = len(generated.instructions)
    train_seqs, held_seqs = seqs[: -args.holdout], seqs[-args.holdout :]
    answer_tokens = sum(len(s.ids) - s.prompt_len for s in train_seqs)
    log(
        f"{len(train_seqs)} training sequences ({answer_tokens} answer tokens), "
        f"{len(held_seqs)} held out"
    )
    times["generate"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    target_cfg = ModelConfig.from_dir(model_dir)
    draft_vocab = min(args.draft_vocab_size, target_cfg.vocab_size)
    draft_ids = build_draft_vocab(train_seqs, target_cfg.vocab_size, draft_vocab)
    cfg = drafter_config(args, target_cfg, draft_vocab)
    aux_layers = cfg.aux_layer_ids(target_cfg.num_layers)
    runner = target_runner(engine)
    train_feats = compute_features(runner, train_seqs, aux_layers, device)
    held_feats = compute_features(runner, held_seqs, aux_layers, device, "held-out features")
    target = runner.model
    agreement = greedy_agreement(held_feats)
    log(
        f"the target's argmax is its generated answer token at {agreement:.4f} of held-out "
        "positions (1 up to rounding)"
    )
    del generated, engine, runner  # NOTE: frees the KV cache (and graphs) for training
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    times["features"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    drafter = build_drafter(cfg, target, draft_ids, device, args.seed)
    history, evals = train_loop(drafter, target, train_feats, held_feats, args, device)
    times["train"] = time.perf_counter() - t0
    export_drafter(drafter, args.output_dir, DTYPES[args.dtype])

    window = max(1, min(20, len(history) // 10))
    last = Acceptance(evals[-1]["acceptance"], evals[-1]["served_length"])
    results = {
        "initial_loss": sum(history[:window]) / window,
        "final_loss": sum(history[-window:]) / window,
        "acceptance": last.rates,
        "steps": evals[-1]["step"],
        "mean_acceptance_length": last.length,
        "served_acceptance_length": last.served_length,
        "greedy_agreement": agreement,
        "evaluations": evals,
        "self_instructions": num_instructions,
        "train_sequences": len(train_seqs),
        "held_out_sequences": len(held_seqs),
        "aux_layers": list(aux_layers),
        "target_model_dir": model_dir,
        "seconds": times,
    }
    with open(os.path.join(args.output_dir, "training_args.json"), "w") as f:
        json.dump({"args": args.to_json(), "results": results}, f, indent=2)
    print(
        f"train-eagle3: loss {results['initial_loss']:.3f} -> {results['final_loss']:.3f}, "
        f"{report(evals[-1]['step'], last)}; generate {times['generate']:.0f} s, features "
        f"{times['features']:.0f} s, train {times['train']:.0f} s; saved {args.output_dir}",
        flush=True,
    )
    return results


def main(argv: list[str]) -> int:
    try:
        args = TrainArgs.from_argv(argv).resolved()
        assert args.prompts is not None
        prompts = load_prompts(args.prompts, args.num_prompts, args.seed)
        # NOTE: the drafter's config against the target (its aux layers), before minutes
        # of generation (the target resolves again in `generate`: converted once, cached)
        target_cfg = ModelConfig.from_dir(resolve_model(args.target_model, args.cache_dir))
        drafter_config(args, target_cfg, 1)
    except (ValueError, OSError) as exc:
        print(f"gyrfalcon train-eagle3: error: {exc}", file=sys.stderr)
        return 2
    train(args, prompts)
    return 0
