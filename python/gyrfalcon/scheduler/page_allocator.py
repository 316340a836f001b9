"""KV page allocator with reference counts and an executable integrity check.

Page 0 is the reserved dummy page: padded rows read and write it, nobody owns it,
it is never handed out. Reference counts let requests share pages: the prefix
cache (prefix_cache.py) holds one reference on each page it caches (`hold`), and a
cached page nobody else references is *evictable*: it counts as free, sits in LRU
order (least recently released first), and `alloc` takes it back from the cache
(`on_evict`) only when the free list runs short.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable

from gyrfalcon.ipc.contract import DUMMY_PAGE


class OutOfPages(Exception):
    """Raised when an allocation cannot be satisfied; nothing was allocated."""


class PageAllocator:
    def __init__(self, num_pages: int):
        assert num_pages >= 2, "need the dummy page and at least one usable page"
        self.num_pages = num_pages
        self._free: list[int] = list(range(num_pages - 1, DUMMY_PAGE, -1))  # pop() -> low ids first
        self._ref = [0] * num_pages
        self._held: set[int] = set()  # pages the prefix cache holds a reference on
        self._evictable: OrderedDict[int, None] = OrderedDict()  # held only by it, LRU first
        # called with each evictable page taken back (the cache forgets it)
        self.on_evict: Callable[[int], None] | None = None

    @property
    def num_free(self) -> int:
        """Pages an allocation may take: free ones and evictable cached ones."""
        return len(self._free) + len(self._evictable)

    @property
    def num_evictable(self) -> int:
        return len(self._evictable)

    @property
    def held(self) -> frozenset[int]:
        """Pages the prefix cache holds a reference on."""
        return frozenset(self._held)

    @property
    def num_usable(self) -> int:
        return self.num_pages - 1

    def alloc(self, n: int) -> list[int]:
        if n == 0:
            return []  # NOTE: most decode rows of most steps
        if n > self.num_free:
            raise OutOfPages(f"asked for {n} pages, {self.num_free} free")
        while len(self._free) < n:
            self.evict(next(iter(self._evictable)))
        pages = [self._free.pop() for _ in range(n)]
        for p in pages:
            self._ref[p] = 1
        return pages

    def share(self, pages: Iterable[int]) -> None:
        """Take one more reference on pages already owned (an evictable page is then
        in use again)."""
        for p in pages:
            assert self._ref[p] > 0, f"page {p} is free"
            self._ref[p] += 1
            self._evictable.pop(p, None)

    def free(self, pages: Iterable[int]) -> None:
        """Drop one reference; a page returns to the free list at zero, or becomes
        evictable when only the cache still holds it, as the most recently released;
        within `pages` (a page table), the later pages (deeper in the cache's tree)
        count as released first, so eviction takes the deepest first."""
        released = []
        for p in pages:
            assert p != DUMMY_PAGE, "the dummy page is never freed"
            assert self._ref[p] > 0, f"double free of page {p}"
            self._ref[p] -= 1
            if self._ref[p] == 0:
                self._free.append(p)
            elif self._ref[p] == 1 and p in self._held:
                released.append(p)
        for p in reversed(released):
            self._evictable[p] = None
            self._evictable.move_to_end(p)

    def hold(self, page: int) -> None:
        """The cache takes its reference on an owned page."""
        assert page not in self._held, f"page {page} is cached twice"
        self.share([page])
        self._held.add(page)

    def evict(self, page: int) -> None:
        """The cache drops its reference on `page` (`on_evict` tells it first)."""
        assert page in self._held, f"page {page} is not cached"
        if self.on_evict is not None:
            self.on_evict(page)
        self.unhold(page)

    def unhold(self, page: int) -> None:
        """The cache drops its reference on `page` untold: it is dropping the page's
        node itself (a descendant of an evicted node)."""
        assert page in self._held, f"page {page} is not cached"
        self._held.discard(page)
        self._evictable.pop(page, None)
        self.free([page])

    def check_integrity(self, owners: Iterable[Iterable[int]] = ()) -> None:
        """Raise AssertionError unless every page is free xor referenced by its owners.

        `owners` lists the page tables of everything holding references
        (requests); the cache's holds count one reference each. An evictable page is
        one the cache alone holds.
        """
        counts = [0] * self.num_pages
        for table in owners:
            for p in table:
                counts[p] += 1
        for p in self._held:
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
            if (p in self._evictable) != (p in self._held and self._ref[p] == 1):
                raise AssertionError(f"page {p}: evictable={p in self._evictable}, wrongly")
