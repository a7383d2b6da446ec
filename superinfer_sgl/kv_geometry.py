"""How much KV cache one token takes, from a model's config.json: the one rule for the launcher's
CPU KV budget, the A/B harness's vLLM byte budget and the simulator's scaled profiles.

Two layouts cover the families we serve (docs/models.md):
- MHA/GQA (Llama, Qwen2, Mixtral, Gemma...): each layer keeps K and V, `num_key_value_heads` x
  `head_dim` values each (SGLang's MHATokenToKVPool).
- MLA (DeepSeek V2/V3, Kimi): each layer keeps one latent of `kv_lora_rank + qk_rope_head_dim`
  values, K and V both derived from it (SGLang's MLATokenToKVPool).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DTYPE_BYTES = {"float32": 4, "float": 4, "float16": 2, "half": 2, "bfloat16": 2, "auto": 2,
               "fp8_e4m3": 1, "fp8_e5m2": 1}


@dataclass(frozen=True)
class KvGeometry:
    layout: str  # "mha" or "mla"
    layers: int
    buffers_per_layer: int  # 2 (K and V) for MHA, 1 (the latent) for MLA
    values_per_buffer: int  # values one token stores in one buffer of one layer

    def __post_init__(self) -> None:
        assert self.layout in ("mha", "mla"), self.layout
        assert self.layers >= 1 and self.buffers_per_layer in (1, 2) and self.values_per_buffer >= 1, self

    def bytes_per_token(self, dtype_bytes: int = 2) -> int:
        """All layers, all buffers."""
        return self.layers * self.buffers_per_layer * self.values_per_buffer * dtype_bytes


def kv_geometry(cfg: dict[str, Any]) -> KvGeometry:
    """The KV layout a config.json describes. MLA is recognised by `kv_lora_rank` (as SGLang's
    model_config does for DeepSeek-style models)."""
    layers = int(cfg["num_hidden_layers"])
    if cfg.get("kv_lora_rank"):
        return KvGeometry("mla", layers, 1, int(cfg["kv_lora_rank"]) + int(cfg.get("qk_rope_head_dim", 0)))
    heads = int(cfg["num_attention_heads"])
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    head_dim = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads)
    return KvGeometry("mha", layers, 2, kv_heads * head_dim)


def dtype_bytes(dtype: str) -> int:
    """Bytes per KV value of a --dtype / --kv-cache-dtype name (unknown names: 2, bf16's)."""
    return DTYPE_BYTES.get(dtype, 2)


def model_kv_bytes_per_token(model_path: str | Path, dtype: str = "auto") -> int:
    """KV bytes one token takes in a model folder (its config.json) at `dtype`."""
    cfg = json.loads((Path(model_path).expanduser() / "config.json").read_text())
    return kv_geometry(cfg).bytes_per_token(dtype_bytes(dtype))
