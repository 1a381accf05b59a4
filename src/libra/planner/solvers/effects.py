"""Sparse effects on the live-bytes curve, and a tree that keeps the peak of their sum.

NOTE [Sparse effects]: checkpointing one unit under one option changes the live curve only around the storages of
that unit: each storage's interval ends elsewhere, an extra copy lives for a while, a replay adds a transient. Each
effect is therefore a handful of ``(op, bytes)`` entries of a difference array (the curve changes by ``bytes`` from
``op`` on), measured by the simulator on that one decision alone in time linear in the unit's size
(``Simulator.changes``). A plan's estimated curve is eager's plus the sum of its decisions' effects; :class:`PeakTree`
keeps that sum's maximum and where it is under point updates in O(log n) each. The estimate ignores how regions
interact (a storage held by two regions ends at the later holder, hooked calls share copies), so the solvers check
what they choose with the full simulator, a few times per solve.
"""

from __future__ import annotations

import numpy as np

__all__ = ["PeakTree", "DenseCurve", "peak_curve", "RECOMPUTE", "OFFLOAD", "longest_prefix"]

RECOMPUTE, OFFLOAD = "recompute", "offload"

_NEG = -(1 << 62)


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


class DenseCurve:
    """:class:`PeakTree`'s interface over a plain array: a change of the difference array costs O(n) in numpy and the
    peak one ``argmax``, which for a few thousand ops is less than building and walking a tree."""

    def __init__(self, curve: np.ndarray) -> None:
        self.values = np.array(curve, dtype=np.int64)
        self.n = len(self.values)

    def peak(self) -> tuple[int, int]:
        t = int(np.argmax(self.values))
        return int(self.values[t]), t

    def range_max(self, a: int, b: int) -> int:
        return int(self.values[a:b + 1].max())

    def add_points(self, pos, val, sign: int = 1) -> None:
        if len(pos):
            delta = np.zeros(self.n, dtype=np.int64)
            np.add.at(delta, np.asarray(pos, dtype=np.int64), np.asarray(val, dtype=np.int64) * sign)
            self.values += np.cumsum(delta)

    def forget(self) -> None:
        pass


DENSE_OPS = 16384


def peak_curve(curve: np.ndarray) -> "PeakTree | DenseCurve":
    """A curve that keeps its peak under changes of its difference array: dense up to ``DENSE_OPS`` points, else
    on a :class:`PeakTree` (a unit's effect spans its forward to its backward, so on long profiles a dense change
    costs the length of the step where the tree costs O(log n) per point)."""
    return DenseCurve(curve) if len(curve) <= DENSE_OPS else PeakTree(curve)


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
