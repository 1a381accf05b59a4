"""``libra.max_batch``: the largest batch whose plan fits, confirmed by profiling, in a bounded number of profiles."""

import logging
import math

import pytest
import torch

import libra
from libra.fit import _Bracket
from libra.testing import AllocatorMeter, models

BUDGET = 2 * 2**20  # above what was live before this module ran (set_budget): earlier tests may leave tensors alive
INPUTS = {}  # the latest size's inputs only: what stays alive between profiles counts as static bytes


def make(batch_size):
    torch.manual_seed(0)
    model, x, y, loss_fn = models.make_mlp(batch=batch_size, d=64, hidden=256, depth=4)
    INPUTS.clear()
    INPUTS[batch_size] = (x, y)
    return model, lambda: loss_fn(model(x), y).backward()


@pytest.fixture(scope="module", autouse=True)
def set_budget():
    """2 MiB above the tensors already live in this process: the budget counts everything live during a step, and
    in a full test run earlier modules keep models and inputs alive."""
    global BUDGET
    with AllocatorMeter() as meter:
        pass
    BUDGET = meter.start_bytes + 2 * 2**20
    yield


@pytest.fixture(scope="module")
def fit(set_budget):
    lines = []
    result = libra.max_batch(make, BUDGET, start=16, progress=lines.append)
    return result, lines


def _search(f, budget, start, limit=10):
    """Drives the search as max_batch does, over a pure bytes(batch) function."""
    bracket = _Bracket(budget)
    bracket.add(start, f(start), f(start) <= budget)
    while len(bracket.fits) < limit:
        size = bracket.next_size()
        if size is None:
            break
        bracket.add(size, f(size), f(size) <= budget)
    return bracket


@pytest.mark.parametrize("name,f", [
    ("linear", lambda b: 5_000_000 + 12_345 * b),
    ("static-dominated at small sizes", lambda b: 5_000_000 + max(400_000, 12_345 * b)),
    ("convex", lambda b: 5_000_000 + 10_000 * b + 3 * b * b),
    ("concave", lambda b: 5_000_000 + 200_000 * math.sqrt(b) + 1_000 * b),
    ("rounded up to 64 KiB blocks", lambda b: 2**16 * math.ceil((5_000_000 + 12_345 * b) / 2**16)),
])
def test_search_finds_the_exact_largest_size_in_few_profiles(name, f):
    for budget in (6_000_000, 9_876_543, 40_000_000, 300_000_000):
        for start in (1, 4, 32):
            if f(start) > budget:
                continue
            truth = start
            while f(truth + 1) <= budget:
                truth += 1
            bracket = _search(f, budget, start)
            assert bracket.closed and bracket.lo == truth, (name, budget, start, bracket.order)
            assert len(bracket.fits) <= 10


def test_max_batch_confirms_both_answers(fit):
    result, _ = fit
    sizes = {b: (eager, minimum) for b, eager, minimum in result.profiled}
    assert result.exact and len(sizes) <= 10 and result.profiled[0][0] == 16
    assert sizes[result.batch_size][1] <= BUDGET < sizes[result.batch_size + 1][1]
    e = result.eager_max_batch
    assert sizes[e][0] <= BUDGET < sizes[e + 1][0]
    assert result.batch_size > e * 1.5
    assert result.plan.budget_bytes == BUDGET and result.plan.predicted_peak_bytes <= BUDGET
    assert result.profile.eager_peak_bytes == sizes[result.batch_size][0]
    assert result.predicted_ratio == pytest.approx(
        result.plan.predicted_step_seconds / result.plan.eager_step_seconds) and result.predicted_ratio >= 1.0


def test_plan_at_the_answer_fits_when_applied(fit):
    result, _ = fit
    model, step = make(result.batch_size)
    step()
    model.zero_grad(set_to_none=True)
    with AllocatorMeter(extra=[*model.parameters(), *INPUTS[result.batch_size]]) as meter:
        with libra.apply(model, result.plan):
            step()
    assert meter.peak_bytes <= BUDGET


def test_fake_profiles_find_the_same_batch_and_its_plan_fits(fit):
    """NOTE [Fake profiles]: each size profiled on fake tensors (no eager step at any size) gives the same answer,
    and the plan made from a fake profile holds on the real model."""
    real, _ = fit
    result = libra.max_batch(make, BUDGET, start=16, fake=True)
    assert result.batch_size == real.batch_size and result.eager_max_batch == real.eager_max_batch
    assert result.profile.provenance["memory"] == "fake"
    model, step = make(result.batch_size)
    with AllocatorMeter(extra=[*model.parameters(), *INPUTS[result.batch_size]]) as meter:
        with libra.apply(model, result.plan):
            step()
    assert meter.peak_bytes <= BUDGET


def test_a_factory_building_on_meta_finds_the_same_batch(fit):
    """A model on ``meta`` profiled fake on the CPU, op times estimated (NOTE [Estimated op times]): the memory, and
    so the answer, is the real model's."""
    real, _ = fit

    def make_meta(batch_size):
        model, step = make(batch_size)
        return model.to("meta"), step  # the step's inputs stay real; the weights take no memory

    result = libra.max_batch(make_meta, BUDGET, start=16, fake="cpu", timing="estimate")
    assert result.batch_size == real.batch_size and result.eager_max_batch == real.eager_max_batch
    assert result.profile.provenance == {"memory": "fake", "op_seconds": "estimate", "host_bandwidth": "none"}


def test_progress_one_line_per_profile_and_never_prints(fit, capsys):
    result, lines = fit
    assert len(lines) == len(result.profiled)
    assert lines[0].startswith("batch 16: eager peak") and "fits" in lines[0]
    assert capsys.readouterr().out == ""


def test_start_that_does_not_fit_names_the_minimum():
    with pytest.raises(libra.BudgetInfeasibleError) as info:
        libra.max_batch(make, "1MiB", start=64)
    e = info.value
    assert str(e).startswith("libra.max_batch: expected batch 64 to fit") and "Fix:" in str(e)
    assert e.min_budget_bytes > 2**20 == e.budget_bytes
    assert libra.max_batch(make, e.min_budget_bytes, start=64, max_profiles=2).batch_size >= 64


def test_profile_limit_gives_a_confirmed_but_inexact_answer(caplog):
    with caplog.at_level(logging.WARNING, logger="libra"):
        result = libra.max_batch(make, BUDGET, start=16, max_profiles=3)
    assert not result.exact and len(result.profiled) == 3
    assert result.plan.predicted_peak_bytes <= BUDGET
    assert "max_profiles" in caplog.text


def test_out_of_device_memory_counts_as_not_fitting():
    def make_capped(batch_size):
        model, step = make(batch_size)
        if batch_size <= 100:
            return model, step

        def oom():
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")

        return model, oom

    lines = []
    result = libra.max_batch(make_capped, BUDGET, start=64, max_profiles=12, progress=lines.append)
    assert result.batch_size == 100 and result.exact  # bisected: nothing to extrapolate from
    assert any("out of device memory" in line for line in lines)
    with pytest.raises(libra.LibraError, match="batch 128 ran out of device memory"):
        libra.max_batch(make_capped, BUDGET, start=128)


def test_bad_arguments():
    with pytest.raises(libra.LibraError, match="start should be an int of at least 1"):
        libra.max_batch(make, BUDGET, start=0)
    with pytest.raises(libra.LibraError, match="max_profiles"):
        libra.max_batch(make, BUDGET, max_profiles=1)
    with pytest.raises(libra.LibraError, match="budget"):
        libra.max_batch(make, 0.5)
    with pytest.raises(libra.LibraError, match=r"make_step\(1\) should return \(model, step\)"):
        libra.max_batch(lambda b: torch.nn.Linear(2, 2), BUDGET)
    with pytest.raises(libra.LibraError, match="timing='safe' runs one real step at each batch size.*Fix"):
        libra.max_batch(make, BUDGET, fake=True, timing="safe")
