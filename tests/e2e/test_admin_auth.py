"""Admin endpoints under SGLang's --api-key / --admin-api-key, through our launcher (issue 38).

With both keys set, no route of the server answers without a key (health, readiness and metrics
excepted, by SGLang's design, for probes and scrapers), and every endpoint SGLang marks as an
admin endpoint (cache flush, weight updates, memory release, profiling, ...) refuses the plain API
key too. The routes are read from SGLang's own app, so an endpoint added later is covered; the
state-changing endpoints the issue names must be among the admin ones."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Iterator

import pytest
import requests

from serverutil import Server, start_server

pytestmark = pytest.mark.e2e

API_KEY, ADMIN_KEY = "sk-issue38-user", "sk-issue38-admin"
OPEN_PREFIXES = ("/health", "/ready", "/metrics")  # always open (SGLang: k8s probes, Prometheus)
MUST_BE_ADMIN = ["/flush_cache", "/update_weights_from_disk", "/release_memory_occupation",
                 "/resume_memory_occupation", "/start_profile", "/stop_profile"]


@pytest.fixture(scope="module")
def server(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    srv = start_server(["--max-total-tokens", "1024", "--api-key", API_KEY, "--admin-api-key", ADMIN_KEY],
                       tmp_path_factory.mktemp("logs") / "admin_auth.log")
    try:
        yield srv
    finally:
        assert not srv.stop(), "processes left after shutdown"


def _routes() -> list[tuple[str, str, str]]:
    """(method, path, auth level) of every route of SGLang's HTTP app."""
    from fastapi.routing import APIRoute
    from sglang.srt.entrypoints.http_server import app

    out = []
    for route in app.routes:
        if not isinstance(route, APIRoute):
            continue
        level = getattr(getattr(route, "endpoint", None), "_auth_level", None)
        path = re.sub(r"\{[^}]+\}", "x", route.path)
        for method in sorted(route.methods or []):
            out.append((method, path, getattr(level, "value", "normal")))
    return out


def _call(server: Server, method: str, path: str, key: str | None) -> requests.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    body = None if method in ("GET", "HEAD", "DELETE") else {}
    return requests.request(method, server.url + path, json=body, headers=headers, timeout=60)


def test_the_named_state_changing_endpoints_are_admin_endpoints() -> None:
    levels = {path: level for _, path, level in _routes()}
    assert all(levels.get(p, "missing").startswith("admin") for p in MUST_BE_ADMIN), \
        {p: levels.get(p, "missing") for p in MUST_BE_ADMIN}


def test_nothing_answers_without_a_key(server: Server) -> None:
    answered = []
    for method, path, _ in _routes():
        if path.startswith(OPEN_PREFIXES) or method == "HEAD":
            continue
        r = _call(server, method, path, None)
        if r.status_code not in (401, 403):
            answered.append((method, path, r.status_code))
    assert not answered, answered
    assert requests.get(server.url + "/health", timeout=60).status_code == 200


def test_admin_endpoints_refuse_the_plain_api_key(server: Server) -> None:
    admin = [(m, p) for m, p, level in _routes() if level.startswith("admin")]
    assert len(admin) >= len(MUST_BE_ADMIN)
    answered = [(m, p, r.status_code) for m, p in admin
                if (r := _call(server, m, p, API_KEY)).status_code not in (401, 403)]
    assert not answered, answered


def test_the_keys_unlock_what_they_should(server: Server) -> None:
    r = requests.post(server.url + "/generate", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60,
                      json={"text": "hi", "sampling_params": {"max_new_tokens": 2}})
    assert r.status_code == 200, r.text
    assert _call(server, "POST", "/flush_cache", ADMIN_KEY).status_code == 200
    assert _call(server, "POST", "/generate", ADMIN_KEY).status_code == 401  # the admin key is not a user key


@pytest.mark.parametrize("api_key, admin_key", [(None, None), (API_KEY, None), (None, ADMIN_KEY),
                                                (API_KEY, ADMIN_KEY)])
def test_admin_endpoints_under_each_key_configuration(api_key: str | None, admin_key: str | None) -> None:
    """Without a server: SGLang's own decision (`decide_request_auth`, which its middleware calls) for
    every admin route, under each of the four key configurations (docs/reliability.md's table). Pins
    what SGLang 0.5.23 does; an upgrade that changes it fails here."""
    from sglang.srt.utils.auth import AuthLevel, decide_request_auth

    def allowed(method: str, path: str, level: str, key: str | None) -> bool:
        return decide_request_auth(method=method, path=path, authorization_header=f"Bearer {key}" if key else None,
                                   api_key=api_key, admin_api_key=admin_key, auth_level=AuthLevel(level)).allowed

    admin = [(m, p, level) for m, p, level in _routes() if level.startswith("admin") and m != "HEAD"]
    assert {p for _, p, _ in admin} >= set(MUST_BE_ADMIN)
    for method, path, level in admin:
        anyone, user, owner = (allowed(method, path, level, k) for k in (None, API_KEY, ADMIN_KEY))
        if level == "admin_force":  # only the admin key, and only when one is set
            assert (anyone, user, owner) == (False, False, admin_key is not None), (path, level)
        elif admin_key:  # admin_optional with an admin key: that key only
            assert (anyone, user, owner) == (False, False, True), (path, level)
        elif api_key:  # admin_optional, only --api-key: the user key opens it
            assert (anyone, user, owner) == (False, True, False), (path, level)
        else:  # no key at all: open to anyone who reaches the port
            assert (anyone, user, owner) == (True, True, True), (path, level)
