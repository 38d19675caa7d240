"""A plain multi-layer perceptron: no BatchNorm, no dropout, so runs are reproducible.

Used by the equivalence tests (1 vs N workers, split vs unsplit) and the benchmarks,
where a compute-bound model with a known cost per sample is wanted.
"""

from __future__ import annotations

import math
from typing import Sequence

from torch import nn


class MLP(nn.Sequential):
    """Flatten, then ``Linear -> ReLU`` for each width, then a classifier layer.

    Each ``Linear+ReLU`` pair is one child module (a "block"), so the model can be
    split over devices or pipeline stages at block boundaries.
    """

    def __init__(self, input_shape: Sequence[int], num_classes: int = 10,
                 widths: Sequence[int] = (256, 256)):
        layers = [nn.Flatten()]
        width_in = math.prod(input_shape)
        for width in widths:
            layers.append(nn.Sequential(nn.Linear(width_in, width), nn.ReLU()))
            width_in = width
        layers.append(nn.Linear(width_in, num_classes))
        super().__init__(*layers)
