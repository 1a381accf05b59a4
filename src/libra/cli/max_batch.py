"""``libra max-batch``: the largest batch size whose plan fits a budget, and eager's, from a batch-size factory."""

from __future__ import annotations

import sys

import libra
from libra.cli.commands import add_fake_options, load_factory
from libra.units import format_bytes, parse_bytes

__all__ = ["add_parser"]


def add_parser(sub) -> None:
    p = sub.add_parser("max-batch", help="find the largest batch size whose plan fits a budget, and eager's")
    p.add_argument("factory", help="SCRIPT_OR_MODULE:FACTORY, a callable taking a batch size, returning (model, step)")
    p.add_argument("--budget", required=True, help="peak live bytes allowed, e.g. 6GiB or 800MB")
    p.add_argument("--start", type=int, default=1, help="the smallest batch size considered, profiled first (1)")
    p.add_argument("--max-profiles", type=int, default=10, help="profile at most this many sizes (default 10)")
    p.add_argument("--warmup", type=int, default=1, help="plain steps before each profile (default 1)")
    add_fake_options(p, "profile each size")
    p.add_argument("-o", "--output", help="where to write the plan at the largest batch (default: not written)")
    p.set_defaults(run=_run)


def _run(args) -> int:
    factory = load_factory(args.factory, "libra max-batch")
    budget = parse_bytes(args.budget, what="libra max-batch: --budget")
    print(f"searching for the largest batch under {format_bytes(budget)} from batch {args.start} "
          f"(one {'fake ' if args.fake else ''}profiled step per size, at most {args.max_profiles}) ...",
          file=sys.stderr)
    fit = libra.max_batch(factory, budget, start=args.start, max_profiles=args.max_profiles, warmup=args.warmup,
                          progress=lambda line: print("  " + line, file=sys.stderr, flush=True), fake=args.fake,
                          timing=args.timing)
    if args.output:
        fit.plan.save(args.output)
        print(f"{args.output}: the plan at batch {fit.batch_size}")
    eager = fit.eager_max_batch
    print(f"largest batch under {format_bytes(budget)}: {fit.batch_size} with Libra "
          f"(predicted step x{fit.predicted_ratio:.2f} of eager at that batch), "
          + (f"{eager} eagerly ({fit.batch_size / eager:.2f}x the batch)" if eager else
             f"eager fits not even batch {args.start}")
          + ("" if fit.exact else "; the profile limit ran out, the true answers may be larger"))
    return 0
