"""Small models with the awkward constructs of the reliability issue, built from code and seeded.

Every model is a stack of identical blocks between an input layer and a head, so that whatever the planner recomputes
lies inside an awkward block. Sizes are tiny but the batch is large enough that activations dominate memory.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

D_IN, D, HIDDEN, CLASSES, BATCH = 32, 64, 256, 10, 512


class Stack(nn.Module):
    """``inp -> blocks -> head``; the blocks take and return one tensor unless a subclass says otherwise."""

    def __init__(self, block, depth: int = 4, d_in: int = D_IN, d: int = D, classes: int = CLASSES) -> None:
        super().__init__()
        self.inp = nn.Linear(d_in, d)
        self.blocks = nn.ModuleList(block(d) for _ in range(depth))
        self.head = nn.Linear(d, classes)

    def forward(self, x):
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


# ---- in-place ops -------------------------------------------------------------------------------------------------
class InplaceReLUBlock(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d, HIDDEN)
        self.relu = nn.ReLU(inplace=True)
        self.fc2 = nn.Linear(HIDDEN, d)

    def forward(self, x):
        return x + self.fc2(self.relu(self.fc1(x)))


class InplaceReLUGeluBlock(nn.Module):
    """An in-place ReLU on a saved activation next to ordinary saved activations (LayerNorm, GELU)."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, HIDDEN)
        self.relu = nn.ReLU(inplace=True)
        self.fc2 = nn.Linear(HIDDEN, HIDDEN)
        self.fc3 = nn.Linear(HIDDEN, d)

    def forward(self, x):
        h = self.relu(self.fc1(self.ln(x)))
        return x + self.fc3(F.gelu(self.fc2(h)))


class InplaceAddBlock(nn.Module):
    """``h += g`` and ``h *= s`` on tensors made inside the block, before and after they are saved by others."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d, HIDDEN)
        self.gate = nn.Linear(d, HIDDEN)
        self.fc2 = nn.Linear(HIDDEN, d)

    def forward(self, x):
        h = self.fc1(x)
        h += self.gate(x)
        s = torch.sigmoid(h)  # saves its output s, not h
        h *= s  # h is not saved by anyone yet: allowed in eager
        h = torch.tanh(h)
        out = self.fc2(h)
        out += x
        return out


class MaskedFillBlock(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d, HIDDEN)
        self.fc2 = nn.Linear(HIDDEN, d)

    def forward(self, x):
        h = self.fc1(x)
        h.masked_fill_(h < -0.2, 0.0)
        h = F.gelu(h)
        h.masked_fill_(h > 0.8, 0.8)
        return x + self.fc2(h)


class MutatesInputBlock(nn.Module):
    """Scales its own input in place: recomputing it would see the changed input, so the planner must refuse it."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d, HIDDEN)
        self.fc2 = nn.Linear(HIDDEN, d)

    def forward(self, x):
        x.mul_(0.5)
        return x + self.fc2(F.gelu(self.fc1(x)))


class AlternatingStack(Stack):
    """Clean blocks at even positions, input-mutating ones at odd positions."""

    def __init__(self) -> None:
        super().__init__(lambda d: None, depth=0)
        self.blocks = nn.ModuleList(
            [MLPBlock(D), MutatesInputBlock(D), MLPBlock(D), MutatesInputBlock(D)]
        )


# ---- views --------------------------------------------------------------------------------------------------------
class ViewChainBlock(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d, HIDDEN)
        self.fc2 = nn.Linear(HIDDEN // 2, d)

    def forward(self, x):
        b = x.shape[0]
        h = self.fc1(x)
        left, right = h.chunk(2, dim=-1)  # two views of one storage
        left = left.view(b, -1, 8).transpose(1, 2).reshape(b, -1)  # non-contiguous view, then a copy
        right = right[:, ::2].unsqueeze(1).expand(-1, 2, -1).reshape(b, -1)  # strided slice, broadcast view, copy
        y = torch.sigmoid(left) * F.gelu(right)
        y = y.t().contiguous().t()  # a transposed copy seen through a transposed view
        return x + self.fc2(y[:, :].narrow(1, 0, HIDDEN // 2))


class CatViewsBlock(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d, HIDDEN)
        self.fc2 = nn.Linear(HIDDEN + 64, d)

    def forward(self, x):
        h = torch.tanh(self.fc1(x))
        y = torch.cat([h[:, ::2], h[:, 1::2], h[:, :32].flip(1), h.t()[HIDDEN - 32 :].t()], dim=1)
        return x + self.fc2(F.relu(y))


# ---- attention ----------------------------------------------------------------------------------------------------
VOCAB, SEQ, TOK_BATCH, HEADS = 128, 32, 24, 4


class ExplicitAttentionBlock(nn.Module):
    def __init__(self, d: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.drop = nn.Dropout(dropout)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)
        self.register_buffer("mask", torch.tril(torch.ones(SEQ, SEQ, dtype=torch.bool)))

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, HEADS, d // HEADS).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(d // HEADS))
        att = att.masked_fill(~self.mask[:t, :t], float("-inf"))
        att = self.drop(F.softmax(att, dim=-1))
        y = (att @ v).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(y)
        return x + self.fc2(F.gelu(self.fc(self.ln2(x))))


class SDPABlock(nn.Module):
    def __init__(self, d: int, dropout: float = 0.1) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.dropout = dropout
        self.fc = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, HEADS, d // HEADS).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc(x)))


class TokenModel(nn.Module):
    """Token and position embeddings, attention blocks, a head tied to the token embedding."""

    def __init__(self, block, depth: int = 6, d: int = D, tied: bool = True) -> None:
        super().__init__()
        self.wte = nn.Embedding(VOCAB, d)
        self.wpe = nn.Embedding(SEQ, d)
        self.blocks = nn.ModuleList(block(d) for _ in range(depth))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, VOCAB, bias=False)
        if tied:
            self.head.weight = self.wte.weight

    def forward(self, idx):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


# ---- weight tying and a shared block ------------------------------------------------------------------------------
class MLPBlock(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d, HIDDEN)
        self.fc2 = nn.Linear(HIDDEN, d)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(x)))


class TiedStack(Stack):
    """Block 3's fc1 shares block 1's weight; block 0 runs twice (as blocks.0 and again at the end)."""

    def __init__(self) -> None:
        super().__init__(MLPBlock, depth=4)
        self.blocks[3].fc1.weight = self.blocks[1].fc1.weight
        self.blocks.append(self.blocks[0])


# ---- several outputs, keyword arguments, non-tensor outputs -------------------------------------------------------
class TupleBlock(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d, HIDDEN)
        self.fc2 = nn.Linear(HIDDEN, d)
        self.aux = nn.Linear(HIDDEN, d)

    def forward(self, x, carry):
        h = F.gelu(self.fc1(x + carry))
        return x + self.fc2(h), carry + torch.tanh(self.aux(h))


class DictBlock(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d, HIDDEN)
        self.fc2 = nn.Linear(HIDDEN, d)
        self.gate = nn.Linear(HIDDEN, d)

    def forward(self, x):
        h = F.silu(self.fc1(x))
        return {"out": x + self.fc2(h), "gate": torch.sigmoid(self.gate(h)), "hidden_norm": h.norm(dim=1)}


class MultiOutputModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(D_IN, D)
        self.tuples = nn.ModuleList(TupleBlock(D) for _ in range(2))
        self.dicts = nn.ModuleList(DictBlock(D) for _ in range(2))
        self.head = nn.Linear(D, CLASSES)

    def forward(self, x):
        h = self.inp(x)
        carry = torch.zeros_like(h)
        for block in self.tuples:
            h, carry = block(h, carry)
        norms = 0.0
        for block in self.dicts:
            out = block(h)
            h = out["out"] * out["gate"]
            norms = norms + out["hidden_norm"].mean()
        return self.head(h + carry) + 1e-3 * norms


class KwargsBlock(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d, HIDDEN)
        self.fc2 = nn.Linear(HIDDEN, d)

    def forward(self, x, *, scale: float = 1.0, mask=None, bias=None):
        h = F.gelu(self.fc1(x))
        if mask is not None:
            h = h * mask
        if bias is not None:
            h = h + bias
        return x + scale * self.fc2(h)


class KwargsModel(Stack):
    def __init__(self) -> None:
        super().__init__(KwargsBlock, depth=4)
        self.bias = nn.Parameter(torch.zeros(HIDDEN))

    def forward(self, x):
        h = self.inp(x)
        mask = (x[:, :1] > -1.0).to(h.dtype)  # a tensor keyword argument computed from the input
        for i, block in enumerate(self.blocks):
            h = block(h, scale=0.5 + 0.1 * i, mask=mask, bias=self.bias if i % 2 else None)
        return self.head(h)


class UnreadArgumentModel(Stack):
    """Each block is handed a tensor it never reads (as Hugging Face decoder layers are handed ``position_ids`` and
    ``cache_position``): eager frees it when the forward returns, a checkpointed block holds it until its backward."""

    def __init__(self) -> None:
        super().__init__(UnreadArgumentBlock, depth=4)

    def forward(self, x):
        h = self.inp(x)
        positions = torch.arange(64 * HIDDEN, device=x.device)  # 64 rows' worth of int64s
        for block in self.blocks:
            h = block(h, positions=positions)
        return self.head(h)


class UnreadArgumentBlock(KwargsBlock):
    def forward(self, x, *, positions=None):
        return super().forward(x)


class NonTensorOutputBlock(nn.Module):
    """Returns (tensor, int): the int counts active units (a data-dependent ``.item()``)."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d, HIDDEN)
        self.fc2 = nn.Linear(HIDDEN, d)

    def forward(self, x):
        h = F.relu(self.fc1(x))
        active = int((h > 0).sum().item())
        return x + self.fc2(h), active


class NonTensorOutputModel(Stack):
    def __init__(self) -> None:
        super().__init__(NonTensorOutputBlock, depth=4)
        self.active: list[int] = []

    def forward(self, x):
        h = self.inp(x)
        self.active = []
        for block in self.blocks:
            h, n = block(h)
            self.active.append(n)
        return self.head(h)


# ---- indexing ops -------------------------------------------------------------------------------------------------
class WhereGatherScatterBlock(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d, HIDDEN)
        self.fc2 = nn.Linear(HIDDEN, d)
        self.register_buffer("perm", torch.randperm(HIDDEN))

    def forward(self, x):
        h = self.fc1(x)
        h = torch.where(h > 0, h, 0.1 * h)
        top, idx = h.topk(HIDDEN // 4, dim=1)
        g = torch.gather(h, 1, self.perm.expand(h.shape[0], -1))
        s = torch.zeros_like(h).scatter(1, idx, torch.tanh(top))
        s = s.scatter_add(1, self.perm[: HIDDEN // 2].expand(h.shape[0], -1), g[:, : HIDDEN // 2])
        return x + self.fc2(s * g)


# ---- a custom autograd.Function -----------------------------------------------------------------------------------
class SquarePlus(torch.autograd.Function):
    """y = x * x + x, saving its input through ctx.save_for_backward."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * x + x

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return grad * (2 * x + 1)


class ClampedExp(torch.autograd.Function):
    """y = exp(min(x, 3)), saving its output and a non-tensor on ctx."""

    @staticmethod
    def forward(ctx, x, limit: float):
        y = torch.exp(x.clamp(max=limit))
        ctx.save_for_backward(y, x)
        ctx.limit = limit
        return y

    @staticmethod
    def backward(ctx, grad):
        y, x = ctx.saved_tensors
        return grad * y * (x < ctx.limit), None


class CustomFunctionBlock(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d, HIDDEN)
        self.fc2 = nn.Linear(HIDDEN, d)

    def forward(self, x):
        h = SquarePlus.apply(self.fc1(x) * 0.1)
        h = ClampedExp.apply(h, 3.0)
        return x + self.fc2(h) * 0.1


# ---- BatchNorm, dropout -------------------------------------------------------------------------------------------
class BatchNormBlock(nn.Module):
    def __init__(self, d: int, momentum: float | None = 0.1) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d, HIDDEN)
        self.bn1 = nn.BatchNorm1d(HIDDEN, momentum=momentum)
        self.fc2 = nn.Linear(HIDDEN, d)
        self.bn2 = nn.BatchNorm1d(d)

    def forward(self, x):
        return x + self.bn2(self.fc2(F.relu(self.bn1(self.fc1(x)))))


class BatchNormStack(Stack):
    def __init__(self) -> None:
        super().__init__(BatchNormBlock, depth=4)
        self.blocks[1].bn1.momentum = None  # cumulative average: reads num_batches_tracked


class DropoutBlock(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d, HIDDEN)
        self.drop1 = nn.Dropout(0.1)
        self.drop2 = nn.Dropout(0.3, inplace=True)
        self.fc2 = nn.Linear(HIDDEN, d)

    def forward(self, x):
        h = self.drop1(F.gelu(self.fc1(F.dropout(x, 0.2, self.training))))
        h = self.drop2(h * 2.0)
        return x + F.dropout(self.fc2(h), 0.5, self.training)


class DropoutStack(Stack):
    def __init__(self) -> None:
        super().__init__(DropoutBlock, depth=4)
        self.drop = nn.Dropout(0.1)

    def forward(self, x):
        h = self.drop(self.inp(x))
        for block in self.blocks:
            h = block(h)
        return self.head(self.drop(h))


class NormDropBlock(nn.Module):
    """LayerNorm + GELU MLP with dropout: the bfloat16 autocast case."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, HIDDEN)
        self.fc2 = nn.Linear(HIDDEN, d)
        self.drop = nn.Dropout(0.1)

    def forward(self, x):
        return x + self.drop(self.fc2(F.gelu(self.fc1(self.ln(x)))))


class SharedAutocastStack(Stack):
    """Block 0 runs twice in one forward: under autocast its weights' bf16 copies are cached after the first call."""

    def __init__(self) -> None:
        super().__init__(NormDropBlock, depth=3)
        self.blocks.append(self.blocks[0])


# ---- frozen parts -------------------------------------------------------------------------------------------------
class FrozenStack(Stack):
    """The input layer and block 0 are frozen (no gradient reaches them at all); block 2 is frozen in the middle."""

    def __init__(self) -> None:
        super().__init__(MLPBlock, depth=4)
        self.inp.requires_grad_(False)
        self.blocks[0].requires_grad_(False)
        self.blocks[2].requires_grad_(False)


# ---- control flow that changes after profiling ---------------------------------------------------------------------
class FlagBlock(nn.Module):
    """Runs an extra op in the middle when ``extra`` is set, and skips its last op when ``short`` is set."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d, HIDDEN)
        self.fc2 = nn.Linear(HIDDEN, d)
        self.extra = False
        self.short = False

    def forward(self, x):
        h = F.gelu(self.fc1(x))
        if self.extra:
            h = h * 1.5
        h = torch.tanh(self.fc2(h))
        if self.short:
            return h
        return x + torch.sigmoid(h)


class FlagNormBlock(nn.Module):
    """Runs an extra op before its BatchNorm when ``extra`` is set: the norm, which updates its running statistics
    without its schema saying so, runs after the call has left the profiled op sequence."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d, HIDDEN)
        self.norm = nn.BatchNorm1d(HIDDEN)
        self.fc2 = nn.Linear(HIDDEN, d)
        self.extra = False

    def forward(self, x):
        h = F.gelu(self.fc1(x))
        if self.extra:
            h = h * 1.5
        return x + self.fc2(torch.tanh(self.norm(h)))


class DataDependentBlock(nn.Module):
    """Its op sequence depends on the values it gets: a branch on the input's mean and a loop whose trip count is
    read from the data (``.item()``), so steps with other batches dispatch other ops than the profiled one."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d, HIDDEN)
        self.fc2 = nn.Linear(HIDDEN, d)

    def forward(self, x):
        h = F.gelu(self.fc1(x))
        if h.mean() > 0.2:
            h = h * torch.sigmoid(h)
        for _ in range(int(x.abs().mean().item() * 7) % 3):
            h = torch.tanh(h) + h
        return x + self.fc2(h)


# ---- the user's own checkpoint and save_on_cpu ---------------------------------------------------------------------
class UserCheckpointBlock(nn.Module):
    def __init__(self, d: int, use_reentrant: bool = False) -> None:
        super().__init__()
        self.inner = MLPBlock(d)
        self.fc3 = nn.Linear(d, HIDDEN)
        self.fc4 = nn.Linear(HIDDEN, d)
        self.use_reentrant = use_reentrant

    def forward(self, x):
        h = checkpoint(self.inner, x, use_reentrant=self.use_reentrant)
        return h + self.fc4(F.gelu(self.fc3(h)))


class SaveOnCpuBlock(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d, HIDDEN)
        self.fc2 = nn.Linear(HIDDEN, d)
        self.fc3 = nn.Linear(d, HIDDEN)
        self.fc4 = nn.Linear(HIDDEN, d)

    def forward(self, x):
        with torch.autograd.graph.save_on_cpu():
            h = x + self.fc2(F.gelu(self.fc1(x)))
        return h + self.fc4(F.gelu(self.fc3(h)))


class EscapeBlock(nn.Module):
    """Returns an intermediate ``h`` as well as its output; the replay needs ``h`` to recompute ``exp(h + 1)``."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d, HIDDEN)
        self.fc2 = nn.Linear(HIDDEN, d)

    def forward(self, x):
        h = self.fc1(x)
        e = torch.exp((h + 1.0) * 0.1)
        return h, x + self.fc2(e)


class MutatedEscapeModel(Stack):
    """Each block's escaping intermediate is changed in place after the block returned (legal in eager: nothing
    autograd saved aliases it)."""

    def __init__(self) -> None:
        super().__init__(EscapeBlock, depth=4)
        self.side = nn.Linear(HIDDEN, D)

    def forward(self, x):
        h = self.inp(x)
        side = 0.0
        for block in self.blocks:
            inner, h = block(h)
            inner.mul_(0.5)
            side = side + self.side(inner)
        return self.head(h + side)


class RoutedBlock(nn.Module):
    """A MoE-like block: the rows whose gate is positive go through ``expert``, so the expert's input shape depends
    on the data and changes from batch to batch (NOTE [Unplanned shapes] in runtime/apply.py). Like Mixtral's router
    jitter it scales its own input in place first, so the block is refused and its parts are planned instead."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.gate = nn.Linear(d, 1)
        self.expert = nn.Sequential(nn.Linear(d, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, d))

    def forward(self, x):
        x.mul_(torch.empty_like(x).uniform_(0.99, 1.01))
        chosen = (self.gate(x) > 0).squeeze(-1)
        out = x.clone()
        out[chosen] = out[chosen] + self.expert(x[chosen])
        return out


class NormedMLP(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, HIDDEN)
        self.fc2 = nn.Linear(HIDDEN, d)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))) * 0.5)


class PairBlock(nn.Module):
    """Two blocks in one: the planner checkpoints its parts, not the pair (as a Whisper decoder layer's attention
    and MLP parts)."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.a = NormedMLP(d)
        self.b = NormedMLP(d)

    def forward(self, x):
        return self.b(self.a(x))


class LayerDropStack(Stack):
    """A stack whose forward skips the block ``self.skip`` (None: none), as layer drop or stochastic depth does:
    the test sets it before each step."""

    skip: int | None = None

    def forward(self, x):
        h = self.inp(x)
        for i, block in enumerate(self.blocks):
            if i != self.skip:
                h = block(h)
        return self.head(h)


class DenseLayer(nn.Module):
    """A DenseNet-style layer: handed the list of the block's features so far, which its caller appends to after
    the call (torchvision's ``_DenseBlock``). It sums them, so a replay that read the list as it is later would get
    a same-shaped wrong value, not an error."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)

    def forward(self, features: list):
        return F.gelu(self.fc(torch.stack(features).sum(0)))


class DenseStack(Stack):
    def __init__(self, depth: int = 4) -> None:
        super().__init__(DenseLayer, depth=depth)

    def forward(self, x):
        features = [self.inp(x)]
        for block in self.blocks:
            features.append(block(features))
        return self.head(features[-1])
