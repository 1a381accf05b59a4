"""The Plan: one decision per saved activation, and the regions the runtime checkpoints. Plain data, JSON on disk."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

__all__ = ["Decision", "RegionPlan", "Plan", "PLAN_SCHEMA_VERSION"]

PLAN_SCHEMA_VERSION = 1


class Decision(str, enum.Enum):
    """What happens to one saved activation between forward and backward."""

    KEEP = "keep"
    RECOMPUTE = "recompute"
    OFFLOAD = "offload"


@dataclass
class RegionPlan:
    """One call of one module run under checkpoint, with the ops whose outputs are saved rather than recomputed.

    Attributes:
        module: FQN of the module (``"blocks.3"``).
        call: which call of that module within one call of the root model (0 for the first).
        ops: the aten op names the module's forward dispatched when profiled, in order: the runtime's guard.
        save: local indices (into ``ops``) of ops whose outputs are kept from forward; every other op is replayed.
        offload: the subset of ``save`` whose outputs wait in host memory between forward and replay.
        protect: local index -> names of arguments written to module state (BatchNorm running stats,
            ``num_batches_tracked``); the replay writes to private copies so the state is updated exactly once.
        input_shapes: shapes of the tensor arguments when profiled; other shapes run the module plainly.
        skip: local indices of ops the replay does not run, because nothing backward needs from the replay depends
            on them (NOTE [Dead ops in a replay], runtime/region.py); they return uninitialized tensors of the
            shapes the forward saw. Never in ``save``.
        plain: run the call under plain ``torch.utils.checkpoint``, without Libra's modes (NOTE [Plain regions] in
            planner/simulate.py): everything is recomputed; ``save``, ``offload`` and ``skip`` are empty; where
            ``protect`` is not, the replay alone runs under a mode that guards module state (NOTE [Guarded replay]
            in runtime/region.py).
        hooked: run the call under saved-tensor hooks that copy what it saves to host memory and back, with no
            checkpoint (NOTE [Hooked regions] in planner/simulate.py): nothing is recomputed; ``save``,
            ``offload`` and ``skip`` are empty.
        stay: hooked only: which of the call's saves stay on the device, uncopied: ordinals among the saves of
            its own tensors (not its inputs, parameters or buffers) in the order autograd makes them; the saves of
            what the call returns.
        offload_inputs: hooked only: the inputs it saves go to host memory too (nothing else saves them).
        plain_ok: plain checkpoint would recompute it exactly (it hands no random op a generator of its own; what
            it writes to module state the guarded replay protects): a call that gets other input shapes than planned
            runs that way, recomputed whole, instead of keeping everything (NOTE [Unplanned shapes] in
            runtime/apply.py).
        prefetch_after: ``[module, call]`` of the call whose backward start brings this call's offloaded tensors
            back (NOTE [Prefetch] in planner/simulate.py), planned or not; empty: they come back when this call's
            own backward starts.
    """

    module: str
    call: int
    ops: list[str]
    save: list[int]
    offload: list[int] = field(default_factory=list)
    protect: dict[int, list[str]] = field(default_factory=dict)
    input_shapes: list[list[int]] = field(default_factory=list)
    skip: list[int] = field(default_factory=list)
    plain: bool = False
    hooked: bool = False
    stay: list[int] = field(default_factory=list)
    offload_inputs: bool = False
    plain_ok: bool = False
    prefetch_after: list = field(default_factory=list)


@dataclass
class Plan:
    """What :func:`libra.plan` decided, and what it predicts.

    Attributes:
        budget_bytes: the budget the plan was made for.
        predicted_peak_bytes: simulated peak of live bytes during one step under the plan.
        predicted_step_seconds: simulated step time under the plan.
        eager_peak_bytes / eager_step_seconds / static_bytes: the profile's eager figures the plan was made against.
        decisions: one entry per saved activation, ``"blocks.3:aten.mm.default#2" -> Decision``.
        regions: what the runtime wraps; empty when everything is kept (then nothing is installed).
        parameters: (name, shape, dtype) of every parameter and buffer of the profiled model.
        input_signature: dtype and shape of every tensor input of the profiled root call (empty: not recorded);
            ``libra.apply`` runs steps with other inputs under plans of their own.
        refused: ``[module, call, reason]`` of every module call the planner could not recompute or offload, and
            why (a key/value cache, an input changed in place, a collective, ...); shown by :meth:`explain`.
        allowed: the decisions the planner was allowed (``libra.plan``'s ``decisions``), sorted; empty: not
            recorded (an older plan file). A step ``libra.apply`` plans anew is planned with the same.
        host_bandwidth: the host link's bytes per second the plan was made with; 0.0: none (offloading was not
            modelled).
        granularity: the region granularity of the plan's regions (NOTE [Region granularity] in
            planner/regions.py); empty: not recorded. A step ``libra.apply`` plans anew is planned with the same.
        unprofiled: the modules the profiled step never called whose twin in the same container it did call (layer
            drop): ``libra.apply`` recomputes them whole when they run, and the plan reserves their memory; None:
            not recorded (an older plan file: every module no decision names counts).
        provenance: where the profile's figures came from (``Profile.provenance``): ``"memory"``: ``"step"`` or
            ``"fake"``; ``"op_seconds"``: ``"step"``, ``"benchmark"``, ``"estimate"`` or ``"safe"``; ``"host_bandwidth"``: ``"measured"``,
            ``"given"`` or ``"none"``. Shown by :meth:`explain`.
    """

    budget_bytes: int
    predicted_peak_bytes: int
    predicted_step_seconds: float
    eager_peak_bytes: int
    eager_step_seconds: float
    static_bytes: int
    device: str
    solver: str
    decisions: dict[str, Decision]
    regions: list[RegionPlan]
    parameters: list[tuple[str, list[int], str]]
    peak_op: int = -1
    peak_description: str = ""
    planner_seconds: float = 0.0
    input_signature: list[str] = field(default_factory=list)
    # module calls the planner left out, and why: [module, call, reason] (calls that save nothing are not listed)
    refused: list[list] = field(default_factory=list)
    allowed: list[str] = field(default_factory=list)
    host_bandwidth: float = 0.0
    provenance: dict = field(default_factory=dict)
    granularity: str = ""
    # modules the profiled step never called that have a called twin beside them (layer drop: NOTE [Unprofiled
    # siblings] in runtime/apply.py); None: not recorded (an older plan file)
    unprofiled: list[str] | None = None
    schema_version: int = PLAN_SCHEMA_VERSION

    @property
    def counts(self) -> dict[Decision, int]:
        out = {d: 0 for d in Decision}
        for d in self.decisions.values():
            out[d] += 1
        return out

    def save(self, path) -> None:
        """Writes the plan as JSON (with ``schema_version``)."""
        from libra.planner.io import save_plan

        save_plan(self, path)

    @classmethod
    def load(cls, path) -> "Plan":
        """Reads a plan written by :meth:`save`. Never runs code from the file.

        Raises:
            PlanFormatError: the file is not valid JSON, is of another schema version, or has unknown, missing or
                invalid fields.
        """
        from libra.planner.io import load_plan

        return load_plan(path)

    def explain(self) -> str:
        """A readable account of the plan: the peak moment, what is recomputed and what it costs."""
        from libra.planner.explain import explain_plan

        return explain_plan(self)
