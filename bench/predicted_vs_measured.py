"""Does a plan's predicted step time hold? Predicted against measured step ratios, per kind of profile (issue 15).

    .venv/bin/python -m bench.predicted_vs_measured [--models gpt,resnet,unet,mixer] [--sizes test,full]

Each model runs in a process of its own, so that its first profile is the process's first step. It is profiled four
ways: ``first-step`` (a real profile of that first step, nothing warmed), ``fake-safe`` (a fake profile timed by one
real step with every module call recomputed, NOTE [Safe timing] in profiler/timed.py), ``real`` (a real profile
after a warm-up step, the way the bench profiles) and ``fake-benchmark`` (each op timed alone). At each share of the
real profile's activation memory, each profile plans for the same budget; the plan's predicted step ratio
(``predicted_step_seconds / eager_step_seconds`` of its own profile) is set against the measured one: the fastest of
``--steps`` interleaved steps under the plan over eager's fastest (medians beside them), all in one process. Sizes:
``test`` (the test suite's models, ``libra.testing.models``) and ``full`` (the bench's, ``bench/models.py``).
Writes bench/results/predicted-vs-measured-<date>.json and prints a table.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import subprocess
import sys

import torch

KINDS = ("first-step", "fake-safe", "real", "fake-benchmark")
TEST_SIZES = {"gpt": {}, "resnet": dict(batch=8, size=32), "unet": dict(batch=4, size=32), "mixer": {}}


def _build(name: str, size: str):
    torch.manual_seed(0)
    if size == "test":  # as tests/unit/test_fake.py builds them
        from libra.testing import models

        return getattr(models, f"make_{name}")(**TEST_SIZES[name])
    from bench.models import build

    work = build(name, quick=False)
    return work.model, work.inputs, work.targets, work.loss_fn


def worker(name: str, size: str, shares: list[float], steps: int) -> list[dict]:
    import libra
    from libra.planner import Planning
    from bench.harness import summarize_times, timed_rounds
    from bench.methods import eager, libra_method
    from bench.models import Workload

    model, x, y, loss_fn = _build(name, size)
    model.train()

    def step():
        loss_fn(model(x), y).backward()

    profiles = {"first-step": libra.profile(model, step)}
    model.zero_grad(set_to_none=True)
    profiles["fake-safe"] = libra.profile(model, step, fake=True, timing="safe")
    model.zero_grad(set_to_none=True)
    step()
    model.zero_grad(set_to_none=True)
    profiles["real"] = libra.profile(model, step)
    model.zero_grad(set_to_none=True)
    profiles["fake-benchmark"] = libra.profile(model, step, fake=True)
    real = profiles["real"]
    work = Workload(name, model, x, y, loss_fn, [])
    methods = [eager(model)]
    plans = {}
    for share in shares:
        for kind in KINDS:
            prof = profiles[kind]
            planning = Planning(prof)
            budget = max(real.budget_for_share(share), planning.min_budget_bytes())
            plan = libra.plan(planning, budget)
            label = f"{kind}@{share:.0%}"
            plans[label] = (kind, share, plan, prof)
            methods.append(libra_method(model, label, plan, {}))
    times = timed_rounds(work, methods, warmup=2, steps=steps, log=lambda *_: None)
    summary = summarize_times(times)
    rows = []
    for label, (kind, share, plan, prof) in plans.items():
        s = summary[label]
        predicted = plan.predicted_step_seconds / prof.eager_step_seconds
        rows.append({
            "model": name, "size": size, "kind": kind, "share": share,
            "predicted_ratio": predicted,
            "measured_min_ratio": s["min_ratio_to_eager"],
            "measured_median_ratio": s["ratio_to_eager"],
            "error": predicted / s["min_ratio_to_eager"] - 1.0,
            "profile_eager_seconds": prof.eager_step_seconds,
            "measured_eager_min_seconds": summary["eager"]["min_step_seconds"],
            "measured_eager_median_seconds": summary["eager"]["median_step_seconds"],
            "recomputed": plan.counts[libra.Decision.RECOMPUTE],
            "disturbed_steps": s["disturbed_steps"],
        })
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="gpt,resnet,unet,mixer")
    ap.add_argument("--sizes", default="test,full")
    ap.add_argument("--shares", default="0.75,0.5")
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--worker", nargs=2, metavar=("MODEL", "SIZE"), help=argparse.SUPPRESS)
    ap.add_argument("--out", default=f"bench/results/predicted-vs-measured-{datetime.date.today().isoformat()}.json")
    args = ap.parse_args(argv)
    shares = [float(s) for s in args.shares.split(",")]
    if args.worker:
        from bench.machine import steady_malloc

        steady_malloc()  # NOTE [Page faults on CPU] in bench/machine.py
        print(json.dumps(worker(*args.worker, shares, args.steps)))
        return 0
    from bench.machine import write_result

    rows = []
    for size in args.sizes.split(","):
        for name in args.models.split(","):
            out = subprocess.run([sys.executable, "-m", "bench.predicted_vs_measured", "--worker", name, size,
                                  "--shares", args.shares, "--steps", str(args.steps)],
                                 capture_output=True, text=True, check=True)
            got = json.loads(out.stdout.strip().splitlines()[-1])
            rows.extend(got)
            for r in got:
                print(f"{name:>7} {size:>4} {r['kind']:>14} {r['share']:.0%}: predicted {r['predicted_ratio']:.2f}, "
                      f"measured {r['measured_min_ratio']:.2f} ({r['measured_median_ratio']:.2f}), "
                      f"error {r['error']:+.0%}", flush=True)
    print("\n| model | profile | predicted / measured step ratio at " + " / ".join(f"{s:.0%}" for s in shares)
          + " | worst error |\n|---|---|---|---|")
    for size in args.sizes.split(","):
        for name in args.models.split(","):
            for kind in KINDS:
                sel = [r for r in rows if r["model"] == name and r["size"] == size and r["kind"] == kind]
                if not sel:
                    continue
                cells = " / ".join(f"{r['predicted_ratio']:.2f} vs {r['measured_min_ratio']:.2f}" for r in sel)
                worst = max(sel, key=lambda r: abs(r["error"]))["error"]
                print(f"| {name} ({size}) | {kind} | {cells} | {worst:+.0%} |")
    errors = {k: [abs(r["error"]) for r in rows if r["kind"] == k] for k in KINDS}
    print("\nmedian |error| per profile kind: " + ", ".join(
        f"{k} {statistics.median(v):.0%}" for k, v in errors.items() if v))
    write_result(args.out, {"rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
