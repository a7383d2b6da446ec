"""How much of its `max_new_tokens` a request that may stop at EOS decodes, learned from the
requests that finished: what TTFT shedding (`rotasched.shedding.shed`) counts for a waiting request
of unknown length instead of nothing.

A fixed-length request (ignore_eos) decodes exactly its max_new_tokens, so the policy knows its
work. One that may stop early says only an upper bound. SGLang's own answer for its decode reserve
is a new-token ratio that decays from a guess; here the server measures it: the share is the ratio of
the recent finished requests' output tokens to what they asked for, each clipped as the decode
reserve clips them (`rotasched.views.CLIP_MAX_NEW_TOKENS`: a client asking for 100,000 tokens looks
like one asking for the clip, to the reserve and to the views). A ratio of sums, not a mean of
ratios: shedding sums the expected outputs of the requests it keeps, and share x the sum of their
bounds is that sum's estimate. Exponentially weighted (about the last 50 requests) so that it
follows a workload that changes. Pure Python.
"""

from __future__ import annotations

from superinfer_sgl.rotasched.views import CLIP_MAX_NEW_TOKENS

SMOOTHING = 0.02  # weight of the newest finished request: about the last 50
# Finished requests seen before the share is used: until then a request of unknown length counts
# its prompt only (shedding as it was without the estimate).
MIN_FINISHED = 10


class OutputShare:
    """`observe` each finished request that could stop at EOS (not aborted); `share` is what a
    waiting one is expected to decode, as a share of its clipped outputs left (0: not known yet)."""

    __slots__ = ("_outputs", "_asked", "_seen", "_clip", "_a")

    def __init__(self, clip: int = CLIP_MAX_NEW_TOKENS, smoothing: float = SMOOTHING) -> None:
        assert clip > 0 and 0 < smoothing <= 1, (clip, smoothing)
        self._outputs = self._asked = 0.0
        self._seen = 0
        self._clip, self._a = clip, smoothing

    def observe(self, outputs: int, max_new_tokens: int) -> None:
        """A request that asked for up to `max_new_tokens` ended after `outputs` tokens."""
        clip = self._clip
        asked = min(max(max_new_tokens, 1), clip)
        got = min(max(outputs, 0), asked)
        if self._seen == 0:
            self._outputs, self._asked = float(got), float(asked)
        else:
            a = self._a
            self._outputs += a * (got - self._outputs)
            self._asked += a * (asked - self._asked)
        self._seen += 1

    @property
    def seen(self) -> int:
        return self._seen

    @property
    def share(self) -> float:
        if self._seen < MIN_FINISHED:
            return 0.0
        return self._outputs / self._asked
