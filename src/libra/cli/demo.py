"""``libra demo``: trains a GPT-2-like model eagerly and under Libra at half of eager's activation memory."""

from __future__ import annotations

import contextlib
import copy
import statistics
import time

import torch

import libra
from libra.testing import AllocatorMeter, assert_grads_equal, models
from libra.units import format_bytes

__all__ = ["add_parser", "run_demo", "make"]


def make(batch_size: int = 8, layers: int = 6):
    """The demo's GPT-2-like model and one training step at ``batch_size``: a factory for ``libra profile`` and
    ``libra max-batch``.

    Args:
        batch_size: sequences of 128 tokens per step.
        layers: transformer blocks (d=128, 4 heads, dropout 0.1).

    Returns:
        ``(model, step)``, step running one forward and backward; the weights and inputs are seeded.

    Example:
        >>> fit = libra.max_batch(make, "256MiB", start=8)   # or: libra max-batch libra.cli.demo:make --budget 256MiB
    """
    torch.manual_seed(0)
    model, x, y, loss_fn = models.make_gpt(batch=batch_size, layers=layers, d=128, seq=128, dropout=0.1)
    return model, lambda: loss_fn(model(x), y).backward()


def add_parser(sub) -> None:
    p = sub.add_parser("demo", help="train a built-in GPT-2-like model eagerly and under Libra, and compare")
    p.add_argument("--steps", type=int, default=5, help="training steps timed after profiling (default 5)")
    p.add_argument("--share", type=float, default=0.5,
                   help="share of eager's activation memory the budget allows (default 0.5)")
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--batch", type=int, default=8)
    p.set_defaults(run=lambda a: run_demo(steps=a.steps, share=a.share, layers=a.layers, batch=a.batch))


def _step(model, x, y, loss_fn, seed) -> float:
    """One forward and backward: its seconds."""
    torch.manual_seed(seed)
    t0 = time.perf_counter()
    loss_fn(model(x), y).backward()
    return time.perf_counter() - t0


def run_demo(steps: int = 5, share: float = 0.5, layers: int = 6, batch: int = 8) -> int:
    torch.set_num_threads(max(torch.get_num_threads(), 1))
    eager, x, y, loss_fn = models.make_gpt(batch=batch, layers=layers, d=128, seq=128, dropout=0.1)
    ours = copy.deepcopy(eager)
    opt_e = torch.optim.SGD(eager.parameters(), lr=0.01)
    opt_o = torch.optim.SGD(ours.parameters(), lr=0.01)

    def step():
        loss_fn(ours(x), y).backward()

    def update() -> None:
        for opt in (opt_e, opt_o):
            opt.step()
            opt.zero_grad(set_to_none=True)

    print(f"GPT-2-like model: {layers} layers, d=128, seq 128, batch {batch}, dropout 0.1, "
          f"{sum(p.numel() for p in eager.parameters()) / 1e6:.2f}M parameters")
    for model in (eager, ours):  # warm-up: first-call kernel costs are not the steady state
        torch.manual_seed(99)
        loss_fn(model(x), y).backward()
    update()
    torch.manual_seed(100)
    prof = libra.profile(ours, step)
    torch.manual_seed(100)
    loss_fn(eager(x), y).backward()
    assert_grads_equal(eager, ours)
    update()
    budget = prof.budget_for_share(share)
    t0 = time.perf_counter()
    plan = libra.plan(prof, budget)
    plan_seconds = time.perf_counter() - t0
    identical = True
    seconds_e, seconds_o = [], []
    peaks = {}
    # The steps alternate which model goes first; the last pair runs under the allocator meter (every byte the
    # allocator holds, kernels' temporaries included), apart from the timed ones (its profiler slows each op).
    for i in range(steps + 1):
        metered = i == steps
        for name in (("libra", "eager") if i % 2 == 0 else ("eager", "libra")):
            model = ours if name == "libra" else eager
            with contextlib.ExitStack() as stack:
                meter = stack.enter_context(AllocatorMeter()) if metered else None
                if name == "libra":
                    stack.enter_context(libra.apply(ours, plan))
                sec = _step(model, x, y, loss_fn, seed=200 + i)
            if metered:
                peaks[name] = (meter.peak_bytes, meter.start_bytes)
            else:
                (seconds_o if name == "libra" else seconds_e).append(sec)
        try:
            assert_grads_equal(eager, ours)
        except AssertionError as e:
            identical = False
            print(f"step {i}: {e}")
        update()
    (peak_e, start_e), (peak_o, start_o) = peaks["eager"], peaks["libra"]
    counts = plan.counts
    print(f"profiled {prof.n_ops} ops; planned in {plan_seconds * 1e3:.0f} ms: "
          f"{counts[libra.Decision.KEEP]} saved activations kept, {counts[libra.Decision.RECOMPUTE]} recomputed, "
          f"{len(plan.regions)} modules checkpointed")
    print(f"budget: static {format_bytes(prof.static_bytes)} + {share:.0%} of eager's activation memory "
          f"({format_bytes(prof.activation_peak_bytes)}) = {format_bytes(budget)}")
    print()
    print(f"{'':24}{'eager':>14}{'libra':>14}")
    print(f"{'measured peak':24}{format_bytes(peak_e):>14}{format_bytes(peak_o):>14}")
    print(f"{'  above static':24}{format_bytes(peak_e - start_e):>14}{format_bytes(peak_o - start_o):>14}")
    print(f"{'budget':24}{'':>14}{format_bytes(budget):>14}")
    print(f"{'predicted peak':24}{format_bytes(prof.eager_peak_bytes):>14}"
          f"{format_bytes(plan.predicted_peak_bytes):>14}")
    fe, fo = min(seconds_e), min(seconds_o)
    me, mo = statistics.median(seconds_e), statistics.median(seconds_o)
    print(f"{'step time (fastest)':24}{fe * 1e3:>11.1f} ms{fo * 1e3:>11.1f} ms")
    print(f"{'step time (median)':24}{me * 1e3:>11.1f} ms{mo * 1e3:>11.1f} ms")
    print(f"{'ratio to eager':24}{1.0:>14.2f}{fo / fe:>14.2f}  "
          f"(medians {mo / me:.2f}; {steps} steps each, interleaved)")
    print()
    print(f"under budget: {'yes' if peak_o <= budget else 'NO'} (the allocator's peak)")
    print(f"gradients identical: {'yes' if identical else 'NO'}")
    return 0 if identical and peak_o <= budget else 1
