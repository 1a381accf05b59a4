"""Is Rockmate usable as a peer? Downloads ``rockmate`` and ``rkgb`` from the package registry into a temporary
folder, installs them there (never into the project's environment) and tries ``import rkgb`` / ``import rockmate``.

DESIGN.md records that PyPI's ``rkgb`` 2.0.0 source package lacks its ``core/``, ``lowlevel/`` and ``utils/`` folders;
this check confirms or refutes that on every benchmark run and says so in the results.
"""

from __future__ import annotations

import glob
import os
import subprocess
import sys
import tarfile
import tempfile
import time

__all__ = ["check_rockmate", "DESIGN_FIGURES"]

# The figures DESIGN.md records for Rockmate 2.0 on a machine of this kind, to compare against when it cannot run.
DESIGN_FIGURES = {
    "source": "DESIGN.md, 'Peers measured on this kind of machine'",
    "budget": "40% of eager peak",
    "activations_kept_vs_eager": "measured 77% (predicted 29 MiB, used 69 MiB)",
    "step_time_vs_eager": "1.26-1.54x",
    "planner_minutes": "1.3-11 (ILP solvers)",
    "correctness": "dropout gradients wrong from the second step; BatchNorm statistics not updated",
}


def _tail(text: str, n: int = 600) -> str:
    return text.strip()[-n:]


def check_rockmate(timeout_s: float = 150.0) -> dict:
    t0 = time.perf_counter()
    out: dict = {"design_figures": DESIGN_FIGURES}
    with tempfile.TemporaryDirectory(prefix="libra-bench-rockmate-") as tmp:
        dl = os.path.join(tmp, "dl")
        site = os.path.join(tmp, "site")
        try:
            proc = subprocess.run(
                [sys.executable, "-m", "pip", "download", "--no-deps", "rockmate", "rkgb", "-d", dl],
                capture_output=True, text=True, timeout=timeout_s,
            )
        except subprocess.TimeoutExpired:
            out.update(status="not downloadable", reason=f"pip download timed out after {timeout_s:.0f} s")
            return out
        if proc.returncode != 0:
            out.update(status="not downloadable", reason=_tail(proc.stderr or proc.stdout))
            return out
        files = sorted(os.path.basename(f) for f in glob.glob(os.path.join(dl, "*")))
        out["downloaded"] = files
        for sdist in glob.glob(os.path.join(dl, "rkgb-*.tar.gz")):
            with tarfile.open(sdist) as tar:
                names = tar.getnames()
            pkg = sorted({n.split("src/rkgb/", 1)[1].split("/", 1)[0] for n in names if "src/rkgb/" in n} - {""})
            out["rkgb_sdist_package_contents"] = pkg
            out["rkgb_sdist_missing_folders"] = [d for d in ("core", "lowlevel", "utils") if d not in pkg]
        archives = [os.path.join(dl, f) for f in files]
        proc = subprocess.run(
            [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation", "--target", site,
             *archives],
            capture_output=True, text=True, timeout=timeout_s,
        )
        if proc.returncode != 0:
            out.update(status="not installable", reason=_tail(proc.stderr or proc.stdout))
            return out
        env = {**os.environ, "PYTHONPATH": site}
        imports = {}
        for mod in ("rkgb", "rockmate"):
            p = subprocess.run([sys.executable, "-c", f"import {mod}"], capture_output=True, text=True, env=env,
                               timeout=timeout_s)
            imports[mod] = "ok" if p.returncode == 0 else _tail(p.stderr).splitlines()[-1]
        out["import"] = imports
    if all(v == "ok" for v in out["import"].values()):
        out["status"] = "importable"
        out["reason"] = "imports work; this benchmark does not drive Rockmate yet (it hard-codes CUDA, DESIGN.md)"
    else:
        out["status"] = "not importable"
        out["reason"] = (
            "pip installs rockmate and rkgb from the registry, but `import rkgb` fails: "
            f"{out['import']['rkgb']}. The rkgb sdist ships only {out.get('rkgb_sdist_package_contents')} and lacks "
            f"{out.get('rkgb_sdist_missing_folders')}. Compare against the DESIGN.md figures instead."
        )
    out["check_seconds"] = time.perf_counter() - t0
    return out


if __name__ == "__main__":
    import json

    print(json.dumps(check_rockmate(), indent=1))
