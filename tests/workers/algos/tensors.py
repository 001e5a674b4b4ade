"""What the loss and advantage tests build their inputs from."""

from __future__ import annotations

import torch


def f64(rows: object) -> torch.Tensor:
    """``rows`` (nested lists) as a float64 tensor: exact enough to compare with hand math."""
    return torch.tensor(rows, dtype=torch.float64)
