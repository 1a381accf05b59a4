"""The default solver: a greedy over each unit's options (NOTE [Options per unit] in ``problem.py``), made monotone
in the budget by choosing from a budget-independent family (NOTE [Option family]) and chains from its members
(NOTE [Option chains] in ``chains.py``).

Growth: at the estimated peak, one unit switches to the option that frees the most bytes there per second it adds
(one that frees bytes there for no added time first); repeat. The estimate is eager's curve plus the chosen
options' effects (:class:`Curve`). Trim: each unit of a fitting plan the estimate still fits
without, the costliest first, is dropped; then each unit left moves to its cheapest option the estimate still fits,
the moves that save the most first; the simulator checks, and where it disagrees the longest prefix of the drops
and moves it accepts is kept.

NOTE [Monotone in the budget]: a larger budget must never give a plan with a higher predicted step time. A plan
that fits a budget fits every larger one, so choosing, for budget ``b``, the cheapest plan that fits ``b`` out of a
family of candidate plans that does *not* depend on ``b`` is monotone by construction: a larger budget admits a
superset of the candidates, and the cheapest of a superset costs no more. Growing a plan for ``b`` itself is not:
the growth for some ``b1 < b2`` can be cheaper than the growth for ``b2``, and a pure planner cannot remember it
(on small chains growth alone got slower with more memory at some budget steps: ``bench/planner_scaling.py``'s
``monotonicity``). A candidate counts for ``b`` when the simulator's peak fits ``b`` (and, for a chain's state, its
estimated peak too); both are properties of the candidate alone, and candidates are ranked by their simulated added
seconds (a chain's exactly, by :class:`~libra.planner.simulate.TimeModel`), so equal plans tie exactly.

NOTE [Option family]: the plan for ``b`` is the cheapest candidate, by simulated added seconds, of a family that does
not depend on ``b`` whose simulated peak fits ``b`` (NOTE [Monotone in the budget]). The family:

- the plans on the growth path from eager to the lowest estimated peak (the state after each switch, with no
  budget), trimmed at their own simulated peaks: growth that stops at the first plan under a budget adds a third
  half-used unit where two whole ones fit a little lower on the path, and the path passes those. A path longer
  than ``2 * PATH_PLANS`` gives its first ``PATH_PLANS`` plans (where units are few and such choices matter) and
  ``PATH_PLANS`` more evenly spaced;
- the same for a second path that switches to the option freeing the most bytes at the peak (the cheaper of equal
  ones): ranked by rate, three small units come before one large one, and where two large ones fit, neither path
  of rates nor the trims (one unit at a time) reaches them (a ResNet's stem and two plain blocks where two other
  plain blocks fit for less; with offload, two hooked bottlenecks where recompute fit). The two paths share most
  plans, each simulated once;
- the growth to each of ``RUNGS`` budgets evenly spaced from the path's lowest simulated peak to eager's (with
  the simulator's corrections where units interact), trimmed at that budget: these reach budgets between the
  path's plans. One growth goes down the rungs, each going on from the last one's untrimmed plan;
- each option alone where no other option alone has both a lower peak and a lower cost: the growth rule ranks bytes
  freed per second, so a unit that frees enough alone at a lower rate is never on the path, which takes two units
  of better rates instead; and likewise each pair of such options of two units (of at most ``PAIRED`` of them):
  where one unit's cheap option and another's just fit together, growth takes a third unit, or one unit's dearer
  option, at a better rate;
- the gaps: a budget between two members the rule can choose (by peak, each cheaper than every one below it) gets
  the lower one, however close the upper one's peak. So for each such pair the upper one is grown to fit one byte
  under its own peak and trimmed there, and the lower one is trimmed there too (it may spend the gap's bytes); in
  the first pass the same again at the gap's middle (a plan that fits well inside a wide gap is often not one
  byte under its top); ``FILL_ROUNDS`` passes while they add members (more passes find more, each costing about as
  much as the last). Gaps narrower than ``GAP_MIN`` of the range from the lowest peak to eager's are left: few
  budgets fall in them, and members a few kilobytes apart (a unit that frees little) make many;
- from each member a budget can choose, a chain of single steps up to the peak of the member ``REACH`` above it,
  or ``REACH_SHARE`` of the range from the lowest peak to eager's above its own where the members are denser
  (NOTE [Option chains]): one unit at a time, growth and trim miss trades of a unit for more evictions in others,
  and the members are sparse near a given budget. Where members are dense, four of them up can be a few kilobytes:
  on the bench Mixer at 75% of its activations the exact plan is a member less two plain blocks 22 MB up from it
  (1.1482x eager; the chains that stopped four members up gave 1.1516x).

A large problem (more than ``LARGE`` units, ``problem.py``) has only the rate path's plans and ``RUNGS_LARGE`` rungs,
untrimmed, and their chains: a chain's first steps take back what a plan does not need at no rise of its peak, as a
trim would, and trims, pairs and gap fills cost time quadratic in the units there (NOTE [Option family cost]).

The growth path cannot cycle: a unit only moves to an option that frees more bytes at the current peak than its
current one, and each option is taken at most once on the path, so it has at most as many steps as options.

NOTE [Option family cost]: a growth step costs O(log options) to find the best option at the peak (:class:`_Ranking`:
lazily re-scored, ranked again in O(options) when the peak moves to another op, which on the profiles measured it
does a handful of times per growth) plus O(log n) per point of the option's effect to move the estimate (O(n) in
numpy on a short profile: :func:`peak_curve`); the family runs the simulator once per member and O(log k) more times
per trim of a k-unit plan, whose checks cost the length of each unit's effect (dense: why large problems are not
trimmed), and the gap fills add at most ``FILL_ROUNDS`` growths per member the rule can choose. A chain costs O(log
n) per point per step. Members and chains are built once per selection and shared by every budget.
"""

from __future__ import annotations

import heapq

import numpy as np

from libra.planner.problem import LARGE, Choice, Problem
from libra.planner.simulate import State
from libra.planner.solvers.chains import Chain, neighbours
from libra.planner.solvers.effects import longest_prefix, peak_curve

__all__ = ["Family", "grow", "path", "trim", "RUNGS", "PATH_PLANS"]

RUNGS = 16
RUNGS_LARGE = 32  # a large problem's members are untrimmed: more of them, the chains bridge the rest
PATH_PLANS = 24  # a longer growth path has its first plans and this many more, evenly spaced, in the family
FILL_ROUNDS = 4  # passes over the gaps between members (NOTE [Option family])
REACH_LARGE = 2
REACH = 4  # a chain stops once its estimated peak passes the member this many above its start (by peak)
REACH_SHARE = 0.05  # and this share of eager's peak less the lowest above its start, whichever is higher
PAIRED = 64  # the best single options paired with each other (NOTE [Option family])
GAP_MIN = 0.005  # narrower gaps, as a share of eager's peak less the lowest, are not filled (NOTE [Option family])
_VERIFY_ROUNDS = 16


class Curve:
    """An estimated live-bytes curve (eager's plus options' effects) that keeps its peak (:func:`peak_curve`): an
    option's switch adds its sparse effect."""

    def __init__(self, problem: Problem, curve: np.ndarray) -> None:
        self.problem = problem
        self.tree = peak_curve(np.asarray(curve[: problem.n_t], dtype=np.int64))

    def peak(self) -> tuple[int, int]:
        """(largest value, first op where it is reached)."""
        return self.tree.peak()

    def add(self, o: int, sign: int = 1) -> None:
        pos, val = self.problem.points(o, clipped=True)
        self.tree.add_points(pos, val, sign)
        self.tree.forget()


def _switch(problem: Problem, curve: Curve, choice: Choice, ui: int, o: int | None) -> None:
    """Unit ``ui`` takes option ``o`` (None: it is not checkpointed), on ``curve`` and in ``choice``."""
    old = choice.get(ui)
    if old is not None:
        curve.add(old, -1)
        del choice[ui]
    if o is not None:
        curve.add(o, 1)
        choice[ui] = o


def _added(problem: Problem, unit_terms: np.ndarray, which=None, totals: np.ndarray | None = None) -> np.ndarray:
    """What switching to each option (or to each of ``which``) adds to the plan's simulated seconds, from the
    units' current ``(base, exposed, lane)`` terms (``Problem.terms``; ``totals``, their sum, where the caller keeps
    it): they add up over units but the busy link is one for all, so an offload that is free alone can cost once
    the link is full."""
    if totals is None:
        totals = unit_terms.sum(axis=0)
    which = slice(None) if which is None else which
    after = totals + problem.terms[which] - unit_terms[problem.unit_of[which]]
    return problem.sim.added_seconds(after.T) - problem.sim.added_seconds(totals)


class _Ranking:
    """The options at the estimated peak's op ``t``, best first (:func:`_growth`'s rule), ranked lazily: an option's
    score is computed again when it comes up, and goes back if it fell below the next one. Scores only fall while
    the peak stays at ``t`` (a unit's switch frees bytes there, so its other options free less, and the plan's
    seconds grow; the bytes still over the budget shrink), except for the switched unit's own options, whose
    seconds are counted from its new option: those are ranked again. So the first option that keeps its score is
    the best one, and a growth step costs O(log options) where ranking every option costs O(options)."""

    def __init__(self, problem: Problem, t: int, current: np.ndarray, unit_terms: np.ndarray, totals: np.ndarray,
                 used: np.ndarray, by_bytes: bool, over: int | None) -> None:
        self.problem, self.t, self.by_bytes = problem, t, by_bytes
        self.vals = problem.values_at(t)
        vals = self.vals
        now = np.where(current >= 0, vals[np.maximum(current, 0)], 0)
        red = now[problem.unit_of] - vals
        added = _added(problem, unit_terms, None, totals)
        open_ = (red > 0) & ~used
        open_[current[current >= 0]] = False
        # by bytes, equal ones go to the cheaper: the seconds scaled under one byte, by this scale
        self.scale = float(added.max()) + 1.0 if added.size else 1.0
        self.version = np.zeros(problem.n_units, dtype=np.int64)
        idx = np.flatnonzero(open_)
        k0, k1 = self._keys(red[idx], added[idx], over)
        self.heap = list(zip((-k0).tolist(), (-k1).tolist(), idx.tolist(), [0] * idx.size))
        heapq.heapify(self.heap)

    def _keys(self, red, added, over):
        """``(class, score)``, larger first: an option that adds no time first, by bytes freed; then by bytes freed
        per second added (``by_bytes``: by bytes, the cheaper of equal ones); bytes beyond ``over`` count as
        ``over``."""
        gain = red if over is None else np.minimum(red, over)
        free = added <= 0
        if self.by_bytes:
            score = gain - np.maximum(added, 0.0) / self.scale
        else:
            score = gain / np.maximum(added, 1e-15)
        return free.astype(np.float64), np.where(free, red, score).astype(np.float64)

    def rerank(self, ui: int, current: np.ndarray, unit_terms: np.ndarray, totals: np.ndarray,
               used: np.ndarray, over: int | None) -> None:
        """Unit ``ui`` switched: its options' scores start again from its new option."""
        self.version[ui] += 1
        mine = self.problem.unit_options(ui)
        red = self.vals[current[ui]] - self.vals[mine] if current[ui] >= 0 else -self.vals[mine]
        added = _added(self.problem, unit_terms, mine, totals)
        ok = (red > 0) & ~used[mine] & (mine != current[ui])
        k0, k1 = self._keys(red[ok], added[ok], over)
        v = int(self.version[ui])
        for a, b, o in zip((-k0).tolist(), (-k1).tolist(), mine[ok].tolist()):
            heapq.heappush(self.heap, (a, b, o, v))

    def pop(self, current: np.ndarray, unit_terms: np.ndarray, totals: np.ndarray, used: np.ndarray,
            over: int | None) -> int | None:
        """The best option still open, scored as things are now; None when none frees bytes at ``t``."""
        pr, heap, vals = self.problem, self.heap, self.vals
        terms = pr.term_tuples
        step = float(pr.sim.profile.eager_step_seconds)
        b, e, la = totals.tolist()
        before = b + max(e, la - step)  # Simulator.added_seconds, in plain floats
        while heap:
            entry = heapq.heappop(heap)
            o = entry[2]
            ui = int(pr.unit_of[o])
            if entry[3] != self.version[ui] or used[o] or current[ui] == o:
                continue
            red = (int(vals[current[ui]]) if current[ui] >= 0 else 0) - int(vals[o])
            if red <= 0:
                continue
            nb, ne, nl = terms[o]
            ob, oe, ol = terms[current[ui]] if current[ui] >= 0 else (0.0, 0.0, 0.0)
            added = (b + nb - ob) + max(e + ne - oe, la + nl - ol - step) - before
            if added <= 0:
                fresh = (-1.0, -float(red), o, entry[3])
            else:
                gain = red if over is None else min(red, over)
                score = gain - added / self.scale if self.by_bytes else gain / max(added, 1e-15)
                fresh = (-0.0, -float(score), o, entry[3])
            if heap and fresh > heap[0]:
                heapq.heappush(heap, fresh)
                continue
            return o
        return None


def _arrays(problem: Problem, choice: Choice) -> tuple[np.ndarray, np.ndarray]:
    current = np.full(problem.n_units, -1, dtype=np.int64)
    unit_terms = np.zeros((problem.n_units, 3))
    for ui, o in choice.items():
        current[ui] = o
        unit_terms[ui] = problem.terms[o]
    return current, unit_terms


def _growth(problem: Problem, choice: Choice, curve: Curve, budget: int | None = None, by_bytes: bool = False):
    """Switches units, one per step, to the best option at the estimated peak (``choice`` and ``curve`` change in
    place), yielding each switch ``(unit, option)``; ends when no option frees bytes at the peak, or when the peak
    fits ``budget``. The best: the most bytes freed per second added (``by_bytes``: the most bytes), one that adds
    no time first; bytes beyond what the peak is over the budget count as that much. Each option is taken at most
    once."""
    current, unit_terms = _arrays(problem, choice)
    totals = unit_terms.sum(axis=0)
    used = np.zeros(len(problem.options), dtype=bool)
    used[current[current >= 0]] = True
    ranking = None
    while True:
        peak, t = curve.peak()
        if budget is not None and peak <= budget:
            return
        over = None if budget is None else peak - budget
        if ranking is None or ranking.t != t:
            ranking = _Ranking(problem, t, current, unit_terms, totals, used, by_bytes, over)
        o = ranking.pop(current, unit_terms, totals, used, over)
        if o is None:
            return
        ui = int(problem.unit_of[o])
        _switch(problem, curve, choice, ui, o)
        totals += problem.terms[o] - unit_terms[ui]
        current[ui], unit_terms[ui], used[o] = o, problem.terms[o], True
        ranking.rerank(ui, current, unit_terms, totals, used, over)
        yield ui, o


def grow(problem: Problem, budget: int, choice: Choice, curve: Curve) -> bool:
    """Grows ``choice`` until its estimate fits ``budget``; False when no option frees bytes at some peak
    (``choice`` and ``curve`` are left where it stopped)."""
    for _ in _growth(problem, choice, curve, budget):
        pass
    return curve.peak()[0] <= budget


def path(problem: Problem, by_bytes: bool = False, first: int = PATH_PLANS) -> list[Choice]:
    """The growth path with no budget, from eager to the lowest estimated peak, ranked by rate or (``by_bytes``) by
    bytes freed (NOTE [Option family]): the choice after each of its ``first`` switches, and after ``PATH_PLANS``
    more evenly spaced where it is longer than ``first + PATH_PLANS``."""
    choice: Choice = {}
    steps = list(_growth(problem, choice, Curve(problem, problem.eager), by_bytes=by_bytes))
    n = len(steps)
    wanted = range(1, n + 1)
    if n > first + PATH_PLANS:  # the first ones, where units are few, and the rest evenly spaced
        rest = n - first
        wanted = sorted(set(range(1, first + 1)) | {first + 1 + rest * i // PATH_PLANS for i in range(PATH_PLANS)})
    out, choice, done = [], {}, 0
    for k in wanted:
        for ui, o in steps[done:k]:
            choice[ui] = o
        done = k
        out.append(dict(choice))
    return out


def _cheaper(problem: Problem, budget: int, ui: int, o: int, curve: np.ndarray, unit_terms: np.ndarray,
             totals: np.ndarray) -> tuple[int | None, float]:
    """Unit ``ui``'s cheapest option (None: not checkpointed) that keeps ``curve`` (without ``ui``'s option ``o``,
    within ``budget`` outside ``o``'s span) within ``budget`` and costs less than ``o`` with the other units as they
    are (their terms ``unit_terms``, summed in ``totals``), and the seconds it saves; ``(o, 0.0)`` where none
    does."""
    lo, eff = problem.span(o)
    if not eff.size:
        return None, 0.0
    # over the budget only in the span: an option must take bytes off at its highest op
    seg = curve[lo: lo + eff.size]
    top = int(np.argmax(seg))
    over = int(seg[top]) - budget
    if over <= 0:
        return None, float(problem.sim.added_seconds(totals) - problem.sim.added_seconds(totals - unit_terms[ui]))
    mine = problem.unit_options(ui)
    able = mine[problem.unit_values_at(ui, lo + top) <= -over]
    if not able.size:
        return o, 0.0
    added = _added(problem, unit_terms, able, totals)  # against the plan with ``o``
    less = added < 0
    if not less.any():
        return o, 0.0
    # the span's largest value up to each of its ops and from each on: an option must fit where it changes nothing
    upto = np.maximum.accumulate(seg)
    after = np.maximum.accumulate(seg[::-1])[::-1]
    for k in np.lexsort((able[less], added[less])):  # cheapest first, then by index
        c = int(able[less][k])
        clo, ceff = problem.span(c)
        a, b = clo - lo, clo + ceff.size - lo
        if (a > 0 and upto[min(a, seg.size) - 1] > budget) or (b < seg.size and after[max(b, 0)] > budget):
            continue
        if ceff.size and int((curve[clo: clo + ceff.size] + ceff).max()) > budget:
            continue
        return c, -float(added[less][k])
    return o, 0.0


def trim(problem: Problem, budget: int, choice: Choice, live: np.ndarray,
         simulate=None) -> tuple[Choice, np.ndarray]:
    """``choice`` (which the simulator fits under ``budget``, curve ``live``) without each unit the estimate still
    fits without, costliest first, then with each unit left moved to its cheapest option the estimate still fits
    (cheapest with the other units' choices as they are: a busy host link makes an offload that is cheap alone
    dear), the units whose move saves the most, each judged alone, first; checked by the simulator (NOTE [Option
    family cost]). Whole units go first: a unit moved to a cheaper option can spend the slack that dropping
    another, dearer in all, needed; and the larger savings go first: a unit that saves little can spend the slack
    one that saves much needed (costliest first, a dear unit moved to a slightly cheaper option can take the bytes
    another unit's much cheaper keep-set needed). ``simulate(choice) -> (curve, added seconds)`` runs the simulator (a
    caller that simulates the same choices again remembers it)."""
    # the curve stays within the budget after every step, so a step checks only the span it changes
    curve = np.array(live[: problem.n_t], dtype=np.int64)
    drops: list[tuple[int, int | None]] = []
    _, unit_terms = _arrays(problem, choice)
    totals = unit_terms.sum(axis=0)
    order = sorted(choice, key=lambda u: (-problem.cost[choice[u]], u))
    rank = {u: i for i, u in enumerate(order)}
    for ui in order:
        lo, eff = problem.span(choice[ui])
        curve[lo: lo + eff.size] -= eff
        if not eff.size or curve[lo: lo + eff.size].max() <= budget:
            drops.append((ui, None))
            totals -= unit_terms[ui]
            unit_terms[ui] = 0.0
        else:
            curve[lo: lo + eff.size] += eff
    gone = {ui for ui, _ in drops}
    left = [u for u in order if u not in gone]
    alone = {}
    for ui in left:  # each move judged alone, on the curve after the drops
        lo, eff = problem.span(choice[ui])
        curve[lo: lo + eff.size] -= eff
        alone[ui] = _cheaper(problem, budget, ui, choice[ui], curve, unit_terms, totals)
        curve[lo: lo + eff.size] += eff
    moved = False  # until a unit moves, each one's move judged alone stands
    for ui in sorted(left, key=lambda u: (-alone[u][1], rank[u])):
        cur = choice[ui]
        lo, eff = problem.span(cur)
        curve[lo: lo + eff.size] -= eff
        o = cur
        if alone[ui][1] > 0:
            o = _cheaper(problem, budget, ui, cur, curve, unit_terms, totals)[0] if moved else alone[ui][0]
        if o != cur:
            drops.append((ui, o))
            moved = True
        if o is not None:
            olo, oeff = problem.span(o)
            curve[olo: olo + oeff.size] += oeff
        totals -= unit_terms[ui]
        unit_terms[ui] = 0.0 if o is None else problem.terms[o]
        totals += unit_terms[ui]
    if not drops:
        return choice, live
    fitting: dict[int, tuple[Choice, np.ndarray]] = {0: (choice, live)}

    def fits(k: int) -> bool:
        trial = dict(choice)
        for ui, o in drops[:k]:
            if o is None:
                trial.pop(ui, None)
            else:
                trial[ui] = o
        curve = simulate(trial)[0] if simulate else problem.sim.live(problem.state(trial))[0]
        if curve.max() <= budget:
            fitting[k] = (trial, curve)
        return k in fitting

    return fitting[longest_prefix(len(drops), fits)]


def _few(problem: Problem) -> list[Choice]:
    """The plans of one unit and of two units that are best by estimate: no other option alone or pair of options
    of two units has both a lower estimated peak and a lower cost. Pairs are of the best single options (at most
    ``PAIRED`` of them, evenly spread over their peaks): growth takes the unit that frees the most at the peak per
    second, where the best pair may be two others that just fit together."""
    eager = problem.eager
    top = int(eager.max())
    # the largest value before each op, and from each op on
    before = np.concatenate(([0], np.maximum.accumulate(eager)))
    after = np.concatenate((np.maximum.accumulate(eager[::-1])[::-1], [0]))

    def peak(opts) -> int:
        spans = [problem.span(o) for o in opts]
        lo = min(s[0] for s in spans)
        hi = max(s[0] + s[1].size for s in spans)
        seg = eager[lo:hi].copy()
        for slo, eff in spans:
            seg[slo - lo: slo - lo + eff.size] += eff
        return max(int(seg.max()) if seg.size else top, int(before[lo]), int(after[hi]))

    alone = [(problem.cost[o], p, o) for o in range(len(problem.options)) if (p := peak([o])) < top]
    best = [o for _, _, o in _choosable(alone)]
    if len(best) > PAIRED:
        best = [best[i * len(best) // PAIRED] for i in range(PAIRED)]
    pairs = [(problem.cost[a] + problem.cost[b], peak([a, b]), (a, b))
             for i, a in enumerate(best) for b in best[i + 1:] if problem.unit_of[a] != problem.unit_of[b]]
    # a pair that one option alone beats on both counts is no plan a budget would choose
    front = _choosable([(c, p, (o,)) for c, p, o in alone] + pairs)
    return [{int(problem.unit_of[o]): o for o in opts} for _, _, opts in front]


def _grow_verified(problem: Problem, budget: int, choice: Choice,
                   curve: Curve) -> tuple[np.ndarray | None, Curve]:
    """Grows ``choice`` (whose estimate ``curve`` holds) until the simulator fits it under ``budget``, going on from
    the simulated curve where the units' interactions put it over: its simulated curve (None if it found none) and
    the curve of its estimate."""
    for _ in range(_VERIFY_ROUNDS):
        if not grow(problem, budget, choice, curve):
            return None, curve
        live, _ = problem.sim.live(problem.state(choice))
        if live.max() <= budget:
            return live, curve
        curve = Curve(problem, live)  # the units interact: go on from the simulated curve
    return None, curve


def _choosable(members: list) -> list:
    """The members (``(added seconds, peak, ...)``) some budget chooses, by peak: none other has both a lower peak
    and a lower cost."""
    out, best = [], None
    for m in sorted(members, key=lambda m: (m[1], m[0])):
        if best is None or m[0] < best:
            out.append(m)
            best = m[0]
    return out


class Family:
    """The budget-independent family of plans of one problem (NOTE [Option family]), built when first solved.

    Args:
        problem: the units' options.
        floor: the lowest peak the planner reaches (``Selection.minimum``): a large problem's rungs start there.
    """

    def __init__(self, problem: Problem, floor: int | None = None) -> None:
        self.problem = problem
        self.floor = int(problem.eager.max()) if floor is None else int(floor)
        self._members: list[tuple[float, int, State]] | None = None  # (added seconds, simulated peak, state)
        # every candidate, cheapest first: (simulated added seconds, estimated peak, chain or None, state i of
        # it or member index); and the simulated peaks of chain states verified so far
        self._candidates: list[tuple[float, int, Chain | None, int]] = []
        self._verified: dict[tuple[int, int], int] = {}

    @property
    def members(self) -> list[tuple[float, int, State]]:
        """``(simulated added seconds, simulated peak, state)`` of every member, cheapest first."""
        if self._members is None:
            found = self._build()
            self._members = sorted(((added, peak, self.problem.state(choice))
                                    for added, peak, choice, _ in found), key=lambda m: (m[0], m[1], len(m[2])))
            self._candidates = self._chains(found)
        return self._members

    def _chains(self, found: list[tuple[float, int, Choice, np.ndarray]]) -> list[tuple]:
        """The chains from the members a budget can choose (NOTE [Option chains]), each up to the peak of the
        member ``REACH`` above its own or ``REACH_SHARE`` of the range above it, and every candidate, members
        included, cheapest first."""
        pr = self.problem
        near: dict[int, list[int]] = {}
        diffs: dict = {}

        def nearby(o: int) -> list[int]:
            got = near.get(o)
            if got is None:
                got = near[o] = neighbours(pr, o)
            return got

        out = [(m[0], m[1], None, i) for i, m in enumerate(self._members)]
        choosable = _choosable(found)
        span = int(pr.eager.max()) - min((m[1] for m in choosable), default=0)
        reach = REACH_LARGE if pr.n_units > LARGE else REACH
        for k, (_, _, choice, live) in enumerate(choosable):
            if not choice:
                continue
            ceiling = choosable[k + reach][1] if k + reach < len(choosable) else None
            if ceiling is not None:
                ceiling = max(ceiling, choosable[k][1] + int(REACH_SHARE * span))
            chain = Chain(pr, choice, live, ceiling, nearby, diffs)
            out.extend((float(chain.costs[i]), int(chain.peaks[i]), chain, i) for i in range(1, len(chain.steps) + 1))
        return sorted(out, key=lambda c: (c[0], c[1], c[2] is not None, c[3]))

    def _build(self) -> list[tuple[float, int, Choice, np.ndarray]]:
        pr, sim = self.problem, self.problem.sim
        # (simulated added seconds, simulated peak, choice, simulated curve): the gap fills trim members again
        found: dict[tuple, tuple[float, int, Choice, np.ndarray]] = {}

        simulated: dict[tuple, tuple[np.ndarray, float]] = {}  # trims simulate the choices add() keeps

        def simulate(choice: Choice, key: tuple | None = None) -> tuple[np.ndarray, float]:
            key = tuple(sorted(choice.items())) if key is None else key
            got = simulated.get(key)
            if got is None:
                got = simulated[key] = sim.live(pr.state(choice))
            return got

        def add(choice: Choice) -> bool:
            key = tuple(sorted(choice.items()))
            if key in found:
                return False
            live, added = simulate(choice, key)
            # the rungs' growth goes on in choice: the member is a copy (its curve is the memo's, not a copy)
            found[key] = (added, int(live.max()), dict(choice), live)
            return True

        top = int(pr.eager.max())
        if pr.n_units > LARGE:  # the rungs alone, from the floor, untrimmed and unverified (NOTE [Option family])
            choice, curve = {}, Curve(pr, pr.eager)
            for i in reversed(range(RUNGS_LARGE)):
                if not grow(pr, self.floor + (top - self.floor) * i // RUNGS_LARGE, choice, curve):
                    break
                add(choice)
            return list(found.values())
        lowest = int(pr.eager.max())
        grown: dict[tuple, Choice] = {}  # the plans of both paths, each once
        for by_bytes in (False, True):
            one = path(pr, by_bytes)
            grown.update((tuple(sorted(c.items())), c) for c in one)
        for choice in grown.values():
            live, _ = simulate(choice)
            peak = int(live.max())
            lowest = min(lowest, peak)
            add(trim(pr, peak, choice, live, simulate)[0])
        for choice in _few(pr):
            add(choice)
        lowest = min([lowest] + [m[1] for m in found.values()])
        # one growth down the rungs, from the highest: each rung's plan goes on from the last one's, untrimmed
        choice: Choice = {}
        curve = Curve(pr, pr.eager)
        for i in reversed(range(1, RUNGS)):
            rung = lowest + (top - lowest) * i // RUNGS
            live, curve = _grow_verified(pr, rung, choice, curve)
            if live is None:
                break
            add(trim(pr, rung, choice, live, simulate)[0])
        # the gaps between members the rule can choose: the upper one grown to fit one byte under its own peak, and
        # the lower one trimmed there
        done: set[tuple[int, int]] = set()
        for round_ in range(FILL_ROUNDS):
            new = False
            choosable = _choosable(list(found.values()))
            for (_, low_peak, low, low_live), (_, peak, choice, _) in zip(choosable, choosable[1:]):
                if (low_peak, peak) in done or peak - low_peak < GAP_MIN * (top - lowest):
                    continue
                done.add((low_peak, peak))
                for at in (peak - 1, (low_peak + peak) // 2) if round_ == 0 else (peak - 1,):
                    trial = dict(choice)
                    live, _ = _grow_verified(pr, at, trial, Curve(pr, pr.estimate(trial)))
                    if live is not None:
                        new |= add(trim(pr, at, trial, live, simulate)[0])
                    new |= add(trim(pr, at, low, low_live, simulate)[0])
            if not new:
                break
        return list(found.values())

    def solve(self, budget: int) -> State | None:
        """The cheapest candidate (a member, or a state of a chain from one) whose simulated peak fits ``budget``,
        and for a chain's state its estimated peak too (both properties of the candidate alone: NOTE [Monotone in
        the budget]); None when none does."""
        pr = self.problem
        if pr.eager.max() <= budget:
            return {}
        members = self.members
        for cost, peak, chain, i in self._candidates:
            if peak > budget:
                continue
            if chain is None:
                return members[i][2]
            key = (id(chain), i)
            got = self._verified.get(key)
            if got is None:
                got = self._verified[key] = pr.sim.run(pr.state(chain.choice(i))).peak_bytes
            if got <= budget:
                return pr.state(chain.choice(i))
        return None
