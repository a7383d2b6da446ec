"""Fast CPU attention for SGLang's paged KV pool (replaces torch_native's per-request loops).

- paged.py: batched decode/extend attention in plain torch (plans built once per forward).
- native.py + csrc/paged_decode.c: a C decode kernel that reads K/V in place (built on first use
  with the system C compiler; the torch path is the fallback).
- backend.py: SuperInferCpuAttnBackend, a TorchNativeAttnBackend subclass that SGLang builds for
  `--attention-backend torch_native` once patches/cpu_attention_backend.py is registered.

Only backend.py imports sglang. This module stays import-light: the plugin reads the switch below
in every SGLang process.

Switch: SUPERINFER_CPU_ATTENTION=1 turns it on, =0 off; unset, it follows SUPERINFER_CPU_COMPAT
(our launcher sets that on CPU; set it by hand for stock `python -m sglang.launch_server`).
SUPERINFER_CPU_ATTENTION_KERNEL=auto|native|torch picks the decode kernel (default auto: the C
kernel when it builds, else torch).
SUPERINFER_CPU_FAST_OPS=0 leaves out the CPU op patches that come with the attention (packed
bfloat16 linear / lm_head, C RMSNorm and rotary: ops.py, linear.py); default on wherever the
attention is on.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

CPU_ATTENTION_ENV = "SUPERINFER_CPU_ATTENTION"
KERNEL_ENV = "SUPERINFER_CPU_ATTENTION_KERNEL"
FAST_OPS_ENV = "SUPERINFER_CPU_FAST_OPS"
KERNELS = ("auto", "native", "torch")
_CPU_COMPAT_ENV = "SUPERINFER_CPU_COMPAT"  # same name as plugin.CPU_COMPAT_ENV (not imported: no cycle)


def cpu_attention_enabled(environ: Mapping[str, str] | None = None) -> bool:
    env = os.environ if environ is None else environ
    value = env.get(CPU_ATTENTION_ENV)
    if value is None or value == "":
        return env.get(_CPU_COMPAT_ENV) == "1"
    if value not in ("0", "1"):
        raise ValueError(f"{CPU_ATTENTION_ENV} must be 0 or 1, got {value!r}")
    return value == "1"


def kernel_choice(environ: Mapping[str, str] | None = None) -> str:
    env = os.environ if environ is None else environ
    value = env.get(KERNEL_ENV) or "auto"
    if value not in KERNELS:
        raise ValueError(f"{KERNEL_ENV} must be one of {KERNELS}, got {value!r}")
    return value


def cpu_fast_ops_enabled(environ: Mapping[str, str] | None = None) -> bool:
    """The CPU op patches (linear/lm_head packing, RMSNorm, rotary): on with the attention."""
    env = os.environ if environ is None else environ
    value = env.get(FAST_OPS_ENV) or "1"
    if value not in ("0", "1"):
        raise ValueError(f"{FAST_OPS_ENV} must be 0 or 1, got {value!r}")
    return value == "1" and cpu_attention_enabled(env)
