"""The default solver: a greedy over each unit's options (NOTE [Options per unit] in ``problem.py``), made monotone
in the budget by choosing from a budget-independent family (NOTE [Option family]).

Growth: at the estimated peak, one unit switches to the option that frees the most bytes there per second it adds
(one that frees bytes there for no added time first); repeat. The estimate is eager's curve plus the chosen
options' effects, kept dense (:class:`Curve`). Trim: each unit of a fitting plan the estimate still fits without,
the costliest first, is dropped; then each unit left moves to its cheapest option the estimate still fits, the
moves that save the most first; the simulator checks, and where it disagrees the longest prefix of the drops and
moves it accepts is kept.

NOTE [Option family]: a larger budget must never give a slower plan (NOTE [Monotone in the budget] in
``front.py``), so the plan for ``b`` is the cheapest member, by simulated added seconds, of a family that does not
depend on ``b`` whose simulated peak fits ``b``. The family:

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
  budgets fall in them, and members a few kilobytes apart (a unit that frees little) make many.

The planner takes the cheaper of this family's plan and the move-level front's (``front.py``), both chosen by the
same rule, so the result stays monotone. Neither alone is enough (``bench/planner_family.py`` measures each): the
front's chains trade a unit for more evictions in two others, which growth and trim, one unit at a time, do not, and
its single moves reach keep-sets no option ordering lists; the family has two whole units where the front adds a
third half-used one, units that fit alone, and the plans with offload. Selections of more than
``FAMILY_MAX_UNITS`` units plan with the front alone.

The growth path cannot cycle: a unit only moves to an option that frees more bytes at the current peak than its
current one, and each option is taken at most once on the path, so it has at most as many steps as options.

NOTE [Option family cost]: a growth step costs O(options) to rank every option at the peak (each option's effect
there is remembered per op, and the peaks fall on few ops) plus O(ops) to move the dense estimate; the family runs
the simulator once per member and O(log k) more times per trim of a k-unit plan, and the gap fills add at most
``FILL_ROUNDS`` growths per member the rule can choose. Members are built once per selection and shared by every
budget.
"""

from __future__ import annotations

import numpy as np

from libra.planner.problem import Choice, Problem
from libra.planner.simulate import State
from libra.planner.solvers.effects import longest_prefix

__all__ = ["Family", "grow", "path", "trim", "RUNGS", "PATH_PLANS"]

RUNGS = 16
PATH_PLANS = 24  # a longer growth path has its first plans and this many more, evenly spaced, in the family
FILL_ROUNDS = 4  # passes over the gaps between members (NOTE [Option family])
PAIRED = 64  # the best single options paired with each other (NOTE [Option family])
GAP_MIN = 0.005  # narrower gaps, as a share of eager's peak less the lowest, are not filled (NOTE [Option family])
_VERIFY_ROUNDS = 16


class Curve:
    """An estimated live-bytes curve (eager's plus options' effects), dense: an option's switch adds its dense
    effect (``Problem.span``), and the peak is one ``argmax`` (a few microseconds for thousands of ops, less than
    walking a tree per point of an option's effect)."""

    def __init__(self, problem: Problem, curve: np.ndarray) -> None:
        self.problem = problem
        self.values = np.array(curve[: problem.n_t], dtype=np.int64)

    def peak(self) -> tuple[int, int]:
        """(largest value, first op where it is reached)."""
        t = int(np.argmax(self.values))
        return int(self.values[t]), t

    def add(self, o: int, sign: int = 1) -> None:
        lo, eff = self.problem.span(o)
        self.values[lo: lo + eff.size] += sign * eff


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


def _best_switch(problem: Problem, curve: Curve, current: np.ndarray, unit_terms: np.ndarray,
                 over: int | None, used: np.ndarray | None, by_bytes: bool = False) -> int | None:
    """The option to switch to at the estimated peak (None when none frees bytes there): the most bytes freed per
    second added (``by_bytes``: the most bytes), one that adds no time first; bytes beyond ``over`` (what the peak
    is above the budget) count as ``over``."""
    _, t = curve.peak()
    vals = problem.values_at(t)
    now = np.where(current >= 0, vals[np.maximum(current, 0)], 0)
    red = now[problem.unit_of] - vals
    added = _added(problem, unit_terms)
    open_ = red > 0
    if used is not None:
        open_ &= ~used
    open_[current[current >= 0]] = False
    if not open_.any():
        return None
    free = open_ & (added <= 0)
    if free.any():
        return int(np.flatnonzero(free)[np.argmax(red[free])])
    gain = red if over is None else np.minimum(red, over)
    if by_bytes:  # the most bytes; of equal ones the cheapest (the added seconds scaled under one byte)
        return int(np.argmax(np.where(open_, gain - np.maximum(added, 0.0) / (added.max() + 1.0), -np.inf)))
    return int(np.argmax(np.where(open_, gain / np.maximum(added, 1e-15), -np.inf)))


def _arrays(problem: Problem, choice: Choice) -> tuple[np.ndarray, np.ndarray]:
    current = np.full(problem.n_units, -1, dtype=np.int64)
    unit_terms = np.zeros((problem.n_units, 3))
    for ui, o in choice.items():
        current[ui] = o
        unit_terms[ui] = problem.terms[o]
    return current, unit_terms


def _growth(problem: Problem, choice: Choice, curve: Curve, budget: int | None = None, by_bytes: bool = False):
    """Switches units, one per step, to the best option at the estimated peak (``choice`` and ``curve`` change in
    place), yielding after each; ends when no option frees bytes at the peak, or when the peak fits ``budget``.
    Each option is taken at most once."""
    current, unit_terms = _arrays(problem, choice)
    used = np.zeros(len(problem.options), dtype=bool)
    used[current[current >= 0]] = True
    while True:
        peak, _ = curve.peak()
        if budget is not None and peak <= budget:
            return
        o = _best_switch(problem, curve, current, unit_terms, None if budget is None else peak - budget, used,
                         by_bytes)
        if o is None:
            return
        ui = int(problem.unit_of[o])
        _switch(problem, curve, choice, ui, o)
        current[ui], unit_terms[ui], used[o] = o, problem.terms[o], True
        yield


def grow(problem: Problem, budget: int, choice: Choice, curve: Curve) -> bool:
    """Grows ``choice`` until its estimate fits ``budget``; False when no option frees bytes at some peak
    (``choice`` and ``curve`` are left where it stopped)."""
    for _ in _growth(problem, choice, curve, budget):
        pass
    return curve.peak()[0] <= budget


def path(problem: Problem, by_bytes: bool = False) -> list[Choice]:
    """The growth path with no budget: the choice after each switch, from eager to the lowest estimated peak,
    ranked by rate or (``by_bytes``) by bytes freed (NOTE [Option family])."""
    choice: Choice = {}
    return [dict(choice) for _ in _growth(problem, choice, Curve(problem, problem.eager), by_bytes=by_bytes)]


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
    """

    def __init__(self, problem: Problem) -> None:
        self.problem = problem
        self._members: list[tuple[float, int, State]] | None = None  # (added seconds, simulated peak, state)

    @property
    def members(self) -> list[tuple[float, int, State]]:
        """``(simulated added seconds, simulated peak, state)`` of every member, cheapest first."""
        if self._members is None:
            self._members = self._build()
        return self._members

    def _build(self) -> list[tuple[float, int, State]]:
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

        lowest = int(pr.eager.max())
        grown: dict[tuple, Choice] = {}  # the plans of both paths, each once
        for by_bytes in (False, True):
            one = path(pr, by_bytes)
            if len(one) > 2 * PATH_PLANS:  # the first ones, where units are few, and the rest evenly spaced
                rest = len(one) - PATH_PLANS
                one = one[:PATH_PLANS] + [one[PATH_PLANS + rest * i // PATH_PLANS] for i in range(PATH_PLANS)]
            grown.update((tuple(sorted(c.items())), c) for c in one)
        for choice in grown.values():
            live, _ = simulate(choice)
            peak = int(live.max())
            lowest = min(lowest, peak)
            add(trim(pr, peak, choice, live, simulate)[0])
        for choice in _few(pr):
            add(choice)
        lowest = min([lowest] + [m[1] for m in found.values()])
        top = int(pr.eager.max())
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
        members = [(added, peak, pr.state(choice)) for added, peak, choice, _ in found.values()]
        return sorted(members, key=lambda m: (m[0], m[1], len(m[2])))

    def solve(self, budget: int) -> State | None:
        """The cheapest member whose simulated peak fits ``budget``; None when none does."""
        if self.problem.eager.max() <= budget:
            return {}
        for _, peak, state in self.members:
            if peak <= budget:
                return state
        return None
