"""SGLang plugin entry point (group `sglang.srt.plugins`), loaded in every SGLang process.

Installed in a venv, this module is loaded by stock `python -m sglang.launch_server` as well, so it
must stay inert there: it installs our hooks only when our launcher put SUPERINFER_SGL_CONFIG into
the environment. The CPU-compatibility patch has its own switch (SUPERINFER_CPU_COMPAT=1) so that
stock SGLang can serve on a CPU as the A/B baseline with nothing else changed; it also switches on
our batched CPU attention (superinfer_sgl.cpu_attention) unless SUPERINFER_CPU_ATTENTION=0.
SUPERINFER_STEP_LOG=<path> (any server, stock included) logs every scheduler iteration there
(patches/step_log.py: measurement only).
"""

from __future__ import annotations

import os

from .cpu_attention import cpu_attention_enabled, cpu_fast_ops_enabled

CPU_COMPAT_ENV = "SUPERINFER_CPU_COMPAT"
CPU_ATTENTION_ENV = "SUPERINFER_CPU_ATTENTION"


def cpu_compat_enabled(environ: dict[str, str] | None = None) -> bool:
    return (environ if environ is not None else os.environ).get(CPU_COMPAT_ENV) == "1"


def load() -> None:
    from .config import SuperInferConfig

    if cpu_compat_enabled():
        from superinfer_patches import fused_gate_sigmoid_mul_cpu, rotary_embedding_cpu

        rotary_embedding_cpu.register()
        fused_gate_sigmoid_mul_cpu.register()  # Qwen2-MoE's shared-expert gate (a Triton kernel)
    if cpu_attention_enabled():
        # On wherever the CPU-compatibility switch is (our launcher on CPU, or stock SGLang with
        # SUPERINFER_CPU_COMPAT=1, so an A/B compares scheduling at equal attention speed);
        # SUPERINFER_CPU_ATTENTION=0 keeps SGLang's own torch_native attention.
        from superinfer_patches import cpu_attention_backend

        cpu_attention_backend.register()
    if cpu_fast_ops_enabled():  # with the attention; SUPERINFER_CPU_FAST_OPS=0 leaves these out
        from superinfer_patches import (linear_packed_cpu, lm_head_packed_cpu, packed_weights_refresh, rmsnorm_cpu,
                                        rotary_forward_cpu, silu_and_mul_cpu)

        for patch in (linear_packed_cpu, lm_head_packed_cpu, packed_weights_refresh, rmsnorm_cpu, rotary_forward_cpu,
                      silu_and_mul_cpu):
            patch.register()
    from superinfer_patches import step_log

    if step_log.step_log_path():
        step_log.register()
    cfg = SuperInferConfig.from_env()
    if cfg is None:
        return
    from .integration import install

    install(cfg)
