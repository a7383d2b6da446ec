"""superinfer_sgl: SLO-aware rotary scheduling (RotaSched) and KV rotation (DuplexKV) on SGLang."""

__version__ = "0.1.0"

# The one SGLang release our patches and hooks were written against.
SUPPORTED_SGLANG_VERSION = "0.5.23"
