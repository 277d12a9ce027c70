"""CIFAR-sized image classifiers: ResNet-20 (He et al. 2016, section 4.2) and a small VGG."""

from __future__ import annotations

from collections import OrderedDict

import torch.nn.functional as F
from torch import Tensor, nn


class BasicBlock(nn.Module):
    """Two 3x3 conv-BN layers with an identity shortcut.

    Where the block halves the size and doubles the width, the shortcut subsamples by 2
    and zero-pads the new channels: the paper's option A, which adds no parameters.
    """

    def __init__(self, c_in: int, c_out: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.stride, self.pad = stride, c_out - c_in

    def forward(self, x: Tensor) -> Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        shortcut = x[:, :, :: self.stride, :: self.stride] if self.stride > 1 else x
        if self.pad:
            shortcut = F.pad(shortcut, (0, 0, 0, 0, self.pad // 2, self.pad - self.pad // 2))  # (B, c_out, H, W)
        return F.relu(out + shortcut)


class ResNetCIFAR(nn.Module):
    """3 stages of ``n`` basic blocks at 16/32/64 channels (32x32, 16x16, 8x8); depth 6n+2."""

    def __init__(self, n: int = 3, classes: int = 10) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 16, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(16)
        layers, c_in = [], 16
        for stage, c_out in enumerate((16, 32, 64)):
            for i in range(n):
                layers.append(BasicBlock(c_in, c_out, 2 if stage > 0 and i == 0 else 1))
                c_in = c_out
        self.blocks = nn.Sequential(*layers)
        self.fc = nn.Linear(64, classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, x: Tensor) -> Tensor:
        x = self.blocks(F.relu(self.bn(self.conv(x))))  # (B, 64, 8, 8)
        return self.fc(x.mean((2, 3)))  # (B, classes)


def resnet20(classes: int = 10) -> nn.Module:
    """ResNet-20: 0.27M parameters."""
    return ResNetCIFAR(3, classes)


VGG_CONFIG = (32, 32, "M", 64, 64, "M", 128, 128, "M")  # channels, or "M" for 2x2 max-pool


def vgg_small(classes: int = 10) -> nn.Module:
    """Six 3x3 conv-BN-ReLU layers in 3 pooled stages, then FC(2048, 256) and FC(256, 10): 0.8M params.

    The 0.5M-parameter first FC layer is the kind of large matrix low-rank methods target.
    """
    layers: list[nn.Module] = []
    c_in = 3
    for item in VGG_CONFIG:
        if item == "M":
            layers.append(nn.MaxPool2d(2))
        else:
            assert isinstance(item, int)  # every entry but "M" is a channel count
            layers += [nn.Conv2d(c_in, item, 3, padding=1, bias=False), nn.BatchNorm2d(item), nn.ReLU()]
            c_in = item
    return nn.Sequential(
        OrderedDict(
            features=nn.Sequential(*layers),  # (B, 128, 4, 4)
            flatten=nn.Flatten(),  # (B, 2048)
            fc1=nn.Linear(c_in * 4 * 4, 256),
            relu=nn.ReLU(),
            fc2=nn.Linear(256, classes),
        )
    )
