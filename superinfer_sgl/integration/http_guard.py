"""OpenAI request limits that SGLang 0.5.23 does not enforce, refused with a 400 (issue 38).

OpenAI's API caps the alternatives a client may ask for per token: chat `top_logprobs` is 0..20,
completions `logprobs` is 0..5. SGLang accepts any integer, and a large one makes every step of
the request compute and ship that many alternatives per token (a client asking for 10**6 gets a
vocabulary-sized answer per token). Refused here, in the OpenAI layer's own `_validate_request`
(AFTER hooks: its error message is SGLang's 400 ErrorResponse). SGLang's extension
`return_flat_raw_output_top_logprobs` (raw top-k for distillation, meta_info only) is left alone:
its k is not OpenAI's.

A chat request's `max_completion_tokens: 0` (or `max_tokens: 0`) reads as "not set" in SGLang
(`max_completion_tokens or max_tokens`): the client asked for no tokens and was served up to the
context length (found by schemathesis: a 30 s read timeout on a CPU server). Refused with a 400
here too (`/v1/completions` passes 0 through as a zero budget, which SGLang serves).

`n: 0` (or a negative `n`) on `/v1/completions` asks for no choices; SGLang expands the prompt into
zero copies and then indexes the first: IndexError, HTTP 500 (found by schemathesis, seed 2026, 600
examples: `{"prompt": ["a", "b"], "max_tokens": 1, "n": 0}`). OpenAI's `n` is at least 1, on chat
as on completions: refused with a 400 on both.

A JSON body that is not an object (an array, a string, a number, null) sent to an OpenAI endpoint
reached pydantic model validators of SGLang's that call `values.get(...)` on it (e.g.
ChatCompletionRequest.set_json_schema): AttributeError, HTTP 500. Every OpenAI request body is an
object, so under `/v1/` any other JSON value is refused as a 400 where SGLang parses the body
(`ORJSONRequest.json`, which FastAPI calls for every JSON body of SGLang's routes), before any
model sees it. The native endpoints (`/generate`, ...) refuse such bodies themselves.

`/generate`'s request model leaves `input_ids`, `input_embeds` and `sampling_params` loosely typed,
and `GenerateReqInput.normalize_batch_and_arguments` indexes into them unchecked: `input_embeds:
[]` is an IndexError there, `sampling_params: []` another, `input_ids: 5` a TypeError, each an
HTTP 500 (found by schemathesis). Normalizing is pure input handling in the HTTP process, before
anything reaches the scheduler, so any such exception from it is the request's fault: an AROUND
hook turns IndexError, KeyError, TypeError and AttributeError there into the ValueError SGLang
answers with 400 (a streaming request gets it as its error event), naming the exception. The
same hook checks the normalized request ids (`check_rids`).
"""

from __future__ import annotations

from typing import Any, Callable

MAX_CHAT_TOP_LOGPROBS = 20
MAX_COMPLETION_LOGPROBS = 5

NORMALIZE = "sglang.srt.managers.io_struct.GenerateReqInput.normalize_batch_and_arguments"
BODY = "sglang.srt.entrypoints.http_server.ORJSONRequest.json"
OBJECT_BODY_PREFIX = "/v1/"
CHAT = "sglang.srt.entrypoints.openai.serving_chat.OpenAIServingChat._validate_request"
COMPLETION = "sglang.srt.entrypoints.openai.serving_completions.OpenAIServingCompletion._validate_request"


def _out_of_range(value: object, high: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and not 0 <= value <= high


def chat_logprobs_error(request: Any) -> str | None:
    """The 400 message for a chat request whose top_logprobs is outside OpenAI's 0..20."""
    if getattr(request, "return_flat_raw_output_top_logprobs", False):
        return None
    value = getattr(request, "top_logprobs", None)
    if _out_of_range(value, MAX_CHAT_TOP_LOGPROBS):
        return f"top_logprobs must be between 0 and {MAX_CHAT_TOP_LOGPROBS} (OpenAI's limit), got {value}"
    return None


def chat_budget_error(request: Any) -> str | None:
    """The 400 message for a chat request whose token budget is 0, which SGLang would read as
    unlimited (module doc)."""
    for field in ("max_completion_tokens", "max_tokens"):
        value = getattr(request, field, None)
        if value == 0 and not isinstance(value, bool):
            return f"{field} must be at least 1, got 0 (SGLang would read 0 as no limit)"
        if value is not None:
            return None  # max_completion_tokens wins over max_tokens, as in SGLang
    return None


def choices_error(request: Any) -> str | None:
    """The 400 message for an OpenAI request asking for fewer than one choice (module doc)."""
    value = getattr(request, "n", None)
    if isinstance(value, int) and not isinstance(value, bool) and value < 1:
        return f"n must be at least 1, got {value}"
    return None


def completion_logprobs_error(request: Any) -> str | None:
    """The 400 message for a completion request whose logprobs is outside OpenAI's 0..5."""
    value = getattr(request, "logprobs", None)
    if _out_of_range(value, MAX_COMPLETION_LOGPROBS):
        return f"logprobs must be between 0 and {MAX_COMPLETION_LOGPROBS} (OpenAI's limit), got {value}"
    return None


def body_shape_error(path: str, body: object) -> str | None:
    """The 400 message for a parsed JSON body that must be an object and is not."""
    if not path.startswith(OBJECT_BODY_PREFIX) or isinstance(body, dict):
        return None
    kind = {list: "an array", str: "a string", bool: "a boolean", type(None): "null"}.get(
        type(body), "a number")
    return f"the request body must be a JSON object, got {kind}"


async def _around_body(original: Callable[..., Any], request: Any, *args: Any, **kwargs: Any) -> Any:
    from fastapi import HTTPException

    body = await original(request, *args, **kwargs)
    error = body_shape_error(request.url.path, body)
    if error is not None:  # FastAPI passes an HTTPException from here through: SGLang's 400
        raise HTTPException(status_code=400, detail=error)
    return body


MALFORMED = (IndexError, KeyError, TypeError, AttributeError)


def around_normalize(original: Callable[..., Any], obj: Any, *args: Any, **kwargs: Any) -> Any:
    try:
        result = original(obj, *args, **kwargs)
    except MALFORMED as exc:
        raise ValueError(f"malformed request (text, input_ids, input_embeds or sampling_params): "
                         f"{type(exc).__name__}: {exc}"[:500]) from None
    check_rids(obj)
    check_batch_params(obj)
    return result


def check_batch_params(obj: Any) -> None:
    """ValueError unless a batch's list of sampling params has one entry per prompt: SGLang
    repeats the list for `n` without checking its length, so a short list failed later on an
    index (HTTP 500, the first prompts already sent) and a long one dropped its extra entries
    (their SLOs with them) without a word."""
    params = getattr(obj, "sampling_params", None)
    if getattr(obj, "is_single", True) or not isinstance(params, list):
        return
    n = max(1, getattr(obj, "parallel_sample_num", 1))
    if len(params) != obj.batch_size * n:
        raise ValueError(f"sampling_params: a batch of {obj.batch_size} prompts takes {obj.batch_size} "
                         f"sampling_params objects (or one object for all), got {len(params) // n}")


def check_rids(obj: Any) -> None:
    """ValueError unless a normalized request's rid is a string (one prompt) or a list of strings
    (a batch): SGLang keeps a list given for one prompt (`rid: ["a"]` with a string prompt) and
    then hashes it (TypeError, HTTP 500; found by schemathesis on /v1/completions).
    An empty id is refused too: the scheduler keys every request by it (found by schemathesis on
    /v1/chat/completions: `rid: ""` stopped the scheduler)."""
    rid = getattr(obj, "rid", None)
    if getattr(obj, "is_single", True):
        if not isinstance(rid, str):
            raise ValueError(f"rid: one prompt takes one request id (a string), got {type(rid).__name__}")
        if not rid:
            raise ValueError("rid: a request id must be a non-empty string")
    elif not isinstance(rid, list) or not all(isinstance(r, str) and r for r in rid):
        raise ValueError("rid: a batch takes a list of request ids (non-empty strings)")


def _after(*checks: Callable[[Any], str | None]) -> Callable[..., str | None]:
    def after(result: str | None, serving: Any, request: Any, *args: Any, **kwargs: Any) -> str | None:
        if result:
            return result  # SGLang's own message first
        for check in checks:
            error = check(request)
            if error:
                return error
        return None  # keeps SGLang's result

    return after


def hooks() -> list[tuple[str, Callable[..., Any], str]]:
    """(target, hook, HookType name) triples for integration.hooks."""
    return [(NORMALIZE, around_normalize, "AROUND"), (BODY, _around_body, "AROUND"),
            (CHAT, _after(chat_logprobs_error, chat_budget_error, choices_error), "AFTER"),
            (COMPLETION, _after(completion_logprobs_error, choices_error), "AFTER")]
