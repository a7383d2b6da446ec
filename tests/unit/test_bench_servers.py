"""A/B server command lines (same shared flags for every system) and process-group cleanup."""

from __future__ import annotations

import json
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from superinfer_sgl.bench.cli import parser
from superinfer_sgl.bench.paired import pairs_for
from superinfer_sgl.bench.planning import build_plan
from superinfer_sgl.bench.servers import (
    OUR_MODULE,
    STOCK_MODULE,
    VLLM_MODULE,
    ServerProcess,
    SystemSpec,
    command,
    environment,
    kv_bytes_per_token,
    noise_twin,
    parse_variants,
    shared_flags,
    systems,
)
from superinfer_sgl.config import CONFIG_ENV
from superinfer_sgl.device_defaults import device_defaults
from superinfer_sgl.plugin import CPU_COMPAT_ENV


def _model(tmp_path: Path) -> str:
    (tmp_path / "config.json").write_text(json.dumps({
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 64}))
    return str(tmp_path)


def _contains(seq: list[str], sub: list[str]) -> bool:
    return any(seq[i:i + len(sub)] == sub for i in range(len(seq) - len(sub) + 1))


def _plan(argv: list[str]):  # type: ignore[no-untyped-def]
    return build_plan(parser().parse_args(argv), argv)


def test_every_system_gets_the_same_shared_flags(tmp_path: Path) -> None:
    shared = shared_flags(_model(tmp_path), 2048, 512, "cpu", ("--dtype", "float32"))
    table = systems(("--scheduler", "rotasched", "--ttft-slo-ms", "6000"))
    cmds = {name: command(spec, shared, 12345) for name, spec in table.items()}
    for name, cmd in cmds.items():
        assert _contains(cmd, shared), name
        assert cmd[-4:] == ["--host", "127.0.0.1", "--port", "12345"]
    assert cmds["sglang"][1:3] == ["-m", STOCK_MODULE] and cmds["superinfer"][1:3] == ["-m", OUR_MODULE]
    assert "--enable-priority-scheduling" in cmds["sglang-priority"]
    assert not any(a.startswith(("--scheduler", "--ttft-slo")) for a in cmds["sglang"] + cmds["sglang-priority"])
    assert "--scheduler" in cmds["superinfer"]
    stock_only = [a for a in cmds["sglang"] if a not in shared]
    assert stock_only == [sys.executable, "-m", STOCK_MODULE, "--host", "127.0.0.1", "--port", "12345"]


def test_cpu_flags_are_the_launchers_device_defaults(tmp_path: Path) -> None:
    model = _model(tmp_path)
    shared = shared_flags(model, 1536, 512, "cpu")
    for flag, value in device_defaults(["--device", "cpu", "--model-path", model]).flags:
        if flag == "--max-total-tokens":
            assert shared[shared.index(flag) + 1] == "1536"  # ours, not the launcher's RAM-sized default
        elif value is None:
            assert flag in shared  # a switch, e.g. --sleep-on-idle
        else:
            assert shared[shared.index(flag) + 1] == value
    assert shared.count("--max-total-tokens") == 1
    assert shared[shared.index("--chunked-prefill-size") + 1] == "512"
    assert "--enable-metrics" in shared


def test_stock_environment_keeps_our_plugin_inert(tmp_path: Path) -> None:
    shared = shared_flags(_model(tmp_path), 1024, 256, "cpu")
    base = {CONFIG_ENV: '{"scheduler": "rotasched"}', "PATH": "/bin"}
    env = environment(systems(())["sglang"], shared, base)
    assert CONFIG_ENV not in env and env[CPU_COMPAT_ENV] == "1" and env["PATH"] == "/bin"
    gpu = shared_flags(_model(tmp_path), 1024, 256, "cuda")
    assert CPU_COMPAT_ENV not in environment(systems(())["sglang"], gpu, {CPU_COMPAT_ENV: "1"})
    assert gpu[gpu.index("--attention-backend") + 1] == "flashinfer"


def test_a_system_s_own_environment_reaches_its_server(tmp_path: Path) -> None:
    """prefix_ab's lru-pycore arm: stock LRU on SGLang's Python tree core, set by its own variable."""
    from superinfer_sgl.bench.prefix_ab import PYTHON_TREE_CORE_ENV, arms

    shared = shared_flags(_model(tmp_path), 1024, 256, "cpu")
    table = arms(64, 11)
    assert environment(table["lru-pycore"], shared, {})[PYTHON_TREE_CORE_ENV] == "python"
    assert PYTHON_TREE_CORE_ENV not in environment(table["lru"], shared, {})


def test_noise_twin_is_identical() -> None:
    a = systems(())["sglang"]
    b = noise_twin(a)
    assert (b.module, b.flags, b.uses_priority) == (a.module, a.flags, a.uses_priority) and b.name == "sglang#2"


def test_gpu_profile_dry_plan(tmp_path: Path, model_dir: Path) -> None:
    plan, _ = _plan(["--profile", "gpu", "--out", str(tmp_path / "g"), "--num-requests", "20"])
    shared = plan.shared
    assert _contains(shared, ["--load-format", "dummy"]) and _contains(shared, ["--device", "cuda"])
    assert "torch_native" not in shared
    cfg = json.loads((Path(plan.model) / "config.json").read_text())
    assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["num_key_value_heads"]) == (4096, 32, 8)
    assert (Path(plan.model) / "tokenizer.json").is_file()
    assert (plan.profile.slo.ttft_ms, plan.profile.slo.tbt_ms) == (5000, 100)
    ours = command(plan.systems[-1], shared, 1)
    assert _contains(ours, ["--ttft-slo-ms", "5000", "--tbt-slo-ms", "100"])
    plan, _ = _plan(["--profile", "gpu", "--dummy-shape", "qwen2.5-32b", "--out", str(tmp_path / "q"),
                              "--num-requests", "5"])
    assert json.loads((Path(plan.model) / "config.json").read_text())["num_hidden_layers"] == 64


def test_a_variant_is_ours_with_its_flags_last(tmp_path: Path, model_dir: Path) -> None:
    """--variant NAME=FLAGS: system superinfer-NAME runs our server as shipped plus FLAGS, which
    come last (so they override the harness's own); with --paired it sits beside ours."""
    plan, _ = _plan(["--profile", "smoke", "--out", str(tmp_path / "v"), "--paired",
                     "--variant", "reserve15=--running-reserve 0.15", "--systems", "superinfer,superinfer-reserve15"])
    ours, variant = plan.systems
    assert variant.name == "superinfer-reserve15" and variant.ours
    assert variant.flags == (*ours.flags, "--running-reserve", "0.15")
    assert [(a.name, b.name) for a, b in pairs_for(plan.systems)] == [("superinfer", "superinfer-reserve15")]
    for bad in ("reserve15", "Bad Name=--x 1", "x=", "needed=--mix-prefill always"):
        with pytest.raises(ValueError, match="--variant"):
            _plan(["--profile", "smoke", "--out", str(tmp_path / "b"), "--variant", bad])
    with pytest.raises(ValueError, match="twice"):
        parse_variants(["a=--x 1", "a=--x 2"])


def test_mixed_workload_adds_the_priority_baseline(tmp_path: Path, model_dir: Path) -> None:
    plan, _ = _plan(["--profile", "smoke", "--workload", "mixed", "--out", str(tmp_path / "m")])
    assert [s.name for s in plan.systems] == ["sglang", "sglang-priority", "superinfer"]
    assert {r.slo_class for r in plan.requests} <= {"interactive", "batch"}
    plan, _ = _plan(["--profile", "smoke", "--noise", "--out", str(tmp_path / "n")])
    assert [s.name for s in plan.systems] == ["sglang", "superinfer", "sglang#2"]


def test_the_vllm_peer_gets_the_same_model_kv_budget_and_chunk(tmp_path: Path, model_dir: Path) -> None:
    model = _model(tmp_path)
    shared = shared_flags(model, 1536, 512, "cpu", ("--dtype", "bfloat16"))
    spec = systems((), vllm_python="/opt/vllm/bin/python")["vllm"]
    cmd = command(spec, shared, 4321)
    assert cmd[:3] == ["/opt/vllm/bin/python", "-m", VLLM_MODULE]
    # 2 layers x 2 KV heads x 16 dims x K and V x 2 bytes = 256 bytes per token
    assert kv_bytes_per_token(model) == 256
    # the same usable tokens: one block more, which vLLM keeps back
    for flag, value in (("--model", model), ("--max-model-len", "1536"), ("--kv-cache-memory-bytes", str((1536 + 32) * 256)),
                        ("--max-num-batched-tokens", "512"), ("--block-size", "32"), ("--dtype", "bfloat16"),
                        ("--port", "4321")):
        assert _contains(cmd, [flag, value]), flag
    assert "--attention-backend" not in cmd and "--model-path" not in cmd  # SGLang-only flags dropped
    env = environment(spec, shared, {})
    assert env["VLLM_SERVER_DEV_MODE"] == "1" and env["VLLM_TARGET_DEVICE"] == "cpu"  # cache reset; platform
    # --peer vllm adds it (and says how to install it when its venv is missing)
    fake = tmp_path / "python"
    fake.write_text("")
    plan, _ = _plan(["--profile", "smoke", "--peer", "vllm", "--vllm-python", str(fake), "--out", str(tmp_path / "v")])
    assert [s.name for s in plan.systems] == ["sglang", "superinfer", "vllm"] and plan.systems[-1].is_vllm
    with pytest.raises(ValueError, match="setup_vllm_cpu.sh"):
        _plan(["--profile", "smoke", "--peer", "vllm", "--vllm-python", str(tmp_path / "none"), "--out", str(tmp_path / "w")])


STUBBORN = textwrap.dedent("""
    import signal, subprocess, sys, time
    signal.signal(signal.SIGTERM, signal.SIG_IGN)   # a launcher that ignores SIGTERM
    kids = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"]) for _ in range(2)]
    print("ready", flush=True)
    time.sleep(600)
""")


def test_stop_kills_the_whole_process_group(tmp_path: Path) -> None:
    script = tmp_path / "stubborn.py"
    script.write_text(STUBBORN)
    spec = SystemSpec("fake", "fake")
    server = ServerProcess(spec, [sys.executable, str(script)], {}, tmp_path / "log.txt", 0)
    server.start()
    deadline = time.time() + 120
    while "ready" not in server.log_tail() and time.time() < deadline:
        time.sleep(0.1)
    assert "ready" in server.log_tail()
    server._track()
    tree = set(server.pids)
    assert len(tree) == 3, tree
    left = server.stop(grace_s=1.0)
    assert left == []
    assert not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in tree)


HARNESS = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from superinfer_sgl.bench.servers import ServerProcess, SystemSpec
    server = ServerProcess(SystemSpec("fake", "fake"), [sys.executable, "-c", "import time; time.sleep(600)"],
                           {}, Path(sys.argv[1]), 0)
    server.start()
    print(server.proc.pid, flush=True)
    time.sleep(600)
""")


def test_servers_die_with_a_killed_harness(tmp_path: Path) -> None:
    """SIGKILL leaves no handler to run: the server's parent-death signal takes it down."""
    import signal
    import subprocess

    harness = subprocess.Popen([sys.executable, "-c", HARNESS, str(tmp_path / "log.txt")], stdout=subprocess.PIPE,
                               text=True)
    server_pid = int(harness.stdout.readline())
    assert psutil.pid_exists(server_pid)
    harness.send_signal(signal.SIGKILL)
    harness.wait()
    deadline = time.time() + 30
    while time.time() < deadline and psutil.pid_exists(server_pid) and \
            psutil.Process(server_pid).status() != psutil.STATUS_ZOMBIE:
        time.sleep(0.1)
    assert not psutil.pid_exists(server_pid) or psutil.Process(server_pid).status() == psutil.STATUS_ZOMBIE
