"""Libra against Hugging Face's own ``gradient_checkpointing_enable()`` at its measured peak (issue 17).

    .venv/bin/python -m bench.hf_checkpointing [--models hf.llama,hf.gpt2] [--steps 15]

For each Hugging Face model of ``bench/real_models.py`` named (built from a config with random weights, one process
for all), in one process: the eager step, the same step with ``gradient_checkpointing_enable()`` (non-reentrant, as
transformers recommends; every decoder or encoder layer recomputed) and Libra planned at the peak the allocator
measured for the latter (``libra.testing.AllocatorMeter``: static bytes plus that peak above them). Each step's
gradients are compared bit for bit with eager's; the times are the fastest of ``--steps`` interleaved steps over
eager's fastest, medians beside them. Writes bench/results/hf-checkpointing-<date>.json and prints a table.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import warnings

import torch

import libra
from bench import harness
from bench.machine import steady_malloc, write_result
from bench.methods import Method, eager, libra_method
from bench.models import Workload
from bench.real_models import hf_cases

DEFAULT_MODELS = "hf.llama,hf.gpt2,hf.qwen2,hf.mistral,hf.bert_mlm"


def _hf_checkpointing(model: torch.nn.Module) -> Method:
    @contextlib.contextmanager
    def enabled():
        with warnings.catch_warnings():  # transformers 5 renames it activation_checkpointing_enable (same thing)
            warnings.simplefilter("ignore", FutureWarning)
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        try:
            yield
        finally:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)
                model.gradient_checkpointing_disable()

    return Method("hf_gradient_checkpointing", "peer", enabled, model)


def _row(check: harness.CheckResult, reference: harness.CheckResult) -> dict:
    return {"peak_bytes": check.peak_bytes, "start_bytes": check.start_bytes,
            "above_start_bytes": check.above_start_bytes, **harness.compare(reference, check)}


def run(name: str, build, make_inputs, steps: int, warmup: int, log=print) -> dict:
    torch.manual_seed(0)
    model = build()
    model.train()
    inputs = make_inputs()
    work = Workload(name, model, inputs, None, lambda out, _targets: out.loss, [])
    plain, hf = eager(model), _hf_checkpointing(model)

    def forward(inp):
        return model(**inp)

    plain.forward = hf.forward = forward
    snap = harness.Snapshot(model)
    harness.run_step(work, plain)  # lazy one-time allocations, outside every measurement
    snap.restore()
    reference = harness.check(work, snap, plain)
    hf_check = harness.check(work, snap, hf)
    snap.restore()
    model.zero_grad(set_to_none=True)
    torch.manual_seed(harness.STEP_SEED)
    prof = libra.profile(model, lambda: model(**inputs).loss.backward())
    snap.restore()
    model.zero_grad(set_to_none=True)
    budget = prof.static_bytes + hf_check.above_start_bytes
    result = {"model": name, "eager": _row(reference, reference),
              "hf_gradient_checkpointing": _row(hf_check, reference),
              "static_bytes": prof.static_bytes, "budget_bytes": budget}
    try:
        plan = libra.plan(prof, budget)
    except libra.BudgetInfeasibleError as e:
        result["libra"] = {"status": "infeasible", "min_budget_bytes": e.min_budget_bytes}
        return result
    ours = libra_method(model, "libra", plan, {})
    ours.forward = forward
    libra_check = harness.check(work, snap, ours)
    result["libra"] = {"status": "ok", **_row(libra_check, reference),
                       "predicted_peak_bytes": plan.predicted_peak_bytes,
                       "predicted_step_ratio": plan.predicted_step_seconds / plan.eager_step_seconds,
                       "under_budget": libra_check.peak_bytes <= budget,
                       "regions": len(plan.regions), "plain_regions": sum(r.plain for r in plan.regions)}
    snap.restore()
    log(f"[{name}] timing eager, HF checkpointing and Libra: {warmup} warm-up + {steps} rounds")
    times = harness.summarize_times(harness.timed_rounds(work, [plain, hf, ours], warmup, steps, log=lambda *_: None))
    for m in (plain, hf, ours):  # the rows are named as the methods
        result[m.name].update(times[m.name])
    return result


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=DEFAULT_MODELS)
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--out", default=f"bench/results/hf-checkpointing-{datetime.date.today().isoformat()}.json")
    args = ap.parse_args(argv)
    steady_malloc()  # NOTE [Page faults on CPU] in bench/machine.py
    torch.set_num_threads(2)
    cases = hf_cases()
    rows = []
    print("| model | HF checkpointing: peak above static MiB, time vs eager | Libra at that peak: MiB, time vs eager "
          "(predicted) | Libra over HF checkpointing: fastest (medians) | grads equal |\n|---|---|---|---|---|")
    for name in args.models.split(","):
        build, make_inputs, _loss, _desc = cases[name][:4]
        r = run(name, build, make_inputs, args.steps, args.warmup, log=lambda *_: None)
        rows.append(r)
        hf, lib = r["hf_gradient_checkpointing"], r["libra"]
        mib = 2 ** 20
        if lib["status"] != "ok":
            print(f"| {name} | {hf['above_start_bytes'] / mib:.1f}, {hf['min_ratio_to_eager']:.2f} | infeasible "
                  f"(minimum {(lib['min_budget_bytes'] - r['static_bytes']) / mib:.1f} MiB) | | |")
            continue
        equal = hf["grads_equal"] and lib["grads_equal"] and lib["buffers_equal"]
        print(f"| {name} | {hf['above_start_bytes'] / mib:.1f}, {hf['min_ratio_to_eager']:.2f} "
              f"({hf['ratio_to_eager']:.2f}) | {lib['above_start_bytes'] / mib:.1f}, {lib['min_ratio_to_eager']:.2f} "
              f"({lib['ratio_to_eager']:.2f}; {lib['predicted_step_ratio']:.2f}) | "
              f"{lib['min_step_seconds'] / hf['min_step_seconds']:.2f} "
              f"({lib['median_step_seconds'] / hf['median_step_seconds']:.2f}) | {'yes' if equal else 'NO'} |",
              flush=True)
    write_result(args.out, {"rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
