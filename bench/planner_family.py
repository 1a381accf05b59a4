"""The default solver against its option family alone and the exact option MILP (issue 18).

    .venv/bin/python -m bench.planner_family [--models gpt,resnet,unet,mixer] [--fresh | --profiles a.json ...]
                                             [--no-milp] [--out bench/results/option-family-<date>.json]

For each benchmark model (its profile saved in ``bench/results/profiles/``, the README's planner rows' input; with
``--fresh``, profiled here at full size after two warm-up steps; or each profile file given), with the op
times as measured and with steady times (each op 10 us plus 10 us per MiB it writes: the test suite's setup, where a
plan's cost does not depend on machine load), without offload and with a 2 GB/s host link: the predicted step time,
as a ratio to eager's, at 90/75/50/30% of eager's activation memory and at the named minimum, of

- ``family``: the option family and its chains alone (NOTE [Option family] in solvers/options.py),
- ``default``: what ``libra.plan`` picks (the family's plan, or the lowest-peak plan),
- ``milp``: the exact option program (NOTE [Exact up to interactions] in solvers/milp.py),

all checked by the simulator against the same target, and the seconds the default took to plan the five budgets
from a fresh analysis. Planner-only: nothing here is timed on the device after profiling.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import time
from pathlib import Path

import libra
from bench.machine import machine_info
from libra.planner import Planning
from libra.planner.solvers import milp

MODELS = ("gpt", "resnet", "unet", "mixer")
SAVED = Path(__file__).resolve().parent / "results" / "profiles"
SHARES = (0.9, 0.75, 0.5, 0.3, "min")
BANDWIDTHS = (None, 2e9)


def _steady(profile: libra.Profile) -> libra.Profile:
    prof = copy.deepcopy(profile)
    for op in prof.ops:
        op.seconds = 1e-5 * (1 + sum(prof.storages[s].nbytes for s in op.outputs) / 2**20)
    prof.eager_step_seconds = sum(op.seconds for op in prof.ops)
    return prof


def _profile_model(name: str) -> libra.Profile:
    from bench.models import profile_workload

    return profile_workload(name)[1]


def _best(planning: Planning, target: int, pick) -> float | None:
    """The least added seconds of ``pick(selection) -> state | None`` over the selections, checked to fit."""
    best = None
    for sel in planning.selections:
        state = pick(sel)
        if state is None:
            continue
        r = sel.sim.run(state)
        assert r.peak_bytes <= target, (sel.granularity, r.peak_bytes, target)
        best = r.added_seconds if best is None else min(best, r.added_seconds)
    return best


def compare(profile: libra.Profile, bandwidth: float | None, exact: bool) -> dict:
    t0 = time.perf_counter()
    planning = Planning(profile, bandwidth)
    budgets = {}
    for share in SHARES:
        budgets[share] = (planning.min_budget_bytes() if share == "min"
                          else max(planning.min_budget_bytes(), profile.budget_for_share(share)))
        libra.plan(planning, budgets[share])
    seconds = time.perf_counter() - t0
    eager = profile.eager_step_seconds
    rows = {}
    for share, budget in budgets.items():
        target = planning.target_bytes(budget)
        got = {
            "family": _best(planning, target, lambda sel: sel.family.solve(target)),
            "default": _best(planning, target, lambda sel: planning._solve_in(sel, budget, target, "greedy", 60.0)),
        }
        if exact:
            got["milp"] = _best(planning, target, lambda sel: (lambda c: None if c is None else sel.problem.state(c))(
                milp.solve(sel.problem, target, time_limit=60.0)))
        rows[str(share)] = {k: None if v is None else round(1 + v / eager, 4) for k, v in got.items()}
    return {"plan_seconds_5_budgets": round(seconds, 3), "ratios": rows}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--profiles", nargs="*", default=[])
    ap.add_argument("--fresh", action="store_true", help="profile the models here instead of the saved profiles")
    ap.add_argument("--no-milp", action="store_true")
    ap.add_argument("--out", default=f"bench/results/option-family-{datetime.date.today().isoformat()}.json")
    args = ap.parse_args(argv)
    models = [m for m in args.models.split(",") if m]
    if args.profiles:
        profiles = {Path(p).name.split(".")[0]: libra.Profile.load(p) for p in args.profiles}
    elif args.fresh:
        profiles = {m: _profile_model(m) for m in models}
    else:
        profiles = {m: libra.Profile.load(SAVED / f"{m}.json.gz") for m in models}
    out = {"machine": machine_info(), "date": datetime.datetime.now().isoformat(timespec="seconds"), "rows": []}
    for name, prof in profiles.items():
        for times, p in (("measured", prof), ("steady", _steady(prof))):
            for bw in BANDWIDTHS:
                row = {"model": name, "times": times, "host_bandwidth": bw, **compare(p, bw, not args.no_milp)}
                out["rows"].append(row)
                cells = "  ".join(f"{s}: " + "/".join("-" if v is None else f"{v:.3f}" for v in r.values())
                                  for s, r in row["ratios"].items())
                print(f"{name:>8} {times:>8} bw={bw or '-':>6}  {cells}  ({row['plan_seconds_5_budgets']:.2f} s)",
                      flush=True)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(f"columns: family/default{'/milp' if not args.no_milp else ''}; wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
