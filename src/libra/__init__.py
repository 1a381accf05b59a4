"""Libra: train PyTorch models in less memory.

Profile one training step, plan under a byte budget which saved activations to keep and which to recompute, and
apply the plan to every later step, on stock eager PyTorch; ``max_batch`` finds the largest batch that fits.
"""

from libra.errors import BudgetInfeasibleError, LibraError, PlanFormatError, PlanMismatchError, UnplannedInputsError
from libra.fit import BatchFit, max_batch
from libra.planner import plan
from libra.planner.types import Decision, Plan
from libra.api import apply, profile
from libra.profiler.types import Profile

__version__ = "0.1.0"

__all__ = [
    "BatchFit",
    "BudgetInfeasibleError",
    "Decision",
    "LibraError",
    "Plan",
    "PlanFormatError",
    "PlanMismatchError",
    "UnplannedInputsError",
    "Profile",
    "apply",
    "max_batch",
    "plan",
    "profile",
]
