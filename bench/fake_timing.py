"""How good are the plans chosen from a fake profile's op times? (issue 15)

    .venv/bin/python -m bench.fake_timing [--shares 0.75,0.5]

For each test model (``libra.testing.models``: GPT, ResNet, U-Net, Mixer at the test suite's sizes), profiles one
real step (after a warm-up) and the same step fake, with op times benchmarked op by op, estimated by the roofline
(NOTE [Estimated op times] in profiler/fake.py) and taken from one real step with every module call recomputed
(NOTE [Safe timing] in profiler/timed.py). At each share of eager's activation memory the plan chosen from
each profile is judged by the real profile's simulator: its added seconds against those of the plan chosen from the
real profile itself (1.00: as good; the real profile's op times are the judge, so the real plan is optimal for the
planner only). Planner-only once profiled: nothing is timed against anything else. Writes
bench/results/fake-timing-<date>.json.
"""

from __future__ import annotations

import argparse
import datetime

import torch

import libra
from bench.machine import write_result
from libra.planner import Planning
from libra.testing import models

BUILDERS = {
    "gpt": lambda: models.make_gpt(),
    "resnet": lambda: models.make_resnet(batch=8, size=32),
    "unet": lambda: models.make_unet(batch=4, size=32),
    "mixer": lambda: models.make_mixer(),
}


def _judge(real: Planning, other: Planning, budget: int) -> tuple[float | None, int]:
    """Added seconds, by the real profile's simulator, of the plan ``other`` picks for ``budget`` (its state moved
    to the real planning's units of the same granularity, which are the same module calls with the same ops), and
    how far its peak is over the real target (> 0: it does not fit by the real profile)."""
    found = other.solve(budget)
    if found is None:
        return None, 0
    sel, state = found
    twin = next(s for s in real.selections if s.granularity == sel.granularity)
    index = {(u.module, u.call): i for i, u in enumerate(twin.units)}
    moved = {}
    for ui, entry in state.items():
        u = sel.units[ui]
        j = index[(u.module, u.call)]
        assert twin.units[j].op_names == u.op_names, (u.module, u.call)
        moved[j] = entry
    result = twin.sim.run(moved)
    return result.added_seconds, result.peak_bytes - real.target_bytes(budget)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shares", default="0.75,0.5")
    ap.add_argument("--out", default=f"bench/results/fake-timing-{datetime.date.today().isoformat()}.json")
    args = ap.parse_args(argv)
    shares = [float(s) for s in args.shares.split(",")]
    rows = []
    for name, build in BUILDERS.items():
        model, x, y, loss_fn = build()
        model.train()

        def step():
            loss_fn(model(x), y).backward()

        step()
        model.zero_grad(set_to_none=True)
        torch.manual_seed(0)
        real = libra.profile(model, step)
        model.zero_grad(set_to_none=True)
        profiles = {"benchmark": libra.profile(model, step, fake=True),
                    "estimate": libra.profile(model, step, fake=True, timing="estimate"),
                    "safe": libra.profile(model, step, fake=True, timing="safe")}
        model.zero_grad(set_to_none=True)  # the safe timing's step was real
        planning = Planning(real)
        others = {k: Planning(p) for k, p in profiles.items()}
        for share in shares:
            budget = max(real.budget_for_share(share), planning.min_budget_bytes())
            found = planning.solve(budget)
            best = found[0].sim.run(found[1]).added_seconds if found else None
            row = {"model": name, "share": share, "real_added_seconds": best,
                   "eager_step_seconds": real.eager_step_seconds}
            for k, other in others.items():
                got, over = _judge(planning, other, budget)
                row[f"{k}_added_seconds"] = got
                row[f"{k}_over_real_target_bytes"] = over
                row[f"{k}_vs_real"] = None if got is None or not best else got / best
            rows.append(row)
            cells = "  ".join(
                f"{k} -" if row[f"{k}_vs_real"] is None else f"{k} {row[f'{k}_vs_real']:.2f}"
                + (f" (over the real target by {row[f'{k}_over_real_target_bytes']} B)"
                   if row[f"{k}_over_real_target_bytes"] > 0 else "") for k in others)
            print(f"{name:>7} {share:.0%}: added time of the plan chosen from the fake profile, over the real "
                  f"profile's own choice: {cells}", flush=True)
    write_result(args.out, {"rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
