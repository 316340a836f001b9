"""Values and index math both ends of the scheduler -> worker edge rely on.

The scheduler plans with them and the worker executes with them; neither side
imports the other, so they live here, beside the messages they describe.
"""

from __future__ import annotations

# Input id of a position whose token is still being sampled by a step in flight:
# the worker substitutes the id it sampled, on the device.
PLACEHOLDER = -1

# The reserved KV page: never handed to a request; padded and dummy rows read and
# write only this page, so a padded batch needs no KV capacity beyond it.
DUMMY_PAGE = 0


def pages_needed(pages_held: int, end: int, page_size: int) -> int:
    """Extra pages for KV positions [0, end) given pages already held."""
    return max(0, -(-end // page_size) - pages_held)
