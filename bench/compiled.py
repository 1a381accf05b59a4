"""Worker: ``torch.compile`` with ``torch._functorch.config.activation_memory_budget`` on one model, one backend, one
budget, in its own process (so that a compile that takes too long can be stopped by the launcher's timeout, and so
that dynamo's caches do not change what is live in the eager-mode worker).

    python -m bench.compiled gpt --backend inductor --budget 0.5 [--quick] --out /tmp/gpt-inductor-0.5.json

Backends:
- ``aot_eager_decomp_partition``: AOTAutograd with decompositions and the min-cut partitioner that reads
  ``activation_memory_budget``, running the partitioned aten graphs eagerly. The meter sees every op, so its memory
  figure is the partitioner's real memory; its time has no kernel fusion.
- ``inductor``: the real compiler. It allocates its own buffers outside the dispatcher; the allocator meter sees them
  (before the bench used it, a live-bytes meter missed them and Inductor's memory was not compared).
"""

from __future__ import annotations

import argparse
import json
import os
import time
import traceback

import torch
import torch._functorch.config as functorch_config

from bench import harness
from bench.machine import machine_info, steady_malloc
from bench.methods import Method, eager
from bench.models import build

__all__ = ["run_compiled"]


def run_compiled(name: str, quick: bool, backend: str, budget: float, warmup: int, steps: int, log=print) -> dict:
    t_start = time.perf_counter()
    work = build(name, quick)
    model = work.model
    model.train()
    snap = harness.Snapshot(model)
    label = f"compile[{backend}]@{budget:g}"
    row: dict = {"family": "compile", "backend": backend, "activation_memory_budget": budget,
                 "meter_sees_all_allocations": True}
    out = {"model": name, "quick": quick, "label": label, "row": row, "machine": machine_info()}
    base = eager(model)
    harness.run_step(work, base)
    snap.restore()
    ref = harness.check(work, snap, base)
    row["eager_above_start_bytes_in_this_process"] = ref.above_start_bytes

    if backend == "inductor":
        from torch._inductor.runtime.cache_dir_utils import cache_dir

        # a second run finds the compiled kernels in Inductor's on-disk cache: its compile_seconds are then far lower
        row["inductor_cache_dir_had_files"] = os.path.isdir(cache_dir()) and bool(os.listdir(cache_dir()))
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=backend)

    def context():
        return functorch_config.patch(activation_memory_budget=budget)

    method = Method(label, "compile", context, compiled, {})
    try:
        snap.restore()
        torch.manual_seed(harness.STEP_SEED)
        t0 = time.perf_counter()
        harness.run_step(work, method)  # compiles forward and backward
        row["compile_seconds"] = time.perf_counter() - t0
        snap.restore()
        res = harness.check(work, snap, method)
    except Exception as e:  # a compile failure is a result, not a crash of the benchmark
        row.update(status="failed", error=f"{type(e).__name__}: {e}"[:2000],
                   traceback=traceback.format_exc(limit=8)[-3000:])
        return out
    cmp = harness.compare(ref, res)
    row.update(status="ok", peak_bytes=res.peak_bytes, start_bytes=res.start_bytes, **cmp)
    if row["meter_sees_all_allocations"]:
        row["above_start_bytes"] = res.above_start_bytes
    else:
        row["dispatcher_visible_above_start_bytes"] = res.above_start_bytes
    if not cmp["grads_equal"]:
        row["note"] = ("gradients differ from eager: compiled graphs draw dropout masks with other RNG calls and "
                       "reorder floating-point work; compare max_abs_grad_diff")
    counters = torch._dynamo.utils.counters
    row["dynamo"] = {"unique_graphs": counters["stats"]["unique_graphs"],
                     "graph_breaks": sum(counters["graph_break"].values())}
    log(f"[{name}] {label}: compiled in {row['compile_seconds']:.1f} s, timing against eager")
    summary = harness.summarize_times(harness.timed_rounds(work, [base, method], warmup, steps, log=log))
    row.update(summary[label])
    row["eager_median_step_seconds_in_this_process"] = summary["eager"]["median_step_seconds"]
    row["worker_seconds"] = time.perf_counter() - t_start
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.compiled", description=__doc__.splitlines()[0])
    p.add_argument("model")
    p.add_argument("--backend", default="inductor")
    p.add_argument("--budget", type=float, default=0.5)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=7)
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    steady_malloc()  # NOTE [Page faults on CPU] in bench/machine.py
    if a.threads:
        torch.set_num_threads(a.threads)
    out = run_compiled(a.model, a.quick, a.backend, a.budget, a.warmup, a.steps, log=lambda s: print(s, flush=True))
    with open(a.out, "w") as f:
        json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
