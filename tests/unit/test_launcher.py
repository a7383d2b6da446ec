"""The launcher: our flags vs SGLang's, device defaults, launch checks, one-line errors. No server."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest

from superinfer_sgl import SUPPORTED_SGLANG_VERSION, device_defaults, launch_server
from superinfer_sgl.config import CONFIG_ENV, ConfigError, SuperInferConfig
from superinfer_sgl.launch_checks import (
    LaunchError,
    check_model_path,
    check_port_free,
    flag_given,
    flag_value,
)
from superinfer_sgl.plugin import CPU_COMPAT_ENV

OUR_GROUP = "superinfer_sgl (RotaSched / DuplexKV)"
GIB = 1 << 30
BUDGET_10_GIB = 10 * GIB // 10 // 23040  # 10 % of 10 GiB over 23040 bytes per token = 46603
# What the launcher must add on CPU (it may add more, e.g. --sleep-on-idle).
CPU_FLAGS = {
    "--device": "cpu",
    "--attention-backend": "torch_native",
    "--cuda-graph-backend-decode": "disabled",
    "--cuda-graph-backend-prefill": "disabled",
    "--max-total-tokens": str(BUDGET_10_GIB),
}


def _model_dir(root: Path, **overrides: object) -> Path:
    """A minimal HF folder: 30 layers, 3 KV heads of 64 dims (SmolLM2-135M's shape)."""
    cfg = {
        "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
        "head_dim": 64, "hidden_size": 576,
    }
    cfg.update(overrides)
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps({k: v for k, v in cfg.items() if v is not None}))
    return root


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _one_error_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("superinfer_sgl: error:"), err
    return lines[0]


def _flags(argv: list[str]) -> dict[str, str | None]:
    """Flags of an argv tail (no positional arguments), each at most once."""
    out: dict[str, str | None] = {}
    i = 0
    while i < len(argv):
        flag = argv[i]
        assert flag.startswith("--") and flag not in out, argv
        value = argv[i + 1] if i + 1 < len(argv) and not argv[i + 1].startswith("--") else None
        out[flag] = value
        i += 1 if value is None else 2
    return out


def _run_main(argv: list[str]) -> int | str | None:
    try:
        return launch_server.main(argv)
    except SystemExit as exc:  # argparse reports its own errors by exiting
        return exc.code


@pytest.fixture(autouse=True)
def _restore_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """prepare() writes our variables into os.environ; put them back as they were."""
    for name in (CONFIG_ENV, CPU_COMPAT_ENV):
        monkeypatch.setenv(name, "placeholder")  # records the original value for undo
        monkeypatch.delenv(name)
    yield


@pytest.fixture
def no_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(device_defaults, "has_cuda", lambda: False)
    monkeypatch.setattr("psutil.virtual_memory", lambda: SimpleNamespace(available=10 * GIB))


@pytest.fixture
def with_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(device_defaults, "has_cuda", lambda: True)


# --- our flags vs SGLang's -----------------------------------------------------------------------


def test_our_parser_separates_flags() -> None:
    argv = ["--scheduler", "sglang", "--port", "1234", "--tp-size", "1", "--enable-metrics"]
    ns, rest = launch_server.our_parser().parse_known_args(argv)
    assert ns.scheduler == "sglang"
    assert rest == ["--port", "1234", "--tp-size", "1", "--enable-metrics"]


def test_our_parser_interleaved_and_equals_forms() -> None:
    argv = [
        "--model-path", "m", "--ttft-slo-ms=250", "--schedule-policy", "lpm", "--tbt-slo-ms", "20",
        "--scheduler-recv-interval", "4", "--kv-cache-dtype", "auto", "--kv-transfer", "torch",
    ]
    ns, rest = launch_server.our_parser().parse_known_args(argv)
    assert (ns.ttft_slo_ms, ns.tbt_slo_ms, ns.kv_transfer) == (250.0, 20.0, "torch")
    assert rest == [
        "--model-path", "m", "--schedule-policy", "lpm", "--scheduler-recv-interval", "4",
        "--kv-cache-dtype", "auto",
    ]


@pytest.mark.parametrize(
    "argv",
    [
        ["--schedule-policy", "fcfs"],
        ["--schedule", "fcfs"],  # a prefix of our --scheduler
        ["--ttft", "5"],  # a prefix of our --ttft-slo-ms
        ["--rotary", "1"],
        ["--kv", "x"],
    ],
)
def test_abbreviations_are_left_to_sglang(argv: list[str]) -> None:
    assert launch_server.our_parser().allow_abbrev is False
    ns, rest = launch_server.our_parser().parse_known_args(argv)
    assert rest == argv
    assert ns.scheduler == "rotasched" and ns.ttft_slo_ms == 5000.0


def test_prepare_on_cpu(tmp_path: Path, no_cuda: None) -> None:
    model, port = str(_model_dir(tmp_path / "m")), str(_free_port())
    argv = ["--scheduler", "sglang", "--model-path", model, "--port", port, "--tp-size", "1",
            "--enable-metrics"]
    cfg, rest = launch_server.prepare(argv)
    assert cfg == SuperInferConfig(scheduler="sglang")
    sglang_argv = ["--model-path", model, "--port", port, "--tp-size", "1", "--enable-metrics"]
    assert rest[: len(sglang_argv)] == sglang_argv  # SGLang's flags untouched, in order
    added = _flags(rest[len(sglang_argv):])
    assert added.items() >= CPU_FLAGS.items(), added
    assert not set(added) & set(_flags(sglang_argv))
    assert SuperInferConfig.from_env() == cfg
    assert os.environ[CPU_COMPAT_ENV] == "1"


def test_prepare_inserts_default_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                       no_cuda: None) -> None:
    from superinfer_sgl import model_prep

    model = _model_dir(tmp_path / "default")
    monkeypatch.setattr(model_prep, "prepare_default_model", lambda: model)
    port = str(_free_port())
    _, rest = launch_server.prepare(["--scheduler", "sglang", "--port", port, "--tp-size", "1",
                                     "--enable-metrics"])
    assert rest[:7] == ["--model-path", str(model), "--port", port, "--tp-size", "1",
                        "--enable-metrics"]
    assert _flags(rest[7:])["--device"] == "cpu"


def test_prepare_keeps_cpu_compat_choice(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                         no_cuda: None) -> None:
    monkeypatch.setenv(CPU_COMPAT_ENV, "0")
    launch_server.prepare(["--model-path", str(_model_dir(tmp_path)), "--port", str(_free_port())])
    assert os.environ[CPU_COMPAT_ENV] == "0"


def test_prepare_with_cuda(tmp_path: Path, with_cuda: None) -> None:
    model, port = str(_model_dir(tmp_path)), str(_free_port())
    _, rest = launch_server.prepare(["--model-path", model, "--port", port])
    assert rest == ["--model-path", model, "--port", port, "--attention-backend", "flashinfer",
                    "--enable-mixed-chunk"]  # rotasched resumes ride along with decode
    assert CPU_COMPAT_ENV not in os.environ
    assert SuperInferConfig.from_env() == SuperInferConfig()


def test_prepare_config_error_before_side_effects() -> None:
    with pytest.raises(ConfigError, match="--ttft-slo-ms"):
        launch_server.prepare(["--ttft-slo-ms", "-5", "--port", "1"])
    assert CONFIG_ENV not in os.environ


# --- device defaults ----------------------------------------------------------------------------


def test_cpu_defaults(tmp_path: Path, no_cuda: None) -> None:
    model = str(_model_dir(tmp_path))
    d = device_defaults.device_defaults(["--model-path", model])
    assert d.cpu
    flags = dict(d.flags)
    assert len(flags) == len(d.flags)  # each flag once
    assert flags.items() >= CPU_FLAGS.items(), d.flags
    assert flags["--max-total-tokens"] == "46603"


def test_cuda_defaults(with_cuda: None) -> None:
    d = device_defaults.device_defaults([])
    assert not d.cpu and d.flags == (("--attention-backend", "flashinfer"),)


def test_explicit_cpu_device_wins_over_cuda(tmp_path: Path, with_cuda: None) -> None:
    assert device_defaults.device_defaults(["--device", "cpu"]).cpu
    assert not device_defaults.device_defaults(["--device", "cuda"]).cpu


@pytest.mark.parametrize(
    "given",
    [
        ["--attention-backend", "triton"],
        ["--device=cpu", "--attention-backend=triton", "--cuda-graph-backend-decode", "full"],
        ["--device", "cpu", "--attention-backend", "intel_amx", "--cuda-graph-backend-decode=full",
         "--cuda-graph-backend-prefill", "breakable"],
    ],
)
def test_user_flags_are_never_overridden(tmp_path: Path, no_cuda: None, given: list[str]) -> None:
    argv = ["--model-path", str(_model_dir(tmp_path)), "--max-total-tokens", "777", *given]
    out = launch_server.apply_device_defaults(argv, device_defaults.device_defaults(argv))
    assert out[: len(argv)] == argv
    added = _flags(out[len(argv):])
    user = {a.split("=", 1)[0] for a in argv if a.startswith("--")}
    assert not set(added) & user, added  # never a second value for a flag the user gave
    assert {k: v for k, v in CPU_FLAGS.items() if k not in user}.items() <= added.items()


def test_user_flags_are_never_overridden_with_cuda(with_cuda: None) -> None:
    argv = ["--attention-backend", "fa3"]
    assert launch_server.apply_device_defaults(argv, device_defaults.device_defaults(argv)) == argv


def test_kv_bytes_per_token(tmp_path: Path) -> None:
    model = str(_model_dir(tmp_path))
    assert device_defaults.kv_bytes_per_token(model, "bfloat16") == 23040
    assert device_defaults.kv_bytes_per_token(model, "auto") == 23040
    assert device_defaults.kv_bytes_per_token(model, "float32") == 46080


def test_kv_bytes_per_token_derived_fields(tmp_path: Path) -> None:
    # No head_dim: hidden_size / heads; no num_key_value_heads: every attention head has KV.
    model = str(_model_dir(tmp_path, head_dim=None, num_key_value_heads=None))
    assert device_defaults.kv_bytes_per_token(model, "float16") == 30 * 2 * 9 * 64 * 2


@pytest.mark.parametrize(("available", "expected"), [(10 * GIB, 46603), (10**15, 65536), (GIB // 100, 1024)])
def test_cpu_kv_budget_is_clamped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, available: int,
                                  expected: int) -> None:
    monkeypatch.setattr("psutil.virtual_memory", lambda: SimpleNamespace(available=available))
    assert device_defaults.cpu_kv_budget_tokens(str(_model_dir(tmp_path)), "bfloat16") == expected


def test_cpu_kv_budget_without_readable_config(tmp_path: Path) -> None:
    assert device_defaults.cpu_kv_budget_tokens("org/hub-model", "auto") == 8192
    assert device_defaults.cpu_kv_budget_tokens(str(tmp_path), "auto") == 8192


# --- launch checks ------------------------------------------------------------------------------


def test_flag_helpers() -> None:
    argv = ["--port", "1", "--host=::1", "--model-path-extra", "x", "--trailing"]
    assert flag_given(argv, "--port") and flag_given(argv, "--host")
    assert not flag_given(argv, "--model-path")
    assert flag_value(argv, "--port") == "1" and flag_value(argv, "--host") == "::1"
    assert flag_value(argv, "--model-path") is None
    assert flag_value(argv, "--trailing") is None


def test_check_port_free_busy() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(LaunchError, match=f"port {port} "):
            check_port_free("127.0.0.1", port)


def test_check_port_free_free() -> None:
    check_port_free("127.0.0.1", _free_port())


def test_check_model_path_missing(tmp_path: Path) -> None:
    with pytest.raises(LaunchError, match="does not exist"):
        check_model_path(str(tmp_path / "nope"))
    with pytest.raises(LaunchError, match="does not exist"):
        check_model_path("./relative/nope")


def test_check_model_path_folder_without_config(tmp_path: Path) -> None:
    with pytest.raises(LaunchError, match="config.json"):
        check_model_path(str(tmp_path))


def test_check_model_path_local_ok(tmp_path: Path) -> None:
    check_model_path(str(_model_dir(tmp_path)))


def test_check_model_path_unknown_hub_id(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(LaunchError, match="unknown model path"):
        check_model_path("superinfer-no-such-org/no-such-model-7f3a")


def test_check_sglang_version_ok() -> None:
    launch_server.check_sglang_version()
    assert SUPPORTED_SGLANG_VERSION == "0.5.23"


def test_check_sglang_version_mismatch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(launch_server.metadata, "version", lambda name: "0.5.22")
    with pytest.raises(LaunchError, match="found sglang 0.5.22"):
        launch_server.check_sglang_version()


def test_check_sglang_version_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    def missing(name: str) -> str:
        raise launch_server.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(launch_server.metadata, "version", missing)
    with pytest.raises(LaunchError, match="not installed"):
        launch_server.check_sglang_version()


# --- main(): exit codes and one-line errors ---------------------------------------------------


def test_main_bad_choice_fails(capsys: pytest.CaptureFixture[str]) -> None:
    assert _run_main(["--scheduler", "bogus"]) == 2
    assert "Traceback" not in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["--scheduler", "bogus"], ["--ttft-slo-ms", "abc"]])
def test_main_argparse_error_is_one_line(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert _run_main(argv) == 2
    _one_error_line(capsys.readouterr().err)


def test_main_config_error_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert launch_server.main(["--ttft-slo-ms", "-5"]) == 2
    assert "--ttft-slo-ms must be a number of milliseconds in [0.001, 1e+09]" in _one_error_line(capsys.readouterr().err)


def test_main_launch_error_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert launch_server.main(["--model-path", str(tmp_path / "missing")]) == 2
    assert "does not exist" in _one_error_line(capsys.readouterr().err)
    assert CONFIG_ENV not in os.environ


def test_main_busy_port_is_one_line(tmp_path: Path, no_cuda: None,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        rc = launch_server.main(["--model-path", str(_model_dir(tmp_path)), "--port", str(port)])
    assert rc == 2
    assert f"port {port}" in _one_error_line(capsys.readouterr().err)


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_main_help(flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert launch_server.main([flag]) == 0
    out = capsys.readouterr().out
    assert OUR_GROUP in out
    for option in ("--scheduler", "--ttft-slo-ms", "--model-path", "--tp-size", "--port"):
        assert option in out


def test_cli_subprocess_one_line_error(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in (CONFIG_ENV, CPU_COMPAT_ENV)}
    proc = subprocess.run(
        [sys.executable, "-m", "superinfer_sgl.launch_server", "--ttft-slo-ms", "-5"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr
    assert "--ttft-slo-ms" in _one_error_line(proc.stderr)


def test_mixed_chunk_only_for_rotasched_and_not_twice(tmp_path: Path, with_cuda: None) -> None:
    model = str(_model_dir(tmp_path))
    _, rest = launch_server.prepare(["--model-path", model, "--port", str(_free_port()), "--scheduler", "sglang"])
    assert "--enable-mixed-chunk" not in rest
    _, rest = launch_server.prepare(["--model-path", model, "--port", str(_free_port()), "--no-mixed-resume"])
    assert "--enable-mixed-chunk" not in rest
    _, rest = launch_server.prepare(["--model-path", model, "--port", str(_free_port()), "--enable-mixed-chunk"])
    assert rest.count("--enable-mixed-chunk") == 1


def test_from_the_checkout_triton_kernels_probe_answers_truthfully(tmp_path: Path) -> None:
    """Started from the repository root, our triton_kernels/ folder is a namespace package that
    importlib finds as `triton_kernels` (SGLang's is_triton_kernels_available() then says yes);
    the launcher drops the checkout from sys.path (our packages are installed), so the probe sees
    only a real Triton kernels package. The child runs the launcher's function on a path of the
    root and the standard library only, so an installed Triton package cannot mask the folder."""
    import inspect

    from superinfer_sgl.launch_server import CHECKOUT, drop_checkout_from_path

    child = "\n".join([
        "import os, sys, sysconfig, importlib.util as u",
        "from importlib import metadata",
        "from pathlib import Path",
        f"CHECKOUT = Path({str(CHECKOUT)!r})",
        inspect.getsource(drop_checkout_from_path),
        "sys.path[:] = ['', *(sysconfig.get_paths()[k] for k in ('stdlib', 'platstdlib'))]",
        "before = u.find_spec('triton_kernels')",
        "sys.path[:] = drop_checkout_from_path(sys.path, importable=True)",
        "sys.path_importer_cache.clear()",
        "print(list(before.submodule_search_locations) if before else None)",
        "print(u.find_spec('triton_kernels'))",
    ])
    out = subprocess.run([sys.executable, "-c", child], cwd=CHECKOUT, capture_output=True, text=True,
                         timeout=60, check=True).stdout.splitlines()
    assert out == [str([str(CHECKOUT / "triton_kernels")]), "None"]  # the false yes, then none
    # a checkout that is not the installed one keeps its root (dropping it would switch code)
    path = ["", str(tmp_path), str(CHECKOUT)]
    assert drop_checkout_from_path(path, importable=False) == path
    assert drop_checkout_from_path([str(tmp_path), str(CHECKOUT)], importable=True) == [str(tmp_path)]
    # here (an editable install of this checkout) the launcher's own answer: it imports without it
    assert launch_server._imports_without([str(tmp_path)], CHECKOUT) is True
    assert launch_server._imports_without([str(tmp_path)], tmp_path) is False  # another checkout


@pytest.mark.parametrize(("ranks", "cores", "bind"), [
    (2, [0, 1], "0|1"),
    (2, list(range(8)), "0-3|4-7"),
    (3, list(range(8)), "0-1|2-3|4-5"),  # the remainder stays unused: equal ranks
    (2, [7, 6, 5, 2, 1, 0], "0-2|5-7"),
    (2, [0, 2, 4, 6], "0,2|4,6"),
])
def test_cpu_threads_bind(ranks: int, cores: list[int], bind: str) -> None:
    assert device_defaults.cpu_threads_bind(ranks, cores) == bind


def test_cpu_threads_bind_needs_a_core_per_rank() -> None:
    with pytest.raises(LaunchError, match="need at least 3 cores"):
        device_defaults.cpu_threads_bind(3, [0, 1])


def test_default_threads_bind(monkeypatch: pytest.MonkeyPatch) -> None:
    env = device_defaults.THREADS_BIND_ENV
    monkeypatch.setenv(env, "x")
    monkeypatch.delenv(env)
    monkeypatch.setattr(device_defaults, "numa_nodes", lambda: 1)
    monkeypatch.setattr(device_defaults.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    assert device_defaults.default_threads_bind([]) is None  # one rank: SGLang's own choice
    assert device_defaults.default_threads_bind(["--dp-size", "2"]) == "0-1|2-3"
    assert device_defaults.default_threads_bind(["--dp-size", "2", "--tp-size", "2"]) == "0|1|2|3"
    monkeypatch.setattr(device_defaults, "numa_nodes", lambda: 2)
    assert device_defaults.default_threads_bind(["--dp-size", "2"]) is None  # a NUMA node each
    monkeypatch.setenv(env, "0|1")
    assert device_defaults.default_threads_bind(["--dp-size", "4"]) is None  # the user's stands


def test_prepare_binds_cpu_ranks(tmp_path: Path, no_cuda: None, monkeypatch: pytest.MonkeyPatch) -> None:
    env = device_defaults.THREADS_BIND_ENV
    monkeypatch.setenv(env, "x")
    monkeypatch.delenv(env)
    monkeypatch.setattr(device_defaults, "numa_nodes", lambda: 1)
    monkeypatch.setattr(device_defaults.os, "sched_getaffinity", lambda pid: {0, 1})
    model, port = str(_model_dir(tmp_path / "m")), str(_free_port())
    launch_server.prepare(["--model-path", model, "--port", port, "--dp-size", "2"])
    assert os.environ[env] == "0|1"


def test_replica_threads_binds(monkeypatch: pytest.MonkeyPatch, no_cuda: None) -> None:
    env = device_defaults.THREADS_BIND_ENV
    monkeypatch.setenv(env, "x")
    monkeypatch.delenv(env)
    monkeypatch.setattr(device_defaults.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    assert device_defaults.replica_threads_binds(2, []) == ["0-1", "2-3"]  # a core group each
    assert device_defaults.replica_threads_binds(1, []) is None
    assert device_defaults.replica_threads_binds(5, []) is None  # fewer cores than replicas: shared
    assert device_defaults.replica_threads_binds(2, ["--dp-size", "2"]) is None  # ranks bind themselves
    monkeypatch.setenv(env, "0|1")
    assert device_defaults.replica_threads_binds(2, []) is None  # the user's stands


def test_replica_threads_binds_not_on_cuda(monkeypatch: pytest.MonkeyPatch, with_cuda: None) -> None:
    monkeypatch.setattr(device_defaults.os, "sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.delenv(device_defaults.THREADS_BIND_ENV, raising=False)
    assert device_defaults.replica_threads_binds(2, []) is None


@pytest.mark.parametrize("cores", [[0], [0, 1], [0, 1, 2, 5], [3, 7, 8, 9, 12]])
def test_cpulist_round_trip(cores: list[int]) -> None:
    text = device_defaults.cpu_threads_bind(1, cores)
    assert device_defaults.parse_cpulist(text) == set(cores)
