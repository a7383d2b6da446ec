"""Scheduling policies by name. Each entry builds a fresh policy object (policies keep state)."""

from __future__ import annotations

from collections.abc import Callable

from superinfer_sgl.registry import Registry
from superinfer_sgl.sim.policies.base import Plan, Policy, Victim
from superinfer_sgl.sim.policies.oracle import Oracle
from superinfer_sgl.sim.policies.rotasched import RotaSched
from superinfer_sgl.sim.policies.sglang import SGLangFCFS, SGLangPriority
from superinfer_sgl.sim.policies.vllm import VllmSwap

POLICIES: Registry[Callable[[], Policy]] = Registry("simulator policy", {
    "sglang": SGLangFCFS,
    "sglang-priority": SGLangPriority,
    "vllm-swap-waiting-first": lambda: VllmSwap(swapped_first=False),
    "vllm-swap-swapped-first": lambda: VllmSwap(swapped_first=True),
    "lvf-naive": lambda: RotaSched("naive"),
    "lvf-batched": lambda: RotaSched("batched"),
    "lvf-duplex": lambda: RotaSched("duplex"),
    "lvf-naive-direct": lambda: RotaSched("naive", direct_resume=True),
    "lvf-duplex-direct": lambda: RotaSched("duplex", direct_resume=True),
    # Our server as shipped (--policy goodput / paper): DuplexKV, its default quantum, decode
    # shortages answered by rotation (--decode-shortage rotate).
    "goodput": lambda: RotaSched("duplex", policy="goodput", name="goodput", shortage_rotates=True),
    "paper": lambda: RotaSched("duplex", policy="paper", name="paper", shortage_rotates=True),
    "oracle": Oracle,
})


def make_policy(name: str) -> Policy:
    return POLICIES[name]()  # an unknown name: a ValueError listing the known ones


__all__ = ["POLICIES", "Plan", "Policy", "Victim", "make_policy"]
