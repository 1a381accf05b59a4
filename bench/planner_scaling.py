"""Planner time against profile size on synthetic chain profiles (issue 4, part 3).

    .venv/bin/python bench/planner_scaling.py [--max-storages N]

Writes bench/results/planner-scaling-<date>.json.
"""

from __future__ import annotations

import datetime
import json
import platform
import sys
import time
from pathlib import Path

import torch

import libra
from libra.planner import Planning
from libra.testing.synthetic import chain_profile


def main() -> int:
    limit = int(sys.argv[sys.argv.index("--max-storages") + 1]) if "--max-storages" in sys.argv else 4000
    rows = []
    for n_blocks in (25, 50, 100, 200, 400, 800):
        prof = chain_profile(n_blocks, 5, seed=0)
        n = len(prof.storages)
        if n > limit:
            break
        t0 = time.perf_counter()
        planning = Planning(prof)
        budget = prof.budget_for_share(0.5)
        plan = libra.plan(planning, max(budget, planning.min_budget_bytes()))
        seconds = time.perf_counter() - t0
        rows.append({"storages": n, "ops": prof.n_ops, "units": len(planning.units), "planner_s": seconds,
                     "recomputed": plan.counts[libra.Decision.RECOMPUTE]})
        print(json.dumps(rows[-1]), flush=True)
    out = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "torch": torch.__version__,
           "platform": platform.platform(), "rows": rows}
    path = Path(__file__).resolve().parent / "results" / f"planner-scaling-{datetime.date.today()}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
