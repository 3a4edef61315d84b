"""What the battery's scripts share: a small model, fixed data and the one line each prints at the end.

Kept apart from the scripts so that each reads as a script a DeepSpeed user writes; nothing here imports DeepSpeed
(``train`` drives the engine a script hands it).
"""

import json

import torch
from torch import nn


class Net(nn.Module):
    """A little language model: embedding, two residual MLP blocks, a head (optionally an unused second head)."""

    def __init__(self, vocab=64, hidden=32, unused_head=False):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(hidden), nn.Linear(hidden, 4 * hidden), nn.GELU(),
                                                  nn.Linear(4 * hidden, hidden)) for _ in range(2))
        self.head = nn.Linear(hidden, vocab)
        self.aux = nn.Linear(hidden, vocab) if unused_head else None

    def forward(self, tokens, checkpoint=None):
        h = self.embed(tokens[:, :-1])
        for block in self.blocks:
            h = h + (checkpoint(block, h) if checkpoint is not None else block(h))
        logits = self.head(h)
        return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def data(n=16, seq=9, vocab=64):
    g = torch.Generator().manual_seed(1234)
    return torch.randint(0, vocab, (n, seq), generator=g)


def train(engine, batches, **forward_kwargs):
    """The plain DeepSpeed loop (forward, ``engine.backward``, ``engine.step`` per batch): each step's loss."""
    losses = []
    for tokens in batches:
        loss = engine(tokens, **forward_kwargs)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def train_scheduled(engine, batches):
    """``train``'s loop, with the learning rate each step read (the engine's schedule moves it): (losses, rates)."""
    losses, lrs = [], []
    for tokens in batches:
        loss = engine(tokens)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        lrs.append(engine.get_lr()[0])
    return losses, lrs


def report(**observed):
    """The script's observations, one JSON line the battery compares."""
    print("RESULT " + json.dumps(observed, sort_keys=True), flush=True)
