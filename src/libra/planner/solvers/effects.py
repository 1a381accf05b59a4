"""Per-decision effects on the live-bytes curve, stored sparsely, and a tree that keeps the peak of their sum.

NOTE [Sparse effects]: checkpointing one unit, or recomputing or offloading one of its candidates, changes the live
curve only around the storages of that unit: each storage's interval ends elsewhere, an extra copy lives for a while,
a replay adds a transient. Each effect is therefore a handful of ``(op, bytes)`` entries of a difference array (the
curve changes by ``bytes`` from ``op`` on), measured by the simulator on that one decision alone in time linear in
the unit's size (``Simulator.changes``). A plan's estimated curve is eager's plus the sum of its decisions' effects;
:class:`PeakTree` keeps that sum's maximum and where it is under point updates in O(log n) each. The estimate ignores
how regions interact (a storage held by two regions ends at the later holder, hooked calls share copies), so the
solvers check what they choose with the full simulator, a few times per solve.
"""

from __future__ import annotations

import numpy as np

from libra.planner.simulate import Simulator

__all__ = ["Effects", "PeakTree", "RECOMPUTE", "OFFLOAD", "merged", "longest_prefix"]

RECOMPUTE, OFFLOAD = "recompute", "offload"

_NEG = -(1 << 62)


def _minus(pos: np.ndarray, val: np.ndarray, base_pos: np.ndarray, base_val: np.ndarray):
    """The sparse difference ``(pos, val) - (base_pos, base_val)``, merged by position, zeros dropped."""
    p = np.concatenate([pos, base_pos])
    v = np.concatenate([val, -base_val])
    if p.size == 0:
        return p, v
    uniq, inv = np.unique(p, return_inverse=True)
    summed = np.zeros(uniq.size, dtype=np.int64)
    np.add.at(summed, inv, v)
    keep = summed != 0
    return uniq[keep], summed[keep]


def merged(pos: np.ndarray, val: np.ndarray):
    """The sparse difference ``(pos, val)`` with one entry per position, zeros dropped."""
    return _minus(pos, val, np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64))


class Effects:
    """Per-decision effects on the live curve and their costs in seconds, measured one decision at a time.

    Moves are ``(unit, local op, kind)``: recompute the op's outputs, or offload them to host memory. The effect of
    checkpointing unit ``u`` at all (everything cached) is ``unit_points(u)``; the effect of one move, on top of
    that, is ``move_points(m)``; both are sparse difference arrays over the live curve (NOTE [Sparse effects]).
    Costs are the simulator's added seconds for the same single decisions.
    """

    def __init__(self, sim: Simulator, kinds=(RECOMPUTE,)) -> None:
        self.kinds = tuple(kinds)
        self.n_t = sim.n + 1
        self.eager = np.array(sim.live({})[0])
        self.moves: list[tuple[int, int, str]] = []
        self.cand_of: list[tuple[int, int]] = []  # candidate index -> (unit, local op)
        unit_pos, unit_val, unit_ptr, unit_cost = [], [], [0], []
        move_pos, move_val, move_ptr, move_cost, move_unit, move_cand = [], [], [0], [], [], []
        for ui, unit in enumerate(sim.units):
            cand = frozenset(unit.candidates)
            on_pos, on_val, on_added = sim.changes({ui: cand})
            on_pos, on_val = merged(on_pos, on_val)
            unit_pos.append(on_pos)
            unit_val.append(on_val)
            unit_ptr.append(unit_ptr[-1] + on_pos.size)
            unit_cost.append(on_added)
            for j in unit.candidates:
                n_cand = len(self.cand_of)
                self.cand_of.append((ui, j))
                for kind in self.kinds:
                    if kind == OFFLOAD and j not in unit.offloadable:
                        continue
                    kept = cand - {j} if kind == RECOMPUTE else (cand - {j}) | {~j}
                    p, v, added = sim.changes({ui: kept})
                    p, v = _minus(p, v, on_pos, on_val)
                    move_pos.append(p)
                    move_val.append(v)
                    move_ptr.append(move_ptr[-1] + p.size)
                    move_cost.append(max(added - on_added, 1e-12 if kind == RECOMPUTE else 1e-7))
                    move_unit.append(ui)
                    move_cand.append(n_cand)
                    self.moves.append((ui, j, kind))
        empty = np.zeros(0, dtype=np.int64)
        self.unit_pos = np.concatenate(unit_pos) if unit_pos else empty
        self.unit_val = np.concatenate(unit_val) if unit_val else empty
        self.unit_ptr = np.array(unit_ptr, dtype=np.int64)
        self.move_pos = np.concatenate(move_pos) if move_pos else empty
        self.move_val = np.concatenate(move_val) if move_val else empty
        self.move_ptr = np.array(move_ptr, dtype=np.int64)
        self.unit_cost = np.array(unit_cost, dtype=np.float64)
        self.move_cost = np.array(move_cost, dtype=np.float64)
        self.move_unit = np.array(move_unit, dtype=np.int64)
        self.move_cand = np.array(move_cand, dtype=np.int64)  # moves of one candidate exclude each other
        self.n_units = len(sim.units)
        # which entry belongs to which move / unit, for evaluating every effect at one op at once
        self._move_of_point = np.repeat(np.arange(len(self.moves)), np.diff(self.move_ptr))
        self._unit_of_point = np.repeat(np.arange(self.n_units), np.diff(self.unit_ptr))
        self._moves_of_unit = [np.flatnonzero(self.move_unit == u) for u in range(self.n_units)]
        self._moves_of_cand = [[] for _ in self.cand_of]
        for m, c in enumerate(self.move_cand.tolist()):
            self._moves_of_cand[c].append(m)
        # plain lists for the per-move loops
        self._move_pos = [self.move_pos[a:b].tolist() for a, b in zip(self.move_ptr[:-1], self.move_ptr[1:])]
        self._move_val = [self.move_val[a:b].tolist() for a, b in zip(self.move_ptr[:-1], self.move_ptr[1:])]
        self._unit_pos = [self.unit_pos[a:b].tolist() for a, b in zip(self.unit_ptr[:-1], self.unit_ptr[1:])]
        self._unit_val = [self.unit_val[a:b].tolist() for a, b in zip(self.unit_ptr[:-1], self.unit_ptr[1:])]
        self._rises: dict[tuple[int, bool], list[tuple[int, int, int]]] = {}

    # ---- access ---------------------------------------------------------------------------------------------
    def move_points(self, m: int) -> tuple[list[int], list[int]]:
        return self._move_pos[m], self._move_val[m]

    def unit_points(self, u: int) -> tuple[list[int], list[int]]:
        return self._unit_pos[u], self._unit_val[u]

    def moves_of_unit(self, u: int) -> np.ndarray:
        return self._moves_of_unit[u]

    def rises(self, pos: list[int], val: list[int]) -> list[tuple[int, int, int]]:
        """Where taking away the effect ``(pos, val)`` (sorted positions) raises the curve: ``(first op, last op,
        bytes)`` for each stretch it does."""
        out = []
        run = 0
        n = len(pos)
        for i in range(n):
            run += val[i]
            if run < 0:
                end = pos[i + 1] - 1 if i + 1 < n else self.n_t - 1
                if end >= pos[i]:
                    out.append((pos[i], end, -run))
        return out

    def removal_rises(self, m: int, with_unit: bool) -> list[tuple[int, int, int]]:
        """:meth:`rises` of move ``m``, and of its unit too when ``with_unit`` (it is the unit's last move)."""
        key = (m, with_unit)
        got = self._rises.get(key)
        if got is None:
            pos, val = self._move_pos[m], self._move_val[m]
            if with_unit:
                u = int(self.move_unit[m])
                merged: dict[int, int] = {}
                for p, v in zip(pos + self._unit_pos[u], val + self._unit_val[u]):
                    merged[p] = merged.get(p, 0) + v
                pos = sorted(merged)
                val = [merged[p] for p in pos]
            got = self._rises[key] = self.rises(pos, val)
        return got

    def take(self, taken: np.ndarray, m: int) -> None:
        """Marks move ``m`` and the other mechanisms of its candidate as taken."""
        taken[self._moves_of_cand[self.move_cand[m]]] = True

    def values_at(self, t: int) -> tuple[np.ndarray, np.ndarray]:
        """Every move's and every unit's effect on the live curve at op ``t`` (bytes, negative: frees)."""
        mask = self.move_pos <= t
        moves = np.bincount(self._move_of_point[mask], weights=self.move_val[mask], minlength=len(self.moves))
        mask = self.unit_pos <= t
        units = np.bincount(self._unit_of_point[mask], weights=self.unit_val[mask], minlength=self.n_units)
        return np.rint(moves).astype(np.int64), np.rint(units).astype(np.int64)

    def curve_of(self, chosen) -> np.ndarray:
        """The estimated live curve of the plan made of moves ``chosen``: eager's plus their effects."""
        delta = np.zeros(self.n_t, dtype=np.int64)
        units = sorted({int(self.move_unit[m]) for m in chosen})
        for m in chosen:
            a, b = self.move_ptr[m], self.move_ptr[m + 1]
            np.add.at(delta, self.move_pos[a:b], self.move_val[a:b])
        for u in units:
            a, b = self.unit_ptr[u], self.unit_ptr[u + 1]
            np.add.at(delta, self.unit_pos[a:b], self.unit_val[a:b])
        return self.eager + np.cumsum(delta)

    def cost(self, chosen) -> float:
        """Estimated added seconds of moves ``chosen``: their costs plus each used unit's."""
        if not len(chosen):
            return 0.0
        chosen = np.asarray(chosen, dtype=np.int64)
        units = np.unique(self.move_unit[chosen])
        return float(self.move_cost[chosen].sum() + self.unit_cost[units].sum())


class PeakTree:
    """The maximum of a curve, and its first position, under point changes of its difference array.

    A segment tree over the difference array: each node holds the sum of its range and the largest prefix sum in
    it (with where), so changing one entry costs O(log n) and the curve's peak is the root's largest prefix sum.
    Changes can be rolled back to a mark (for trial moves).
    """

    def __init__(self, curve: np.ndarray) -> None:
        curve = np.asarray(curve, dtype=np.int64)
        self.n = n = len(curve)
        size = 1
        while size < max(n, 1):
            size *= 2
        self.size = size
        delta = np.zeros(size, dtype=np.int64)
        delta[:n] = np.diff(curve, prepend=0)
        sums = [None] * (2 * size)
        best = [None] * (2 * size)
        where = [None] * (2 * size)
        s = delta
        b = np.where(np.arange(size) < n, delta, _NEG)
        w = np.arange(size, dtype=np.int64)
        level = size
        while level >= 1:
            sums[level:2 * level] = s.tolist()
            best[level:2 * level] = b.tolist()
            where[level:2 * level] = w.tolist()
            if level == 1:
                break
            sl, sr = s[0::2], s[1::2]
            bl, br = b[0::2], b[1::2]
            cand = sl + br
            left = bl >= cand
            s = sl + sr
            b = np.where(left, bl, cand)
            w = np.where(left, w[0::2], w[1::2])
            level //= 2
        self._sum, self._best, self._where = sums, best, where
        self._log: list[tuple[int, int]] = []

    def add(self, pos: int, val: int) -> None:
        """Adds ``val`` to the curve from ``pos`` on."""
        self.add_points((pos,), (val,))

    def add_points(self, pos, val, sign: int = 1) -> None:
        """Adds ``sign * val[i]`` to the curve from ``pos[i]`` on, for every i."""
        sums, best, where, log = self._sum, self._best, self._where, self._log
        size = self.size
        for p, v in zip(pos, val):
            v *= sign
            log.append((p, v))
            i = p + size
            sums[i] += v
            best[i] = sums[i]
            i >>= 1
            while i:
                lft = 2 * i
                sl = sums[lft]
                sums[i] = sl + sums[lft + 1]
                cand = sl + best[lft + 1]
                if best[lft] >= cand:
                    best[i] = best[lft]
                    where[i] = where[lft]
                else:
                    best[i] = cand
                    where[i] = where[lft + 1]
                i >>= 1

    def range_max(self, a: int, b: int) -> int:
        """The largest value of the curve over positions ``a..b`` (inclusive)."""
        sums, best, size = self._sum, self._best, self.size
        run = 0
        r = a + size
        lo = size
        while lo < r:  # sum of the difference array before a
            if r & 1:
                r -= 1
                run += sums[r]
            lo >>= 1
            r >>= 1
        lft, rgt = a + size, b + size + 1
        tail = []
        out = _NEG
        while lft < rgt:
            if lft & 1:
                if run + best[lft] > out:
                    out = run + best[lft]
                run += sums[lft]
                lft += 1
            if rgt & 1:
                rgt -= 1
                tail.append(rgt)
            lft >>= 1
            rgt >>= 1
        for x in reversed(tail):
            if run + best[x] > out:
                out = run + best[x]
            run += sums[x]
        return out

    def peak(self) -> tuple[int, int]:
        """(largest value of the curve, first position where it is reached)."""
        return self._best[1], self._where[1]

    def mark(self) -> int:
        return len(self._log)

    def add_merged(self, groups) -> None:
        """Adds several effects at once, ``(pos, val, sign)`` each: entries at one position are summed first, so
        the tree is walked once per distinct position."""
        merged: dict[int, int] = {}
        for pos, val, sign in groups:
            for p, v in zip(pos, val):
                merged[p] = merged.get(p, 0) + sign * v
        pos = [p for p, v in merged.items() if v]
        self.add_points(pos, [merged[p] for p in pos])

    def rollback(self, mark: int) -> None:
        """Undoes every change since ``mark``."""
        log = self._log
        undone = log[mark:]
        del log[mark:]
        self.add_merged([([p for p, _ in undone], [v for _, v in undone], -1)])
        del log[mark:]

    def forget(self) -> None:
        """Drops the change log (the changes stay)."""
        self._log.clear()

    def curve(self) -> np.ndarray:
        return np.cumsum(np.array(self._sum[self.size:self.size + self.n], dtype=np.int64))


def longest_prefix(n: int, fits) -> int:
    """The largest ``k <= n`` for which ``fits(k)`` holds (``fits(0)`` does), trusting that a prefix of a fitting
    prefix fits too: ``n`` first (the estimate that chose the changes is usually right), else a bisection,
    O(log n) calls."""
    if n == 0 or fits(n):
        return n
    lo, hi = 0, n
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo
