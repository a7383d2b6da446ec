"""Checks that turn common launch mistakes into one clear line instead of a traceback wall."""

from __future__ import annotations

import errno
import os
import socket


class LaunchError(RuntimeError):
    """The server cannot start as asked; the message says why in one line."""


def flag_given(argv: list[str], flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in argv)


def flag_value(argv: list[str], flag: str) -> str | None:
    """The value `flag` takes in `argv`: its last occurrence, as argparse reads a repeated flag."""
    found = None
    for i, a in enumerate(argv):
        if a == flag and i + 1 < len(argv):
            found = argv[i + 1]
        elif a.startswith(flag + "="):
            found = a.split("=", 1)[1]
    return found


# SGLang's parallel sizes and their long aliases (sglang/srt/arg_groups/fields/parallel.py)
PARALLEL_FLAGS = {"dp": ("--dp-size", "--data-parallel-size"), "tp": ("--tp-size", "--tensor-parallel-size"),
                  "pp": ("--pp-size", "--pipeline-parallel-size")}


def parallel_flag(argv: list[str], kind: str) -> tuple[str, str] | None:
    """(flag, value) of the `kind` ("dp", "tp", "pp") parallel size given in `argv`, by either of
    SGLang's spellings (the last one given wins, as in argparse); None when neither is given."""
    last = None
    for i, a in enumerate(argv):
        for flag in PARALLEL_FLAGS[kind]:
            if a == flag and i + 1 < len(argv):
                last = (flag, argv[i + 1])
            elif a.startswith(flag + "="):
                last = (flag, a.split("=", 1)[1])
    return last


def parallel_size(argv: list[str], kind: str) -> int:
    """The `kind` parallel size `argv` asks for (1 when not given or not a number: SGLang names that)."""
    given = parallel_flag(argv, kind)
    try:
        return int(given[1]) if given else 1
    except ValueError:
        return 1


def check_port_free(host: str, port: int) -> None:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as s:
        # Like the HTTP server itself: connections lingering in TIME_WAIT do not block a restart.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise LaunchError(f"port {port} on {host} is already in use (pick another with --port)") from exc
            raise LaunchError(f"cannot bind {host}:{port}: {exc.strerror}") from exc


def check_model_path(path: str) -> None:
    """A local folder must hold a config.json and a local file must be a GGUF checkpoint; a hub id
    (owner/repo, or the GGUF references owner/repo/file.gguf and owner/repo:QUANT) must be
    resolvable (cache or hub); a remote URL (connector://...) is SGLang's loaders' to reach."""
    if "://" in path:
        return
    expanded = os.path.expanduser(path)
    if os.path.isdir(expanded):
        if not os.path.isfile(os.path.join(expanded, "config.json")):
            raise LaunchError(f"model path {path} is a folder without config.json (not a Hugging Face model)")
        return
    if os.path.isfile(expanded):
        if not _is_gguf(expanded):
            raise LaunchError(f"model path {path} is a file, neither a model folder nor a GGUF checkpoint")
        return
    repo = "/".join(path.split(":", 1)[0].split("/")[:2])  # the repository a GGUF reference names
    if path.startswith((".", "/", "~")) or (path.count("/") > 1 and not path.endswith(".gguf")):
        raise LaunchError(f"model path {path} does not exist")
    if not _hub_model_known(repo):
        raise LaunchError(f"unknown model path {path}: not a local folder, not in the Hugging Face cache, "
                          "and not reachable on the hub")


def _is_gguf(path: str) -> bool:
    """SGLang's own test: the suffix, or the file's magic."""
    if path.endswith(".gguf"):
        return True
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF"


def _hub_model_known(repo_id: str) -> bool:
    try:
        from huggingface_hub import snapshot_download

        snapshot_download(repo_id, local_files_only=True, allow_patterns=["config.json"])
        return True
    except Exception:
        pass
    if os.environ.get("HF_HUB_OFFLINE") == "1":
        return False
    try:
        from huggingface_hub import HfApi

        HfApi().model_info(repo_id, timeout=5)
        return True
    except Exception:
        return False
