"""A step's host index lists: the plain rows' batch path equals the row-by-row one."""

import random
from array import array

import pytest

from gyrfalcon.ipc.contract import PLACEHOLDER
from gyrfalcon.ipc.messages import ScheduledRow
from gyrfalcon.worker.request_table import WorkerRequest
from gyrfalcon.worker.step_layout import StepLayout, batch_input_ids, placeholder_indices


@pytest.mark.parametrize(
    "ids", [[5], [PLACEHOLDER], [], [1, 2, 3], [PLACEHOLDER, 4, PLACEHOLDER], [0, PLACEHOLDER]]
)
def test_placeholder_indices_are_the_placeholders_positions(ids):
    assert placeholder_indices(ids) == [j for j, t in enumerate(ids) if t == PLACEHOLDER]


def test_batch_input_ids_append_a_zero_per_draft():
    row = ScheduledRow("a", 3, [PLACEHOLDER], [], True, num_draft=2)
    assert batch_input_ids(row) == [PLACEHOLDER, 0, 0] and row.input_ids == [PLACEHOLDER]
    plain = ScheduledRow("b", 3, [7, 8], [], False)
    assert batch_input_ids(plain) == [7, 8]


def _lists(layout: StepLayout) -> tuple:
    return (
        layout.lists(),
        layout.logit_starts,
        layout.draft_lists(),
        layout._tokens,
        layout._rows,
        layout._samples,
    )


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("decode", [False, True])
def test_add_plain_equals_adding_row_by_row(seed, decode):
    """Decode rows (a placeholder or a known token), prompt chunks that sample or not,
    in one batch or two (the second continues the first's token and row counts)."""
    rng = random.Random(seed)
    rows, reqs = [], []
    for i in range(rng.randint(1, 12)):
        n = 1 if decode or rng.random() < 0.6 else rng.randint(2, 6)
        ids = [rng.choice([PLACEHOLDER, rng.randint(0, 99)]) for _ in range(n)]
        rows.append(ScheduledRow(f"r{i}", rng.randint(0, 40), ids, [], rng.random() < 0.8))
        reqs.append(WorkerRequest([1, 2], None, array("q", [3]), rng.randint(0, 63)))
    one, two = StepLayout(99, 0, 1), StepLayout(99, 0, 1)
    for row, req in zip(rows, reqs):
        one.add(row, req, 0, False, 1 << 20, 16)
    cut = rng.randint(0, len(rows))
    two.add_plain(rows[:cut], reqs[:cut])
    two.add_plain(rows[cut:], reqs[cut:])
    assert _lists(one) == _lists(two)
