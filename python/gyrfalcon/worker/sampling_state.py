"""Sampling state of one live request on the worker: its validated parameters,
its outputs so far (for penalties and grammars), its seeded generator, its static
logit row and its grammar's matcher."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from gyrfalcon.ipc.messages import SamplingParams
from gyrfalcon.worker.grammar_state import GrammarState
from gyrfalcon.worker.logit_adjust import static_row, stop_ids
from gyrfalcon.worker.penalties import DeviceTokenBuffer

# NOTE: temperatures below this are greedy: dividing logits by them could overflow float32.
GREEDY_TEMPERATURE = 1e-5


def is_greedy(params: SamplingParams) -> bool:
    """Whether a request decodes greedily (argmax, no RNG)."""
    return params.temperature < GREEDY_TEMPERATURE or params.top_k == 1


def _validate(params: SamplingParams) -> None:
    if params.temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {params.temperature}")
    if not 0.0 < params.top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {params.top_p}")
    if params.top_k < -1:
        raise ValueError(f"top_k must be -1 (off) or >= 0, got {params.top_k}")
    if not 0.0 <= params.min_p <= 1.0:
        raise ValueError(f"min_p must be in [0, 1], got {params.min_p}")
    if params.repetition_penalty <= 0:
        raise ValueError(f"repetition_penalty must be > 0, got {params.repetition_penalty}")
    if params.min_tokens < 0:
        raise ValueError(f"min_tokens must be >= 0, got {params.min_tokens}")
    if params.allowed_token_ids is not None and not params.allowed_token_ids:
        raise ValueError("allowed_token_ids must not be empty")
    for name in ("logprobs", "prompt_logprobs"):
        k = getattr(params, name)
        if k is not None and k < 0:
            raise ValueError(f"{name} must be None or >= 0, got {k}")


@dataclass
class RequestSamplingState:
    """Sampling state of one live request, owned by the worker.

    NOTE: `output_ids` must only grow by appending (the worker appends each sampled
    token); penalties mirror it on the device incrementally.
    """

    params: SamplingParams
    prompt_ids: list[int]
    output_ids: list[int] = field(default_factory=list)
    generator: torch.Generator | None = None  # on the logits' device; set iff params.seed
    stop_ids: list[int] = field(default_factory=list)  # held back while under min_tokens
    adjusts_logits: bool = False  # bias / allowed ids / min_tokens / grammar (per step)
    grammar: GrammarState | None = None  # structured output (grammar_state.py)
    prompt_dev: DeviceTokenBuffer = field(default_factory=DeviceTokenBuffer, repr=False)
    output_dev: DeviceTokenBuffer = field(default_factory=DeviceTokenBuffer, repr=False)
    _static_row: torch.Tensor | None = field(default=None, repr=False)
    # NOTE: derived from params and grammar once (`__post_init__`): the sampler reads
    # them for every row of every step
    greedy: bool = field(init=False)  # `is_greedy`: argmax, no RNG
    has_penalty: bool = field(init=False)  # repetition / presence / frequency penalty
    # sampling reads the outputs so far on the host (penalties, a grammar): the steps
    # before must be resolved first
    reads_outputs: bool = field(init=False)

    def __post_init__(self) -> None:
        p = self.params
        self.greedy = is_greedy(p)
        self.has_penalty = (
            p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0
        )
        self.reads_outputs = self.has_penalty or self.grammar is not None

    @classmethod
    def create(
        cls,
        params: SamplingParams,
        prompt_ids: list[int],
        device: torch.device | str,
        eos_token_ids: tuple[int, ...] = (),
        grammar: GrammarState | None = None,
    ) -> RequestSamplingState:
        """Validate `params` (ValueError) and seed a generator on `device` if asked;
        `grammar`: the matcher of `params.structured` (required with it)."""
        _validate(params)
        if (params.structured is None) != (grammar is None):
            raise ValueError("a structured-output request needs its grammar, and only it")
        generator = None
        if params.seed is not None:
            generator = torch.Generator(device=torch.device(device))
            # NOTE: any Python int is a valid seed; fold it into the 64 bits torch accepts.
            generator.manual_seed(params.seed & 0xFFFF_FFFF_FFFF_FFFF)
        return cls(
            params=params,
            prompt_ids=list(prompt_ids),
            generator=generator,
            stop_ids=stop_ids(params, eos_token_ids) if params.min_tokens else [],
            adjusts_logits=params.adjusts_logits,
            grammar=grammar,
        )

    def static_row(self, vocab_size: int, device: torch.device) -> torch.Tensor | None:
        """The request's logit_bias / allowed_token_ids row [vocab] (built once), or None."""
        p = self.params
        if not p.logit_bias and p.allowed_token_ids is None:
            return None
        if self._static_row is None:
            self._static_row = static_row(p, vocab_size, device)
        return self._static_row
