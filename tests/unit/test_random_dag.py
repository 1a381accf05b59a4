"""Random small DAG models (hypothesis): under any budget, gradients and buffers equal eager's and the measured peak
fits the budget, or the planner names a minimum that it then meets, measured.

A stack of one to four blocks, each a spec (node kinds and input indices, some nodes nested DAGs of their own), is drawn first, the module is built from it
(``dag_models``, no generated code). The menu: linear over length or over channels (through transposed views),
conv1d, LayerNorm, BatchNorm, GroupNorm, GELU/tanh/sigmoid, in-place ReLU and scaling of a node's own input,
in-place ReLU and dropout inside a node, dropout, residual adds, ``h += b``, ``h.mul_(...)``, ``a += b`` on an input,
``torch.cat`` of two branches. Budgets are a random share of eager's activation memory; plans may offload (with a
host bandwidth) as well as recompute.

Op times in the profile are replaced by ones drawn from a seed, so that a drawn example gives the same plan on every
machine and run (measured times would make the plan, and with it the outcome, differ between runs).
"""

from __future__ import annotations

import copy
import random

import pytest
import torch
from hypothesis import HealthCheck, Phase, assume, currently_in_test_context, event, given, settings
from hypothesis import strategies as st

import dag_models as dm
import libra
from libra.planner import Planning
from libra.runtime.apply import _ACTIVE_ATTR
from libra.testing import AllocatorMeter, assert_grads_equal
from dag_models import Node

STEPS = 2  # steps under the plan after the profiled one

PLAIN_KINDS = [k for k in dm.KINDS if k != "sub"]
_INPLACE_ERROR = "modified by an inplace operation"


pytestmark = pytest.mark.usefixtures("one_thread")


# ---- the spec strategy --------------------------------------------------------------------------------------------
@st.composite
def specs(draw, depth: int = 0, max_nodes: int = 6):
    n = draw(st.integers(1, max_nodes))
    kinds = st.sampled_from(PLAIN_KINDS + (["sub"] if depth < 2 else []))
    spec = []
    for i in range(n):
        kind = draw(kinds)
        # prefer recent values (chains and residuals), sometimes reach far back (skip connections)
        pick = st.one_of(st.just(i), st.integers(0, i))
        inputs = tuple(draw(pick) for _ in range(dm.arity(kind)))
        children = draw(specs(depth + 1, max_nodes=3)) if kind == "sub" else ()
        spec.append(Node(kind, inputs, children))
    return tuple(spec)


def stacks():
    """One to four blocks, each a random DAG."""
    return st.lists(specs(), min_size=1, max_size=4).map(tuple)


def set_times(prof: libra.Profile, seed: int) -> libra.Profile:
    """Op times drawn from ``seed`` (5 to 50 µs): the plan then depends on the drawn example only."""
    rng = random.Random(seed)
    for op in prof.ops:
        op.seconds = rng.uniform(5e-6, 5e-5)
    prof.dispatch_overhead_seconds = 1e-5
    prof.region_costs = []
    prof.eager_step_seconds = sum(op.seconds for op in prof.ops)
    return prof


def _event(text: str) -> None:
    if currently_in_test_context():  # the fixed stacks below run the same check outside hypothesis
        event(text)


# ---- one example --------------------------------------------------------------------------------------------------
def check(blocks, share: float, bandwidth: float | None, times_seed: int) -> dict:
    """Profiles, plans at ``share`` (or the named minimum), trains STEPS steps eagerly and under the plan; returns the
    plan's decision counts."""
    torch.manual_seed(0)
    eager = dm.Model(blocks)
    ours = copy.deepcopy(eager)
    data = dm.batch()
    opts = [torch.optim.SGD(m.parameters(), lr=0.05) for m in (eager, ours)]

    torch.manual_seed(1234)
    try:
        dm.step(eager, data)
    except RuntimeError as e:
        # eager itself refuses (an input changed in place after autograd saved it): not a model to test
        assume(_INPLACE_ERROR not in str(e))
        raise
    torch.manual_seed(1234)
    prof = set_times(libra.profile(ours, lambda: dm.step(ours, data)), times_seed)
    assert_grads_equal(eager, ours)  # profiling changes nothing
    for opt in opts:
        opt.step()
        opt.zero_grad(set_to_none=True)

    decisions = {"keep", "recompute", "offload"} if bandwidth is not None else None
    planning = Planning(prof, bandwidth, decisions) if bandwidth is not None else Planning(prof)
    budget = prof.budget_for_share(share)
    try:
        plan = libra.plan(planning, budget)
    except libra.BudgetInfeasibleError as e:
        _event("budget infeasible: planned at the named minimum")
        assert e.min_budget_bytes > budget
        budget = e.min_budget_bytes
        plan = libra.plan(planning, budget)
    assert plan.predicted_peak_bytes <= budget
    counts = plan.counts
    _event(f"recompute: {counts[libra.Decision.RECOMPUTE] > 0}, offload: {counts[libra.Decision.OFFLOAD] > 0}")

    over = []
    for i in range(1, STEPS + 1):
        torch.manual_seed(100 + i)
        with AllocatorMeter(extra=list(ours.parameters())) as meter:
            with libra.apply(ours, plan):
                offload = ours.__dict__[_ACTIVE_ATTR].offload
                loss_o = dm.step(ours, data)
        # on CPU host copies are device memory too: an offloading plan may use up to its host buffers more
        host = offload.pool.allocated_bytes if offload is not None else 0
        del offload
        torch.manual_seed(100 + i)
        loss_e = dm.step(eager, data)
        assert torch.equal(loss_e, loss_o), f"step {i}: loss {loss_o.item()} != eager {loss_e.item()}"
        assert_grads_equal(eager, ours)
        for opt in opts:
            opt.step()
            opt.zero_grad(set_to_none=True)
        del loss_o, loss_e
        assert meter.start_bytes == prof.static_bytes, "the test keeps other tensors alive than when profiled"
        if meter.peak_bytes > budget + host:
            over.append(f"step {i}: measured peak {meter.peak_bytes} > budget {budget} (+{host} offloaded; "
                        f"predicted {plan.predicted_peak_bytes})")
    assert_grads_equal(eager, ours)
    assert not over, "; ".join(over)
    return counts


# ---- the property -------------------------------------------------------------------------------------------------
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
          phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.target, Phase.shrink])
@given(
    blocks=stacks(),
    share=st.floats(0.0, 1.0),
    bandwidth=st.sampled_from([None, None, 1e13, 1e9]),
    times_seed=st.integers(0, 2**16),
)
def test_random_dag_matches_eager_within_budget(blocks, share, bandwidth, times_seed):
    check(blocks, share, bandwidth, times_seed)


# ---- fixed stacks that must use each mechanism (so the property above is known to reach them) --------------------
RESIDUAL = (Node("linear", (0,)), Node("gelu", (1,)), Node("dropout", (2,)), Node("linear", (3,)),
            Node("layernorm", (4,)), Node("add", (5, 0)))
CONV = (Node("conv", (0,)), Node("batchnorm", (1,)), Node("relu_", (2,)),
        Node("sub", (3,), (Node("chan_linear", (0,)), Node("tanh", (1,)))), Node("cat", (4, 0)))


@pytest.mark.parametrize("blocks", [(RESIDUAL,) * 3, (CONV, RESIDUAL, CONV)], ids=["residual", "conv-bn-nested"])
@pytest.mark.parametrize("bandwidth", [None, 1e13], ids=["recompute", "offload"])
def test_fixed_stack_recomputes_or_offloads(blocks, bandwidth):
    kind = libra.Decision.RECOMPUTE if bandwidth is None else libra.Decision.OFFLOAD
    # which mechanism wins at one budget depends on the drawn op times; the stack must use it at one of these
    seen = []
    for share in (0.75, 0.9):
        counts = check(blocks, share, bandwidth, times_seed=0)
        seen.append((share, counts))
        if counts[kind] > 0:
            break
    assert counts[kind] > 0, seen
