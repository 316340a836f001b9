"""Prefix caching: full KV pages shared by content between requests of one DP rank.

A cached page is a node of a tree: its key is (its parent node's id, the page's
tokens and the one token after them); the root's id is 0. Node ids are never reused,
so a key names one exact token prefix for as long as the node lives, and a match
compares tokens, never hashes. A request arriving with the same leading tokens walks
the tree page by page and starts with those pages shared (reference counts,
page_allocator.py) and their positions computed.

Why the token after the page is in the key: the EAGLE3 drafter's KV at position p is
computed from the target's features at p and the token at p + 1 (its input), so the
drafter's KV of a page's last position depends on the next page's first token. With
it in the key, a hit reuses the drafter's KV as well as the target's: it is cached
too, never recomputed. The same rule bounds what may be cached: page i of a request
is inserted once its positions [iP, (i+1)P) are computed and the token at (i+1)P is
known (`cacheable_pages`), and a match always leaves at least the last prompt token
to compute (its logits give the first output token). With a drafter, a request that
does not draft (penalties: `verifies_drafts`) writes no drafter KV, so its pages are
never inserted (it may still match pages others inserted).

The cache holds one reference on each cached page. A page nobody else holds is
evictable (LRU, allocator): allocation takes it back when the free list runs short,
and its descendants go with it. Requests that ask for prompt logprobs never match
(their prefix's logits would not be computed).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from gyrfalcon.ipc.contract import verifies_drafts
from gyrfalcon.scheduler.page_allocator import PageAllocator
from gyrfalcon.scheduler.request import Request

ROOT = 0  # the parent id of a first page


@dataclass
class Node:
    id: int
    key: tuple[int, tuple[int, ...]]  # (parent id, the page's tokens + the next token)
    page: int
    children: set[int] = field(default_factory=set)  # child node ids


def page_key(parent: int, tokens: list[int], i: int, page_size: int) -> tuple[int, tuple[int, ...]]:
    """The key of page i of `tokens` under node `parent`: its tokens and the next one."""
    return parent, tuple(tokens[i * page_size : (i + 1) * page_size + 1])


def cacheable_pages(num_computed: int, num_known: int, page_size: int) -> int:
    """Leading pages of a request that may be cached: every position computed and the
    token after the page known, (i + 1) P <= min(num_computed, num_known - 1)."""
    return max(0, min(num_computed, num_known - 1)) // page_size


class PrefixCache:
    """The cached pages of one DP rank's allocator (module docstring)."""

    def __init__(self, alloc: PageAllocator, page_size: int, drafter_kv: bool = False):
        """drafter_kv: the pages also hold an EAGLE3 drafter's KV (speculative decoding)."""
        self.alloc, self.page_size, self.drafter_kv = alloc, page_size, drafter_kv
        self._by_key: dict[tuple[int, tuple[int, ...]], Node] = {}
        self._by_id: dict[int, Node] = {}
        self._by_page: dict[int, Node] = {}
        self._ids = itertools.count(ROOT + 1)
        alloc.on_evict = self._forget
        self.queried_tokens = 0  # prompt tokens of admissions
        self.hit_tokens = 0  # of them, found cached

    @property
    def num_pages(self) -> int:
        return len(self._by_page)

    def match(self, tokens: list[int]) -> list[Node]:
        """The cached nodes of the longest page-aligned prefix of `tokens` that leaves
        at least the last token to compute, in order."""
        nodes: list[Node] = []
        parent = ROOT
        for i in range((len(tokens) - 1) // self.page_size):
            node = self._by_key.get(page_key(parent, tokens, i, self.page_size))
            if node is None:
                break
            nodes.append(node)
            parent = node.id
        return nodes

    def _match_request(self, req: Request) -> list[Node]:
        """The nodes `acquire` would start req on (none when prompt logprobs are asked
        for: those need every prompt position's logits)."""
        if req.sampling.prompt_logprobs is not None:
            return []
        return self.match(req.prompt_ids + req.output_ids)

    def cached_tokens(self, req: Request) -> int:
        """How many of req's tokens `acquire` would find cached now (DP routing)."""
        return len(self._match_request(req)) * self.page_size

    def acquire(self, req: Request) -> int:
        """Start a request with no pages on its cached prefix: share the pages, count
        their positions computed; returns the tokens found."""
        assert not req.pages and req.num_computed == 0, "only a request without pages"
        nodes = self._match_request(req)
        pages = [n.page for n in nodes]
        self.alloc.share(pages)
        req.pages = pages
        req.num_computed = len(pages) * self.page_size
        req.cache_node = nodes[-1].id if nodes else ROOT
        req.num_cache_pages = len(nodes)
        return req.num_computed

    def release(self, req: Request) -> None:
        """Undo `acquire` (the request was not admitted after all)."""
        self.alloc.free(req.pages)
        req.pages, req.num_computed = [], 0
        req.cache_node, req.num_cache_pages = ROOT, 0

    def count(self, queried: int, hit: int) -> None:
        """One admission: its tokens, and how many of them were found cached."""
        self.queried_tokens += queried
        self.hit_tokens += hit

    def insert(self, req: Request) -> None:
        """Cache the request's pages that became cacheable since its last insert. A page
        whose content is cached already (computed twice, side by side) stays the
        request's own; the chain goes on from the cached node, which the request does
        not hold and eviction may take."""
        if self.drafter_kv and not verifies_drafts(req.sampling):
            return  # NOTE: its pages lack the drafter's KV (module docstring)
        if req.cache_node not in self._by_id and req.cache_node != ROOT:
            # NOTE: the chain went through a node whose page the request does not hold
            # (a duplicate it computed itself); that node was evicted, its descendants
            # with it. Walking again from the root finds what is still cached and caches
            # the request's own copies in place of the rest.
            req.cache_node, req.num_cache_pages = ROOT, 0
        if req.num_computed // self.page_size <= req.num_cache_pages:
            return  # NOTE: most steps of a decoding request (one page per P tokens)
        num_known = len(req.prompt_ids) + len(req.output_ids)
        upto = min(cacheable_pages(req.num_computed, num_known, self.page_size), len(req.pages))
        if upto <= req.num_cache_pages:
            return
        tokens = req.prompt_ids + req.output_ids
        for i in range(req.num_cache_pages, upto):
            key = page_key(req.cache_node, tokens, i, self.page_size)
            node = self._by_key.get(key)
            if node is None:
                node = Node(next(self._ids), key, req.pages[i])
                self._by_key[key] = self._by_id[node.id] = self._by_page[node.page] = node
                if req.cache_node != ROOT:
                    self._by_id[req.cache_node].children.add(node.id)
                self.alloc.hold(node.page)
            req.cache_node, req.num_cache_pages = node.id, i + 1

    def _forget(self, page: int) -> None:
        """The allocator takes `page` back: drop its node and every descendant (their
        keys name it as an ancestor; their pages stay with whoever else holds them)."""
        top = self._by_page[page]
        parent = self._by_id.get(top.key[0])
        if parent is not None:
            parent.children.discard(top.id)
        # NOTE: a loop, not a recursion through the allocator: a generation of
        # thousands of pages hangs under one node (Python's recursion limit is 1,000)
        stack = [top]
        while stack:
            node = stack.pop()
            stack += [self._by_id[c] for c in node.children]
            del self._by_key[node.key], self._by_id[node.id], self._by_page[node.page]
            if node is not top:
                self.alloc.unhold(node.page)

    def check_integrity(self) -> None:
        """Raise AssertionError unless the tree and the allocator's holds agree."""
        assert set(self._by_page) == self.alloc.held, "cached pages != pages the cache holds"
        assert len(self._by_key) == len(self._by_id) == len(self._by_page)
        for node in self._by_id.values():
            assert self._by_key[node.key] is node and self._by_page[node.page] is node
            parent = node.key[0]
            assert parent == ROOT or node.id in self._by_id[parent].children, "orphaned node"
            assert len(node.key[1]) == self.page_size + 1, "a key of the wrong length"
            for child in node.children:
                assert self._by_id[child].key[0] == node.id, "a child of another parent"
