"""What the bench_spec.py tests share."""

from collections.abc import Iterator
from types import ModuleType

import pytest
from bench_scripts import bench_script


@pytest.fixture(scope="module")
def bs() -> Iterator[ModuleType]:
    """benchmarks/bench_spec.py, imported as a module."""
    with bench_script("bench_spec.py") as mod:
        yield mod
