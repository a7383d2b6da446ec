"""Our server options: defaults, validation (one ConfigError naming the flag), env and CLI round trips."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, replace
from pathlib import Path

import pytest

from superinfer_sgl.config import (
    CONFIG_ENV,
    KV_TRANSFERS,
    SCHEDULERS,
    ConfigError,
    SuperInferConfig,
    add_cli_args,
    from_namespace,
    knobs_from_env,
)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(allow_abbrev=False)
    add_cli_args(parser)
    return parser


def test_defaults_are_the_paper_settings() -> None:
    cfg = SuperInferConfig()
    assert cfg.scheduler == "rotasched"
    assert (cfg.ttft_slo_ms, cfg.tbt_slo_ms) == (5000.0, 100.0)
    assert cfg.vlt_alpha == 3.0
    assert (cfg.vlt_beta_ttft, cfg.vlt_beta_tbt) == (0.5, 0.0)
    assert cfg.rotation_budget_blocks is None  # auto: from the measured link (planner.rotation_budget)
    assert cfg.rotary_block_tokens == 16
    assert cfg.slo_classes is None and cfg.rotary_pool_gb is None and cfg.handshake_dir is None
    assert cfg.kv_transfer == "auto"


def test_config_is_frozen() -> None:
    with pytest.raises(AttributeError):
        SuperInferConfig().scheduler = "sglang"  # type: ignore[misc]


@pytest.mark.parametrize(
    ("field", "value", "flag"),
    [
        ("scheduler", "fifo", "--scheduler"),
        ("kv_transfer", "dma", "--kv-transfer"),
        ("ttft_slo_ms", 0.0, "--ttft-slo-ms"),
        ("ttft_slo_ms", -5.0, "--ttft-slo-ms"),
        ("ttft_slo_ms", float("nan"), "--ttft-slo-ms"),
        ("tbt_slo_ms", 0.0, "--tbt-slo-ms"),
        ("tbt_slo_ms", -1.0, "--tbt-slo-ms"),
        ("vlt_alpha", 0.0, "--vlt-alpha"),
        ("vlt_alpha", -3.0, "--vlt-alpha"),
        ("vlt_beta_ttft", -0.1, "--vlt-beta-ttft"),
        ("vlt_beta_ttft", float("nan"), "--vlt-beta-ttft"),
        ("vlt_beta_tbt", -0.5, "--vlt-beta-tbt"),
        ("rotation_budget_blocks", -1, "--rotation-budget-blocks"),
        ("rotation_budget_blocks", 0, "--rotation-budget-blocks"),
        ("rotary_block_tokens", 0, "--rotary-block-tokens"),
        ("rotary_block_tokens", -16, "--rotary-block-tokens"),
        ("rotary_pool_gb", 0.0, "--rotary-pool-gb"),
        ("rotary_pool_gb", -2.0, "--rotary-pool-gb"),
    ],
)
def test_invalid_value_names_the_flag(field: str, value: object, flag: str) -> None:
    with pytest.raises(ConfigError) as info:
        SuperInferConfig(**{field: value})
    msg = str(info.value)
    assert msg.startswith(flag + " "), msg
    assert "\n" not in msg


@pytest.mark.parametrize("field", ["ttft_slo_ms", "tbt_slo_ms"])
def test_infinite_slo_is_rejected_like_slo_does(field: str) -> None:
    with pytest.raises(ConfigError, match="--" + field.replace("_", "-")):
        SuperInferConfig(**{field: float("inf")})


def test_boundary_values_are_valid() -> None:
    cfg = SuperInferConfig(
        vlt_beta_ttft=0.0, vlt_beta_tbt=0.0, rotation_budget_blocks=1, rotary_block_tokens=1,
        rotary_pool_gb=0.5, ttft_slo_ms=1e-3, tbt_slo_ms=1e-3, vlt_alpha=1e-6,
    )
    assert cfg.rotation_budget_blocks == 1 and cfg.rotary_block_tokens == 1


@pytest.mark.parametrize("scheduler", SCHEDULERS)
@pytest.mark.parametrize("kv_transfer", KV_TRANSFERS)
def test_every_choice_is_valid(scheduler: str, kv_transfer: str) -> None:
    assert SuperInferConfig(scheduler=scheduler, kv_transfer=kv_transfer).scheduler == scheduler


@pytest.mark.parametrize(
    "text",
    [
        "{bad json",
        '{"chat": {"ttft_ms": -1}}',
        '{"chat": {"latency_ms": 10}}',
        '{"chat": 5}',
        "[1, 2]",
        "/nonexistent/slo_classes.json",
    ],
)
def test_invalid_slo_classes_raise_config_error(text: str) -> None:
    with pytest.raises(ConfigError) as info:
        SuperInferConfig(slo_classes=text)
    assert str(info.value).startswith("--slo-classes: ")


def test_valid_slo_classes_inline_and_file(tmp_path: Path) -> None:
    classes = {"chat": {"ttft_ms": 800, "tbt_ms": 40}, "bulk": {"ttft_ms": 60000}}
    assert SuperInferConfig(slo_classes=json.dumps(classes)).slo_classes == json.dumps(classes)
    path = tmp_path / "classes.json"
    path.write_text(json.dumps(classes))
    assert SuperInferConfig(slo_classes=str(path)).slo_classes == str(path)


def test_env_round_trip() -> None:
    cfg = SuperInferConfig(
        scheduler="sglang", ttft_slo_ms=1234.5, tbt_slo_ms=42.0,
        slo_classes='{"chat": {"ttft_ms": 800, "tbt_ms": 40}}', vlt_alpha=2.5, vlt_beta_ttft=0.25,
        vlt_beta_tbt=0.125, rotation_budget_blocks=7, rotary_block_tokens=32, rotary_pool_gb=1.5,
        kv_transfer="torch", handshake_dir="/tmp/hs",
    )
    raw = cfg.to_env()
    assert json.loads(raw) == asdict(cfg)
    assert SuperInferConfig.from_env({CONFIG_ENV: raw}) == cfg
    assert SuperInferConfig.from_env({CONFIG_ENV: SuperInferConfig().to_env()}) == SuperInferConfig()


def test_from_env_reads_os_environ(monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = replace(SuperInferConfig(), scheduler="sglang")
    monkeypatch.setenv(CONFIG_ENV, cfg.to_env())
    assert SuperInferConfig.from_env() == cfg


def test_from_env_absent_is_none(monkeypatch: pytest.MonkeyPatch) -> None:
    # Absence of the variable is what keeps the plugin inert in stock SGLang.
    monkeypatch.delenv(CONFIG_ENV, raising=False)
    assert SuperInferConfig.from_env() is None
    assert SuperInferConfig.from_env({}) is None
    assert SuperInferConfig.from_env({CONFIG_ENV: ""}) is None
    assert SuperInferConfig.from_env({"OTHER": "x"}) is None


def test_from_env_validates() -> None:
    raw = json.dumps({**asdict(SuperInferConfig()), "tbt_slo_ms": -1})
    with pytest.raises(ConfigError, match="--tbt-slo-ms"):
        SuperInferConfig.from_env({CONFIG_ENV: raw})


def test_cli_defaults_match_dataclass() -> None:
    assert from_namespace(_parser().parse_args([])) == SuperInferConfig()


def test_cli_parses_our_flags() -> None:
    ns = _parser().parse_args([
        "--scheduler", "sglang", "--ttft-slo-ms", "2500", "--tbt-slo-ms=80",
        "--slo-classes", '{"chat": {"ttft_ms": 800, "tbt_ms": 40}}',
        "--vlt-alpha", "4", "--vlt-beta-ttft", "0.3", "--vlt-beta-tbt", "0.1",
        "--rotation-budget-blocks", "128", "--rotary-block-tokens", "8",
        "--rotary-pool-gb", "2.5", "--kv-transfer", "naive",
    ])
    cfg = from_namespace(ns)
    assert cfg == SuperInferConfig(
        scheduler="sglang", ttft_slo_ms=2500.0, tbt_slo_ms=80.0,
        slo_classes='{"chat": {"ttft_ms": 800, "tbt_ms": 40}}', vlt_alpha=4.0, vlt_beta_ttft=0.3,
        vlt_beta_tbt=0.1, rotation_budget_blocks=128, rotary_block_tokens=8, rotary_pool_gb=2.5,
        kv_transfer="naive",
    )
    assert isinstance(cfg.rotation_budget_blocks, int) and isinstance(cfg.ttft_slo_ms, float)
    assert cfg.handshake_dir is None  # set by the launcher, never a CLI flag


def test_cli_has_no_handshake_flag() -> None:
    with pytest.raises(SystemExit):
        _parser().parse_args(["--handshake-dir", "/tmp/x"])


def test_cli_flags_are_in_their_own_group() -> None:
    parser = _parser()
    ours = [g for g in parser._action_groups if g.title and g.title.startswith("superinfer_sgl")]
    assert len(ours) == 1
    flags = {s for a in ours[0]._group_actions for s in a.option_strings}
    assert flags == {
        "--scheduler", "--ttft-slo-ms", "--tbt-slo-ms", "--slo-classes", "--slo-service-tiers",
        "--slo-gateway-classes", "--slo-priority-classes", "--vlt-alpha",
        "--vlt-beta-ttft", "--vlt-beta-tbt", "--min-stint-ms", "--running-reserve", "--rotation-budget-blocks", "--rotary-block-tokens",
        "--rotary-pool-gb", "--rotary-kv-dtype", "--kv-transfer", "--eager-sync", "--no-eager-sync", "--prefetch",
        "--no-prefetch",
        "--mixed-resume", "--no-mixed-resume", "--mix-prefill", "--policy", "--max-best-effort-wait-ms",
        "--ttft-shedding", "--no-ttft-shedding", "--prefix-cache",
        "--prefix-host-tokens",
        "--decode-shortage",
    }


def test_min_stint_must_be_finite_and_not_negative() -> None:
    assert SuperInferConfig().min_stint_ms is None  # auto: the policy's default (planner.quantum_s)
    assert from_namespace(_parser().parse_args(["--min-stint-ms", "0"])).min_stint_ms == 0.0
    for bad in ("-1", "nan", "inf"):
        with pytest.raises(ConfigError, match="min-stint-ms"):
            from_namespace(_parser().parse_args(["--min-stint-ms", bad]))


def test_from_namespace_validates() -> None:
    ns = _parser().parse_args(["--rotary-block-tokens", "0"])
    with pytest.raises(ConfigError, match="^--rotary-block-tokens must be >= 1$"):
        from_namespace(ns)


def test_policy_and_best_effort_bound() -> None:
    assert SuperInferConfig().policy == "goodput"
    cfg = from_namespace(_parser().parse_args(["--policy", "paper", "--max-best-effort-wait-ms", "2500"]))
    assert cfg.policy == "paper" and cfg.max_best_effort_wait_ms == 2500.0
    with pytest.raises(SystemExit):
        _parser().parse_args(["--policy", "fcfs"])
    with pytest.raises(ConfigError, match="--policy"):
        SuperInferConfig(policy="fcfs")
    for bad in (0.0, -1.0, float("nan")):
        with pytest.raises(ConfigError, match="max-best-effort-wait-ms"):
            SuperInferConfig(max_best_effort_wait_ms=bad)


def test_test_knobs_are_read_from_the_environment_once_into_the_config() -> None:
    assert knobs_from_env({}) == {}
    env = {"SUPERINFER_TEST_ROTATE_INTERVAL": "3", "SUPERINFER_VERIFY_ROTATION": "1"}
    assert knobs_from_env(env) == {"test_rotate_interval": 3, "verify_rotation": True}
    assert knobs_from_env({"SUPERINFER_VERIFY_ROTATION": "0"}) == {"verify_rotation": False}
    cfg = from_namespace(_parser().parse_args([]), {"SUPERINFER_TEST_HOLD_ROTARY_ITERS": "6"})
    assert cfg.test_hold_rotary_iters == 6 and cfg.test_rotate_interval == 0
    assert SuperInferConfig.from_env({CONFIG_ENV: cfg.to_env()}) == cfg  # children get it as config
    with pytest.raises(ConfigError, match="SUPERINFER_TEST_ROTATE_INTERVAL must be an integer"):
        knobs_from_env({"SUPERINFER_TEST_ROTATE_INTERVAL": "often"})
    with pytest.raises(ConfigError, match="SUPERINFER_TEST_HOLD_ROTARY_ITERS must be >= 0"):
        SuperInferConfig(test_hold_rotary_iters=-1)


def test_auto_or_a_number_for_the_derived_rotation_knobs() -> None:
    parse = _parser().parse_args
    auto = from_namespace(parse(["--rotation-budget-blocks", "auto", "--min-stint-ms", "auto",
                                 "--running-reserve", "auto"]))
    assert auto.rotation_budget_blocks is None and auto.min_stint_ms is None and auto.running_reserve is None
    set_ = from_namespace(parse(["--rotation-budget-blocks", "12", "--min-stint-ms", "250", "--running-reserve", "0.5"]))
    assert set_.rotation_budget_blocks == 12 and set_.min_stint_ms == 250.0 and set_.running_reserve == 0.5
    for flag, bad in (("--rotation-budget-blocks", "1.5"), ("--rotation-budget-blocks", "lots"),
                      ("--min-stint-ms", "soon"), ("--running-reserve", "half")):
        with pytest.raises(SystemExit):
            parse([flag, bad])


def test_every_engine_transfer_path_is_a_flag_choice() -> None:
    """--kv-transfer offers exactly the engine's paths (config stays importable without torch)."""
    from superinfer_sgl.duplexkv.transfer import TRANSFERS

    assert set(KV_TRANSFERS) == set(TRANSFERS)


def test_predictive_prefix_cache_refuses_sglangs_eviction_flags() -> None:
    from superinfer_sgl.config import check_prefix_cache

    predictive = SuperInferConfig(prefix_cache="predictive")
    check_prefix_cache(predictive, None, False)
    check_prefix_cache(SuperInferConfig(), "lfu", True)  # the default cache leaves SGLang's flags alone
    with pytest.raises(ConfigError, match="--radix-eviction-policy lfu"):
        check_prefix_cache(predictive, "lfu", False)
    with pytest.raises(ConfigError, match="--disable-radix-cache"):
        check_prefix_cache(predictive, None, True)
    # model parallelism: every rank keeps a tree, and ours scores by each rank's clock
    check_prefix_cache(predictive, None, False, {"--tp-size": 1, "--pp-size": 1})
    check_prefix_cache(SuperInferConfig(), None, False, {"--tp-size": 4})
    for flags in ({"--tp-size": 2}, {"--tensor-parallel-size": 8}, {"--pp-size": 2}):
        with pytest.raises(ConfigError, match="diverge"):
            check_prefix_cache(predictive, None, False, flags)


def test_model_parallel_flags_read_sglangs_spellings() -> None:
    from superinfer_sgl.launch_server import model_parallel_flags

    assert model_parallel_flags(["--tensor-parallel-size", "2", "--pp-size=4"]) == {"--tensor-parallel-size": 2,
                                                                                  "--pp-size": 4}
    assert model_parallel_flags(["--tp-size", "x"]) == {}  # SGLang's parser says what is wrong
    assert model_parallel_flags([]) == {}


def test_prefix_host_tokens_auto_off_or_a_count_only_with_the_predictive_cache() -> None:
    from superinfer_sgl.config import check_prefix_host

    assert SuperInferConfig().prefix_host_tokens is None  # auto
    ns = _parser().parse_args(["--prefix-cache", "predictive", "--prefix-host-tokens", "4096"])
    cfg = from_namespace(ns)
    assert cfg.prefix_host_tokens == 4096
    check_prefix_host(cfg)
    assert from_namespace(_parser().parse_args(["--prefix-host-tokens", "auto"])).prefix_host_tokens is None
    check_prefix_host(SuperInferConfig(prefix_host_tokens=0))  # off, with any cache
    check_prefix_host(SuperInferConfig())  # auto with the default radix cache: nothing to size
    with pytest.raises(ConfigError, match="prefix-host-tokens must be >= 0"):
        SuperInferConfig(prefix_cache="predictive", prefix_host_tokens=-1)
    with pytest.raises(ConfigError, match="host tier of --prefix-cache predictive"):
        check_prefix_host(SuperInferConfig(prefix_host_tokens=100))
