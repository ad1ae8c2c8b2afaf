"""Orthogonal rotations applied to K and V before quantization."""

from __future__ import annotations

import torch

from .config import OscarInputError


def hadamard(n: int) -> torch.Tensor:
    """Normalised Sylvester Hadamard matrix of size n (a power of two): H @ H.T = I."""
    if n <= 0 or n & (n - 1):
        raise OscarInputError(f"hadamard size {n}: expected a power of two")
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (h / n**0.5).to(torch.float32)


def hadamard_rotations(layers: int, head_dim: int) -> torch.Tensor:
    """The data-free rotation set: the same Hadamard for every layer, [layers, D, D]."""
    return hadamard(head_dim).expand(layers, head_dim, head_dim).contiguous()
