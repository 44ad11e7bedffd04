"""Model factories for the command line: models that are not causal LMs on token ids.

    meshplan plan --model examples/factories.py:convnet --mesh local:2 --batch 8 -o plan.json
    meshplan run plan.json --steps 5
    meshplan plan --model examples/factories.py:encoder_decoder --mesh local:4 --batch 8 \\
        --manual dp=2,tp=2 -o plan.json

Each factory returns ``meshplan.ModelBundle(model, example_inputs, example_targets,
loss_fn)``: one example batch whose first dim is the batch. ``meshplan plan --batch N``
calls a factory with ``batch=N`` when it has that keyword (``convnet``), otherwise it repeats
the example rows up to N (``encoder_decoder``). ``meshplan run`` trains on synthetic batches
of the examples' shapes and dtypes (normal floats, integers in each example's [min, max]),
from ``--seed`` and the step. ``python examples/factories.py`` checks that every factory
plans (on a local mesh, nothing allocated).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

import meshplan

CLASSES, SIZE, VOCAB, SRC, TGT, WIDTH = 10, 16, 64, 12, 8, 32


class ConvNet(nn.Module):
    """Two conv blocks with BatchNorm2d, global average pooling, a linear classifier."""

    def __init__(self, width: int = 16, classes: int = CLASSES):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, padding=1, bias=False),
                                  nn.BatchNorm2d(width), nn.ReLU())
        self.block = nn.Sequential(nn.Conv2d(width, 2 * width, 3, stride=2, padding=1,
                                             bias=False), nn.BatchNorm2d(2 * width), nn.ReLU())
        self.head = nn.Linear(2 * width, classes)

    def forward(self, images):
        return self.head(self.block(self.stem(images)).mean(dim=(2, 3)))


def classification_loss(logits, labels):
    return F.cross_entropy(logits, labels)


def convnet(batch: int = 8) -> meshplan.ModelBundle:
    """Images (batch x 3 x 16 x 16, float) and class ids (0..9) as the loss target."""
    images = torch.randn(batch, 3, SIZE, SIZE)
    labels = torch.arange(batch) % CLASSES  # spans 0..9 when batch >= 10: the drawn range
    labels[-1] = CLASSES - 1
    return meshplan.ModelBundle(ConvNet(), (images,), (labels,), classification_loss)


class Block(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.mix = nn.MultiheadAttention(width, 4, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x, memory):
        h = self.norm(x)
        x = x + self.mix(h, memory, memory, need_weights=False)[0]
        return x + self.mlp(self.norm(x))


class EncoderDecoder(nn.Module):
    """Float source features (an audio-like encoder input) and decoder token ids: two keyword
    inputs; the decoder cross-attends to the encoded source."""

    def __init__(self, features: int = 20, width: int = WIDTH, vocab: int = VOCAB):
        super().__init__()
        self.encode = nn.Sequential(nn.Linear(features, width), nn.GELU(), nn.Linear(width, width))
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(2))
        self.out = nn.Linear(width, vocab)

    def forward(self, features, decoder_ids):
        memory = self.encode(features)
        x = self.embed(decoder_ids)
        for block in self.blocks:
            x = block(x, memory)
        return self.out(x)


def sequence_loss(logits, labels):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


def encoder_decoder() -> meshplan.ModelBundle:
    """Keyword inputs {features: 4 x 12 x 20 float, decoder_ids: 4 x 8 ids} and labels."""
    ids = torch.arange(4 * TGT).reshape(4, TGT) % VOCAB
    ids[0, 0], ids[-1, -1] = 0, VOCAB - 1  # the examples span the vocabulary
    inputs = {"features": torch.randn(4, SRC, 20), "decoder_ids": ids}
    return meshplan.ModelBundle(EncoderDecoder(), inputs, ids.roll(-1, dims=1), sequence_loss)


def not_a_model():
    """A factory returning something else: meshplan refuses it in one line."""
    return {"model": ConvNet()}


if __name__ == "__main__":
    from meshplan.specs import parse_model_spec

    for name in ("convnet", "encoder_decoder"):
        loaded = parse_model_spec(f"{__file__}:{name}").load(8, None)
        plan = meshplan.autoparallel(loaded.model, meshplan.Mesh.local(2),
                                     graph=loaded.trace(name))
        print(f"{name}: {plan.summary().splitlines()[0]}")
