"""Fake profiles: the step runs on fake tensors, so profiling needs none of eager's memory (NOTE [Fake profiles]).

NOTE [Fake profiles]: under ``torch._subclasses.fake_tensor.FakeTensorMode`` every op computes only the metadata of
its outputs (shape, stride, dtype, aliasing) and allocates nothing, yet saved-tensor hooks, module calls and
``weakref.finalize`` on storages happen as on real tensors, so the recorder sees the same ops, storages, packs and
frees as in a real step: what the planner needs for memory. What fake execution cannot give is time and the
kernels' own temporaries; :func:`benchmark_ops` measures both per distinct op signature, on real tensors of the
recorded shapes, one op at a time (the largest op's inputs and outputs are the memory it needs). The model's
parameters, buffers and gradients are swapped for fake ones while the step runs (tied weights stay tied) and put
back afterwards; the step's other tensors (inputs, optimizer state) stay real and are converted by the mode as ops
use them, which the recorder sees as the real tensors they come from, so they count as static like in a real
profile. The RNG is not advanced: fake random ops draw nothing.

A model built on ``meta`` (``with torch.device("meta"): model = ...``: no memory for its weights) profiles fake on
the device it will train on, named by ``fake="cuda:0"`` or ``fake="cpu"``: its parameters and buffers become fakes
of their layout on that device.

NOTE [Estimated op times]: ``timing="estimate"`` runs nothing at the recorded shapes. Each op costs a tiny op's
time plus the larger of its floating-point operations (``torch.utils.flop_counter``, where it knows the op) at the
device's measured matmul rate and the bytes it reads and writes at the device's measured copy rate: a roofline that
ranks plans by what the replays cost, without the memory or the minutes that timing a step too big for the device
would take. It knows no kernel's temporaries (they count as 0), so a budget planned from it holds only as far as
the kernels' workspaces fit in the planner's 1% margin; ``timing="benchmark"`` (the default) measures both.

Limits: an op whose output depends on values (``.item()``, ``nonzero``, a branch on a tensor, MoE routing) or a
custom op without a fake kernel cannot run fake; the profile raises :class:`LibraError` naming it.
"""

from __future__ import annotations

import logging
import time

import torch
from torch.utils._pytree import tree_map

from libra._allocator import MARKER, TAP, per_marker_extra
from libra.errors import LibraError

__all__ = ["FakeStep", "OpCall", "benchmark_ops", "estimate_ops", "device_rates", "signature", "specs"]

log = logging.getLogger("libra")


class FakeStep:
    """Swaps a model's parameters, buffers and gradients for fake ones inside a fake mode, and back."""

    def __init__(self, model: torch.nn.Module, device: torch.device, timing: str = "benchmark") -> None:
        from torch._subclasses.fake_tensor import FakeTensorMode

        if device.type == "cuda" and not torch.cuda.is_available():
            raise LibraError(
                f"libra.profile: expected a CUDA device for fake={str(device)!r}, but this PyTorch has none. "
                "Fix: profile fake on the device the model will train on (fake=True on its own device)."
            )
        self.model = model
        self.device = device
        self.timing = timing  # how op times are found afterwards (NOTE [Estimated op times])
        self.mode = FakeTensorMode(allow_non_fake_inputs=True)
        self._swapped: list[tuple[dict, str, torch.Tensor]] = []
        self.originals: list[torch.Tensor] = []

    def __enter__(self) -> "FakeStep":
        fakes: dict[int, torch.Tensor] = {}  # id of a real tensor -> its fake (tied weights stay one tensor)
        try:
            for module in self.model.modules():
                for table in (module._parameters, module._buffers):
                    for name, t in list(table.items()):
                        if t is None:
                            continue
                        fake = fakes.get(id(t))
                        if fake is None:
                            fake = self._fake_of(t)
                            fakes[id(t)] = fake
                        self._swapped.append((table, name, t))
                        self.originals.append(t)
                        if isinstance(t, torch.nn.Parameter) and t.grad is not None:
                            self.originals.append(t.grad)
                        table[name] = fake
        except BaseException:
            self._restore()
            raise
        self.mode.__enter__()
        return self

    def _fake_of(self, t: torch.Tensor) -> torch.Tensor:
        fake = self._fake_tensor(t.detach())
        if isinstance(t, torch.nn.Parameter):
            fake = torch.nn.Parameter(fake, requires_grad=t.requires_grad)
            if t.grad is not None:
                fake.grad = self._fake_tensor(t.grad)
        return fake

    def _fake_tensor(self, t: torch.Tensor) -> torch.Tensor:
        """A fake of ``t`` on the profiled device: of ``t`` itself where it lives there, else (a model built on
        ``meta``, NOTE [Fake profiles]) a fresh fake of its layout, whose values nothing reads."""
        if t.device == self.device:
            return self.mode.from_tensor(t)
        with self.mode:
            return torch.empty_strided(tuple(t.shape), tuple(t.stride()), dtype=t.dtype, device=self.device)

    def _restore(self) -> None:
        for table, name, t in reversed(self._swapped):
            table[name] = t
        self._swapped.clear()

    def __exit__(self, *exc) -> bool:
        try:
            self.mode.__exit__(*exc)
        finally:
            self._restore()
        return False


class OpCall:
    """What it takes to run one recorded op again on real tensors: the op and its arguments, tensors described by
    shape, stride, dtype and device; and what :func:`estimate_ops` needs: its floating-point operations (where
    ``torch.utils.flop_counter`` knows the op) and the bytes it reads and writes."""

    __slots__ = ("func", "args", "kwargs", "key", "flops", "nbytes")

    def __init__(self, func, args, kwargs, out=None) -> None:
        """``out``: the op's outputs, given only when op times will be estimated (else flops and bytes stay 0)."""
        self.func = func
        self.args, self.kwargs = specs(args, kwargs)
        self.key = signature(func, self.args, self.kwargs)
        self.flops = self.nbytes = 0
        if out is not None:
            self.flops = _flops(func, args, kwargs, out)
            self.nbytes = sum(t.numel() * t.element_size() for t in _leaves((args, kwargs, out)))


def _leaves(tree) -> list[torch.Tensor]:
    from torch.utils._pytree import tree_leaves

    return [t for t in tree_leaves(tree) if isinstance(t, torch.Tensor)]


def _flops(func, args, kwargs, out) -> int:
    from torch.utils.flop_counter import flop_registry

    count = flop_registry.get(getattr(func, "overloadpacket", None))
    if count is None:
        return 0
    try:
        return int(count(*args, out_val=out, **kwargs))
    except Exception:  # noqa: BLE001 - an op the counter cannot read is estimated by its bytes alone
        return 0


class _TensorSpec:
    __slots__ = ("shape", "stride", "dtype", "device")

    def __init__(self, t: torch.Tensor) -> None:
        self.shape, self.stride, self.dtype, self.device = tuple(t.shape), tuple(t.stride()), t.dtype, t.device

    def __repr__(self) -> str:
        return f"T({self.shape},{self.stride},{self.dtype},{self.device})"

    def make(self, device: torch.device) -> torch.Tensor:
        t = torch.empty_strided(self.shape, self.stride, dtype=self.dtype, device=device)
        if t.is_floating_point() or t.is_complex():
            t.normal_()
        else:
            t.zero_()  # indices 0 are valid for every gather, embedding and loss target
        return t


def _spec(v):
    if isinstance(v, torch.Tensor):
        return _TensorSpec(v)
    if isinstance(v, torch.Generator):
        return None
    return v


def signature(func, args: tuple, kwargs: dict) -> tuple:
    """The key of an op call whose arguments went through ``_spec``: the op, each tensor's layout, every other
    argument as it is. Calls with one key run the same kernel on the same shapes."""
    return (str(func), repr(args), repr(sorted(kwargs.items())))


def specs(args, kwargs) -> tuple[tuple, dict]:
    """``args`` and ``kwargs`` with each tensor replaced by its layout (what ``signature`` keys on)."""
    return tree_map(_spec, tuple(args)), tree_map(_spec, dict(kwargs))


def _make(v, device):
    return v.make(device) if isinstance(v, _TensorSpec) else v


def benchmark_ops(calls: list[OpCall], device: torch.device, repeats: int = 2) -> tuple[list[float], list[int]]:
    """See :func:`_benchmark`; the RNG is left as it was (inputs and random ops draw from it)."""
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices, device_type=device.type if devices else "cuda"):
        return _benchmark(calls, device, repeats)


_RATES: dict[str, tuple[float, float, float]] = {}


def device_rates(device: torch.device) -> tuple[float, float, float]:
    """(floating-point operations per second of a matmul, bytes per second of a copy, seconds of a tiny op) on
    ``device``, measured once per device in a few milliseconds (NOTE [Estimated op times])."""
    key = str(device)
    if key not in _RATES:
        cuda = device.type == "cuda"
        sync = (lambda: torch.cuda.synchronize(device)) if cuda else (lambda: None)

        def best(fn, repeats=5) -> float:
            fn()
            sync()
            out = float("inf")
            for _ in range(repeats):
                t0 = time.perf_counter()
                fn()
                sync()
                out = min(out, time.perf_counter() - t0)
            return max(out, 1e-9)

        n = 512
        a, b = torch.randn(n, n, device=device), torch.randn(n, n, device=device)
        flop_rate = 2 * n**3 / best(lambda: a @ b)
        big = torch.empty(4 * 2**20, device=device)  # 16 MiB: read and written once
        byte_rate = 2 * big.numel() * 4 / best(lambda: big.clone())
        tiny = torch.zeros(8, device=device)
        launch = best(lambda: torch.add(tiny, tiny), repeats=50)
        _RATES[key] = (flop_rate, byte_rate, launch)
    return _RATES[key]


def estimate_ops(calls: list[OpCall], device: torch.device) -> list[float]:
    """Seconds of every call from ``device``'s rates, running nothing at the recorded shapes (NOTE [Estimated op
    times])."""
    flop_rate, byte_rate, launch = device_rates(device)
    return [launch + max(c.flops / flop_rate, c.nbytes / byte_rate) for c in calls]


def _benchmark(calls: list[OpCall], device: torch.device, repeats: int) -> tuple[list[float], list[int]]:
    """Seconds and transient bytes of every call (NOTE [Fake profiles]), each distinct signature run alone on
    ``device`` with fresh inputs of the recorded layout: the fastest of ``repeats`` timed runs after a warm-up, and
    the most the allocator held inside the op above what it held when the op returned (one more run, watched by
    the allocator). A call that cannot run on made-up values (an in-place write through a broadcast view, an op
    whose values must agree with each other) gets the median time of the others and no transient bytes."""
    distinct: dict[tuple, OpCall] = {}
    for call in calls:
        distinct.setdefault(call.key, call)
    seconds: dict[tuple, float] = {}
    failed: list[str] = []
    cuda = device.type == "cuda"
    for key, call in distinct.items():
        try:
            args, kwargs = _inputs(call, device)
            with torch.no_grad():
                call.func(*args, **kwargs)  # warm-up: first-call costs, oneDNN primitive caches
                best = float("inf")
                for _ in range(repeats):
                    if cuda:
                        torch.cuda.synchronize(device)
                    t0 = time.perf_counter()
                    out = call.func(*args, **kwargs)
                    if cuda:
                        torch.cuda.synchronize(device)
                    best = min(best, time.perf_counter() - t0)
                    del out
            seconds[key] = best
        except Exception as e:  # noqa: BLE001 - a failure only costs this op its measurement
            failed.append(f"{call.func}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
    transient = _transients([c for k, c in distinct.items() if k in seconds], device)
    times = sorted(seconds.values())
    fallback = times[len(times) // 2] if times else 1e-5
    if failed:
        log.debug("libra.profile: %d op signatures could not run on made-up inputs; they get the median time: %s",
                  len(failed), "; ".join(failed[:5]))
    return ([seconds.get(c.key, fallback) for c in calls], [transient.get(c.key, 0) for c in calls])


def _inputs(call: OpCall, device: torch.device):
    return tree_map(lambda v: _make(v, device), call.args), tree_map(lambda v: _make(v, device), call.kwargs)


def _transients(calls: list[OpCall], device: torch.device) -> dict[tuple, int]:
    """Per call key: the most the allocator held inside one run above what it held when the op returned."""
    out: dict[tuple, int] = {}
    if device.type == "cuda":
        for call in calls:
            args, kwargs = _inputs(call, device)
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            with torch.no_grad():
                result = call.func(*args, **kwargs)
            torch.cuda.synchronize(device)
            out[call.key] = max(int(torch.cuda.max_memory_allocated(device) - torch.cuda.memory_allocated(device)), 0)
            del result
        return out
    if device.type != "cpu":
        return out
    att = TAP.attach()
    if att is None:
        return out
    ran = []
    try:
        for call in calls:
            args, kwargs = _inputs(call, device)
            with torch.no_grad(), torch._C._profiler._RecordFunctionFast(MARKER):
                result = call.func(*args, **kwargs)
            del result, args, kwargs
            ran.append(call.key)
    finally:
        TAP.detach(att)
    out.update(zip(ran, per_marker_extra(att.memory, att.markers)))
    return out
