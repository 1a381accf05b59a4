"""The planning problem: for each unit (module call), a finite list of options, each measured once by the simulator.

NOTE [Options per unit]: a plan picks at most one option per unit; a unit with none is not checkpointed. An option
is one way to run the unit's calls:

- ``Mode.MODES``: under Libra's region modes, each candidate's outputs kept on the device (``keep``), copied to host
  memory (``offload``), or recomputed in backward (the rest). A unit with up to ``EXHAUSTIVE_CANDIDATES``
  candidates gets every set of candidates to evict; a larger one gets the prefixes and the suffixes of a few
  orderings of its candidates (most bytes per second of replay first, most bytes first, last in forward first), so
  its list grows linearly, not exponentially (a suffix keeps only the best few: the plans that keep one or two of
  eight candidates, which measured op times often favour), and, in a problem of at most ``LARGE`` units, the
  prefixes of the order a greedy alone on eager's curve evicts them in (most bytes freed at the peak per second
  first: which candidates free bytes at the peak depends on when it falls in the unit's replay, which no order of
  the unit's own figures knows; each candidate's effect over the whole step is too dear for thousands of units);
  with more than ``PREFIXES`` candidates, ``PREFIXES`` lengths of each, evenly spread (NOTE [Many candidates] in
  ``regions.py``). Where offloading is allowed, each eviction set comes twice more: offloading what
  may be offloaded and recomputing the rest, and (when recompute is not allowed) offloading alone.
- ``Mode.PLAIN``: plain ``torch.utils.checkpoint`` (NOTE [Plain regions] in ``simulate.py``), where allowed.
- ``Mode.HOOKED``: saved-tensor hooks that offload what the call saves (NOTE [Hooked regions]), where allowed.
- Every option that offloads comes twice where the unit has a prefetch trigger: its copies back at its own first
  unpack, or ``early``, at the trigger (NOTE [Prefetch] in ``simulate.py``): less memory, or less copy time exposed.

Each option's effect on eager's live-bytes curve is measured by the simulator alone, once, as a sparse difference
array (NOTE [Sparse effects] in ``solvers/effects.py``), with its added seconds. A plan's estimated curve is eager's
plus the sum of its options' effects; the estimate ignores how units interact (a storage held by two units ends at
the later holder, hooked calls share copies; prefetches start at fixed points, NOTE [Prefetch]), so the solvers verify
what they choose with the simulator, which stays the single judge.
"""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass

import numpy as np

from libra.planner.simulate import EARLY, HOOKED, PLAIN, Simulator, State, is_hooked, kept_split
from libra.planner.solvers.effects import OFFLOAD, RECOMPUTE

__all__ = ["Mode", "Option", "Problem", "Choice", "EXHAUSTIVE_CANDIDATES", "LARGE"]

EXHAUSTIVE_CANDIDATES = 6  # units with at most this many candidates get every eviction set (2**6 = 64)
LARGE = 128  # a problem of more units is large: one ordering less per unit, a smaller family (NOTE [Option family])
PREFIXES = 32  # prefixes (and suffixes) of each ordering a unit with more candidates gets, evenly spread


class Mode(enum.Enum):
    MODES = "modes"
    PLAIN = "plain"
    HOOKED = "hooked"


@dataclass(frozen=True)
class Option:
    """One way to run a unit's calls (NOTE [Options per unit]); candidates in neither set are recomputed."""

    mode: Mode
    keep: frozenset[int] = frozenset()
    offload: frozenset[int] = frozenset()
    early: bool = False  # what it offloads comes back at its prefetch trigger (NOTE [Prefetch] in simulate.py)

    def entry(self) -> frozenset[int]:
        """The simulator's state entry for this option."""
        if self.mode is Mode.PLAIN:
            return PLAIN
        flag = frozenset({EARLY}) if self.early else frozenset()
        if self.mode is Mode.HOOKED:
            return HOOKED | flag
        return frozenset(self.keep) | frozenset(~j for j in self.offload) | flag

    @staticmethod
    def of_entry(entry: frozenset[int]) -> "Option":
        if entry == PLAIN:
            return Option(Mode.PLAIN)
        if is_hooked(entry):
            return Option(Mode.HOOKED, early=EARLY in entry)
        keep, offload = kept_split(entry)
        return Option(Mode.MODES, frozenset(keep), frozenset(offload), early=bool(offload) and EARLY in entry)


Choice = dict[int, int]  # unit index -> option index (into Problem.options)


def _merged(owner: list[np.ndarray], pos: list[np.ndarray], val: list[np.ndarray]):
    """Every option's sparse effect with one entry per position, in order, zeros dropped: ``(owner, pos, val)``
    sorted by option, then position (all options at once: one sort, where one ``np.unique`` per option cost more
    than measuring it)."""
    if not pos:
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty, empty
    o, p, v = np.concatenate(owner), np.concatenate(pos), np.concatenate(val)
    order = np.lexsort((p, o))
    o, p, v = o[order], p[order], v[order]
    first = np.r_[True, (o[1:] != o[:-1]) | (p[1:] != p[:-1])] if o.size else np.zeros(0, dtype=bool)
    starts = np.flatnonzero(first)
    summed = np.add.reduceat(v, starts) if starts.size else v[:0]
    keep = summed != 0
    return o[starts][keep], p[starts][keep], summed[keep]


def _dense(pos: np.ndarray, val: np.ndarray, n: int) -> np.ndarray:
    delta = np.zeros(n + 1, dtype=np.int64)
    np.add.at(delta, np.minimum(pos, n), val)
    return np.cumsum(delta)[:n]


def _at_the_peak(sim: Simulator, ui: int, eager: np.ndarray) -> list[int]:
    """The unit's candidates in the order a greedy alone on eager's curve evicts them: each time the one that frees
    the most bytes at the current peak per second it adds (each eviction measured alone, added up), then the rest
    by bytes per second. Eviction sets a unit's own byte or op-time orders miss: which candidate frees bytes at the
    peak depends on when the peak falls in its replay."""
    cands = sorted(sim.units[ui].candidates)
    n = len(eager)
    everything = frozenset(cands)
    p, v, terms = sim.changes_and_terms({ui: everything})
    base, base_s = _dense(p, v, n), sim.added_seconds(terms)
    curve = eager + base
    effect, secs = {}, {}
    for j in cands:
        p, v, terms = sim.changes_and_terms({ui: everything - {j}})
        effect[j] = _dense(p, v, n) - base
        secs[j] = max(sim.added_seconds(terms) - base_s, 1e-12)
    order, left = [], set(cands)
    while left:
        t = int(np.argmax(curve))
        freed = {j: -int(effect[j][t]) for j in left}
        best = max(left, key=lambda j: (freed[j] / secs[j], -j))
        if freed[best] <= 0:
            break
        order.append(best)
        left.discard(best)
        curve = curve + effect[best]
    size = sim.units[ui].candidate_bytes
    return order + sorted(left, key=lambda j: (-size.get(j, 0) / secs[j], j))


def _orderings(sim: Simulator, ui: int) -> list[list[int]]:
    """A few orders to evict a large unit's candidates in (NOTE [Options per unit])."""
    unit = sim.units[ui]
    cands = list(unit.candidates)
    size = unit.candidate_bytes
    secs = unit.op_seconds
    by_rate = sorted(cands, key=lambda j: (-size.get(j, 0) / max(secs[j], 1e-12), j))
    by_bytes = sorted(cands, key=lambda j: (-size.get(j, 0), j))
    latest = sorted(cands, key=lambda j: -j)
    return [by_rate, by_bytes, latest]


def _eviction_sets(sim: Simulator, ui: int, eager: np.ndarray) -> list[frozenset[int]]:
    cands = list(sim.units[ui].candidates)
    if len(cands) <= EXHAUSTIVE_CANDIDATES:
        return [frozenset(c) for r in range(1, len(cands) + 1) for c in itertools.combinations(cands, r)]
    out: dict[frozenset[int], None] = {}
    n = len(cands)
    # lengths of the prefixes and suffixes: every one, or PREFIXES of them evenly spread where the unit has more
    # candidates (NOTE [Many candidates] in regions.py: each option costs time linear in the unit's size)
    if n <= PREFIXES:
        lengths: list[int] = list(range(1, n + 1))
    else:
        lengths = sorted({max(1, round(n * k / PREFIXES)) for k in range(1, PREFIXES + 1)})
    for order in _orderings(sim, ui):
        for i in lengths:
            out.setdefault(frozenset(order[:i]), None)  # evict the first i
            out.setdefault(frozenset(order[-i:]), None)  # keep only the first len - i
    if len(sim.units) <= LARGE:  # each candidate's effect over the whole step: too dear for every unit of many
        order = _at_the_peak(sim, ui, eager)  # its suffixes would keep what frees the most at the peak
        for i in lengths:
            out.setdefault(frozenset(order[:i]), None)
    return list(out)


def unit_options(sim: Simulator, ui: int, kinds: tuple[str, ...], eager: np.ndarray) -> list[Option]:
    """Every option of unit ``ui`` with the mechanisms ``kinds`` (NOTE [Options per unit]); ``eager`` is eager's
    live-bytes curve."""
    unit = sim.units[ui]
    cands = frozenset(unit.candidates)
    out: dict[Option, None] = {}
    for evict in _eviction_sets(sim, ui, eager):
        keep = cands - evict
        if RECOMPUTE in kinds:
            out.setdefault(Option(Mode.MODES, keep), None)
        if OFFLOAD in kinds:
            movable = evict & unit.offloadable
            if movable and RECOMPUTE in kinds:
                out.setdefault(Option(Mode.MODES, keep, movable), None)
            elif movable == evict:
                out.setdefault(Option(Mode.MODES, keep, movable), None)
    if RECOMPUTE in kinds and unit.plain_ok and sim.plain_costs is not None:
        out.setdefault(Option(Mode.PLAIN), None)
    if OFFLOAD in kinds and sim.hook_ok(ui):
        out.setdefault(Option(Mode.HOOKED), None)
    if sim.prefetch_trigger[ui] >= 0:  # each offloading option again, its copies back ahead (NOTE [Prefetch])
        for opt in [o for o in out if o.offload or o.mode is Mode.HOOKED]:
            out.setdefault(Option(opt.mode, opt.keep, opt.offload, early=True), None)
    return list(out)


class Problem:
    """Units, their options, and each option's measured effect and cost (NOTE [Options per unit]).

    Args:
        sim: the simulator over one region selection.
        kinds: the mechanisms allowed, a non-empty subset of ``(RECOMPUTE, OFFLOAD)``.
    """

    def __init__(self, sim: Simulator, kinds: tuple[str, ...]) -> None:
        self.sim = sim
        self.kinds = tuple(kinds)
        self.eager = np.array(sim.live({})[0])
        self.n_t = len(self.eager)
        self.options: list[Option] = []
        unit_of, cost, terms, pos, val, owner = [], [], [], [], [], []
        self.of_unit: list[list[int]] = []
        for ui in range(len(sim.units)):
            mine = []
            for opt in unit_options(sim, ui, self.kinds, self.eager):
                p, v, seconds = sim.changes_and_terms({ui: opt.entry()})
                mine.append(len(self.options))
                owner.append(np.full(p.size, len(self.options), dtype=np.int64))
                self.options.append(opt)
                unit_of.append(ui)
                cost.append(max(sim.added_seconds(seconds), 1e-12))
                terms.append(seconds)
                pos.append(p)
                val.append(v)
            self.of_unit.append(mine)
        self.unit_of = np.array(unit_of, dtype=np.int64)
        self.cost = np.array(cost, dtype=np.float64)  # each option's added seconds alone
        # and its (base, exposed, lane) terms, which add up over units (Simulator.added_seconds)
        self.terms = np.array(terms, dtype=np.float64).reshape(-1, 3)
        self.term_tuples = [tuple(t) for t in self.terms.tolist()]  # the same, for loops over a few options
        self._owner, self.pos, self.val = _merged(owner, pos, val)
        self.ptr = np.searchsorted(self._owner, np.arange(len(self.options) + 1)).astype(np.int64)
        ptr = self.ptr.tolist()
        self._points = [(self.pos[a:b].tolist(), self.val[a:b].tolist()) for a, b in zip(ptr[:-1], ptr[1:])]
        self._spans: dict[int, tuple[int, np.ndarray]] = {}
        self._at: dict[int, np.ndarray] = {}
        self._of_unit: list[np.ndarray] | None = None
        self._index: dict[tuple[int, Option], int] | None = None  # (unit, option) -> option index, for choice_of
        self._entries: dict[int, frozenset[int]] = {}

    def unit_options(self, ui: int) -> np.ndarray:
        """The indices of unit ``ui``'s options (``of_unit[ui]`` as an array)."""
        if self._of_unit is None:
            self._of_unit = [np.array(x, dtype=np.int64) for x in self.of_unit]
        return self._of_unit[ui]

    @property
    def n_units(self) -> int:
        return len(self.of_unit)

    def points(self, o: int, clipped: bool = False) -> tuple[list[int], list[int]]:
        """Option ``o``'s effect as a sparse difference array: the curve changes by ``val[i]`` from ``pos[i]`` on
        (``clipped``: without the points past the curve's last op)."""
        pos, val = self._points[o]
        if clipped and pos and pos[-1] >= self.n_t:
            keep = [i for i, p in enumerate(pos) if p < self.n_t]
            return [pos[i] for i in keep], [val[i] for i in keep]
        return pos, val

    def span(self, o: int) -> tuple[int, np.ndarray]:
        """Option ``o``'s effect where it is not zero, dense: ``(first op, bytes at each op from there)``."""
        if o not in self._spans:
            p, v = self._points[o]
            if not p:
                self._spans[o] = (0, np.zeros(0, dtype=np.int64))
            else:
                lo = min(p)
                hi = min(max(p), self.n_t) if sum(v) == 0 else self.n_t  # one that does not cancel lasts to the end
                delta = np.zeros(hi - lo + 1, dtype=np.int64)
                np.add.at(delta, np.minimum(np.asarray(p), hi) - lo, v)
                self._spans[o] = (lo, np.cumsum(delta)[: hi - lo])
        return self._spans[o]

    def values_at(self, t: int) -> np.ndarray:
        """Every option's effect on the live bytes after op ``t`` (remembered: the solvers' peaks fall on few ops)."""
        got = self._at.get(t)
        if got is None:
            if len(self._at) >= 64:  # a growth's peaks fall on few ops, but a long one passes many
                self._at.clear()
            mask = self.pos <= t
            got = np.bincount(self._owner[mask], weights=self.val[mask], minlength=len(self.options)).astype(np.int64)
            got.flags.writeable = False
            self._at[t] = got
        return got

    def unit_values_at(self, ui: int, t: int) -> np.ndarray:
        """The effects of unit ``ui``'s options (``unit_options(ui)``, whose points lie together) on the live
        bytes after op ``t``: ``values_at(t)[unit_options(ui)]`` from the unit's points alone."""
        mine = self.unit_options(ui)
        got = self._at.get(t)
        if got is not None:
            return got[mine]
        if not mine.size:
            return np.zeros(0, dtype=np.int64)
        a, b = int(self.ptr[mine[0]]), int(self.ptr[mine[-1] + 1])
        mask = self.pos[a:b] <= t
        return np.bincount(self._owner[a:b][mask] - mine[0], weights=self.val[a:b][mask],
                           minlength=mine.size).astype(np.int64)

    def dense(self) -> np.ndarray:
        """Every option's effect at every op, ``(n_t, options)`` (for the exact solver)."""
        out = np.zeros((self.n_t + 1, len(self.options)), dtype=np.int64)
        np.add.at(out, (np.minimum(self.pos, self.n_t), self._owner), self.val)
        return np.cumsum(out, axis=0)[: self.n_t]

    def entry(self, o: int) -> frozenset[int]:
        """Option ``o``'s simulator state entry (remembered)."""
        got = self._entries.get(o)
        if got is None:
            got = self._entries[o] = self.options[o].entry()
        return got

    def state(self, choice: Choice) -> State:
        """The simulator's state of ``choice``."""
        return {ui: self.entry(o) for ui, o in choice.items()}

    def index(self, ui: int, option: Option) -> int | None:
        """The index of unit ``ui``'s ``option``, or None when it is not one of its options."""
        if self._index is None:
            self._index = {(int(self.unit_of[o]), opt): o for o, opt in enumerate(self.options)}
        return self._index.get((ui, option))

    def choice_of(self, state: State) -> Choice | None:
        """The choice whose state is ``state``, or None when one of its entries is no option here."""
        out = {}
        for ui, entry in state.items():
            o = self.index(ui, Option.of_entry(entry))
            if o is None:
                return None
            out[ui] = o
        return out

    def estimate(self, choice: Choice) -> np.ndarray:
        """Eager's curve plus the effects of ``choice``'s options (what the solvers rank by)."""
        delta = np.zeros(self.n_t + 1, dtype=np.int64)
        for o in choice.values():
            p, v = self._points[o]
            if p:  # an option that changes nothing has no points (an empty list is no index array)
                np.add.at(delta, np.minimum(p, self.n_t), v)
        return self.eager + np.cumsum(delta)[: self.n_t]
