"""Cost profiles for models we have not measured, scaled from one we have: an MoE (Mixtral-8x7B on
an H200) and an MLA model (DeepSeek-V2-Lite on an H100), from the H100 profile measured on our GPU
machine (Qwen2.5-32B-shaped layers, PCIe Gen5 link).

  python -m superinfer_sgl.sim scale-profile h200-mixtral-8x7b   # writes profiles/<name>.json

Each coefficient of the step model moves with what bounds it (docs/sim.md, "Scaled profiles"):
- compute per token (prefill and decode per-token costs): the model's *active* parameters (an MoE
  token runs only its experts), at the same tensor-core peak (H100 and H200 share the GH100 die);
- the memory-bound decode floor: *all* weights read once per step (at the batch sizes that
  matter every expert is touched), over the device's HBM bandwidth;
- the per-context-token cost (attention reading the KV): KV bytes per token over HBM bandwidth
  (MLA reads its 576-value latent, not per-head K and V);
- the per-pair prefill attention cost: layers x query heads x (QK + PV head dims);
- fixed per-iteration costs and the host link: the base profile's (the link is the PCIe Gen5 x16
  link measured on the H100 machine: an H200 machine has the same host interface).
The device KV pool is what the base profile assumes is left for it (88% of HBM less the bf16
weights), in KV bytes per token from the model's config (kv_geometry). These are estimates until a
GPU run of the model measures them: the profile's `sources` and `assumptions` say so.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from superinfer_sgl.bench.profiles import DUMMY_SHAPES
from superinfer_sgl.kv_geometry import kv_geometry
from superinfer_sgl.sim.profile import PROFILE_DIR

HBM_USABLE_SHARE = 0.88  # of device memory left to weights + KV (the base profile's assumption)
HOST_KV_BYTES = 200e9  # host DRAM given to the rotary pool (the base profile's 200 GB)
BF16_BYTES = 2


@dataclass(frozen=True)
class Device:
    name: str
    hbm_gb: float
    hbm_tb_s: float


@dataclass(frozen=True)
class Model:
    shape: str  # a DUMMY_SHAPES key: the public config.json
    name: str
    total_params: float
    active_params: float  # per token (MoE: the routed experts a token uses, plus shared parts)
    source: str


@dataclass(frozen=True)
class Target:
    base: str  # profiles/<base>.json, measured
    base_model: Model
    base_device: Device
    model: Model
    device: Device


H100 = Device("NVIDIA H100 SXM 80 GB (HBM3)", 80.0, 3.35)
H200 = Device("NVIDIA H200 141 GB (HBM3e)", 141.0, 4.8)
QWEN32B = Model("qwen2.5-32b", "Qwen2.5-32B", 32.76e9, 32.76e9, "Hugging Face Qwen/Qwen2.5-32B model card")
MIXTRAL = Model("mixtral-8x7b", "Mixtral-8x7B", 46.7e9, 12.9e9,
                "Mistral AI, Mixtral of Experts (2024): 46.7B parameters, 12.9B active per token")
DSV2_LITE = Model("deepseek-v2-lite", "DeepSeek-V2-Lite", 15.7e9, 2.4e9,
                  "Hugging Face deepseek-ai/DeepSeek-V2-Lite model card: 15.7B parameters, 2.4B activated")
BASE = "h100-pcie5-qwen2.5-32b"

TARGETS: dict[str, Target] = {
    "h200-mixtral-8x7b": Target(BASE, QWEN32B, H100, MIXTRAL, H200),
    "h100-deepseek-v2-lite": Target(BASE, QWEN32B, H100, DSV2_LITE, H100),
}


def _pair_dims(cfg: dict[str, Any]) -> int:
    """Attention work per (query, key) pair: layers x query heads x (QK dim + PV dim)."""
    heads = int(cfg["num_attention_heads"])
    if cfg.get("kv_lora_rank"):  # MLA prefill attends per head with nope+rope keys and v values
        qk = int(cfg["qk_nope_head_dim"]) + int(cfg["qk_rope_head_dim"])
        v = int(cfg["v_head_dim"])
    else:
        qk = v = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads)
    return int(cfg["num_hidden_layers"]) * heads * (qk + v)


def scale(target: Target, base: dict[str, Any]) -> dict[str, Any]:
    """The target's profile as JSON, from the base profile's JSON."""
    old_cfg, new_cfg = DUMMY_SHAPES[target.base_model.shape], DUMMY_SHAPES[target.model.shape]
    old_geo, geo = kv_geometry(old_cfg), kv_geometry(new_cfg)
    kv = geo.bytes_per_token(BF16_BYTES)
    active = target.model.active_params / target.base_model.active_params
    weights = target.model.total_params / target.base_model.total_params
    hbm = target.base_device.hbm_tb_s / target.device.hbm_tb_s  # time per byte, relative
    kv_read = kv / old_geo.bytes_per_token(BF16_BYTES)
    pairs = _pair_dims(new_cfg) / _pair_dims(old_cfg)
    st = base["step"]
    step = {
        "base_s": st["base_s"], "prefill_base_s": st["prefill_base_s"],
        "floor_s": _sig(st["floor_s"] * weights * hbm),
        "per_prefill_token_s": _sig(st["per_prefill_token_s"] * active),
        "per_decode_token_s": _sig(st["per_decode_token_s"] * active),
        "per_context_token_s": _sig(st["per_context_token_s"] * kv_read * hbm),
        "per_prefill_pair_s": _sig(st["per_prefill_pair_s"] * pairs),
        "per_prefill_req_s": st["per_prefill_req_s"],
    }
    weight_bytes = target.model.total_params * BF16_BYTES
    pool = int((HBM_USABLE_SHARE * target.device.hbm_gb * 1e9 - weight_bytes) // kv) // 16 * 16
    assert pool > 0, f"{target.model.name} does not fit on {target.device.name}"
    server = {**base["server"], "kv_tokens": pool, "host_kv_tokens": int(HOST_KV_BYTES // kv)}
    name = next(k for k, v in TARGETS.items() if v == target)
    link = {**base["link"], "name": f"{base['link']['name']}; the base profile's link, not re-measured"}
    return {
        "name": name,
        "comment": (f"{target.model.name} (bf16, {geo.layout.upper()} KV) on one {target.device.name}: scaled from "
                    f"profiles/{target.base}.json by `python -m superinfer_sgl.sim scale-profile {name}` "
                    "(superinfer_sgl/sim/scale_profile.py); an estimate until a GPU run measures it."),
        "sources": [
            f"scaled from profiles/{target.base}.json (measured: see its sources)",
            f"model: {target.model.source}; config.json shape in superinfer_sgl/bench/profiles.py DUMMY_SHAPES",
            f"device: {target.device.name}, {target.device.hbm_tb_s} TB/s, same BF16 tensor-core peak as the base",
        ],
        "assumptions": [
            f"KV per token {kv} B: {geo.layers} layers x {geo.buffers_per_layer} buffer(s) x "
            f"{geo.values_per_buffer} values x 2 bytes",
            f"KV pool: {HBM_USABLE_SHARE} x {target.device.hbm_gb:g} GB - {weight_bytes / 1e9:.1f} GB weights "
            f"= {pool} tokens",
            f"per-token compute x {active:.4f} (active parameters {target.model.active_params / 1e9:g}B "
            f"/ {target.base_model.active_params / 1e9:g}B)",
            f"decode floor x {weights * hbm:.4f} (all weights {target.model.total_params / 1e9:g}B read per step "
            f"at {target.device.hbm_tb_s} TB/s)",
            f"per-context-token x {kv_read * hbm:.4f} (KV bytes per token and HBM bandwidth)",
            f"per-prefill-pair x {pairs:.4f} (layers x query heads x (QK + PV dims))",
            f"host KV pool {HOST_KV_BYTES / 1e9:g} GB; fixed step costs, server limits and link as the base",
        ],
        "model": {"name": target.model.name, "layers": geo.layers, "kv_bytes_per_token": kv,
                  "kv_buffers_per_layer": geo.buffers_per_layer},
        "server": server,
        "step": step,
        "link": link,
        "scheduler": base.get("scheduler", {}),
    }


def _sig(x: float) -> float:
    """Four significant digits: the estimate is no better, and the JSON stays readable."""
    return float(f"{x:.4g}")


def write(name: str, out_dir: Path = PROFILE_DIR) -> Path:
    if name not in TARGETS:
        raise ValueError(f"unknown scaled profile {name!r}; known: {sorted(TARGETS)}")
    target = TARGETS[name]
    base = json.loads((PROFILE_DIR / f"{target.base}.json").read_text())
    path = out_dir / f"{name}.json"
    path.write_text(json.dumps(scale(target, base), indent=1) + "\n")
    return path
