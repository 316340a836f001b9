"""Arguments of `gyrfalcon train-eagle3`: one frozen dataclass; the CLI is generated
from its fields (every default lives here), "auto" values resolved once by
`TrainArgs.resolved()`."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field
from typing import Any

from gyrfalcon.config.cli_args import add_dataclass_args

# NOTE: evaluation sets: a drafter trained on them reports acceptance it has memorized
EVAL_SET_MARKERS = ("mt_bench", "mt-bench")


def parse_aux_layer_ids(text: str) -> tuple[int, ...]:
    """--aux-layer-ids "1,14,28" -> (1, 14, 28); ValueError unless three integers >= 0
    (the target's layer count is checked against them when the drafter is built)."""
    try:
        ids = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise ValueError(f"--aux-layer-ids takes integers like 1,14,28, not {text!r}") from None
    if len(ids) != 3 or min(ids) < 0:
        raise ValueError(f"--aux-layer-ids takes three layer ids >= 0, not {text!r}")
    return ids


@dataclass(frozen=True)
class TrainArgs:
    prompts: str | None = field(
        default=None,
        metadata={
            "help": "JSONL of training prompts, one object with a 'prompt' field a line "
            "(e.g. ../shared/data/train_prompts.jsonl); never an evaluation set"
        },
    )
    output_dir: str | None = field(
        default=None, metadata={"help": "where the checkpoint goes (config.json, safetensors)"}
    )
    target_model: str | None = field(
        default=None,
        metadata={
            "help": "the target: HF directory or id, a .gguf file, or nothing for the "
            "embedded SmolLM2-135M-Instruct (as `gyrfalcon serve`)"
        },
    )
    tokenizer: str | None = field(
        default=None, metadata={"help": "tokenizer directory (default: the target's)"}
    )
    no_chat_template: bool = field(
        default=False,
        metadata={"help": "tokenize the prompt text as is (targets without a chat template)"},
    )
    cache_dir: str | None = field(
        default=None, metadata={"help": "where converted models are cached (as serve)"}
    )
    num_prompts: int = field(
        default=4000, metadata={"help": "prompts drawn (seeded) from the file; 0 = all"}
    )
    holdout: int = field(
        default=64, metadata={"help": "of those, prompts held out to measure acceptance"}
    )
    self_instructions: int = field(
        default=0,
        metadata={
            "help": "user instructions the target writes itself first (sampled from its chat "
            "template's user turn; truncated, short and duplicate ones dropped), answered "
            "as more prompts"
        },
    )
    instruction_examples: int = field(
        default=0,
        metadata={
            "help": "with --self-instructions: each instruction's prompt lists this many "
            "requests drawn from the training prompts (a system message; the prompts "
            "file's sources drawn evenly), steering what the target writes toward them; "
            "0 = none"
        },
    )
    follow_up_turns: int = field(
        default=0,
        metadata={
            "help": "training prompts that also get a second turn: a generic follow-up "
            "question after the target's answer, answered by the target too"
        },
    )
    max_new_tokens: int = field(
        default=256, metadata={"help": "length of the target's greedy answers"}
    )
    max_num_seqs: int = field(
        default=256, metadata={"help": "answers generated at once (the engine's batch)"}
    )
    generate_workers: int = field(
        default=1,
        metadata={
            "help": "engines that generate the data at once, each in its own process on "
            "the device (on a GPU the host's work per row bounds one engine; 4 suits an "
            "H100 with SmolLM2)"
        },
    )
    kv_cache_memory: str = field(
        default="4GiB",
        metadata={
            "help": "the engine's KV cache (generation, features); the rest of the "
            "device's memory is left to training"
        },
    )
    data_cache: str | None = field(
        default=None,
        metadata={
            "help": "a file keeping the generated text: a later run with the same "
            "generation arguments, target and prompts loads it instead of generating "
            "(to try training settings); otherwise it is (re)written"
        },
    )
    draft_intermediate_size: int | None = field(
        default=None,
        metadata={"help": "the drafter's MLP width (default: the target's intermediate size)"},
    )
    aux_layer_ids: str | None = field(
        default=None,
        metadata={
            "help": "three comma-separated target layers whose OUTPUTS the drafter reads "
            "(eagle_config.eagle_aux_hidden_state_layer_ids, written to its config); "
            "default: the inputs of layers 2, N // 2, N - 3"
        },
    )
    norm_before_residual: bool = field(
        default=False,
        metadata={
            "help": "the midlayer's residual is hidden_norm(hidden), not hidden (the "
            "variant vLLM's speculators checkpoints use; written to the config)"
        },
    )
    draft_vocab_size: int = field(
        default=32000,
        metadata={
            "help": "the drafter's vocabulary: the most frequent answer tokens "
            "(capped at the target's vocabulary)"
        },
    )
    ttt_steps: int = field(
        default=4, metadata={"help": "training-time test: draft steps unrolled per position"}
    )
    step_loss_decay: float = field(
        default=0.8, metadata={"help": "weight of unroll step j's loss: decay ** j"}
    )
    reach_weight: float = field(
        default=0.0,
        metadata={
            "help": "in [0, 1]: unroll step j >= 1 weighs a row (1 - w) + w if the "
            "drafter's argmax was the target's at every earlier step there (a greedy "
            "server verifies that draft), (1 - w) otherwise; 0: every row alike"
        },
    )
    target_temperature: float = field(
        default=1.0,
        metadata={
            "help": "the distribution the drafter learns: softmax(target logits / T) over "
            "the draft ids; T < 1 sharpens it toward the target's choice, the token greedy "
            "verification accepts (1: EAGLE3's soft targets)"
        },
    )
    max_steps: int = field(default=3000, metadata={"help": "optimizer steps"})
    max_train_seconds: float | None = field(
        default=None,
        metadata={
            "help": "a guard: training stops after this many seconds (of the training "
            "phase) even short of max-steps, then evaluates and saves; the learning rate "
            "decays by steps or by time, whichever is further"
        },
    )
    batch_size: int = field(default=16, metadata={"help": "sequences per step"})
    seq_bucket: int = field(
        default=64,
        metadata={
            "help": "a batch's length is padded up to a multiple of this (padding masked "
            "out): few distinct shapes, each costing CUDA attention a plan; 1: none"
        },
    )
    lr: float = field(default=3e-4, metadata={"help": "peak learning rate (AdamW)"})
    warmup_steps: int | None = field(
        default=None, metadata={"help": "linear warm-up steps (default: 5%% of max-steps)"}
    )
    max_grad_norm: float = field(default=0.5, metadata={"help": "gradient clipping norm"})
    ema_decay: float = field(
        default=0.0,
        metadata={
            "help": "evaluate and export an exponential moving average of the weights "
            "with this decay a step (e.g. 0.999; 0: the weights themselves)"
        },
    )
    eval_every: int = field(
        default=500, metadata={"help": "steps between acceptance reports (0: at the end only)"}
    )
    device: str = field(default="auto", metadata={"help": "auto|cpu|cuda"})
    dtype: str = field(
        default="auto",
        metadata={
            "help": "the target's dtype; auto = bfloat16 on CUDA, float32 on CPU",
            "choices": ["auto", "float32", "bfloat16", "float16"],
        },
    )
    seed: int = field(default=0, metadata={"help": "seed of prompt sampling, init, batches"})

    def resolved(self) -> TrainArgs:
        """A copy with "auto" resolved; ValueError names a flag that cannot work."""
        import torch

        if self.prompts is None:
            raise ValueError("--prompts is required: a JSONL file of training prompts")
        lowered = self.prompts.lower()
        if any(m in lowered for m in EVAL_SET_MARKERS):
            raise ValueError(
                f"--prompts {self.prompts!r} is MT-Bench, an evaluation set: never train a "
                "drafter on it (use ../shared/data/train_prompts.jsonl)"
            )
        if self.output_dir is None:
            raise ValueError("--output-dir is required")
        if self.follow_up_turns and self.no_chat_template:
            raise ValueError("--follow-up-turns needs the chat template (a conversation)")
        if self.self_instructions and self.no_chat_template:
            raise ValueError(
                "--self-instructions needs the chat template (the target writes a user turn)"
            )
        if self.generate_workers < 1:
            raise ValueError(f"--generate-workers must be >= 1, got {self.generate_workers}")
        if self.self_instructions < 0:
            raise ValueError(f"--self-instructions must be >= 0, got {self.self_instructions}")
        if self.instruction_examples < 0:
            raise ValueError(
                f"--instruction-examples must be >= 0, got {self.instruction_examples}"
            )
        if self.instruction_examples and not self.self_instructions:
            raise ValueError("--instruction-examples needs --self-instructions")
        positive = {
            "--max-new-tokens": self.max_new_tokens,
            "--max-steps": self.max_steps,
            "--batch-size": self.batch_size,
            "--ttt-steps": self.ttt_steps,
            "--draft-vocab-size": self.draft_vocab_size,
            "--seq-bucket": self.seq_bucket,
            "--draft-intermediate-size": self.draft_intermediate_size or 1,
        }
        for flag, value in positive.items():
            if value < 1:
                raise ValueError(f"{flag} must be at least 1, got {value}")
        if self.max_train_seconds is not None and self.max_train_seconds <= 0:
            raise ValueError(f"--max-train-seconds must be positive, got {self.max_train_seconds}")
        if not self.target_temperature > 0:
            raise ValueError(
                f"--target-temperature must be positive, got {self.target_temperature}"
            )
        if self.aux_layer_ids is not None:
            parse_aux_layer_ids(self.aux_layer_ids)
        if not 0.0 <= self.reach_weight <= 1.0:
            raise ValueError(f"--reach-weight must be in [0, 1], got {self.reach_weight}")
        if not 0.0 <= self.ema_decay < 1.0:
            raise ValueError(f"--ema-decay must be in [0, 1), got {self.ema_decay}")
        if self.holdout < 1:
            raise ValueError(f"--holdout must be at least 1, got {self.holdout}")
        device = self.device
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        dtype = self.dtype
        if dtype == "auto":
            dtype = "bfloat16" if device.startswith("cuda") else "float32"
        warmup = self.warmup_steps
        if warmup is None:
            warmup = max(1, self.max_steps // 20)
        return dataclasses.replace(self, device=device, dtype=dtype, warmup_steps=warmup)

    @classmethod
    def parser(cls) -> argparse.ArgumentParser:
        parser = argparse.ArgumentParser(
            prog="gyrfalcon train-eagle3",
            description="Train an EAGLE3 draft head on the target's own greedy answers.",
        )
        add_dataclass_args(parser, cls)
        return parser

    @classmethod
    def from_argv(cls, argv: list[str]) -> TrainArgs:
        ns = cls.parser().parse_args(argv)
        return cls(**vars(ns))

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)
