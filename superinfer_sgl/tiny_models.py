"""Tiny random-weight models, one per architecture family, for CPU tests of serving and rotation.

`python -m superinfer_sgl.model_prep tiny FAMILY DIR [--seed N]` writes a Hugging Face folder:
config.json, model.safetensors (bfloat16, a few MB: two layers, hidden size 32) and the tokenizer
files of the prepared default model (SmolLM2, vocab 49152), so that SGLang serves it offline
(`--dtype float32` upcasts the weights exactly). Nothing comes from the hub.

Weights are deterministic from the seed: every matrix is drawn from N(0, 1/fan_in) by one seeded
generator in parameter-name order (embeddings N(0, 1), or N(0, 0.05^2) when the lm_head is tied to
them), biases N(0, 0.02^2), norms and attention sinks at their initial values. The scale gives
greedy decoding clear winners: HF's default 0.02 init gives near-flat logits whose argmax could flip
on the last float32 bit of a differently batched matmul.

Families (SGLang 0.5.23's architecture and KV pool on CPU; see FAMILIES):
- llama, qwen2, mistral: dense GQA, MHATokenToKVPool;
- mixtral: MoE (4 experts, top-2); qwen2-moe: MoE with a shared expert; both MHATokenToKVPool;
- gemma2: alternating sliding-window (window 8) and full layers, one MHATokenToKVPool (SGLang keeps
  all of a Gemma2 request's KV and masks the window in attention);
- deepseek-v2: MLA (latent KV, MLATokenToKVPool, which rotation moves) with MoE and a shared expert;
- gpt-oss: sliding-window + full layers with attention sinks and MoE (SGLang: hybrid SWA pool).
"""

from __future__ import annotations

import json
import shutil
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

VOCAB = 49152  # SmolLM2's tokenizer
BOS, EOS = 1, 2  # SmolLM2's <|im_start|> / <|im_end|> ids, as its own config has them
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, LAYERS, FFN = 32, 2, 1, 16, 2, 64
MAX_POSITIONS = 4096
SLIDING_WINDOW = 8
TIED_EMBED_STD = 0.05
# transformers builds and loads models under process-wide switches (torch's default dtype, its
# logging, class patches): hold this to build or load one model at a time in a threaded process.
TRANSFORMERS_LOCK = threading.RLock()
# Files of the default model folder that are not its config or weights.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


class TinyModelError(ValueError):
    """Unknown family or unusable arguments."""


@dataclass(frozen=True)
class Family:
    architecture: str  # config.architectures[0], what SGLang dispatches on
    kv_pool: str  # the KV pool class SGLang 0.5.23 builds for it
    kind: str  # dense / MoE / MLA / sliding window, for docs and --list
    config: Callable[[], Any]  # -> transformers PretrainedConfig


def _common(tie: bool = True) -> dict[str, Any]:
    return dict(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                num_key_value_heads=KV_HEADS, intermediate_size=FFN, max_position_embeddings=MAX_POSITIONS,
                rms_norm_eps=1e-5, bos_token_id=BOS, eos_token_id=EOS, pad_token_id=EOS,
                tie_word_embeddings=tie, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})


def _llama() -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(**_common(), head_dim=HEAD_DIM)


def _qwen2() -> Any:
    from transformers import Qwen2Config

    return Qwen2Config(**_common(), use_sliding_window=False)


def _mistral() -> Any:
    from transformers import MistralConfig

    # SGLang serves MistralForCausalLM as Llama: sliding_window None keeps HF and SGLang identical.
    return MistralConfig(**_common(), head_dim=HEAD_DIM, sliding_window=None)


def _mixtral() -> Any:
    from transformers import MixtralConfig

    # SGLang's Mixtral has no tied lm_head: an untied one is written.
    return MixtralConfig(**_common(tie=False), num_local_experts=4, num_experts_per_tok=2,
                         sliding_window=None, router_aux_loss_coef=0.0)


def _qwen2_moe() -> Any:
    from transformers import Qwen2MoeConfig

    return Qwen2MoeConfig(**_common(tie=False), num_experts=4, num_experts_per_tok=2, moe_intermediate_size=FFN,
                          shared_expert_intermediate_size=FFN, decoder_sparse_step=1, norm_topk_prob=False,
                          qkv_bias=True, use_sliding_window=False, mlp_only_layers=[])


def _gemma2() -> Any:
    from transformers import Gemma2Config

    # No attention soft-capping: SGLang's torch_native backend ignores logit_cap, HF would apply it.
    # SGLang's Gemma2 reads hidden_act too (older HF configs carried both names).
    return Gemma2Config(**_common(), head_dim=HEAD_DIM, hidden_activation="gelu_pytorch_tanh",
                        hidden_act="gelu_pytorch_tanh",
                        query_pre_attn_scalar=HEAD_DIM, sliding_window=SLIDING_WINDOW,
                        attn_logit_softcapping=None, final_logit_softcapping=None)


def _deepseek_v2() -> Any:
    from transformers import DeepseekV2Config

    common = _common(tie=False)
    common["num_key_value_heads"] = HEADS  # MLA: every head reads the shared latent
    # YaRN rope scaling as DeepSeek-V2's own configs have it (factor 40 there): SGLang's CPU rope
    # factory builds only deepseek_yarn for MLA (get_rope_cpu asserts rope_scaling is set).
    common["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                 "original_max_position_embeddings": MAX_POSITIONS // 4, "beta_fast": 32,
                                 "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707}
    return DeepseekV2Config(**common, q_lora_rank=None, kv_lora_rank=16, qk_nope_head_dim=16,
                            qk_rope_head_dim=8, v_head_dim=16, head_dim=8, n_routed_experts=4,
                            num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=FFN,
                            first_k_dense_replace=1, n_group=1, topk_group=1, topk_method="greedy",
                            routed_scaling_factor=1.0, norm_topk_prob=False,
                            # read by SGLang, absent from transformers' config (DeepSeek-V2's own have them)
                            moe_layer_freq=1, scoring_func="softmax")


def _gpt_oss() -> Any:
    from transformers import GptOssConfig

    return GptOssConfig(**_common(tie=False), head_dim=HEAD_DIM, num_local_experts=4, num_experts_per_tok=2,
                        sliding_window=SLIDING_WINDOW, layer_types=["sliding_attention", "full_attention"])


FAMILIES: dict[str, Family] = {
    "llama": Family("LlamaForCausalLM", "MHATokenToKVPool", "dense", _llama),
    "qwen2": Family("Qwen2ForCausalLM", "MHATokenToKVPool", "dense (qkv bias)", _qwen2),
    "mistral": Family("MistralForCausalLM", "MHATokenToKVPool", "dense", _mistral),
    "mixtral": Family("MixtralForCausalLM", "MHATokenToKVPool", "MoE 4 experts top-2", _mixtral),
    "qwen2-moe": Family("Qwen2MoeForCausalLM", "MHATokenToKVPool",
                        "MoE 4 experts top-2 + shared expert", _qwen2_moe),
    "gemma2": Family("Gemma2ForCausalLM", "MHATokenToKVPool",
                     f"sliding window {SLIDING_WINDOW} on even layers", _gemma2),
    "deepseek-v2": Family("DeepseekV2ForCausalLM", "MLATokenToKVPool", "MLA + MoE with shared expert",
                          _deepseek_v2),
    "gpt-oss": Family("GptOssForCausalLM", "SWAKVPool", f"sliding window {SLIDING_WINDOW} + sinks, MoE", _gpt_oss),
}


def tiny_config(family: str) -> Any:
    """The transformers config of a family's tiny model."""
    try:
        spec = FAMILIES[family]
    except KeyError:
        raise TinyModelError(f"unknown family {family!r}; known: {', '.join(FAMILIES)}") from None
    config = spec.config()
    config.architectures = [spec.architecture]
    return config


def _seeded_weights(model: Any, seed: int) -> None:
    import torch

    gen = torch.Generator().manual_seed(seed)
    # A tied lm_head with embeddings as large as the layers' outputs makes every step repeat its
    # input token (the residual stream's own embedding wins the dot product): small ones there.
    embed_std = TIED_EMBED_STD if getattr(model.config, "tie_word_embeddings", False) else 1.0
    with torch.no_grad():
        for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            if p.dim() < 2:
                if "bias" in name:  # biases (qkv, router): small; norm weights keep their init
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
                elif "sinks" in name:
                    p.zero_()
                continue
            std = embed_std if "embed_tokens" in name else p.shape[-1] ** -0.5
            p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float32) * std)


def _check_tied(model: Any, family: str) -> None:
    """A config that ties the lm_head to the embeddings must get one tensor for both: SGLang reads
    such a checkpoint as tied whatever it holds, transformers would not (a second, different
    lm_head in the file)."""
    if not getattr(model.config, "tie_word_embeddings", False):
        return
    head, embed = model.get_output_embeddings(), model.get_input_embeddings()
    if head is not None and head.weight is not embed.weight:
        raise TinyModelError(f"{family}: transformers built the lm_head untied although the config ties it")


def write_tiny_model(family: str, out: Path | str, *, tokenizer_dir: Path | str, seed: int = 0) -> Path:
    """Write FAMILY's tiny model into `out` (created; existing files overwritten) and return it.
    `tokenizer_dir`: where the tokenizer files come from (the CLI passes the prepared default model,
    model_prep.prepare_default_model())."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    config = tiny_config(family)
    copied = [f for f in TOKENIZER_FILES if (Path(tokenizer_dir) / f).is_file()]
    if "tokenizer.json" not in copied:
        raise TinyModelError(f"{tokenizer_dir} has no tokenizer.json")
    with TRANSFORMERS_LOCK:
        verbosity, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
        try:
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
            _check_tied(model, family)
            _seeded_weights(model, seed)
            out = Path(out)
            out.mkdir(parents=True, exist_ok=True)
            # save_pretrained writes checkpoint names (transformers 5 fuses MoE experts in memory and
            # splits them again on save: one matrix per expert, as SGLang's loaders read them).
            model.to(torch.bfloat16).save_pretrained(out)
        finally:
            hf_logging.set_verbosity(verbosity)
            if bars:
                hf_logging.enable_progress_bar()
    cfg = json.loads((out / "config.json").read_text())
    cfg["superinfer_tiny"] = {"family": family, "seed": seed}
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    for f in copied:
        shutil.copyfile(Path(tokenizer_dir) / f, out / f)
    return out


def describe() -> str:
    rows = [f"{name:12s} {f.architecture:24s} {f.kv_pool:18s} {f.kind}" for name, f in FAMILIES.items()]
    return "\n".join(rows)
