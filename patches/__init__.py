"""Small, version-guarded changes to SGLang internals; one target per module.

Each patch module names its TARGET (a dotted path into sglang), the SGLang versions it was written
for, and a `register()` that installs it through SGLang's HookRegistry. `check()` verifies that the
target still exists, so an SGLang upgrade fails loudly here instead of silently misbehaving.
"""

from __future__ import annotations

import importlib
from importlib import metadata

from superinfer_sgl import SUPPORTED_SGLANG_VERSION

SUPPORTED_SGLANG = (SUPPORTED_SGLANG_VERSION,)  # the one constant lives in superinfer_sgl


class PatchError(RuntimeError):
    """A patch cannot be applied to the installed SGLang."""


def sglang_version() -> str | None:
    try:
        return metadata.version("sglang")
    except metadata.PackageNotFoundError:
        return None


def resolve(target: str) -> object:
    """Import the object at a dotted path (module attribute chain), or raise PatchError."""
    parts = target.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj: object = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            if not hasattr(obj, attr):
                raise PatchError(f"patch target {target} not found (missing {attr!r})")
            obj = getattr(obj, attr)
        return obj
    raise PatchError(f"patch target {target} not importable")


def check_target(target: str) -> None:
    version = sglang_version()
    if version not in SUPPORTED_SGLANG:
        raise PatchError(f"patch for {target} supports sglang {SUPPORTED_SGLANG}, found {version}")
    resolve(target)
