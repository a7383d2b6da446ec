"""patches/fused_gate_sigmoid_mul_cpu.py: the torch fallback equals SGLang's Triton kernel (run
under TRITON_INTERPRET=1 in a subprocess) and is batch-invariant; CPU tensors take it, others not."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from superinfer_patches import fused_gate_sigmoid_mul_cpu as patch


def _inputs(tokens: int, hidden: int, dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(tokens, hidden, generator=gen).to(dtype)
    w = torch.randn(hidden, generator=gen).to(dtype) * 0.1
    s = torch.randn(tokens, hidden, generator=gen).to(dtype)
    f = torch.randn(tokens, hidden, generator=gen).to(dtype)
    return h, w, s, f


@pytest.mark.parametrize("do_add", [True, False])
def test_matches_formula(do_add: bool) -> None:
    h, w, s, f = _inputs(5, 48, torch.float32)
    out = f.clone()
    patch.gate_sigmoid_mul(h, w, s, out, do_add=do_add)
    gate = torch.sigmoid((h.double() * w.double()).sum(-1, keepdim=True))
    want = gate * s.double() + (f.double() if do_add else 0)
    torch.testing.assert_close(out.double(), want, rtol=1e-6, atol=1e-6)


def test_batch_invariant() -> None:
    """A token's output does not depend on the other tokens of its batch (rotation's exactness
    check compares a request served alone with the same request batched)."""
    h, w, s, f = _inputs(9, 64, torch.float32)
    batched = f.clone()
    patch.gate_sigmoid_mul(h, w, s, batched, do_add=True)
    for i in range(9):
        alone = f[i:i + 1].clone()
        patch.gate_sigmoid_mul(h[i:i + 1], w, s[i:i + 1], alone, do_add=True)
        assert torch.equal(alone[0], batched[i])


def test_hook_dispatch() -> None:
    h, w, s, f = _inputs(3, 16, torch.float32)
    calls = []

    def original(*args: object, **kwargs: object) -> str:
        calls.append((args, kwargs))
        return "original"

    out = f.clone()
    assert patch._launch(original, h, w, s, out, do_add=True) is None and not calls
    assert not torch.equal(out, f)
    assert patch._launch(original, h, w, s, out, True, do_add=True) == "original"  # unknown form
    meta = torch.empty(3, 16, device="meta")
    assert patch._launch(original, meta, w, s, out, do_add=False) == "original"


def test_equals_sglang_triton_kernel_interpreted() -> None:
    code = textwrap.dedent("""
        import os, torch
        os.environ["TRITON_INTERPRET"] = "1"
        from sglang.kernels.ops.elementwise import elementwise as ew
        from superinfer_patches.fused_gate_sigmoid_mul_cpu import gate_sigmoid_mul
        gen = torch.Generator().manual_seed(3)
        for do_add in (True, False):
            h, s, f = (torch.randn(6, 40, generator=gen) for _ in range(3))
            w = torch.randn(40, generator=gen) * 0.1
            ref, ours = f.clone(), f.clone()
            ew._launch_fused_gate_sigmoid_mul(h, w, s, ref, do_add=do_add)
            gate_sigmoid_mul(h, w, s, ours, do_add=do_add)
            torch.testing.assert_close(ours, ref, rtol=1e-6, atol=1e-6)
        print("OK")
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "TRITON_INTERPRET": "1"})
    assert proc.stdout.strip().endswith("OK"), proc.stderr[-3000:]
