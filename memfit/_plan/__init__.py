"""The planner: measure blocks, forecast the step's peak, choose what to keep or recompute."""

from memfit._plan._autoconfig import AutoConfig, autoconfigure
from memfit._plan._budget import parse_bytes
from memfit._plan._loss import chunked_cross_entropy
from memfit._plan._plan import Plan, PlanError, plan
from memfit._plan._time import DeviceProfile

__all__ = [
    "AutoConfig",
    "DeviceProfile",
    "Plan",
    "PlanError",
    "autoconfigure",
    "chunked_cross_entropy",
    "parse_bytes",
    "plan",
]
