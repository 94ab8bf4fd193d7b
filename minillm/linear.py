"""minillm's linear layer: ``y = x W^T + b`` with W stored (out_features, in_features), as ``nn.Linear``.

The library's layers are plain torch; how a product streams W fastest on one kind of CPU (column shards, a few-row
kernel, oneDNN's packed layout) is the speed layer's ``minillm.fast.linear.FastLinear``, which
``minillm.fast.accelerate`` swaps in for this class. ``linear_naive`` is the baseline both are tested against.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Linear(nn.Module):
    """``y = x W^T + b``.

    Args:
        weight: (out_features, in_features), in PyTorch's usual layout.
        bias: (out_features,) or None.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.weight = nn.Parameter(weight.detach().clone(), requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)

    def load_weight(self, weight: torch.Tensor) -> None:
        """Replace W with ``weight`` (out_features, in_features) (AWQ folds its scales in)."""
        self.weight.data = weight.to(self.weight.dtype).contiguous()

    def rows(self, index: torch.Tensor) -> torch.Tensor:
        """Rows ``W[index]`` (..., in_features): a tied embedding's lookup."""
        return self.weight[index]

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (..., in) -> (..., out)
        return F.linear(x, self.weight, self.bias)


def linear_naive(x: torch.Tensor, layer: nn.Module) -> torch.Tensor:
    """The baseline of every linear layer's forward (same result): ``x W^T + b`` written out on the (out, in) weight."""
    y = x @ layer.weight.t()
    return y if layer.bias is None else y + layer.bias
