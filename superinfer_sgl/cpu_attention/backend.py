"""SuperInferCpuAttnBackend: SGLang's torch_native attention backend with batched CPU kernels.

SGLang builds it for `--attention-backend torch_native` once patches/cpu_attention_backend.py has
swapped it in for TorchNativeAttnBackend (a subclass, so every `torch_native` check in SGLang,
e.g. its torch fallbacks for Triton-only helpers, still applies). Per forward pass it builds one
plan (init_forward_metadata); each layer then runs:

- decode: one call for all requests (the C kernel in native.py, or paged.decode_attention);
- extend: one SDPA per request over only the new tokens (prefix-offset causal mask); requests
  that extend by exactly one token (every request of a resume-only batch, the decode rows of a
  mixed chunk) go through the batched decode kernel instead.

Left to the stock torch_native code, which implements them: sliding-window layers over a plain
pool (it masks the window), cross-attention and encoder-only layers (per layer), and forward modes
other than decode/extend/mixed/split-prefill (speculative verify, draft extend). Decode shapes the C
kernel does not take go to the torch batched path (decided once, at construction). Refused
(UnsupportedAttentionError, at construction where the model shows it): logit soft-capping, which
stock torch_native would ignore; sliding-window KV pools, which it reads with the wrong slot ids
(docs/models.md); and attention arguments neither backend takes (`sinks`, ...).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from sglang.srt.layers.attention import torch_native_backend as _torch_native
from sglang.srt.layers.radix_attention import AttentionType, RadixAttention
from sglang.srt.mem_cache.memory_pool import KVWriteLoc
from sglang.srt.model_executor.forward_batch_info import ForwardMode

from . import kernel_choice, native, paged

if TYPE_CHECKING:
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch
    from sglang.srt.model_executor.model_runner import ModelRunner

logger = logging.getLogger(__name__)

# Modes whose extend is plain causal prefill over the paged pool (what plan_extend models).
_EXTEND_MODES = (ForwardMode.EXTEND, ForwardMode.MIXED, ForwardMode.SPLIT_PREFILL)


class UnsupportedAttentionError(NotImplementedError):
    """A model or layer feature this backend does not implement (set SUPERINFER_CPU_ATTENTION=0)."""


@dataclass(frozen=True)
class DecodeStep:
    """Inputs of the decode kernels for one forward: one query row per request."""

    req_pool_indices: torch.Tensor  # [B] int64, contiguous
    seq_lens: torch.Tensor  # [B] int64, contiguous (include the token being decoded)
    max_len: int
    torch_plan: paged.DecodePlan | None  # built only when the torch kernel runs


@dataclass(frozen=True)
class ExtendStep:
    """Requests extending by more than one token: one SDPA each. Those extending by exactly one
    (the decode rows of a mixed chunk, or one-token prompts and resumes) go to the batched decode
    kernel: query rows `decode_rows` of the batch, attending to all their keys, as a decode does."""

    segments: list[paged.ExtendSegment]
    decode: DecodeStep | None = None
    decode_rows: torch.Tensor | None = None  # [B1] int64 row of each one-token request in q


def check_layer(layer: RadixAttention) -> None:
    """Raise for an attention feature that neither this backend nor stock torch_native computes
    (stock would silently leave it out)."""
    if layer.logit_cap and layer.logit_cap > 0:
        raise UnsupportedAttentionError(
            f"layer {layer.layer_id}: logit soft-capping ({layer.logit_cap}) is not supported")


def stock_layer(layer: RadixAttention) -> bool:
    """A layer the stock torch_native code serves (its per-request SDPA implements them; the batched
    plans here are plain causal decoder attention over the whole prefix)."""
    return ((layer.sliding_window_size is not None and layer.sliding_window_size > -1)
            or layer.is_cross_attention or layer.attn_type != AttentionType.DECODER)


def _no_extra_args(layer: RadixAttention, kw: dict) -> None:
    extra = sorted(k for k, v in kw.items() if v is not None and v is not False)
    if extra:  # sinks, k_rope, return_lse, ...: stock torch_native takes none of them either
        raise UnsupportedAttentionError(f"layer {layer.layer_id}: attention arguments {extra} are not supported "
                                        "by the torch_native backend")


class SuperInferCpuAttnBackend(_torch_native.TorchNativeAttnBackend):
    def __init__(self, model_runner: ModelRunner):
        super().__init__(model_runner)
        if self.use_sliding_window_kv_pool:  # stock torch_native reads its window layers with full-pool ids
            raise UnsupportedAttentionError("sliding-window KV pools are not supported (docs/models.md)")
        self._checked_layers: set[int] = set()
        self._stock_layers: set[int] = set()  # `stock_layer`
        self._step: DecodeStep | ExtendStep | None = None
        self._step_batch: ForwardBatch | None = None
        model = getattr(model_runner, "model", None)
        layers = [m for m in model.modules() if isinstance(m, RadixAttention)] if model is not None else []
        for layer in layers:
            self._check_once(layer)
        self.kernel = _resolve_kernel(kernel_choice(), getattr(self.token_to_kv_pool, "dtype", None),
                                      getattr(model_runner, "dtype", None), layers)
        logger.info("superinfer cpu attention active (decode kernel: %s)", self.kernel)

    # ---- planning: once per forward pass ----

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        super().init_forward_metadata(forward_batch)
        self._step = self._plan(forward_batch)
        self._step_batch = forward_batch

    def _plan(self, fb: ForwardBatch) -> DecodeStep | ExtendStep | None:
        mode = fb.forward_mode
        if fb.encoder_lens is not None or not (mode.is_decode() or mode in _EXTEND_MODES):
            return None  # stock path
        if mode.is_decode():
            return self._plan_decode(fb.req_pool_indices, fb.seq_lens, fb.seq_lens_cpu)
        extend_lens = _host_list(fb.extend_seq_lens_cpu, fb.extend_seq_lens)
        if extend_lens and all(n == 1 for n in extend_lens):
            return self._plan_decode(fb.req_pool_indices, fb.seq_lens, fb.seq_lens_cpu)
        seq_lens = _host_list(None, fb.seq_lens_cpu if fb.seq_lens_cpu is not None else fb.seq_lens)
        segments = paged.plan_extend(
            self.req_to_token_pool.req_to_token,
            fb.req_pool_indices.tolist(),
            seq_lens,
            _host_list(fb.extend_prefix_lens_cpu, fb.extend_prefix_lens),
            extend_lens,
        )
        ones = [b for b, n in enumerate(extend_lens) if n == 1]
        if not ones:
            return ExtendStep(segments)
        # A mixed chunk: its decode rows would otherwise cost one SDPA call each, per layer.
        pick = torch.tensor(ones, dtype=torch.int64)
        lens = torch.tensor([seq_lens[b] for b in ones], dtype=torch.int64)
        decode = self._plan_decode(fb.req_pool_indices.index_select(0, pick), lens, lens)
        starts = [0]
        for n in extend_lens[:-1]:
            starts.append(starts[-1] + n)
        rows = torch.tensor([starts[b] for b in ones], dtype=torch.int64)
        return ExtendStep([seg for seg in segments if seg.q_len > 1], decode, rows)

    def _plan_decode(self, req_pool_indices, seq_lens, seq_lens_cpu) -> DecodeStep:
        host = seq_lens_cpu if seq_lens_cpu is not None else seq_lens
        max_len = int(host.max()) if host.numel() else 0
        rpi = req_pool_indices.to(torch.int64).contiguous()
        lens = seq_lens.to(torch.int64).contiguous()
        torch_plan = None
        if self.kernel == "torch":
            torch_plan = paged.plan_decode(self.req_to_token_pool.req_to_token, rpi, lens, max_len)
        return DecodeStep(rpi, lens, max_len, torch_plan)

    def _current_step(self, forward_batch: ForwardBatch) -> DecodeStep | ExtendStep | None:
        if self._step_batch is not forward_batch:  # a caller skipped init_forward_metadata
            self.init_forward_metadata(forward_batch)
        return self._step

    # ---- per layer ----

    def forward_decode(self, q, k, v, layer: RadixAttention, forward_batch: ForwardBatch, save_kv_cache=True, **kw):
        _no_extra_args(layer, kw)
        step = self._current_step(forward_batch)
        if not isinstance(step, DecodeStep) or self._check_once(layer):
            return super().forward_decode(q, k, v, layer, forward_batch, save_kv_cache)
        return self._attend(q, k, v, layer, forward_batch, save_kv_cache, step)

    def forward_extend(self, q, k, v, layer: RadixAttention, forward_batch: ForwardBatch, save_kv_cache=True, **kw):
        _no_extra_args(layer, kw)
        step = self._current_step(forward_batch)
        if step is None or self._check_once(layer):
            return super().forward_extend(q, k, v, layer, forward_batch, save_kv_cache)
        return self._attend(q, k, v, layer, forward_batch, save_kv_cache, step)

    def _attend(self, q, k, v, layer, forward_batch, save_kv_cache, step: DecodeStep | ExtendStep):
        if save_kv_cache and k is not None and v is not None:
            self.token_to_kv_pool.set_kv_buffer(
                layer, KVWriteLoc(forward_batch.out_cache_loc, self.swa_out_cache_loc), k, v
            )
        q_ = q.reshape(-1, layer.tp_q_head_num, layer.qk_head_dim)
        o = q.new_empty((q_.shape[0], layer.tp_q_head_num * layer.v_head_dim))
        o_ = o.view(-1, layer.tp_q_head_num, layer.v_head_dim)
        k_cache = self.token_to_kv_pool.get_key_buffer(layer.layer_id)
        v_cache = self.token_to_kv_pool.get_value_buffer(layer.layer_id)
        scale = layer.scaling if layer.scaling is not None else layer.qk_head_dim**-0.5
        if isinstance(step, DecodeStep):
            self._decode(q_, k_cache, v_cache, step, scale, o_)
            return o
        paged.extend_attention(q_, k_cache, v_cache, step.segments, scale, o_)
        if step.decode is not None:
            assert step.decode_rows is not None
            od = o_.new_empty((step.decode_rows.numel(), *o_.shape[1:]))
            self._decode(q_.index_select(0, step.decode_rows), k_cache, v_cache, step.decode, scale, od)
            o_.index_copy_(0, step.decode_rows, od)
        return o

    def _decode(self, q_, k_cache, v_cache, step: DecodeStep, scale: float, o_) -> None:
        if step.torch_plan is None and native.supports(q_, k_cache, v_cache):
            native.decode_attention(
                q_, k_cache, v_cache, self.req_to_token_pool.req_to_token,
                step.req_pool_indices, step.seq_lens, step.max_len, scale, o_,
            )  # fmt: skip
        else:
            plan = step.torch_plan or paged.plan_decode(
                self.req_to_token_pool.req_to_token, step.req_pool_indices, step.seq_lens, step.max_len
            )
            paged.decode_attention(q_, k_cache, v_cache, plan, scale, o_)

    def _check_once(self, layer: RadixAttention) -> bool:
        """`check_layer` (raises) once per layer; whether the stock code serves it (`stock_layer`)."""
        if layer.layer_id not in self._checked_layers:
            check_layer(layer)
            self._checked_layers.add(layer.layer_id)
            if stock_layer(layer):
                self._stock_layers.add(layer.layer_id)
        return layer.layer_id in self._stock_layers


def _resolve_kernel(choice: str, kv_dtype: torch.dtype | None, model_dtype: torch.dtype | None = None,
                    layers: list[RadixAttention] = ()) -> str:
    """'native' (the C kernel) or 'torch' for decode, decided once: the C kernel needs float32 or
    bfloat16 KV in the model's own dtype, and attention shapes within its buffers."""
    if choice == "torch":
        return "torch"
    why = None
    wide = [layer.layer_id for layer in layers if not stock_layer(layer)
            and (layer.qk_head_dim != layer.v_head_dim  # the kernel walks both pools with K's strides
                 or not native.shape_supported(layer.tp_q_head_num, layer.tp_k_head_num, layer.qk_head_dim,
                                               layer.v_head_dim))]
    if kv_dtype not in native.SUPPORTED_DTYPES:
        why = f"KV cache dtype {kv_dtype} (the C kernel reads float32/bfloat16)"
    elif model_dtype is not None and model_dtype != kv_dtype:
        why = f"model dtype {model_dtype} with KV cache dtype {kv_dtype} (the C kernel reads them alike)"
    elif wide:
        why = (f"layer {wide[0]}'s shape (more than {native.MAX_GROUP} query heads per KV head, a head dim "
               f"over {native.MAX_HEAD_DIM}, or K and V head dims that differ)")
    elif native.load() is None:
        why = "the C kernel could not be built"
    if why is None:
        return "native"
    if choice == "native":
        raise RuntimeError(f"SUPERINFER_CPU_ATTENTION_KERNEL=native but {why}")
    logger.warning("superinfer cpu attention: torch decode path: %s", why)
    return "torch"


def _host_list(host: list[int] | None, tensor: torch.Tensor | None) -> list[int]:
    if host is not None:
        return [int(x) for x in host]
    assert tensor is not None, "extend batch without lengths"
    return tensor.tolist()
