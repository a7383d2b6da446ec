"""Seeded workloads with prefix reuse, for the prefix-cache A/B (bench/prefix_ab.py).

Prompts are token ids (sent as `input_ids`), so a shared prefix is shared token for token; each
is a pure function of its seed, so every system sees the same requests at the same times.

tenants        multi-tenant system prompts with Zipf-skewed popularity in front of unique user
               turns; halfway through, the popularity ranks rotate by half (tenants come and go)
conversations  multi-turn conversations arriving as a Poisson stream; each next turn extends the
               last (the previous prompt, the model's actual answer, a new user message), sent
               after a think time once the previous answer is complete (a closed loop per
               conversation: the client builds turn k+1 from turn k's output)
unique         the control: unique prompts, no reuse at all
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

VOCAB = (1000, 40000)  # token ids drawn from here (SmolLM2's vocabulary is 49152)
# Lengths are small because the A/B runs on a shared 2-core CPU; the KV pool is sized to match
# (prefix_ab.py: 800 tokens against ~2000 tokens of system prompts or live conversations).
WORKLOADS = ("tenants", "conversations", "unique")


@dataclass(frozen=True)
class PrefixRequest:
    """One open-loop request (tenants, unique) at `arrival_s`."""

    idx: int
    arrival_s: float
    input_ids: tuple[int, ...]
    output_tokens: int
    group: int  # the tenant (-1: none)


@dataclass(frozen=True)
class Conversation:
    """A conversation: its first prompt at `arrival_s`; each later turn appends the previous answer
    and `user_turns[k]` after `think_s[k]` seconds."""

    idx: int
    arrival_s: float
    first: tuple[int, ...]
    user_turns: tuple[tuple[int, ...], ...]
    think_s: tuple[float, ...]
    output_tokens: int


@dataclass(frozen=True)
class TenantShape:
    tenants: int = 24
    zipf_s: float = 1.1
    system_tokens: tuple[int, int] = (60, 110)
    user_tokens: tuple[int, int] = (8, 24)
    output_tokens: int = 8


@dataclass(frozen=True)
class ConversationShape:
    first_tokens: tuple[int, int] = (40, 90)
    user_tokens: tuple[int, int] = (6, 16)
    turns: tuple[int, int] = (2, 6)  # later turns after the first
    think_mean_s: float = 2.0
    output_tokens: int = 8


def _ids(rng: np.random.Generator, n: int) -> tuple[int, ...]:
    return tuple(int(t) for t in rng.integers(VOCAB[0], VOCAB[1], size=n))


def _len(rng: np.random.Generator, bounds: tuple[int, int]) -> int:
    return int(rng.integers(bounds[0], bounds[1] + 1))


def poisson_arrivals(rng: np.random.Generator, rate: float, duration_s: float) -> list[float]:
    assert rate > 0 and duration_s > 0
    out, t = [], 0.0
    while True:
        t += float(rng.exponential(1.0 / rate))
        if t >= duration_s:
            return out
        out.append(t)


def tenant_popularity(shape: TenantShape) -> np.ndarray:
    w = 1.0 / np.arange(1, shape.tenants + 1) ** shape.zipf_s
    return w / w.sum()


def tenants(seed: int, rate: float, duration_s: float, shape: TenantShape = TenantShape()) -> list[PrefixRequest]:
    rng = np.random.default_rng([seed, 1])
    systems = [_ids(rng, _len(rng, shape.system_tokens)) for _ in range(shape.tenants)]
    popularity = tenant_popularity(shape)
    out = []
    for i, t in enumerate(poisson_arrivals(rng, rate, duration_s)):
        rank = int(rng.choice(shape.tenants, p=popularity))
        if t >= duration_s / 2:  # the popularity ranks rotate by half
            rank = (rank + shape.tenants // 2) % shape.tenants
        user = _ids(rng, _len(rng, shape.user_tokens))
        out.append(PrefixRequest(i, t, systems[rank] + user, shape.output_tokens, rank))
    return out


def unique(seed: int, rate: float, duration_s: float, shape: TenantShape = TenantShape()) -> list[PrefixRequest]:
    """As long as a tenant request (system + user turn), but every prompt its own."""
    rng = np.random.default_rng([seed, 2])
    lo = shape.system_tokens[0] + shape.user_tokens[0]
    hi = shape.system_tokens[1] + shape.user_tokens[1]
    return [PrefixRequest(i, t, _ids(rng, _len(rng, (lo, hi))), shape.output_tokens, -1)
            for i, t in enumerate(poisson_arrivals(rng, rate, duration_s))]


def conversations(seed: int, rate: float, duration_s: float,
                  shape: ConversationShape = ConversationShape()) -> list[Conversation]:
    """`rate` conversations per second start within `duration_s`."""
    rng = np.random.default_rng([seed, 3])
    out = []
    for i, t in enumerate(poisson_arrivals(rng, rate, duration_s)):
        n = _len(rng, shape.turns)
        out.append(Conversation(
            i, t, _ids(rng, _len(rng, shape.first_tokens)),
            tuple(_ids(rng, _len(rng, shape.user_tokens)) for _ in range(n)),
            tuple(float(rng.exponential(shape.think_mean_s)) for _ in range(n)),
            shape.output_tokens))
    return out
