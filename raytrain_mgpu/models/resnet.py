"""ResNet-18 as in d2l (section 8.6): 3x3 stem, stride 1, no max-pool, for small images."""

from __future__ import annotations

from torch import nn
from torch.nn import functional as F


class Residual(nn.Module):
    """Two 3x3 convs with BatchNorm; a 1x1 conv on the shortcut when the shape changes."""

    def __init__(self, in_channels: int, channels: int, stride: int = 1):
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, channels, kernel_size=3, padding=1, stride=stride)
        self.conv2 = nn.Conv2d(channels, channels, kernel_size=3, padding=1)
        self.bn1 = nn.BatchNorm2d(channels)
        self.bn2 = nn.BatchNorm2d(channels)
        needs_projection = stride != 1 or in_channels != channels
        self.conv3 = nn.Conv2d(in_channels, channels, kernel_size=1, stride=stride) if needs_projection else None

    def forward(self, x):
        y = F.relu(self.bn1(self.conv1(x)))
        y = self.bn2(self.conv2(y))
        shortcut = self.conv3(x) if self.conv3 is not None else x
        return F.relu(y + shortcut)


def _stage(in_channels: int, channels: int, num_residuals: int, first: bool) -> nn.Sequential:
    blocks = []
    for i in range(num_residuals):
        if i == 0 and not first:
            blocks.append(Residual(in_channels, channels, stride=2))
        else:
            blocks.append(Residual(channels if i else in_channels, channels))
    return nn.Sequential(*blocks)


class ResNet18(nn.Sequential):
    """d2l's ``resnet18(num_classes, in_channels)``: blocks are children, so it can be split."""

    def __init__(self, in_channels: int = 1, num_classes: int = 10):
        super().__init__(
            nn.Sequential(nn.Conv2d(in_channels, 64, kernel_size=3, stride=1, padding=1),
                          nn.BatchNorm2d(64), nn.ReLU()),
            _stage(64, 64, 2, first=True),
            _stage(64, 128, 2, first=False),
            _stage(128, 256, 2, first=False),
            _stage(256, 512, 2, first=False),
            nn.Sequential(nn.AdaptiveAvgPool2d((1, 1)), nn.Flatten(), nn.Linear(512, num_classes)),
        )
