"""KV page allocator with reference counts and an executable integrity check.

Page 0 is the reserved dummy page: padded rows read and write it, nobody owns it,
it is never handed out. Reference counts let the prefix cache share pages later.
"""

from __future__ import annotations

from collections.abc import Iterable

from gyrfalcon.ipc.contract import DUMMY_PAGE


class OutOfPages(Exception):
    """Raised when an allocation cannot be satisfied; nothing was allocated."""


class PageAllocator:
    def __init__(self, num_pages: int):
        assert num_pages >= 2, "need the dummy page and at least one usable page"
        self.num_pages = num_pages
        self._free: list[int] = list(range(num_pages - 1, DUMMY_PAGE, -1))  # pop() -> low ids first
        self._ref = [0] * num_pages

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_usable(self) -> int:
        return self.num_pages - 1

    def alloc(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfPages(f"asked for {n} pages, {len(self._free)} free")
        pages = [self._free.pop() for _ in range(n)]
        for p in pages:
            self._ref[p] = 1
        return pages

    def share(self, pages: Iterable[int]) -> None:
        """Take one more reference on pages already owned."""
        for p in pages:
            assert self._ref[p] > 0, f"page {p} is free"
            self._ref[p] += 1

    def free(self, pages: Iterable[int]) -> None:
        """Drop one reference; a page returns to the free list at zero."""
        for p in pages:
            assert p != DUMMY_PAGE, "the dummy page is never freed"
            assert self._ref[p] > 0, f"double free of page {p}"
            self._ref[p] -= 1
            if self._ref[p] == 0:
                self._free.append(p)

    def check_integrity(self, owners: Iterable[Iterable[int]] = ()) -> None:
        """Raise AssertionError unless every page is free xor referenced by its owners.

        `owners` lists the page tables of everything holding references
        (requests, prefix cache); each holding counts one reference.
        """
        counts = [0] * self.num_pages
        for table in owners:
            for p in table:
                counts[p] += 1
        free = set(self._free)
        if len(free) != len(self._free):
            raise AssertionError("free list holds a page twice")
        if DUMMY_PAGE in free or counts[DUMMY_PAGE] or self._ref[DUMMY_PAGE]:
            raise AssertionError("the dummy page was handed out")
        for p in range(1, self.num_pages):
            if counts[p] != self._ref[p]:
                raise AssertionError(f"page {p}: {counts[p]} owners but refcount {self._ref[p]}")
            if (p in free) == (self._ref[p] > 0):
                raise AssertionError(f"page {p}: free={p in free} refcount={self._ref[p]}")
