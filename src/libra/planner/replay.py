"""Which ops of a region's replay backward needs: the rest are skipped (NOTE [Dead ops in a replay], runtime/region.py).

Pure Python over a :class:`~libra.profiler.types.Profile`.

A replay must reproduce every storage autograd saved inside the region that the plan does not keep (its targets)
and whatever those are computed from. Walking the region's ops backwards from its last replayed op, an op is needed
when a storage it returns or writes is needed (its inputs then become needed), or when Python may read its result
(``.item()``, a bool). Storages, not tensors, are the unit: a view returns its base's storage, so an op making any
view of a needed storage is needed; that keeps more than strictly necessary, never less. Kept ops return their
cached outputs, so their inputs are not needed for them. Ops whose returns the profile did not record are needed.
"""

from __future__ import annotations

from libra.planner.regions import RegionInstance, Unit
from libra.profiler.types import Profile

__all__ = ["needed_ops", "replay_skip"]


def needed_ops(profile: Profile, inst: RegionInstance, saved: set[int]) -> set[int]:
    """Local indices of the ops of one region call that its replay must run, given the ops whose outputs are kept."""
    ops = profile.ops
    need = {profile.packs[p].storage for p in inst.packs}
    out: set[int] = set()
    for local in range(inst.stop - inst.start - 1, -1, -1):
        if local in saved:
            continue
        op = ops[inst.start + local]
        if op.returned is None or op.python_value or op.collective:
            out.add(local)
            need.update(op.inputs)
            continue
        if need.intersection(op.returned) or need.intersection(op.writes) or need.intersection(op.outputs):
            out.add(local)
            need.update(op.inputs)
    return out


def _skippable(profile: Profile, index: int) -> bool:
    """Whether skipping the op changes no memory: it allocates (its placeholder takes what its outputs took) or
    writes in place (it returns the written tensor). Views of a placeholder still run: they allocate nothing, and a
    placeholder has the strides the real output had."""
    op = profile.ops[index]
    if op.returned is None:
        return False
    return bool(op.writes) or (bool(op.outputs) and set(op.returned) <= set(op.outputs))


def replay_skip(profile: Profile, unit: Unit, saved: set[int]) -> set[int]:
    """Local indices of the ops no replay of ``unit`` needs, in any of its calls; never one in ``saved``."""
    span = min(inst.stop - inst.start for inst in unit.instances)
    skip = set(range(span)) - saved
    for inst in unit.instances:
        skip -= needed_ops(profile, inst, saved)
        skip = {j for j in skip if _skippable(profile, inst.start + j)}
    return skip
