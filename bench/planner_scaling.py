"""Planner time against profile size, and the planner's monotonicity in the budget (issue 4, parts 3 and 5).

    .venv/bin/python bench/planner_scaling.py [--max-storages N] [--no-gpt2]

Times ``libra.plan`` (analysis, options and the monotone family with its chains) on synthetic chain profiles of 1k to
100k saved storages at half of eager's activation memory, next to the growth for that exact budget alone
(:func:`exact_budget_growth`, the baseline: not monotone), and fits the growth exponent. Every plan is checked by the simulator against its budget.
Then: planner time on a 12-layer GPT-2-small-like profile (profiled here, on the CPU); how often a larger budget
gives a slower plan on small chains (720 budget steps), for the planner and for the baseline; and what the
monotone plan costs against the baseline's over 41 budgets per profile.

Writes bench/results/planner-scaling-<date>.json.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np
import torch

import libra
from libra.planner import Planning
from libra.planner.problem import LARGE
from libra.planner.solvers import options
from libra.testing.synthetic import chain_profile

OPS_PER_BLOCK = 5
SIZES = (100, 300, 1000, 3000, 10000)  # blocks: 1003 ... 100003 saved storages
SHARE = 0.5


def exact_budget_growth(sel, target: int):
    """The baseline: the option growth for exactly ``target`` from eager, verified by the simulator, trimmed where the
    selection is not large (NOTE [Option family] in solvers/options.py); None where it gets stuck."""
    problem = sel.problem
    choice: dict = {}
    live, _ = options._grow_verified(problem, target, choice, options.Curve(problem, problem.eager))
    if live is None:
        return None
    if problem.n_units <= LARGE:
        choice = options.trim(problem, target, choice, live)[0]
    return problem.state(choice)


def scaling_row(n_blocks: int) -> dict:
    t0 = time.perf_counter()
    prof = chain_profile(n_blocks, OPS_PER_BLOCK, seed=0)
    generate = time.perf_counter() - t0
    t0 = time.perf_counter()
    base = Planning(prof)
    budget = max(prof.budget_for_share(SHARE), base.min_budget_bytes())
    target = base.target_bytes(budget)
    raw = exact_budget_growth(base.selections[0], target)
    raw_seconds = time.perf_counter() - t0
    raw_result = base.sim.run(raw)
    t0 = time.perf_counter()
    planning = Planning(prof)
    analysis = time.perf_counter() - t0
    plan = libra.plan(planning, budget)
    seconds = time.perf_counter() - t0
    checked = planning.sim.run(planning.selections[0].family.solve(target))
    if not (plan.predicted_peak_bytes <= budget and checked.peak_bytes <= target and raw_result.peak_bytes <= target):
        raise SystemExit(f"bench/planner_scaling.py: a plan over its budget at {n_blocks} blocks")
    return {
        "storages": len(prof.storages), "ops": prof.n_ops, "units": len(planning.units),
        "options": len(planning.selections[0].problem.options), "generate_s": generate, "planner_s": seconds,
        "analysis_s": analysis, "baseline_solve_at_s": raw_seconds, "budget_bytes": budget,
        "predicted_peak_bytes": plan.predicted_peak_bytes,
        "added_seconds": plan.predicted_step_seconds - prof.eager_step_seconds,
        "baseline_added_seconds": raw_result.added_seconds, "recomputed": plan.counts[libra.Decision.RECOMPUTE],
    }


def fitted_exponent(rows: list[dict], key: str) -> float:
    x = np.log([r["storages"] for r in rows])
    y = np.log([r[key] for r in rows])
    return float(np.polyfit(x, y, 1)[0])


def gpt2_small() -> dict:
    from libra.testing import models

    cfg = dict(batch=4, layers=12, d=768, heads=12, seq=256, vocab=50304, dropout=0.1)
    model, x, y, loss_fn = models.make_gpt(**cfg)
    prof = libra.profile(model, lambda: loss_fn(model(x), y).backward())
    out = {"config": cfg, "ops": prof.n_ops, "storages": len(prof.storages), "plans": []}
    for bandwidth in (None, 2e10):
        for share in (0.95, 0.75, 0.5):
            t0 = time.perf_counter()
            try:
                plan = libra.plan(prof, prof.budget_for_share(share), host_bandwidth=bandwidth)
            except libra.BudgetInfeasibleError as e:
                plan = libra.plan(prof, e.min_budget_bytes, host_bandwidth=bandwidth)
            out["plans"].append({"share": share, "host_bandwidth": bandwidth, "planner_s": time.perf_counter() - t0,
                                 "counts": {d.value: c for d, c in plan.counts.items()}})
    out["max_planner_s"] = max(p["planner_s"] for p in out["plans"])
    return out


def monotonicity() -> dict:
    """Budget steps on small chains where a larger budget gave a slower plan: the planner, and the baseline."""
    cases = [(nb, ob, seed) for nb, ob in [(2, 6), (3, 4), (4, 3), (5, 5), (6, 2), (8, 4)] for seed in range(4)]
    out = {}
    for name, exact in (("plan", False), ("baseline_solve_at", True)):
        steps = violations = 0
        worst = 1.0
        for nb, ob, seed in cases:
            prof = chain_profile(nb, ob, seed=seed)
            planning = Planning(prof)
            lo, hi = planning.min_budget_bytes(), prof.eager_peak_bytes
            prev = None
            for k in range(31):
                budget = lo + (hi - lo) * k // 30
                if not exact:
                    seconds = libra.plan(planning, budget).predicted_step_seconds
                else:
                    state = exact_budget_growth(planning.selections[0], planning.target_bytes(budget))
                    if state is None:  # below what growth reaches: only the planner's searched minimum fits
                        continue
                    seconds = prof.eager_step_seconds + planning.sim.run(state).added_seconds
                if prev is not None:
                    steps += 1
                    if seconds > prev:
                        violations += 1
                        worst = max(worst, seconds / prev)
                prev = seconds
        out[name] = {"steps": steps, "violations": violations, "worst_ratio": worst}
    return out


def quality() -> list[dict]:
    """The monotone plan's added seconds over the baseline's, at 41 budgets from the floor to eager's peak."""
    rows = []
    for nb, ob, seed in [(2, 6, 0), (5, 5, 1), (8, 4, 2), (20, 5, 3), (40, 5, 4)]:
        for bandwidth in (None, 2e9):
            prof = chain_profile(nb, ob, seed=seed)
            planning = Planning(prof, host_bandwidth=bandwidth)
            sel = planning.selections[0]
            lo, hi = planning.min_budget_bytes(), planning.eager.peak_bytes
            ratios = []
            for k in range(41):
                budget = lo + (hi - lo) * k // 41
                target = planning.target_bytes(budget)
                mono = libra.plan(planning, budget).predicted_step_seconds - prof.eager_step_seconds
                state = exact_budget_growth(sel, target)
                raw = None if state is None else sel.sim.run(state).added_seconds
                if raw:
                    ratios.append(mono / raw)
            r = np.array(ratios)
            rows.append({"blocks": nb, "ops_per_block": ob, "seed": seed, "host_bandwidth": bandwidth,
                         "mean_ratio": float(r.mean()), "max_ratio": float(r.max()), "min_ratio": float(r.min()),
                         "share_over_3pct": float(np.mean(r > 1.03))})
            print(json.dumps(rows[-1]), flush=True)
    return rows


def main() -> int:
    limit = int(sys.argv[sys.argv.index("--max-storages") + 1]) if "--max-storages" in sys.argv else 200_000
    rows = []
    for n_blocks in SIZES:
        if 2 * n_blocks * OPS_PER_BLOCK + 3 > limit:
            break
        rows.append(scaling_row(n_blocks))
        print(json.dumps(rows[-1]), flush=True)
    out = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"), "torch": torch.__version__,
        "platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version(),
        "config": {"ops_per_block": OPS_PER_BLOCK, "share": SHARE, "blocks": list(SIZES)},
        "rows": rows,
    }
    if len(rows) >= 2:
        out["exponent_planner_s"] = fitted_exponent(rows, "planner_s")
        out["exponent_baseline_solve_at_s"] = fitted_exponent(rows, "baseline_solve_at_s")
        n = [r["storages"] for r in rows]
        out["exponent_n_log_n"] = float(np.polyfit(np.log(n), np.log([v * math.log(v) for v in n]), 1)[0])
        print(f"planner time ~ storages^{out['exponent_planner_s']:.2f} (n log n over this range: "
              f"^{out['exponent_n_log_n']:.2f})", flush=True)
    if "--no-gpt2" not in sys.argv:
        out["gpt2_small_like"] = gpt2_small()
        print(json.dumps(out["gpt2_small_like"]), flush=True)
    out["monotonicity"] = monotonicity()
    print(json.dumps(out["monotonicity"]), flush=True)
    out["monotone_vs_exact_budget_growth"] = quality()
    path = Path(__file__).resolve().parent / "results" / f"planner-scaling-{datetime.date.today()}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.exists():  # an earlier run today (before a change, say): keep its figures next to these
        earlier = json.loads(path.read_text())
        out["earlier_run"] = {"date": earlier.get("date"), "rows": earlier.get("rows"),
                              "note": earlier.get("note", "")}
    path.write_text(json.dumps(out, indent=1))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
