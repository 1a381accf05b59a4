"""Installs a plan's regions on the user's module for the duration of a ``with`` block (``libra.apply``, in
``libra/api.py``, adds the profiler and the planner for steps with new inputs: the runtime imports neither)."""

from __future__ import annotations

import collections
import contextlib
import logging
import os
from typing import Iterator, Protocol

import torch
import torch.utils.checkpoint as torch_checkpoint
from torch.utils._pytree import tree_leaves

from libra._forward import ForwardSwaps
from libra.errors import LibraError, PlanMismatchError, UnplannedInputsError
from libra.planner.types import Decision, Plan, RegionPlan
from libra._ops import input_signature, kv_cache_args, model_signature, plain_tensors, storage_key
from libra.runtime.region import (HookRun, OffloadContext, PlainRun, RegionRun, TriggerRun, debug_enabled,
                                  hand_arguments)
from libra.units import format_bytes

__all__ = ["apply", "begin_step", "Replanner"]

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

    def _plain(self, args, kwargs, key: tuple[str, int] | None = None, region: RegionPlan | None = None):
        """The call under plain ``torch.utils.checkpoint``, recomputed whole (NOTE [Plain regions]); its replay
        guarded where it writes module state, or may (NOTE [Guarded replay])."""
        # with no plan for the call (a layer the profiled step skipped), a module without buffers of its own has no
        # state to write twice: no guard, whose fallback would clone every buffer an op reads (a mask)
        owns_state = region is not None or next(self.module.buffers(), None) is not None
        plain = PlainRun(self.forward, region, self.session.buffer_keys() if owns_state else set())
        self.session.track(plain, key)
        context_fn = plain.contexts if plain.guarded else torch_checkpoint.noop_context_fn
        args, kwargs = hand_arguments(plain, args, kwargs)  # NOTE [Arguments as they were]
        return torch_checkpoint.checkpoint(plain.run, *args, use_reentrant=False, preserve_rng_state=True,
                                           context_fn=context_fn, **kwargs)

    def __call__(self, *args, **kwargs):
        if not torch.is_grad_enabled():
            return self.forward(*args, **kwargs)
        key = self.session.next_call(self.fqn)
        region = self.session.regions.get(key)
        if region is None:
            if self.session.offload is not None and key in self.session.offload.after:
                # NOTE [Prefetch] in planner/simulate.py: its backward start brings a later call's copies back
                trigger = TriggerRun(self.fqn, self.forward)
                self.session.track(trigger, key)
                return trigger.run(*args, **kwargs)
            why = self.session.unprofiled.get(self.fqn)
            if why is None:
                return self.forward(*args, **kwargs)
            # NOTE [Unprofiled siblings]
            self.session.note_once(
                ("unprofiled", self.fqn),
                "libra: %r ran, which the profiled step did not call (layer drop, or another branch?); recomputing it "
                "whole (plain checkpoint), %s.", self.fqn, why, level=logging.INFO,
            )
            return self._plain(args, kwargs)
        shapes = [list(a.shape) for a in args if isinstance(a, torch.Tensor)]
        if shapes != region.input_shapes:
            # NOTE [Unplanned shapes]: a call whose input shape depends on the data (a MoE expert gets the tokens
            # routed to it) cannot follow an op-level plan made at another shape. Kept whole, its activations
            # broke the budget (Mixtral with router jitter: +14.5 MiB on 35.9); recomputed whole under plain
            # checkpoint, it holds only its inputs, like the plan's regions. Only where that is exact (plain_ok).
            if region.plain_ok and not kv_cache_args(args, kwargs):
                self.session.note_once(
                    ("shapes", self.fqn),
                    "libra: %r got inputs of shapes %s, planned for %s; recomputing it whole (plain checkpoint) "
                    "at those shapes.", self.fqn, shapes, region.input_shapes, level=logging.INFO,
                )
                return self._plain(args, kwargs, key, region)
            self.session.note_once(
                ("shapes", self.fqn),
                "libra: %r got inputs of shapes %s, planned for %s; running it without recompute. "
                "Profile and plan at the new shapes to save memory there.",
                self.fqn,
                shapes,
                region.input_shapes,
            )
            return self.forward(*args, **kwargs)
        caches = kv_cache_args(args, kwargs)
        if caches:  # NOTE [Key/value caches are not replayable] in _ops.py
            self.session.note_once(
                ("kv_cache", self.fqn),
                "libra: %r got a key/value cache (%s), which a replay would append to again; running it without "
                "recompute. Pass use_cache=False when training to save memory there.",
                self.fqn,
                ", ".join(caches),
            )
            return self.forward(*args, **kwargs)
        if region.hooked:  # NOTE [Hooked regions] in planner/simulate.py
            if debug_enabled():
                log.debug("libra: %s[%d] runs hooked (what it saves goes to host memory)", region.module,
                          region.call)
            hook = HookRun(region, self.forward, self.session.offload, self.session.static_keys(),
                           self.session.device)
            self.session.track(hook, key)
            return hook.run(*args, **kwargs)
        if region.plain:  # NOTE [Plain regions] in planner/simulate.py
            if debug_enabled():
                log.debug("libra: %s[%d] runs under plain checkpoint (everything recomputed)", region.module,
                          region.call)
            return self._plain(args, kwargs, key, region)
        run = RegionRun(region, self.forward, self.session.offload, note=self.session.note_once,
                        buffer_keys=self.session.buffer_keys())
        self.session.track(run, key)
        args, kwargs = hand_arguments(run, args, kwargs)  # NOTE [Arguments as they were]
        return torch_checkpoint.checkpoint(
            run.run,
            *args,
            use_reentrant=False,
            context_fn=run.contexts,
            preserve_rng_state=True,
            **kwargs,
        )


# NOTE [Plans per input signature]: a plan is made for one input signature: the dtype and shape of every tensor the
# root module's call gets (Plan.input_signature). A step whose root call gets another signature never runs under
# it. ``libra.apply(model, [plan, ...])`` takes plans for several signatures (made ahead from fake profiles, which
# need no memory). With ``on_over_budget="raise"`` (the default) a step with a signature none of them has raises
# UnplannedInputsError from the root's forward pre-hook, before it allocates anything: the budget is a promise.
# With ``"warn"`` and ``replan=True`` that step runs plainly while it is profiled (a StepRecording started in the root's
# forward pre-hook and stopped when its backward ends), it is planned under the same budget, and later steps with
# that signature run under their own plan. The plans for other signatures hang on the plan object (so a ``with``
# block per step reuses them): at most ``max_plans`` of them, the least recently used dropped. Once 4 x max_plans
# signatures have been profiled for one plan (inputs that change shape every step), new ones run plainly.
# With ``replan=False`` such steps run plainly. Each case is logged once per signature. A plan without a recorded
# signature (an older plan file) matches every step; the per-region shape guard still holds.
_PROFILES_PER_PLAN = 4


class Replanner(Protocol):
    """How a session profiles a step with inputs no plan was made for, and plans it (NOTE [Plans per input
    signature]). ``libra/api.py`` gives one built from the profiler and the planner; without one such steps run
    plainly."""

    def record(self, model: torch.nn.Module):
        """A recording of one step of ``model`` whose root call has begun (a ``StepRecording``, not yet started)."""

    def plan(self, recording, base: Plan, signature: list[str]) -> Plan:
        """The plan for the finished ``recording`` of a step with ``signature``, made as ``base`` was."""


class _Variants:
    """The plans made for other input signatures than a plan's own, kept on that plan object."""

    def __init__(self) -> None:
        self.plans: collections.OrderedDict[tuple[str, ...], Plan] = collections.OrderedDict()
        self.profiled = 0
        self.noted: set = set()  # what was logged once for this plan (across ``with`` blocks)


def _variants(plan: Plan) -> _Variants:
    return plan.__dict__.setdefault("_libra_variants", _Variants())


class _Session:
    """The hooks of one ``apply`` block. Installs on enter, removes everything on exit."""

    def __init__(self, model: torch.nn.Module, plan: Plan, replanner: Replanner | None = None, max_plans: int = 4,
                 on_over_budget: str = "raise", given: dict | None = None) -> None:
        self.model = model
        self.base = plan
        self.replanner = replanner
        self.on_over_budget = on_over_budget
        self.given: dict[tuple[str, ...], Plan] = given or {}  # plans passed for other input signatures
        self.max_plans = max_plans
        self.variants = _variants(plan)
        self.recording = None  # the replanner's recording of a step with new inputs, while it runs
        self.recording_signature: tuple[str, ...] = ()
        self.lingering: list = []  # the replanner's finished recordings not yet off the mode stacks
        self.regions: dict[tuple[str, int], RegionPlan] = {}
        self.counts: dict[str, int] = {}
        self._swaps = ForwardSwaps()
        self._wrapped: set[str] = set()
        self._handles: list[torch.utils.hooks.RemovableHandle] = []
        self.device = next((p.device for p in model.parameters()), torch.device("cpu"))
        self.offload: OffloadContext | None = None
        self.unprofiled: dict[str, str] = {}  # NOTE [Unprofiled siblings]
        self._static: set[int] | None = None
        self._buffers: set[int] | None = None
        self._activate(plan)

    # ---- which plan runs ------------------------------------------------------------------------------------
    def _activate(self, plan: Plan | None) -> None:
        """Runs the next steps under ``plan`` (None: plainly)."""
        self.active = plan
        self.regions = {(r.module, r.call): r for r in plan.regions} if plan is not None else {}
        if plan is None:
            self.unprofiled = {}
        if plan is not None and self.offload is None and any(r.offload or r.hooked for r in plan.regions):
            self.offload = OffloadContext(self.device)
        if self.offload is not None:
            self.offload.follow(plan.regions if plan is not None else [])
        if plan is not None and self._handles:
            self._wrap(plan)

    def static_keys(self) -> set[int]:
        """Storages of the model's parameters and buffers, which hooked regions never copy (taken once per step:
        a parameter can be replaced between steps)."""
        if self._static is None:
            self._static = {storage_key(t) for t in plain_tensors((*self.model.parameters(), *self.model.buffers()))}
        return self._static

    def buffer_keys(self) -> set[int]:
        """Storages of the model's buffers (NOTE [Leaving the profiled ops] in runtime/region.py), taken once per
        step like ``static_keys``."""
        if self._buffers is None:
            self._buffers = {storage_key(t) for t in plain_tensors(self.model.buffers())}
        return self._buffers

    def next_call(self, fqn: str) -> tuple[str, int]:
        """(module, call): which call of ``fqn`` within this root call this one is."""
        call = self.counts.get(fqn, 0)
        self.counts[fqn] = call + 1
        return fqn, call

    def track(self, run, key: tuple[str, int] | None) -> None:
        """Hands ``run`` what to call when its backward starts, where the plan offloads (NOTE [Prefetch])."""
        if self.offload is not None:
            run.on_backward = self.offload.register(run, key)

    def note_once(self, key, message, *args, level=logging.WARNING) -> None:
        if key not in self.variants.noted:
            self.variants.noted.add(key)
            log.log(level, message, *args)

    def begin_step(self) -> None:
        """A new step starts: module calls are counted from zero again (see :func:`begin_step`)."""
        self.counts = {}
        self._static = self._buffers = None
        if self.offload is not None:
            self.offload.new_step()
        if self.recording is not None:
            self._finish_recording()
        self.lingering = [r for r in self.lingering if not r.release()]

    def _root_pre_hook(self, module, args, kwargs):
        if not torch.is_grad_enabled():
            return
        self.begin_step()
        if not self.base.input_signature:
            return
        signature = tuple(input_signature(args, kwargs))
        plan = self.base if signature == tuple(self.base.input_signature) else self.given.get(signature)
        if plan is None:
            plan = self.variants.plans.get(signature)
            if plan is not None:
                self.variants.plans.move_to_end(signature)
        if plan is not None:
            if plan is not self.active:
                self._activate(plan)
            return
        self._activate(None)
        if self.on_over_budget == "raise":  # NOTE [Plans per input signature]: before anything is allocated
            raise UnplannedInputsError(
                f"libra.apply: expected inputs {self.base.input_signature}"
                + (f" or one of the {len(self.given)} other planned signatures" if self.given else "")
                + f", got {list(signature)}, which no plan was made for; profiling them in this step would run it "
                "without recompute, over the budget. Fix: plan them ahead without running them, "
                "plan = libra.plan(libra.profile(model, step_with_those_inputs, fake=True), budget), and pass "
                "libra.apply(model, [plan, ...]); or pass on_over_budget=\"warn\" to profile such steps as they come.",
                signature=list(signature),
            )
        if self.replanner is None:
            self.note_once(("signature", signature),
                           "libra: inputs %s differ from the planned %s; replan=False, so steps with them run "
                           "without recompute (more memory).", list(signature), self.base.input_signature)
            return
        if self.variants.profiled >= _PROFILES_PER_PLAN * self.max_plans:
            self.note_once("too many signatures",
                           "libra: the inputs changed shape %d times; new shapes now run without recompute. "
                           "Fix: pad or bucket inputs to a few shapes.", self.variants.profiled)
            return
        log.warning("libra: inputs %s differ from the planned %s; this step runs without recompute while it is "
                    "profiled, and later steps with these inputs get a plan of their own.",
                    list(signature), self.base.input_signature)
        self.variants.profiled += 1
        self.recording = self.replanner.record(self.model)
        self.recording_signature = signature
        self.recording.start()
        self.recording.enter_root(args, kwargs)

    def _root_post_hook(self, module, args, output):
        recording = self.recording
        if recording is None or recording.stopped:
            return
        recording.exit_root()
        nodes = {t.grad_fn for t in tree_leaves(output) if isinstance(t, torch.Tensor) and t.grad_fn is not None}
        if not nodes:
            return
        queued = []

        def backward_started(grad_outputs):
            # runs inside backward: the callback runs when this backward pass is over
            if not queued:
                queued.append(True)
                torch.autograd.Variable._execution_engine.queue_callback(recording.stop)

        for node in nodes:
            recording.hooks.append(node.register_prehook(backward_started))

    def _finish_recording(self) -> None:
        recording, signature = self.recording, self.recording_signature
        self.recording = None
        if not recording.stopped:
            recording.abort()
            if not recording.released:
                self.lingering.append(recording)
            self.variants.profiled -= 1
            log.info("libra: the profiled step with inputs %s ran no backward; it will be profiled again",
                     list(signature))
            return
        plan = self.replanner.plan(recording, self.base, list(signature))
        if not recording.released:
            self.lingering.append(recording)
        plans = self.variants.plans
        plans[signature] = plan
        while len(plans) > self.max_plans:
            plans.popitem(last=False)
        log.info("libra: planned for inputs %s: predicted peak %s, %d recomputed / %d offloaded",
                 list(signature), format_bytes(plan.predicted_peak_bytes), plan.counts[Decision.RECOMPUTE],
                 plan.counts[Decision.OFFLOAD])

    # ---- hooks ----------------------------------------------------------------------------------------------
    def _unprofiled_siblings(self, plan: Plan) -> dict[str, str]:
        """NOTE [Unprofiled siblings]: layer drop (Whisper's, or stochastic depth) skips other layers each step; a
        layer the profiled step skipped has no plan and kept all its activations (a Whisper with layer drop 0.3
        ran over eager's own peak at a 50% budget). The planner names the modules the profiled step never called
        whose called twin plain checkpoint replays exactly (``Plan.unprofiled``) and reserves what each holds under
        plain checkpoint; under a plan that checkpoints anything, such a module runs under plain checkpoint,
        recomputed whole. (It once ran so only beside a sibling region of its own class: a Whisper decoder layer,
        planned as its attention and MLP parts, then ran as it is and measured 8.3 MiB over its budget.) A plan
        file from before that field counts every module no decision names that has a planned sibling of its class
        that plain checkpoint may replay (it also counted profiled modules that save nothing, whose plain checkpoint
        then ran over the budget by one RNG state and their inputs). Returns fqn -> why it runs so, for the log."""
        modules = dict(self.model.named_modules())
        planned = {r.module for r in plan.regions}
        seen = {key.split(":", 1)[0] for key in plan.decisions}
        out: dict[str, str] = {}
        if plan.unprofiled is not None:
            if plan.regions:
                for fqn in plan.unprofiled:
                    if fqn in modules and fqn not in planned and not any(
                            s == fqn or s.startswith(fqn + ".") for s in seen):
                        out[fqn] = "as the plan's budget reserves for it"
            return out
        for r in plan.regions:
            if not r.plain_ok or "." not in r.module or r.module not in modules:
                continue
            parent_fqn, _ = r.module.rsplit(".", 1)
            parent = modules.get(parent_fqn)
            if parent is None:
                continue
            kind = type(modules[r.module])
            for name, child in parent.named_children():
                fqn = f"{parent_fqn}.{name}"
                if type(child) is not kind or fqn in planned or fqn in out:
                    continue
                if any(s == fqn or s.startswith(fqn + ".") for s in seen):
                    continue
                out[fqn] = f"as its planned sibling {r.module!r} is"
        return out

    def _wrap(self, plan: Plan) -> None:
        modules = dict(self.model.named_modules())
        self.unprofiled = self._unprofiled_siblings(plan)
        triggers = [r.prefetch_after[0] for r in plan.regions if r.prefetch_after]  # NOTE [Prefetch]
        for fqn in dict.fromkeys([*(r.module for r in plan.regions), *self.unprofiled, *triggers]):
            if fqn in self._wrapped:
                continue
            module = modules.get(fqn)
            if module is None:
                raise PlanMismatchError(
                    f"libra.apply: the plan checkpoints module {fqn!r}, which this model does not have. "
                    "Fix: profile and plan this model."
                )
            self._swaps.replace(module, lambda forward, m=module, fqn=fqn: _RegionForward(self, m, fqn, forward))
            self._wrapped.add(fqn)

    def install(self) -> None:
        """Marks the model as under a plan and, when the plan checkpoints anything or may be replaced by one for
        other inputs, wraps the planned modules and hooks the root."""
        setattr(self.model, _ACTIVE_ATTR, self)
        checks = self.base.input_signature and (self.replanner is not None or self.on_over_budget == "raise" or self.given)
        if not self.base.regions and not checks and not self.given:
            return  # with nothing to evict and no inputs to check, install nothing
        self._handles.append(self.model.register_forward_pre_hook(self._root_pre_hook, with_kwargs=True))
        self._handles.append(self.model.register_forward_hook(self._root_post_hook))
        self._wrap(self.base)

    def remove(self) -> None:
        if self.recording is not None:
            try:
                self._finish_recording()  # kept when the step ran to the end of its backward, else discarded
            except LibraError as e:
                log.warning("libra: planning for inputs %s failed: %s", list(self.recording_signature), e)
            self.recording = None
        self.lingering = [r for r in self.lingering if not r.release()]
        if self.lingering:
            log.warning("libra: a dispatch mode or saved-tensor hooks entered inside `with libra.apply` are still "
                        "active; Libra's finished profiling hooks under them pass everything through until they leave.")
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._swaps.restore()
        self.model.__dict__.pop(_ACTIVE_ATTR, None)


def begin_step(model: torch.nn.Module) -> None:
    """Tells the plan applied to ``model`` that a training step starts.

    A step starts when the root module is called with gradients on; a caller whose step may call only submodules
    (a LightningModule's ``training_step`` calling ``self.backbone(x)``) calls this before each step, so that module
    calls are matched to the plan's from the first again. Does nothing when no plan is applied.
    """
    session = model.__dict__.get(_ACTIVE_ATTR)
    if isinstance(session, _Session):
        session.begin_step()


@contextlib.contextmanager
def apply(model: torch.nn.Module, plan, *, on_over_budget: str = "raise", replanner: Replanner | None = None,
          max_plans: int = 4) -> Iterator[None]:
    """Runs the steps inside the ``with`` block under ``plan``: :func:`libra.apply` (see there) is this with a
    ``replanner``, which profiles and plans steps with new inputs (None: they run plainly)."""
    if not isinstance(model, torch.nn.Module):
        raise LibraError(f"libra.apply: expected a torch.nn.Module, got {type(model).__name__}.")
    plans = list(plan) if isinstance(plan, (list, tuple)) else [plan]
    if not plans or not all(isinstance(p, Plan) for p in plans):
        bad = next((p for p in plans if not isinstance(p, Plan)), None)
        raise LibraError(
            "libra.apply: expected a libra.Plan (from libra.plan or libra.Plan.load) or a non-empty list of them, "
            f"got {type(plan).__name__ if not plans or bad is plan else 'a list holding a ' + type(bad).__name__}."
        )
    if on_over_budget not in ("raise", "warn"):
        raise LibraError(f"libra.apply: on_over_budget should be \"raise\" or \"warn\", got {on_over_budget!r}.")
    plan, others = plans[0], plans[1:]
    given: dict[tuple[str, ...], Plan] = {}
    for p in others:
        key = tuple(p.input_signature)
        if not key or key == tuple(plan.input_signature) or key in given:
            raise LibraError(
                "libra.apply: expected plans for different input signatures, got two for "
                f"{list(key) or 'an unrecorded signature'}. Fix: pass one plan per input shape."
            )
        given[key] = p
    if debug_enabled() and not log.handlers:
        # NOTE [LIBRA_DEBUG]: asked for by the environment, so shown even where the application configured no
        # logging: one stderr handler on the "libra" logger, added once.
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(name)s: %(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.DEBUG)
    if os.environ.get("LIBRA_DISABLE") == "1":
        log.info("libra: LIBRA_DISABLE=1, plan not applied")
        yield
        return
    if _ACTIVE_ATTR in model.__dict__:
        raise LibraError(
            "libra.apply: a plan is already applied to this model; nest no second libra.apply on the same model. "
            "Fix: leave the first `with libra.apply(...)` block before entering another."
        )
    if isinstance(max_plans, bool) or not isinstance(max_plans, int) or max_plans < 1:
        raise LibraError(f"libra.apply: max_plans should be a positive int, got {max_plans!r}.")
    for p in plans:
        _check_signature(model, p)
    counts = plan.counts
    session = _Session(model, plan, replanner=replanner, max_plans=max_plans, on_over_budget=on_over_budget,
                       given=given)
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
