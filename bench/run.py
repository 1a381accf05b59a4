"""Worker: every eager-mode method on one model, in one process. Writes a JSON fragment that ``bench.__main__``
merges with the compile worker's and turns into the result file, the table and the plot.

    python -m bench.run gpt [--quick] --out /tmp/gpt.json
"""

from __future__ import annotations

import argparse
import json
import time
import traceback

import torch

import libra
from libra.planner import Planning

from bench import harness, methods
from bench.bounds import overhead_free, zero_overhead
from bench.machine import machine_info, steady_malloc
from bench.models import build

__all__ = ["run_model", "SHARES"]

SHARES = (1.0, 0.75, 0.5, 0.35)
# Libra is also planned at the budget each of these peers was measured to need, for a same-memory comparison.
MATCHED_PEERS = ("ckpt_every_block", "ckpt_every_2nd_block", "sac_save_matmuls")


def _error(e: BaseException) -> dict:
    return {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc(limit=6)[-3000:]}


def _plan_info(plan: libra.Plan, budget: int, seconds: float, prof: libra.Profile) -> dict:
    counts = plan.counts
    return {
        "budget_bytes": budget,
        "budget_above_static_bytes": budget - prof.static_bytes,
        "predicted_peak_bytes": plan.predicted_peak_bytes,
        "predicted_step_ratio": plan.predicted_step_seconds / plan.eager_step_seconds,
        "planner_seconds": seconds,
        "plan_planner_seconds": plan.planner_seconds,
        "kept": counts[libra.Decision.KEEP],
        "recomputed": counts[libra.Decision.RECOMPUTE],
        "regions": len(plan.regions),
    }


def run_model(name: str, quick: bool, warmup: int, steps: int, log=print) -> dict:
    t_start = time.perf_counter()
    work = build(name, quick)
    model = work.model
    model.train()
    snap = harness.Snapshot(model)
    result: dict = {
        "model": name,
        "quick": quick,
        "config": {
            "model": work.config,
            "parameters": sum(p.numel() for p in model.parameters()),
            "blocks_for_checkpoint": len(work.blocks),
            "inputs_shape": list(work.inputs.shape),
            "targets_shape": list(work.targets.shape),
            "step_seed": harness.STEP_SEED,
            "warmup_rounds": warmup,
            "timed_rounds": steps,
            "libra_shares": list(SHARES),
            "libra_matched_peers": list(MATCHED_PEERS),
            "torch_threads": torch.get_num_threads(),
        },
        "machine_start": machine_info(),
        "methods": {},
    }
    rows = result["methods"]

    eager = methods.eager(model)
    peers = [
        methods.checkpoint_blocks(model, work.blocks, every=1),
        methods.checkpoint_blocks(model, work.blocks, every=2),
        methods.selective_checkpoint(model, work.blocks),
        methods.save_on_cpu(model),
    ]
    # warm-up outside any measurement: lazy one-time allocations (oneDNN primitives, thread pools)
    harness.run_step(work, eager)
    snap.restore()

    log(f"[{name}] memory and gradient check: eager and peers")
    ref = harness.check(work, snap, eager)
    rows["eager"] = {"family": "eager", "status": "ok", "peak_bytes": ref.peak_bytes, "start_bytes": ref.start_bytes,
                     "above_start_bytes": ref.above_start_bytes, **harness.compare(ref, ref)}
    timed = [eager]
    for m in peers:
        try:
            res = harness.check(work, snap, m)
        except Exception as e:  # a peer failing is a result, not a crash of the benchmark
            rows[m.name] = {"family": m.family, "status": "failed", **m.info, **_error(e)}
            snap.restore()
            continue
        rows[m.name] = {"family": m.family, "status": "ok", **m.info, "peak_bytes": res.peak_bytes,
                        "start_bytes": res.start_bytes, "above_start_bytes": res.above_start_bytes,
                        **harness.compare(ref, res)}
        timed.append(m)

    log(f"[{name}] libra: profile")
    snap.restore()
    torch.manual_seed(harness.STEP_SEED)
    t0 = time.perf_counter()
    prof = libra.profile(model, lambda: work.loss_fn(model(work.inputs), work.targets).backward())
    profile_seconds = time.perf_counter() - t0
    prof_grads = {n: p.grad.detach().numpy().copy() for n, p in model.named_parameters() if p.grad is not None}
    snap.restore()
    prof_cmp = harness.compare(ref, harness.CheckResult(0, 0, 0.0, ref.loss, prof_grads, ref.buffers))
    t0 = time.perf_counter()
    min_budget = Planning(prof).min_budget_bytes()
    min_seconds = time.perf_counter() - t0
    result["libra_profile"] = {
        "static_bytes": prof.static_bytes,
        "eager_peak_bytes": prof.eager_peak_bytes,
        "activation_peak_bytes": prof.activation_peak_bytes,
        "eager_step_seconds_profiled": prof.eager_step_seconds,
        "n_ops": prof.n_ops,
        "n_saved": len(prof.packs),
        "profile_seconds": profile_seconds,
        "profiled_grads_equal_eager": prof_cmp["grads_equal"],
        "min_budget_bytes": min_budget,
        "min_budget_above_static_bytes": min_budget - prof.static_bytes,
        "min_budget_seconds": min_seconds,
        "meter_start_equals_profile_static": ref.start_bytes == prof.static_bytes,
        "meter_eager_above_start_bytes": ref.above_start_bytes,
    }

    budgets: list[tuple[str, int, dict]] = []
    for share in SHARES:
        budgets.append((f"libra@{share:.0%}", prof.budget_for_share(share), {"share": share}))
    budgets.append(("libra@min", min_budget, {"share": "min"}))
    for peer in MATCHED_PEERS:
        row = rows.get(peer, {})
        if row.get("status") == "ok":
            budgets.append((f"libra@={peer}", prof.static_bytes + row["above_start_bytes"], {"matched": peer}))

    log(f"[{name}] libra: plan {len(budgets)} budgets, check memory and gradients")
    free = Planning(overhead_free(prof))
    for label, budget, extra in budgets:
        base = {"family": "libra", **extra, "budget_bytes": budget, "budget_above_static_bytes": budget - prof.static_bytes}
        t0 = time.perf_counter()
        try:
            plan = libra.plan(prof, budget)
        except libra.BudgetInfeasibleError as e:
            rows[label] = {**base, "status": "infeasible", "min_budget_bytes": e.min_budget_bytes,
                           "min_budget_above_static_bytes": e.min_budget_bytes - prof.static_bytes,
                           "planner_seconds": time.perf_counter() - t0}
            continue
        except Exception as e:
            rows[label] = {**base, "status": "failed", "stage": "plan", **_error(e)}
            continue
        info = {**base, **_plan_info(plan, budget, time.perf_counter() - t0, prof)}
        bound = zero_overhead(free, budget)  # what the same regions cost with a runtime that costs nothing
        if bound["status"] == "ok":
            info["zero_overhead_ratio"] = bound["predicted_ratio"]
        m = methods.libra_method(model, label, plan, info)
        try:
            res = harness.check(work, snap, m)
        except Exception as e:
            rows[label] = {**info, "status": "failed", "stage": "apply", **_error(e)}
            snap.restore()
            continue
        rows[label] = {**info, "status": "ok", "peak_bytes": res.peak_bytes, "start_bytes": res.start_bytes,
                       "above_start_bytes": res.above_start_bytes, "under_budget": res.peak_bytes <= budget,
                       "over_budget_bytes": max(res.peak_bytes - budget, 0),
                       "measured_minus_predicted_bytes": res.peak_bytes - plan.predicted_peak_bytes,
                       **harness.compare(ref, res)}
        timed.append(m)

    log(f"[{name}] timing {len(timed)} methods, {warmup} warm-up + {steps} timed rounds")
    summary = harness.summarize_times(harness.timed_rounds(work, timed, warmup, steps, log=log))
    for label, stats in summary.items():
        rows[label].update(stats)
    result["machine_end"] = machine_info()
    result["worker_seconds"] = time.perf_counter() - t_start
    return result


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.run", description=__doc__.splitlines()[0])
    p.add_argument("model")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=7)
    p.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (0: torch's default)")
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    steady_malloc()  # NOTE [Page faults on CPU] in bench/machine.py
    if a.threads:
        torch.set_num_threads(a.threads)
    result = run_model(a.model, a.quick, a.warmup, a.steps, log=lambda s: print(s, flush=True))
    with open(a.out, "w") as f:
        json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
