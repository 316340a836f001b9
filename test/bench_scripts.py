"""Load a script of benchmarks/ as a module for its tests; the configs of
benchmarks/models."""

from __future__ import annotations

import contextlib
import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

from gyrfalcon.config.model_config import ModelConfig

ROOT = Path(__file__).resolve().parents[1]
MODELS = ROOT / "benchmarks" / "models"


def bench_model_config(name: str) -> ModelConfig:
    """The config of benchmarks/models/<name> (a shape served with dummy weights)."""
    return ModelConfig.from_dir(str(MODELS / name))


@contextlib.contextmanager
def bench_script(filename: str) -> Iterator[ModuleType]:
    """benchmarks/<filename> imported under a name of its own, registered in
    sys.modules while in use (dataclasses look their module up there)."""
    name = "gyrfalcon_script_" + filename.removesuffix(".py")
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / filename)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    try:
        spec.loader.exec_module(mod)
        yield mod
    finally:
        sys.modules.pop(name, None)
