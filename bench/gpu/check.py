"""The GPU check (issue 3): eager vs save_on_cpu vs per-block checkpoint vs Libra (recompute, offload, both) at 30%
and 50% of eager's activation memory, on a GPT-2-small-like model and a ResNet-50-like model. One CUDA device.

Each method's row has its step time, its peak by the caching allocator, and the CPU's side of the step: the time
until ``backward()`` returns, before the device is waited for (``median_enqueue_s``; Libra's modes run there, issue
17), what that adds over eager's, and whether the step was launch-bound (the device waited on the CPU).

Prints one line per method and writes bench/results/gpu-<date>.json. Run with bench/gpu/run.sh.
"""

from __future__ import annotations

import contextlib
import copy
import datetime
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.utils.checkpoint as tc

import libra
from libra.planner import Planning
from libra.testing import models

STEPS = 5
DEVICE = "cuda"  # "cpu" with --smoke: tiny models, no memory figures, to check the script itself


def _step(model, x, y, loss_fn, seed):
    """(step seconds, peak bytes, enqueue seconds, CPU seconds) of one step. Enqueue: until ``backward()`` returns,
    before the device is waited for: what the CPU needs to launch the step (Python, dispatch, Libra's modes); where
    it is close to the step's time, the device waited on the CPU (launch-bound). CPU: the process's CPU time."""
    torch.manual_seed(seed)
    cuda = DEVICE == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    c0 = time.process_time()
    t0 = time.perf_counter()
    loss_fn(model(x), y).backward()
    enqueue = time.perf_counter() - t0
    if cuda:
        torch.cuda.synchronize()
    step = time.perf_counter() - t0
    return step, torch.cuda.max_memory_allocated() if cuda else 0, enqueue, time.process_time() - c0


def _grads(model):
    return [p.grad.detach().clone() for p in model.parameters() if p.grad is not None]


def _equal(a, b):
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


class _Checkpointed:
    """Per-block torch.utils.checkpoint by instance-attribute forward, removed on exit."""

    def __init__(self, blocks):
        self.blocks = blocks

    def __enter__(self):
        for b in self.blocks:
            f = b.forward
            b.forward = lambda *a, _f=f, **k: tc.checkpoint(_f, *a, use_reentrant=False, **k)

    def __exit__(self, *exc):
        for b in self.blocks:
            del b.forward


def run_model(name, make, blocks_of, shares=(0.5, 0.3)):
    model, x, y, loss_fn = make()
    model, x, y = model.to(DEVICE), x.to(DEVICE), y.to(DEVICE)
    base = copy.deepcopy(model)
    rows = []

    def measure(label, m, ctx_fn, plan=None):
        times, peaks, enqueues, cpus = [], [], [], []
        grads = None
        for i in range(STEPS + 1):
            m.zero_grad(set_to_none=True)
            with ctx_fn():
                t, peak, enqueue, cpu = _step(m, x, y, loss_fn, seed=i)
            if i == 0:
                grads = _grads(m)
            else:
                times.append(t)
                peaks.append(peak)
                enqueues.append(enqueue)
                cpus.append(cpu)
        m.zero_grad(set_to_none=True)
        row = {"method": label, "median_s": statistics.median(times), "min_s": min(times),
               "median_enqueue_s": statistics.median(enqueues), "median_cpu_s": statistics.median(cpus),
               "max_memory_allocated": max(peaks), "grads": grads}
        if plan is not None:
            row.update(budget=plan.budget_bytes, predicted_peak=plan.predicted_peak_bytes,
                       counts={d.value: c for d, c in plan.counts.items()},
                       regions=len(plan.regions), plain=sum(r.plain for r in plan.regions),
                       hooked=sum(r.hooked for r in plan.regions),
                       predicted_ratio=plan.predicted_step_seconds / plan.eager_step_seconds)
        rows.append(row)
        return row

    eager = measure("eager", model, contextlib.nullcontext)
    eager2 = measure("eager (again)", copy.deepcopy(base), contextlib.nullcontext)
    deterministic = _equal(eager["grads"], eager2["grads"])
    measure("save_on_cpu", copy.deepcopy(base),
            lambda: torch.autograd.graph.save_on_cpu(pin_memory=DEVICE == "cuda"))
    ck = copy.deepcopy(base)
    measure("checkpoint every block", ck, lambda: _Checkpointed(blocks_of(ck)))
    ours = copy.deepcopy(base)
    ours.zero_grad(set_to_none=True)
    loss_fn(ours(x), y).backward()  # warm-up
    ours.zero_grad(set_to_none=True)
    torch.manual_seed(0)
    prof = libra.profile(ours, lambda: loss_fn(ours(x), y).backward())
    ours.zero_grad(set_to_none=True)
    for share in shares:
        for decisions in ({"keep", "recompute"}, {"keep", "offload"}, {"keep", "recompute", "offload"}):
            label = f"libra {'+'.join(sorted(decisions - {'keep'}))} {share:.0%}"
            t0 = time.perf_counter()
            planning = Planning(prof, None if DEVICE == "cuda" else 1e10, decisions)
            infeasible = prof.budget_for_share(share) < planning.min_budget_bytes()
            # a budget below the planner's minimum: measured at the minimum instead, and said so
            plan = libra.plan(planning, max(prof.budget_for_share(share), planning.min_budget_bytes()))
            planner_s = time.perf_counter() - t0
            m = copy.deepcopy(base)
            row = measure(label + (" (at its minimum)" if infeasible else ""), m,
                          lambda p=plan, m=m: libra.apply(m, p), plan)
            row.update(planner_s=planner_s, share_infeasible=infeasible,
                       min_share=(planning.min_budget_bytes() - prof.static_bytes) / prof.activation_peak_bytes)
    # NOTE [Fake profiles]: the same step recorded on fake tensors of this device, planned, applied for real
    del m, row
    fake = libra.profile(ours, lambda: loss_fn(ours(x), y).backward(), fake=True)
    fake_planning = Planning(fake, None if DEVICE == "cuda" else 1e10, {"keep", "recompute"})
    fake_plan = libra.plan(fake_planning, max(fake.budget_for_share(0.5), fake_planning.min_budget_bytes()))
    m = copy.deepcopy(base)
    row = measure("libra recompute 50% (fake profile)", m, lambda p=fake_plan, m=m: libra.apply(m, p), fake_plan)
    row.update(fake_vs_real={"ops": [fake.n_ops, prof.n_ops], "packs": [len(fake.packs), len(prof.packs)],
                             "eager_peak": [fake.eager_peak_bytes, prof.eager_peak_bytes],
                             "static": [fake.static_bytes, prof.static_bytes],  # other methods' rows keep grads
                             "activation_peak": [fake.activation_peak_bytes, prof.activation_peak_bytes],
                             "eager_step_seconds": [fake.eager_step_seconds, prof.eager_step_seconds]})
    out = []
    reference = eager["grads"]
    for r in rows:
        g = r.pop("grads", None)
        if g is not None:
            r["grads_equal_eager"] = _equal(g, reference)
            r["ratio_to_eager"] = r["median_s"] / eager["median_s"]
            # what the method adds to the CPU's launch work per step (issue 17: Libra's modes against GPU time)
            r["enqueue_over_eager_s"] = r["median_enqueue_s"] - eager["median_enqueue_s"]
            r["launch_bound"] = r["median_enqueue_s"] >= 0.9 * r["median_s"]
        if "budget" in r and DEVICE == "cuda":  # the promise, as the caching allocator counts it
            r["over_budget_bytes"] = r["max_memory_allocated"] - r["budget"]
        out.append(r)
        print(name, json.dumps(r), flush=True)
    return {"model": name, "eager_deterministic": deterministic, "static_bytes": prof.static_bytes,
            "eager_peak_bytes_profile": prof.eager_peak_bytes, "rows": out}


def main() -> int:
    global DEVICE
    smoke = "--smoke" in sys.argv
    if smoke:
        DEVICE = "cpu"
        gpt = lambda: models.make_gpt(batch=4, layers=4, d=64, heads=4, seq=64, vocab=128)  # noqa
        resnet = lambda: models.make_resnet(batch=8, size=16)  # noqa
    elif not torch.cuda.is_available():
        print("bench/gpu/check.py: no CUDA device; nothing to check (--smoke runs tiny models on the CPU)",
              file=sys.stderr)
        return 2
    else:
        gpt = lambda: models.make_gpt(batch=8, layers=12, d=768, heads=12, seq=1024, vocab=50304, dropout=0.1)  # noqa
        resnet = lambda: models.make_resnet(batch=32, size=128, widths=(64, 128, 256, 512), blocks=(3, 4, 6, 3))  # noqa
    results = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu (smoke)",
        "torch": torch.__version__,
        "platform": platform.platform(),
        "models": [],
    }
    if "--out" in sys.argv:
        path = Path(sys.argv[sys.argv.index("--out") + 1])
    else:
        path = Path(__file__).resolve().parents[1] / "results" / f"gpu-{datetime.date.today()}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    for name, make, blocks_of in (("gpt2-small-like", gpt, lambda m: list(m.blocks)),
                                  ("resnet50-like", resnet, lambda m: [b for stage in m.layers for b in stage])):
        results["models"].append(run_model(name, make, blocks_of))
        if not smoke:  # after each model: a run cut short still leaves what it measured
            path.write_text(json.dumps(results, indent=1))
            print(f"wrote {path}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
