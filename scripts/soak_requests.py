"""scripts/soak.py's requests: what each kind of request sends, how one is run and classified
(Outcome), and the answer checks (token counts, the greedy exactness sample with its near-tie rule,
constrained output). Split out of soak.py to keep each script under 450 lines."""

from __future__ import annotations

import json
import random
import re
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import requests

WORDS = ("the quick brown fox jumps over a lazy dog while bright stars shine above quiet hills and "
         "rivers run to the sea").split()
CLASSES = ["interactive", "standard", "batch", None]
EXACT_PROMPTS = [
    "List the planets of the solar system in order from the sun:",
    "Once upon a time, in a small village by the mountains,",
    "The quick brown fox jumps over the lazy dog. " * 6 + "Summarise this text.",
    "Write a haiku about the sea.",
]
EXACT_TOKENS = 24
# A greedy sample that differs from its reference is a numerical tie, not lost KV, when at the first
# differing token the reference's best two choices were within this many nats and the sample took the
# second one: float32 matmuls on CPU round differently with the batch's size, and a near-tie can flip
# (stock SGLang's too); corrupted KV moves logits by far more.
TIE_LOGPROB_GAP = 0.01
REGEX = r"(yes|no|maybe)"
SCHEMA = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 12}}, "required": ["answer"]}
# Default share of each request kind (the rest: plain requests); --shares overrides.
SHARES = {"disconnect": 0.10, "timeout": 0.03, "abort": 0.06, "burst": 0.01, "constrained": 0.05,
          "n2": 0.04, "oversize": 0.03}  # `exact` requests come at evenly spaced arrivals (--exact-samples)
BURST_SIZE = 12


# ---- one request -----------------------------------------------------------------------------

@dataclass
class Outcome:
    i: int
    kind: str
    outcome: str = "pending"  # completed | refused | cancelled | errored
    detail: str = ""
    status: int | None = None
    tokens_expected: int | None = None
    tokens_got: int | None = None
    latency_s: float = 0.0
    rid: str | None = None  # the request id the server logs (none for n=2, whose samples get their own)


@dataclass
class Shared:
    """State every client thread reads: the server's URL (changes on a restart) and the SIGTERM
    window, in which connection errors are expected."""
    url: str
    restarting: threading.Event = field(default_factory=threading.Event)
    sigterm_windows: list[tuple[float, float]] = field(default_factory=list)
    exact_reference: dict[str, list[int]] = field(default_factory=dict)
    exact_top2: dict[str, list[list[tuple[float, int]]]] = field(default_factory=dict)  # per token
    exact_results: list[dict] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def in_sigterm_window(self, t0: float, t1: float) -> bool:
        return any(a <= t1 and t0 <= (b or float("inf")) for a, b in self.sigterm_windows)


def _prompt(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


@dataclass(frozen=True)
class Sizes:
    pool_tokens: int  # the device KV pool: an `oversize` prompt is longer
    prompt_words: int  # longest ordinary prompt (~1 token a word)
    new_tokens: int  # most output tokens of an ordinary request (bursts: 4x)


def build_request(i: int, kind: str, rng: random.Random, sz: Sizes) -> tuple[dict, dict[str, str]]:
    """The /generate body and headers of request i of `kind`."""
    params: dict[str, Any] = {"temperature": 0, "max_new_tokens": rng.randint(1, sz.new_tokens), "ignore_eos": True}
    body: dict[str, Any] = {"sampling_params": params}
    if kind == "abort":  # the rid /abort_request names
        body["rid"] = f"soak-{i}-{rng.getrandbits(32):08x}"
    elif kind != "n2" and i >= 0:  # a rid to find the request by in the server's log
        body["rid"] = f"req-{i}-r"  # not a prefix of another: SGLang aborts by rid prefix
    headers: dict[str, str] = {}
    cls = rng.choice(CLASSES)
    how = rng.random()
    if cls is not None:  # the class through one of the conventions (docs/slo.md)
        if how < 0.6:
            params["custom_params"] = {"slo_class": cls}
        elif how < 0.8:
            body["service_tier"] = {"interactive": "priority", "batch": "flex", "standard": "default"}[cls]
        else:
            headers["x-smg-priority"] = {"interactive": "interactive", "batch": "bulk", "standard": "default"}[cls]
    top = sz.prompt_words
    words = int(rng.choice([rng.randint(1, 8), rng.randint(8, max(8, top // 4)), rng.randint(max(8, top // 4), top)]))
    if kind == "oversize":
        words = sz.pool_tokens + rng.randint(16, 400)  # ~1 token a word: over the pool, under the context
    elif kind == "burst":
        words, params["max_new_tokens"] = rng.randint(top // 2, top), rng.randint(2 * sz.new_tokens, 4 * sz.new_tokens)
    elif kind == "constrained":
        params.pop("ignore_eos")  # a finished grammar ends the request
        if rng.random() < 0.5:
            params["regex"] = REGEX
        else:
            params["json_schema"] = json.dumps(SCHEMA)
            params["max_new_tokens"] = 48
    elif kind == "n2":
        params["n"] = 2
    elif kind == "disconnect":
        params["max_new_tokens"] = rng.randint(sz.new_tokens, 4 * sz.new_tokens)
    elif kind == "exact":
        body["text"] = rng.choice(EXACT_PROMPTS)
        params["max_new_tokens"] = EXACT_TOKENS
        return body, headers
    body["text"] = _prompt(rng, words)
    body["stream"] = kind == "disconnect" or (kind in ("plain", "abort") and rng.random() < 0.3)
    return body, headers


def _token_count(out: dict) -> int:
    return len(out.get("output_ids") or [])


def _finish(out: dict) -> str:
    reason = (out.get("meta_info") or {}).get("finish_reason") or {}
    return reason.get("type", "") if isinstance(reason, dict) else str(reason)


def run_request(o: Outcome, body: dict, headers: dict[str, str], shared: Shared, rng: random.Random) -> None:
    t0 = time.time()
    params = body["sampling_params"]
    n = params.get("n", 1)
    o.tokens_expected = params["max_new_tokens"] if params.get("ignore_eos") else None
    url = shared.url
    abort_timer: threading.Timer | None = None
    try:
        if o.kind == "abort":  # the abort races the request: before, during or after its run
            abort_timer = threading.Timer(rng.uniform(0.05, 3.0), lambda: _abort(url, body["rid"]))
            abort_timer.start()
        read_timeout = rng.uniform(0.2, 1.5) if o.kind == "timeout" else 1800
        with requests.post(url + "/generate", json=body, headers=headers, stream=bool(body.get("stream")),
                           timeout=(10, read_timeout)) as r:
            o.status = r.status_code
            if r.status_code != 200:
                text = r.text[:300]
                if o.kind == "oversize" and r.status_code == 400 and "exceeds the maximum allowed length" in text:
                    o.outcome, o.detail = "refused", "oversize prompt: 400"
                elif o.kind == "abort" and "abort" in text.lower():  # SGLang answers a non-stream abort so
                    o.outcome, o.detail = "cancelled", f"aborted by its client (http {r.status_code})"
                elif shared.in_sigterm_window(t0, time.time()):
                    o.outcome, o.detail = "errored", f"server SIGTERM: http {r.status_code}"
                else:
                    o.outcome, o.detail = "errored", f"http {r.status_code}: {text}"
                return
            if body.get("stream"):
                _read_stream(o, r, rng)
            else:
                _check_answer(o, r.json(), n, body, shared)
    except requests.exceptions.ReadTimeout:
        o.outcome, o.detail = ("cancelled", "client read timeout") if o.kind == "timeout" else \
            ("errored", "read timeout")
    except requests.RequestException as exc:
        if shared.in_sigterm_window(t0, time.time()):
            o.outcome, o.detail = "errored", f"server SIGTERM: {type(exc).__name__}"
        else:
            o.outcome, o.detail = "errored", f"{type(exc).__name__}: {str(exc)[:200]}"
    finally:
        if abort_timer is not None:
            abort_timer.cancel()
        o.latency_s = time.time() - t0
        if o.outcome == "pending":
            o.outcome, o.detail = "errored", "no outcome recorded"
        # A request in flight when the server got its SIGTERM may end any way short of a wrong
        # answer: it is an error the SIGTERM explains, not a defect.
        if (o.outcome == "errored" and not o.detail.startswith(("server SIGTERM", "WRONG"))
                and shared.in_sigterm_window(t0, time.time())):
            o.detail = f"server SIGTERM: {o.detail}"


def _abort(url: str, rid: str) -> None:
    try:
        requests.post(url + "/abort_request", json={"rid": rid}, timeout=30)
    except requests.RequestException:
        pass


def _read_stream(o: Outcome, r: requests.Response, rng: random.Random) -> None:
    stop_after = rng.randint(1, 6) if o.kind == "disconnect" else None
    last: dict | None = None
    chunks = 0
    for line in r.iter_lines():
        if not line.startswith(b"data: ") or line == b"data: [DONE]":
            continue
        event = json.loads(line[6:])
        if "error" in event:
            o.outcome, o.detail = "errored", f"stream error: {str(event['error'])[:200]}"
            return
        last, chunks = event, chunks + 1
        if stop_after is not None and chunks >= stop_after and _finish(event) == "":
            o.outcome, o.detail = "cancelled", f"client disconnected after {chunks} chunks"
            return  # leaving the with-block closes the connection: SGLang aborts the request
    if last is None:
        o.outcome, o.detail = "errored", "empty stream"
        return
    _check_one(o, last, o.tokens_expected)


def _check_answer(o: Outcome, out: Any, n: int, body: dict, shared: Shared) -> None:
    outs = out if isinstance(out, list) else [out]
    if len(outs) != n:
        o.outcome, o.detail = "errored", f"{len(outs)} answers for n={n}"
        return
    for one in outs:
        _check_one(o, one, o.tokens_expected)
        if o.outcome != "completed":
            return
    params = body["sampling_params"]
    if o.kind == "constrained":
        _check_constrained(o, outs[0], params)
    if o.kind == "exact" and o.outcome == "completed":
        ref = shared.exact_reference.get(body["text"])
        with shared.lock:
            got = list(outs[0]["output_ids"])
            shared.exact_results.append({"prompt": body["text"][:40], "equal": got == ref, "rid": body.get("rid"),
                                         # ours: rotations / recomputes of this request (a differing sample's why)
                                         "superinfer": (outs[0].get("meta_info") or {}).get("superinfer"),
                                         **({} if got == ref else {"got": got, "reference": ref,
                                            **near_tie(got, ref or [], shared.exact_top2.get(body["text"], []))})})


def near_tie(got: list[int], ref: list[int], top2: list[list[tuple[float, int]]]) -> dict[str, Any]:
    """Where a sample first differs from its reference, and whether that was a near-tie there."""
    i = next((k for k, (a, b) in enumerate(zip(got, ref)) if a != b), min(len(got), len(ref)))
    pair = top2[i] if i < len(top2) else []
    gap = pair[0][0] - pair[1][0] if len(pair) >= 2 else None
    tie = gap is not None and gap <= TIE_LOGPROB_GAP and i < len(got) and got[i] == pair[1][1]
    return {"first_difference": i, "reference_top2_gap": gap, "near_tie": tie}


def _check_one(o: Outcome, out: dict, expected: int | None) -> None:
    reason = _finish(out)
    o.tokens_got = _token_count(out)
    if reason == "abort":
        o.outcome, o.detail = ("cancelled", "aborted by its client") if o.kind == "abort" else \
            ("errored", f"aborted by the server: {str((out.get('meta_info') or {}).get('finish_reason'))[:200]}")
        return
    if expected is not None and o.tokens_got != expected:
        o.outcome, o.detail = "errored", f"WRONG TOKEN COUNT {o.tokens_got} != {expected} ({reason})"
        return
    o.outcome = "completed"
    o.detail = "abort came too late" if o.kind == "abort" else ""


def _check_constrained(o: Outcome, out: dict, params: dict) -> None:
    if _finish(out) != "stop":
        return  # hit max_new_tokens mid-grammar: nothing to check
    text = out.get("text", "")
    if "regex" in params and not re.fullmatch(REGEX, text):
        o.outcome, o.detail = "errored", f"regex violated: {text!r}"
    elif "json_schema" in params:
        try:
            if "answer" not in json.loads(text):
                raise ValueError("no answer key")
        except ValueError as exc:
            o.outcome, o.detail = "errored", f"schema violated: {text[:80]!r} ({exc})"


# ---- the server ------------------------------------------------------------------------------
