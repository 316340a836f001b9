"""The one-shot kernels' ranks simulated on the CPU (the Triton interpreter runs one
launch at a time, so the ranks of a call take turns; the test modules that import this
set TRITON_INTERPRET first): the wire format written independently of the kernels, the
receive buffers and call counts of every rank, and a peer's arrival as its kernel's
step 2 would leave it."""

import torch

from gyrfalcon.kernels.all_reduce import (
    CHUNK,
    MAX_PROGRAMS,
    buffer_words,
    flag_of,
    one_shot_all_reduce,
    place_of,
    programs_for,
    words_per_slot,
)

HALF = 4 * CHUNK  # the tests' largest tensor


def words_of(values: torch.Tensor, flag: int) -> torch.Tensor:
    """The wire format, written here independently of the kernel: 32 data bits per
    int64 word (two 16-bit elements, the first in the low bits; or one float32) and the
    flag in the upper half."""
    if values.element_size() == 2:
        bits = values.view(torch.int16).to(torch.int64) & 0xFFFF
        if bits.numel() % 2:
            bits = torch.cat([bits, bits.new_zeros(1)])
        data = bits[0::2] | (bits[1::2] << 16)
    else:
        data = values.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    return data | (flag << 32)


class Ranks:
    """The receive buffers and call counts of `world` simulated ranks."""

    def __init__(self, world: int, dtype: torch.dtype, half: int = HALF):
        self.world, self.dtype, self.half = world, dtype, half
        self.slot = words_per_slot(half)
        self.data = [
            torch.zeros(buffer_words(world, half), dtype=torch.int64) for _ in range(world)
        ]
        self.uses = [torch.zeros(MAX_PROGRAMS, dtype=torch.int64) for _ in range(world)]
        self.buf_ptrs = torch.tensor([t.data_ptr() for t in self.data], dtype=torch.int64)

    def at(self, receiver: int, sender: int, use: int, place: int, n: int) -> torch.Tensor:
        """The words of `n` elements of this call's dtype from word `place` of the
        sender's slot in the receiver's buffer, in the half of call `use`."""
        epw = 4 // torch.tensor([], dtype=self.dtype).element_size()
        first = ((use % 2) * self.world + sender) * self.slot + place
        return self.data[receiver][first : first + (n + epw - 1) // epw]

    def arrive(self, p: int, x: torch.Tensor, waiting: int) -> None:
        """Rank p's step 2 for its next call, seen from rank `waiting`: its chunks."""
        n = x.numel()
        chunks = [(b, place_of(b), x[b * CHUNK : (b + 1) * CHUNK]) for b in range(programs_for(n))]
        self.arrive_parts(p, chunks, waiting)

    def arrive_parts(self, p: int, parts: list, waiting: int, ahead: int = 1) -> None:
        """`arrive` for parts (program, place in a slot in words, values); `ahead`: which
        of p's next calls (2: the one after its next)."""
        for b, at, values in parts:
            use = int(self.uses[p][b]) + ahead
            self.at(waiting, p, use, at, values.numel())[:] = words_of(values, flag_of(use))

    def all_reduce(self, xs: list[torch.Tensor]) -> list[torch.Tensor]:
        """One call of every rank (in rank order), each with its own addend."""
        outs = []
        for r in range(self.world):
            for p in range(r + 1, self.world):
                self.arrive(p, xs[p], waiting=r)
            out = torch.empty_like(xs[r])
            one_shot_all_reduce(xs[r], out, self.buf_ptrs, self.uses[r], r, self.half)
            outs.append(out)
        return outs


def addends(world: int, n: int, dtype: torch.dtype, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=g).to(dtype) for _ in range(world)]


def reference(xs: list[torch.Tensor]) -> torch.Tensor:
    """The sum in rank order in float32."""
    acc = torch.zeros(xs[0].shape, dtype=torch.float32)
    for x in xs:
        acc += x.float()
    return acc


def close_to_reference(out: torch.Tensor, xs: list[torch.Tensor]) -> None:
    """float32: exactly the rank-order sum; 16-bit: that sum rounded once (the
    interpreter truncates where the GPU rounds to nearest: within one unit)."""
    want = reference(xs)
    if out.dtype == torch.float32:
        assert torch.equal(out, want)
        return
    ulp = want.abs().clamp_min(1e-30) * torch.finfo(out.dtype).eps
    assert ((out.float() - want).abs() <= ulp).all(), (out, want)
