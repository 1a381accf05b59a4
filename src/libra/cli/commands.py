"""``libra profile``, ``libra plan`` and ``libra show``: the profile -> plan -> inspect flow from a shell."""

from __future__ import annotations

import importlib
import importlib.util
import sys
import time
from pathlib import Path

import libra
from libra.errors import LibraError
from libra.units import format_bytes

__all__ = ["add_parsers", "load_factory"]


def add_fake_options(p, what: str) -> None:
    """``--fake [DEVICE]`` and ``--timing``, as ``libra.profile`` takes them."""
    p.add_argument("--fake", nargs="?", const=True, default=False, metavar="DEVICE",
                   help=f"{what} on fake tensors: no eager memory needed (a DEVICE such as cpu or cuda:0 for a model "
                        "built on meta)")
    p.add_argument("--timing", choices=("benchmark", "estimate", "safe"), default="benchmark",
                   help="with --fake: time each op alone (default), estimate from its operations and bytes, or time "
                        "one real step with every module call recomputed (safe: it trains one step)")


def load_factory(spec: str, command: str = "libra profile"):
    """Resolves ``path/to/script.py:make`` or ``package.module:make`` to the callable it names.

    Args:
        spec: ``SCRIPT_OR_MODULE:FACTORY``.
        command: the subcommand named in error messages.

    Raises:
        LibraError: the spec is malformed, the file or module is missing, or it has no such callable.
    """
    target, sep, name = spec.rpartition(":")
    if not sep or not target or not name:
        raise LibraError(
            f"{command}: expected SCRIPT_OR_MODULE:FACTORY such as 'train.py:make' or 'mypkg.models:make', got "
            f"{spec!r}."
        )
    if target.endswith(".py") or Path(target).exists():
        path = Path(target)
        if not path.exists():
            raise LibraError(f"{command}: no such file {target!r}. Fix: pass the path of a Python script.")
        module_spec = importlib.util.spec_from_file_location(path.stem, path)
        module = importlib.util.module_from_spec(module_spec)
        sys.path.insert(0, str(path.parent.resolve()))
        module_spec.loader.exec_module(module)
    else:
        try:
            module = importlib.import_module(target)
        except ImportError as e:
            raise LibraError(f"{command}: cannot import {target!r}: {e}. Fix: check the module name and sys.path.") \
                from None
    factory = getattr(module, name, None)
    if not callable(factory):
        raise LibraError(f"{command}: {target!r} has no callable {name!r}. Fix: name a function defined there.")
    return factory


def _profile(args) -> int:
    made = load_factory(args.factory)()
    if not (isinstance(made, tuple) and len(made) == 2 and callable(made[1])):
        raise LibraError("libra profile: the factory should return (model, step), step a callable running one "
                         "forward and backward.")
    model, step = made
    for _ in range(0 if args.fake else args.warmup):
        step()
        model.zero_grad(set_to_none=True)
    print(f"profiling one {'fake ' if args.fake else ''}step of {type(model).__name__} ...", file=sys.stderr)
    prof = libra.profile(model, step, fake=args.fake, timing=args.timing)
    prof.save(args.output)
    print(f"{args.output}: {prof.n_ops} ops, eager peak {format_bytes(prof.eager_peak_bytes)} "
          f"(static {format_bytes(prof.static_bytes)}), {prof.eager_step_seconds * 1e3:.1f} ms")
    return 0


def _plan(args) -> int:
    prof = libra.Profile.load(args.profile)
    t0 = time.perf_counter()
    plan = libra.plan(prof, args.budget, solver=args.solver)
    plan.save(args.output)
    print(f"{args.output}: planned in {(time.perf_counter() - t0) * 1e3:.0f} ms")
    print(plan.explain())
    return 0


def _show(args) -> int:
    plan = libra.Plan.load(args.plan)
    if args.plot and not args.profile:
        raise LibraError(
            "libra show: --plot draws the memory timeline, which a plan alone does not hold; no --profile was given. "
            f"Fix: libra show {args.plan} --profile profile.json --plot {args.plot} (the profile it was planned from)."
        )
    print(plan.explain())
    if args.plot:
        from libra.planner.timeline import memory_timeline
        from libra.plot import plot_memory_timeline

        timeline = memory_timeline(libra.Profile.load(args.profile), plan)
        title = (f"{plan.device}: eager peak {format_bytes(plan.eager_peak_bytes)}, plan peak "
                 f"{format_bytes(plan.predicted_peak_bytes)} (predicted step x"
                 f"{plan.predicted_step_seconds / max(plan.eager_step_seconds, 1e-12):.2f})")
        out = plot_memory_timeline(timeline, args.plot, title=title)
        print(f"{out}: memory timeline of {timeline.n_ops} ops, eager and under the plan")
    return 0


def add_parsers(sub) -> None:
    p = sub.add_parser("profile", help="profile one training step from a (model, step) factory")
    p.add_argument("factory", help="SCRIPT_OR_MODULE:FACTORY, a callable returning (model, step)")
    p.add_argument("-o", "--output", default="profile.json", help="where to write the profile (profile.json)")
    p.add_argument("--warmup", type=int, default=1, help="plain steps before profiling (default 1; none with --fake)")
    add_fake_options(p, "record the step")
    p.set_defaults(run=_profile)

    p = sub.add_parser("plan", help="plan a profile under a byte budget")
    p.add_argument("profile", help="a profile.json from `libra profile`")
    p.add_argument("--budget", required=True, help="peak live bytes allowed, e.g. 6GiB or 800MB")
    p.add_argument("--solver", choices=["greedy", "milp"], default="greedy")
    p.add_argument("-o", "--output", default="plan.json", help="where to write the plan (plan.json)")
    p.set_defaults(run=_plan)

    p = sub.add_parser("show", help="explain a plan, and draw its memory timeline")
    p.add_argument("plan", help="a plan.json")
    p.add_argument("--profile", help="the profile.json the plan was planned from (needed by --plot)")
    p.add_argument("--plot", metavar="PNG",
                   help="draw live bytes over the step, eager vs the plan, to this file (needs matplotlib)")
    p.set_defaults(run=_show)
