"""``python -m bench [--quick]``: every method on every model, one process per model (and per compile variant).

Writes ``bench/results/<model>[-quick].json`` and ``<model>[-quick]_pareto.png``, ``summary[-quick].json``, and
prints a table per model and the checks where Libra wins or loses.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

from bench import report
from bench.machine import machine_info
from bench.models import WORKLOADS
from bench.rockmate import check_rockmate

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(cmd: list[str], timeout_s: float) -> tuple[int | None, float]:
    """Runs a worker in its own process group, streaming its output; on timeout kills the group. Returns
    (return code or None on timeout, seconds)."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, start_new_session=True)
    try:
        rc = proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        rc = None
    return rc, time.perf_counter() - t0


def _cpu_busy_fraction(seconds: float = 1.0) -> float | None:
    """Share of all cores busy over ``seconds``, from /proc/stat (None where it cannot be read)."""
    def sample():
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
        idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
        return sum(fields), idle

    try:
        total0, idle0 = sample()
        time.sleep(seconds)
        total1, idle1 = sample()
    except (OSError, ValueError, IndexError):
        return None
    return 1.0 - (idle1 - idle0) / max(total1 - total0, 1)


def _choose_threads(requested: int) -> tuple[int, str]:
    """``--threads 0`` (auto): every core when the machine is idle, else one thread.

    NOTE [Threads under contention]: with two OpenMP threads on two cores that another process is also using, every
    parallel op waits at a barrier for a descheduled thread; measured here, a 20 ms step then takes 0.1-1.4 s, with
    wild spread, while one thread stays at 27 ms. Ratios measured like that mean nothing, so a busy machine is
    measured single-threaded, and the results say so.
    """
    if requested:
        return requested, "--threads"
    busy = _cpu_busy_fraction()
    cores = os.cpu_count() or 1
    if busy is not None and busy > 0.10:
        return 1, f"auto: {busy:.0%} of the CPUs were busy with other work at start, so one thread"
    return cores, f"auto: machine idle at start ({'unknown' if busy is None else f'{busy:.0%} busy'}), all {cores} cores"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="small models and fewer steps (under 3 minutes on 2 cores)")
    p.add_argument("--models", default=",".join(WORKLOADS), help=f"comma-separated subset of {','.join(WORKLOADS)}")
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
    p.add_argument("--warmup", type=int, default=None, help="warm-up rounds (default 2, quick 1)")
    p.add_argument("--steps", type=int, default=None, help="timed rounds (default 7, quick 5)")
    p.add_argument("--threads", type=int, default=0,
                   help="torch.set_num_threads in the workers (default 0: all cores if the machine is idle, else 1)")
    p.add_argument("--compile-backends", default=None,
                   help="comma-separated torch.compile backends (default aot_eager_decomp_partition,inductor; quick "
                        "aot_eager_decomp_partition; '' for none)")
    p.add_argument("--compile-budgets", default="0.5", help="activation_memory_budget values (comma-separated)")
    p.add_argument("--compile-timeout", type=float, default=None, help="seconds per compile worker (default 240, quick 60)")
    p.add_argument("--model-timeout", type=float, default=600.0, help="seconds per eager-mode worker")
    p.add_argument("--skip-rockmate", action="store_true", help="do not check whether Rockmate installs")
    a = p.parse_args(argv)
    quick = a.quick
    warmup = a.warmup if a.warmup is not None else (1 if quick else 2)
    steps = a.steps if a.steps is not None else (5 if quick else 7)
    backends = a.compile_backends
    if backends is None:
        backends = "aot_eager_decomp_partition" if quick else "aot_eager_decomp_partition,inductor"
    backends = [b for b in backends.split(",") if b]
    budgets = [float(b) for b in a.compile_budgets.split(",") if b]
    compile_timeout = a.compile_timeout if a.compile_timeout is not None else (60.0 if quick else 240.0)
    names = [n for n in a.models.split(",") if n]
    for n in names:
        if n not in WORKLOADS:
            p.error(f"unknown model {n!r}; expected some of {', '.join(WORKLOADS)}")
    os.makedirs(a.out, exist_ok=True)
    suffix = "-quick" if quick else ""
    t_all = time.perf_counter()

    threads, threads_reason = _choose_threads(a.threads)
    print(f"threads: {threads} ({threads_reason})", flush=True)
    rockmate = {"status": "skipped"} if a.skip_rockmate else check_rockmate()
    print(f"rockmate: {rockmate['status']}: {rockmate.get('reason', '')}", flush=True)

    common = ["--warmup", str(warmup), "--steps", str(steps), "--threads", str(threads)] + (["--quick"] if quick else [])
    # compile rows time only eager and one compiled variant: fewer rounds keep the full run within its 20 minutes
    compile_common = ["--warmup", "1", "--steps", str(max(5, steps - 2)), "--threads", str(threads)] + \
        (["--quick"] if quick else [])
    summary = {"quick": quick, "machine": machine_info(), "threads": threads, "threads_reason": threads_reason,
               "rockmate": rockmate, "models": {}}
    results: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="libra-bench-") as tmp:
        for name in names:
            print(f"\n=== {name} ===", flush=True)
            frag = os.path.join(tmp, f"{name}.json")
            rc, seconds = _run([sys.executable, "-m", "bench.run", name, "--out", frag, *common], a.model_timeout)
            if rc != 0 or not os.path.exists(frag):
                why = "timed out" if rc is None else f"exited with {rc}"
                print(f"[{name}] eager-mode worker {why} after {seconds:.0f} s; no result", flush=True)
                summary["models"][name] = {"status": f"worker {why}"}
                continue
            with open(frag) as f:
                result = json.load(f)
            result["rockmate"] = rockmate
            result["config"]["threads_reason"] = threads_reason
            result["config"]["compile"] = {"backends": backends, "budgets": budgets, "timeout_s": compile_timeout}
            for backend in backends:
                for budget in budgets:
                    label = f"compile[{backend}]@{budget:g}"
                    cfrag = os.path.join(tmp, f"{name}-{backend}-{budget}.json")
                    rc, seconds = _run([sys.executable, "-m", "bench.compiled", name, "--backend", backend,
                                        "--budget", str(budget), "--out", cfrag, *compile_common], compile_timeout)
                    if rc == 0 and os.path.exists(cfrag):
                        with open(cfrag) as f:
                            crow = json.load(f)
                        result["methods"][label] = crow["row"]
                        result.setdefault("compile_machine", []).append(crow["machine"])
                    else:
                        why = f"timed out after {compile_timeout:.0f} s (compile on this CPU)" if rc is None else \
                            f"worker exited with {rc}"
                        result["methods"][label] = {"family": "compile", "backend": backend,
                                                    "activation_memory_budget": budget, "status": "failed",
                                                    "error": why}
                    result["methods"][label]["worker_wall_seconds"] = seconds
            result["verdicts"] = report.verdicts(result)
            results.append(result)
            path = os.path.join(a.out, f"{name}{suffix}.json")
            with open(path, "w") as f:
                json.dump(result, f, indent=1)
            png = os.path.join(a.out, f"{name}{suffix}_pareto.png")
            report.plot_pareto(result, png)
            print(f"\n{name}{' (quick)' if quick else ''}: {path}, {png}")
            print(report.table(result))
            losses = [v for v in result["verdicts"] if not v["pass"]]
            print(f"checks: {len(result['verdicts']) - len(losses)} pass, {len(losses)} fail")
            for v in result["verdicts"]:
                print(f"  [{'pass' if v['pass'] else 'FAIL'}] {v['check']}: {v['detail']}")
            summary["models"][name] = {"result": os.path.relpath(path, ROOT), "plot": os.path.relpath(png, ROOT),
                                       "verdicts": result["verdicts"]}
    seen = [m["libra"] for r in results for m in [r["machine_start"], r["machine_end"], *r.get("compile_machine", [])]]
    commits = sorted({(v["commit"], v["src_modified"]) for v in seen})
    summary["libra_versions_seen"] = [{"commit": c, "src_modified": m} for c, m in commits]
    if len(commits) > 1:
        print(f"WARNING: Libra's source changed during the run ({len(commits)} versions seen): results of different "
              "models may come from different code", flush=True)
    summary["total_seconds"] = time.perf_counter() - t_all
    with open(os.path.join(a.out, f"summary{suffix}.json"), "w") as f:
        json.dump(summary, f, indent=1)
    print(f"\ntotal {summary['total_seconds']:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
