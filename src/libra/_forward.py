"""Replacing a module's ``forward`` by an instance attribute and putting it back: shared by profiler and runtime."""

from __future__ import annotations

import torch

__all__ = ["ForwardSwaps"]


class ForwardSwaps:
    """Instance-attribute ``forward`` replacements, undone in reverse order (a user's own instance ``forward`` is
    restored as it was)."""

    def __init__(self) -> None:
        self._saved: list[tuple[torch.nn.Module, object]] = []

    def replace(self, module: torch.nn.Module, make) -> None:
        """Sets ``module.forward = make(current forward)``."""
        self._saved.append((module, module.__dict__.get("forward")))
        module.forward = make(module.forward)

    def restore(self) -> None:
        for module, previous in reversed(self._saved):
            if previous is None:
                module.__dict__.pop("forward", None)
            else:
                module.forward = previous
        self._saved.clear()
