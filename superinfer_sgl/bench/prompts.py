"""Prompts of requested token lengths, written as sglang.benchmark's `openai` JSONL dataset.

Each prompt is natural English (a fixed passage repeated from a per-request offset) behind a
unique request tag, so prompts share no prefix beyond the chat template's system turn. Requests
that may stop at EOS (`question`) end with a question the model answers in a sentence or two, so
their lengths are the model's (SmolLM2: ~40 tokens, most stopping at EOS). Lengths are counted the
way the load generator counts them: the chat template applied, generation prompt included.

One JSONL line per request: {"messages", "max_tokens", "custom_params", "stream_options"[,
"priority"]}. The openai dataset passes every key except messages/max_tokens/model through to
the request body, so custom_params (our SLO keys) reach SGLang's sampling params.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path

from .workloads import BenchRequest

PASSAGE = (
    "The harbour town woke slowly. Fishermen checked their nets while the baker opened the shutters "
    "and the smell of bread drifted down to the water. Children ran along the sea wall, counting the "
    "boats that had come back before dawn, and an old man mended a sail in the shade of the market "
    "hall. By noon the square was full: traders argued over the price of salt, a teacher read the "
    "news aloud to anyone who would listen, and the ferry from the island sounded its horn twice. "
    "In the afternoon clouds gathered over the hills, the wind turned, and the harbour master raised "
    "the storm flag. Everyone knew what that meant. Boats were tied twice, windows were closed, and "
    "the lamps in the lighthouse were lit an hour early. The storm passed in the night, leaving the "
    "streets washed clean and the air cold and bright, and in the morning the town woke slowly again."
)

# Ends a prompt whose answer length the model decides (ab_bench --no-ignore-eos).
QUESTION = "In one sentence, what is this passage about?"

# Priority sent to stock SGLang's --enable-priority-scheduling baseline: tighter TTFT, higher value
# (SGLang schedules larger priority values first by default).
PriorityOf = Callable[[BenchRequest], int]


def priority_by_ttft(reqs: Sequence[BenchRequest]) -> PriorityOf:
    ranks = {t: i for i, t in enumerate(sorted({r.slo.ttft_ms for r in reqs}, reverse=True))}
    return lambda r: ranks[r.slo.ttft_ms]


class PromptBuilder:
    def __init__(self, tokenizer: object, question: str | None = None) -> None:
        self.tok = tokenizer
        self.words = PASSAGE.split()
        self.question = question

    def _messages(self, content: str) -> list[dict[str, str]]:
        return [{"role": "user", "content": content}]

    def _count(self, content: str) -> int:
        ids = self.tok.apply_chat_template(  # type: ignore[attr-defined]
            self._messages(content), tokenize=True, add_generation_prompt=True, return_dict=False)
        return len(ids)

    def _text(self, idx: int, n_words: int) -> str:
        start = (idx * 37) % len(self.words)
        body = [self.words[(start + k) % len(self.words)] for k in range(n_words)]
        text = " ".join([f"[request {idx}]", *body])
        return f"{text}\n\n{self.question}" if self.question else text

    def build(self, idx: int, target_tokens: int) -> tuple[str, int]:
        """Content whose templated length is the largest <= target (at least the tag alone)."""
        lo, hi = 0, max(1, target_tokens)
        if self._count(self._text(idx, 0)) >= target_tokens:
            return self._text(idx, 0), self._count(self._text(idx, 0))
        while lo < hi:  # largest word count whose templated length fits the target
            mid = (lo + hi + 1) // 2
            if self._count(self._text(idx, mid)) <= target_tokens:
                lo = mid
            else:
                hi = mid - 1
        text = self._text(idx, lo)
        return text, self._count(text)

    @property
    def min_tokens(self) -> int:
        return self._count(self._text(0, 0))


def openai_line(req: BenchRequest, content: str, priority: int | None = None) -> dict:
    params: dict[str, object] = {"ttft_slo_ms": req.slo.ttft_ms, "tbt_slo_ms": req.slo.tbt_ms}
    if req.slo_class is not None:
        params["slo_class"] = req.slo_class
    line: dict[str, object] = {
        "messages": [{"role": "user", "content": content}],
        "max_tokens": req.output_tokens,
        "custom_params": params,
        # The final usage chunk carries the server's completion_tokens (checks ignore_eos).
        "stream_options": {"include_usage": True},
    }
    if priority is not None:
        line["priority"] = priority
    return line


def write_dataset(path: Path, reqs: Sequence[BenchRequest], builder: PromptBuilder,
                  priority_of: PriorityOf | None = None) -> list[int]:
    """Write the JSONL dataset; return each request's real (templated) prompt length."""
    lens = []
    with open(path, "w") as f:
        for r in reqs:
            content, n = builder.build(r.idx, r.prompt_tokens)
            lens.append(n)
            prio = priority_of(r) if priority_of is not None else None
            f.write(json.dumps(openai_line(r, content, prio)) + "\n")
    return lens
