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
    for i, a in enumerate(argv):
        if a == flag and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith(flag + "="):
            return a.split("=", 1)[1]
    return None


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
    """A local folder must hold a config.json; a hub id must be resolvable (cache or hub)."""
    expanded = os.path.expanduser(path)
    if os.path.isdir(expanded):
        if not os.path.isfile(os.path.join(expanded, "config.json")):
            raise LaunchError(f"model path {path} is a folder without config.json (not a Hugging Face model)")
        return
    if os.path.exists(expanded) or path.startswith((".", "/", "~")) or path.count("/") > 1:
        raise LaunchError(f"model path {path} does not exist")
    if not _hub_model_known(path):
        raise LaunchError(f"unknown model path {path}: not a local folder, not in the Hugging Face cache, "
                          "and not reachable on the hub")


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
