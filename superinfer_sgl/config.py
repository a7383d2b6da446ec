"""Our own server options: parsed by our launcher, handed to SGLang's child processes by environment.

SGLang's ServerArgs is a sealed struct that drops unknown arguments, so we never add fields to it.
Instead the launcher serialises this config into SUPERINFER_SGL_CONFIG; spawned children inherit the
environment and our plugin reads it there. Its absence is what keeps the plugin inert.
"""

from __future__ import annotations

import argparse
import json
import math
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields
from typing import TYPE_CHECKING

from .rotasched.goodput import DEFAULT_MAX_BEST_EFFORT_WAIT_S
from .rotasched.planner import MIX_PREFILL
from .rotasched.planner import POLICIES as _POLICY_REGISTRY
from .rotasched.slo import DEFAULT_SLO, MAX_SLO_MS, MIN_SLO_MS, ROTARY_KV_DTYPES
from .rotasched.vlt import VltParams

if TYPE_CHECKING:
    from .rotasched.slo_conventions import SloConventions

_VLT = VltParams()  # the paper's VLT defaults, defined once in rotasched.vlt

CONFIG_ENV = "SUPERINFER_SGL_CONFIG"
# The test and debug knobs' environment variables (config field -> variable), read once by the launcher.
TEST_KNOB_ENV = {
    "test_rotate_interval": "SUPERINFER_TEST_ROTATE_INTERVAL",
    "test_hold_rotary_iters": "SUPERINFER_TEST_HOLD_ROTARY_ITERS",
    "verify_rotation": "SUPERINFER_VERIFY_ROTATION",
}
SCHEDULERS = ("rotasched", "sglang")
POLICIES = _POLICY_REGISTRY.names()
KV_TRANSFERS = ("auto", "triton-dma", "triton-dma-serial", "triton-direct", "triton-hybrid", "naive", "torch")
# Host rotary block dtype: auto = the device KV dtype (bits copied exactly, the default); fp8_e4m3 =
# quantized blocks with per-block, per-head scales (duplexkv/quant.py; lossy, opt-in); int4 = 4-bit
# codes with a scale byte per 32 values of a row (duplexkv/quant_int4.py; lossy, opt-in). Also a
# class's "rotary_kv_dtype" in --slo-classes (rotasched/slo.py, where the tuple lives so that the
# class parser needs no import of config), which overrides this flag: ROTARY_KV_DTYPES, imported above.
# Prefix cache: radix = SGLang's radix cache with its --radix-eviction-policy; predictive = the
# same tree evicting by predicted reuse with a bounded pin set (docs/prefix_cache.md).
PREFIX_CACHES = ("radix", "predictive")
# A running batch short of decode memory (SGLang's check_decode_mem): rotate = rotate requests out to
# host (KV kept) and let SGLang retract only what rotation cannot take (integration/decode_shortage.py);
# retract = SGLang's own retract-and-recompute (the behaviour before; for A/Bs).
DECODE_SHORTAGES = ("rotate", "retract")
ROTARY_KV_DTYPE_HELP = (
    "dtype of rotated-out KV in host memory. auto (default): the device KV dtype, copied bit-exactly; "
    "fp8_e4m3: quantized per block and KV head on the way out, dequantized on the way back: half the "
    "host bytes of bf16 (a quarter of float32), LOSSY: a rotated request's greedy output may diverge "
    "from bit-exact rotation (its measured effect: docs/duplexkv.md); int4: 4-bit codes with a scale "
    "byte per 32 values, about half of fp8's host bytes, LOSSIER (error up to about 8 percent of each group's "
    "largest value). Classes of --slo-classes may set their own (\"rotary_kv_dtype\"), which wins. "
    "Not with an fp8 --kv-cache-dtype, SUPERINFER_VERIFY_ROTATION=1 or --kv-transfer naive")


class ConfigError(ValueError):
    """An invalid value of one of our options."""


@dataclass(frozen=True)
class SuperInferConfig:
    scheduler: str = "rotasched"
    # goodput: serve first the requests that can still meet both SLOs (rotasched/goodput.py);
    # paper: the paper's Largest-VLT-First as published (plus the rotation quantum). The choices
    # are rotasched.planner.POLICIES.
    policy: str = "goodput"
    # The goodput policy's starvation bound: a best-effort request that has waited this long is first
    # in line for memory.
    max_best_effort_wait_ms: float = DEFAULT_MAX_BEST_EFFORT_WAIT_S * 1000.0
    # The goodput policy's TTFT shedding (rotasched.shedding.shed): a waiting request that would
    # make others miss their TTFT behind it, and has the most work of them, is served best-effort.
    ttft_shedding: bool = True
    ttft_slo_ms: float = DEFAULT_SLO.ttft_ms
    tbt_slo_ms: float = DEFAULT_SLO.tbt_ms
    slo_classes: str | None = None
    # The ecosystem's SLO conventions (rotasched/slo_conventions.py, docs/slo.md): overrides of
    # the built-in OpenAI service_tier and x-smg-priority mappings to our classes, and SGLang's
    # integer `priority` to classes by thresholds (None: priority is no SLO input).
    slo_service_tiers: str | None = None
    slo_gateway_classes: str | None = None
    slo_priority_classes: str | None = None
    vlt_alpha: float = _VLT.alpha
    vlt_beta_ttft: float = _VLT.beta_ttft
    vlt_beta_tbt: float = _VLT.beta_tbt
    # Rotation quantum: LVF may rotate a running request out only after it has run this long in
    # its current stint. The paper's rule (0) round-robins every request under sustained overload:
    # each rotation costs the server work, and every paused request misses TBT. None (auto): the
    # policy's default (rotasched.planner.quantum_s): 5 s with --policy paper, 20 measured
    # rotation costs with goodput.
    min_stint_ms: float | None = None
    # The decode reserve a running request keeps, as a share of SGLang's (all its remaining outputs
    # when fixed-length, ignore_eos; its decaying estimate when it may stop at EOS):
    # rotasched.planner.running_reserve_ratio.
    # None (auto): the policy's (0.4 with goodput, 1 with paper); 1 whenever rotation is off.
    running_reserve: float | None = None
    # None (auto): what the KV link, as measured at startup, moves in one measured decode step,
    # at most an eighth of the device KV pool (rotasched.planner.rotation_budget).
    rotation_budget_blocks: int | None = None
    rotary_block_tokens: int = 16
    rotary_pool_gb: float | None = None
    kv_transfer: str = "auto"
    rotary_kv_dtype: str = "auto"
    # None (auto): on where KV copies run beside compute (a CUDA device: a side stream), off on
    # CPU, where every eager copy is synchronous and sits on the step's critical path for all
    # running requests while only the few rotated requests ever use it.
    eager_sync: bool | None = None
    prefetch: bool = True
    mixed_resume: bool = True
    mix_prefill: str = "always"  # rotasched.planner.MIX_PREFILL
    prefix_cache: str = "radix"
    # With --prefix-cache predictive: host tokens for demoted prefixes (integration/prefix_host.py);
    # 0: off; None (auto): as many tokens as the device KV pool, within an eighth of the free RAM.
    prefix_host_tokens: int | None = None
    # What answers a decode memory shortage of the running batch (DECODE_SHORTAGES); rotation off
    # (no engine): SGLang's retraction whatever this says.
    decode_shortage: str = "rotate"
    # Directory where scheduler ranks confirm that our hooks are live (set by the launcher).
    handshake_dir: str | None = None
    # Test and debug knobs (no flags; set from TEST_KNOB_ENV by the launcher, like SGLang's
    # SGLANG_TEST_RETRACT): rotate the first rotatable running request out every N iterations;
    # keep a rotated-out request rotary for at least K iterations; hash each request's KV bytes
    # when it rotates out and again once it is re-admitted.
    test_rotate_interval: int = 0
    test_hold_rotary_iters: int = 0
    verify_rotation: bool = False

    def __post_init__(self) -> None:
        if self.scheduler not in SCHEDULERS:
            raise ConfigError(f"--scheduler must be one of {SCHEDULERS}, got {self.scheduler!r}")
        if self.policy not in POLICIES:
            raise ConfigError(f"--policy must be one of {POLICIES}, got {self.policy!r}")
        _require(self.max_best_effort_wait_ms > 0, "max_best_effort_wait_ms", "must be > 0")
        if self.kv_transfer not in KV_TRANSFERS:
            raise ConfigError(f"--kv-transfer must be one of {KV_TRANSFERS}, got {self.kv_transfer!r}")
        if self.prefix_cache not in PREFIX_CACHES:
            raise ConfigError(f"--prefix-cache must be one of {PREFIX_CACHES}, got {self.prefix_cache!r}")
        if self.decode_shortage not in DECODE_SHORTAGES:
            raise ConfigError(f"--decode-shortage must be one of {DECODE_SHORTAGES}, got {self.decode_shortage!r}")
        for name in ("ttft_slo_ms", "tbt_slo_ms"):  # the bounds every SLO is held to (rotasched.slo)
            value = getattr(self, name)
            _require(math.isfinite(value) and MIN_SLO_MS <= value <= MAX_SLO_MS, name,
                     f"must be a number of milliseconds in [{MIN_SLO_MS:g}, {MAX_SLO_MS:g}]")
        _require(math.isfinite(self.vlt_alpha) and self.vlt_alpha > 0, "vlt_alpha", "must be a finite number > 0")
        for name in ("vlt_beta_ttft", "vlt_beta_tbt", "min_stint_ms"):
            value = getattr(self, name)
            if value is None:
                continue
            _require(math.isfinite(value) and value >= 0, name, "must be a finite number >= 0")
        if self.running_reserve is not None:
            _require(math.isfinite(self.running_reserve) and 0 < self.running_reserve <= 1, "running_reserve",
                     "must be in (0, 1]")
        if self.rotation_budget_blocks is not None:
            # 0 would leave what a decode shortage or a chunk's room rotates out stranded while anything ran
            _require(self.rotation_budget_blocks >= 1, "rotation_budget_blocks", "must be >= 1")
        _require(self.rotary_block_tokens >= 1, "rotary_block_tokens", "must be >= 1")
        if self.prefix_host_tokens is not None:
            _require(self.prefix_host_tokens >= 0, "prefix_host_tokens", "must be >= 0 (0: off) or auto")
        for name in ("test_rotate_interval", "test_hold_rotary_iters"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{TEST_KNOB_ENV[name]} must be >= 0, got {getattr(self, name)}")
        if self.rotary_pool_gb is not None:
            _require(math.isfinite(self.rotary_pool_gb) and self.rotary_pool_gb > 0, "rotary_pool_gb",
                     "must be a finite number > 0")
        if self.slo_classes is not None:
            from .rotasched.slo import Slo, SloClasses, SloError

            try:
                SloClasses.parse(self.slo_classes, default=Slo(self.ttft_slo_ms, self.tbt_slo_ms))
            except SloError as exc:
                raise ConfigError(f"--slo-classes: {exc}") from None
        self._check_rotary_kv_dtype()  # after --slo-classes parsed: it may set lossy formats per class
        if (self.slo_service_tiers, self.slo_gateway_classes, self.slo_priority_classes) != (None,) * 3:
            slo_conventions(self)  # a bad mapping is a ConfigError naming its flag

    def _check_rotary_kv_dtype(self) -> None:
        if self.rotary_kv_dtype not in ROTARY_KV_DTYPES:
            raise ConfigError(f"--rotary-kv-dtype must be one of {ROTARY_KV_DTYPES}, got {self.rotary_kv_dtype!r}")
        lossy = _lossy_setting(self)
        if lossy is None:
            return
        if self.verify_rotation:
            raise ConfigError(f"{lossy} is lossy, so the KV byte check of "
                              f"{TEST_KNOB_ENV['verify_rotation']}=1 cannot hold: unset one of them")
        if self.kv_transfer == "naive":
            raise ConfigError(f"{lossy} needs --kv-transfer auto, torch, "
                              "triton-dma or triton-direct (naive copies bits)")

    def class_rotary_kv_dtypes(self) -> dict[str, str]:
        """--slo-classes' class -> the precision its KV rotates at (inherited: --rotary-kv-dtype);
        the built-in classes when --slo-classes is unset."""
        from .rotasched.slo import DEFAULT_CLASSES, Slo, SloClasses

        classes = SloClasses.parse(self.slo_classes or DEFAULT_CLASSES, default=Slo(self.ttft_slo_ms, self.tbt_slo_ms))
        return classes.rotary_kv_dtypes(self.rotary_kv_dtype)

    def rotary_kv_formats(self) -> tuple[str, ...]:
        """The distinct rotation precisions in use (one host pool each): --rotary-kv-dtype (requests
        without a class) first, then the classes' in class order."""
        return tuple(dict.fromkeys([self.rotary_kv_dtype, *self.class_rotary_kv_dtypes().values()]))

    def to_env(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> "SuperInferConfig | None":
        raw = (environ if environ is not None else os.environ).get(CONFIG_ENV)
        if not raw:
            return None
        return cls(**json.loads(raw))


def slo_conventions(cfg: SuperInferConfig) -> SloConventions:
    """How the server reads the ecosystem's SLO conventions (docs/slo.md), from its options."""
    from .rotasched.slo import DEFAULT_CLASSES, Slo, SloClasses, SloError
    from .rotasched.slo_conventions import SloConventions

    classes = SloClasses.parse(cfg.slo_classes or DEFAULT_CLASSES, default=Slo(cfg.ttft_slo_ms, cfg.tbt_slo_ms))
    try:
        return SloConventions.parse(classes, service_tiers=cfg.slo_service_tiers,
                                    priority_classes=cfg.slo_priority_classes,
                                    gateway_classes=cfg.slo_gateway_classes)
    except SloError as exc:
        raise ConfigError(f"--{exc.field.replace('_', '-')}: {exc}") from None


def _require(ok: bool, name: str, what: str) -> None:
    if not ok:
        raise ConfigError(f"--{name.replace('_', '-')} {what}")


def _or_auto(kind: type) -> Callable[[str], object]:
    """An argparse type: `auto` (None: the server derives the value) or a number of `kind`."""
    def parse(text: str) -> object:
        if text == "auto":
            return None
        try:
            return kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected auto or a number, got {text!r}") from None
    parse.__name__ = f"{kind.__name__} or auto"
    return parse


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """Our options, in their own --help group."""
    d = SuperInferConfig()
    g = parser.add_argument_group("superinfer_sgl (RotaSched / DuplexKV)")
    g.add_argument("--scheduler", choices=SCHEDULERS, default=d.scheduler,
                   help="rotasched: SLO-aware rotary scheduling; sglang: SGLang's stock scheduling")
    g.add_argument("--policy", choices=POLICIES, default=d.policy,
                   help="goodput: requests that can still meet both SLOs first, TBT- and cost-aware "
                        "rotation, bounded starvation; paper: the paper's Largest-VLT-First")
    g.add_argument("--max-best-effort-wait-ms", type=float, default=d.max_best_effort_wait_ms,
                   help="goodput policy: a request that can no longer meet its SLOs is served "
                        "best-effort, and first in line for memory once it has waited this long")
    g.add_argument("--ttft-shedding", action=argparse.BooleanOptionalAction, default=d.ttft_shedding,
                   help="goodput policy: when the waiting requests, earliest deadline first, cannot all "
                        "get their first token in time, the ones with the most work (prompt, and decoding "
                        "where the length is fixed: ignore_eos) are served best-effort, so that more of "
                        "the others make it (Moore-Hodgson)")
    g.add_argument("--ttft-slo-ms", type=float, default=d.ttft_slo_ms, help="default TTFT SLO (ms)")
    g.add_argument("--tbt-slo-ms", type=float, default=d.tbt_slo_ms, help="default TBT SLO (ms)")
    g.add_argument("--slo-classes", default=d.slo_classes,
                   help="named SLO classes: a JSON object or a path to a JSON file")
    g.add_argument("--slo-service-tiers", default=d.slo_service_tiers, metavar="JSON",
                   help="OpenAI service_tier -> SLO class (null: the server default), over the "
                        "built-in {\"priority\": \"interactive\", \"default\": null, \"flex\": "
                        "\"batch\"} (auto follows default); a JSON object or a JSON file")
    g.add_argument("--slo-gateway-classes", default=d.slo_gateway_classes, metavar="JSON",
                   help="x-smg-priority header (Shepherd Model Gateway) -> SLO class, over the "
                        "built-in {\"system\": \"interactive\", \"interactive\": \"interactive\", "
                        "\"default\": null, \"bulk\": \"batch\"}; a JSON object or a JSON file")
    g.add_argument("--slo-priority-classes", default=d.slo_priority_classes, metavar="JSON",
                   help="map SGLang's integer request priority to SLO classes by thresholds: "
                        "'{\"0\": \"batch\", \"10\": \"interactive\"}' reads priority >= 10 as "
                        "interactive, 0..9 as batch, < 0 as the server default (default: priority "
                        "sets no SLO)")
    g.add_argument("--vlt-alpha", type=float, default=d.vlt_alpha, help="VLT weight of rotary requests")
    g.add_argument("--vlt-beta-ttft", type=float, default=d.vlt_beta_ttft, help="VLT TTFT slack fraction")
    g.add_argument("--vlt-beta-tbt", type=float, default=d.vlt_beta_tbt, help="VLT TBT slack fraction")
    g.add_argument("--min-stint-ms", type=_or_auto(float), default=d.min_stint_ms, metavar="{MS,auto}",
                   help="rotation quantum: a running request is not rotated out before it has run "
                        "this long in its current stint (0: the paper's rule, any running request; "
                        "auto, the default: 5000 with --policy paper, 20 measured rotation costs "
                        "with goodput)")
    g.add_argument("--running-reserve", type=_or_auto(float), default=d.running_reserve, metavar="{SHARE,auto}",
                   help="decode memory a running request keeps back, as a share of SGLang's reserve (all its "
                        "remaining outputs with ignore_eos, else SGLang's decaying estimate); below 1 more requests share "
                        "the device KV pool and LVF rotates one out to host memory when it runs short "
                        "(auto, the default: 0.4 with goodput, 1 with paper; 1 whenever rotation is off)")
    g.add_argument("--rotation-budget-blocks", type=_or_auto(int), default=d.rotation_budget_blocks,
                   metavar="{N,auto}",
                   help="B_xfer: rotation blocks moved per iteration in each direction (auto, the "
                        "default: what the KV link, measured at startup, moves in one measured "
                        "decode step, at most 1/8 of the device KV pool; the paper's 2400, so "
                        "capped, until a step is measured)")
    g.add_argument("--rotary-block-tokens", type=int, default=d.rotary_block_tokens,
                   help="tokens per host rotation block")
    g.add_argument("--rotary-pool-gb", type=float, default=d.rotary_pool_gb,
                   help="host memory for rotated-out KV (default: derived from free RAM)")
    g.add_argument("--kv-transfer", choices=KV_TRANSFERS, default=d.kv_transfer,
                   help="KV copy path between device and host pools (auto: on CUDA the fastest of the "
                        "triton paths by a startup probe that also checks each round trip's bytes; "
                        "docs/duplexkv.md)")
    g.add_argument("--rotary-kv-dtype", choices=ROTARY_KV_DTYPES, default=d.rotary_kv_dtype,
                   help=ROTARY_KV_DTYPE_HELP)
    g.add_argument("--eager-sync", action=argparse.BooleanOptionalAction, default=d.eager_sync,
                   help="copy filled KV blocks of running requests to host in the background, so "
                        "rotating a request out moves only its unsynced tail (default: on with CUDA, "
                        "where the copies overlap compute; off on CPU, where they would not)")
    g.add_argument("--prefetch", action=argparse.BooleanOptionalAction, default=d.prefetch,
                   help="start copying back, one iteration early, the rotary request LVF ranks next "
                        "into device memory no one else needs this iteration (one request at a time)")
    g.add_argument("--mixed-resume", action=argparse.BooleanOptionalAction, default=d.mixed_resume,
                   help="with rotasched, enable SGLang's mixed chunked prefill so a resumed request's "
                        "one-token extend rides along with the decode batch instead of stalling it; other "
                        "prefills ride along too, as --mix-prefill says (a mixed step keeps the running "
                        "requests' pace and makes a new request's first token a little later)")
    g.add_argument("--mix-prefill", choices=MIX_PREFILL, default=d.mix_prefill,
                   help="with mixed chunk: always (default) mixes every prefill; needed runs a prefill "
                        "alone when nobody else waits and no running request would miss its next gap "
                        "for it, so its first token comes sooner, as on stock SGLang (goodput only; "
                        "docs/results.md)")
    g.add_argument("--prefix-cache", choices=PREFIX_CACHES, default=d.prefix_cache,
                   help="radix (default): SGLang's radix cache, evicting by --radix-eviction-policy; "
                        "predictive: the same tree (on SGLang's Python tree core) evicting by each "
                        "prefix's predicted reuse, learned online from its hit history, with the "
                        "top-predicted prefixes pinned within a quarter of the KV pool "
                        "(docs/prefix_cache.md)")
    g.add_argument("--prefix-host-tokens", type=_or_auto(int), default=d.prefix_host_tokens, metavar="{N,auto}",
                   help="with --prefix-cache predictive: host memory, in tokens, for prefixes predicted to "
                        "come back, which eviction then copies to host (DuplexKV) instead of dropping and a "
                        "later match copies back, bytes identical (0: off; auto, the default: as many tokens "
                        "as the device KV pool, within 1/8 of the free RAM split among the node's scheduler "
                        "processes; one rank and an MHA pool only, "
                        "docs/prefix_cache.md)")
    g.add_argument("--decode-shortage", choices=DECODE_SHORTAGES, default=d.decode_shortage,
                   help="when the running batch is short of KV memory for its next decode step: rotate "
                        "(default) moves requests' KV to host memory (kept, resumed later) and leaves "
                        "SGLang's retract-and-recompute only what rotation cannot take (host pool full, "
                        "a request not rotatable); retract: SGLang's retraction alone")


def knobs_from_env(environ: dict[str, str] | None = None) -> dict[str, int | bool]:
    """The test and debug knobs set in the environment (TEST_KNOB_ENV), as config fields."""
    env = environ if environ is not None else os.environ
    knobs: dict[str, int | bool] = {}
    for name, var in TEST_KNOB_ENV.items():
        raw = (env.get(var) or "").strip()
        if not raw:
            continue
        if name == "verify_rotation":
            knobs[name] = raw == "1"
            continue
        try:
            knobs[name] = int(raw)
        except ValueError:
            raise ConfigError(f"{var} must be an integer, got {raw!r}") from None
    return knobs


def _lossy_setting(cfg: SuperInferConfig) -> str | None:
    """The first lossy rotation precision set, named as the user set it (the flag, or a class of
    --slo-classes), or None when every rotation is exact."""
    if cfg.rotary_kv_dtype != "auto":
        return f"--rotary-kv-dtype {cfg.rotary_kv_dtype}"
    for name, fmt in cfg.class_rotary_kv_dtypes().items():
        if fmt != "auto":
            return f"--slo-classes class {name!r} rotary_kv_dtype {fmt}"
    return None


def check_rotary_kv_dtype(cfg: SuperInferConfig, kv_cache_dtype: str | None) -> None:
    """Launch-time check against SGLang's --kv-cache-dtype: an fp8 device cache is 1 byte already."""
    lossy = _lossy_setting(cfg)
    if lossy is not None and (kv_cache_dtype or "").startswith("fp8"):
        raise ConfigError(f"{lossy} quantizes a 16/32-bit KV cache; with "
                          f"--kv-cache-dtype {kv_cache_dtype} the device KV is fp8 already (use auto)")


def check_prefix_cache(cfg: SuperInferConfig, eviction_policy: str | None, radix_disabled: bool,
                       model_parallel: dict[str, int] | None = None) -> None:
    """Launch-time check against SGLang's radix-cache flags: the predictive cache is an eviction
    policy on SGLang's radix tree, so it replaces --radix-eviction-policy and needs the tree; and
    against model parallelism (`model_parallel`: flag -> size), whose ranks each keep a tree: ours
    scores nodes by each rank's own clock, so their trees (and batches) could part."""
    if cfg.prefix_cache != "predictive":
        return
    for flag, size in (model_parallel or {}).items():
        if size > 1:
            raise ConfigError(f"--prefix-cache predictive with {flag} {size}: each rank would evict by its own "
                              "clock-based scores and the ranks' radix trees could diverge; use SGLang's "
                              "--radix-eviction-policy with model parallelism")
    if eviction_policy is not None:
        raise ConfigError(f"--prefix-cache predictive evicts by predicted reuse in place of SGLang's "
                          f"--radix-eviction-policy {eviction_policy}: drop one of the two")
    if radix_disabled:
        raise ConfigError("--prefix-cache predictive needs SGLang's radix cache: drop --disable-radix-cache")


def check_prefix_host(cfg: SuperInferConfig) -> None:
    """--prefix-host-tokens is the predictive cache's host tier."""
    if cfg.prefix_host_tokens and cfg.prefix_cache != "predictive":
        raise ConfigError(f"--prefix-host-tokens {cfg.prefix_host_tokens} is the host tier of --prefix-cache "
                          "predictive: add that, or drop the option")


def from_namespace(ns: argparse.Namespace, environ: dict[str, str] | None = None) -> SuperInferConfig:
    """Our options from the parsed command line, plus the test knobs from the environment."""
    names = {f.name for f in fields(SuperInferConfig)} - {"handshake_dir"} - set(TEST_KNOB_ENV)
    return SuperInferConfig(**{n: getattr(ns, n) for n in names}, **knobs_from_env(environ))
