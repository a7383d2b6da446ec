"""Prompt token ids that would crash the scheduler are refused in the tokenizer instead.

SGLang 0.5.23 passes a prompt's token ids to the model unchecked, so one request can take the whole
server down (found by tests/e2e/test_hostile_input.py): a token id outside the vocabulary
(`/generate` `input_ids`, or an OpenAI `/v1/completions` prompt given as token ids) raises
IndexError in the embedding lookup (on a GPU: a device-side assert), and a prompt that tokenizes
to no tokens at all (`"text": ""`, `"prompt": ""`) raises IndexError in the logits processor.
Either exception ends the scheduler process, and SGLang then stops every process of the server.
SGLang refuses an empty `input_ids` list itself, but not an empty text.

A BEFORE hook on `TokenizerManager._validate_one_request(obj, input_ids)`, which SGLang calls with
the token ids of every request (single and batched, text or ids) before it sends it to the
scheduler: a ValueError there is HTTP 400 with this message, and nothing reaches the scheduler.

With `--enable-custom-logit-processor`, a request's `custom_logit_processor` (a dill-pickled class,
hex in JSON) is unpickled in the scheduler when its batch is built, unchecked: a processor that
cannot be loaded there (a module the server lacks: ModuleNotFoundError; not JSON, not hex, not a
pickle, not a callable) ends the scheduler the same way (issue 38). The same hook loads it once
in the tokenizer process first and refuses what does not load. This runs the client's pickle in
the HTTP process as well as in the scheduler: the flag already trusts clients with code
execution (SGLang loads it in the tokenizer itself for `return_sampling_mask`). A processor that
loads but raises when called still ends the scheduler, as in stock SGLang.
"""

from __future__ import annotations

from typing import Any, Sequence


def check_prompt_ids(input_ids: Sequence[int] | None, vocab_size: int) -> None:
    """ValueError naming the problem if `input_ids` is empty or holds an id outside
    [0, vocab_size); None (input embeddings instead of ids) passes."""
    if input_ids is None:
        return
    if len(input_ids) == 0:
        raise ValueError("the prompt is empty: it has no tokens (send a non-empty text, prompt or "
                         "input_ids)")
    low, high = min(input_ids), max(input_ids)
    if low < 0 or high >= vocab_size:
        bad = low if low < 0 else high
        raise ValueError(f"input_ids: token id {bad} is out of the vocabulary; valid ids are "
                         f"0..{vocab_size - 1}")


def load_logit_processor(serialized: object) -> None:
    """ValueError naming the problem unless `serialized` is what SGLang's scheduler can load and
    call: a JSON object whose `callable` is the hex of a dill pickle of a callable class
    (CustomLogitProcessor.to_str()). Loaded without SGLang's cache (an unbounded lru_cache)."""
    import json

    import dill

    prefix = "custom_logit_processor: "
    if not isinstance(serialized, str):
        raise ValueError(f"{prefix}expected a string (CustomLogitProcessor.to_str()), got "
                         f"{type(serialized).__name__}")
    try:
        data = json.loads(serialized)
    except ValueError:
        raise ValueError(f"{prefix}not JSON (send CustomLogitProcessor.to_str())") from None
    if not isinstance(data, dict) or not isinstance(data.get("callable"), str):
        raise ValueError(f'{prefix}expected a JSON object with a "callable" string')
    try:
        raw = bytes.fromhex(data["callable"])
    except ValueError:
        raise ValueError(f"{prefix}callable is not hex") from None
    try:
        cls = dill.loads(raw)
        processor = cls()
    except Exception as exc:  # ModuleNotFoundError, UnpicklingError, EOFError, TypeError, ...
        raise ValueError(f"{prefix}cannot be loaded on this server: {type(exc).__name__}: "
                         f"{exc}"[:500]) from None
    if not callable(processor):
        raise ValueError(f"{prefix}{type(processor).__name__} instances are not callable")


TOP_K_MAX = 1 << 30  # SGLang's TOP_K_ALL (the whole vocabulary); the scheduler packs top_k as int32


def check_sampling_params(params: Any) -> None:
    """ValueError for sampling params SGLang accepts but its scheduler cannot batch: a `top_k`
    past int32 raised RuntimeError ("value cannot be converted to type int32 without overflow")
    while building the batch, which ended the scheduler and the server (found by schemathesis,
    issue 38). Called after SGLang's own SamplingParams.verify (integration.hooks)."""
    top_k = getattr(params, "top_k", None)
    if isinstance(top_k, int) and top_k > TOP_K_MAX:
        raise ValueError(f"top_k must be -1 (the whole vocabulary) or 1..{TOP_K_MAX}, got {top_k}")


def _custom_processors_enabled() -> bool:
    from sglang.srt.runtime_context import get_exec

    return bool(get_exec().features.enable_custom_logit_processor)


def before_validate(manager: Any, obj: Any, *args: Any, **kwargs: Any) -> None:
    """BEFORE hook of TokenizerManager._validate_one_request(self, obj, input_ids)."""
    input_ids = args[0] if args else kwargs.get("input_ids")
    check_prompt_ids(input_ids, manager.model_config.vocab_size)
    processor = getattr(obj, "custom_logit_processor", None)
    # Without the flag SGLang refuses any processor itself (and never loads one).
    if processor is not None and _custom_processors_enabled():
        load_logit_processor(processor)

