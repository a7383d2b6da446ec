"""Named benchmark setups. Every number a result depends on lives here (and lands in the JSON).

smoke  CI: two rates, a few short requests, SmolLM2 on CPU.
cpu    SmolLM2 on a 2-core CPU: KV budget small enough for memory pressure, SLOs scaled to CPU
       decode speed (calibrated), the whole A/B within its time budget.
gpu    a Llama-3-8B- (or Qwen2.5-32B-) shaped model with random weights (--load-format dummy),
       ShareGPT-like lengths, the paper's SLOs (TTFT 5 s, TBT 100 ms); scripts/gpu_ab.sh runs it on
       a lent GPU (argument building and --dry-run are tested on CPU).
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from ..registry import Registry
from ..rotasched.slo import DEFAULT_CLASSES, Slo
from .calibrate import CalibrationKnobs
from .workloads import SHAREGPT_INPUT, SHAREGPT_OUTPUT, LengthDist


@dataclass(frozen=True)
class Profile:
    name: str
    device: str
    kv_tokens: int
    chunked_prefill: int
    rates: tuple[float, ...]
    num_requests: int
    inputs: LengthDist
    outputs: LengthDist
    slo: Slo
    slo_classes: str
    class_mix: str
    systems: tuple[str, ...] = ("sglang", "superinfer")
    server_flags: tuple[str, ...] = ()
    our_flags: tuple[str, ...] = ()
    dummy_model: str | None = None  # a config shape from DUMMY_SHAPES: random weights
    # Environment for every system alike (e.g. which CPU attention implementation serves torch_native).
    env: tuple[tuple[str, str], ...] = ()
    # Derive SLOs, rates and request count from a speed probe of the first server (calibrate.py);
    # the values above are then only the shape (class ratios, lengths) and a fallback.
    calibrate: bool = False
    knobs: CalibrationKnobs = CalibrationKnobs()
    ready_timeout_s: float = 300.0
    run_timeout_s: float = 900.0
    notes: tuple[str, ...] = field(default=())


# CPU SLO classes scaled like the cpu profile's default SLO (interactive tight, batch loose).
CPU_CLASSES = json.dumps({
    "interactive": {"ttft_ms": 2000, "tbt_ms": 250},
    "standard": {"ttft_ms": 6000, "tbt_ms": 400},
    "batch": {"ttft_ms": 30000, "tbt_ms": 1500},
})

# SmolLM2 on 2 CPU cores: ShareGPT's long-tailed shape, scaled down (mean ~150 prompt and ~36
# output tokens) so that about 8 requests fill a 1536-token KV budget and a point takes minutes.
CPU_INPUT = LengthDist(median=128, sigma=0.6, lo=32, hi=384)
CPU_OUTPUT = LengthDist(median=32, sigma=0.5, lo=12, hi=96)

# The host rotary pool would default to a quarter of free RAM (GBs); a KV budget of a few thousand
# SmolLM2 tokens (23 KB each) needs a few tens of MB.
CPU_OUR_FLAGS = ("--rotary-pool-gb", "0.25")

# ab_bench's --profile choices (an unknown name is an error listing these).
PROFILES: Registry[Profile] = Registry("bench profile", {
    "smoke": Profile(
        name="smoke", device="cpu", kv_tokens=1024, chunked_prefill=256, rates=(0.5, 2.0), num_requests=6,
        inputs=LengthDist(median=96, sigma=0.3, lo=48, hi=160), outputs=LengthDist(median=12, sigma=0.2, lo=8, hi=16),
        slo=Slo(4000, 500), slo_classes=CPU_CLASSES, class_mix="interactive:1,batch:1",
        our_flags=CPU_OUR_FLAGS, ready_timeout_s=600.0, run_timeout_s=600.0,
        env=(("SUPERINFER_CPU_ATTENTION", "1"),),
        # a calibrated smoke run (scripts/gpu_ab.sh --cpu-smoke) probes briefly: two batch sizes, once each
        knobs=CalibrationKnobs(min_requests=4, probe_batches=(1, 4), probe_out_tokens=8, probe_repeats=1),
    ),
    "cpu": Profile(
        name="cpu", device="cpu", kv_tokens=1536, chunked_prefill=512, rates=(0.5, 0.8, 1.1, 1.5),
        num_requests=80, inputs=CPU_INPUT, outputs=CPU_OUTPUT,
        slo=Slo(6000, 400), slo_classes=CPU_CLASSES, class_mix="interactive:1,standard:1,batch:1",
        our_flags=CPU_OUR_FLAGS, run_timeout_s=900.0, calibrate=True, env=(("SUPERINFER_CPU_ATTENTION", "1"),),
    ),
    "gpu": Profile(
        name="gpu", device="cuda", kv_tokens=65536, chunked_prefill=8192, rates=(4, 8, 12, 16, 20, 24),
        num_requests=600, inputs=SHAREGPT_INPUT, outputs=SHAREGPT_OUTPUT,
        slo=Slo(5000, 100), slo_classes=DEFAULT_CLASSES, class_mix="interactive:1,standard:1,batch:1",
        systems=("sglang", "superinfer"), server_flags=("--load-format", "dummy"),
        dummy_model="llama3-8b", ready_timeout_s=900.0, run_timeout_s=1200.0,
    ),
})

# Model shapes for random-weight GPU runs (config.json fields of the public models).
DUMMY_SHAPES: dict[str, dict[str, object]] = {
    "llama3-8b": {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
        "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
        "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 128256, "max_position_embeddings": 8192,
        "rope_theta": 500000.0, "rms_norm_eps": 1e-5, "hidden_act": "silu", "tie_word_embeddings": False,
        "attention_bias": False, "torch_dtype": "bfloat16",
    },
    "qwen2.5-32b": {
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 5120,
        "intermediate_size": 27648, "num_hidden_layers": 64, "num_attention_heads": 40,
        "num_key_value_heads": 8, "vocab_size": 152064, "max_position_embeddings": 32768,
        "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "hidden_act": "silu", "tie_word_embeddings": False,
        "sliding_window": 131072, "use_sliding_window": False, "max_window_layers": 64,
        "torch_dtype": "bfloat16",
    },
    # MoE: 8 experts, 2 per token (46.7B parameters, 12.9B active); KV as Llama's (GQA, 8 KV heads).
    "mixtral-8x7b": {
        "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "hidden_size": 4096,
        "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
        "num_key_value_heads": 8, "num_local_experts": 8, "num_experts_per_tok": 2, "vocab_size": 32000,
        "max_position_embeddings": 32768, "rope_theta": 1000000.0, "rms_norm_eps": 1e-5,
        "hidden_act": "silu", "sliding_window": None, "router_aux_loss_coef": 0.02,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    },
    # MLA + MoE with shared experts (15.7B parameters, 2.4B active): one 576-value latent per
    # token and layer (kv_lora_rank 512 + rope 64), SGLang's MLATokenToKVPool.
    "deepseek-v2-lite": {
        "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2", "hidden_size": 2048,
        "intermediate_size": 10944, "moe_intermediate_size": 1408, "num_hidden_layers": 27,
        "num_attention_heads": 16, "num_key_value_heads": 16, "n_routed_experts": 64,
        "n_shared_experts": 2, "num_experts_per_tok": 6, "first_k_dense_replace": 1, "moe_layer_freq": 1,
        "n_group": 1, "topk_group": 1, "topk_method": "greedy", "norm_topk_prob": False,
        "scoring_func": "softmax", "routed_scaling_factor": 1.0, "q_lora_rank": None,
        "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
        "vocab_size": 102400, "max_position_embeddings": 163840, "rope_theta": 10000,
        "rope_scaling": {"type": "yarn", "factor": 40, "beta_fast": 32, "beta_slow": 1, "mscale": 0.707,
                         "mscale_all_dim": 0.707, "original_max_position_embeddings": 4096},
        "rms_norm_eps": 1e-6, "hidden_act": "silu", "attention_bias": False,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    },
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                   "special_tokens_map.json", "generation_config.json")


def make_dummy_model(shape: str, tokenizer_dir: Path, out_dir: Path) -> Path:
    """A model folder of the given shape: config.json + the SmolLM2 tokenizer (weights: dummy). The
    vocabulary is the tokenizer's (49,152 for SmolLM2): ids past it decode to nothing, so a random
    model of Llama 3's 128,256 streams empty chunks the load generator never counts (and a smaller
    one, Mixtral's 32,000, would index past its embedding with SmolLM2's prompt ids)."""
    if shape not in DUMMY_SHAPES:
        raise ValueError(f"unknown model shape {shape!r}; known: {sorted(DUMMY_SHAPES)}")
    target = out_dir / f"dummy-{shape}"
    target.mkdir(parents=True, exist_ok=True)
    tok_cfg = json.loads((tokenizer_dir / "config.json").read_text())
    cfg = {**DUMMY_SHAPES[shape], "vocab_size": tok_cfg.get("vocab_size", DUMMY_SHAPES[shape]["vocab_size"]),
           "bos_token_id": tok_cfg.get("bos_token_id", 1),
           "eos_token_id": tok_cfg.get("eos_token_id", 2), "pad_token_id": tok_cfg.get("pad_token_id", 2)}
    (target / "config.json").write_text(json.dumps(cfg, indent=2))
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).is_file():
            shutil.copy(tokenizer_dir / name, target / name)
    return target
