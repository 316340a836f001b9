"""Typed messages for every process edge (msgspec structs, tagged unions).

Edges:
  frontend  -> scheduler : GenerateRequest | AbortRequest | StatsRequest
  scheduler -> frontend  : EngineReady | BatchOutput | StatsReply | EngineError
                           (one edge per API server: a request's outputs and a stats
                           reply go to the API server that sent it, the rest to all)
  scheduler -> worker    : StepPlan | Shutdown
  worker    -> scheduler : WorkerReady | StepResult | WorkerError
"""

from __future__ import annotations

import enum

import msgspec


class ForwardMode(enum.IntEnum):
    """What one batch computes. Set explicitly by the scheduler; never inferred."""

    PREFILL = 1  # new prompt tokens only (possibly a chunk, possibly after a cached prefix)
    DECODE = 2  # exactly one new token per request
    MIXED = 3  # prefill chunks and decodes in one batch
    VERIFY = 4  # target scores last accepted token + k draft tokens (spec decode)
    DRAFT_EXTEND = 5  # drafter consumes accepted tokens (spec decode)
    DRAFT_DECODE = 6  # one drafter step (spec decode)
    IDLE = 7  # padded dummy rows of a DP rank with no work


class StructuredOutput(msgspec.Struct, frozen=True):
    """A grammar the output must follow (grammar/spec.py builds it):
    kind "json_object" (any JSON object; spec unused), "json_schema" (spec: the
    schema's JSON text; strict: xgrammar's strict mode, no properties beyond the
    schema's), "regex" (spec: the pattern) or "ebnf" (spec: a GBNF grammar whose
    start rule is `root`)."""

    kind: str
    spec: str = ""
    strict: bool = False


class SamplingParams(msgspec.Struct, frozen=True):
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 = disabled
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    max_tokens: int = 16
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    logprobs: int | None = None  # None = off; k >= 0 = sampled token's logprob + top-k
    prompt_logprobs: int | None = None  # None = off; k >= 0 = per prompt token
    min_tokens: int = 0  # eos and stop_token_ids cannot end the output before this many
    logit_bias: dict[int, float] = {}  # added to the raw logits before sampling
    allowed_token_ids: list[int] | None = None  # None = all; else only these are sampled
    structured: StructuredOutput | None = None  # None = free text; else a grammar's tokens only

    @property
    def adjusts_logits(self) -> bool:
        """Whether logits are changed before sampling (beyond penalties)."""
        return (
            bool(self.logit_bias)
            or self.allowed_token_ids is not None
            or self.min_tokens > 0
            or self.structured is not None
        )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1


# ---------------------------------------------------------------- frontend <-> scheduler


class GenerateRequest(msgspec.Struct, tag=True):
    rid: str
    prompt_ids: list[int]
    sampling: SamplingParams
    api_server: int = 0  # the sender (--api-server-count): it gets the request's outputs


class AbortRequest(msgspec.Struct, tag=True):
    rid: str


class StatsRequest(msgspec.Struct, tag=True):
    nonce: int
    api_server: int = 0  # the sender, which gets the StatsReply


class EngineReady(msgspec.Struct, tag=True):
    max_model_len: int
    num_kv_pages: int
    page_size: int
    num_draft_tokens: int = 0  # k with speculative decoding, else 0
    prefix_caching: bool = False  # usage reports prompt_tokens_details.cached_tokens


class TokenLogprob(msgspec.Struct, array_like=True):
    token_id: int
    logprob: float


class PositionLogprobs(msgspec.Struct, array_like=True):
    """Logprob of the chosen token at one position, plus the top-k alternatives."""

    token_id: int
    logprob: float
    top: list[TokenLogprob] = []
    rank: int | None = None  # 1 + tokens strictly more probable (prompt positions only)


class RequestOutput(msgspec.Struct, array_like=True):
    """New tokens of one request since its last output."""

    rid: str
    token_ids: list[int]
    logprobs: list[PositionLogprobs] | None = None
    # prompt logprobs (position 0 has none), sent once with the first output
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    finish_reason: str | None = None  # None while running; "stop" | "length" | "abort" | "error"
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    error: str | None = None
    # speculative decoding, so far: steps that verified drafts, drafts they accepted
    num_verify_steps: int = 0
    num_accepted: int = 0
    # with finish_reason "error": the HTTP status to answer (0: 400, the client's side;
    # 503: the server is full, retry later)
    error_status: int = 0
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache at admission


class BatchOutput(msgspec.Struct, tag=True):
    outputs: list[RequestOutput]


class StatsReply(msgspec.Struct, tag=True):
    nonce: int
    num_total_pages: int
    num_free_pages: int
    num_running: int
    num_waiting: int
    integrity_ok: bool
    integrity_error: str | None = None
    # since start-up: requests preempted; speculative rows that verified drafts, and
    # the drafts they accepted
    num_preemptions: int = 0
    spec_verify_steps: int = 0
    spec_accepted: int = 0
    # prefix caching, since start-up: prompt tokens of admissions, and of them cached
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0


class EngineError(msgspec.Struct, tag=True):
    message: str


FrontendToScheduler = GenerateRequest | AbortRequest | StatsRequest
SchedulerToFrontend = EngineReady | BatchOutput | StatsReply | EngineError


# ---------------------------------------------------------------- scheduler <-> worker


class NewRequest(msgspec.Struct, array_like=True):
    """Sent once, the first step a request is scheduled on a worker."""

    rid: str
    prompt_ids: list[int]
    sampling: SamplingParams


class ScheduledRow(msgspec.Struct, array_like=True):
    """One request's work in one step (a delta against what the worker knows).

    The row computes tokens at positions [start, start + len(input_ids)).
    `new_pages` are appended to the worker's copy of the request's page table.
    `sample` is False for a prefill chunk that does not reach the prompt's end.
    `reset` drops the worker's page table for the request (it was preempted and
    is recomputed from position 0); its sampled outputs and seeded generator stay.
    `num_draft` (speculative decoding; 0 without it): the worker appends that many
    draft tokens of its own after the input and verifies them in this row; the
    row's pages hold their KV positions too. The draft tokens never leave the
    worker; the row emits 1 .. num_draft + 1 tokens (`RowResult`).
    `drafts_in_flight` > 0 makes it a floating row (scheduler/request.py): planned
    while the request's previous row, with that many drafts, is in flight, it starts
    where that row ends, start + (drafts it accepts), a position the worker takes
    from the device; `new_pages` cover the latest start.
    """

    rid: str
    start: int
    input_ids: list[int]
    new_pages: list[int]
    sample: bool
    reset: bool = False
    num_draft: int = 0
    drafts_in_flight: int = 0


class RankBatch(msgspec.Struct, array_like=True):
    """One DP rank's share of a step; the workers of that rank's DP group run it.

    Before the rows run, the worker drops the state of `finished_rids` and adds
    `new_requests`. A batch without rows is IDLE: its workers still run one padded
    dummy row on the dummy page (collectives need every rank in every step).
    """

    forward_mode: ForwardMode
    rows: list[ScheduledRow]
    new_requests: list[NewRequest] = []
    finished_rids: list[str] = []


class StepPlan(msgspec.Struct, tag=True):
    step_id: int
    batches: list[RankBatch]  # one per DP rank, indexed by DP rank
    # where the DP ranks' collectives span the DP groups (MoE experts over DP
    # attention), the graph every rank replays this step (`plan.agreed_graph`): its
    # rows (the most of any rank when every batch is DECODE and IDLE, or uniform
    # VERIFY and IDLE; else 0: every rank eager) and tokens per row (1 for DECODE,
    # k + 1 for VERIFY: an IDLE rank's dummy row has as many)
    graph_rows: int = 0
    graph_width: int = 1
    # where graph_rows is 0, the token count every rank's forward runs padded to as
    # piecewise graphs (`plan.agreed_tokens`: the most tokens of any rank's batch, an
    # IDLE rank's dummy row 1, padded to a captured size); 0: every rank eager
    graph_tokens: int = 0


class Shutdown(msgspec.Struct, tag=True):
    pass


class WorkerReady(msgspec.Struct, tag=True):
    """Sent once by every worker rank; the engine is ready when all ranks are."""

    rank: int
    num_kv_pages: int
    max_model_len: int
    floats_rows: bool = False  # starts floating rows on the device (ScheduledRow)


class RowResult(msgspec.Struct, array_like=True):
    """What one row emitted.

    A sampling row emits `num_accepted + 1` tokens, in order: the worker's draft
    tokens it accepted, then one token of the target (0 drafts without speculative
    decoding: one token). A row that does not sample emits none. Draft tokens the
    worker proposed but rejected never leave it.
    """

    rid: str
    token_ids: list[int] = []  # emitted tokens; empty when the row did not sample
    num_accepted: int = 0  # draft tokens accepted (always 0 without speculation)
    logprobs: list[PositionLogprobs] | None = None  # one per emitted token, when asked
    prompt_logprobs: list[PositionLogprobs] | None = None  # for positions start+1 .. end


class StepResult(msgspec.Struct, tag=True):
    """One DP rank's rows of a step, sent by the first TP rank of its DP group."""

    step_id: int
    rows: list[RowResult]
    dp_rank: int = 0


class WorkerError(msgspec.Struct, tag=True):
    rank: int
    message: str


SchedulerToWorker = StepPlan | Shutdown
WorkerToScheduler = WorkerReady | StepResult | WorkerError
