"""The one error family Libra raises.

Every message starts with the function that raised it, says what was expected, what was seen, and how to fix it.
"""

from __future__ import annotations

__all__ = [
    "LibraError",
    "BudgetInfeasibleError",
    "PlanMismatchError",
    "PlanFormatError",
    "UnplannedInputsError",
    "internal_assert",
]


class LibraError(RuntimeError):
    """Base class of every error Libra raises on purpose."""


class BudgetInfeasibleError(LibraError):
    """No plan keeps the step's peak live bytes under the requested budget.

    Attributes:
        budget_bytes: the budget that was asked for.
        min_budget_bytes: the smallest budget the planner can meet on this profile.
    """

    def __init__(self, message: str, *, budget_bytes: int, min_budget_bytes: int) -> None:
        super().__init__(message)
        self.budget_bytes = budget_bytes
        self.min_budget_bytes = min_budget_bytes


class PlanMismatchError(LibraError):
    """A plan does not fit the model or the step it is applied to."""


class UnplannedInputsError(LibraError):
    """A step's inputs have no plan, and finding out what they need would run it over the budget.

    Attributes:
        signature: the step's input signature (``["0:torch.int64[8, 512]"]``).
    """

    def __init__(self, message: str, *, signature: list[str]) -> None:
        super().__init__(message)
        self.signature = signature


class PlanFormatError(LibraError):
    """A plan or profile file is corrupt, of another schema version, or hand-edited into something invalid."""


def internal_assert(condition: bool, message: str) -> None:
    """Checks one of Libra's own invariants. A failure is a bug in Libra, never a user error."""
    if not condition:
        raise LibraError(
            f"libra internal error: {message}. This is a bug in Libra, not in your code; "
            "please report it with the model and the traceback."
        )
