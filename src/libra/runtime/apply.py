"""``libra.apply``: installs a plan's regions on the user's module for the duration of a ``with`` block."""

from __future__ import annotations

import contextlib
import logging
import os
from typing import Iterator

import torch
import torch.utils.checkpoint as torch_checkpoint

from libra._forward import ForwardSwaps
from libra.errors import LibraError, PlanMismatchError
from libra.planner.types import Decision, Plan, RegionPlan
from libra.profiler import model_signature
from libra.runtime.region import OffloadContext, RegionRun
from libra.units import format_bytes

__all__ = ["apply"]

log = logging.getLogger("libra")

_ACTIVE_ATTR = "_libra_active_session"


def _check_signature(model: torch.nn.Module, plan: Plan) -> None:
    have = model_signature(model)
    want = [tuple(p) for p in plan.parameters]
    for i in range(max(len(have), len(want))):
        h = tuple(have[i]) if i < len(have) else None
        w = tuple(want[i]) if i < len(want) else None
        if h != w:
            raise PlanMismatchError(
                "libra.apply: the plan was made for another model: "
                f"its tensor #{i} is {_describe(w)} but this model's is {_describe(h)}. "
                "Fix: profile and plan this model (libra.profile, then libra.plan)."
            )


def _describe(entry) -> str:
    if entry is None:
        return "missing"
    name, shape, dtype = entry
    return f"{name!r} of shape {tuple(shape)} and {dtype}"


class _RegionForward:
    """Stands in for one module's ``forward``: runs the planned calls under checkpoint, the others plainly."""

    def __init__(self, session: "_Session", module: torch.nn.Module, fqn: str, forward) -> None:
        self.session = session
        self.module = module
        self.fqn = fqn
        self.forward = forward

    def __call__(self, *args, **kwargs):
        if not torch.is_grad_enabled():
            return self.forward(*args, **kwargs)
        region = self.session.next_region(self.fqn)
        if region is None:
            return self.forward(*args, **kwargs)
        shapes = [list(a.shape) for a in args if isinstance(a, torch.Tensor)]
        if shapes != region.input_shapes:
            self.session.note_once(
                ("shapes", self.fqn),
                "libra: %r got inputs of shapes %s, planned for %s; running it without recompute. "
                "Profile and plan at the new shapes to save memory there.",
                self.fqn,
                shapes,
                region.input_shapes,
            )
            return self.forward(*args, **kwargs)
        run = RegionRun(region, self.forward, self.session.offload)
        if self.session.offload is not None:
            self.session.offload.register(run)
        return torch_checkpoint.checkpoint(
            run.run,
            *args,
            use_reentrant=False,
            context_fn=run.contexts,
            preserve_rng_state=True,
            **kwargs,
        )


class _Session:
    """The hooks of one ``apply`` block. Installs on enter, removes everything on exit."""

    def __init__(self, model: torch.nn.Module, plan: Plan) -> None:
        self.model = model
        self.plan = plan
        self.regions: dict[tuple[str, int], RegionPlan] = {(r.module, r.call): r for r in plan.regions}
        self.counts: dict[str, int] = {}
        self._swaps = ForwardSwaps()
        self._handles: list[torch.utils.hooks.RemovableHandle] = []
        self._noted: set = set()
        offloads = any(r.offload for r in plan.regions)
        device = next((p.device for p in model.parameters()), torch.device("cpu"))
        self.offload = OffloadContext(device) if offloads else None

    def next_region(self, fqn: str) -> RegionPlan | None:
        call = self.counts.get(fqn, 0)
        self.counts[fqn] = call + 1
        return self.regions.get((fqn, call))

    def note_once(self, key, message, *args) -> None:
        if key not in self._noted:
            self._noted.add(key)
            log.warning(message, *args)

    def _root_pre_hook(self, module, args):
        if torch.is_grad_enabled():
            self.counts = {}
            if self.offload is not None:
                self.offload.new_step()

    def install(self) -> None:
        """Marks the model as under a plan and, when the plan checkpoints anything, wraps the planned modules."""
        setattr(self.model, _ACTIVE_ATTR, self)
        if not self.plan.regions:
            return  # with nothing to evict, install nothing
        modules = dict(self.model.named_modules())
        for fqn in dict.fromkeys(r.module for r in self.plan.regions):
            module = modules.get(fqn)
            if module is None:
                raise PlanMismatchError(
                    f"libra.apply: the plan checkpoints module {fqn!r}, which this model does not have. "
                    "Fix: profile and plan this model."
                )
            self._swaps.replace(module, lambda forward, m=module, fqn=fqn: _RegionForward(self, m, fqn, forward))
        self._handles.append(self.model.register_forward_pre_hook(self._root_pre_hook))

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._swaps.restore()
        self.model.__dict__.pop(_ACTIVE_ATTR, None)


@contextlib.contextmanager
def apply(model: torch.nn.Module, plan: Plan) -> Iterator[None]:
    """Runs the steps inside the ``with`` block under ``plan``.

    The model is the user's own: Libra replaces the ``forward`` of the planned modules by an instance attribute and
    adds one forward pre-hook to the root; both are removed on exit, also when the block raises. When the plan keeps
    everything, nothing is installed. ``LIBRA_DISABLE=1`` makes it a no-op.

    Args:
        model: the model the plan was made for (same parameter names, shapes and dtypes).
        plan: from :func:`libra.plan` or :meth:`libra.Plan.load`.

    Raises:
        PlanMismatchError: the plan was made for another model; the message names the first differing tensor.
        LibraError: ``apply`` is already active on this model, or the arguments are of the wrong type.

    Example:
        >>> with libra.apply(model, plan):
        ...     for x, y in loader:
        ...         loss_fn(model(x), y).backward(); opt.step(); opt.zero_grad()
    """
    if not isinstance(model, torch.nn.Module):
        raise LibraError(f"libra.apply: expected a torch.nn.Module, got {type(model).__name__}.")
    if not isinstance(plan, Plan):
        raise LibraError(
            f"libra.apply: expected a libra.Plan (from libra.plan or libra.Plan.load), got {type(plan).__name__}."
        )
    if os.environ.get("LIBRA_DISABLE") == "1":
        log.info("libra: LIBRA_DISABLE=1, plan not applied")
        yield
        return
    if _ACTIVE_ATTR in model.__dict__:
        raise LibraError(
            "libra.apply: a plan is already applied to this model; nest no second libra.apply on the same model. "
            "Fix: leave the first `with libra.apply(...)` block before entering another."
        )
    _check_signature(model, plan)
    counts = plan.counts
    session = _Session(model, plan)
    try:
        session.install()
        if plan.regions:
            log.info(
                "plan applied: %d kept / %d recomputed / %d offloaded, predicted peak %s of budget %s",
                counts[Decision.KEEP],
                counts[Decision.RECOMPUTE],
                counts[Decision.OFFLOAD],
                format_bytes(plan.predicted_peak_bytes),
                format_bytes(plan.budget_bytes),
            )
        else:
            log.info(
                "plan applied: everything kept (%d saved tensors), nothing installed; predicted peak %s of budget %s",
                counts[Decision.KEEP],
                format_bytes(plan.predicted_peak_bytes),
                format_bytes(plan.budget_bytes),
            )
        yield
    finally:
        session.remove()
