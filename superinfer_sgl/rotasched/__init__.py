"""RotaSched: SLO-aware rotary scheduling policy (pure Python, standard library only)."""

from superinfer_sgl.rotasched.lvf import Decision, idle_resume, lvf_decide
from superinfer_sgl.rotasched.slo import (
    DEFAULT_CLASSES,
    DEFAULT_SLO,
    Slo,
    SloClasses,
    SloError,
    resolve_slo,
)
from superinfer_sgl.rotasched.request_view import ReqState, ReqView
from superinfer_sgl.rotasched.sync import DecisionSync
from superinfer_sgl.rotasched.vlt import VltParams, vlt

__all__ = [
    "DEFAULT_CLASSES",
    "DEFAULT_SLO",
    "Decision",
    "DecisionSync",
    "ReqState",
    "ReqView",
    "Slo",
    "SloClasses",
    "SloError",
    "VltParams",
    "idle_resume",
    "lvf_decide",
    "resolve_slo",
    "vlt",
]
