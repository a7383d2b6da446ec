"""The ecosystem's SLO conventions, folded into our own per-request SLO keys.

Clients and gateways state latency wishes in several ways besides our `custom_params` keys
(`slo_class`, `ttft_slo_ms`, `tbt_slo_ms`, rotasched.slo):

- OpenAI's `service_tier` request field (`auto`, `default`, `flex`, `priority`, ...);
- SGLang's own integer `priority` request field (mapped only when the operator configures it);
- the Shepherd Model Gateway's class header `x-smg-priority` (`system`, `interactive`,
  `default`, `bulk`; the gateway formerly known as sgl-model-gateway / sglang-router);
- the Kubernetes Gateway API inference extension's per-request SLO headers `x-slo-ttft-ms` and
  `x-slo-tpot-ms` (milliseconds; its TPOT is the inter-token latency, our TBT).

`fold_conventions` turns all of them into our keys, with one precedence order (docs/slo.md):

    TTFT / TBT:  custom_params.ttft_slo_ms / tbt_slo_ms
                 > x-slo-ttft-ms / x-slo-tpot-ms header
                 > the request's class (below) > the server default
    class:       custom_params.slo_class > x-smg-priority header > service_tier
                 > priority (when mapped) > none (the server default SLO)

A convention whose value maps to no class (service_tier `auto`/`default`, x-smg-priority
`default`, a priority below every threshold) states no preference and defers to the next one.
Every convention a request carries is validated, whether or not it wins: a bad value is an
SloConventionError naming the field or header.

Pure Python, standard library only: the HTTP layer (integration.http_slo) gathers the inputs.
"""

from __future__ import annotations

import math
import re
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from .slo import (MAX_SLO_MS, MIN_SLO_MS, NUMBER, SLO_CLASS_KEY, TBT_KEY, TTFT_KEY, Slo, SloClasses, SloError,
                  check_slo_keys, load_json, resolve_slo)

SERVICE_TIER_FIELD = "service_tier"
PRIORITY_FIELD = "priority"
TTFT_HEADER = "x-slo-ttft-ms"
TPOT_HEADER = "x-slo-tpot-ms"
GATEWAY_CLASS_HEADER = "x-smg-priority"
HEADERS = (TTFT_HEADER, TPOT_HEADER, GATEWAY_CLASS_HEADER)

# OpenAI service tier -> our class (None: the server default). `auto` means "the project's
# default tier" in OpenAI's API, so it follows `default` unless the operator maps it itself.
DEFAULT_SERVICE_TIERS: Mapping[str, str | None] = MappingProxyType(
    {"default": None, "priority": "interactive", "flex": "batch"})
# Shepherd Model Gateway class -> our class. SMG treats a missing header as `default`.
DEFAULT_GATEWAY_CLASSES: Mapping[str, str | None] = MappingProxyType(
    {"system": "interactive", "interactive": "interactive", "default": None, "bulk": "batch"})

_INTEGER = re.compile(r"[+-]?\d+", re.ASCII)


class SloConventionError(SloError):
    """A bad value of one SLO convention: `field` is the request field or header it came in."""

    def __init__(self, field: str, message: str, *, header: bool = False) -> None:
        ValueError.__init__(self, f"invalid SLO {'header' if header else 'field'} {field!r}: {message}")
        self.field = field
        self.header = header


@dataclass(frozen=True)
class SloConventions:
    """How this server reads the conventions: the operator's mappings to its SLO classes."""

    service_tiers: Mapping[str, str | None] = field(default_factory=lambda: DEFAULT_SERVICE_TIERS)
    gateway_classes: Mapping[str, str | None] = field(default_factory=lambda: DEFAULT_GATEWAY_CLASSES)
    # (lowest priority of the band, class) ascending; empty: `priority` is not an SLO input.
    priority_bands: tuple[tuple[int, str | None], ...] = ()

    @classmethod
    def parse(cls, classes: Collection[str], *, service_tiers: str | None = None,
              priority_classes: str | None = None, gateway_classes: str | None = None) -> SloConventions:
        """The server's conventions from its options (each a JSON object or a path to one).

        `service_tiers` and `gateway_classes` override entries of the built-in mappings (a value
        of null: the server default); every class they name must be one of `classes`. A built-in
        entry naming a class this server does not define means the server default.
        `priority_classes` maps band thresholds to classes: {"0": "batch", "10": "interactive"}
        reads priority >= 10 as interactive, 0..9 as batch, < 0 as the server default.
        SloError names the option (`slo_service_tiers`, ...) on a bad value.
        """
        known = set(classes)
        tiers = _builtin(DEFAULT_SERVICE_TIERS, known)
        tiers.update(_class_map("slo_service_tiers", service_tiers, known, lower=False))
        gateway = _builtin(DEFAULT_GATEWAY_CLASSES, known)
        gateway.update(_class_map("slo_gateway_classes", gateway_classes, known, lower=True))
        bands: list[tuple[int, str | None]] = []
        if priority_classes is not None:
            raw = _class_map("slo_priority_classes", priority_classes, known, lower=False)
            if not raw:
                raise SloError("slo_priority_classes", "expected at least one threshold")
            seen: dict[int, str] = {}
            for key, name in raw.items():
                if not _INTEGER.fullmatch(key.strip()):
                    raise SloError("slo_priority_classes", f"threshold {key!r} is not an integer")
                threshold = int(key)
                if threshold in seen:
                    raise SloError("slo_priority_classes", f"thresholds {seen[threshold]!r} and {key!r} are equal")
                seen[threshold] = key
                bands.append((threshold, name))
            bands.sort(key=lambda band: band[0])
        return cls(MappingProxyType(tiers), MappingProxyType(gateway), tuple(bands))

    def tier_class(self, tier: object) -> str | None:
        """The class of an OpenAI `service_tier` value (None: no preference)."""
        if not isinstance(tier, str):
            raise SloConventionError(SERVICE_TIER_FIELD, f"expected a string, got {type(tier).__name__}")
        if tier in self.service_tiers:
            return self.service_tiers[tier]
        if tier == "auto" and "default" in self.service_tiers:
            return self.service_tiers["default"]
        known = sorted({*self.service_tiers, *(["auto"] if "default" in self.service_tiers else [])})
        raise SloConventionError(SERVICE_TIER_FIELD, f"unknown service tier {tier!r}; known: {known}")

    def gateway_class(self, value: str) -> str | None:
        """The class of an `x-smg-priority` header value (case-insensitive, trimmed)."""
        key = value.strip().lower()
        if key in self.gateway_classes:
            return self.gateway_classes[key]
        raise SloConventionError(GATEWAY_CLASS_HEADER, f"unknown class {value!r}; known: "
                                 f"{sorted(self.gateway_classes)}", header=True)

    def priority_class(self, priority: object) -> str | None:
        """The class of SGLang's integer `priority`: that of the highest threshold <= priority."""
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise SloConventionError(PRIORITY_FIELD, f"expected an integer, got {type(priority).__name__}")
        chosen: str | None = None
        for threshold, name in self.priority_bands:
            if priority < threshold:
                break
            chosen = name
        return chosen

    @property
    def maps_priority(self) -> bool:
        return bool(self.priority_bands)


def header_ms(header: str, raw: str) -> float:
    """A header's number of milliseconds: finite and > 0, or SloConventionError naming it."""
    text = raw.strip()
    if not NUMBER.fullmatch(text):
        raise SloConventionError(header, f"expected a number of milliseconds, got {raw!r}", header=True)
    ms = float(text)
    if not math.isfinite(ms) or ms <= 0:
        raise SloConventionError(header, f"must be a finite number of milliseconds > 0, got {raw!r}",
                                 header=True)
    if ms < MIN_SLO_MS:
        raise SloConventionError(header, f"must be at least {MIN_SLO_MS:g} ms, got {raw!r}", header=True)
    if ms > MAX_SLO_MS:
        raise SloConventionError(header, f"must be at most {MAX_SLO_MS:.0e} ms, got {raw!r}", header=True)
    return ms


def fold_conventions(conv: SloConventions, custom_params: object, *,
                     headers: Mapping[str, str] | None = None, service_tier: object = None,
                     priority: object = None) -> object:
    """`custom_params` with the request's SLO conventions folded into our keys (module doc).

    `headers`: the request's headers by lower-case name (only HEADERS are read; an empty value
    counts as absent); `service_tier`, `priority`: the request's fields (None: absent; `priority`
    is read only when the server maps it). Returns `custom_params` itself when nothing is
    folded, else a new dict; a `custom_params` that is not an object is returned as it is, for
    resolve_slo to reject. Raises SloConventionError on a bad convention value.
    """
    headers = headers or {}
    ttft_raw, tpot_raw = headers.get(TTFT_HEADER, "").strip(), headers.get(TPOT_HEADER, "").strip()
    gateway_raw = headers.get(GATEWAY_CLASS_HEADER, "").strip()
    ttft = header_ms(TTFT_HEADER, ttft_raw) if ttft_raw else None
    tbt = header_ms(TPOT_HEADER, tpot_raw) if tpot_raw else None
    # Lower precedence first, so the last one set wins; each is validated even if it loses.
    cls = conv.priority_class(priority) if priority is not None and conv.maps_priority else None
    if service_tier is not None:
        cls = conv.tier_class(service_tier) or cls
    if gateway_raw:
        cls = conv.gateway_class(gateway_raw) or cls
    if cls is None and ttft is None and tbt is None:
        return custom_params
    if custom_params is not None and not isinstance(custom_params, Mapping):
        return custom_params
    params = dict(custom_params or {})
    changed = False
    for key, value in ((SLO_CLASS_KEY, cls), (TTFT_KEY, ttft), (TBT_KEY, tbt)):
        if value is not None and params.get(key) is None:  # an explicit custom_params key wins
            params[key] = value
            changed = True
    return params if changed else custom_params


def resolve_request_slo(conv: SloConventions, default: Slo, classes: SloClasses, custom_params: object,
                        **conventions: object) -> tuple[Slo, str | None]:
    """The SLO (and class name) the scheduler will give a request: fold, check_slo_keys, then
    resolve_slo (the tokenizer's checks, integration.hooks)."""
    params = fold_conventions(conv, custom_params, **conventions)  # type: ignore[arg-type]
    check_slo_keys(params)
    slo = resolve_slo(params, default, classes)  # type: ignore[arg-type]
    name = params.get(SLO_CLASS_KEY) if isinstance(params, Mapping) else None
    return slo, name if isinstance(name, str) else None


def _builtin(mapping: Mapping[str, str | None], known: set[str]) -> dict[str, str | None]:
    return {key: (name if name in known else None) for key, name in mapping.items()}


def _class_map(option: str, text_or_path: str | None, known: set[str], *, lower: bool) -> dict[str, str | None]:
    """A JSON object (inline or a file) of key -> class name or null, every class known."""
    if text_or_path is None:
        return {}
    raw = load_json(text_or_path, option)
    if not isinstance(raw, dict):
        raise SloError(option, "expected a JSON object of value -> class name (or null)")
    out: dict[str, str | None] = {}
    for key, name in raw.items():
        norm = key.strip().lower() if lower else key
        if not norm:
            raise SloError(option, "keys must be non-empty")
        if norm in out:
            raise SloError(option, f"key {key!r} is given twice")
        if name is not None and not isinstance(name, str):
            raise SloError(option, f"{key!r}: expected a class name or null, got {type(name).__name__}")
        if name is not None and name not in known:
            raise SloError(option, f"{key!r}: unknown class {name!r}; known: {sorted(known)}")
        out[norm] = name
    return out
