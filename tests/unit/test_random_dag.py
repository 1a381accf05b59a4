"""Random small DAG models (hypothesis): under any budget, gradients and buffers equal eager's and the measured peak
fits the budget, or the planner names a minimum that it then meets, measured.

A stack of two to four blocks, each a spec of at least three nodes (node kinds and input indices, some nodes nested
DAGs of their own), is drawn first, the module is built from it (``dag_models``, no generated code); one block, or
blocks of one op each, leave a plan nothing to save. The menu: linear over length or over channels (through
transposed views), conv1d, LayerNorm, BatchNorm, GroupNorm, GELU/tanh/sigmoid, in-place ReLU and scaling of a node's
own input, in-place ReLU and dropout inside a node, dropout, residual adds, ``h += b``, ``h.mul_(...)``, ``a += b`` on
an input, ``torch.cat`` of two branches. Budgets are drawn between the smallest the planner meets and eager's peak,
and about one in five below that smallest (then the planner must name a minimum, and meet it); plans may offload
(with a host bandwidth, in three examples of four) as well as recompute, under Libra's modes, plain checkpoint or
hooks.

Op times and the region executor's costs in the profile are replaced by ones drawn from a seed, so that a drawn
example gives the same plan on every machine and run (measured times would make the plan, and with it the outcome,
differ between runs). ``test_the_property_reaches_recompute_and_offload`` checks that the examples drawn use what
they are meant to test.
"""

from __future__ import annotations

import copy
import os
import random

import pytest
import torch
from hypothesis import HealthCheck, Phase, assume, currently_in_test_context, event, given, settings
from hypothesis import strategies as st

import dag_models as dm
import libra
from libra.planner import Planning
from libra.runtime.apply import _ACTIVE_ATTR
from libra.testing import AllocatorMeter, assert_grads_equal, bit_equal
from dag_models import Node

STEPS = 2  # steps under the plan after the profiled one

PLAIN_KINDS = [k for k in dm.KINDS if k != "sub"]
_INPLACE_ERROR = "modified by an inplace operation"


pytestmark = pytest.mark.usefixtures("one_thread")


# ---- the spec strategy --------------------------------------------------------------------------------------------
@st.composite
def specs(draw, depth: int = 0, min_nodes: int = 3, max_nodes: int = 6):
    n = draw(st.integers(min_nodes, max_nodes))
    kinds = st.sampled_from(PLAIN_KINDS + (["sub"] if depth < 2 else []))
    spec = []
    for i in range(n):
        kind = draw(kinds)
        # prefer recent values (chains and residuals), sometimes reach far back (skip connections)
        pick = st.one_of(st.just(i), st.integers(0, i))
        inputs = tuple(draw(pick) for _ in range(dm.arity(kind)))
        children = draw(specs(depth + 1, min_nodes=1, max_nodes=3)) if kind == "sub" else ()
        spec.append(Node(kind, inputs, children))
    return tuple(spec)


def stacks():
    """Two to four blocks, each a random DAG."""
    return st.lists(specs(), min_size=2, max_size=4).map(tuple)


def set_times(prof: libra.Profile, seed: int) -> libra.Profile:
    """Op times drawn from ``seed`` (5 to 50 µs), and fixed region and copy costs of this machine's order: the plan
    then depends on the drawn example only. With the six region costs the planner may also choose plain-checkpoint
    and hooked calls (NOTE [Plain regions], NOTE [Hooked regions] in planner/simulate.py)."""
    rng = random.Random(seed)
    for op in prof.ops:
        op.seconds = rng.uniform(5e-6, 5e-5)
    prof.dispatch_overhead_seconds = 1e-5
    prof.region_costs = [2e-5, 2e-5, 6e-5, 8e-6, 8e-6, 3e-5]
    prof.copy_seconds_per_byte = 1e-10
    prof.eager_step_seconds = sum(op.seconds for op in prof.ops)
    return prof


def _event(text: str) -> None:
    if currently_in_test_context():  # the fixed stacks below run the same check outside hypothesis
        event(text)


# ---- one example --------------------------------------------------------------------------------------------------
def check(blocks, x: float, bandwidth: float | None, times_seed: int) -> dict:
    """Profiles, plans ``x`` of the way from the smallest budget the planner meets to eager's peak (below that
    smallest when ``x < 0``: then the plan at the named minimum), trains STEPS steps eagerly and under the plan;
    returns the plan's decision counts."""
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
    lo, hi = planning.min_budget_bytes(), prof.eager_peak_bytes
    budget = lo + int(x * (hi - lo)) if x >= 0 else int(lo * (1 + x / 2))
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
    for how in ("plain", "hooked"):
        if any(getattr(r, how) for r in plan.regions):
            _event(f"a {how} call")

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
        assert bit_equal(loss_e, loss_o), f"step {i}: loss {loss_o.item()} != eager {loss_e.item()}"
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
# more examples to hunt for budget breaks: LIBRA_DAG_EXAMPLES=300 HYPOTHESIS_PROFILE=explore pytest -k matches_eager
# (150 found the layer-drop-sibling miss below)
@settings(max_examples=int(os.environ.get("LIBRA_DAG_EXAMPLES", "30")), deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
          phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.target, Phase.shrink])
@given(
    blocks=stacks(),
    x=st.floats(-0.25, 0.95),
    bandwidth=st.sampled_from([None, 1e13, 1e13, 1e9]),
    times_seed=st.integers(0, 2**16),
)
def test_random_dag_matches_eager_within_budget(blocks, x, bandwidth, times_seed):
    counts = check(blocks, x, bandwidth, times_seed)
    REACHED.append((bandwidth, counts[libra.Decision.RECOMPUTE] > 0, counts[libra.Decision.OFFLOAD] > 0))


REACHED: list[tuple[float | None, bool, bool]] = []  # (bandwidth, recomputes, offloads) per example the property ran


def test_the_property_reaches_recompute_and_offload():
    """The property above proves something only where its plans change the step: most of its examples must
    recompute or offload, and most of those with a fast host link must offload. (Run after it, in file order; on
    its own there is nothing to check.)"""
    if not REACHED:
        pytest.skip("runs with test_random_dag_matches_eager_within_budget")
    acting = sum(r or o for _, r, o in REACHED)
    fast = [o for bw, _, o in REACHED if bw == 1e13]
    assert acting >= 0.75 * len(REACHED), REACHED
    assert fast and sum(fast) >= 0.5 * len(fast), REACHED


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
    for x in (0.5, 0.8):
        counts = check(blocks, x, bandwidth, times_seed=0)
        seen.append((x, counts))
        if counts[kind] > 0:
            break
    assert counts[kind] > 0, seen


# A block whose forward keeps every node's output in a list until it returns: the second linear's output is saved by
# the third, so eager never shows when Python lets go of it; the block's list holds it to the block's end, which the
# profiler records (NOTE [Python's hold] in profiler/recorder.py). Found by the property on a fresh clone.
HELD_BY_THE_BLOCK = (Node("linear", (0,)), Node("linear", (0,)), Node("linear", (2,)))


def test_a_profiled_module_that_saves_nothing_runs_as_planned():
    """The second block's third node (a linear over channels of the block's input) makes nothing the plan decides
    on, so no decision names it: the runtime took it for a layer the profiled step skipped (layer drop) and ran it
    under plain checkpoint, one RNG state (5,056 B) over a budget planned to the byte. Found by the property (150
    examples); the plan now names the modules the profiled step never called (``Plan.unprofiled``)."""
    check(((Node("linear", (0,)), Node("linear", (1,)), Node("linear", (2,))),
           (Node("chan_linear", (0,)), Node("chan_linear", (1,)), Node("chan_linear", (0,)))), 0.0, None, 0)


def test_a_plain_linear_between_in_place_scalings_is_predicted():
    """At the named minimum the plan recomputes the third block's middle linear whole; its output, saved by the next
    linear, lives until autograd releases that linear's node, after its bias reduction, not until the save's last
    unpack: the simulator let go 6 ops early and the step measured 5,376 B over its prediction. Found by a
    250-example explored sweep (``LIBRA_DAG_EXAMPLES``)."""
    _check_in_a_frame_of_its_own(((Node("add", (0, 0)), Node("add", (1, 1)), Node("linear", (2,)), Node("scale_", (3,)), Node("add", (4, 4))),
           (Node("add", (0, 0)), Node("add", (1, 1)), Node("linear", (2,)), Node("scale_", (3,)), Node("add", (4, 4))),
           (Node("add", (0, 0)), Node("linear", (1,)), Node("linear", (2,)), Node("linear", (3,)),
            Node("scale_", (0,)))), 0.0, None, 0)


def test_a_channel_linear_then_an_in_place_scaling_at_the_minimum():
    """At the named minimum both blocks are recomputed whole; ``h.mul_(0.5)`` makes an 8-byte tensor of its scalar
    that no op returns and its autograd node keeps without a saved-tensor hook, so the forward's copy lives on to
    backward while the replay makes another: the step measured 8 B over its prediction (NOTE [Untracked bytes] in
    planner/simulate.py). Found by a 600-example explored sweep."""
    _check_in_a_frame_of_its_own(((Node("linear", (0,)), Node("linear", (1,)), Node("linear", (2,))),
                                  (Node("linear", (0,)), Node("chan_linear", (1,)), Node("scale_", (2,)),
                                   Node("linear", (3,)))), 0.0, None, 0)


def test_an_option_that_changes_nothing_is_estimated():
    """The option family's gap fills estimate the curve of a member whose options include one that changes nothing
    (no points in its effect): the estimate indexed with an empty list, which numpy reads as floats, and planning
    raised IndexError. Found by a 500-example explored sweep."""
    check(((Node("linear", (0,)), Node("linear", (1,)), Node("chan_linear", (2,)), Node("linear_dropout_", (3,))),
           (Node("linear_dropout_", (0,)), Node("cat", (1, 1)), Node("linear", (1,)), Node("linear", (3,)),
            Node("linear", (4,))),
           (Node("sub", (0,), (Node("batchnorm", (0,)), Node("linear_relu_", (1,)))), Node("tanh", (1,)),
            Node("chan_linear", (2,)), Node("add", (3, 3)), Node("linear", (4,)), Node("linear", (5,))),
           (Node("sub", (0,), (Node("linear", (0,)), Node("linear_relu_", (1,)))), Node("tanh", (1,)),
            Node("chan_linear", (2,)), Node("linear", (3,)), Node("linear", (4,)), Node("linear", (5,)))),
          0.0, 1e9, 0)


def test_hooked_calls_with_early_prefetch_and_a_plain_sigmoid_at_the_minimum():
    """At the named minimum with a 1 GB/s link the plan hooked calls and ran one sigmoid under plain checkpoint, its
    input the output of a hooked call whose ReLU saved it (kept on the device: ``stay``). The simulator let that
    output go with the plain call's backward, though the ReLU's save held it to the hooked call's own backward: each
    step measured 32 KiB more than simulated there, 10,400 B over the budget plus the host buffers. Found by a
    500-example explored sweep; the measured peak is now the prediction."""
    _check_in_a_frame_of_its_own(
        ((Node("linear_dropout_", (0,)), Node("add_into", (1, 1)), Node("add", (2, 2)), Node("linear", (3,))),
         (Node("linear", (0,)), Node("linear", (0,)), Node("linear", (2,))),
         (Node("sub", (0,), (Node("batchnorm", (0,)), Node("linear_relu_", (1,)))), Node("sigmoid", (1,)),
          Node("linear_dropout_", (0,)), Node("add", (3, 3)), Node("linear", (4,)), Node("linear", (5,))),
         (Node("sub", (0,), (Node("linear", (0,)), Node("linear_relu_", (1,)))), Node("sigmoid", (1,)),
          Node("linear_dropout_", (1,)), Node("add", (3, 3)), Node("linear", (4,)), Node("linear", (5,)))),
        0.0, 1e9, 0)


def _check_in_a_frame_of_its_own(*args) -> None:
    """``check``, whose failure is raised again without its traceback: an expected failure's traceback keeps the
    failing frames, and with them the models and tensors later tests must not find live."""
    try:
        check(*args)
        return
    except AssertionError as e:
        message = str(e)
    raise AssertionError(message)


def test_a_block_that_holds_its_nodes_outputs_is_predicted():
    """Two blocks of three linears, the second recomputed whole, whose forward keeps every node's output in a list
    until it returns: measured with the allocator, the plan's peak is its prediction (it was 18,936 B above it while
    the simulator assumed each storage held only to the end of the Linear that made it; NOTE [Python's hold])."""
    measured, predicted = _held_by_the_block_peaks()
    assert measured == predicted, (measured, predicted)


def _held_by_the_block_peaks() -> tuple[int, int]:
    """(measured, predicted) peak of the plan above, in a frame of its own: a failure's traceback keeps the test's
    frame, which must hold no tensors (later tests count what is live when their steps start)."""
    from libra.planner.simulate import PLAIN

    torch.manual_seed(0)
    ours = dm.Model(((Node("linear", (0,)), Node("linear", (1,)), Node("linear", (2,))), HELD_BY_THE_BLOCK))
    data = dm.batch()
    torch.manual_seed(1234)
    prof = set_times(libra.profile(ours, lambda: dm.step(ours, data)), 0)
    planning = Planning(prof)
    sel = planning.selections[0]
    (ui,) = [u for u, unit in enumerate(sel.units) if unit.module == "blocks.1"]
    state = {ui: PLAIN}
    plan = planning.build(state, prof.eager_peak_bytes, sel.sim.run(state), "greedy", 0.0, sel)
    for i in range(2):
        torch.manual_seed(100 + i)
        with AllocatorMeter(extra=list(ours.parameters())) as meter:
            with libra.apply(ours, plan):
                dm.step(ours, data)
        ours.zero_grad(set_to_none=True)
    return meter.peak_bytes, plan.predicted_peak_bytes
