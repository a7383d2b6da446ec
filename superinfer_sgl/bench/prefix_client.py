"""The prefix-cache A/B's load generator: streamed `/generate` calls with token-id prompts.

Per request it records TTFT (first streamed token), the end-to-end time, output tokens, and what
SGLang reports of the prompt: `prompt_tokens` and `cached_tokens` (the prefix-hit tokens). The
conversations are driven as closed loops (turn k+1 is turn k's prompt + the model's answer + a new
user message, sent a think time after turn k ends); the others are open loop at their arrival
times. `/metrics` is sampled during the run for the peak device KV in use.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import threading
import time
from dataclasses import asdict, dataclass
from typing import Any

import aiohttp

from .prefix_workloads import Conversation, PrefixRequest

_TOKEN_USAGE = re.compile(r"^sglang:token_usage\{[^}]*\}\s+([0-9.eE+-]+)", re.M)


@dataclass
class Record:
    kind: str  # tenants, conversations, unique
    idx: int  # request (or conversation) index
    turn: int
    sent_s: float  # offset from the run's start
    ttft_s: float | None
    e2e_s: float | None
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int
    ok: bool
    error: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


async def _generate(session: aiohttp.ClientSession, url: str, ids: tuple[int, ...] | list[int],
                    out_tokens: int, kind: str, idx: int, turn: int, t0: float,
                    slo_class: str) -> tuple[Record, list[int]]:
    body = {"input_ids": list(ids), "stream": True,
            "sampling_params": {"max_new_tokens": out_tokens, "ignore_eos": True, "temperature": 0,
                                "custom_params": {"slo_class": slo_class}}}
    sent = time.perf_counter()
    first: float | None = None
    meta: dict[str, Any] = {}
    out_ids: list[int] = []
    try:
        async with session.post(url + "/generate", json=body) as resp:
            if resp.status != 200:
                text = await resp.text()
                return Record(kind, idx, turn, sent - t0, None, None, len(ids), 0, 0, False,
                              f"{resp.status}: {text[:200]}"), []
            async for raw in resp.content:
                line = raw.decode().strip()
                if not line.startswith("data:") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[5:])
                meta = chunk.get("meta_info", meta)
                if first is None and meta.get("completion_tokens", 0) >= 1:
                    first = time.perf_counter()
                if "output_ids" in chunk:
                    out_ids = list(chunk["output_ids"])
    except (aiohttp.ClientError, asyncio.TimeoutError, json.JSONDecodeError) as exc:
        return Record(kind, idx, turn, sent - t0, None, None, len(ids), 0, 0, False, repr(exc)[:200]), []
    end = time.perf_counter()
    return Record(kind, idx, turn, sent - t0, None if first is None else first - sent, end - sent,
                  int(meta.get("prompt_tokens", len(ids))), int(meta.get("cached_tokens", 0)),
                  int(meta.get("completion_tokens", 0)), first is not None), out_ids


async def _open_loop(url: str, reqs: list[PrefixRequest], kind: str, slo_class: str,
                     session: aiohttp.ClientSession, t0: float) -> list[Record]:
    async def one(r: PrefixRequest) -> Record:
        await asyncio.sleep(max(0.0, t0 + r.arrival_s - time.perf_counter()))
        rec, _ = await _generate(session, url, r.input_ids, r.output_tokens, kind, r.idx, 0, t0, slo_class)
        return rec
    return list(await asyncio.gather(*(one(r) for r in reqs)))


async def _closed_loops(url: str, convs: list[Conversation], slo_class: str,
                        session: aiohttp.ClientSession, t0: float) -> list[Record]:
    async def one(c: Conversation) -> list[Record]:
        await asyncio.sleep(max(0.0, t0 + c.arrival_s - time.perf_counter()))
        prompt, recs = list(c.first), []
        for turn in range(len(c.user_turns) + 1):
            rec, out = await _generate(session, url, prompt, c.output_tokens, "conversations", c.idx, turn, t0,
                                       slo_class)
            recs.append(rec)
            if not rec.ok or turn == len(c.user_turns):
                break
            await asyncio.sleep(c.think_s[turn])
            prompt = prompt + out + list(c.user_turns[turn])
        return recs
    nested = await asyncio.gather(*(one(c) for c in convs))
    return [r for recs in nested for r in recs]


async def _sample_kv(session: aiohttp.ClientSession, url: str, stop: asyncio.Event, out: list[float]) -> None:
    while not stop.is_set():
        try:
            async with session.get(url + "/metrics") as resp:
                text = await resp.text()
            out += [float(m) for m in _TOKEN_USAGE.findall(text)]
        except aiohttp.ClientError:
            pass
        try:
            await asyncio.wait_for(stop.wait(), timeout=0.5)
        except asyncio.TimeoutError:
            pass


async def _run(url: str, kind: str, work: list[Any], slo_class: str) -> tuple[list[Record], float, float]:
    timeout = aiohttp.ClientTimeout(total=900)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        stop, usage = asyncio.Event(), []
        sampler = asyncio.create_task(_sample_kv(session, url, stop, usage))
        t0 = time.perf_counter()
        if kind == "conversations":
            recs = await _closed_loops(url, work, slo_class, session, t0)
        else:
            recs = await _open_loop(url, work, kind, slo_class, session, t0)
        wall = time.perf_counter() - t0
        stop.set()
        await sampler
    return recs, wall, max(usage, default=float("nan"))


def _result(recs: list[Record], wall: float, peak: float) -> dict[str, Any]:
    return {"records": [r.to_dict() for r in recs], "wall_s": wall, "peak_token_usage": peak}


def run_workload(url: str, kind: str, work: list[Any], slo_class: str = "interactive") -> dict[str, Any]:
    """Drive one workload against a server; its records, wall time and peak KV token usage."""
    return _result(*asyncio.run(_run(url, kind, work, slo_class)))


def run_workload_on_each(urls: list[str], kind: str, work: list[Any], cores: list[frozenset[int]],
                         slo_class: str = "interactive") -> list[dict[str, Any]]:
    """The same workload against several servers at once (prefix_ab --paired), each driven by its
    own thread pinned to that server's `cores` (a load generator left to float would take its
    cycles from whichever server shares its core), all started together."""
    got: list[Any] = [None] * len(urls)
    start = threading.Barrier(len(urls))

    def drive(k: int) -> None:
        try:
            os.sched_setaffinity(0, cores[k])  # 0: this thread
            start.wait()
            got[k] = _result(*asyncio.run(_run(urls[k], kind, work, slo_class)))
        except BaseException as exc:  # noqa: BLE001 - raised in the caller below
            start.abort()
            got[k] = exc

    threads = [threading.Thread(target=drive, args=(k,), daemon=True) for k in range(len(urls))]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    for res in got:
        if isinstance(res, BaseException):
            raise res
    return got
