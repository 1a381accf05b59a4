"""A step too big for this machine, planned without its memory (issue 15): a GPT-2-small-like model built on ``meta``.

    .venv/bin/python -m bench.meta_profile [--batch 16] [--seq 1024] [--budget 20GiB]

The model (12 layers, d=768, 12 heads, vocabulary 50,304, tied head) is built under ``torch.device("meta")``, so its
weights take no memory; ``libra.profile(..., fake="cpu", timing="estimate")`` records the step on fake tensors and
estimates op times from each op's operations and bytes (NOTE [Estimated op times] in profiler/fake.py), then
``libra.plan`` plans it under the budget. Reports the profile's eager peak (beyond this machine's memory at batch
16), the seconds to profile and to plan, and the process's peak resident memory. Writes
bench/results/meta-profile-<date>.json.
"""

from __future__ import annotations

import argparse
import datetime
import resource
import time

import torch
import torch.nn.functional as F

import libra
from bench.machine import write_result
from libra.testing.models import GPT


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--budget", default="20GiB")
    ap.add_argument("--out", default=f"bench/results/meta-profile-{datetime.date.today().isoformat()}.json")
    args = ap.parse_args(argv)
    vocab = 50304
    with torch.device("meta"):
        model = GPT(vocab=vocab, d=768, layers=12, heads=12, seq=args.seq, dropout=0.1)
    idx = torch.randint(0, vocab, (args.batch, args.seq))
    targets = torch.randint(0, vocab, (args.batch, args.seq))

    def step():
        logits = model(idx)
        F.cross_entropy(logits.reshape(-1, vocab), targets.reshape(-1)).backward()

    t0 = time.perf_counter()
    prof = libra.profile(model, step, fake="cpu", timing="estimate")
    profile_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    plan = libra.plan(prof, args.budget)
    plan_s = time.perf_counter() - t0
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kilobytes on Linux
    row = {
        "config": {"batch": args.batch, "seq": args.seq, "layers": 12, "d": 768, "vocab": vocab},
        "ops": len(prof.ops),
        "eager_peak_bytes": prof.eager_peak_bytes,
        "static_bytes": prof.static_bytes,
        "budget_bytes": plan.budget_bytes,
        "predicted_peak_bytes": plan.predicted_peak_bytes,
        "predicted_ratio": plan.predicted_step_seconds / plan.eager_step_seconds,
        "recomputed": plan.counts[libra.Decision.RECOMPUTE],
        "profile_seconds": round(profile_s, 2),
        "plan_seconds": round(plan_s, 2),
        "max_resident_bytes": rss,
    }
    print(f"eager peak {prof.eager_peak_bytes / 2**30:.2f} GiB ({len(prof.ops)} ops), profiled in {profile_s:.1f} s, "
          f"planned under {plan.budget_bytes / 2**30:.2f} GiB in {plan_s:.1f} s (predicted peak "
          f"{plan.predicted_peak_bytes / 2**30:.2f} GiB, x{row['predicted_ratio']:.3f} eager's time by the estimate), "
          f"process peak resident memory {rss / 2**30:.2f} GiB")
    write_result(args.out, row)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
