"""Model families with SGLang's per-layer K/V pool (MHATokenToKVPool) and its MLA pool
(MLATokenToKVPool) rotate losslessly.

For each family, a tiny random-weight model (superinfer_sgl.tiny_models, SmolLM2's tokenizer) is
served by our launcher on CPU in float32 with rotations forced (SUPERINFER_TEST_ROTATE_INTERVAL=2)
and the KV byte check on (SUPERINFER_VERIFY_ROTATION=1), one short-lived server per family:
- every greedy output of a concurrent round equals the same request served alone, and equals
  transformers' argmax decoding of the same folder (SGLang read the weights as the architecture
  means them);
- requests were rotated, every KV check found identical bytes, none changed;
- afterwards no request is rotary, running or queued and the host pool holds no block.

gemma2 is the sliding-window family here: SGLang 0.5.23 keeps its KV in one MHATokenToKVPool and
masks the window in attention. Our batched CPU attention hands its sliding-window layers to SGLang's
stock torch_native code, which masks the window, and serves its full-attention layers itself.
deepseek-v2 is the MLA family (one latent buffer per layer): rotations and the KV byte check as for
the others, but no output comparison, because SGLang 0.5.23's MLA/MoE CPU path in float32 is not
exact: the same request served alone twice can give different greedy ids, and they differ from
transformers' (docs/models.md). gpt-oss (SWAKVPool, which rotation refuses) does not start on CPU
in SGLang: not served here; the unit tests build its pool (tests/unit/test_kv_pools_mla_swa.py).

Startup dominates (2-3 minutes a server on a loaded 2-core machine, nearly all Python imports in
the launcher and the scheduler; the file took 7 minutes there): servers start two at a time
in family order, and at most two are alive at once (a family's server stops at the end of its test,
which frees the slot for the next start). SGLANG_DISABLED_MODEL_ARCHS (SGLang's own switch) skips
importing SGLang's other model modules.
"""

from __future__ import annotations

import concurrent.futures as cf
import threading
import time
from pathlib import Path
from typing import Iterator

import pytest
import sglang

from serverutil import STARTUP_TIMEOUT_S, Server, generate, start_server
from superinfer_sgl.tiny_models import FAMILIES as TINY_FAMILIES
from superinfer_sgl.tiny_models import TRANSFORMERS_LOCK

pytestmark = pytest.mark.e2e

# family -> (SGLang model module it needs, extra environment, whether SGLang's CPU path is exact enough
# to compare outputs)
FAMILIES = {
    "llama": ("llama", {}, True),
    "qwen2": ("qwen2", {}, True),
    "mixtral": ("mixtral", {}, True),
    "qwen2-moe": ("qwen2_moe", {}, True),
    "gemma2": ("gemma2", {}, True),
    "deepseek-v2": ("deepseek_v2", {}, False),  # MLATokenToKVPool
}
FLAGS = ["--dtype", "float32", "--max-total-tokens", "4096", "--chunked-prefill-size", "64",
         "--enable-metrics", "--rotary-pool-gb", "0.05", "--log-level", "info"]
ROTATION_ENV = {"SUPERINFER_TEST_ROTATE_INTERVAL": "2", "SUPERINFER_VERIFY_ROTATION": "1"}
PROMPTS = [
    "The quick brown fox jumps over the lazy dog. " * 8 + "Summarise this text.",  # > 1 chunk, > window
    "Once upon a time, in a small village by the mountains,",
    "List the planets of the solar system in order from the sun:",
    "What is two plus two?",
]
NEW_TOKENS = 20
ON_LINE = "superinfer: host rotary pool"  # startup.create_runtime: rotation is on


def _other_model_modules(keep: str) -> str:
    models = Path(sglang.__file__).parent / "srt" / "models"
    names = sorted(p.stem for p in models.glob("*.py") if p.stem not in (keep, "registry", "__init__"))
    return ",".join(names)


def _wait_idle(server: Server, timeout: float = 60) -> dict[str, float]:
    deadline = time.time() + timeout
    m: dict[str, float] = {}
    while time.time() < deadline:
        m = server.metrics()
        busy = server.sglang_gauge("num_running_reqs") + server.sglang_gauge("num_queue_reqs")
        if m.get("superinfer_rotary_requests", 1) == 0 and m.get("superinfer_host_pool_blocks_used", 1) == 0 \
                and busy == 0:
            return m
        time.sleep(1)
    return m


def _hf_greedy(folder: Path) -> dict[str, list[int]]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with TRANSFORMERS_LOCK:  # the next family's model may be written meanwhile, by another thread
        tok = AutoTokenizer.from_pretrained(folder)
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    out = {}
    with torch.no_grad():  # plain argmax steps (EOS included: the server runs with ignore_eos)
        for p in PROMPTS:
            ids = tok(p, return_tensors="pt").input_ids
            for _ in range(NEW_TOKENS):
                ids = torch.cat([ids, model(ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
            out[p] = ids[0, -NEW_TOKENS:].tolist()
    return out


class _Starts:
    """Servers of the selected families, started by two threads in family order, at most two alive."""

    def __init__(self, families: list[str], model_dir: Path, root: Path) -> None:
        self.root, self.model_dir = root, model_dir
        self.slots = threading.BoundedSemaphore(2)
        self.closing = False
        self.pool = cf.ThreadPoolExecutor(2)
        self.futures = {f: self.pool.submit(self._start, f) for f in families}  # run in this order

    def _start(self, family: str) -> tuple[Path, Server]:
        from superinfer_sgl.tiny_models import write_tiny_model

        while not self.slots.acquire(timeout=1):  # a slot frees when an earlier family's test ends
            if self.closing:
                raise RuntimeError("closed before this family's server started")
        try:
            if self.closing:
                raise RuntimeError("closed before this family's server started")
            module, extra_env, _ = FAMILIES[family]
            folder = write_tiny_model(family, self.root / family, seed=0, tokenizer_dir=self.model_dir)
            env = {**ROTATION_ENV, **extra_env, "SGLANG_DISABLED_MODEL_ARCHS": _other_model_modules(module)}
            return folder, start_server(["--model-path", str(folder), *FLAGS], self.root / f"{family}.log", env=env)
        except BaseException:
            self.slots.release()
            raise

    def get(self, family: str) -> tuple[Path, Server]:
        return self.futures[family].result(timeout=3 * STARTUP_TIMEOUT_S)

    def stop(self, server: Server) -> list[int]:
        try:
            return server.stop()
        finally:
            self.slots.release()

    def close(self) -> list[int]:
        """Cancel starts not begun, wait for those under way, stop every server still up."""
        self.closing = True
        for fut in self.futures.values():
            fut.cancel()
        self.pool.shutdown(wait=True)
        left: list[int] = []
        for fut in self.futures.values():
            if not fut.cancelled() and fut.exception() is None:
                server = fut.result()[1]
                if server.proc.poll() is None:
                    left += self.stop(server)
        return left


@pytest.fixture(scope="module")
def starts(request: pytest.FixtureRequest, model_dir: Path,
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[_Starts]:
    selected = [item.callspec.params["family"] for item in request.session.items
                if item.module is request.module and hasattr(item, "callspec")]
    pipeline = _Starts([f for f in FAMILIES if f in selected], model_dir, tmp_path_factory.mktemp("families"))
    try:
        yield pipeline
    finally:
        left = pipeline.close()
        assert not left, f"processes left after shutdown: {left}"


@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_rotates_losslessly(family: str, starts: _Starts) -> None:
    folder, server = starts.get(family)
    try:
        assert ON_LINE in server.log(), f"{family}: rotation is off:\n{server.log()[-3000:]}"
        pool = TINY_FAMILIES[family].kv_pool  # the handshake names the pool it rotates
        assert f"scheduler 0: KV pool {pool}, rotation on" in server.log(), f"{family}: not {pool}"
        alone = {p: list(generate(server, p, max_new_tokens=NEW_TOKENS)["output_ids"]) for p in PROMPTS}
        before = server.metrics()
        with cf.ThreadPoolExecutor(len(PROMPTS)) as pool:
            got = dict(zip(PROMPTS, pool.map(lambda p: generate(server, p, max_new_tokens=NEW_TOKENS), PROMPTS)))
        after = _wait_idle(server)
        running = server.sglang_gauge("num_running_reqs") + server.sglang_gauge("num_queue_reqs")
    finally:
        left = starts.stop(server)
    assert not left, f"{family}: processes left after shutdown: {left}"

    def delta(key: str) -> float:
        return after.get(key, 0) - before.get(key, 0)

    rotated = sum(r["meta_info"]["superinfer"]["superinfer_rotations"] for r in got.values())
    assert rotated > 0 and delta("superinfer_resumes_total") > 0, f"{family}: no rotation was forced"
    assert delta('superinfer_kv_verify_total{outcome="identical"}') > 0
    assert delta('superinfer_kv_verify_total{outcome="changed"}') == 0
    assert after.get("superinfer_rotary_requests") == 0 and after.get("superinfer_host_pool_blocks_used") == 0, after
    assert running == 0
    if not FAMILIES[family][2]:
        return  # SGLang's own CPU path is not exact for this family: the KV byte checks are the proof
    changed = [p[:30] for p, r in got.items() if list(r["output_ids"]) != alone[p]]
    assert not changed, f"{family}: {len(changed)} of {len(PROMPTS)} outputs changed by rotation: {changed}"
    hf = _hf_greedy(folder)
    assert alone == hf, f"{family}: SGLang's greedy ids differ from transformers'"
