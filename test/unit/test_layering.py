"""The layering contract of pyproject.toml ([tool.importlinter]): the compute stack
(models > layers > forward > kernels) never imports the worker, scheduler or
frontend; those three meet only through ipc/; no import loops between siblings."""

from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_import_contracts_hold(monkeypatch):
    from importlinter.cli import lint_imports

    monkeypatch.chdir(ROOT)  # the contracts live in ROOT/pyproject.toml
    monkeypatch.syspath_prepend(str(ROOT / "python"))
    assert os.path.exists("pyproject.toml")
    assert lint_imports(no_cache=True) == 0, "run `lint-imports` for the broken contract"
