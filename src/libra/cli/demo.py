"""``libra demo``: trains a GPT-2-like model eagerly and under Libra at half of eager's activation memory."""

from __future__ import annotations

import copy
import statistics
import time

import torch

import libra
from libra.testing import LiveBytesMeter, assert_grads_equal, models
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


def _timed_step(model, opt, x, y, loss_fn, seed):
    torch.manual_seed(seed)
    with LiveBytesMeter(extra=list(model.parameters())) as meter:
        t0 = time.perf_counter()
        loss = loss_fn(model(x), y)
        loss.backward()
        seconds = time.perf_counter() - t0
    return loss.item(), seconds, meter


def run_demo(steps: int = 5, share: float = 0.5, layers: int = 6, batch: int = 8) -> int:
    torch.set_num_threads(max(torch.get_num_threads(), 1))
    eager, x, y, loss_fn = models.make_gpt(batch=batch, layers=layers, d=128, seq=128, dropout=0.1)
    ours = copy.deepcopy(eager)
    opt_e = torch.optim.SGD(eager.parameters(), lr=0.01)
    opt_o = torch.optim.SGD(ours.parameters(), lr=0.01)

    def step():
        loss_fn(ours(x), y).backward()

    print(f"GPT-2-like model: {layers} layers, d=128, seq 128, batch {batch}, dropout 0.1, "
          f"{sum(p.numel() for p in eager.parameters()) / 1e6:.2f}M parameters")
    for model, opt in ((eager, opt_e), (ours, opt_o)):  # warm-up: first-call kernel costs are not the steady state
        torch.manual_seed(99)
        loss_fn(model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    torch.manual_seed(100)
    prof = libra.profile(ours, step)
    torch.manual_seed(100)
    loss_fn(eager(x), y).backward()
    assert_grads_equal(eager, ours)
    for opt in (opt_e, opt_o):
        opt.step()
        opt.zero_grad(set_to_none=True)
    budget = prof.budget_for_share(share)
    t0 = time.perf_counter()
    plan = libra.plan(prof, budget)
    plan_seconds = time.perf_counter() - t0
    rows_e, rows_o = [], []
    identical = True
    for i in range(steps):
        # Libra's step first, while the eager copy holds no gradients: the same tensors are live as when profiled.
        with libra.apply(ours, plan):
            loss_o, sec_o, meter_o = _timed_step(ours, opt_o, x, y, loss_fn, seed=200 + i)
        loss_e, sec_e, meter_e = _timed_step(eager, opt_e, x, y, loss_fn, seed=200 + i)
        try:
            assert_grads_equal(eager, ours)
        except AssertionError as e:
            identical = False
            print(f"step {i}: {e}")
        for opt in (opt_e, opt_o):
            opt.step()
            opt.zero_grad(set_to_none=True)
        rows_e.append((sec_e, meter_e.peak_bytes, meter_e.start_bytes))
        rows_o.append((sec_o, meter_o.peak_bytes, meter_o.start_bytes))
    te = statistics.median(r[0] for r in rows_e)
    to = statistics.median(r[0] for r in rows_o)
    peak_e = max(r[1] for r in rows_e)
    peak_o = max(r[1] for r in rows_o)
    counts = plan.counts
    print(f"profiled {prof.n_ops} ops; planned in {plan_seconds * 1e3:.0f} ms: "
          f"{counts[libra.Decision.KEEP]} saved activations kept, {counts[libra.Decision.RECOMPUTE]} recomputed, "
          f"{len(plan.regions)} modules checkpointed")
    print(f"budget: static {format_bytes(prof.static_bytes)} + {share:.0%} of eager's activation memory "
          f"({format_bytes(prof.activation_peak_bytes)}) = {format_bytes(budget)}")
    print()
    print(f"{'':22}{'eager':>14}{'libra':>14}")
    print(f"{'measured peak':22}{format_bytes(peak_e):>14}{format_bytes(peak_o):>14}")
    print(f"{'  above static':22}{format_bytes(peak_e - rows_e[0][2]):>14}{format_bytes(peak_o - rows_o[0][2]):>14}")
    print(f"{'budget':22}{'':>14}{format_bytes(budget):>14}")
    print(f"{'predicted peak':22}{format_bytes(prof.eager_peak_bytes):>14}{format_bytes(plan.predicted_peak_bytes):>14}")
    print(f"{'step time (median)':22}{te * 1e3:>11.1f} ms{to * 1e3:>11.1f} ms")
    print(f"{'ratio to eager':22}{1.0:>14.2f}{to / te:>14.2f}")
    print()
    print(f"under budget: {'yes' if peak_o <= budget else 'NO'}")
    print(f"gradients identical: {'yes' if identical else 'NO'}")
    return 0 if identical and peak_o <= budget else 1
