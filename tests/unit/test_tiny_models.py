"""Tiny random-weight model folders (superinfer_sgl.tiny_models): deterministic from the seed, each
family's config fields, checkpoint names SGLang's loaders read, and transformers can load them."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from safetensors import safe_open

from superinfer_sgl import model_prep, tiny_models
from superinfer_sgl.tiny_models import FAMILIES, TinyModelError, tiny_config, write_tiny_model

MAX_WEIGHT_BYTES = 8 * 2**20


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Stand-ins for the default model's tokenizer files (the writer copies them verbatim)."""
    d = tmp_path_factory.mktemp("tok")
    (d / "tokenizer.json").write_text('{"stand-in": true}')
    (d / "tokenizer_config.json").write_text("{}")
    (d / "model.safetensors").write_bytes(b"not copied")
    return d


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    return {f: write_tiny_model(f, root / f, seed=0, tokenizer_dir=tokenizer_dir) for f in FAMILIES}


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _keys(folder: Path) -> set[str]:
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        return set(f.keys())


def test_required_families_present() -> None:
    for family in ("llama", "qwen2", "mixtral", "qwen2-moe", "deepseek-v2", "gemma2"):
        assert family in FAMILIES


@pytest.mark.parametrize("family", ["llama", "mixtral"])
def test_deterministic_from_seed(family: str, written: dict[str, Path], tokenizer_dir: Path, tmp_path: Path) -> None:
    again = write_tiny_model(family, tmp_path / "again", seed=0, tokenizer_dir=tokenizer_dir)
    other = write_tiny_model(family, tmp_path / "other", seed=1, tokenizer_dir=tokenizer_dir)
    first = written[family]
    assert _digest(again / "model.safetensors") == _digest(first / "model.safetensors")
    assert (again / "config.json").read_text() == (first / "config.json").read_text()
    assert _digest(other / "model.safetensors") != _digest(first / "model.safetensors")
    assert json.loads((other / "config.json").read_text())["superinfer_tiny"] == {"family": family, "seed": 1}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_folder_loads_with_autoconfig(family: str, written: dict[str, Path], tokenizer_dir: Path) -> None:
    from transformers import AutoConfig

    folder = written[family]
    cfg = AutoConfig.from_pretrained(folder)
    assert type(cfg) is type(tiny_config(family))
    assert cfg.architectures == [FAMILIES[family].architecture]
    assert cfg.vocab_size == 49152 and cfg.num_hidden_layers == 2 and cfg.hidden_size == 32
    assert (folder / "model.safetensors").stat().st_size < MAX_WEIGHT_BYTES
    assert (folder / "tokenizer.json").read_text() == (tokenizer_dir / "tokenizer.json").read_text()
    assert (folder / "model.safetensors").read_bytes() != b"not copied"


def test_config_fields_per_family() -> None:
    mixtral = tiny_config("mixtral")
    assert (mixtral.num_local_experts, mixtral.num_experts_per_tok) == (4, 2)
    assert not mixtral.tie_word_embeddings  # SGLang's Mixtral has no tied lm_head
    qmoe = tiny_config("qwen2-moe")
    assert qmoe.num_experts == 4 and qmoe.shared_expert_intermediate_size > 0 and qmoe.qkv_bias
    ds = tiny_config("deepseek-v2")
    assert ds.kv_lora_rank == 16 and ds.qk_rope_head_dim == 8 and ds.q_lora_rank is None
    assert ds.n_shared_experts == 1 and ds.first_k_dense_replace == 1
    gemma = tiny_config("gemma2")
    assert gemma.sliding_window == tiny_models.SLIDING_WINDOW
    assert gemma.attn_logit_softcapping is None  # SGLang's torch_native backend would ignore it
    assert tiny_config("gpt-oss").layer_types == ["sliding_attention", "full_attention"]
    for family in ("llama", "qwen2", "mistral"):
        cfg = tiny_config(family)
        assert cfg.num_attention_heads == 2 and cfg.num_key_value_heads == 1  # GQA
        assert getattr(cfg, "sliding_window", None) is None


def test_sglang_config_reads_what_sglang_needs() -> None:
    """Fields SGLang 0.5.23's model code reads that transformers 5's configs do not carry."""
    ds = tiny_config("deepseek-v2")
    assert ds.moe_layer_freq == 1 and ds.scoring_func == "softmax"
    assert ds.rope_parameters["rope_type"] == "yarn"  # get_rope_cpu: only deepseek_yarn on CPU
    assert tiny_config("gemma2").hidden_act == "gelu_pytorch_tanh"


@pytest.mark.parametrize("family", list(FAMILIES))
def test_sglang_picks_the_stated_kv_pool(family: str, written: dict[str, Path]) -> None:
    """FAMILIES[..].kv_pool agrees with SGLang's own model config: MLA -> MLATokenToKVPool, hybrid
    sliding window -> SWAKVPool, else MHATokenToKVPool (gemma2's window lives in attention)."""
    from sglang.srt.configs.model_config import AttentionArch, ModelConfig

    mc = ModelConfig(str(written[family]))
    pool = ("MLATokenToKVPool" if mc.attention_arch == AttentionArch.MLA
            else "SWAKVPool" if mc.is_hybrid_swa else "MHATokenToKVPool")
    assert pool == FAMILIES[family].kv_pool


def test_checkpoint_names_one_matrix_per_expert(written: dict[str, Path]) -> None:
    """transformers 5 fuses experts in memory; SGLang's loaders read one matrix per expert."""
    assert "model.layers.0.block_sparse_moe.experts.3.w1.weight" in _keys(written["mixtral"])
    qmoe = _keys(written["qwen2-moe"])
    assert "model.layers.1.mlp.experts.0.gate_proj.weight" in qmoe
    assert "model.layers.1.mlp.shared_expert.up_proj.weight" in qmoe
    assert "model.layers.0.self_attn.q_proj.bias" in qmoe
    ds = _keys(written["deepseek-v2"])
    assert "model.layers.1.self_attn.kv_a_proj_with_mqa.weight" in ds
    assert "model.layers.1.mlp.shared_experts.gate_proj.weight" in ds
    assert "lm_head.weight" not in _keys(written["llama"])  # tied


@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_tied_lm_head_is_not_written(family: str, written: dict[str, Path]) -> None:
    """SGLang reads a tied family's lm_head from the embeddings whatever the file holds; a second,
    different lm_head in it would make transformers decode another model."""
    assert ("lm_head.weight" in _keys(written[family])) == (not tiny_config(family).tie_word_embeddings)


def test_writes_from_threads_give_the_serial_bytes(written: dict[str, Path], tokenizer_dir: Path,
                                                   tmp_path: Path) -> None:
    """The e2e families test writes the next family's model while another thread loads one."""
    import concurrent.futures as cf

    jobs = [(f, i) for i in range(2) for f in ("gemma2", "mixtral", "llama")]
    with cf.ThreadPoolExecutor(4) as pool:
        out = list(pool.map(lambda j: write_tiny_model(j[0], tmp_path / f"{j[0]}-{j[1]}", seed=0,
                                                       tokenizer_dir=tokenizer_dir), jobs))
    for (family, _), folder in zip(jobs, out):
        assert _digest(folder / "model.safetensors") == _digest(written[family] / "model.safetensors"), family


def test_an_untied_head_under_a_tying_config_is_refused() -> None:
    import torch

    cfg = tiny_config("llama")
    model = type("M", (), {"config": cfg, "get_input_embeddings": lambda self: torch.nn.Embedding(4, 2),
                           "get_output_embeddings": lambda self: torch.nn.Linear(2, 4)})()
    with pytest.raises(TinyModelError, match="untied"):
        tiny_models._check_tied(model, "llama")


def test_weights_are_not_flat(written: dict[str, Path]) -> None:
    """Matrices are N(0, 1/fan_in), not HF's 0.02 init (near-flat logits, fragile greedy ties)."""
    with safe_open(str(written["llama"] / "model.safetensors"), "pt") as f:
        q = f.get_tensor("model.layers.0.self_attn.q_proj.weight").float()
        emb = f.get_tensor("model.embed_tokens.weight").float()
    assert 0.7 < float(q.std()) * 32**0.5 < 1.3
    assert abs(float(emb.std()) - tiny_models.TIED_EMBED_STD) < 0.01


def test_unknown_family() -> None:
    with pytest.raises(TinyModelError, match="unknown family 'bert'"):
        tiny_config("bert")


def test_tokenizer_dir_without_tokenizer(tmp_path: Path) -> None:
    with pytest.raises(TinyModelError, match="no tokenizer.json"):
        write_tiny_model("llama", tmp_path / "out", tokenizer_dir=tmp_path)


def test_cli_tiny_subcommand(monkeypatch: pytest.MonkeyPatch, tokenizer_dir: Path, tmp_path: Path,
                             capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(model_prep, "prepare_default_model", lambda: tokenizer_dir)
    model_prep.main(["tiny", "qwen2", str(tmp_path / "q"), "--seed", "7"])
    assert capsys.readouterr().out.strip() == str(tmp_path / "q")
    assert json.loads((tmp_path / "q" / "config.json").read_text())["superinfer_tiny"] == {"family": "qwen2", "seed": 7}
    with pytest.raises(SystemExit):
        model_prep.main(["tiny", "no-such-family", str(tmp_path / "x")])


def test_cli_default_still_prepares(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(model_prep, "prepare_default_model", lambda: tmp_path)
    model_prep.main([])
    assert capsys.readouterr().out.strip() == str(tmp_path)
