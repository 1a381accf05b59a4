"""What Libra's region executor costs per op, against the floors it cannot go under (issue 17).

    .venv/bin/python -m bench.executor_cost [--rounds 15] [--threads 1] [--sizes 16,512]

The block of ``runtime/calibrate.py`` (layer norm, linear, GELU, scaling, residual add; 6 counted ops per layer) at
depths 4 and 12, with float32 activations of 16 KiB (Python's cost dominates) and 512 KiB, run forward and forward +
backward:

- ``eager``: the block as it is;
- ``null_mode``: under a ``TorchDispatchMode`` that only calls each op: what any dispatch-mode executor pays;
- ``plain``: ``torch.utils.checkpoint(use_reentrant=False)`` (its saved-tensor hooks; the replay recomputes all);
- ``keep_all``: Libra's region keeping every op's output (nothing recomputed): it holds what eager frees;
- ``keep_saved``: Libra's region keeping the outputs autograd saves and skipping the other ops in the replay, as a
  plan that recomputes nothing of the call does, and as the calibration measures it (``calibration_plan``);
- ``keep_none``: Libra's region keeping nothing (every op recomputed by Libra's replay mode);
- ``guarded_plain``: plain checkpoint whose replay runs under the guard's mode, as a plain call that writes module
  state does (NOTE [Guarded replay] in runtime/region.py; here it protects nothing, so what is measured is the mode).

Per op added seconds are slopes between the two depths (so a call's fixed cost drops out): forward = slope of the
forward time over eager's; replay = slope of the step time over eager's, less the forward's, less the recomputed ops'
own time (eager's forward slope) where the replay recomputes them. Rounds are interleaved; each figure is taken from
the fastest of five calls per round: the fastest round and the median round are reported. Writes
bench/results/executor-cost-<date>.json.
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import time

import torch
import torch.utils.checkpoint as torch_checkpoint
from torch.utils._python_dispatch import TorchDispatchMode

from bench.machine import steady_malloc, write_result
from libra.planner.types import RegionPlan
from libra.runtime.calibrate import _WIDTH, _Block, _op_names, _quiet, calibration_plan
from libra.runtime.region import PlainRun, RegionRun

DEPTHS = (4, 12)
SIZES_KIB = (16, 512)
VARIANTS = ("null_mode", "plain", "keep_all", "keep_saved", "keep_none", "guarded_plain")


class _NullMode(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def _functions(depth: int, rows: int) -> tuple[int, dict]:
    torch.manual_seed(0)
    block = _Block(depth)
    x = torch.randn(rows, _WIDTH, requires_grad=True)
    names = _op_names(block, x)
    plans = {"keep_all": RegionPlan("bench", 0, names, save=list(range(len(names)))),
             "keep_saved": calibration_plan(block, x),
             "keep_none": RegionPlan("bench", 0, names, save=[])}

    def region(plan):
        run = RegionRun(plan, block, note=_quiet)
        return torch_checkpoint.checkpoint(run.run, x, use_reentrant=False, context_fn=run.contexts)

    def guarded():
        run = PlainRun(block, plans["keep_none"])
        run.guarded = True  # the block writes no module state: the mode runs, and protects nothing
        return torch_checkpoint.checkpoint(run.run, x, use_reentrant=False, context_fn=run.contexts)

    def null():
        with _NullMode():
            return block(x)

    forward = {
        "eager": lambda: block(x),
        "null_mode": null,
        "plain": lambda: torch_checkpoint.checkpoint(block, x, use_reentrant=False),
        "keep_all": lambda: region(plans["keep_all"]),
        "keep_saved": lambda: region(plans["keep_saved"]),
        "keep_none": lambda: region(plans["keep_none"]),
        "guarded_plain": guarded,
    }
    fns = {}
    for name, f in forward.items():
        fns[(name, "forward")] = f
        fns[(name, "step")] = (lambda f: lambda: f().sum().backward())(f)
    return len(names), fns


def measure(rows: int, rounds: int) -> dict:
    per_depth = {d: _functions(d, rows) for d in DEPTHS}
    samples: dict[tuple, list[float]] = {}
    for f in (f for _, fns in per_depth.values() for f in fns.values()):
        f()  # one-time costs
    for _ in range(rounds):
        for depth, (_, fns) in per_depth.items():
            for key, f in fns.items():
                best = float("inf")
                for _ in range(5):
                    t0 = time.perf_counter()
                    f()
                    best = min(best, time.perf_counter() - t0)
                samples.setdefault((depth,) + key, []).append(best)
    (n_lo, _), (n_hi, _) = per_depth[DEPTHS[0]], per_depth[DEPTHS[1]]
    out = {"ops": {DEPTHS[0]: n_lo, DEPTHS[1]: n_hi}}
    for stat_name, stat in (("fastest", min), ("median", statistics.median)):
        t = {k: stat(v) for k, v in samples.items()}

        def slope(name, kind):
            return (t[(DEPTHS[1], name, kind)] - t[(DEPTHS[0], name, kind)]) / (n_hi - n_lo)

        eager_f, eager_s = slope("eager", "forward"), slope("eager", "step")
        figures = {"eager_op_forward_us": eager_f * 1e6, "eager_op_step_us": eager_s * 1e6}
        for name in VARIANTS:
            fwd = slope(name, "forward") - eager_f
            recomputes = name in ("plain", "keep_none", "guarded_plain")
            replay = slope(name, "step") - eager_s - fwd - (eager_f if recomputes else 0.0)
            figures[name] = {"forward_us": fwd * 1e6, "replay_us": replay * 1e6 if name != "null_mode" else None}
        out[stat_name] = figures
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--sizes", default=",".join(map(str, SIZES_KIB)), help="activation sizes in KiB")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    steady_malloc()  # NOTE [Page faults on CPU] in bench/machine.py
    torch.set_num_threads(args.threads)
    results = {}
    for kib in map(int, args.sizes.split(",")):
        results[f"{kib}KiB"] = r = measure(kib * 1024 // (4 * _WIDTH), args.rounds)
        for stat in ("fastest", "median"):
            f = r[stat]
            cells = []
            for n in VARIANTS:
                replay = "-" if f[n]["replay_us"] is None else format(f[n]["replay_us"], ".1f")
                cells.append(f"{n} {f[n]['forward_us']:5.1f}/{replay}")
            print(f"{kib:4d} KiB {stat:8s} eager op {f['eager_op_forward_us']:5.1f} us | per op added, forward / "
                  "replay: " + "  ".join(cells))
    out = args.out or f"bench/results/executor-cost-{datetime.date.today().isoformat()}.json"
    write_result(out, {"rounds": args.rounds, "depths": DEPTHS, "results": results})


if __name__ == "__main__":
    main()
