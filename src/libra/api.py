"""``libra.profile``: the profiler's recording of one step with the runtime's calibrations added.

It lives above the profiler and the runtime (the flow is profiler -> Profile -> planner -> Plan -> runtime, and the
profiler imports neither of the others): the recording is the profiler's, what a plan will cost to run on the
device (the region executor's per-op cost, a clone's cost per byte) is measured by the runtime's own code.
"""

from __future__ import annotations

from typing import Callable

import torch

from libra.errors import LibraError
from libra.profiler import FakeStep, StepRecording, dispatch_overhead_seconds, model_device
from libra.profiler.types import Profile
from libra.runtime.calibrate import step_calibrations

__all__ = ["profile"]


def profile(model: torch.nn.Module, step: Callable[[], object], *, fake: bool | str | torch.device = False,
            timing: str = "benchmark") -> Profile:
    """Runs ``step()`` once under recording and returns what it did.

    ``step`` is one training step's forward and backward (``loss_fn(model(x), y).backward()``); its gradients,
    buffer updates and RNG draws happen exactly as in a plain call. Profile after a warm-up step if the optimizer
    creates state lazily, so that the static bytes include it.

    With ``fake=True`` the step runs on fake tensors (NOTE [Fake profiles] in profiler/fake.py): it needs none of
    eager's memory, trains nothing (gradients, buffers and the RNG are left as they were), and each distinct op is
    then timed alone on real tensors of its recorded shapes, which also measures its temporary memory. Use it when
    the eager step does not fit, or to plan for input shapes before any step runs with them. ``fake="cpu"`` or
    ``fake="cuda:0"`` names the device: a model built on ``meta`` (no memory for its weights) is then profiled as if
    its parameters lived there.

    Args:
        model: the module whose submodules may later be recomputed.
        step: a callable running one forward and backward.
        fake: run the step on fake tensors: ``True`` on the model's device, or on the device named.
        timing: with ``fake``, how op times are found: ``"benchmark"`` (each distinct op run alone at its recorded
            shapes, which also measures its temporary memory) or ``"estimate"`` (from each op's floating-point
            operations and bytes at the device's measured rates, running nothing at those shapes: for steps too big
            to time op by op; NOTE [Estimated op times] in profiler/fake.py).

    Returns:
        A :class:`Profile`.

    Raises:
        LibraError: ``model`` is not a module or ``step`` not callable; with ``fake=True``, an op of the step cannot
            run on fake tensors (named, with its module). Whatever ``step`` raises propagates unchanged, with every
            hook removed.

    Example:
        >>> prof = libra.profile(model, lambda: loss_fn(model(x), y).backward())
        >>> prof.eager_peak_bytes > prof.static_bytes
        True
    """
    if not isinstance(model, torch.nn.Module):
        raise LibraError(f"libra.profile: expected a torch.nn.Module, got {type(model).__name__}.")
    if not callable(step):
        raise LibraError(f"libra.profile: expected a callable step, got {type(step).__name__}.")
    if timing not in ("benchmark", "estimate"):
        raise LibraError(f"libra.profile: timing should be 'benchmark' or 'estimate', got {timing!r}.")
    device = model_device(model)
    if fake is not False and fake is not True:
        try:
            device = torch.device(fake)
        except (RuntimeError, TypeError) as e:
            raise LibraError(f"libra.profile: fake should be True or a device such as 'cpu' or 'cuda:0', got "
                             f"{fake!r} ({e}).") from e
    if device.type == "meta":
        raise LibraError(
            "libra.profile: the model's parameters are on 'meta' (no values, no device): expected the device the "
            "step will run on. Fix: profile it fake there, libra.profile(model, step, fake='cuda:0') or fake='cpu'."
        )
    if timing != "benchmark" and not fake:
        raise LibraError("libra.profile: timing='estimate' is for fake profiles; a real step times its own ops. "
                         "Fix: pass fake=True, or leave timing as it is.")
    fake_step = None
    if fake is not False:
        dispatch_overhead_seconds()  # measured on real tensors, before the fake mode is entered
        fake_step = FakeStep(model, device, timing)
        fake_step.__enter__()
    recording = StepRecording(model, fake=fake_step, calibrate=step_calibrations)
    try:
        recording.start()
        step()
        recording.stop()
    except BaseException:
        recording.abort()
        raise
    finally:
        if fake_step is not None:
            fake_step.__exit__(None, None, None)
    return recording.finish()
