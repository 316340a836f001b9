import pytest

from gyrfalcon.ipc.contract import DUMMY_PAGE
from gyrfalcon.scheduler.page_allocator import OutOfPages, PageAllocator


def test_alloc_free_roundtrip_keeps_integrity():
    a = PageAllocator(8)
    assert a.num_free == 7
    p1 = a.alloc(3)
    p2 = a.alloc(2)
    assert DUMMY_PAGE not in p1 + p2
    assert len(set(p1 + p2)) == 5
    a.check_integrity([p1, p2])
    a.free(p1)
    a.check_integrity([p2])
    assert a.num_free == 5
    a.free(p2)
    a.check_integrity([])
    assert a.num_free == 7


def test_exhaustion_raises_and_allocates_nothing():
    a = PageAllocator(4)
    held = a.alloc(2)
    with pytest.raises(OutOfPages):
        a.alloc(2)
    assert a.num_free == 1
    a.check_integrity([held])


def test_double_free_and_dummy_free_are_caught():
    a = PageAllocator(4)
    p = a.alloc(1)
    a.free(p)
    with pytest.raises(AssertionError):
        a.free(p)
    with pytest.raises(AssertionError):
        a.free([DUMMY_PAGE])


def test_integrity_detects_leak_and_foreign_owner():
    a = PageAllocator(6)
    p = a.alloc(2)
    with pytest.raises(AssertionError, match="owners but refcount"):
        a.check_integrity([])  # leaked: referenced by nobody
    with pytest.raises(AssertionError):
        a.check_integrity([p, [p[0]]])  # claimed twice, one reference
    a.check_integrity([p])


def test_shared_pages_need_every_reference_dropped():
    a = PageAllocator(4)
    p = a.alloc(1)
    a.share(p)
    a.check_integrity([p, p])
    a.free(p)
    assert a.num_free == 2
    a.check_integrity([p])
    a.free(p)
    assert a.num_free == 3
