"""Small reference models built from code (no downloads), used by the tests, the demo and the benchmarks."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["MLP", "GPT", "ResNet", "UNet", "Mixer", "make_mlp", "make_gpt", "make_resnet", "make_unet", "make_mixer"]


class MLPBlock(nn.Module):
    def __init__(self, d: int, hidden: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d, hidden)
        self.fc2 = nn.Linear(hidden, d)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(x)))


class MLP(nn.Module):
    """Residual MLP: ``depth`` blocks of Linear-GELU-Linear."""

    def __init__(self, d: int = 256, hidden: int = 1024, depth: int = 6, classes: int = 10) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(MLPBlock(d, hidden) for _ in range(depth))
        self.head = nn.Linear(d, classes)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class Attention(nn.Module):
    def __init__(self, d: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.dropout = dropout
        self.resid_drop = nn.Dropout(dropout)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        return self.resid_drop(self.proj(y.transpose(1, 2).reshape(b, t, d)))


class GPTBlock(nn.Module):
    def __init__(self, d: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = Attention(d, heads, dropout)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.proj = nn.Linear(4 * d, d)
        self.drop = nn.Dropout(dropout)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.drop(self.proj(F.gelu(self.fc(self.ln2(x)))))


class GPT(nn.Module):
    """GPT-2-like decoder: token and position embeddings, pre-norm blocks with SDPA, dropout, tied head."""

    def __init__(self, vocab: int = 512, d: int = 128, layers: int = 6, heads: int = 4, seq: int = 128,
                 dropout: float = 0.1) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(seq, d)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(GPTBlock(d, heads, dropout) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.wte.weight

    def forward(self, idx):
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


class Bottleneck(nn.Module):
    def __init__(self, cin: int, width: int, stride: int = 1) -> None:
        super().__init__()
        cout = width * 4
        self.conv1 = nn.Conv2d(cin, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, cout, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.down = None
        if stride != 1 or cin != cout:
            self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride=stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        identity = x if self.down is None else self.down(x)
        out += identity
        return self.relu(out)


class ResNet(nn.Module):
    """ResNet-like CNN with bottleneck blocks, BatchNorm (train mode) and in-place ReLU."""

    def __init__(self, widths=(8, 16, 32), blocks=(3, 3, 3), classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, widths[0], 3, padding=1, bias=False), nn.BatchNorm2d(widths[0]),
                                  nn.ReLU(inplace=True))
        layers = []
        cin = widths[0]
        for i, (w, n) in enumerate(zip(widths, blocks)):
            stage = []
            for j in range(n):
                stage.append(Bottleneck(cin, w, stride=2 if (j == 0 and i > 0) else 1))
                cin = w * 4
            layers.append(nn.Sequential(*stage))
        self.layers = nn.Sequential(*layers)
        self.fc = nn.Linear(cin, classes)

    def forward(self, x):
        x = self.layers(self.stem(x))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


# ---- U-Net ----------------------------------------------------------------------------------------------------------
class DoubleConv(nn.Module):
    """(3x3 conv, BatchNorm, ReLU) twice, optionally with channel dropout at the end."""

    def __init__(self, cin: int, cout: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.drop = nn.Dropout2d(dropout) if dropout else nn.Identity()

    def forward(self, x):
        x = F.relu(self.bn1(self.conv1(x)))
        return self.drop(F.relu(self.bn2(self.conv2(x))))


class Down(nn.Module):
    def __init__(self, cin: int, cout: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.conv = DoubleConv(cin, cout, dropout)

    def forward(self, x):
        return self.conv(F.max_pool2d(x, 2))


class Up(nn.Module):
    def __init__(self, cin: int, cout: int) -> None:
        super().__init__()
        self.up = nn.ConvTranspose2d(cin, cin // 2, 2, stride=2)
        self.conv = DoubleConv(cin // 2 + cout, cout)

    def forward(self, x, skip):
        return self.conv(torch.cat([self.up(x), skip], dim=1))


class UNet(nn.Module):
    """U-Net-like segmentation model: an encoder whose every stage's output is carried by a long skip connection to
    the decoder stage of the same resolution, BatchNorm (train mode) and channel dropout at the bottleneck."""

    def __init__(self, widths=(16, 32, 64, 128), classes: int = 4, dropout: float = 0.1) -> None:
        super().__init__()
        self.inc = DoubleConv(3, widths[0])
        self.downs = nn.ModuleList(
            Down(widths[i], widths[i + 1], dropout if i == len(widths) - 2 else 0.0) for i in range(len(widths) - 1)
        )
        self.ups = nn.ModuleList(Up(widths[i + 1], widths[i]) for i in reversed(range(len(widths) - 1)))
        self.head = nn.Conv2d(widths[0], classes, 1)

    def forward(self, x):
        x = self.inc(x)
        skips = [x]
        for down in self.downs:
            x = down(x)
            skips.append(x)
        skips.pop()
        for up in self.ups:
            x = up(x, skips.pop())
        return self.head(x)


# ---- MLP-Mixer ------------------------------------------------------------------------------------------------------
class MixerMLP(nn.Module):
    def __init__(self, d: int, hidden: int, dropout: float) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d, hidden)
        self.fc2 = nn.Linear(hidden, d)
        self.drop = nn.Dropout(dropout)

    def forward(self, x):
        return self.drop(self.fc2(self.drop(F.gelu(self.fc1(x)))))


class MixerBlock(nn.Module):
    def __init__(self, tokens: int, d: int, token_hidden: int, channel_hidden: int, dropout: float) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.token_mlp = MixerMLP(tokens, token_hidden, dropout)
        self.ln2 = nn.LayerNorm(d)
        self.channel_mlp = MixerMLP(d, channel_hidden, dropout)

    def forward(self, x):
        x = x + self.token_mlp(self.ln1(x).transpose(1, 2)).transpose(1, 2)
        return x + self.channel_mlp(self.ln2(x))


class Mixer(nn.Module):
    """MLP-Mixer-like image classifier: patch embedding, blocks of token-mixing and channel-mixing MLPs with
    LayerNorm and dropout, mean pooling, linear head."""

    def __init__(self, image: int = 64, patch: int = 8, d: int = 256, depth: int = 8, token_hidden: int = 128,
                 channel_hidden: int = 1024, classes: int = 10, dropout: float = 0.1) -> None:
        super().__init__()
        tokens = (image // patch) ** 2
        self.stem = nn.Conv2d(3, d, patch, stride=patch)
        self.blocks = nn.ModuleList(MixerBlock(tokens, d, token_hidden, channel_hidden, dropout) for _ in range(depth))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, classes)

    def forward(self, x):
        x = self.stem(x).flatten(2).transpose(1, 2)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x).mean(dim=1))


def make_mlp(batch: int = 64, seed: int = 0, **kw):
    """(model, inputs, targets, loss_fn) for a residual MLP."""
    torch.manual_seed(seed)
    model = MLP(**kw)
    d = model.blocks[0].fc1.in_features
    return model, torch.randn(batch, d), torch.randint(0, model.head.out_features, (batch,)), F.cross_entropy


def make_gpt(batch: int = 4, seed: int = 0, **kw):
    """(model, tokens, targets, loss_fn) for a GPT-2-like model on synthetic tokens."""
    torch.manual_seed(seed)
    model = GPT(**kw)
    seq = model.wpe.num_embeddings
    vocab = model.wte.num_embeddings
    idx = torch.randint(0, vocab, (batch, seq))
    targets = torch.randint(0, vocab, (batch, seq))

    def loss_fn(logits, y):
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))

    return model, idx, targets, loss_fn


def make_resnet(batch: int = 8, size: int = 32, seed: int = 0, **kw):
    """(model, images, targets, loss_fn) for a ResNet-like CNN."""
    torch.manual_seed(seed)
    model = ResNet(**kw)
    return model, torch.randn(batch, 3, size, size), torch.randint(0, model.fc.out_features, (batch,)), F.cross_entropy


def make_unet(batch: int = 4, size: int = 32, seed: int = 0, **kw):
    """(model, images, targets, loss_fn) for a U-Net-like segmentation model (per-pixel classes)."""
    torch.manual_seed(seed)
    model = UNet(**kw)
    x = torch.randn(batch, 3, size, size)
    return model, x, torch.randint(0, model.head.out_channels, (batch, size, size)), F.cross_entropy


def make_mixer(batch: int = 16, seed: int = 0, **kw):
    """(model, images, targets, loss_fn) for an MLP-Mixer-like classifier."""
    torch.manual_seed(seed)
    model = Mixer(**kw)
    image = kw.get("image", 64)
    return model, torch.randn(batch, 3, image, image), torch.randint(0, model.head.out_features, (batch,)), F.cross_entropy
