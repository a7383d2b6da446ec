"""Schemathesis against a live server's own OpenAPI schema (issue 38), for tests and longer runs.

`trimmed_schema` takes the server's `/openapi.json` and keeps the operations we fuzz, changed in
four ways, each for a stated reason:
- generation is bounded, so a case costs a second on a CPU server, not minutes: the OpenAI
  endpoints' `max_tokens` / `max_completion_tokens` become required and at most MAX_TOKENS (chat's
  default is "until the context ends"), `n` / `best_of` at most 2, `min_tokens` at most
  MAX_TOKENS; `/generate`'s free-form `sampling_params` object becomes required, with a required
  `max_new_tokens` (SGLang's default is 128) beside any other keys.
- `400` is a declared response of every operation: SGLang's exception handlers answer a request
  validation error with 400 where FastAPI's schema declares 422 (http_server.py).
- the 200 response of `/generate` is any JSON (FastAPI declares a string: it cannot see the
  response model of SGLang's ORJSON responses), and the generation endpoints' 200 may also be
  `text/event-stream` (what `stream: true` answers).
- the OpenAI request bodies keep the fields a client of the OpenAI API (plus SGLang's sampling
  extensions and our SLO fields) sends, CHAT_FIELDS / COMPLETION_FIELDS, of SGLang's 76 / 56:
  on the full models hypothesis needed ~17 s per negative chat case on our 2-core machine
  (10 cases in 168 s, the first after 82 s: issue 38's "minutes generating without sending a
  request"), on these well under a second. Most of that time was `response_format` alone (its
  union of JSON-schema and structural-tag formats: 5 negative cases in 26 s). The dropped ones
  (response_format, tools, disaggregation bootstrap, multimodal and routing knobs) are SGLang's
  own, parsed by SGLang's models before our HTTP layer sees the request.

`fuzz` runs hypothesis over each operation with a fixed seed, sends every case, and records
instead of raising, so one run gives the whole tally: cases sent per operation, failures by check
with a reproduction (method, path, body, status, answer). Negative cases (data the schema does not
allow) may break the bounds above; one that would be served at length (a token budget between
MAX_TOKENS and the context length, or none on chat / `/generate`, or more than 2 choices) is not
sent but counted as skipped (`long_generation`): a CPU server generates a few tokens a second, and
one such case took minutes. Out-of-range budgets past the context length are sent (SGLang refuses
them at once).
"""

from __future__ import annotations

import copy
import json
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import requests

MAX_TOKENS = 4
LENIENT_CHECK = "Schema-violating request accepted"  # negative_data_rejection's failure title
CONTEXT = 8192  # the default model's context length: larger budgets are refused at once
COMMON_FIELDS = ["model", "max_tokens", "temperature", "top_p", "top_k", "min_p", "n", "stop", "stream",
                 "stream_options", "seed", "presence_penalty", "frequency_penalty", "repetition_penalty",
                 "logit_bias", "user", "min_tokens", "ignore_eos", "stop_token_ids", "regex",
                 "custom_params", "custom_logit_processor", "priority", "rid"]
CHAT_FIELDS = COMMON_FIELDS + ["messages", "max_completion_tokens", "logprobs", "top_logprobs",
                               "separate_reasoning", "chat_template_kwargs", "continue_final_message"]
COMPLETION_FIELDS = COMMON_FIELDS + ["prompt", "best_of", "echo", "logprobs", "suffix"]
OPERATIONS = [("/generate", "POST"), ("/generate", "PUT"), ("/v1/chat/completions", "POST"),
              ("/v1/completions", "POST"), ("/v1/models", "GET")]


def trimmed_schema(doc: dict[str, Any], operations: list[tuple[str, str]] = OPERATIONS) -> dict[str, Any]:
    out = copy.deepcopy(doc)
    keep = {path for path, _ in operations}
    out["paths"] = {p: ops for p, ops in out["paths"].items() if p in keep}
    for path, ops in out["paths"].items():
        for method in [m for m in ops if (path, m.upper()) not in operations]:
            del ops[method]
        for verb, op in ops.items():
            op.setdefault("responses", {})["400"] = {"description": "Bad request (SGLang's 422)",
                                                      "content": {"application/json": {"schema": {}}}}
            if path == "/generate":
                op["responses"]["200"]["content"]["application/json"]["schema"] = {}
            if verb.upper() in ("POST", "PUT") and "200" in op["responses"]:
                # `stream: true` answers server-sent events (FastAPI cannot see that either)
                op["responses"]["200"].setdefault("content", {})["text/event-stream"] = {"schema": {}}
    schemas = out["components"]["schemas"]
    for name, fields in (("ChatCompletionRequest", CHAT_FIELDS), ("CompletionRequest", COMPLETION_FIELDS)):
        body = schemas[name]
        body["properties"] = props = {k: v for k, v in body["properties"].items() if k in fields}
        for key in ("max_tokens", "max_completion_tokens"):
            if key in props:
                props[key] = {"type": "integer", "minimum": 1, "maximum": MAX_TOKENS}
        for key in ("n", "best_of"):
            if key in props:
                props[key] = {"type": "integer", "minimum": 1, "maximum": 2}
        if "min_tokens" in props:
            props["min_tokens"] = {"type": "integer", "minimum": 0, "maximum": MAX_TOKENS}
        length = "max_completion_tokens" if name == "ChatCompletionRequest" else "max_tokens"
        body["required"] = sorted({*body.get("required", []), length})
        props.pop("max_tokens" if length == "max_completion_tokens" else "max_completion_tokens", None)
    generate = schemas["GenerateReqInput"]
    generate["required"] = sorted({*generate.get("required", []), "sampling_params"})
    gen = generate["properties"]
    gen["sampling_params"] = {"type": "object", "additionalProperties": True, "required": ["max_new_tokens"],
                              "properties": {"max_new_tokens": {"type": "integer", "minimum": 0,
                                                                "maximum": MAX_TOKENS}}}
    return out


@dataclass
class Failure:
    operation: str
    mode: str
    check: str
    status: int | None
    request: str
    answer: str

    def line(self) -> str:
        return f"{self.operation} [{self.mode}] {self.check}: {self.status} <- {self.request[:1500]} -> {self.answer[:300]}"


@dataclass
class Tally:
    cases: Counter = field(default_factory=Counter)  # (operation, mode) -> cases sent
    statuses: Counter = field(default_factory=Counter)  # status code -> responses
    failures: list[Failure] = field(default_factory=list)
    skipped: Counter = field(default_factory=Counter)  # (operation, mode) -> long generations not sent
    unfinished: list[str] = field(default_factory=list)  # "operation [mode]" cut short by the time budget
    not_applicable: list[str] = field(default_factory=list)  # "operation [mode]" with no case to generate
    seconds: float = 0.0

    def server_errors(self) -> list[Failure]:
        return [f for f in self.failures if f.status is None or f.status >= 500]

    def summary(self) -> str:
        lines = [f"{sum(self.cases.values())} cases sent in {self.seconds:.0f} s, {sum(self.skipped.values())} "
                 f"long generations skipped; statuses {dict(sorted(self.statuses.items()))}"]
        lines += [f"  {op} [{mode}]: {n} sent, {self.skipped[(op, mode)]} skipped"
                  for (op, mode), n in sorted(self.cases.items())]
        if self.not_applicable:
            lines.append(f"no case to generate: {self.not_applicable}")
        if self.unfinished:
            lines.append(f"cut short by the time budget: {self.unfinished}")
        checks = Counter(f.check for f in self.failures)
        lines.append(f"failures by check: {dict(checks)}")
        seen: set[tuple[str, str, int | None]] = set()
        for f in self.failures:  # one reproduction per operation, check and status
            if (f.operation, f.check, f.status) not in seen:
                seen.add((f.operation, f.check, f.status))
                lines.append("  " + f.line())
        return "\n".join(lines)


def _check_names(exc: BaseException) -> list[str]:
    inner = getattr(exc, "exceptions", None) or [exc]
    names = []
    for e in inner:
        title = getattr(e, "title", None) or type(e).__name__
        names.append(str(title))
    return names


def fuzz(base_url: str, doc: dict[str, Any], *, examples: int, seed: int, modes: tuple[str, ...],
         checks: list[Any], operations: list[tuple[str, str]] = OPERATIONS, timeout: float = 60,
         budget_s: float | None = None, log: Any = None) -> Tally:
    """Send `examples` generated cases per operation and mode; record every failed check."""
    import schemathesis
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis.errors import Unsatisfiable
    from hypothesis import seed as hseed
    from schemathesis import GenerationMode

    schema = schemathesis.openapi.from_dict(trimmed_schema(doc, operations))
    tally = Tally()
    session = requests.Session()
    start = time.monotonic()

    def out_of_time() -> bool:
        return budget_s is not None and time.monotonic() - start > budget_s
    for path, method in operations:
        op = schema[path][method]
        name = f"{method} {path}"
        for mode in modes:
            if out_of_time():
                tally.unfinished.append(f"{name} [{mode}]")
                continue
            strategy = op.as_strategy(generation_mode=GenerationMode(mode))

            @settings(max_examples=examples, deadline=None, database=None, derandomize=False,
                      phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
            @hseed(seed)
            @given(strategy)
            def run(case: Any) -> None:
                if out_of_time():
                    raise _OutOfTime
                if long_generation(path, getattr(case, "body", None)):
                    tally.skipped[(name, mode)] += 1
                    return
                tally.cases[(name, mode)] += 1
                try:
                    response = case.call(base_url=base_url, session=session, timeout=timeout)
                except requests.RequestException as exc:  # no answer at all: as bad as a 5xx
                    tally.failures.append(Failure(name, mode, "no_response", None, _describe(case), repr(exc)))
                    return
                tally.statuses[response.status_code] += 1
                if log is not None:
                    print(f"{time.monotonic() - start:7.1f} {name} [{mode}] {response.status_code} "
                          f"{_describe(case)[:150]}", file=log, flush=True)
                try:
                    case.validate_response(response, checks=checks)
                except BaseException as exc:  # a FailureGroup of the checks that failed
                    if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                        raise
                    for check in _check_names(exc):
                        tally.failures.append(Failure(name, mode, check, response.status_code, _describe(case),
                                                      response.text))

            try:
                run()
            except _OutOfTime:
                tally.unfinished.append(f"{name} [{mode}]")
            except Unsatisfiable:  # nothing to negate: GET /v1/models has no parameters
                tally.not_applicable.append(f"{name} [{mode}]")
    tally.seconds = time.monotonic() - start
    return tally


class _OutOfTime(Exception):
    """The fuzz run's time budget is spent."""


def _long_budget(value: object, missing_is_long: bool) -> bool:
    if value is None:
        return missing_is_long
    return isinstance(value, int) and not isinstance(value, bool) and MAX_TOKENS < value <= CONTEXT


def _many(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 2


def long_generation(path: str, body: object) -> bool:
    """Whether SGLang would serve this body at length (module doc): not sent."""
    if not isinstance(body, dict):
        return False
    if path == "/generate":
        params = body.get("sampling_params")
        for p in params if isinstance(params, list) else [params]:
            if p is None:
                return True  # SGLang's default budget: 128 tokens
            if isinstance(p, dict) and (_long_budget(p.get("max_new_tokens"), True) or _many(p.get("n"))):
                return True
        return False
    chat = path == "/v1/chat/completions"
    budget = body.get("max_completion_tokens", body.get("max_tokens")) if chat else body.get("max_tokens")
    return _long_budget(budget, chat) or _many(body.get("n")) or _many(body.get("best_of"))


def _describe(case: Any) -> str:
    body = getattr(case, "body", None)
    try:
        text = json.dumps(body)
    except (TypeError, ValueError):
        text = repr(body)
    extra = {k: v for k, v in (("query", case.query), ("headers", case.headers)) if v}
    return text + (f" {extra}" if extra else "")
