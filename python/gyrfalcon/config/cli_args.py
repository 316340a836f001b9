"""The command line from dataclasses: one flag per field (`add_dataclass_args`), and
the parsers of sizes and core counts the flags use."""

from __future__ import annotations

import argparse
import dataclasses
import os
from typing import Any


def add_dataclass_args(parser: argparse.ArgumentParser, cls: type) -> None:
    """One flag per field of the dataclass `cls`: --field-name, its type from the
    annotation, its default, and the field's metadata ("help", "positional", the
    rest passed to argparse); bool fields are store_true switches."""
    for f in dataclasses.fields(cls):
        meta = dict(f.metadata)
        help_text = meta.pop("help", "")
        if meta.pop("positional", False):
            parser.add_argument(f.name, nargs="?", default=f.default, help=help_text)
            continue
        flag = "--" + f.name.replace("_", "-")
        if f.type in ("bool", bool):
            parser.add_argument(flag, action="store_true", default=f.default, help=help_text)
            continue
        parser.add_argument(
            flag,
            type=_parse_type(f.type),
            default=f.default,
            help=f"{help_text} (default: {f.default})",
            **meta,
        )


def _parse_type(annotation: Any) -> Any:
    text = str(annotation)
    if text.startswith("int"):
        return int
    if text.startswith("float"):
        return float
    return str


def available_cores() -> int:
    """The cores this process may run on (its CPU affinity; else the machine's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # NOTE: no sched_getaffinity on macOS
        return os.cpu_count() or 1


def parse_size(text: str) -> int:
    """Parse '2GiB', '512MiB', '1.5GB', '4096' into bytes."""
    units = {
        "kib": 1 << 10,
        "mib": 1 << 20,
        "gib": 1 << 30,
        "tib": 1 << 40,
        "kb": 10**3,
        "mb": 10**6,
        "gb": 10**9,
        "tb": 10**12,
        "k": 1 << 10,
        "m": 1 << 20,
        "g": 1 << 30,
        "b": 1,
    }
    s = text.strip().lower().replace(" ", "")
    for suffix in sorted(units, key=len, reverse=True):
        if s.endswith(suffix):
            return int(float(s[: -len(suffix)]) * units[suffix])
    return int(float(s))
