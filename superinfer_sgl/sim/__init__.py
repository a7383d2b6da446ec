"""What-if simulator: iteration-level replay of a workload through the production RotaSched
policy (superinfer_sgl.rotasched) and baseline schedulers, under a measured or published cost
profile. See docs/sim.md; command line: python -m superinfer_sgl.sim --help."""

from superinfer_sgl.sim.engine import SimConfig, Simulator
from superinfer_sgl.sim.metrics import summarize
from superinfer_sgl.sim.policies import POLICIES, make_policy
from superinfer_sgl.sim.profile import Profile, load_profile, resolve_profile
from superinfer_sgl.sim.workload import RequestSpec, Workload

__all__ = ["POLICIES", "Profile", "RequestSpec", "SimConfig", "Simulator", "Workload", "load_profile",
           "make_policy", "resolve_profile", "summarize"]
