"""A small torch model and its data, shared by the optimizer-state tests.

`Net` (two wrapped `Block`s between linear layers, seeded so every construction is equal) and
`batch(step)` (a deterministic batch per step): enough parameters for several units, small
enough to train bit-exactly against plain torch in a test.
"""

import torch
import torch.nn as nn


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.ln = nn.LayerNorm(d)

    def forward(self, x):
        return self.ln(torch.tanh(self.fc(x)))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(7)
        self.inp = nn.Linear(6, 16)
        self.blocks = nn.Sequential(Block(16), Block(16))
        self.out = nn.Linear(16, 3)

    def forward(self, x):
        return self.out(self.blocks(torch.relu(self.inp(x))))


def batch(step):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)
