"""Tiny stand-ins for ``torchvision.models``: built the way torchvision builds its models
(``norm_layer`` a class called with the channel count, 1000 classes), small enough for CPU tests."""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn


class _Block(nn.Module):
    """A residual block: conv, norm, ReLU, conv, norm, plus the input."""

    def __init__(self, channels: int, norm_layer: Callable[[int], nn.Module]) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = norm_layer(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = norm_layer(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(x + self.bn2(self.conv2(out)))


class TinyResNet(nn.Module):
    """A stem, one residual block, global average pooling and a 1000-way classifier."""

    def __init__(self, width: int = 8, num_classes: int = 1000,
                 norm_layer: Callable[[int], nn.Module] = nn.BatchNorm2d) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, width, 3, stride=2, padding=1, bias=False)
        self.bn1 = norm_layer(width)
        self.layer1 = _Block(width, norm_layer)
        self.fc = nn.Linear(width, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.bn1(self.conv1(x)))
        x = self.layer1(x)
        return self.fc(torch.flatten(nn.functional.adaptive_avg_pool2d(x, 1), 1))


def tiny_resnet(**kwargs: object) -> TinyResNet:
    """``models.resnet50(**kwargs)``'s stand-in."""
    return TinyResNet(**kwargs)  # type: ignore[arg-type]
