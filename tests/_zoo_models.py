"""Hand-written models for the zoo tests: a torchtitan-style Llama (blocks in an
nn.ModuleDict) and a ResNet-style ConvNet (no torchvision: installing it replaces torch)."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(dim, dim, bias=False) for _ in range(4))

    def forward(self, x, cos, sin):
        b, s, d = x.shape
        q, k, v = (w(x).view(b, s, self.heads, -1).transpose(1, 2)
                   for w in (self.wq, self.wk, self.wv))
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, s, d))


def rotate(x, cos, sin):
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, hidden: int):
        super().__init__()
        self.attention_norm = nn.RMSNorm(dim)
        self.attention = Attention(dim, heads)
        self.ffn_norm = nn.RMSNorm(dim)
        self.feed_forward = FeedForward(dim, hidden)

    def forward(self, x, cos, sin):
        x = x + self.attention(self.attention_norm(x), cos, sin)
        return x + self.feed_forward(self.ffn_norm(x))


class TitanLlama(nn.Module):
    """torchtitan's layout: ``self.layers = nn.ModuleDict({str(i): Block()})``."""

    def __init__(self, vocab_size=256, dim=64, n_layers=3, heads=4, hidden=160, max_seq=64):
        super().__init__()
        self.vocab_size = vocab_size
        self.tok_embeddings = nn.Embedding(vocab_size, dim)
        self.layers = nn.ModuleDict({str(i): Block(dim, heads, hidden) for i in range(n_layers)})
        self.norm = nn.RMSNorm(dim)
        self.output = nn.Linear(dim, vocab_size, bias=False)
        head_dim = dim // heads
        inv = 1.0 / (10000 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        angles = torch.outer(torch.arange(max_seq, dtype=torch.float32), inv)
        angles = torch.cat((angles, angles), dim=-1)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, tokens):
        s = tokens.shape[1]
        h = self.tok_embeddings(tokens)
        cos, sin = self.cos[:s], self.sin[:s]
        for layer in self.layers.values():
            h = layer(h, cos, sin)
        return self.output(self.norm(h))


class NoGradRotaryLlama(nn.Module):
    """A Llama whose rotary cos/sin are computed in the forward under ``torch.no_grad()``, as
    Hugging Face's ``LlamaRotaryEmbedding`` did up to transformers 5.23 (5.24 dropped the
    no-grad region). torch.export puts that region in a higher-order operator
    (``wrap_with_set_grad_enabled``) whose body is a submodule of the graph module: the case
    the pipeline split hands to every stage that reads it (runtime/graph/pipeline_split.py)."""

    def __init__(self, vocab_size=256, dim=64, n_layers=4, heads=4, hidden=128):
        super().__init__()
        self.vocab_size = vocab_size
        self.tok_embeddings = nn.Embedding(vocab_size, dim)
        self.layers = nn.ModuleList(Block(dim, heads, hidden) for _ in range(n_layers))
        self.norm = nn.RMSNorm(dim)
        self.output = nn.Linear(dim, vocab_size, bias=False)
        head_dim = dim // heads
        inv = 1.0 / (10000 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        self.register_buffer("inv_freq", inv, persistent=False)

    def forward(self, tokens):
        h = self.tok_embeddings(tokens)
        with torch.no_grad():
            positions = torch.arange(tokens.shape[1], device=tokens.device, dtype=torch.float32)
            angles = positions[:, None] * self.inv_freq[None, :]
            angles = torch.cat((angles, angles), dim=-1)
            cos, sin = angles.cos(), angles.sin()
        for layer in self.layers:
            h = layer(h, cos, sin)
        return self.output(self.norm(h))


def no_grad_rotary_llama() -> nn.Module:
    """The ``file.py:factory`` spec of ``NoGradRotaryLlama`` (tests/test_pipeline_runtime.py)."""
    return NoGradRotaryLlama()


class BasicBlock(nn.Module):
    """ResNet's basic block (He et al. 2016, fig. 2): two 3x3 convolutions and a shortcut."""

    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut = nn.Sequential()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False),
                                          nn.BatchNorm2d(cout))

    def forward(self, x):
        y = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(y)) + self.shortcut(x))


class ConvNet(nn.Module):
    """A small ResNet: 3x3 stem, stages of basic blocks, global average pool, classifier."""

    def __init__(self, widths=(16, 32, 64), blocks_per_stage=2, num_classes=10):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, widths[0], 3, 1, 1, bias=False),
                                  nn.BatchNorm2d(widths[0]), nn.ReLU())
        blocks, cin = [], widths[0]
        for i, w in enumerate(widths):
            for j in range(blocks_per_stage):
                blocks.append(BasicBlock(cin, w, 2 if i > 0 and j == 0 else 1))
                cin = w
        self.blocks = nn.Sequential(*blocks)
        self.fc = nn.Linear(cin, num_classes)

    def forward(self, x):
        x = self.blocks(self.stem(x))
        return self.fc(x.mean(dim=(2, 3)))

    def closed_form_flops(self, batch: int, size: int) -> int:
        """Forward FLOPs of the convolutions and the classifier, from the layer shapes alone:
        a k x k convolution costs 2 x Cin x k^2 x Cout x Hout x Wout per image (a multiply-add
        is 2 FLOPs, torch.utils.flop_counter's convention); norms and pooling are not counted."""
        stem = self.stem[0]
        total, hw = 2 * stem.in_channels * 9 * stem.out_channels * size * size, size
        for b in self.blocks:
            cin, cout, stride = b.conv1.in_channels, b.conv1.out_channels, b.conv1.stride[0]
            hw = (hw + 2 - 3) // stride + 1
            total += 2 * cin * 9 * cout * hw * hw + 2 * cout * 9 * cout * hw * hw
            if len(b.shortcut):
                total += 2 * cin * cout * hw * hw
        total += 2 * self.fc.in_features * self.fc.out_features
        return batch * total


class Bottleneck(nn.Module):
    """ResNet's bottleneck block (He et al. 2016, fig. 5; stride on the 3x3 as torchvision)."""

    def __init__(self, cin: int, width: int, stride: int):
        super().__init__()
        cout = 4 * width
        self.conv1 = nn.Conv2d(cin, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, cout, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(cout)
        self.downsample = nn.Sequential()
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False),
                                            nn.BatchNorm2d(cout))

    def forward(self, x):
        y = F.relu(self.bn1(self.conv1(x)))
        y = F.relu(self.bn2(self.conv2(y)))
        return F.relu(self.bn3(self.conv3(y)) + self.downsample(x))


class ResNet50(nn.Module):
    """ResNet-50 (He et al. 2016, table 1): 7x7 stem, max pool, 3-4-6-3 bottlenecks."""

    def __init__(self, num_classes: int = 1000):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64),
                                  nn.ReLU(), nn.MaxPool2d(3, 2, 1))
        blocks, cin = [], 64
        for i, (width, count) in enumerate(((64, 3), (128, 4), (256, 6), (512, 3))):
            for j in range(count):
                blocks.append(Bottleneck(cin, width, 2 if i > 0 and j == 0 else 1))
                cin = 4 * width
        self.layers = nn.Sequential(*blocks)
        self.fc = nn.Linear(cin, num_classes)

    def forward(self, x):
        return self.fc(self.layers(self.stem(x)).mean(dim=(2, 3)))
