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


def load_factory(spec: str):
    """Resolves ``path/to/script.py:make`` or ``package.module:make`` to the callable it names."""
    target, sep, name = spec.rpartition(":")
    if not sep or not target or not name:
        raise LibraError(
            f"libra profile: expected SCRIPT_OR_MODULE:FACTORY such as 'train.py:make' or 'mypkg.models:make', got "
            f"{spec!r}."
        )
    if target.endswith(".py") or Path(target).exists():
        path = Path(target)
        if not path.exists():
            raise LibraError(f"libra profile: no such file {target!r}.")
        module_spec = importlib.util.spec_from_file_location(path.stem, path)
        module = importlib.util.module_from_spec(module_spec)
        sys.path.insert(0, str(path.parent.resolve()))
        module_spec.loader.exec_module(module)
    else:
        try:
            module = importlib.import_module(target)
        except ImportError as e:
            raise LibraError(f"libra profile: cannot import {target!r}: {e}.") from None
    factory = getattr(module, name, None)
    if not callable(factory):
        raise LibraError(f"libra profile: {target!r} has no callable {name!r}.")
    return factory


def _profile(args) -> int:
    made = load_factory(args.factory)()
    if not (isinstance(made, tuple) and len(made) == 2 and callable(made[1])):
        raise LibraError("libra profile: the factory should return (model, step), step a callable running one "
                         "forward and backward.")
    model, step = made
    for _ in range(args.warmup):
        step()
        model.zero_grad(set_to_none=True)
    print(f"profiling one step of {type(model).__name__} ...", file=sys.stderr)
    prof = libra.profile(model, step)
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
    print(libra.Plan.load(args.plan).explain())
    return 0


def add_parsers(sub) -> None:
    p = sub.add_parser("profile", help="profile one training step from a (model, step) factory")
    p.add_argument("factory", help="SCRIPT_OR_MODULE:FACTORY, a callable returning (model, step)")
    p.add_argument("-o", "--output", default="profile.json", help="where to write the profile (profile.json)")
    p.add_argument("--warmup", type=int, default=1, help="plain steps before profiling (default 1)")
    p.set_defaults(run=_profile)

    p = sub.add_parser("plan", help="plan a profile under a byte budget")
    p.add_argument("profile", help="a profile.json from `libra profile`")
    p.add_argument("--budget", required=True, help="peak live bytes allowed, e.g. 6GiB or 800MB")
    p.add_argument("--solver", choices=["greedy", "milp"], default="greedy")
    p.add_argument("-o", "--output", default="plan.json", help="where to write the plan (plan.json)")
    p.set_defaults(run=_plan)

    p = sub.add_parser("show", help="explain a plan")
    p.add_argument("plan", help="a plan.json")
    p.set_defaults(run=_show)
