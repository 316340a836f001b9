"""Stream the tensors of a Hugging Face checkpoint directory.

Supported layouts, in order of preference:

* ``model.safetensors.index.json`` plus the shards it lists,
* a single ``model.safetensors``,
* ``pytorch_model.bin.index.json`` plus its shards, or a single
  ``pytorch_model.bin`` (loaded with ``weights_only=True``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator

import torch
from safetensors import safe_open
from tqdm.auto import tqdm

SAFETENSORS_INDEX = "model.safetensors.index.json"
SAFETENSORS_SINGLE = "model.safetensors"
TORCH_BIN_INDEX = "pytorch_model.bin.index.json"
TORCH_BIN_SINGLE = "pytorch_model.bin"


def _shards_from_index(model_dir: str, index_name: str) -> list[tuple[str, list[str]]]:
    """Group the tensor names of an index file by shard, in first-seen shard order."""
    index_path = os.path.join(model_dir, index_name)
    with open(index_path, encoding="utf-8") as f:
        weight_map = json.load(f).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise ValueError(f"{index_path} has no usable 'weight_map'")
    by_shard: dict[str, list[str]] = {}
    for name, shard in weight_map.items():
        by_shard.setdefault(shard, []).append(name)
    shards = []
    for shard, names in by_shard.items():
        path = os.path.join(model_dir, shard)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"shard {shard!r} listed in {index_path} does not exist")
        shards.append((path, names))
    return shards


def _safetensors_names(path: str) -> list[str]:
    """Return the tensor names stored in one safetensors file."""
    with safe_open(path, framework="pt") as f:
        return list(f.keys())


def _plan(model_dir: str) -> tuple[str, list[tuple[str, list[str] | None]]]:
    """Decide which files to read: returns (format, [(path, names or None), ...])."""
    if os.path.isfile(os.path.join(model_dir, SAFETENSORS_INDEX)):
        plan: list[tuple[str, list[str] | None]] = list(
            _shards_from_index(model_dir, SAFETENSORS_INDEX)
        )
        return "safetensors", plan
    single = os.path.join(model_dir, SAFETENSORS_SINGLE)
    if os.path.isfile(single):
        return "safetensors", [(single, _safetensors_names(single))]
    if os.path.isfile(os.path.join(model_dir, TORCH_BIN_INDEX)):
        return "bin", list(_shards_from_index(model_dir, TORCH_BIN_INDEX))
    single = os.path.join(model_dir, TORCH_BIN_SINGLE)
    if os.path.isfile(single):
        return "bin", [(single, None)]
    try:
        present = sorted(os.listdir(model_dir))
    except OSError as exc:
        raise FileNotFoundError(f"cannot read model directory {model_dir!r}: {exc}") from exc
    raise FileNotFoundError(
        f"no weights found in {model_dir!r}: expected {SAFETENSORS_SINGLE}, "
        f"{SAFETENSORS_INDEX}, {TORCH_BIN_SINGLE} or {TORCH_BIN_INDEX}; "
        f"directory contains {present[:20]}"
    )


def count_hf_weights(model_dir: str) -> int | None:
    """Number of tensors in the checkpoint, or None when unknown without loading it."""
    _, plan = _plan(model_dir)
    if any(names is None for _, names in plan):
        return None
    return sum(len(names or []) for _, names in plan)


def iter_hf_weights(
    model_dir: str,
    show_progress: bool = True,
    keep: Callable[[str], bool] | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` for every tensor of the checkpoint in ``model_dir``
    (every one that ``keep(name)`` accepts, when given: the others are not read).

    Each shard file is opened exactly once. Tensors are returned on the CPU with
    the dtype they were stored in. When ``show_progress`` is true a tqdm bar
    titled "Loading weights" counts tensors.

    Raises:
        FileNotFoundError: when the directory holds no recognised weight files,
            or an index names a shard that is missing.
        KeyError: when an index names a tensor that its shard does not contain.
    """
    fmt, plan = _plan(model_dir)
    known = [names for _, names in plan]
    total = None if any(n is None for n in known) else sum(len(n or []) for n in known)
    bar = tqdm(total=total, desc="Loading weights", unit="tensor", disable=not show_progress)
    try:
        for path, names in plan:
            if fmt == "safetensors":
                with safe_open(path, framework="pt") as f:
                    available = set(f.keys())
                    for name in names or []:
                        if name not in available:
                            raise KeyError(f"tensor {name!r} is not in shard {path}")
                        bar.update(1)
                        if keep is None or keep(name):
                            yield name, f.get_tensor(name)
            else:
                state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
                wanted = list(state.keys()) if names is None else names
                for name in wanted:
                    if name not in state:
                        raise KeyError(f"tensor {name!r} is not in shard {path}")
                    bar.update(1)
                    if keep is None or keep(name):
                        yield name, state[name]
                del state
    finally:
        bar.close()
