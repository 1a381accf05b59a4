"""First calls of an op, run once untimed so that the profile times what later steps pay.

NOTE [First calls]: the first call of an op signature in a process pays one-time costs that later steps do not:
oneDNN creates a convolution's primitive, cuDNN benchmarks algorithms, CUDA loads kernels. A profile of a process's
first step would take them for the step's own, and predict every plan's step ratio against an eager step later
steps never see. So the recorder (and the timer of ``timing="safe"``, profiler/timed.py) runs the first call of
each signature once more before the timed one and drops its result, where that cannot change anything: an aten op
with no declared or undeclared write (BatchNorm's running statistics), no generator, no collective, no Python
value, and plain strided tensors only (a wrapper subclass's op may talk to other ranks). What that call allocates
is not the step's (the allocator tap folds it into one event, NOTE [Allocator truth] in libra/_allocator.py). The
signatures are remembered for the process: after a warm-up step, or in a second profile, each signature costs one
untimed call the first time only.
"""

from __future__ import annotations

import contextlib

import torch
from torch.utils._pytree import tree_leaves

from libra._allocator import WARM_MARKER
from libra._ops import STATEFUL_OPS, OpInfo
from libra.profiler.fake import signature, specs

__all__ = ["warm_first_call"]

_PLAIN = (torch.Tensor, torch.nn.Parameter)
_WARMED: set[tuple] = set()


def warm_first_call(func, info: OpInfo, args, kwargs, marked: bool) -> None:
    """Runs ``func`` once, its result dropped, if this is the first call of its signature in the process and the
    call can change nothing (NOTE [First calls]); ``marked``: inside a ``WARM_MARKER`` range, for the tap."""
    if (info.write_args or info.random or info.collective or info.python_value or info.name in STATEFUL_OPS
            or getattr(func, "namespace", "") != "aten"):
        return
    if any(isinstance(t, torch.Tensor) and (type(t) not in _PLAIN or t.layout != torch.strided)
           for t in tree_leaves((args, kwargs))):
        return  # a subclass's op may talk to other ranks; a sparse or nested tensor has no strides to key on
    key = signature(func, *specs(args, kwargs))
    if key in _WARMED:
        return
    _WARMED.add(key)
    try:
        with torch._C._profiler._RecordFunctionFast(WARM_MARKER) if marked else contextlib.nullcontext():
            func(*args, **kwargs)  # the result is dropped here, inside the range
    except Exception:  # noqa: BLE001 - the timed call that follows raises it again, where it fails
        pass
