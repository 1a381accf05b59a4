"""Runtime: applies a Plan to later steps with hooks on the user's own module; never plans."""

from libra.runtime.apply import apply

__all__ = ["apply"]
