"""How fast keep/recompute can be at all on this machine, in Libra's own model (issue 5's time targets).

    .venv/bin/python -m bench.bounds [--models gpt,resnet] [--out bench/results/bounds.json]

For each benchmark model (full size, profiled after two warm-up steps), at 50% of eager's activation memory and at
the peak of checkpointing every block (as the simulator predicts it, which the bench measures to the byte), solves
with the exact MILP three times: with the profile as measured, with Libra's runtime overhead set to zero (no cost
per op, per call or per clone), and the greedy as measured. The zero-overhead optimum is a lower bound on the step
time of any keep/recompute plan over the same regions whose replays cost what the profile's ops cost: when it is
above a target, no runtime work can reach that target on this machine and only offload (a GPU) or finer regions
could. Writes one JSON file.
"""

from __future__ import annotations

import argparse
import copy
import json
import time
from pathlib import Path

import torch

from bench.machine import machine_info
from bench.models import profile_workload
from libra.planner import Planning
from libra.planner.simulate import PLAIN

MODELS = ("gpt", "resnet", "unet", "mixer")


def _ratio(prof, seconds: float) -> float:
    return 1.0 + seconds / prof.eager_step_seconds


def _solve(planning: Planning, budget: int, solver: str) -> dict:
    t0 = time.perf_counter()
    got = planning.solve(budget, solver, 120.0)
    if got is None:
        return {"status": "infeasible"}
    sel, state = got
    result = sel.sim.run(state)
    return {"status": "ok", "predicted_ratio": _ratio(planning.profile, result.added_seconds),
            "predicted_peak_above_static_bytes": result.peak_bytes - planning.profile.static_bytes,
            "granularity": sel.granularity, "regions": len(state), "seconds": time.perf_counter() - t0}


def _checkpoint_every_block(planning: Planning, blocks: set[str]) -> tuple[int, float, bool] | None:
    """(predicted peak, predicted ratio, whether Libra may plan it) of plain checkpoint around every block, in the
    finest selection that has all of them as units. Libra never runs a block that updates BatchNorm statistics
    under plain checkpoint, which updates them a second time (NOTE [Plain regions])."""
    for sel in planning.selections:
        units = [ui for ui, u in enumerate(sel.units) if u.module in blocks]
        if len(units) == len(blocks):
            result = sel.sim.run({ui: PLAIN for ui in units})
            allowed = all(sel.units[ui].plain_ok for ui in units)
            return result.peak_bytes, _ratio(planning.profile, result.added_seconds), allowed
    return None


def overhead_free(prof):
    """A copy of ``prof`` whose runtime costs nothing: no cost per op, per call or per clone (plain checkpoint a
    hair cheaper than Libra's modes, as measured, so that plain regions still win where they fit: NOTE [Plain
    regions])."""
    free = copy.deepcopy(prof)
    free.region_costs = [2e-12, 2e-12, 2e-12, 1e-12, 1e-12, 1e-12]
    free.copy_seconds_per_byte = 1e-30  # 0.0 would mean "not measured"
    return free


def zero_overhead(planning: Planning, budget: int) -> dict:
    """The exact MILP's plan at ``budget`` for a ``Planning`` of :func:`overhead_free`'s profile: a lower bound on
    the step time of any keep/recompute plan over the same regions whose replays cost what the profiled ops cost."""
    return _solve(planning, budget, "milp")


def model_bounds(name: str) -> dict:
    work, prof = profile_workload(name)
    model = work.model
    measured, overhead_free_planning = Planning(prof), Planning(overhead_free(prof))
    blocks = {n for n, m in model.named_modules() if any(m is b for b in work.blocks)}
    ckpt = _checkpoint_every_block(measured, blocks)
    budgets = {"50%": prof.budget_for_share(0.5)}
    out = {"eager_step_seconds_profiled": prof.eager_step_seconds, "budgets": {}}
    if ckpt is not None:
        budgets["ckpt_every_block_peak"] = ckpt[0]
        out["ckpt_every_block_predicted_ratio"] = ckpt[1]
        out["ckpt_every_block_keeps_buffers_exact"] = ckpt[2]
    for label, budget in budgets.items():
        out["budgets"][label] = {
            "budget_above_static_bytes": budget - prof.static_bytes,
            "greedy": _solve(measured, budget, "greedy"),
            "milp": _solve(measured, budget, "milp"),
            "milp_without_runtime_overhead": zero_overhead(overhead_free_planning, budget),
        }
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--out", default="bench/results/bounds.json")
    args = ap.parse_args(argv)
    torch.set_num_threads(2)
    report = {"machine": machine_info(), "models": {}}
    for name in args.models.split(","):
        report["models"][name] = got = model_bounds(name)
        for label, row in got["budgets"].items():
            cells = []
            for key in ("greedy", "milp", "milp_without_runtime_overhead"):
                r = row[key]
                cells.append(f"{key} {r['predicted_ratio']:.3f}" if r["status"] == "ok" else f"{key} {r['status']}")
            print(f"{name:7s} {label:22s} " + ", ".join(cells))
        if "ckpt_every_block_predicted_ratio" in got:
            exact = "" if got["ckpt_every_block_keeps_buffers_exact"] else " (updates BatchNorm statistics twice)"
            print(f"{name:7s} checkpoint every block (predicted) {got['ckpt_every_block_predicted_ratio']:.3f}{exact}")
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
