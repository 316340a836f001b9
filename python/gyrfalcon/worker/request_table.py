"""The worker's request table: per-request state the plan sends only as deltas.

A request lives here from the step that first schedules it (`NewRequest`) until
its rank batch lists it in `finished_rids`: its prompt, its sampling state
(outputs for penalties, seeded generator), its page table, and a slot in
`last_tokens`, the device tensor where every step scatters the last token each
sampling row emitted, so the next plan's PLACEHOLDER inputs are filled on the
device. With speculative decoding the slot also indexes `draft_tokens`, the k draft
tokens the drafter proposed for the request's next verify row, written and read
on the device only, and `next_pos`, the position of the last token the request's
latest sampling row emitted, where its next row starts: a floating row
(ipc/messages.ScheduledRow) takes its start from there.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass

import torch

from gyrfalcon.ipc.messages import NewRequest, ScheduledRow
from gyrfalcon.worker.grammar_state import WorkerGrammars
from gyrfalcon.worker.sampling_state import RequestSamplingState

MIN_SLOTS = 64  # last_tokens grows by doubling from this many slots


@dataclass
class WorkerRequest:
    prompt_ids: list[int]
    sampling: RequestSamplingState
    # NOTE: an int64 array, not a list: a step's upload copies it whole into the page
    # table (`forward.metadata.padded_page_table`), without converting each page
    pages: array
    slot: int  # row of RequestTable.last_tokens

    def token_at(self, pos: int) -> int:
        """The known token at position pos (prompt, then the outputs recorded so far)."""
        n = len(self.prompt_ids)
        return self.prompt_ids[pos] if pos < n else self.sampling.output_ids[pos - n]


class RequestTable:
    def __init__(
        self,
        device: torch.device,
        eos_token_ids: tuple[int, ...] = (),
        num_draft: int = 0,
        grammars: WorkerGrammars | None = None,
    ):
        """num_draft: draft tokens per request (k; 0 without speculative decoding);
        grammars: compiles structured-output requests' grammars (None: they fail)."""
        self.device = device
        self.eos_token_ids = eos_token_ids
        self.grammars = grammars
        self._requests: dict[str, WorkerRequest] = {}
        self._free_slots: list[int] = []
        self.last_tokens = torch.zeros(0, dtype=torch.int64, device=device)  # [slots]
        self.draft_tokens = torch.zeros(0, num_draft, dtype=torch.int64, device=device)
        self.next_pos = torch.zeros(0, dtype=torch.int64, device=device)  # [slots]
        self.scratch: int | None = None  # a slot no request gets (`reserve`)
        self.generation = 0  # bumped when the tensors above are reallocated

    def __len__(self) -> int:
        return len(self._requests)

    def __contains__(self, rid: str) -> bool:
        return rid in self._requests

    def __getitem__(self, rid: str) -> WorkerRequest:
        return self._requests[rid]

    @property
    def num_free_slots(self) -> int:
        return len(self._free_slots)

    def add(self, new: NewRequest) -> WorkerRequest:
        """Validate the request's sampling parameters (ValueError) and give it a slot."""
        assert new.rid not in self._requests, f"request {new.rid} sent twice"
        grammar = None
        if new.sampling.structured is not None:
            if self.grammars is None:
                raise ValueError("structured output is not available on this worker")
            grammar = self.grammars.state(new.sampling.structured)
        state = RequestSamplingState.create(
            new.sampling, list(new.prompt_ids), self.device, self.eos_token_ids, grammar
        )
        if not self._free_slots:  # grow (stream-ordered, no sync)
            self._grow(max(MIN_SLOTS, 2 * self.last_tokens.shape[0]))
        req = WorkerRequest(list(new.prompt_ids), state, array("q"), self._free_slots.pop())
        self._requests[new.rid] = req
        return req

    def reserve(self, capacity: int) -> int:
        """Slots for `capacity` requests now, and one scratch slot no request gets,
        returned: captured graphs index these tensors (padded rows write to the scratch
        slot), which keep their addresses until more than `capacity` requests are held
        at once (then `generation` changes). Call before any request is added."""
        assert not self._requests and self.scratch is None, "reserve before any request"
        self._grow(capacity + 1)
        self.scratch = self._free_slots.pop(0)  # NOTE: the highest slot
        return self.scratch

    def _grow(self, rows: int) -> None:
        n = self.last_tokens.shape[0]
        self.last_tokens = _grown(self.last_tokens, rows)
        self.draft_tokens = _grown(self.draft_tokens, rows)
        self.next_pos = _grown(self.next_pos, rows)
        self._free_slots = list(range(rows - 1, n - 1, -1)) + self._free_slots
        if n:
            self.generation += 1

    def drop(self, rid: str) -> None:
        req = self._requests.pop(rid, None)
        if req is not None:
            self._free_slots.append(req.slot)

    def apply(self, rows: list[ScheduledRow]) -> list[WorkerRequest]:
        """The rows' requests, each with its row's page-table delta applied."""
        reqs = [self._requests[row.rid] for row in rows]
        for row, req in zip(rows, reqs):
            if row.reset:
                req.pages = array("q")
            if row.new_pages:  # NOTE: most steps' rows (decodes within a page) bring none
                req.pages.extend(row.new_pages)
        return reqs

    def record_last(self, slots: torch.Tensor, token_ids: torch.Tensor) -> None:
        """Scatter the last token each sampling row emitted into its request's slot (on
        the device). slots, token_ids: [rows] int64."""
        self.last_tokens.index_copy_(0, slots, token_ids)

    def record_next_pos(self, slots: torch.Tensor, positions: torch.Tensor) -> None:
        """Scatter where each sampling row's request goes on (the position of its last
        emitted token; on the device). slots, positions: [rows] int64."""
        self.next_pos.index_copy_(0, slots, positions)


def _grown(t: torch.Tensor, rows: int) -> torch.Tensor:
    """t with `rows` rows, its own first (zeros after)."""
    out = t.new_zeros(rows, *t.shape[1:])
    out[: t.shape[0]].copy_(t)
    return out
