"""The prepared GPU check (bench/gpu/check.py) runs end to end on tiny models on the CPU, so the rare GPU run is
not the first to find it broken: every method runs, every Libra plan (also where a budget is below the planner's
minimum) gives eager's gradients."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_gpu_check_smoke_runs_every_method():
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu" / "check.py"), "--smoke"], cwd=ROOT,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [json.loads(line.split(" ", 1)[1]) for line in done.stdout.splitlines()
            if line.startswith(("gpt2", "resnet50"))]
    methods = {r["method"].split(" (")[0] for r in rows}
    for family in ("recompute", "offload", "offload+recompute"):
        for share in ("50%", "30%"):
            assert f"libra {family} {share}" in methods
    assert {"eager", "save_on_cpu", "checkpoint every block"} <= methods
    fake = [r for r in rows if r["method"] == "libra recompute 50% (fake profile)"]
    assert len(fake) == 2 and all(r["fake_vs_real"]["ops"][0] == r["fake_vs_real"]["ops"][1] for r in fake)
    for r in fake:  # the activations above the static bytes (the bench keeps other methods' gradients alive)
        f, real = r["fake_vs_real"]["activation_peak"]
        assert abs(f - real) <= 0.01 * real + 4096, r["fake_vs_real"]
    assert all(r["grads_equal_eager"] for r in rows), [r["method"] for r in rows if not r["grads_equal_eager"]]
    # the CPU's launch work per step (on a CPU nothing runs asynchronously: the step is all launch work)
    assert all(0 < r["median_enqueue_s"] <= r["median_s"] and r["median_cpu_s"] > 0 and r["launch_bound"]
               for r in rows), rows
