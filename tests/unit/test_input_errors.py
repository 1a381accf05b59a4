"""Every argument Libra checks fails with a LibraError that says what was expected and how to fix it, and the exact
solver's plans run like the greedy's."""

from __future__ import annotations

import copy

import pytest

import libra
from libra.cli.commands import load_factory
from libra.planner import Planning
from libra.planner.solvers import milp
from libra.testing import fixed_times, models
from pairs import train_pair


@pytest.fixture(scope="module")
def small():
    model, x, y, loss_fn = models.make_mlp(batch=256, d=32, hidden=128, depth=3)
    prof = fixed_times(libra.profile(model, lambda: loss_fn(model(x), y).backward()))
    model.zero_grad(set_to_none=True)
    return model, x, y, loss_fn, prof


@pytest.mark.parametrize("kwargs,match", [
    ({"decisions": set()}, "decisions should be a non-empty subset"),
    ({"decisions": {"keep", "fly"}}, "decisions should be a non-empty subset"),
    ({"decisions": {"offload"}}, "needs a host link.s bandwidth"),
    ({"host_bandwidth": -1.0}, "host_bandwidth should be a positive number"),
    ({"host_bandwidth": True}, "host_bandwidth should be a positive number"),
    ({"solver": "annealing"}, "unknown solver"),
])
def test_plan_arguments(small, kwargs, match):
    *_, prof = small
    with pytest.raises(libra.LibraError, match=match):
        libra.plan(prof, prof.eager_peak_bytes, **kwargs)


def test_apply_arguments(small):
    model, x, y, loss_fn, prof = small
    plan = libra.plan(prof, Planning(prof).min_budget_bytes())
    for bad in (0, -2, True, 1.5):
        with pytest.raises(libra.LibraError, match="max_plans should be a positive int"):
            with libra.apply(model, plan, max_plans=bad):
                pass
    with pytest.raises(libra.LibraError, match="expected a libra.Plan"):
        with libra.apply(model, "plan.json"):
            pass
    missing = copy.deepcopy(plan)
    missing.regions[0].module = "blocks.99"
    with pytest.raises(libra.PlanMismatchError, match="'blocks.99', which this model does not have.*Fix:"):
        with libra.apply(model, missing):
            pass
    assert all("forward" not in m.__dict__ and not m._forward_pre_hooks for m in model.modules())


def test_exact_solver_limit_and_its_plan_applied(small, monkeypatch):
    model, x, y, loss_fn, prof = small
    planning = Planning(prof)
    budget = max(prof.budget_for_share(0.5), planning.min_budget_bytes())
    monkeypatch.setattr(milp, "MILP_MAX_VARIABLES", 1)
    with pytest.raises(libra.LibraError, match="exact solver takes at most 1 options; this profile has .*solver='greedy'"):
        libra.plan(planning, budget, solver="milp")
    monkeypatch.undo()
    plan = libra.plan(planning, budget, solver="milp")
    assert plan.solver == "milp" and plan.counts[libra.Decision.RECOMPUTE] > 0
    eager = copy.deepcopy(model)
    for meter in train_pair(eager, model, plan, lambda m: loss_fn(m(x), y).backward()):
        # the eager copy is live now and was not when profiled: compare what the step adds
        assert meter.peak_bytes - meter.start_bytes <= budget - prof.static_bytes


@pytest.mark.parametrize("spec,match", [
    ("no/such/script.py:make", "no such file"),
    ("libra_no_such_module_xyz:make", "cannot import"),
    ("libra.cli.demo:no_such_factory", "has no callable 'no_such_factory'"),
])
def test_cli_factory_errors(spec, match):
    with pytest.raises(libra.LibraError, match=match + ".*Fix:"):
        load_factory(spec)
