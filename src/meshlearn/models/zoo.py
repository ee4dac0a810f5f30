"""Built-in models. Each adapts to the dataset's input shape (C, H, W) and class count."""

from __future__ import annotations

from torch import nn

from meshlearn.models.registry import register_model


def _pooled(size: int, times: int) -> int:
    for _ in range(times):
        size //= 2
    return size


@register_model("mlp")
class MLP(nn.Module):
    """A small multilayer perceptron (hidden layers of 128 and 64), the quick default."""

    def __init__(self, input_shape: tuple[int, int, int], num_classes: int):
        super().__init__()
        c, h, w = input_shape
        self.net = nn.Sequential(
            nn.Flatten(), nn.Linear(c * h * w, 128), nn.ReLU(), nn.Linear(128, 64), nn.ReLU(), nn.Linear(64, num_classes)
        )

    def forward(self, x):
        return self.net(x)


@register_model("lenet")
class LeNet(nn.Module):
    """DecentralizePy's CIFAR-10 LeNet: 3 x (5x5 conv 'same', GroupNorm(2), ReLU, 2x2 max-pool), linear.

    89,834 parameters on 3x32x32 inputs with 10 classes.
    """

    def __init__(self, input_shape: tuple[int, int, int], num_classes: int):
        super().__init__()
        c, h, w = input_shape
        layers = []
        for cin, cout in ((c, 32), (32, 32), (32, 64)):
            layers += [nn.Conv2d(cin, cout, 5, padding="same"), nn.GroupNorm(2, cout), nn.ReLU(), nn.MaxPool2d(2)]
        self.features = nn.Sequential(*layers)
        self.fc = nn.Linear(64 * _pooled(h, 3) * _pooled(w, 3), num_classes)

    def forward(self, x):
        return self.fc(self.features(x).flatten(1))


@register_model("simplecnn")
class SimpleCNN(nn.Module):
    """CloudMesh's SimpleCNN: conv 32-64-128 (3x3, ReLU, 2x2 max-pool), fc 512, dropout 0.5, fc.

    1,147,466 parameters on 3x32x32 inputs with 10 classes.
    """

    def __init__(self, input_shape: tuple[int, int, int], num_classes: int):
        super().__init__()
        c, h, w = input_shape
        layers = []
        for cin, cout in ((c, 32), (32, 64), (64, 128)):
            layers += [nn.Conv2d(cin, cout, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2)]
        self.features = nn.Sequential(*layers)
        self.classifier = nn.Sequential(
            nn.Flatten(), nn.Linear(128 * _pooled(h, 3) * _pooled(w, 3), 512), nn.ReLU(), nn.Dropout(0.5),
            nn.Linear(512, num_classes),
        )

    def forward(self, x):
        return self.classifier(self.features(x))


class BasicBlock(nn.Module):
    """ResNet basic block: two 3x3 convs with BatchNorm and a (projected) shortcut."""

    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut = nn.Sequential()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        out = self.bn1(self.conv1(x)).relu()
        out = self.bn2(self.conv2(out))
        return (out + self.shortcut(x)).relu()


@register_model("resnet18")
class ResNet18(nn.Module):
    """The usual CIFAR ResNet-18 (3x3 stem, no max-pool): 11,173,962 parameters on 3x32x32 / 10."""

    def __init__(self, input_shape: tuple[int, int, int], num_classes: int):
        super().__init__()
        c = input_shape[0]
        self.stem = nn.Sequential(nn.Conv2d(c, 64, 3, 1, 1, bias=False), nn.BatchNorm2d(64), nn.ReLU())
        blocks, cin = [], 64
        for cout, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
            blocks += [BasicBlock(cin, cout, stride), BasicBlock(cout, cout, 1)]
            cin = cout
        self.blocks = nn.Sequential(*blocks)
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(512, num_classes))

    def forward(self, x):
        return self.head(self.blocks(self.stem(x)))
