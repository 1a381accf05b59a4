"""Offload on CPU: the same code path as on CUDA with plain copies. Host and device memory are one here, so these
tests check values, release and reuse, not the budget (that is the GPU check's job)."""

import contextlib
import copy
import gc
import weakref

import pytest
import torch

import libra
from libra.planner import Planning
from libra.planner.simulate import EARLY, HOOKED
from libra.runtime import offload as offload_mod
from libra.runtime.apply import _ACTIVE_ATTR
from libra.testing import LiveBytesMeter, assert_grads_equal
from pairs import plan_anew

FAST = 1e13  # bytes per second: offloading is nearly free
SLOW = 1e6


# per forward op, per replayed op and per call under Libra's modes, then under plain checkpoint: what an idle
# machine measures (NOTE [Region overhead] in runtime/calibrate.py)
IDLE_COSTS = (20e-6, 20e-6, 150e-6, 10e-6, 10e-6, 60e-6)


def _steady(case, region_costs=IDLE_COSTS):
    """The case's profile with fixed op times (0.1 ms) and executor costs: which mechanism a plan picks must not
    depend on how loaded the machine was when it profiled."""
    prof = copy.deepcopy(case.profile)
    for op in prof.ops:
        op.seconds = 1e-4
    prof.eager_step_seconds = 1e-4 * len(prof.ops)
    prof.region_costs = list(region_costs)
    return prof


def _plan(case, decisions, bandwidth=FAST, share=0.5, prof=None):
    prof = case.profile if prof is None else prof
    planning = Planning(prof, bandwidth, decisions)
    return libra.plan(planning, max(prof.budget_for_share(share), planning.min_budget_bytes()))


@pytest.mark.parametrize("decisions", [{"keep", "offload"}, {"keep", "recompute"}, {"keep", "recompute", "offload"}])
def test_gradients_exact(case, decisions):
    plan = _plan(case, decisions)
    counts = plan.counts
    if "offload" in decisions and "recompute" not in decisions:
        assert counts[libra.Decision.OFFLOAD] > 0 and counts[libra.Decision.RECOMPUTE] <= counts[libra.Decision.KEEP]
    if "offload" not in decisions:
        assert counts[libra.Decision.OFFLOAD] == 0
        assert not any(r.hooked for r in plan.regions)
    if "recompute" not in decisions:
        assert not any(r.plain for r in plan.regions)
    case.train(plan, steps=3)


def test_offload_only_never_recomputes_plainly(case):
    """A plain region recomputes everything: never in a plan that may not recompute, even where Libra's modes
    are measured dear enough that plain checkpoint would be the faster plan (a run on a busy machine once made
    the offload-only plan all plain, offloading nothing)."""
    prof = _steady(case, [c * 50 for c in IDLE_COSTS[:3]] + list(IDLE_COSTS[3:]))
    planning = Planning(prof, FAST, {"keep", "offload"})
    plan = libra.plan(planning, max(prof.budget_for_share(0.5), planning.min_budget_bytes()))
    assert plan.counts[libra.Decision.OFFLOAD] > 0
    assert not any(r.plain for r in plan.regions)


def test_bandwidth_decides_the_trade(case):
    prof = _steady(case)
    slow = _plan(case, {"keep", "recompute", "offload"}, SLOW, share=0.75, prof=prof)
    fast = _plan(case, {"keep", "recompute", "offload"}, FAST, share=0.75, prof=prof)
    assert slow.counts[libra.Decision.OFFLOAD] == 0 and slow.counts[libra.Decision.RECOMPUTE] > 0
    assert fast.counts[libra.Decision.OFFLOAD] > 0
    assert fast.predicted_step_seconds <= slow.predicted_step_seconds


def _watch_copies(monkeypatch) -> list:
    """Weak references to the device storage of every host copy made from now on."""
    sources = []
    original = offload_mod.HostCopy.__init__

    def watching(self, t, pool, stream):
        sources.append(weakref.ref(t.untyped_storage()))
        original(self, t, pool, stream)

    monkeypatch.setattr(offload_mod.HostCopy, "__init__", watching)
    return sources


def _assert_released_in_forward_and_pool_steady(case, plan, monkeypatch):
    """Three steps under ``plan``: every storage it offloads is gone from the device once the forward is done, and
    the host pool allocates nothing after the first step."""
    sources = _watch_copies(monkeypatch)
    model = case.ours
    pool_sizes = []
    with libra.apply(model, plan):
        pool = model.__dict__[_ACTIVE_ATTR].offload.pool
        for _ in range(3):
            sources.clear()
            loss = case.loss_fn(model(case.x), case.y)
            gc.collect()
            assert sources, "the plan offloads nothing"
            alive = [s for s in sources if s() is not None]
            assert not alive, f"{len(alive)} of {len(sources)} offloaded storages still on the device after forward"
            loss.backward()
            del loss
            model.zero_grad(set_to_none=True)
            pool_sizes.append(pool.allocated_bytes)
    assert pool_sizes[0] > 0 and pool_sizes[0] == pool_sizes[1] == pool_sizes[2]


def test_offloaded_storages_are_released_in_forward_and_the_pool_does_not_grow(case, monkeypatch):
    _assert_released_in_forward_and_pool_steady(case, _plan(case, {"keep", "offload"}), monkeypatch)


def test_offload_needs_a_bandwidth_on_cpu(case):
    with pytest.raises(libra.LibraError, match="host_bandwidth"):
        libra.plan(case.profile, case.profile.budget_for_share(0.5), decisions={"offload"})
    plan = libra.plan(case.profile, case.profile.budget_for_share(0.5))
    assert plan.counts[libra.Decision.OFFLOAD] == 0


def test_a_cuda_profile_plans_without_cuda(case):
    """The planner is pure: the host link's bandwidth comes from the profile (the profiler measures it on CUDA),
    so a profile made on a GPU machine plans here, with offloading, and the same as with the bandwidth passed."""
    prof = _steady(case)
    prof.device = "cuda:0"
    prof.host_bandwidth = FAST
    with _no_cuda_calls():
        budget = max(prof.budget_for_share(0.5), Planning(prof, decisions={"keep", "offload"}).min_budget_bytes())
        from_profile = libra.plan(prof, budget, decisions={"keep", "offload"})
    assert from_profile.counts[libra.Decision.OFFLOAD] > 0
    given = libra.plan(prof, budget, decisions={"keep", "offload"}, host_bandwidth=FAST)
    assert (from_profile.regions, from_profile.predicted_step_seconds) == (given.regions, given.predicted_step_seconds)
    prof.host_bandwidth = 0.0  # an older profile, or one from a device with no host link measured
    with pytest.raises(libra.LibraError, match="host_bandwidth=") as e:
        libra.plan(prof, budget, decisions={"offload"})
    assert "cuda:0" in str(e.value)


@contextlib.contextmanager
def _no_cuda_calls():
    """Fails the test on any call into torch.cuda's device functions (there is no device here to answer them)."""
    names = ("synchronize", "current_device", "get_device_properties", "mem_get_info", "Stream", "Event",
             "is_available", "device_count", "_lazy_init")
    saved = {n: getattr(torch.cuda, n) for n in names if hasattr(torch.cuda, n)}

    def refuse(*args, **kwargs):
        raise AssertionError("the planner called into torch.cuda")

    for n in saved:
        setattr(torch.cuda, n, refuse)
    try:
        yield
    finally:
        for n, f in saved.items():
            setattr(torch.cuda, n, f)


# ---- hooked regions (NOTE [Hooked regions] in planner/simulate.py) ------------------------------------------------
def _hooked_plan(case, bandwidth=FAST):
    """Every unit that may run hooked does, its copies back at its prefetch trigger where it has one (NOTE
    [Prefetch]): the runtime path, whatever the planner would choose."""
    prof = case.profile
    planning = Planning(prof, bandwidth)
    sel = planning.selections[0]
    early = frozenset({EARLY})
    state = {ui: HOOKED | early if sel.sim.prefetch_trigger[ui] >= 0 else HOOKED
             for ui in range(len(sel.units)) if sel.sim.hook_ok(ui)}
    assert state, "no unit of the model may run hooked"
    return planning.build(state, prof.eager_peak_bytes, sel.sim.run(state), "greedy", 0.0, sel)


def test_hooked_regions_give_exact_gradients_and_release_what_they_offload(case, monkeypatch):
    plan = _hooked_plan(case)
    assert all(r.hooked and not r.save and not r.skip for r in plan.regions)
    assert plan.counts[libra.Decision.OFFLOAD] > 0 and plan.counts[libra.Decision.RECOMPUTE] == 0
    case.train(plan, steps=2)
    case.reset()
    _assert_released_in_forward_and_pool_steady(case, plan, monkeypatch)


def test_planner_hooks_units_when_copies_are_cheap(case):
    """With a fast host link, offloading a whole call under hooks beats recomputing it or running it through
    Libra's modes (no dispatch mode, nothing replayed); with a slow one, nothing is offloaded. Op times and the
    executor's costs are fixed at what an idle machine measures (the hooks' per-op cost, plain checkpoint's, half
    the modes'): measured ones make the plan depend on the machine's load."""
    prof = _steady(case)

    def plan(bandwidth):
        planning = Planning(prof, bandwidth, {"keep", "recompute", "offload"})
        return libra.plan(planning, max(prof.budget_for_share(0.5), planning.min_budget_bytes()))

    fast, slow = plan(FAST), plan(SLOW)
    assert any(r.hooked for r in fast.regions)
    assert not any(r.hooked for r in slow.regions)
    assert fast.predicted_step_seconds <= slow.predicted_step_seconds
    case.train(fast, steps=2)


def test_offload_only_minimum_uses_hooked_calls(case):
    """With only offloading allowed, hooked calls (which offload everything a call saves but what it returns, where
    a region offloads only its candidates and keeps the rest) reach lower than region offloads alone, and the plan
    at that minimum trains with exact gradients."""
    planning = Planning(case.profile, FAST, {"keep", "offload"})
    regions_only = min(sel.lowest.peak_bytes for sel in planning.selections)
    assert planning.min_budget_bytes() < regions_only
    plan = libra.plan(planning, planning.min_budget_bytes())
    assert any(r.hooked for r in plan.regions) and not any(r.plain for r in plan.regions)
    case.train(plan, steps=2)


def test_more_decisions_never_raise_the_minimum(case):
    """Allowing both mechanisms reaches at least as low as either alone (the minimum search also starts from
    offloading's own full state: recompute's starts lower but can end higher once calls are hooked)."""
    prof = case.profile
    lowest = {frozenset(d): Planning(prof, FAST, d).min_budget_bytes()
              for d in ({"keep", "offload"}, {"keep", "recompute"}, {"keep", "recompute", "offload"})}
    both = lowest.pop(frozenset({"keep", "recompute", "offload"}))
    assert both <= min(lowest.values()), (both, lowest)


class _Bumped(torch.nn.Module):
    """A block whose output ReLU saves (and nothing outside it does), changed in place after the block returns
    when ``bump`` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.block = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU())
        self.bump = False

    def forward(self, x):
        h = self.last = self.block(x)  # held: the hooks can still see its version at unpack
        if self.bump:
            h.mul_(2)
        return h * 3


def test_hooked_region_refuses_a_saved_tensor_changed_in_place():
    """NOTE [Version checks]: eager autograd raises when a saved tensor changes in place; under saved-tensor hooks
    it does not check, so the hooked region does, instead of returning the value from before the change."""
    torch.manual_seed(0)
    model, x = _Bumped(), torch.randn(64, 16)
    _assert_refused_like_eager(model, x, _hook_one(model, x, "block"))


def _assert_refused_like_eager(model, x, plan) -> None:
    """With ``model.bump`` set, eager autograd raises at backward, and so does ``plan``."""
    model.bump = True
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        model(x).sum().backward()
    with libra.apply(model, plan):
        with pytest.raises(libra.LibraError, match="changed in place after it was saved"):
            model(x).sum().backward()


class _Returns(torch.nn.Module):
    """Two blocks whose last ReLU saves its output, which the call returns: the next block's Linear saves it too
    (``chained``), or the caller changes it in place once the next op has read it and lets it go (``bump``)."""

    def __init__(self, chained: bool) -> None:
        super().__init__()
        self.a = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 32), torch.nn.ReLU())
        self.b = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.ReLU())
        self.chained = chained
        self.bump = False

    def forward(self, x):
        h = self.a(x)
        if self.chained:
            return self.b(h)
        y = h * 3
        if self.bump:
            h.mul_(2)  # and the caller lets go of h
        return y


def _hook_one(model, x, module: str = "a"):
    """A plan for ``model`` that runs ``module`` hooked and nothing else (profiled here; grads zeroed after)."""
    prof = libra.profile(model, lambda: model(x).sum().backward())
    model.zero_grad(set_to_none=True)
    planning = Planning(prof, FAST)
    sel = planning.selections[0]
    ui = next(i for i, u in enumerate(sel.units) if u.module == module)
    assert sel.sim.hook_ok(ui)
    state = {ui: HOOKED}
    return planning.build(state, prof.eager_peak_bytes, sel.sim.run(state), "greedy", 0.0, sel)


@pytest.mark.parametrize("hooked_next", [False, True], ids=["next-checkpointed", "next-hooked"])
@pytest.mark.parametrize("named", [True, False], ids=["named", "misnamed"])
def test_hooked_call_returns(monkeypatch, named, hooked_next):
    """NOTE [Shared hooked storages]: a storage a hooked call saves and returns, which the next block saves too,
    stays on the device uncopied when that block keeps it (the plan names its save: ``stay``), and goes to host
    memory once for both when the next block is hooked too. A plan whose ``stay`` misses it (a call that saves
    other tensors than profiled) copies it for nothing, and the values stay exact."""
    torch.manual_seed(0)
    model, x = _Returns(chained=True), torch.randn(64, 16)
    ref = copy.deepcopy(model)
    ref(x).sum().backward()
    prof = libra.profile(model, lambda: model(x).sum().backward())
    model.zero_grad(set_to_none=True)
    planning = Planning(prof, FAST)
    sel = planning.selections[0]
    names = {u.module: i for i, u in enumerate(sel.units)}
    state = {names["a"]: HOOKED}
    if hooked_next:
        state[names["b"]] = HOOKED
    else:  # b under Libra's modes, keeping everything: its input is held on the device to its backward
        state[names["b"]] = frozenset(sel.units[names["b"]].candidates)
    plan = planning.build(state, prof.eager_peak_bytes, sel.sim.run(state), "greedy", 0.0, sel)
    region = next(r for r in plan.regions if r.module == "a")
    # saves of a's own tensors: the inner ReLU's output, the second Linear's input (the same), the last ReLU's
    assert region.stay == ([] if hooked_next else [2])
    assert [r.offload_inputs for r in plan.regions if r.module == "b"] == [hooked_next]
    if not named:
        region.stay = []
    sources = _watch_copies(monkeypatch)
    with libra.apply(model, plan):
        loss = model(x).sum()
        gc.collect()
        # a's inner ReLU output, and a's output when it is shared or misnamed (one copy for a and b); b's ReLU
        # output is returned from b and the model: it stays
        assert len(sources) == 1 + (hooked_next or not named)
        if hooked_next:
            assert all(s() is None for s in sources)  # a's output too: nothing holds it on the device
        loss.backward()
    assert_grads_equal(ref, model)


def test_hooked_call_checks_the_version_of_what_stays():
    """A returned storage that stays on the device, changed in place once the caller has let go of it: eager
    raises, and so does the hooked call."""
    torch.manual_seed(0)
    model, x = _Returns(chained=False), torch.randn(64, 16)
    _assert_refused_like_eager(model, x, _hook_one(model, x))


class _InputBumped(torch.nn.Module):
    """A block whose input (which its Linear saves, on the device: ``pre``'s ReLU saves it too) the caller changes
    in place after the call."""

    def __init__(self) -> None:
        super().__init__()
        self.pre = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU())
        self.a = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU())
        self.bump = False

    def forward(self, x):
        h = self.pre(x)
        y = self.a(h)
        if self.bump:
            h.add_(1)
        return y


class _SavesItsInput(torch.nn.Module):
    """A block whose input nothing but the block saves (``pre``'s Linear saves its own input, not its output)."""

    def __init__(self) -> None:
        super().__init__()
        self.pre = torch.nn.Linear(16, 16)
        self.a = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 32))

    def forward(self, x):
        return self.a(self.pre(x))


def test_hooked_call_offloads_an_input_only_it_saves(monkeypatch):
    """``RegionPlan.offload_inputs``: an input nothing else saves goes to host memory with the rest, so its device
    storage is gone once the caller lets go of it; gradients stay exact."""
    torch.manual_seed(0)
    model, x = _SavesItsInput(), torch.randn(64, 16)
    ref = copy.deepcopy(model)
    ref(x).sum().backward()
    plan = _hook_one(model, x)
    (region,) = plan.regions
    assert region.offload_inputs
    sources = _watch_copies(monkeypatch)
    with libra.apply(model, plan):
        loss = model(x).sum()
        gc.collect()
        # pre's output (a's input), the ReLU's output (saved by it and the last Linear): both copied, both gone
        assert len(sources) == 2 and all(s() is None for s in sources)
        loss.backward()
    assert_grads_equal(ref, model)


class _SavedThenChanged(torch.nn.Module):
    """``h`` saved by a multiply, then changed in place by a sigmoid that saves its result: one storage, two values
    saved (eager raises at the multiply's backward; the out-of-place version is the same function)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(16, 16)
        self.w = torch.nn.Parameter(torch.randn(16))
        self.inplace = False

    def forward(self, x):
        h = self.a(x)
        m = h * self.w
        return m + (h.sigmoid_() if self.inplace else torch.sigmoid(h))


class _Wrap(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = _SavedThenChanged()

    def forward(self, x):
        return self.block(x)


def test_hooked_call_copies_a_storage_again_after_an_in_place_change():
    """The copies are deduplicated by storage, but a storage changed in place after its copy was made gets a new
    one: the sigmoid's backward must read its result, not the multiply's input (the saved tensor is gone once the
    forward returns, so no version check can see it)."""
    torch.manual_seed(0)
    model, x = _Wrap(), torch.randn(64, 16)
    ref = copy.deepcopy(model)
    ref(x).sum().backward()  # out of place: the same function
    plan = _hook_one(model, x, "block")
    model.block.inplace = True
    with libra.apply(model, plan):
        model(x).sum().backward()
    assert_grads_equal(ref, model)


def test_hooked_call_checks_the_version_of_its_inputs():
    """Under the hooks autograd checks no version at all, also not of the tensors a hooked call leaves on the
    device (its inputs): an input changed in place after the call raises, as in eager, instead of a wrong
    gradient."""
    torch.manual_seed(0)
    model, x = _InputBumped(), torch.randn(64, 16)
    _assert_refused_like_eager(model, x, _hook_one(model, x))


class _DeviceMeter(LiveBytesMeter):
    """The live-bytes meter without the offload pool's host buffers: on a CPU they are CPU tensors too, but they
    stand for host memory, which the budget does not count."""

    def __init__(self, pool_buffers: set, **kw) -> None:
        super().__init__(**kw)
        self.pool_buffers = pool_buffers

    def _track(self, t):
        if t.untyped_storage()._cdata not in self.pool_buffers:
            super()._track(t)


def _pool_buffers(monkeypatch) -> set:
    """The storages of every host buffer the offload pool hands out from now on, as :class:`_DeviceMeter` takes
    them."""
    buffers: set = set()
    acquire = offload_mod.HostPool.acquire

    def marking(self, nbytes):
        buf = acquire(self, nbytes)
        buffers.add(buf.untyped_storage()._cdata)
        return buf

    monkeypatch.setattr(offload_mod.HostPool, "acquire", marking)
    return buffers


def _device_peaks(case, plan, monkeypatch) -> tuple[int, int]:
    """(measured, predicted) peak bytes of two steps under ``plan`` above what was live when the step began (other
    tests of this module may leave tensors behind), measured by a meter that counts everything but the offload
    pool's host buffers."""
    buffers = _pool_buffers(monkeypatch)
    model = case.ours
    with libra.apply(model, plan):
        for step in range(2):  # the second step reuses the first one's buffers
            with _DeviceMeter(buffers, extra=list(model.parameters())) as meter:
                case.loss_fn(model(case.x), case.y).backward()
            model.zero_grad(set_to_none=True)
    return meter.peak_bytes - meter.start_bytes, plan.predicted_peak_bytes - case.profile.static_bytes


def test_hooked_plan_peak_is_predicted(case, monkeypatch):
    """The simulator's model of a hooked call (device copy gone once copied, back at the prefetch) against a
    meter that counts everything but the host buffers."""
    plan = _hooked_plan(case)
    measured, predicted = _device_peaks(case, plan, monkeypatch)
    assert abs(measured - predicted) <= 0.05 * plan.predicted_peak_bytes, (measured, predicted)


def test_inputs_planned_anew_are_planned_as_the_plan_was():
    """A step with new input shapes is profiled and planned under ``on_over_budget="warn"`` with the decisions and
    the host link the plan was made with (an offload-only plan stays offload-only)."""
    from libra.testing import models

    model, x, y, loss_fn = models.make_mlp(batch=512, d=64, hidden=256, depth=4)
    prof = libra.profile(model, lambda: loss_fn(model(x), y).backward())
    model.zero_grad(set_to_none=True)
    planning = Planning(prof, FAST, {"keep", "offload"})
    plan = libra.plan(planning, max(prof.budget_for_share(0.7), planning.min_budget_bytes()))
    assert plan.counts[libra.Decision.OFFLOAD] > 0 and plan.counts[libra.Decision.RECOMPUTE] == 0
    other = plan_anew(model, plan, lambda: loss_fn(model(x[:384]), y[:384]).backward())
    assert other.allowed == ["keep", "offload"] and other.host_bandwidth == FAST
    assert other.counts[libra.Decision.RECOMPUTE] == 0


def test_offloading_units_add_up(case):
    """NOTE [Prefetch] in planner/simulate.py: copies come back at fixed points (a unit's own backward start, or its
    trigger's), so what each unit's offloading adds to the step does not depend on which other units offload: the
    sum over units alone equals the plan of all of them (with copies that fit in the step, so that the busy link is
    not what decides). With the copy back at "the region replayed before it" the first unit of a plan paid its whole
    copy and the others hid theirs, so the sum was larger."""
    prof = _steady(case)
    probe = Planning(prof, FAST).selections[0]
    units = [ui for ui, u in enumerate(probe.units) if u.offloadable and probe.sim.prefetch_trigger[ui] >= 0]
    assert len(units) >= 2, "the model has no two units that may offload and have a prefetch trigger"
    offloaded = sum(probe.sim.nbytes[s] for ui in units for inst in probe.units[ui].instances
                    for k, s in enumerate(inst.sids) if inst.producer[k] in probe.units[ui].offloadable)
    bandwidth = 4 * offloaded / prof.eager_step_seconds  # every copy together takes a quarter of the step
    sim = Planning(prof, bandwidth).selections[0].sim
    for early in (frozenset(), frozenset({EARLY})):
        entries = {ui: frozenset(~j for j in probe.units[ui].offloadable) | early for ui in units}
        alone = [sim.run({ui: e}).added_seconds for ui, e in entries.items()]
        assert sum(alone) > 0
        assert sim.run(entries).added_seconds == pytest.approx(sum(alone), rel=1e-9, abs=1e-15)


def test_an_unplanned_call_brings_the_next_offloads_back(case, monkeypatch):
    """A unit offloading early whose trigger is planned for nothing: the runtime watches that call's backward start
    (TriggerRun) and starts the copies back there, before the unit's replay; gradients stay bit-equal, and the peak
    stays under the predicted one (measured without the host buffers, as in test_hooked_plan_peak_is_predicted; its
    peak is at the loss's backward, where this meter run alone saw 6 MB less than the simulator charges)."""
    from libra.runtime import region as region_mod

    prof = case.profile
    planning = Planning(prof, FAST)
    sel = planning.selections[0]
    ui = next((u for u, unit in enumerate(sel.units) if unit.offloadable and sel.sim.prefetch_trigger[u] >= 0), None)
    assert ui is not None, "no unit may offload with a prefetch trigger"
    state = {ui: frozenset(~j for j in sel.units[ui].offloadable) | {EARLY}}
    plan = planning.build(state, prof.eager_peak_bytes, sel.sim.run(state), "greedy", 0.0, sel)
    trigger = sel.units[sel.sim.prefetch_trigger[ui]]
    (region,) = plan.regions
    assert region.prefetch_after == [trigger.module, trigger.call]

    events, watched = [], []
    prefetch, run, trigger_run = region_mod.RegionRun.prefetch, region_mod.RegionRun.run, region_mod.TriggerRun.run

    def recording_prefetch(self):
        events.append("prefetch")
        return prefetch(self)

    def recording_run(self, *args, **kwargs):
        if self.calls >= 1:
            events.append("replay")
        return run(self, *args, **kwargs)

    def watching(self, *args, **kwargs):
        watched.append(self.module)
        return trigger_run(self, *args, **kwargs)

    monkeypatch.setattr(region_mod.RegionRun, "prefetch", recording_prefetch)
    monkeypatch.setattr(region_mod.RegionRun, "run", recording_run)
    monkeypatch.setattr(region_mod.TriggerRun, "run", watching)
    case.train(plan, steps=2)
    assert watched and set(watched) == {trigger.module}
    assert events[:2] == ["prefetch", "replay"], events
    measured, predicted = _device_peaks(case, plan, monkeypatch)
    assert measured <= predicted, (measured, predicted)


class _MaskedCall(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(16, 1024)
        self.out = torch.nn.Linear(1024, 16)

    def forward(self, h, mask):
        return self.out(torch.relu(self.fc(h)) * mask)


class _SavesAnArgument(torch.nn.Module):
    """``a`` (set by the subclass) saves a tensor with no autograd history it is handed, and ``post`` saves a lot
    after it, so the step peaks at the end of the forward, while that tensor is still saved."""

    def __init__(self, a: torch.nn.Module) -> None:
        super().__init__()
        self.pre = torch.nn.Linear(16, 16)
        self.a = a
        self.post = torch.nn.Sequential(torch.nn.Linear(16, 2048), torch.nn.ReLU(), torch.nn.Linear(2048, 1))


class _SavesAMask(_SavesAnArgument):
    """As attention saves a mask or position ids."""

    def __init__(self) -> None:
        super().__init__(_MaskedCall())

    def forward(self, x):
        mask = (x.repeat(1, 64) > 0).to(x.dtype)
        return self.post(self.a(self.pre(x), mask))


def _hooked_steps(model, x, monkeypatch):
    """Runs two steps of ``model`` with ``a`` hooked (``_hook_one``), gradients checked against eager: (the device
    peak measured above the step's start, the plan's predicted peak above the static bytes, host copies per step,
    the profile)."""
    ref = copy.deepcopy(model)
    ref(x).sum().backward()
    plan = _hook_one(model, x)
    prof = libra.profile(model, lambda: model(x).sum().backward())
    buffers = _pool_buffers(monkeypatch)
    sources = _watch_copies(monkeypatch)
    copies = []
    with libra.apply(model, plan):
        for _ in range(2):  # the second step reuses the first one's buffers
            sources.clear()
            model.zero_grad(set_to_none=True)
            with _DeviceMeter(buffers, extra=list(model.parameters())) as meter:
                model(x).sum().backward()
            copies.append(len(sources))
    assert_grads_equal(ref, model)
    return meter.peak_bytes - meter.start_bytes, plan.predicted_peak_bytes - prof.static_bytes, copies, prof


def test_hooked_call_keeps_a_saved_input_without_history_on_the_device(monkeypatch):
    """A hooked call copies to host memory only what has autograd history (``HookRun.pack``): the mask it saves
    stays on the device until autograd lets go of it, and the plan's predicted peak counts it there
    (``PackRecord.activation``; the simulator once freed it at the copy, 1 KiB under GPT-2's measured minimum)."""
    torch.manual_seed(0)
    x = torch.randn(64, 16)
    measured, predicted, copies, prof = _hooked_steps(_SavesAMask(), x, monkeypatch)
    # without history: the step's input, saved by pre's Linear, and the mask, saved by the multiply
    assert [p.activation for p in prof.packs].count(False) == 2
    assert copies == [3, 3]  # a's input, the ReLU's output and the product: not the mask
    assert abs(measured - predicted) < x.numel() * 64 * x.element_size() // 4, (measured, predicted)


class _GatheredMatmul(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(16, 64)
        self.full = torch.randn(64, 64, requires_grad=True)  # a plain attribute: not in parameters()

    def forward(self, h):
        return torch.relu(self.fc(h)) @ self.full


class _UnregisteredWeight(torch.nn.Module):
    """``a`` multiplies by a weight that requires grad but is no parameter of the model when the step begins, as
    FSDP2's all-gathered parameters are not."""

    def __init__(self) -> None:
        super().__init__()
        self.pre = torch.nn.Linear(16, 16)
        self.a = _GatheredMatmul()

    def forward(self, x):
        return self.a(self.pre(x))


def test_hooked_call_keeps_a_weight_that_is_no_registered_parameter(monkeypatch):
    """``HookRun.pack``: a leaf that requires grad is a parameter whether or not the model lists it; copying it to
    host memory would move a weight the step keeps anyway, which the simulator does not count (its saves have no
    autograd history: ``PackRecord.activation``)."""
    torch.manual_seed(0)
    model, x = _UnregisteredWeight(), torch.randn(64, 16)
    ref = copy.deepcopy(model)
    ref(x).sum().backward()
    plan = _hook_one(model, x)
    model.a.full.grad = None
    sources = _watch_copies(monkeypatch)
    with libra.apply(model, plan):
        model(x).sum().backward()
    full = model.a.full.untyped_storage()
    assert sources and all(s() is not full for s in sources)  # the ReLU's output went, the weight stayed
    assert_grads_equal(ref, model)
    assert torch.equal(ref.a.full.grad, model.a.full.grad)


class _PairCall(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(16, 1024)
        self.out = torch.nn.Linear(1024, 16)

    def forward(self, h, *, scales):
        a, b = scales
        return self.out(torch.relu(self.fc(h)) * a + b)


class _SavesATupleArgument(_SavesAnArgument):
    """``a`` gets two tensors in one tuple argument, as Hugging Face layers get ``position_embeddings=(cos, sin)``,
    and saves one of them."""

    def __init__(self) -> None:
        super().__init__(_PairCall())

    def forward(self, x):
        scales = ((x.repeat(1, 64) > 0).to(x.dtype), x.repeat(1, 64))
        return self.post(self.a(self.pre(x), scales=scales))


def test_hooked_call_keeps_the_tensors_of_a_tuple_argument_on_the_device(monkeypatch):
    """``HookRun`` takes every tensor a call is handed as its input (``call_tensors``), also those inside a tuple: it
    copied them to host memory as if the call made them, and their copies, brought back, outlived what the
    simulator counts (Phi with offload at its minimum, ``position_embeddings=(cos, sin)``: 13,360 B over)."""
    torch.manual_seed(0)
    x = torch.randn(64, 16)
    measured, predicted, copies, _ = _hooked_steps(_SavesATupleArgument(), x, monkeypatch)
    assert copies == [3, 3]  # a's input, the ReLU's output and the product: not the saved scale
    assert abs(measured - predicted) < x.numel() * 64 * x.element_size() // 4, (measured, predicted)
