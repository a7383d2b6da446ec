"""`python -m superinfer_sgl.launch_server`: SGLang's server with RotaSched and DuplexKV.

Every stock SGLang option passes through unchanged; our own options (see config.py) are parsed here
and handed to SGLang's child processes by environment. With no arguments it serves the embedded
SmolLM2-135M-Instruct model (on CPU when there is no CUDA).
"""

from __future__ import annotations

import argparse
import itertools
import logging
import os
import sys
from importlib import metadata
from pathlib import Path

from . import SUPPORTED_SGLANG_VERSION
from .child_watch import ChildWatch
from .config import (CONFIG_ENV, ConfigError, SuperInferConfig, add_cli_args, check_prefix_cache, check_prefix_host,
                     check_rotary_kv_dtype, from_namespace)
from .device_defaults import THREADS_BIND_ENV, DeviceDefaults, default_threads_bind, device_defaults
from .launch_checks import LaunchError, check_model_path, check_port_free, flag_given, flag_value, parallel_flag
from .plugin import CPU_COMPAT_ENV

logger = logging.getLogger("superinfer_sgl")
CHECKOUT = Path(__file__).resolve().parents[1]  # the repository root when run from a checkout


def drop_checkout_from_path(path: list[str], importable: bool | None = None,
                            checkout: Path = CHECKOUT) -> list[str]:
    """`path` (sys.path) without the entries that are this checkout's root ('' or the cwd when the
    server is started from it), when this same code also imports without them (an editable
    install of this checkout: `importable`, found by `_imports_without`). From the root, our
    `triton_kernels/` folder would pass for Triton's own `triton_kernels` package (a namespace
    package `importlib.util.find_spec` finds), and SGLang's `is_triton_kernels_available()`
    would answer yes where that package is not installed. SGLang's spawned scheduler processes
    inherit this sys.path. A checkout that is not the installed one keeps its root: dropping it
    would switch the server to the installed code."""
    kept = [p for p in path if Path(p or os.getcwd()).resolve() != checkout]
    if importable is None:
        importable = _imports_without(kept, checkout)
    return kept if importable else list(path)


def _imports_without(path: list[str], checkout: Path) -> bool:
    """Whether `import superinfer_sgl` with sys.path = `path` finds this checkout's package."""
    from importlib.machinery import PathFinder

    for finder in sys.meta_path:
        find = getattr(finder, "find_spec", None)
        if find is None:
            continue
        spec = PathFinder.find_spec("superinfer_sgl", path) if finder is PathFinder else find("superinfer_sgl", None)
        if spec is not None and spec.origin:
            return Path(spec.origin).resolve() == checkout / "superinfer_sgl" / "__init__.py"
    return False


class _OneLineParser(argparse.ArgumentParser):
    """argparse prints a usage block and exits; we want our one-line error instead."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise ConfigError(message)


def our_parser() -> argparse.ArgumentParser:
    # allow_abbrev=False: a prefix of an SGLang flag must never be taken as one of ours.
    parser = _OneLineParser(add_help=False, allow_abbrev=False)
    add_cli_args(parser)
    return parser


def print_help() -> None:
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser(
        prog="python -m superinfer_sgl.launch_server",
        description="SGLang server with SLO-aware rotary scheduling (RotaSched) and DuplexKV.",
    )
    add_cli_args(parser)
    sglang_group = argparse.ArgumentParser(add_help=False)
    ServerArgs.add_cli_args(sglang_group)
    parser._actions.extend(a for a in sglang_group._actions)
    for group in sglang_group._action_groups:
        parser._action_groups.append(group)
    parser.print_help()


def check_sglang_version() -> None:
    try:
        found = metadata.version("sglang")
    except metadata.PackageNotFoundError as exc:
        raise LaunchError(f"sglang is not installed; superinfer_sgl needs sglang=={SUPPORTED_SGLANG_VERSION}") from exc
    if found != SUPPORTED_SGLANG_VERSION:
        raise LaunchError(f"superinfer_sgl needs sglang=={SUPPORTED_SGLANG_VERSION}, found sglang {found}")


def resolve_model(argv: list[str]) -> list[str]:
    """Insert the prepared default model when no --model-path was given; validate a given one."""
    given = flag_value(argv, "--model-path") or flag_value(argv, "--model")
    if given is not None:
        check_model_path(given)
        return argv
    from .model_prep import ModelPrepError, prepare_default_model

    try:
        path = prepare_default_model()
    except ModelPrepError as exc:
        raise LaunchError(str(exc)) from exc
    return ["--model-path", str(path), *argv]


def apply_device_defaults(argv: list[str], defaults: DeviceDefaults) -> list[str]:
    extra: list[str] = []
    for flag, value in defaults.flags:
        if not flag_given(argv, flag):
            extra += [flag] if value is None else [flag, value]
    return argv + extra


def model_parallel_flags(argv: list[str]) -> dict[str, int]:
    """The model-parallel sizes given on the command line (SGLang's flag or its alias), by flag."""
    out = {}
    for kind in ("tp", "pp"):
        given = parallel_flag(argv, kind)
        if given is not None:
            try:
                out[given[0]] = int(given[1])
            except ValueError:
                pass  # SGLang's own parser names the bad value
    return out


def expand_config(argv: list[str]) -> list[str]:
    """SGLang's `--config FILE.yaml` written out as flags, ours included, ahead of the command
    line's (which win, as in SGLang's own merge): every check here and every default we add then
    sees what the server will run with (a model path, a port, our options set in the file)."""
    argv = [*itertools.chain.from_iterable(a.split("=", 1) if a.startswith("--config=") else (a,) for a in argv)]
    if "--config" not in argv:
        return argv
    from sglang.srt.server_args import ServerArgs
    from sglang.srt.utils.server_args_config_parser import ConfigArgumentMerger

    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    add_cli_args(parser)
    ServerArgs.add_cli_args(parser)
    try:
        return ConfigArgumentMerger(parser).merge_config_with_args(argv)
    except (ValueError, OSError) as exc:
        raise LaunchError(f"--config: {exc}") from exc


def prepare(argv: list[str]) -> tuple[SuperInferConfig, list[str]]:
    """Parse our options and build the argv for SGLang. Raises LaunchError/ConfigError."""
    ns, rest = our_parser().parse_known_args(expand_config(argv))
    cfg = from_namespace(ns)
    check_rotary_kv_dtype(cfg, flag_value(rest, "--kv-cache-dtype"))
    check_prefix_cache(cfg, flag_value(rest, "--radix-eviction-policy"), flag_given(rest, "--disable-radix-cache"),
                       model_parallel_flags(rest))
    check_prefix_host(cfg)
    check_sglang_version()
    rest = resolve_model(rest)
    defaults = device_defaults(rest)
    rest = apply_device_defaults(rest, defaults)
    if cfg.scheduler == "rotasched" and cfg.mixed_resume and not flag_given(rest, "--enable-mixed-chunk"):
        # A resume re-enters through prefill (a one-token extend); mixed chunks let it share the
        # decode batch's forward instead of costing the running requests a whole iteration.
        rest.append("--enable-mixed-chunk")
    check_port_free(flag_value(rest, "--host") or "127.0.0.1", int(flag_value(rest, "--port") or 30000))
    if defaults.cpu and CPU_COMPAT_ENV not in os.environ:
        os.environ[CPU_COMPAT_ENV] = "1"
    bind = default_threads_bind(rest) if defaults.cpu else None
    if bind is not None:
        os.environ[THREADS_BIND_ENV] = bind
        logger.info("superinfer_sgl: %s=%s (one core group per CPU rank)", THREADS_BIND_ENV, bind)
    os.environ[CONFIG_ENV] = cfg.to_env()
    return cfg, rest


def load_our_plugin() -> None:
    from sglang.srt.plugins import load_plugins

    from .integration import INSTALLED, handshake

    load_plugins()
    if handshake.LAUNCH not in INSTALLED:
        raise LaunchError(
            "the superinfer_sgl SGLang plugin did not load in the launcher (is the package installed "
            "in this venv, and is it allowed by SGLANG_PLUGINS?)"
        )


def serve(rest: list[str]) -> None:
    from sglang.launch_server import run_server
    from sglang.srt.server_args import prepare_server_args
    from sglang.srt.utils import kill_process_tree

    server_args = prepare_server_args(rest)
    watch = ChildWatch()  # a dead scheduler / detokenizer ends the server in seconds (child_watch.py)
    watch.start()
    try:
        run_server(server_args)
    finally:
        watch.stopping.set()
        kill_process_tree(os.getpid(), include_parent=False)
        watch.cleanup()  # SGLang leaves its shared memory and ipc socket files behind


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    sys.path[:] = drop_checkout_from_path(sys.path)
    if "-h" in argv or "--help" in argv:
        print_help()
        return 0
    try:
        cfg, rest = prepare(argv)
        load_our_plugin()
        logger.info("superinfer_sgl: scheduler=%s, sglang args: %s", cfg.scheduler, " ".join(rest))
        serve(rest)
    except (LaunchError, ConfigError) as exc:
        print(f"superinfer_sgl: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # a clear line instead of a traceback wall; details at debug level
        from .integration.handshake import HooksNotLiveError

        if isinstance(exc, HooksNotLiveError):
            print(f"superinfer_sgl: error: refusing to serve: {exc}", file=sys.stderr)
            return 3
        logger.debug("launch failed", exc_info=True)
        print(f"superinfer_sgl: error: server failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
