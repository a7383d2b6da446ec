"""Per-request SLOs: server default, named SLO classes, and per-request overrides.

A request selects its SLO through SGLang's `custom_params` with our keys only:
`slo_class` (a class name), `ttft_slo_ms` and `tbt_slo_ms` (explicit overrides).

`custom_params` is shared with SGLang and other tools (thinking_budget, custom logit processor
parameters, ...), so unknown keys in general pass. A key that looks like one of ours but is not
(`check_slo_keys`: it has `slo` as a word of its name, e.g. `slo_clas`, `SLO_CLASS`, `sloClass`,
`tpot_slo_ms`, `x-slo-ttft-ms`) is refused, naming the key and ours: a misspelt SLO would
otherwise silently give the request the default SLO.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

SLO_CLASS_KEY = "slo_class"
TTFT_KEY = "ttft_slo_ms"
TBT_KEY = "tbt_slo_ms"

# The longest SLO a request or a class may ask for: 1e9 ms, 11.6 days. A longer one means "no SLO"
# in practice, and the policy's arithmetic (deadlines, slack divided by weights, a prefill budget
# divided by a per-token cost) overflows to inf on values near the float range (1e308 ms was
# accepted before), which would order requests by NaN or fail an int() in the scheduler.
MAX_SLO_MS = 1e9
# The shortest: 0.001 ms. Below ~1e-321 ms the policy's seconds (ms / 1000) are 0.0, which the views
# refuse by assertion inside the scheduler; nothing served is within a microsecond anyway.
MIN_SLO_MS = 1e-3
# A class weight's range: the policy divides slack by weights and multiplies work by them, so a
# weight near the float range's ends (1e-310, 1e308 were accepted) ranked its class at +-inf, out of
# deadline order; a millionfold between classes says all a weight can.
MIN_WEIGHT, MAX_WEIGHT = 1e-3, 1e3
# A number of milliseconds as text (a header, or a string in `custom_params`): ASCII decimal, no
# "_" separators; the sign is allowed so "-5" reads as "must be > 0".
NUMBER = re.compile(r"[+-]?(\d+(\.\d*)?|\.\d+)([eE][+-]?\d+)?", re.ASCII)

DEFAULT_CLASSES = json.dumps(
    {
        "interactive": {"ttft_ms": 1000, "tbt_ms": 50},
        "standard": {"ttft_ms": 5000, "tbt_ms": 100},
        "batch": {"ttft_ms": 30000, "tbt_ms": 500},
    }
)


class SloError(ValueError):
    """A bad SLO setting; `field` names the offending key so the client can fix it."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"invalid SLO field {field!r}: {message}")
        self.field = field


SLO_KEYS = (SLO_CLASS_KEY, TTFT_KEY, TBT_KEY)
# camelCase and acronyms: sloClass, SLOClass, TTFTSloMs -> slo class, slo class, ttft slo ms
_CAMEL = re.compile(r"(?<=[a-z0-9])(?=[A-Z])|(?<=[A-Z])(?=[A-Z][a-z])")
_WORD_SEP = re.compile(r"[^a-z0-9]+")


_LATENCY_WORDS = ("ttft", "tbt", "tpot")


def looks_like_slo_key(key: str) -> bool:
    """Whether `key` reads as an SLO key: `slo` is one of its words (split at non-alphanumerics,
    camelCase and acronyms), or its first word starts with ttft, tbt or tpot (an acronym run such
    as TBTSLO is one word). `slo_clas`, `ttft-slo-ms`, `sloClass`, `SLOClass`, `TBTSLOMs`,
    `ttft_ms`, `tpot_slo_ms` yes; `slot_id`, `isolation`, `thinking_budget` no."""
    words = [w for w in _WORD_SEP.split(_CAMEL.sub("_", key).lower()) if w]
    return "slo" in words or (bool(words) and words[0].startswith(_LATENCY_WORDS))


def check_slo_keys(custom_params: object) -> None:
    """SloError naming the first key of `custom_params` that looks like an SLO key
    (looks_like_slo_key) but is not one of SLO_KEYS; other keys are not ours to judge."""
    if not isinstance(custom_params, Mapping):
        return  # resolve_slo names a custom_params that is not an object
    for key in custom_params:
        if isinstance(key, str) and key not in SLO_KEYS and looks_like_slo_key(key):
            raise SloError(key, f"unknown SLO key; the SLO keys are {', '.join(SLO_KEYS)} (keys "
                           "with 'slo' as a word, or starting with ttft, tbt or tpot, are reserved for SLOs)")


def _positive(field: str, value: object) -> float:
    """A weight: a finite number in MIN_WEIGHT..MAX_WEIGHT, or SloError naming `field`."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise SloError(field, f"expected a number, got {type(value).__name__}")
    try:
        number = float(value)
    except OverflowError:  # an integer beyond the float range
        raise SloError(field, "number is too large") from None
    if not math.isfinite(number) or number <= 0:
        raise SloError(field, f"must be finite and > 0, got {value}")
    if not MIN_WEIGHT <= number <= MAX_WEIGHT:
        raise SloError(field, f"must be within {MIN_WEIGHT:g}..{MAX_WEIGHT:g}, got {value}")
    return number


def _positive_ms(field: str, value: object) -> float:
    """A finite number of milliseconds, at least MIN_SLO_MS, or SloError naming `field`."""
    if isinstance(value, bool):  # bool is an int subclass: True would read as 1 ms
        raise SloError(field, f"expected a number of milliseconds, got bool {value}")
    if isinstance(value, str):
        if not NUMBER.fullmatch(value.strip()):
            raise SloError(field, f"expected a number of milliseconds, got {value!r}")
        value = float(value.strip())
    if not isinstance(value, (int, float)):
        raise SloError(field, f"expected a number of milliseconds, got {type(value).__name__}")
    try:
        ms = float(value)
    except OverflowError:
        raise SloError(field, "number is too large") from None
    if not math.isfinite(ms) or ms <= 0:
        raise SloError(field, f"must be finite and > 0, got {ms}")
    if ms < MIN_SLO_MS:
        raise SloError(field, f"must be at least {MIN_SLO_MS:g} ms, got {ms!r}")
    return ms


def _slo_ms(field: str, value: object) -> float:
    """An SLO a request or class asks for: a positive number of milliseconds up to MAX_SLO_MS."""
    ms = _positive_ms(field, value)
    if ms > MAX_SLO_MS:
        raise SloError(field, f"must be at most {MAX_SLO_MS:.0e} ms, got {ms!r}")
    return ms


@dataclass(frozen=True, slots=True)
class Slo:
    """Latency targets of one request: time to first token and time between tokens; `weight`:
    its class's weight in the goodput policy (who wins when not every request can be on time)."""

    ttft_ms: float
    tbt_ms: float
    weight: float = 1.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "ttft_ms", _positive_ms("ttft_ms", self.ttft_ms))
        object.__setattr__(self, "tbt_ms", _positive_ms("tbt_ms", self.tbt_ms))
        object.__setattr__(self, "weight", _positive("weight", self.weight))

    @property
    def ttft_s(self) -> float:
        return self.ttft_ms / 1000.0

    @property
    def tbt_s(self) -> float:
        return self.tbt_ms / 1000.0


DEFAULT_SLO = Slo(ttft_ms=5000.0, tbt_ms=100.0)  # paper defaults: TTFT 5 s, TBT 100 ms


ROTARY_KV_DTYPE_KEY = "rotary_kv_dtype"
# The KV precisions of rotated-out requests (--rotary-kv-dtype and a class's rotary_kv_dtype); defined
# here, where classes are parsed, and re-exported by config (which imports this module).
ROTARY_KV_DTYPES = ("auto", "fp8_e4m3", "int4")


class SloClasses(Mapping[str, Slo]):
    """Named SLO classes (e.g. interactive chat vs batch extraction) served by one server.

    A class may also name the precision its requests' KV rotates at (`rotary_kv_dtypes`: class ->
    a --rotary-kv-dtype value, config.ROTARY_KV_DTYPES); a class without one inherits the server's
    --rotary-kv-dtype (rotary_kv_dtype(name, default))."""

    def __init__(self, classes: Mapping[str, Slo], rotary_kv_dtypes: Mapping[str, str] | None = None) -> None:
        self._classes = dict(classes)
        self._kv_dtypes = dict(rotary_kv_dtypes or {})
        stray = sorted(set(self._kv_dtypes) - set(self._classes))
        if stray:
            raise SloError(f"{stray[0]}.{ROTARY_KV_DTYPE_KEY}", "no such class")

    def rotary_kv_dtype(self, name: str | None, default: str) -> str:
        """The KV precision a request of class `name` rotates at: its class's, else `default` (the
        server's --rotary-kv-dtype; also for no class or a class this server does not know)."""
        return self._kv_dtypes.get(name, default) if name is not None else default

    def rotary_kv_dtypes(self, default: str) -> dict[str, str]:
        """Every class's rotation precision, inherited ones resolved to `default`."""
        return {name: self.rotary_kv_dtype(name, default) for name in self._classes}

    def kv_formats(self, default: str) -> tuple[str, ...]:
        """The distinct rotation precisions in use: `default` (requests without a class) first,
        then the classes' in class order."""
        return tuple(dict.fromkeys([default, *self.rotary_kv_dtypes(default).values()]))

    def __getitem__(self, name: str) -> Slo:
        return self._classes[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._classes)

    def __len__(self) -> int:
        return len(self._classes)

    def __repr__(self) -> str:
        extra = f", rotary_kv_dtypes={self._kv_dtypes!r}" if self._kv_dtypes else ""
        return f"SloClasses({self._classes!r}{extra})"

    @classmethod
    def parse(cls, text_or_path: str, default: Slo = DEFAULT_SLO) -> SloClasses:
        """Read a JSON object (inline, or a path to a file) of name -> {ttft_ms, tbt_ms, weight,
        rotary_kv_dtype}.

        A class may omit one of the two SLO keys; it then falls back to `default`. `weight`
        (optional, default 1) scales the class's urgency in the goodput policy. `rotary_kv_dtype`
        (optional: auto, fp8_e4m3 or int4) is the precision its requests' KV rotates at; without
        it the class inherits --rotary-kv-dtype.
        """
        raw = load_json(text_or_path)
        if not isinstance(raw, dict):
            raise SloError("slo_classes", "expected a JSON object of name -> {ttft_ms, tbt_ms}")
        classes = {name: _parse_class(name, body, default) for name, body in raw.items()}
        kv_dtypes = {name: _kv_dtype(name, body[ROTARY_KV_DTYPE_KEY]) for name, body in raw.items()
                     if ROTARY_KV_DTYPE_KEY in body}
        return cls(classes, kv_dtypes)


def load_json(text_or_path: str, option: str = "slo_classes") -> object:
    """A JSON value given inline (starting with { or [) or as a path to a file; SloError naming
    `option` (the flag it came from) when it is neither."""
    text = text_or_path.strip()
    if not text.startswith(("{", "[")):
        try:
            text = Path(text).read_text(encoding="utf-8-sig")  # -sig: editors that write a BOM
        except UnicodeDecodeError as e:
            raise SloError(option, f"file {text_or_path!r} is not UTF-8 text: {e}") from None
        except (OSError, ValueError) as e:  # ValueError: a NUL byte in the path
            raise SloError(option, f"not a JSON object and not a readable file: {e}") from None
    try:
        return json.loads(text, object_pairs_hook=_unique_keys)
    except json.JSONDecodeError as e:
        raise SloError(option, f"bad JSON: {e}") from None
    except _DuplicateKey as e:
        raise SloError(option, str(e)) from None
    except RecursionError:
        raise SloError(option, "bad JSON: nested too deeply") from None


class _DuplicateKey(ValueError):
    pass


def _unique_keys(pairs: list[tuple[str, object]]) -> dict[str, object]:
    """A JSON object whose keys are all different: json.loads would keep the last of two equal
    keys silently, so a class or mapping entry given twice (a copy-paste slip) would lose one."""
    out: dict[str, object] = {}
    for key, value in pairs:
        if key in out:
            raise _DuplicateKey(f"key {key!r} is given twice")
        out[key] = value
    return out


def _parse_class(name: str, body: object, default: Slo) -> Slo:
    if not name:
        raise SloError("slo_classes", "class name must be non-empty")
    if not isinstance(body, dict):
        raise SloError(name, "expected an object with ttft_ms and/or tbt_ms")
    unknown = sorted(set(body) - {"ttft_ms", "tbt_ms", "weight", ROTARY_KV_DTYPE_KEY})
    if unknown:
        raise SloError(f"{name}.{unknown[0]}", f"unknown key; expected ttft_ms, tbt_ms, weight or {ROTARY_KV_DTYPE_KEY}")
    if not body.keys() & {"ttft_ms", "tbt_ms"}:
        raise SloError(name, "set ttft_ms, tbt_ms or both")
    ttft = _slo_ms(f"{name}.ttft_ms", body["ttft_ms"]) if "ttft_ms" in body else default.ttft_ms
    tbt = _slo_ms(f"{name}.tbt_ms", body["tbt_ms"]) if "tbt_ms" in body else default.tbt_ms
    return Slo(ttft, tbt, _positive(f"{name}.weight", body.get("weight", 1.0)))


def _kv_dtype(name: str, value: object) -> str:
    if not isinstance(value, str) or value not in ROTARY_KV_DTYPES:
        raise SloError(f"{name}.{ROTARY_KV_DTYPE_KEY}",
                       f"expected one of {', '.join(ROTARY_KV_DTYPES)} (auto: exact), got {value!r}")
    return value


def resolve_slo(
    custom_params: Mapping[str, object] | None, default: Slo, classes: SloClasses
) -> Slo:
    """The SLO of one request: class first, then explicit keys override; other keys ignored.

    A key whose value is None counts as absent (clients often send JSON nulls).
    """
    if custom_params is None:
        return default
    if not isinstance(custom_params, Mapping):
        raise SloError("custom_params", f"expected an object, got {type(custom_params).__name__}")
    base = default
    name = custom_params.get(SLO_CLASS_KEY)
    if name is not None:
        if not isinstance(name, str):
            raise SloError(SLO_CLASS_KEY, f"expected a class name, got {type(name).__name__}")
        if name not in classes:
            raise SloError(SLO_CLASS_KEY, f"unknown class {name!r}; known: {sorted(classes)}")
        base = classes[name]
    ttft, tbt = custom_params.get(TTFT_KEY), custom_params.get(TBT_KEY)
    return Slo(
        base.ttft_ms if ttft is None else _slo_ms(TTFT_KEY, ttft),
        base.tbt_ms if tbt is None else _slo_ms(TBT_KEY, tbt),
        base.weight,
    )
