"""Version-guarded SGLang targets, and the torch rotary-embedding fallback of the CPU patch.

The target checks fail loudly when an SGLang upgrade moves or renames something we hook.
"""

from __future__ import annotations

import importlib
import inspect
import math
import pkgutil
import re
import sys
from collections.abc import Callable
from typing import Any

import pytest
import torch
from sglang.srt.plugins.hook_registry import HookType

import superinfer_patches
from superinfer_patches import PatchError, check_target, resolve
from superinfer_patches import rotary_embedding_cpu as rope_patch
from superinfer_patches.rotary_embedding_cpu import rotary_embedding
from superinfer_sgl.config import SuperInferConfig
from superinfer_sgl.integration import handshake
from superinfer_sgl.integration import hooks as our_hooks

# Every patch module (one target each), found on disk so that a new one is checked too.
PATCH_MODULES = [
    importlib.import_module(f"superinfer_patches.{info.name}")
    for info in sorted(pkgutil.iter_modules(superinfer_patches.__path__), key=lambda i: i.name)
]


def _all_hooks() -> list[tuple[str, Callable[..., Any], HookType]]:
    cfg = SuperInferConfig(slo_classes='{"chat": {"ttft_ms": 800, "tbt_ms": 40}}')
    return [
        *handshake.hooks(cfg, []),
        *our_hooks.hooks(cfg),
        (rope_patch.TARGET, rope_patch._around_init, HookType.AROUND),
    ]


def _ids(hooks: list[tuple[str, Any, Any]]) -> list[str]:
    return [t.removeprefix("sglang.srt.") for t, _, _ in hooks]


ALL_HOOKS = _all_hooks()


# --- targets ------------------------------------------------------------------------------------


def test_installed_sglang_is_supported() -> None:
    assert superinfer_patches.sglang_version() in superinfer_patches.SUPPORTED_SGLANG


def test_patch_modules_found() -> None:
    assert rope_patch in PATCH_MODULES


@pytest.mark.parametrize("module", PATCH_MODULES, ids=lambda m: m.__name__.rsplit(".", 1)[-1])
def test_patch_targets_resolve(module: Any) -> None:
    assert isinstance(module.TARGET, str) and module.TARGET.startswith("sglang.")
    assert callable(module.register)
    # TARGET and any other dotted sglang path the module names (e.g. a factory it relies on).
    for name, value in vars(module).items():
        if name.isupper() and isinstance(value, str) and value.startswith("sglang."):
            assert callable(resolve(value)), name
            check_target(value)
    if hasattr(module, "check"):
        module.check()


def test_handshake_targets_resolve() -> None:
    for target in (handshake.SCHEDULER_INFO, handshake.LAUNCH):
        assert callable(resolve(target))
        check_target(target)


@pytest.mark.parametrize(("target", "hook", "kind"), ALL_HOOKS, ids=_ids(ALL_HOOKS))
def test_integration_targets_resolve(target: str, hook: Any, kind: HookType) -> None:
    obj = resolve(target)
    check_target(target)
    if isinstance(obj, type):
        # HookRegistry only allows REPLACE on a class, and a replacement must stay a subclass.
        assert kind is HookType.REPLACE and isinstance(hook, type) and issubclass(hook, obj)
    else:
        assert callable(obj) and not isinstance(hook, type)


def _raw_function(target: str) -> Callable[..., Any]:
    """The function HookRegistry wraps: classmethod/staticmethod unwrapped, self/cls included."""
    owner_path, attr = target.rsplit(".", 1)
    owner = resolve(owner_path)
    raw = owner.__dict__.get(attr) if isinstance(owner, type) else getattr(owner, attr)
    return raw.__func__ if isinstance(raw, (classmethod, staticmethod)) else raw


@pytest.mark.parametrize(
    ("target", "hook", "kind"),
    [h for h in ALL_HOOKS if h[2] is not HookType.REPLACE],
    ids=_ids([h for h in ALL_HOOKS if h[2] is not HookType.REPLACE]),
)
def test_hook_signatures_fit_targets(target: str, hook: Any, kind: HookType) -> None:
    """Every way SGLang may call the target (required only, all positional, by keyword) binds."""
    params = list(inspect.signature(_raw_function(target)).parameters.values())
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    required = [object() for p in positional if p.default is p.empty]
    every = [object() for _ in positional]
    by_keyword = {p.name: object() for p in positional[1:] if p.kind is not p.POSITIONAL_ONLY}
    lead = {HookType.BEFORE: [], HookType.AFTER: [object()], HookType.AROUND: [lambda *a, **k: None]}[kind]
    sig = inspect.signature(hook)
    sig.bind(*lead, *required)
    sig.bind(*lead, *every)
    sig.bind(*lead, object(), **by_keyword)


def test_launch_result_carries_scheduler_infos_at_index_3() -> None:
    """handshake.verify reads result[3].scheduler_infos from Engine._launch_subprocesses."""
    from sglang.srt.entrypoints.engine import SchedulerInitResult

    ann = inspect.signature(_raw_function(handshake.LAUNCH)).return_annotation
    ann = ann if isinstance(ann, str) else str(ann)
    inner = re.sub(r"\s+", "", ann)
    items = re.match(r"(?:typing\.)?Tuple\[(.*)\]$", inner, re.S)
    assert items, ann
    depth, parts, cur = 0, [], ""
    for ch in items.group(1):
        depth += ch == "["
        depth -= ch == "]"
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    parts.append(cur)
    assert parts[3].rsplit(".", 1)[-1] == "SchedulerInitResult"
    assert "scheduler_infos" in SchedulerInitResult.__dataclass_fields__


def test_resolve_missing_attribute() -> None:
    with pytest.raises(PatchError, match="missing 'no_such_method'"):
        resolve("sglang.srt.managers.scheduler.Scheduler.no_such_method")
    with pytest.raises(PatchError, match="missing 'no_such_module'"):
        resolve("sglang.srt.no_such_module.Thing")


def test_resolve_unimportable() -> None:
    with pytest.raises(PatchError, match="not importable"):
        resolve("superinfer_no_such_package.mod.attr")


def test_check_target_missing() -> None:
    with pytest.raises(PatchError, match="not found"):
        check_target("sglang.srt.layers.rotary_embedding.base.RotaryEmbedding.__init_v2__")


@pytest.mark.parametrize("version", ["0.5.22", "0.6.0", None])
def test_check_target_other_sglang_version(monkeypatch: pytest.MonkeyPatch, version: str | None) -> None:
    monkeypatch.setattr(superinfer_patches, "sglang_version", lambda: version)
    with pytest.raises(PatchError, match=f"found {version}"):
        check_target(rope_patch.TARGET)


def test_sglang_version_reads_metadata(monkeypatch: pytest.MonkeyPatch) -> None:
    def missing(name: str) -> str:
        raise superinfer_patches.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(superinfer_patches.metadata, "version", missing)
    assert superinfer_patches.sglang_version() is None


def test_register_refuses_other_sglang_version(monkeypatch: pytest.MonkeyPatch) -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry

    monkeypatch.setattr(superinfer_patches, "sglang_version", lambda: "0.6.0")
    before = len(HookRegistry._hooks.get(rope_patch.TARGET, []))
    with pytest.raises(PatchError):
        rope_patch.register()
    assert len(HookRegistry._hooks.get(rope_patch.TARGET, [])) == before


# --- the torch rotary fallback ------------------------------------------------------------------


def _reference(positions: list[int], x: torch.Tensor, head_size: int, cache: torch.Tensor,
               is_neox: bool) -> torch.Tensor:
    """Straight from the definition: per token, per head, per rotated pair, in Python floats."""
    out = x.detach().clone().reshape(len(positions), -1)
    src = out.clone()
    half = cache.shape[1] // 2
    heads = out.shape[1] // head_size
    for t, p in enumerate(positions):
        for h in range(heads):
            base = h * head_size
            for i in range(half):
                c, s = float(cache[p, i]), float(cache[p, half + i])
                i1, i2 = (base + i, base + half + i) if is_neox else (base + 2 * i, base + 2 * i + 1)
                a, b = float(src[t, i1]), float(src[t, i2])
                out[t, i1] = a * c - b * s
                out[t, i2] = b * c + a * s
    return out.reshape(x.shape)


def _rope_cache(max_pos: int, rot_dim: int, base: float = 10000.0) -> torch.Tensor:
    rows = []
    for p in range(max_pos):
        angles = [p / base ** (2 * i / rot_dim) for i in range(rot_dim // 2)]
        rows.append([math.cos(a) for a in angles] + [math.sin(a) for a in angles])
    return torch.tensor(rows, dtype=torch.float32)


CASES = [
    # tokens, q heads, kv heads, head_size, rotary_dim, max_pos
    (1, 1, 1, 8, 8, 4),
    (3, 2, 1, 16, 16, 32),
    (5, 3, 3, 12, 12, 64),  # non-power-of-two head size
    (4, 4, 2, 16, 8, 16),  # partial rotary: dims 8..15 pass through
    (2, 2, 2, 10, 4, 8),
]


@pytest.mark.parametrize("is_neox", [True, False], ids=["neox", "gptj"])
@pytest.mark.parametrize("case", CASES, ids=[f"t{c[0]}h{c[1]}k{c[2]}d{c[3]}r{c[4]}" for c in CASES])
@pytest.mark.parametrize("cache_kind", ["rope", "random"])
def test_rotary_matches_reference(case: tuple[int, ...], is_neox: bool, cache_kind: str) -> None:
    tokens, hq, hk, d, rot, max_pos = case
    seed = sum(case) * 4 + 2 * is_neox + (cache_kind == "rope")  # deterministic across runs
    gen = torch.Generator().manual_seed(seed)
    cache = _rope_cache(max_pos, rot) if cache_kind == "rope" else torch.randn(max_pos, rot, generator=gen)
    positions = torch.randint(0, max_pos, (tokens,), generator=gen)
    q = torch.randn(tokens, hq * d, generator=gen)
    k = torch.randn(tokens, hk * d, generator=gen)
    want_q = _reference(positions.tolist(), q, d, cache, is_neox)
    want_k = _reference(positions.tolist(), k, d, cache, is_neox)
    q0, k0 = q.clone(), k.clone()
    assert rotary_embedding(positions, q, k, d, cache, is_neox) is None
    torch.testing.assert_close(q, want_q, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(k, want_k, rtol=1e-5, atol=1e-6)
    # Pass-through dims are bit-identical.
    for x, x0, h in ((q, q0, hq), (k, k0, hk)):
        assert torch.equal(x.view(tokens, h, d)[..., rot:], x0.view(tokens, h, d)[..., rot:])


def test_rotary_position_zero_is_identity() -> None:
    cache = _rope_cache(4, 8)
    q = torch.randn(3, 16)
    q0 = q.clone()
    rotary_embedding(torch.zeros(3, dtype=torch.long), q, None, 8, cache, True)
    torch.testing.assert_close(q, q0, rtol=0, atol=1e-7)


@pytest.mark.parametrize("is_neox", [True, False])
def test_rotary_key_none(is_neox: bool) -> None:
    cache = _rope_cache(16, 8)
    positions = torch.tensor([3, 0, 15])
    q = torch.randn(3, 2 * 8)
    want = _reference(positions.tolist(), q, 8, cache, is_neox)
    rotary_embedding(positions, q, None, 8, cache, is_neox)
    torch.testing.assert_close(q, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("is_neox", [True, False])
def test_rotary_in_place_on_fused_qkv_views(is_neox: bool) -> None:
    tokens, hq, hk, d, rot = 4, 3, 1, 16, 8
    cache = torch.randn(32, rot)
    qkv = torch.randn(tokens, (hq + 2 * hk) * d)
    before = qkv.clone()
    q = qkv[:, : hq * d]
    k = qkv[:, hq * d : (hq + hk) * d]
    assert not q.is_contiguous() and not k.is_contiguous()
    positions = torch.tensor([31, 0, 7, 7])
    want_q = _reference(positions.tolist(), before[:, : hq * d], d, cache, is_neox)
    want_k = _reference(positions.tolist(), before[:, hq * d : (hq + hk) * d], d, cache, is_neox)
    rotary_embedding(positions, q, k, d, cache, is_neox)
    torch.testing.assert_close(qkv[:, : hq * d], want_q, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(qkv[:, hq * d : (hq + hk) * d], want_k, rtol=1e-5, atol=1e-6)
    assert torch.equal(qkv[:, (hq + hk) * d :], before[:, (hq + hk) * d :])  # V untouched


def test_rotary_3d_inputs_and_2d_positions() -> None:
    cache = torch.randn(16, 8)
    positions = torch.tensor([[1, 2], [3, 15]])
    q = torch.randn(4, 2, 8)  # [tokens, heads, head_size]
    k = torch.randn(4, 1, 8)
    want_q = _reference(positions.flatten().tolist(), q, 8, cache, True)
    want_k = _reference(positions.flatten().tolist(), k, 8, cache, True)
    rotary_embedding(positions, q, k, 8, cache, True)
    torch.testing.assert_close(q, want_q, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(k, want_k, rtol=1e-5, atol=1e-6)


def test_rotary_bf16_close_to_reference() -> None:
    cache = _rope_cache(64, 16)
    positions = torch.tensor([0, 5, 63])
    q = torch.randn(3, 32).to(torch.bfloat16)
    want = _reference(positions.tolist(), q.float(), 16, cache, True)
    rotary_embedding(positions, q, None, 16, cache, True)
    assert q.dtype == torch.bfloat16
    torch.testing.assert_close(q.float(), want, rtol=3e-2, atol=3e-2)


# --- the constructor shim -----------------------------------------------------------------------


def _make_rope(is_neox: bool = True, head_size: int = 16, rotary_dim: int = 16) -> Any:
    from sglang.srt.layers.rotary_embedding.base import RotaryEmbedding

    obj = RotaryEmbedding.__new__(RotaryEmbedding)
    rope_patch._around_init(RotaryEmbedding.__init__, obj, head_size, rotary_dim, 64, 10000,
                            is_neox, torch.float32)
    return obj


@pytest.mark.skipif(rope_patch._vllm_available(), reason="vLLM installed: the shim stays out of the way")
def test_around_init_leaves_no_fake_vllm() -> None:
    assert rope_patch._SHIM_NAME not in sys.modules
    rope = _make_rope()
    assert rope_patch._SHIM_NAME not in sys.modules
    assert "vllm" not in sys.modules
    if rope.use_fallback_kernel and not torch.cuda.is_available():
        # The constructor really went through the shim (stock SGLang would raise ImportError here).
        assert rope.fallback_rotary_embedding is rotary_embedding


@pytest.mark.skipif(rope_patch._vllm_available(), reason="vLLM installed: the shim stays out of the way")
def test_around_init_cleans_up_when_constructor_fails() -> None:
    def failing(*args: Any, **kwargs: Any) -> None:
        assert sys.modules[rope_patch._SHIM_NAME].rotary_embedding is rotary_embedding
        raise RuntimeError("ctor failed")

    with pytest.raises(RuntimeError, match="ctor failed"):
        rope_patch._around_init(failing)
    assert rope_patch._SHIM_NAME not in sys.modules


def test_around_init_respects_existing_module(monkeypatch: pytest.MonkeyPatch) -> None:
    existing = object()
    monkeypatch.setitem(sys.modules, rope_patch._SHIM_NAME, existing)
    seen: list[object] = []
    assert rope_patch._around_init(lambda x: seen.append(sys.modules[rope_patch._SHIM_NAME]) or x, 7) == 7
    assert seen == [existing] and sys.modules[rope_patch._SHIM_NAME] is existing


@pytest.mark.parametrize(("is_neox", "rotary_dim"), [(True, 16), (False, 16), (True, 8)])
def test_fallback_agrees_with_sglang_native(is_neox: bool, rotary_dim: int) -> None:
    """Our kernel on the constructed layer's own cache agrees with SGLang's forward_native."""
    rope = _make_rope(is_neox, 16, rotary_dim)
    positions = torch.tensor([0, 1, 17, 63])
    q, k = torch.randn(4, 2 * 16), torch.randn(4, 1 * 16)
    want_q, want_k = rope.forward_native(positions, q.clone(), k.clone())
    rotary_embedding(positions, q, k, 16, rope.cos_sin_cache, is_neox)
    torch.testing.assert_close(q, want_q, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(k, want_k, rtol=1e-5, atol=1e-5)
