"""The integration layer: the only place that touches sglang.srt internals.

`install(cfg)` registers our hooks through SGLang's HookRegistry; the plugin calls it in every
SGLang process (main, scheduler, detokenizer) when our launcher enabled us.
"""

from __future__ import annotations

from ..config import SuperInferConfig
from . import handshake, hooks as _hooks

# Every hook we install, by target; reported back by each scheduler rank in the startup handshake.
INSTALLED: list[str] = []


def install(cfg: SuperInferConfig) -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry

    for source in (handshake.hooks(cfg, INSTALLED), _hooks.hooks(cfg)):
        for target, hook, kind in source:
            HookRegistry.register(target, hook, kind)
            INSTALLED.append(target)
