"""How much KV cache one token takes, from a model's config.json: the one rule for the launcher's
CPU KV budget, the A/B harness's vLLM byte budget and the simulator's scaled profiles.

Two layouts cover the families we serve (docs/models.md):
- MHA/GQA (Llama, Qwen2, Mixtral, Gemma...): each layer keeps K and V, `num_key_value_heads` x
  `head_dim` values for K and x `v_head_dim` (when given; else `head_dim`) for V (SGLang's
  MHATokenToKVPool).
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
    values_per_buffer: int  # values one token stores in one buffer (K's, with two) of one layer
    v_values: int | None = None  # V's values when they differ from K's (v_head_dim != head_dim)

    def __post_init__(self) -> None:
        assert self.layout in ("mha", "mla"), self.layout
        assert self.layers >= 1 and self.buffers_per_layer in (1, 2) and self.values_per_buffer >= 1, self
        assert self.v_values is None or (self.buffers_per_layer == 2 and self.v_values >= 1), self

    def bytes_per_token(self, dtype_bytes: int = 2) -> int:
        """All layers, all buffers."""
        per_layer = self.values_per_buffer
        if self.buffers_per_layer == 2:
            per_layer += self.values_per_buffer if self.v_values is None else self.v_values
        return self.layers * per_layer * dtype_bytes


def kv_geometry(cfg: dict[str, Any]) -> KvGeometry:
    """The KV layout a config.json describes. MLA is recognised by `kv_lora_rank` (as SGLang's
    model_config does for DeepSeek-style models). A multimodal config's `text_config` holds the
    language model's fields (SGLang reads the same, get_hf_text_config)."""
    if isinstance(cfg.get("text_config"), dict):
        cfg = {**cfg, **cfg["text_config"]}
    layers = int(cfg["num_hidden_layers"])
    if cfg.get("kv_lora_rank"):
        return KvGeometry("mla", layers, 1, int(cfg["kv_lora_rank"]) + int(cfg.get("qk_rope_head_dim", 0)))
    heads = int(cfg["num_attention_heads"])
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    head_dim = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads)
    v_head_dim = int(cfg.get("v_head_dim") or head_dim)
    return KvGeometry("mha", layers, 2, kv_heads * head_dim, None if v_head_dim == head_dim else kv_heads * v_head_dim)


def dtype_bytes(dtype: str) -> int:
    """Bytes per KV value of a --dtype / --kv-cache-dtype name (unknown names: 2, bf16's)."""
    return DTYPE_BYTES.get(dtype, 2)


def model_kv_bytes_per_token(model_path: str | Path, dtype: str = "auto") -> int:
    """KV bytes one token takes in a model folder (its config.json) at `dtype`."""
    cfg = json.loads((Path(model_path).expanduser() / "config.json").read_text())
    return kv_geometry(cfg).bytes_per_token(dtype_bytes(dtype))
