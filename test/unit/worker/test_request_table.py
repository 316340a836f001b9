"""The worker's request table: slots, the reserve captured graphs rely on."""

import torch

from gyrfalcon.ipc.messages import NewRequest, SamplingParams
from gyrfalcon.worker.request_table import RequestTable


def new(rid: str) -> NewRequest:
    return NewRequest(rid, [1, 2, 3], SamplingParams(max_tokens=4))


def test_a_reserve_keeps_its_tensors_and_its_scratch_slot_until_outgrown():
    table = RequestTable(torch.device("cpu"), num_draft=3)
    scratch = table.reserve(2)
    tensors = (table.last_tokens, table.draft_tokens, table.next_pos)
    assert scratch == 2 and table.last_tokens.shape == (3,) and table.draft_tokens.shape == (3, 3)
    slots = [table.add(new(f"r{i}")).slot for i in range(2)]
    table.drop("r0")
    slots.append(table.add(new("r2")).slot)  # a freed slot is reused: no growth
    assert scratch not in slots and table.generation == 0
    assert all(
        a is b for a, b in zip(tensors, (table.last_tokens, table.draft_tokens, table.next_pos))
    )
    table.next_pos[slots[1]] = 41  # state survives the growth below
    more = [table.add(new(f"s{i}")).slot for i in range(3)]  # past the reserve: reallocated
    assert table.generation == 1 and table.next_pos[slots[1]] == 41
    assert scratch not in more and len(set(slots[1:] + more)) == 5  # never handed out


def test_apply_extends_or_resets_each_rows_page_table():
    from gyrfalcon.ipc.messages import ScheduledRow

    table = RequestTable(torch.device("cpu"))
    for rid in ("a", "b"):
        table.add(new(rid))
    table.apply([ScheduledRow("a", 0, [1], [4, 5], True), ScheduledRow("b", 0, [1], [6], True)])
    reqs = table.apply(
        [ScheduledRow("b", 1, [2], [], True), ScheduledRow("a", 0, [1], [7], True, reset=True)]
    )
    assert reqs == [table["b"], table["a"]]
    assert table["a"].pages.tolist() == [7] and table["b"].pages.tolist() == [6]
