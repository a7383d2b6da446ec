"""Every HookRegistry hook we install into SGLang, with the reason each one exists."""

from __future__ import annotations

from typing import Any, Callable, Iterator

from ..config import SuperInferConfig
from ..rotasched import Slo, SloClasses, SloError, resolve_slo, DEFAULT_CLASSES
from ..rotasched.slo import check_slo_keys
from . import http_guard, http_slo, input_guard, penalty_rows, prefix_cache

SCHED = "sglang.srt.managers.scheduler.Scheduler"
STREAMER = "sglang.srt.managers.scheduler_components.output_streamer.SchedulerOutputStreamer"
TOKENIZER = "sglang.srt.managers.tokenizer_manager.TokenizerManager"
ADDER_RUNNING_RESERVE = "sglang.srt.managers.schedule_policy.PrefillAdder._get_running_request_total_token_offset"
META_KEY = "superinfer"

# The scheduler process hosts exactly one Scheduler; its runtime is reachable from hooks that
# do not receive the scheduler (the output streamer, batch retraction).
_RUNTIME: Any = None


def runtime() -> Any:
    return _RUNTIME


def hooks(cfg: SuperInferConfig) -> Iterator[tuple[str, Callable[..., Any], Any]]:
    from sglang.srt.plugins.hook_registry import HookType

    from .metrics import recompute_hooks
    from .startup import create_runtime

    def attach(result: None, sched: Any, *args: Any, **kwargs: Any) -> None:
        global _RUNTIME
        _RUNTIME = sched._superinfer = create_runtime(sched, cfg)

    def around_prefill(original: Callable[..., Any], sched: Any, running_batch: Any) -> Any:
        return sched._superinfer.around_prefill(original, sched, running_batch)

    def before_abort(sched: Any, recv_req: Any) -> None:
        sched._superinfer.before_abort(recv_req)

    def before_release_aborted(sched: Any, req: Any, *args: Any, **kwargs: Any) -> None:
        # SGLang drops a request on paths that skip abort_request (its queue limit): ours go too.
        sched._superinfer.release_aborted(req)

    def idle(result: bool, sched: Any, *args: Any, **kwargs: Any) -> bool:
        # A rotary request waits on nobody: never let the loop sleep or run idle checks over it.
        return bool(result) and not sched._superinfer.has_work()

    def retract_decode(original: Callable[..., Any], batch: Any, *args: Any, **kwargs: Any) -> Any:
        # A decode memory shortage: rotated out to host first where rotation can take it, SGLang's
        # retraction for the rest (decode_shortage.py); SGLang's retractions counted, mirrors dropped.
        if _RUNTIME is None:
            return original(batch, *args, **kwargs)
        return _RUNTIME.retract_decode(lambda b: original(b, *args, **kwargs), batch)

    def after_pause(result: None, sched: Any, recv_req: Any, *args: Any, **kwargs: Any) -> None:
        # A retract pause (weight updates) drops every running request's KV: ours too (runtime).
        if getattr(recv_req, "mode", None) == "retract":
            sched._superinfer.after_retract_pause()
        return result

    def after_preempt(result: bool, adder: Any, *args: Any, **kwargs: Any) -> bool:
        # Priority preemption released running requests to recompute: their mirrors are stale.
        if result and _RUNTIME is not None:
            _RUNTIME.forget_kv(list(adder.preempt_list))
        return result

    yield f"{SCHED}.__init__", attach, HookType.AFTER
    yield f"{SCHED}.get_new_batch_prefill", around_prefill, HookType.AROUND
    yield f"{SCHED}.abort_request", before_abort, HookType.BEFORE
    yield f"{SCHED}._release_aborted_request", before_release_aborted, HookType.BEFORE
    yield f"{SCHED}.is_fully_idle", idle, HookType.AFTER
    yield "sglang.srt.managers.schedule_batch.ScheduleBatch.retract_decode", retract_decode, HookType.AROUND
    yield f"{SCHED}.pause_generation", after_pause, HookType.AFTER
    yield "sglang.srt.managers.schedule_policy.PrefillAdder.preempt_to_schedule", after_preempt, HookType.AFTER
    # The recompute tax (integration/metrics.py, RecomputeTally): prefill tokens computed, and
    # computed again after a running request's KV was dropped, by cause.
    recompute = recompute_hooks(runtime)
    yield f"{SCHED}.update_running_batch", recompute["decode_update"], HookType.AROUND
    yield f"{SCHED}._add_request_to_queue", recompute["requeued"], HookType.BEFORE
    yield f"{SCHED}._get_new_batch_prefill_raw", recompute["prefill"], HookType.AFTER
    # A resumed or recomputed request's penalty state (frequency, presence, repetition,
    # min_new_tokens) lives in batch rows that SGLang builds empty: refilled from its outputs.
    yield "sglang.srt.managers.schedule_batch.ScheduleBatch.prepare_for_extend", _restore_penalties, HookType.AFTER
    # A running request's decode reserve in SGLang's admission budget: the same rule
    # as our views (views.running_reserve, --running-reserve), so both count the same free memory.
    yield ADDER_RUNNING_RESERVE, _running_offset, HookType.AROUND
    yield STREAMER, _streamer_class(), HookType.REPLACE
    yield "sglang.srt.sampling.sampling_params.SamplingParams.verify", _slo_verify(cfg), HookType.AFTER
    yield f"{TOKENIZER}.update_request_meta_info", _unwrap_meta, HookType.AROUND
    # The ecosystem's SLO conventions (service_tier, priority, x-smg-priority, x-slo-*-ms) into
    # custom_params, where the HTTP request is still at hand (http_slo.py, docs/slo.md).
    yield f"{TOKENIZER}.generate_request", http_slo.around_generate(cfg), HookType.AROUND
    # Empty prompts, out-of-vocabulary token ids and unloadable custom logit processors crash
    # SGLang's scheduler: 400 instead.
    yield f"{TOKENIZER}._validate_one_request", input_guard.before_validate, HookType.BEFORE
    # OpenAI bodies that are not JSON objects (500 in SGLang) and OpenAI's logprobs caps, which
    # SGLang does not enforce: 400 (http_guard.py).
    for target, hook, kind in http_guard.hooks():
        yield target, hook, HookType[kind]
    # --prefix-cache predictive: eviction by predicted reuse on SGLang's Python tree core
    # (prefix_cache.py, docs/prefix_cache.md); nothing with the default radix cache. Its host tier
    # (--prefix-host-tokens, prefix_host.py): demote on eviction, restore on a match, drop on reset.
    host_tokens = prefix_cache.AUTO_HOST if cfg.prefix_host_tokens is None else cfg.prefix_host_tokens
    for target, hook, kind in prefix_cache.hooks(cfg.prefix_cache, prefix_cache.PIN_SHARE, host_tokens,
                                                 cfg.kv_transfer, forward_fence):
        yield target, hook, HookType[kind]


def forward_fence() -> list[Any]:
    """What a KV copy into newly allocated slots waits for: the forward in flight under the overlap
    scheduler (rotation.forward_fence); nothing before the scheduler exists or on a CPU."""
    sched = getattr(_RUNTIME, "sched", None)
    if sched is None:
        return []
    from .rotation import forward_fence as fence

    return fence(sched)


def _restore_penalties(result: None, batch: Any, *args: Any, **kwargs: Any) -> None:
    penalty_rows.restore(batch, bool(getattr(batch, "enable_overlap", False)))


def _running_offset(original: Callable[..., Any], adder: Any, req: Any) -> Any:
    rt = _RUNTIME
    if rt is None or rt.running_share == 1.0:
        return original(adder, req)  # SGLang's own estimate
    from .views import running_reserve

    return running_reserve(rt.sched, req, rt.running_share, rt.rules.clip)


def _streamer_class() -> type:
    """SGLang's output streamer plus one request-level meta_info entry, sent when a request ends."""
    from sglang.srt.managers.scheduler_components.output_streamer import SchedulerOutputStreamer

    class SuperInferOutputStreamer(SchedulerOutputStreamer):
        __slots__ = ()
        has_additional_customized_info = True

        def build_additional_customized_info(self, reqs: list[Any]) -> dict[str, list]:
            rt = _RUNTIME
            values: list[list[dict[str, object]]] = []
            for req in reqs:
                info = _on_finished(rt, req) if rt is not None and req.finished() else None
                values.append([info] if info is not None else [])
            return {META_KEY: values}

        def is_request_level_customized_info_key(self, key: str) -> bool:
            return key == META_KEY or super().is_request_level_customized_info_key(key)

    return SuperInferOutputStreamer


def _on_finished(rt: Any, req: Any) -> Any:
    """rt.on_finished(req), counted in the SLO series unless SGLang sent the request itself (a
    health probe, the startup warm-up: metrics.metered)."""
    from .metrics import metered

    if rt.metrics is None or metered(req):
        return rt.on_finished(req)
    with rt.metrics.unmetered():
        return rt.on_finished(req)


def _unwrap_meta(original: Callable[..., Any], self: Any, meta_info: dict, *args: Any, **kwargs: Any) -> Any:
    # SGLang accumulates customized info into a list; ours is one dict per request.
    result = original(self, meta_info, *args, **kwargs)
    value = meta_info.get(META_KEY)
    if isinstance(value, list):
        if value:
            meta_info[META_KEY] = value[-1]
        else:
            meta_info.pop(META_KEY)
    return result


def _slo_verify(cfg: SuperInferConfig) -> Callable[..., None]:
    """Validate our custom_params keys where SGLang validates sampling params (the tokenizer), so
    a bad SLO is a 400 naming the field and never reaches the scheduler."""
    default = Slo(cfg.ttft_slo_ms, cfg.tbt_slo_ms)
    classes = SloClasses.parse(cfg.slo_classes or DEFAULT_CLASSES, default=default)

    def verify(result: None, params: Any, *args: Any, **kwargs: Any) -> None:
        input_guard.check_sampling_params(params)  # a top_k past int32 ended the scheduler
        try:
            check_slo_keys(params.custom_params)  # a misspelt SLO key: 400, not the default SLO
            resolve_slo(params.custom_params, default, classes)
        except SloError as exc:
            raise ValueError(f"invalid custom_params.{exc.field}: {exc}") from None

    return verify
