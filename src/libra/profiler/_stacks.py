"""Putting a recorder under whatever dispatch modes and saved-tensor hooks are active, and taking it out again.

NOTE [Recording a live step]: ``libra.apply`` profiles a step with new inputs from inside it: the recording starts in
the root module's forward pre-hook and ends when that step's backward is over. Dispatch modes and saved-tensor hooks
are thread-local stacks popped from the top, and the user may have entered modes of their own around the step (a
memory meter, a profiler) that leave after the step. A recorder pushed on top would be popped by their exit (and
theirs left behind); popping it at the end of backward does not stick either, because the autograd engine restores
the caller's thread-local state when backward returns. So the recorder goes *under* everything active when it starts
(innermost for ops, outermost for hooks) and is taken out from wherever it is, on the thread that put it there, once
the step is over. Inserting and removing keeps the order of everything else.
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode_stack, _pop_mode, _push_mode

__all__ = ["insert_mode_under", "remove_mode", "insert_hooks_under", "remove_hooks"]

_autograd = torch._C._autograd


def insert_mode_under(mode: TorchDispatchMode) -> None:
    """Puts ``mode`` at the bottom of this thread's dispatch mode stack."""
    above = [_pop_mode() for _ in range(len(_get_current_dispatch_mode_stack()))]
    _push_mode(mode)
    for m in reversed(above):
        _push_mode(m)


def remove_mode(mode: TorchDispatchMode) -> bool:
    """Takes ``mode`` out of this thread's dispatch mode stack, wherever it is; False if it is not there."""
    stack = _get_current_dispatch_mode_stack()
    if not any(m is mode for m in stack):
        return False
    above = []
    while True:
        m = _pop_mode()
        if m is mode:
            break
        above.append(m)
    for m in reversed(above):
        _push_mode(m)
    return True


def _pop_all_hooks() -> list:
    popped = []
    while (top := _autograd._top_saved_tensors_default_hooks(False)) is not None:
        popped.append(top)
        _autograd._pop_saved_tensors_default_hooks()
    return popped


def insert_hooks_under(pack, unpack) -> None:
    """Puts ``(pack, unpack)`` at the bottom of this thread's saved-tensor hooks stack.

    Raises:
        RuntimeError: saved-tensor hooks are disabled here (``torch.autograd.graph.disable_saved_tensors_hooks``).
    """
    above = _pop_all_hooks()
    try:
        _autograd._push_saved_tensors_default_hooks(pack, unpack)
    finally:
        for hooks in reversed(above):
            _autograd._push_saved_tensors_default_hooks(*hooks)


def remove_hooks(pack) -> bool:
    """Takes the hooks whose pack function is ``pack`` out of this thread's stack; False if they are not there."""
    popped = _pop_all_hooks()
    found = False
    for hooks in reversed(popped):
        if hooks[0] == pack and not found:
            found = True
            continue
        _autograd._push_saved_tensors_default_hooks(*hooks)
    return found
