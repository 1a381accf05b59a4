"""Runtime: applies a Plan to later steps with hooks on the user's own module; never profiles, never plans
(``libra.apply``, in ``libra/api.py``, adds both for steps with new inputs)."""

from libra.runtime.apply import apply, begin_step

__all__ = ["apply", "begin_step"]
