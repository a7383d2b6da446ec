"""RotaSched: SLO-aware rotary scheduling policy (pure Python, standard library only).

lvf.py is the paper's Algorithm 1; policy.py the hooks it leaves to a policy (the paper's own in
`PaperLvf`, goodput.py's `GoodputLvf`); planner.py the step the server and simulator share, and the
registry of policies by name (`planner.POLICIES`)."""

from superinfer_sgl.rotasched.lvf import Decision, idle_resume, lvf_decide, rank_order
from superinfer_sgl.rotasched.policy import PAPER, LvfPolicy
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
    "LvfPolicy",
    "PAPER",
    "ReqState",
    "ReqView",
    "Slo",
    "SloClasses",
    "SloError",
    "VltParams",
    "idle_resume",
    "lvf_decide",
    "rank_order",
    "resolve_slo",
    "vlt",
]
