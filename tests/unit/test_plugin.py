"""The SGLang plugin entry point: inert unless enabled, and exactly our targets when enabled."""

from __future__ import annotations

import importlib
import subprocess
import sys
from collections.abc import Iterator

import pytest
from sglang.srt.plugins.hook_registry import HookRegistry, HookType

from superinfer_patches import rotary_embedding_cpu
from superinfer_sgl.cpu_attention import CPU_ATTENTION_ENV
from superinfer_sgl import integration, plugin
from superinfer_sgl.config import CONFIG_ENV, SuperInferConfig
from superinfer_sgl.integration import handshake
from superinfer_sgl.integration import hooks as our_hooks


@pytest.fixture(autouse=True)
def registry(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """An empty HookRegistry (and INSTALLED list) per test; the previous state restored after."""
    saved_hooks = {k: list(v) for k, v in HookRegistry._hooks.items()}
    saved_patched = set(HookRegistry._patched)
    HookRegistry.reset()
    monkeypatch.setattr(integration, "INSTALLED", [])
    monkeypatch.delenv(CONFIG_ENV, raising=False)
    monkeypatch.delenv(plugin.CPU_COMPAT_ENV, raising=False)
    monkeypatch.delenv(CPU_ATTENTION_ENV, raising=False)
    try:
        yield
    finally:
        HookRegistry.reset()
        HookRegistry._hooks.update(saved_hooks)
        HookRegistry._patched.update(saved_patched)


def _registered() -> dict[str, list[HookType]]:
    return {t: [kind for kind, _, _ in hooks] for t, hooks in HookRegistry._hooks.items() if hooks}


def _fast_ops() -> dict[str, list[HookType]]:
    """The CPU op patches registered with the CPU attention (SUPERINFER_CPU_FAST_OPS=0: none)."""
    from superinfer_patches import (linear_packed_cpu, lm_head_packed_cpu, packed_weights_refresh, rmsnorm_cpu,
                                    rotary_forward_cpu, silu_and_mul_cpu)

    return {**{m.TARGET: [HookType.AROUND] for m in (linear_packed_cpu, lm_head_packed_cpu, rmsnorm_cpu,
                                                     rotary_forward_cpu, silu_and_mul_cpu)},
            packed_weights_refresh.TARGET: [HookType.AFTER]}  # the packed copies dropped on a weight update


def _integration_targets(cfg: SuperInferConfig) -> list[str]:
    return [t for t, _, _ in handshake.hooks(cfg, [])] + [t for t, _, _ in our_hooks.hooks(cfg)]


def test_inert_without_env() -> None:
    plugin.load()
    assert _registered() == {}
    assert integration.INSTALLED == []


@pytest.mark.parametrize("value", ["0", "", "true", "yes"])
def test_cpu_compat_needs_exactly_one(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv(plugin.CPU_COMPAT_ENV, value)
    assert not plugin.cpu_compat_enabled()
    plugin.load()
    assert _registered() == {}


def test_cpu_compat_enabled_reads_mapping() -> None:
    assert plugin.cpu_compat_enabled({plugin.CPU_COMPAT_ENV: "1"})
    assert not plugin.cpu_compat_enabled({})


def _patch_targets() -> set[str]:
    """TARGET of every module in superinfer_patches (the CPU-compatibility patches)."""
    import pkgutil

    import superinfer_patches

    targets = set()
    for info in pkgutil.iter_modules(superinfer_patches.__path__):
        module = importlib.import_module(f"superinfer_patches.{info.name}")
        if isinstance(getattr(module, "TARGET", None), str):
            targets.add(module.TARGET)
    return targets


def _compat_ops() -> dict[str, list[HookType]]:
    """Torch fallbacks for Triton-only ops that come with the CPU-compatibility switch."""
    from superinfer_patches import fused_gate_sigmoid_mul_cpu

    return {fused_gate_sigmoid_mul_cpu.TARGET: [HookType.AROUND]}


def test_cpu_compat_registers_patches_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(plugin.CPU_COMPAT_ENV, "1")
    plugin.load()
    assert rotary_embedding_cpu.TARGET in _registered()
    assert set(_registered()) <= _patch_targets()
    assert integration.INSTALLED == []


def test_cpu_compat_switches_on_cpu_attention(monkeypatch: pytest.MonkeyPatch) -> None:
    """The one switch that lets stock SGLang serve on CPU also gives it our batched attention."""
    from superinfer_patches import cpu_attention_backend
    from superinfer_sgl.cpu_attention.backend import SuperInferCpuAttnBackend

    monkeypatch.setenv(plugin.CPU_COMPAT_ENV, "1")
    plugin.load()
    assert _registered() == {rotary_embedding_cpu.TARGET: [HookType.AROUND], **_compat_ops(),
                             cpu_attention_backend.TARGET: [HookType.REPLACE], **_fast_ops()}
    [(_, hook, _)] = HookRegistry._hooks[cpu_attention_backend.TARGET]
    assert hook is SuperInferCpuAttnBackend
    assert integration.INSTALLED == []


def test_cpu_attention_alone_without_compat(monkeypatch: pytest.MonkeyPatch) -> None:
    from superinfer_patches import cpu_attention_backend

    monkeypatch.setenv(CPU_ATTENTION_ENV, "1")
    plugin.load()
    assert _registered() == {cpu_attention_backend.TARGET: [HookType.REPLACE], **_fast_ops()}


def test_cpu_fast_ops_off(monkeypatch: pytest.MonkeyPatch) -> None:
    from superinfer_patches import cpu_attention_backend

    monkeypatch.setenv(CPU_ATTENTION_ENV, "1")
    monkeypatch.setenv("SUPERINFER_CPU_FAST_OPS", "0")
    plugin.load()
    assert _registered() == {cpu_attention_backend.TARGET: [HookType.REPLACE]}


def test_cpu_compat_registers_only_compat_ops(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(plugin.CPU_COMPAT_ENV, "1")
    monkeypatch.setenv(CPU_ATTENTION_ENV, "0")  # the CPU attention patch has its own switch
    plugin.load()
    assert _registered() == {rotary_embedding_cpu.TARGET: [HookType.AROUND], **_compat_ops()}
    [(_, hook, _)] = HookRegistry._hooks[rotary_embedding_cpu.TARGET]
    assert hook is rotary_embedding_cpu._around_init
    assert integration.INSTALLED == []  # the CPU patch is not one of our scheduler hooks


def test_config_registers_integration(monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = SuperInferConfig(scheduler="sglang", tbt_slo_ms=50.0)
    monkeypatch.setenv(CONFIG_ENV, cfg.to_env())
    plugin.load()
    expected = _integration_targets(cfg)
    assert handshake.SCHEDULER_INFO in expected and handshake.LAUNCH in expected
    assert len(expected) == len(set(expected))
    assert set(_registered()) == set(expected)
    assert all(len(kinds) == 1 for kinds in _registered().values())
    assert integration.INSTALLED == expected
    assert rotary_embedding_cpu.TARGET not in _registered()


def test_config_and_cpu_compat(monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = SuperInferConfig()
    monkeypatch.setenv(CONFIG_ENV, cfg.to_env())
    monkeypatch.setenv(plugin.CPU_COMPAT_ENV, "1")
    monkeypatch.setenv(CPU_ATTENTION_ENV, "0")
    plugin.load()
    assert set(_registered()) == {*_integration_targets(cfg), rotary_embedding_cpu.TARGET, *_compat_ops()}
    assert rotary_embedding_cpu.TARGET not in integration.INSTALLED


def test_registered_kinds_match_hook_definitions(monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = SuperInferConfig()
    monkeypatch.setenv(CONFIG_ENV, cfg.to_env())
    plugin.load()
    defined = {t: kind for t, _, kind in [*handshake.hooks(cfg, []), *our_hooks.hooks(cfg)]}
    assert {t: kinds[0] for t, kinds in _registered().items()} == defined


def test_entry_point_is_discoverable() -> None:
    code = (
        "import importlib.metadata as m\n"
        "eps = {e.name: e.value for e in m.entry_points(group='sglang.srt.plugins')}\n"
        "print(eps.get('superinfer_sgl'))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "superinfer_sgl.plugin:load"
