"""Which TP groups stay on one node (the one-shot all-reduce needs it)."""

import pytest

from gyrfalcon.config.nodes import tp_groups_within_nodes


@pytest.mark.parametrize(
    ("world", "tp", "nnodes", "within"),
    [
        (2, 2, 1, True),  # one node holds everything
        (8, 8, 1, True),
        (4, 2, 2, True),  # two ranks a node, tp 2: ranks {0, 1} and {2, 3}
        (4, 4, 2, False),  # tp 4 over two nodes of two ranks
        (8, 2, 2, True),
        (6, 2, 3, True),
        (6, 3, 2, True),  # ranks {0, 1, 2} on node 0, {3, 4, 5} on node 1
        (4, 1, 4, True),  # no TP group to speak of
        (12, 4, 2, False),  # 6 ranks a node: group {4, 5, 6, 7} spans nodes 0 and 1
    ],
)
def test_tp_groups_within_nodes(world, tp, nnodes, within):
    assert tp_groups_within_nodes(world, tp, nnodes) == within
    # the same by listing: each group's nodes
    per_node = world // nnodes
    spans = any(len({r // per_node for r in range(g, g + tp)}) > 1 for g in range(0, world, tp))
    assert within == (not spans)
