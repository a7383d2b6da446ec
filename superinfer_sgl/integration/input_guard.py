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


def before_validate(manager: Any, obj: Any, *args: Any, **kwargs: Any) -> None:
    """BEFORE hook of TokenizerManager._validate_one_request(self, obj, input_ids)."""
    input_ids = args[0] if args else kwargs.get("input_ids")
    check_prompt_ids(input_ids, manager.model_config.vocab_size)

