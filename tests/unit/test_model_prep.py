"""Preparing the embedded default model: cache location, package lookup, stamp, atomic conversion."""

from __future__ import annotations

import json
from importlib import metadata
from pathlib import Path

import pytest

from superinfer_sgl import model_prep
from superinfer_sgl.model_prep import (
    DEFAULT_MODEL_NAME,
    MODEL_PACKAGE,
    GgufSource,
    ModelPrepError,
    default_cache_dir,
    is_prepared,
    prepare_default_model,
)

STAMP = "superinfer_prepared.json"


@pytest.fixture
def src(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> GgufSource:
    """A fake GGUF file standing in for the installed package's one."""
    path = tmp_path / "pkg" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    path.parent.mkdir()
    path.write_bytes(b"GGUF" + bytes(60))
    source = GgufSource(path, "0.1.2")
    monkeypatch.setattr(model_prep, "find_gguf", lambda: source)
    return source


def _target(cache: Path) -> Path:
    return cache / "models" / DEFAULT_MODEL_NAME


def _leftovers(cache: Path) -> list[str]:
    models = cache / "models"
    return sorted(p.name for p in models.iterdir() if p.name.startswith(".prep-")) if models.exists() else []


def _fake_convert(calls: list[Path]):
    def convert(source: GgufSource, out: Path) -> None:
        calls.append(out)
        assert out.is_dir() and out.name.startswith(".prep-")
        (out / "config.json").write_text(json.dumps({"model_type": "llama"}))

    return convert


# --- cache location -----------------------------------------------------------------------------


def test_cache_dir_env_wins(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("SUPERINFER_CACHE_DIR", str(tmp_path / "mine"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache_dir() == tmp_path / "mine"


def test_cache_dir_expands_user(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("SUPERINFER_CACHE_DIR", "~/models-cache")
    assert default_cache_dir() == tmp_path / "models-cache"


def test_cache_dir_xdg(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("SUPERINFER_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache_dir() == tmp_path / "xdg" / "superinfer_sgl"


def test_cache_dir_home_fallback(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("SUPERINFER_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", "")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert default_cache_dir() == tmp_path / ".cache" / "superinfer_sgl"


# --- the model package --------------------------------------------------------------------------


def test_find_gguf_missing_package(monkeypatch: pytest.MonkeyPatch) -> None:
    def missing(name: str) -> metadata.Distribution:
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(model_prep.metadata, "distribution", missing)
    with pytest.raises(ModelPrepError) as info:
        model_prep.find_gguf()
    assert MODEL_PACKAGE in str(info.value) and "--model-path" in str(info.value)


def test_find_gguf_package_without_file(monkeypatch: pytest.MonkeyPatch) -> None:
    class Dist:
        version = "9.9"
        files: list[object] = []

    monkeypatch.setattr(model_prep.metadata, "distribution", lambda name: Dist())
    with pytest.raises(ModelPrepError, match="does not contain"):
        model_prep.find_gguf()


# --- the stamp ----------------------------------------------------------------------------------


def test_is_prepared_needs_stamp(tmp_path: Path, src: GgufSource) -> None:
    assert not is_prepared(tmp_path / "absent", src)
    (tmp_path / "config.json").write_text("{}")
    assert not is_prepared(tmp_path, src)


def test_is_prepared_fingerprint(tmp_path: Path, src: GgufSource) -> None:
    stamp = tmp_path / STAMP
    stamp.write_text(json.dumps({"fingerprint": "0123456789abcdef"}))
    assert not is_prepared(tmp_path, src)
    stamp.write_text("{not json")
    assert not is_prepared(tmp_path, src)
    stamp.write_text(json.dumps({"fingerprint": model_prep._fingerprint(src)}))
    assert is_prepared(tmp_path, src)
    # Another package version (or a changed file) invalidates it.
    assert not is_prepared(tmp_path, GgufSource(src.path, "0.1.3"))
    src.path.write_bytes(b"GGUF" + bytes(61))
    assert not is_prepared(tmp_path, src)


def test_fingerprint_ignores_mtime_but_not_content(tmp_path: Path, src: GgufSource) -> None:
    """Two virtualenvs install the same wheel with different mtimes and share the prepared folder:
    they must agree on it, or each re-converts it under the other's servers."""
    import os

    twin = tmp_path / "other-venv" / src.path.name
    twin.parent.mkdir()
    twin.write_bytes(src.path.read_bytes())
    os.utime(twin, (1_000_000, 1_000_000))
    assert model_prep._fingerprint(GgufSource(twin, "0.1.2")) == model_prep._fingerprint(src)
    twin.write_bytes(b"GGUF" + bytes(59) + b"x")  # same size, one byte changed
    assert model_prep._fingerprint(GgufSource(twin, "0.1.2")) != model_prep._fingerprint(src)


# --- prepare_default_model ----------------------------------------------------------------------


def test_prepared_folder_is_reused(tmp_path: Path, src: GgufSource, monkeypatch: pytest.MonkeyPatch) -> None:
    target = _target(tmp_path)
    target.mkdir(parents=True)
    (target / STAMP).write_text(json.dumps({"fingerprint": model_prep._fingerprint(src)}))

    def never(*args: object) -> None:
        raise AssertionError("_convert must not run for a prepared folder")

    monkeypatch.setattr(model_prep, "_convert", never)
    assert prepare_default_model(tmp_path) == target


def test_converts_then_renames(tmp_path: Path, src: GgufSource, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[Path] = []
    monkeypatch.setattr(model_prep, "_convert", _fake_convert(calls))
    target = prepare_default_model(tmp_path)
    assert target == _target(tmp_path)
    assert len(calls) == 1 and calls[0].parent == target.parent and calls[0] != target
    assert (target / "config.json").is_file()
    assert is_prepared(target, src)
    assert json.loads((target / STAMP).read_text())["source"] == str(src.path)
    assert _leftovers(tmp_path) == []
    # A second call reuses it.
    assert prepare_default_model(tmp_path) == target and len(calls) == 1


def test_default_cache_dir_is_used(tmp_path: Path, src: GgufSource, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SUPERINFER_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(model_prep, "_convert", _fake_convert([]))
    assert prepare_default_model() == _target(tmp_path / "cache")


def test_stale_folder_is_replaced(tmp_path: Path, src: GgufSource, monkeypatch: pytest.MonkeyPatch) -> None:
    target = _target(tmp_path)
    target.mkdir(parents=True)
    (target / "stale.bin").write_text("old")
    (target / STAMP).write_text(json.dumps({"fingerprint": "old"}))
    monkeypatch.setattr(model_prep, "_convert", _fake_convert([]))
    assert prepare_default_model(tmp_path) == target
    assert not (target / "stale.bin").exists() and is_prepared(target, src)
    assert _leftovers(tmp_path) == []


@pytest.mark.parametrize("error", [RuntimeError("boom"), ModelPrepError("corrupt gguf")])
def test_failed_conversion_leaves_nothing(tmp_path: Path, src: GgufSource,
                                          monkeypatch: pytest.MonkeyPatch, error: Exception) -> None:
    def convert(source: GgufSource, out: Path) -> None:
        (out / "model.safetensors").write_bytes(b"half written")
        raise error

    monkeypatch.setattr(model_prep, "_convert", convert)
    with pytest.raises(ModelPrepError) as info:
        prepare_default_model(tmp_path)
    if isinstance(error, ModelPrepError):
        assert info.value is error
    else:
        assert "boom" in str(info.value) and str(src.path) in str(info.value)
    assert not _target(tmp_path).exists()
    assert _leftovers(tmp_path) == []


def test_interrupted_conversion_leaves_nothing(tmp_path: Path, src: GgufSource,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    def convert(source: GgufSource, out: Path) -> None:
        (out / "model.safetensors").write_bytes(b"half written")
        raise KeyboardInterrupt

    monkeypatch.setattr(model_prep, "_convert", convert)
    with pytest.raises(KeyboardInterrupt):
        prepare_default_model(tmp_path)
    assert not _target(tmp_path).exists()
    assert _leftovers(tmp_path) == []


def test_interrupted_conversion_never_looks_prepared(tmp_path: Path, src: GgufSource,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    def convert(source: GgufSource, out: Path) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(model_prep, "_convert", convert)
    with pytest.raises(KeyboardInterrupt):
        prepare_default_model(tmp_path)
    assert not _target(tmp_path).exists()
