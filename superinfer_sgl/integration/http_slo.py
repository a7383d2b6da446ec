"""The ecosystem's SLO conventions at the HTTP layer: folded into a request's custom_params.

Every generation request of the HTTP server (`/generate`, the OpenAI endpoints, `/v1/responses`,
Ollama) reaches `TokenizerManager.generate_request(obj, request)` in the main process with the
FastAPI request beside it: its headers, and the JSON body FastAPI already parsed (SGLang's OpenAI
models drop fields they do not declare, e.g. `service_tier`). Wrapping that one method, we fold
the conventions into `custom_params` (rotasched.slo_conventions: precedence, mappings), before
SGLang normalizes the request and validates its sampling params (where our `SamplingParams.verify`
hook checks the result). The folded keys then travel with the request to the scheduler, whose
RotaSched runtime reads them like keys the client sent itself. A bad value raises ValueError,
which SGLang turns into HTTP 400 (a streaming request gets it as the stream's error event, like
SGLang's own validation errors).

The same wrapper stamps when the server received the request (`RECEIVED_KEY`, wall-clock seconds,
replacing anything a client sent under that key): the scheduler sees a request only after it was
parsed, templated, tokenized and sent over, and only between two iterations, 50-300 ms later on
our CPU server. A TTFT clock started there gave the policy that much slack the client never had.

It also marks the requests no client sent (`UNMETERED_KEY`, replacing anything a client sent
under it), which our SLO counters must not count (integration.metrics.metered): SGLang's health
probes (`GET /health`, `/health_generate`: a one-token request whose rid starts with
HEALTH_CHECK) and its startup warm-up (a plain `/generate` the server posts to itself while the
tokenizer manager's status is still Starting; an HTTP request arriving in that window, before the
server says it is ready, is taken for warm-up too). Calls of the Engine API (no HTTP request)
are never marked: their tokenizer manager stays Starting for good.
"""

from __future__ import annotations

import contextlib
import math
import time
from typing import Any, AsyncIterator, Callable, Mapping

from ..config import SuperInferConfig, slo_conventions
from ..rotasched.slo_conventions import HEADERS, SERVICE_TIER_FIELD, SloConventions, fold_conventions
from ..rotasched.slo import SloError


def around_generate(cfg: SuperInferConfig) -> Callable[..., AsyncIterator[Any]]:
    """AROUND hook of TokenizerManager.generate_request (an async generator method)."""
    from sglang.srt.managers.io_struct import GenerateReqInput

    conv = slo_conventions(cfg)

    async def generate(original: Callable[..., AsyncIterator[Any]], self: Any, obj: Any,
                       *args: Any, **kwargs: Any) -> AsyncIterator[Any]:
        if isinstance(obj, GenerateReqInput):  # embedding requests have no SLO
            request = args[0] if args else kwargs.get("request")
            stamp_received(obj, received_unix(getattr(obj, "received_time", None)),
                           unmetered=unmetered_reason(self, obj, request),
                           preferred=getattr(self, "preferred_sampling_params", None))
            await fold_request(conv, obj, request)
        async with contextlib.aclosing(original(self, obj, *args, **kwargs)) as responses:
            async for response in responses:
                yield response

    return generate


async def fold_request(conv: SloConventions, obj: Any, request: Any) -> None:
    """Fold the conventions a generation request carries into `obj`'s sampling params (`obj`:
    a GenerateReqInput; `request`: its FastAPI request, or None when the Engine API calls)."""
    headers = _headers(request)
    tier = await _body_field(request, SERVICE_TIER_FIELD) if _openai_or_native(request) else None
    priority = obj.priority if conv.maps_priority else None
    if not headers and tier is None and priority is None:
        return

    def fold(params: Any) -> Any:
        if params is not None and not isinstance(params, dict):
            return params  # SGLang rejects it itself
        custom = (params or {}).get("custom_params")
        folded = fold_conventions(conv, custom, headers=headers, service_tier=tier, priority=priority)
        return params if folded is custom else {**(params or {}), "custom_params": folded}

    try:
        if isinstance(obj.sampling_params, list):  # a batch: one dict per request
            obj.sampling_params = [fold(p) for p in obj.sampling_params]
        else:
            obj.sampling_params = fold(obj.sampling_params)
    except SloError as exc:
        raise ValueError(str(exc)) from None


RECEIVED_KEY = "superinfer_received_unix"
UNMETERED_KEY = "superinfer_unmetered"
HEALTH_CHECK = "health_check"
WARMUP = "warmup"


def unmetered_reason(manager: Any, obj: Any, request: Any) -> str | None:
    """HEALTH_CHECK or WARMUP for the requests SGLang sends itself (module doc), else None."""
    from sglang.srt.constants import HEALTH_CHECK_RID_PREFIX

    rid = getattr(obj, "rid", None)
    if isinstance(rid, str) and rid.startswith(HEALTH_CHECK_RID_PREFIX):
        return HEALTH_CHECK
    status = getattr(getattr(manager, "server_status", None), "value", None)
    if request is not None and status == "Starting":
        return WARMUP
    return None


def received_unix(received_perf: float | None) -> float:
    """Wall-clock time the server received a request: SGLang's OpenAI layer notes it
    (`received_time`, perf_counter of this process) before templating and tokenizing; the
    native API does not, and then it is now."""
    now = time.time()
    if received_perf is None or not math.isfinite(received_perf):
        return now
    return now - max(0.0, time.perf_counter() - received_perf)


def stamp_received(obj: Any, when_unix: float, unmetered: str | None = None,
                   preferred: Mapping[str, Any] | None = None) -> None:
    """Put `when_unix` into every sampling-params dict of `obj` under custom_params[RECEIVED_KEY]
    (the scheduler's RotaSched clock starts there), and `unmetered` under UNMETERED_KEY (None:
    the key is removed). Values SGLang will reject anyway (params or custom_params that are not
    objects) are left for its validation to name. `preferred`: the server's
    `--preferred-sampling-params`, which SGLang merges under the request's own, key by key: a
    request that sends no `custom_params` starts from the preferred ones (the stamp would
    otherwise replace them)."""
    fallback = preferred.get("custom_params") if isinstance(preferred, Mapping) else None

    def stamp(params: Any) -> Any:
        if params is not None and not isinstance(params, dict):
            return params
        params = params or {}
        custom = params["custom_params"] if "custom_params" in params else fallback
        if custom is not None and not isinstance(custom, dict):
            return params
        custom = {**(custom or {}), RECEIVED_KEY: when_unix}
        if unmetered is None:
            custom.pop(UNMETERED_KEY, None)
        else:
            custom[UNMETERED_KEY] = unmetered
        return {**params, "custom_params": custom}

    if isinstance(obj.sampling_params, list):
        obj.sampling_params = [stamp(p) for p in obj.sampling_params]
    else:
        obj.sampling_params = stamp(obj.sampling_params)


# Where `service_tier` is OpenAI's (and the native API's, which follows it); Anthropic's Messages
# API has a `service_tier` of its own ("auto", "standard_only") that SGLang ignores, as we do.
TIER_PATHS = ("/generate", "/v1/chat/completions", "/v1/completions", "/v1/responses")


def _openai_or_native(request: Any) -> bool:
    path = getattr(getattr(request, "url", None), "path", None)
    return isinstance(path, str) and path.rstrip("/").endswith(TIER_PATHS)


def _headers(request: Any) -> dict[str, str]:
    """Our SLO headers present on the request (repeated ones joined with ", ", as HTTP reads them)."""
    raw: Mapping[str, str] | None = getattr(request, "headers", None)
    if raw is None:
        return {}
    out: dict[str, str] = {}
    for name in HEADERS:
        values = raw.getlist(name) if hasattr(raw, "getlist") else [v for v in [raw.get(name)] if v is not None]
        if values:
            out[name] = ", ".join(values)
    return out


async def _body_field(request: Any, name: str) -> object:
    """A top-level field of the request's JSON body (None: absent or no JSON body). FastAPI has
    already read and parsed the body, so this reads Starlette's cached copy."""
    if request is None or getattr(request, "method", None) not in ("POST", "PUT"):
        return None
    ctype = request.headers.get("content-type")
    if ctype and "json" not in ctype.lower():
        return None
    try:
        if f'"{name}"'.encode() not in await request.body():  # the common case: no parse at all
            return None
        body = await request.json()
    except Exception:  # not JSON after all: FastAPI would have refused it already
        return None
    return body.get(name) if isinstance(body, dict) else None


MAX_INTAKE_S = 600.0  # a longer intake delay is a clock step, not a queue: it is capped here


def intake_delay_s(custom_params: Any, now_unix: float) -> float:
    """Seconds since the HTTP layer received the request (http_slo.stamp_received), which the
    request's TTFT clock is backdated by: what its client is already waiting. 0 without a stamp
    (a scheduler fed by something else) and never negative (clocks of different processes)."""
    stamped = custom_params.get(RECEIVED_KEY) if isinstance(custom_params, dict) else None
    if isinstance(stamped, bool) or not isinstance(stamped, (int, float)) or not math.isfinite(stamped):
        return 0.0
    return min(MAX_INTAKE_S, max(0.0, now_unix - float(stamped)))
