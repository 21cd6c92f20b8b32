import torch
import torch.nn as nn


class Model(nn.Module):
    """out = alpha * a + b"""

    def __init__(self, alpha: float) -> None:
        super().__init__()
        self.alpha = alpha

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return self.alpha * a + b


rows = 256
cols = 4096


def get_inputs():
    return [torch.randn(rows, cols), torch.randn(rows, cols)]


def get_init_inputs():
    return [2.0]
