"""The Profile: plain data recorded from one eager training step, serializable to JSON.

Op indices count every aten op the step dispatched, forward and backward, in order. A storage is alive over the
inclusive op range ``[alloc_op, free_op]``; ``alloc_op == -1`` marks storages that were live when the step began.
"""

from __future__ import annotations

import dataclasses
import gzip
import json
from dataclasses import dataclass, field
from pathlib import Path

from libra.errors import PlanFormatError

__all__ = ["OpRecord", "StorageRecord", "PackRecord", "ModuleCall", "Profile", "PROFILE_SCHEMA_VERSION"]

PROFILE_SCHEMA_VERSION = 7  # 2: per-op transient bytes and the allocator's own peak (NOTE [Allocator truth]);
# 3: the host link's bandwidth, measured by the profiler; 4: when Python let go of each storage (StorageRecord.held_op)
# and what each module call was handed (ModuleCall.arg_storages); 5: when autograd let go of each save
# (PackRecord.released_op); 6: what the allocator held between ops that no storage accounts for
# (OpRecord.untracked_bytes); 7: whether a saved tensor had autograd history (PackRecord.activation)


@dataclass
class OpRecord:
    """One dispatched aten op."""

    name: str  # "aten.mm.default"
    seconds: float
    backward: bool  # ran inside an autograd node
    module: str  # FQN of the innermost module whose forward was running ("" for the root or none)
    inputs: list[int]  # storage ids read
    outputs: list[int]  # fresh storage ids this op allocated
    writes: list[int]  # storage ids written (declared by the schema, or detected by comparing values)
    undeclared_writes: list[str]  # argument names mutated without the schema saying so (BatchNorm running stats)
    random: bool = False  # torch.Tag.nondeterministic_seeded
    collective: bool = False
    returned: list[int] | None = None  # storage ids of every returned tensor, fresh or a view (None: not recorded)
    python_value: bool = False  # returns a number or bool Python can branch on (``.item()``): always replayed
    generator: bool = False  # a random op handed an explicit torch.Generator (never under plain checkpoint)
    # bytes the op's kernels held inside it above what it holds when it returns (workspaces, temporaries), from the
    # allocator itself (NOTE [Allocator truth] in libra/_allocator.py); charged at the op, and at every replay of it
    transient_bytes: int = 0
    # of those, what the allocator still held when the op returned and the next began, that no storage of the profile
    # accounts for (NOTE [Untracked bytes] in planner/simulate.py); 0 where not measured (on CUDA, or by hand)
    untracked_bytes: int = 0


@dataclass
class StorageRecord:
    """One storage seen during the step, keyed by the storage object (never by data_ptr)."""

    nbytes: int
    alloc_op: int  # -1: live when the step began
    free_op: int  # last op index during which it was alive; n_ops when it outlived the step
    producer: int = -1  # op index that allocated it, -1 if static or opaque
    static: bool = False
    # last op index during which a tensor object of it that a forward op returned was alive (NOTE [Who holds a
    # storage] in planner/simulate.py); n_ops when one outlived the step, -1 when not recorded (profiles made by hand)
    held_op: int = -1


@dataclass
class PackRecord:
    """One tensor autograd saved for backward (one saved-tensor pack call)."""

    storage: int
    pack_op: int  # number of ops dispatched when it was saved (inputs are saved before their op runs, outputs after)
    module_call: int = -1  # index into Profile.module_calls of the innermost module call it was saved in
    first_unpack: int = -1  # op index about to run when it was first unpacked; -1 if never
    last_unpack: int = -1
    # the last op that ran before autograd let go of the save (NOTE [Release after unpack] in planner/regions.py):
    # the node that holds it is released after its backward has run, or with the graph; the step's op count if it
    # outlived the step
    released_op: int = -1
    # the saved tensor had autograd history (a grad_fn) when saved: a hooked call copies to host memory only such
    # inputs (runtime/region.py, HookRun.pack); position ids, masks and other tensors made without it stay put
    activation: bool = True


@dataclass
class ModuleCall:
    """One call of a submodule's ``forward``: ops ``[start_op, end_op)`` ran inside it."""

    module: str
    call: int  # index of this call of the module within its root call
    root_call: int
    start_op: int
    end_op: int
    depth: int
    parent: int = -1  # index of the enclosing module call, -1 for a root call
    input_shapes: list[list[int]] = field(default_factory=list)
    kv_cache_args: list[str] = field(default_factory=list)  # NOTE [Key/value caches are not replayable]
    # storage ids of the tensors it was handed (arguments and keyword arguments) that ops had made or read before:
    # a checkpointed call holds them all until its backward, also those none of its ops reads
    arg_storages: list[int] = field(default_factory=list)


@dataclass
class Profile:
    """What one eager step did. Produced by :func:`libra.profile`, consumed by :func:`libra.plan`.

    Attributes:
        eager_peak_bytes: peak of all live tensor bytes on the device during the step, static bytes included.
        static_bytes: bytes live on the device when the step began (parameters, buffers, gradients, optimizer
            state, inputs).
        eager_step_seconds: the sum of the ops' times (NOTE [Eager step time] in profiler/__init__.py).
        allocator: where the ops' ``transient_bytes`` came from: ``"cuda"`` (the caching allocator's statistics),
            ``"cpu-events"`` (torch.profiler's memory events), ``"benchmark"`` (each op of a fake profile run alone
            on real tensors), ``""`` (not measured: every op's are 0).
        allocator_peak_bytes: the step's peak as the allocator itself saw it, static bytes included, a second
            opinion on ``eager_peak_bytes`` (-1: not measured).
    """

    device: str
    eager_peak_bytes: int
    static_bytes: int
    eager_step_seconds: float
    dispatch_overhead_seconds: float  # measured cost of one op through a Python dispatch mode
    ops: list[OpRecord]
    storages: list[StorageRecord]
    packs: list[PackRecord]
    module_calls: list[ModuleCall]
    parameters: list[tuple[str, list[int], str]]  # (name, shape, dtype) of every parameter and buffer
    input_signature: list[str] = field(default_factory=list)  # the root call's tensor inputs (libra._ops)
    # what the region executor adds, measured (NOTE [Region overhead], runtime/calibrate.py): seconds per forward
    # op, per replayed op and per call under Libra's modes, then the same under plain checkpoint; [] not measured
    region_costs: list[float] = field(default_factory=list)
    # seconds per byte of cloning a tensor on the device, into a fresh buffer (NOTE [Copy cost] in
    # planner/simulate.py); 0.0: not measured
    copy_seconds_per_byte: float = 0.0
    torch_version: str = ""
    allocator: str = ""
    allocator_peak_bytes: int = -1
    # bytes on the device of the generator state ``checkpoint(preserve_rng_state=True)`` stashes per call: the CPU
    # generator's on a CPU device, 0 on CUDA (its states are host tensors) (NOTE [RNG state] in planner/simulate.py)
    rng_state_bytes: int = 0
    # where the figures come from: "memory" ("step": a real step; "fake": fake tensors, NOTE [Fake profiles]),
    # "op_seconds" ("step": timed in the step; "benchmark": each op signature timed alone on real tensors;
    # "estimate": from its operations and bytes, NOTE [Estimated op times]; "safe": from a real step with every
    # module call recomputed, NOTE [Safe timing])
    provenance: dict = field(default_factory=dict)
    # [storage id, name] of the model's static tensors: "blocks.0.fc1.weight", "gradient of blocks.0.fc1.weight",
    # "buffer bn.running_mean" (what error messages name at a peak)
    static_names: list = field(default_factory=list)
    # bytes per second of the device's host link, its slower direction (profiler/link.py); 0.0: none measured (a
    # CPU device, whose host memory is its own memory). The planner models offloading with it unless given another.
    host_bandwidth: float = 0.0
    schema_version: int = PROFILE_SCHEMA_VERSION

    @property
    def n_ops(self) -> int:
        return len(self.ops)

    @property
    def first_backward_op(self) -> int:
        """Index of the first op that ran in backward (``n_ops`` when none did)."""
        return next((i for i, o in enumerate(self.ops) if o.backward), len(self.ops))

    @property
    def activation_peak_bytes(self) -> int:
        """Eager peak above the static bytes: what the budget shares in the README refer to."""
        return self.eager_peak_bytes - self.static_bytes

    def budget_for_share(self, share: float) -> int:
        """Budget that allows ``share`` of eager's activation memory: static bytes + share of the peak above them."""
        return self.static_bytes + int(share * self.activation_peak_bytes)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def save(self, path) -> None:
        """Writes the profile as JSON (with ``schema_version``), gzip-compressed where ``path`` ends in ``.gz``
        (a tenth of the size: a large model's profile holds tens of thousands of ops)."""
        text = json.dumps(self.to_dict()) + "\n"
        if str(path).endswith(".gz"):
            with gzip.open(path, "wt", encoding="utf-8") as f:
                f.write(text)
        else:
            Path(path).write_text(text)

    @classmethod
    def load(cls, path) -> "Profile":
        """Reads a profile written by :meth:`save` (gzip-compressed where ``path`` ends in ``.gz``); never runs code
        from the file.

        Raises:
            PlanFormatError: the file is unreadable, not JSON, of another schema version, or has invalid fields.
        """
        fix = "Fix: record a new one with libra.profile(model, step).save(path) or `libra profile`."
        try:
            if str(path).endswith(".gz"):
                with gzip.open(path, "rt", encoding="utf-8") as f:
                    data = json.loads(f.read())
            else:
                data = json.loads(Path(path).read_text())
        except (OSError, EOFError, json.JSONDecodeError) as e:
            raise PlanFormatError(f"libra.Profile.load: cannot read {path} as JSON ({e}). {fix}") from None
        if not isinstance(data, dict) or data.get("schema_version") != PROFILE_SCHEMA_VERSION:
            version = data.get("schema_version") if isinstance(data, dict) else None
            raise PlanFormatError(
                f"libra.Profile.load: {path} has schema_version {version!r}; this Libra reads "
                f"{PROFILE_SCHEMA_VERSION}. {fix}"
            )
        try:
            return cls.from_dict(data)
        except (TypeError, KeyError, ValueError) as e:
            raise PlanFormatError(f"libra.Profile.load: {path} has invalid fields ({e}). {fix}") from None

    @classmethod
    def from_dict(cls, data: dict) -> "Profile":
        data = dict(data)
        data["ops"] = [OpRecord(**o) for o in data["ops"]]
        data["storages"] = [StorageRecord(**s) for s in data["storages"]]
        data["packs"] = [PackRecord(**p) for p in data["packs"]]
        data["module_calls"] = [ModuleCall(**m) for m in data["module_calls"]]
        data["parameters"] = [tuple(p) for p in data["parameters"]]
        return cls(**data)
