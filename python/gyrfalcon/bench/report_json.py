"""Benchmark reports as JSON that stays small in the repository: nested objects are
indented as `json.dumps(indent=2)` would, but an object or list holding only scalars
(a request's record, a column of per-request values) goes on one line, without
spaces. The text
parses to the same value as the plain dump; only the whitespace differs
(benchmarks/results holds over a hundred of these reports).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

INDENT = "  "


def _flat(o: Any) -> bool:
    items = o.values() if isinstance(o, dict) else o
    return not any(isinstance(v, (dict, list)) for v in items)


def dumps(report: Any, level: int = 0) -> str:
    """`report` as JSON text (module docstring); NaN and infinities are refused."""
    if not isinstance(report, (dict, list)) or not report or _flat(report):
        return json.dumps(report, allow_nan=False, separators=(",", ":"))
    pad, end = INDENT * (level + 1), INDENT * level
    if isinstance(report, dict):
        items = [f"{pad}{json.dumps(k)}: {dumps(v, level + 1)}" for k, v in report.items()]
        return "{\n" + ",\n".join(items) + f"\n{end}}}"
    items = [pad + dumps(v, level + 1) for v in report]
    return "[\n" + ",\n".join(items) + f"\n{end}]"


def write(path: str | Path, report: Any) -> None:
    """Write `report` to `path` (`dumps`), ending with a newline."""
    Path(path).write_text(dumps(report) + "\n", encoding="utf-8")
