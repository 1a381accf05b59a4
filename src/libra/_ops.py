"""Facts about aten ops read from their schemas, cached per op overload. Shared by the profiler and the runtime."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves

__all__ = ["OpInfo", "op_info", "STATEFUL_OPS", "arg_values", "tensors_in", "storage_key", "plain_tensors",
           "input_signature", "kv_cache_args", "model_signature", "UNCOUNTED", "call_tensors"]

# NOTE [Uncounted ops]: checkpoint's own saved-tensor hook detaches every tensor it saves during a replay, so the
# replay dispatches detach ops the forward never did. detach allocates nothing and is never worth saving: the
# profiler and both region modes run it without counting it, so op indices agree between forward and replay. Under
# fake tensors every device query dispatches as prim.device (NOTE [Fake profiles]): never counted either.
UNCOUNTED = frozenset({torch.ops.aten.detach.default, torch.ops.prim.device.default})


@dataclass(frozen=True)
class OpInfo:
    name: str  # "aten.mm.default"
    write_args: tuple[str, ...]  # arguments the schema declares as written (in-place and out=)
    fresh_returns: tuple[bool, ...]  # per return: True when it does not alias an input
    random: bool  # draws from a generator (torch.Tag.nondeterministic_seeded)
    collective: bool
    python_value: bool  # returns something other than tensors (a number, a bool): Python may read it


# ops that update module state (BatchNorm's running statistics) without their schema saying so
STATEFUL_OPS: dict[str, tuple[str, ...]] = {
    name: ("running_mean", "running_var")
    for name in ("aten.native_batch_norm.default", "aten._native_batch_norm_legit.default",
                 "aten.cudnn_batch_norm.default", "aten.miopen_batch_norm.default",
                 "aten._batch_norm_with_update.default", "aten.batch_norm_update_stats.default")
}

_CACHE: dict[object, OpInfo] = {}
_COLLECTIVE_NAMESPACES = ("c10d", "_c10d_functional", "c10d_functional", "_dtensor")


def op_info(func) -> OpInfo:
    """Returns the cached :class:`OpInfo` of an ``OpOverload``."""
    info = _CACHE.get(func)
    if info is None:
        schema = func._schema
        name = str(func)
        info = OpInfo(
            name=name,
            write_args=tuple(a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write),
            fresh_returns=tuple(r.alias_info is None for r in schema.returns),
            random=torch.Tag.nondeterministic_seeded in func.tags,
            collective=name.split(".", 1)[0] in _COLLECTIVE_NAMESPACES,
            python_value=not all(_is_tensor_type(r.type) for r in schema.returns),
        )
        _CACHE[func] = info
    return info


def _is_tensor_type(t) -> bool:
    if isinstance(t, torch._C.TensorType):
        return True
    if isinstance(t, (torch._C.ListType, torch._C.OptionalType)):
        return _is_tensor_type(t.getElementType())
    return False


def arg_values(func, args, kwargs):
    """Yields ``(argument name, value)`` for every argument of an op call, positional or keyword."""
    for i, arg in enumerate(func._schema.arguments):
        if i < len(args):
            yield arg.name, args[i]
        elif arg.name in kwargs:
            yield arg.name, kwargs[arg.name]


def tensors_in(value):
    """The tensors in an argument value: a tensor, or a list/tuple of (optional) tensors."""
    if isinstance(value, torch.Tensor):
        return (value,)
    if isinstance(value, (list, tuple)):
        return tuple(v for v in value if isinstance(v, torch.Tensor))
    return ()


def call_tensors(args, kwargs) -> list[torch.Tensor]:
    """Every tensor a call is handed, however deep in its arguments' tuples, lists and dicts (Hugging Face layers get
    ``position_embeddings=(cos, sin)``): what checkpoint holds of a checkpointed call, and what a hooked call leaves
    on the device as its inputs."""
    return [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]


def storage_key(t: torch.Tensor) -> int | None:
    """Identity of a tensor's storage while it is alive (the StorageImpl address), or None for storage-less tensors.

    NOTE [Why decisions are per storage]: SDPA's q, k and v are three views of one storage, parameters arrive both as
    Parameters and as ``t()`` views, and in-place ops return their input: only the storage says what memory is shared.
    The key is the storage object's identity, never ``data_ptr`` (two storages can share an address over time, and
    views of one storage have different data pointers).
    """
    if is_traceable_wrapper_subclass(t):  # NOTE [Wrapper subclasses have no storage]
        return None
    try:
        return t.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError):
        return None


# NOTE [Wrapper subclasses have no storage]: a wrapper tensor subclass (DTensor: FSDP2's sharded parameters and their
# gradients) holds its data in inner tensors; its own ``untyped_storage()`` is a placeholder that reports the bytes
# of its local tensor's offset plus size (a 1 KiB gradient shard at offset 100 KiB of a flat buffer "has" 101 KiB)
# and holds no memory. Counting it counts memory that does not exist, once per parameter: a scan of live tensors
# counts the inner tensors instead (``plain_tensors``).
def plain_tensors(tensors) -> list[torch.Tensor]:
    """``tensors`` with every wrapper subclass replaced by its inner tensors (recursively): those that hold memory."""
    out: list[torch.Tensor] = []
    for t in tensors:
        if is_traceable_wrapper_subclass(t):
            names, _ = t.__tensor_flatten__()
            out.extend(plain_tensors(getattr(t, name) for name in names))
        elif isinstance(t, torch.Tensor):
            out.append(t)
    return out


def input_signature(args, kwargs) -> list[str]:
    """What a step's inputs look like, as readable strings: ``["0:torch.int64[4, 128]", "labels:torch.int64[4, 128]"]``.

    Every tensor among the positional arguments (by index) and keyword arguments (by name, sorted), nested in
    lists, tuples and dicts, with its dtype and shape. Plans are made for one signature (NOTE [Plans per input
    signature] in runtime/apply.py).
    """
    from torch.utils._pytree import tree_flatten_with_path, keystr

    out = []
    for where, value in [(str(i), a) for i, a in enumerate(args)] + [(k, kwargs[k]) for k in sorted(kwargs)]:
        leaves, _ = tree_flatten_with_path(value)
        for path, leaf in leaves:
            if isinstance(leaf, torch.Tensor):
                out.append(f"{where}{keystr(path)}:{leaf.dtype}{list(leaf.shape)}")
    return out


def kv_cache_args(args, kwargs) -> list[str]:
    """Where a module call got a key/value cache: positional indices and keyword names, e.g. ``["past_key_values"]``.

    NOTE [Key/value caches are not replayable]: a Hugging Face ``Cache`` (``DynamicCache``, ``EncoderDecoderCache``,
    ...) is a Python object that an attention module's forward appends its keys and values to (``cache.update``). A
    checkpoint replay calls the forward again with the same object, which then already holds this layer's keys: the
    replay runs other ops on other shapes than the forward did. Such calls are never recomputed. Recognised by duck
    typing (``update`` and ``get_seq_length``), so Libra never imports ``transformers``; the legacy tuples of tensors
    are plain inputs and need nothing.
    """
    found = []
    for where, value in [(str(i), a) for i, a in enumerate(args)] + sorted(kwargs.items()):
        if callable(getattr(value, "update", None)) and callable(getattr(value, "get_seq_length", None)):
            found.append(where)
    return found


def model_signature(model: torch.nn.Module) -> list[tuple[str, list[int], str]]:
    """(name, shape, dtype) of every parameter and buffer: what a plan is checked against before it is applied."""
    entries = [(name, list(p.shape), str(p.dtype)) for name, p in model.named_parameters()]
    entries += [(name, list(b.shape), str(b.dtype)) for name, b in model.named_buffers()]
    return entries
