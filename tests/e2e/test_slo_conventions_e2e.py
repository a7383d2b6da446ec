"""The ecosystem's SLO conventions end to end: OpenAI service_tier, SGLang priority, the
x-smg-priority gateway header and the x-slo-*-ms headers each set the SLO the server reports;
precedence when combined; a bad value is a 400 naming it, and the server keeps serving."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

import openai
import pytest
import requests

from serverutil import Server, generate, start_server

pytestmark = pytest.mark.e2e

PRIORITY_CLASSES = {"0": "standard", "10": "interactive"}
ARGS = ["--max-total-tokens", "4096", "--enable-metrics", "--log-level", "info",
        "--slo-priority-classes", json.dumps(PRIORITY_CLASSES),
        "--slo-service-tiers", json.dumps({"scale": "interactive"})]

INTERACTIVE, STANDARD, BATCH = ("interactive", 1000.0, 50.0), ("standard", 5000.0, 100.0), ("batch", 30000.0, 500.0)
SERVER_DEFAULT = (None, 5000.0, 100.0)


@pytest.fixture(scope="module")
def server(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """Our server with SGLang's priority mapped to classes and one operator service tier."""
    srv = start_server(ARGS, tmp_path_factory.mktemp("logs") / "slo_conventions.log")
    try:
        yield srv
    finally:
        left = srv.stop()
        assert not left, f"processes left after shutdown: {left}"


def _post(server: Server, headers: dict[str, str], body: dict, custom: dict | None = None) -> requests.Response:
    sampling = {"max_new_tokens": 2, "temperature": 0, "ignore_eos": True}
    if custom is not None:
        sampling["custom_params"] = custom
    return requests.post(server.url + "/generate", headers=headers, timeout=120,
                         json={"text": "Count to three:", "sampling_params": sampling, **body})


def _reported(resp: requests.Response) -> tuple[str | None, float, float]:
    assert resp.status_code == 200, resp.text
    meta = resp.json()["meta_info"]["superinfer"]
    return meta["superinfer_slo_class"], meta["superinfer_ttft_slo_ms"], meta["superinfer_tbt_slo_ms"]


@pytest.mark.parametrize("headers, body, custom, expected", [
    ({}, {}, None, SERVER_DEFAULT),
    # one convention at a time
    ({}, {"service_tier": "flex"}, None, BATCH),
    ({}, {"service_tier": "priority"}, None, INTERACTIVE),
    ({}, {"service_tier": "scale"}, None, INTERACTIVE),  # the operator's --slo-service-tiers entry
    ({"x-smg-priority": "bulk"}, {}, None, BATCH),
    ({"x-slo-ttft-ms": "1234", "x-slo-tpot-ms": "77"}, {}, None, (None, 1234.0, 77.0)),
    ({}, {"priority": 10}, None, INTERACTIVE),
    ({}, {"priority": 3}, None, STANDARD),
    ({}, {"priority": -5}, None, SERVER_DEFAULT),  # below every --slo-priority-classes threshold
    # precedence
    ({"x-smg-priority": "interactive", "x-slo-ttft-ms": "2222"},
     {"service_tier": "priority", "priority": 10}, {"slo_class": "batch"}, ("batch", 2222.0, 500.0)),
    ({"x-smg-priority": "bulk"}, {"service_tier": "priority", "priority": 10}, None, BATCH),
    ({}, {"service_tier": "flex", "priority": 10}, None, BATCH),
    ({}, {"service_tier": "default", "priority": 10}, None, INTERACTIVE),  # `default` defers
    ({"x-slo-ttft-ms": "2222"}, {}, {"ttft_slo_ms": 999}, (None, 999.0, 100.0)),
], ids=["none", "tier-flex", "tier-priority", "tier-scale", "smg-bulk", "slo-headers", "priority-10",
        "priority-3", "priority-neg", "all", "smg>tier>priority", "tier>priority", "default-defers",
        "custom>header"])
def test_conventions_set_the_reported_slo(server: Server, headers: dict, body: dict, custom: dict | None,
                                          expected: tuple) -> None:
    assert _reported(_post(server, headers, body, custom)) == expected


@pytest.mark.parametrize("headers, body, field", [
    ({}, {"service_tier": "ultra"}, "service_tier"),
    ({"x-slo-ttft-ms": "-5"}, {}, "x-slo-ttft-ms"),
    ({"x-slo-ttft-ms": "soon"}, {}, "x-slo-ttft-ms"),
    ({"x-slo-tpot-ms": "nan"}, {}, "x-slo-tpot-ms"),
    ({"x-slo-tpot-ms": "inf"}, {}, "x-slo-tpot-ms"),
    ({"x-smg-priority": "urgent"}, {}, "x-smg-priority"),
])
def test_bad_values_are_400_naming_them(server: Server, headers: dict, body: dict, field: str) -> None:
    r = _post(server, headers, body, {"slo_class": "batch"})  # validated even where it would lose
    assert r.status_code == 400, r.text
    assert field in r.text
    ok = generate(server, "Still serving?", max_new_tokens=2)
    assert len(ok["output_ids"]) == 2


def _finished(server: Server, slo_class: str) -> float:
    """Requests of `slo_class` whose TTFT outcome the server counted (met or missed)."""
    return sum(v for k, v in server.metrics("superinfer_slo_requests").items()
               if f'slo_class="{slo_class}"' in k and 'slo="ttft"' in k)


def test_openai_chat_service_tier_priority_and_headers(server: Server) -> None:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")

    def chat(**kw: object) -> None:
        out = client.chat.completions.create(model="default", max_tokens=4, temperature=0,
                                             messages=[{"role": "user", "content": "Hi"}], **kw)
        assert out.choices[0].message.content is not None

    for kw, cls in (({"service_tier": "flex"}, "batch"), ({"extra_body": {"priority": 10}}, "interactive"),
                    ({"extra_headers": {"x-smg-priority": "bulk"}}, "batch")):
        before = _finished(server, cls)
        chat(**kw)
        assert _finished(server, cls) == before + 1, kw
    with pytest.raises(openai.BadRequestError, match="service_tier"):
        client.completions.create(model="default", prompt="x", max_tokens=2,
                                  extra_body={"service_tier": "ultra"})
    with pytest.raises(openai.BadRequestError, match="x-slo-ttft-ms"):
        chat(extra_headers={"x-slo-ttft-ms": "-1"})
    chat(service_tier="auto")  # still serving
