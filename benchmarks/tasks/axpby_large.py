import torch
import torch.nn as nn


class Model(nn.Module):
    """alpha * a + b on 32 Mi elements: about 0.4 GB of traffic per call, ~100 us on an H200."""

    def __init__(self, alpha: float) -> None:
        super().__init__()
        self.alpha = alpha

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return self.alpha * a + b


rows = 4096
cols = 8192


def get_inputs():
    return [torch.randn(rows, cols), torch.randn(rows, cols)]


def get_init_inputs():
    return [2.0]
