"""Orthogonal rotations applied to K and V before quantization.

Row-vector convention throughout: a vector x is stored as x @ R.
"""

from __future__ import annotations

import math

import torch

from ..config import OscarInputError


def _sylvester(n: int) -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / math.sqrt(n)


def _dct(m: int) -> torch.Tensor:
    """Orthonormal DCT-II matrix of size m (rows are basis vectors)."""
    k = torch.arange(m, dtype=torch.float64).unsqueeze(1)
    i = torch.arange(m, dtype=torch.float64).unsqueeze(0)
    c = torch.cos(math.pi * (2 * i + 1) * k / (2 * m)) * math.sqrt(2 / m)
    c[0] /= math.sqrt(2)
    return c


def hadamard(n: int) -> torch.Tensor:
    """Normalised Hadamard-like orthogonal matrix of size n.

    A power of two gives the Sylvester Hadamard matrix. Other sizes (80, 96, 112, ...) are
    written n = 2^k * m with m odd and get H_(2^k) kron DCT_m: orthogonal, deterministic,
    and it still mixes every channel of each 2^k block evenly.
    """
    if not isinstance(n, int) or n <= 0:
        raise OscarInputError(f"hadamard size {n!r}: expected a positive integer")
    power = n & -n
    m = n // power
    h = _sylvester(power)
    if m > 1:
        h = torch.kron(h, _dct(m))
    return h.to(torch.float32)


def hadamard_rotations(layers: int, head_dim: int) -> torch.Tensor:
    """The data-free rotation set: the same Hadamard for every layer, [layers, D, D]."""
    return hadamard(head_dim).expand(layers, head_dim, head_dim).contiguous()


def bit_reversal_order(n: int) -> torch.Tensor:
    """Positions 0..n-1 sorted by their bit-reversed value: for n=8, [0, 4, 2, 6, 1, 5, 3, 7].

    Sizes that are not a power of two use ceil(log2 n) bits and the order of those that fit.
    """
    bits = max(1, (n - 1).bit_length())
    return torch.tensor(sorted(range(n), key=lambda i: int(f"{i:0{bits}b}"[::-1], 2)))


def bit_reversal_permutation(n: int) -> torch.Tensor:
    """Permutation matrix P with x @ P moving channel j to position bit_reversal_order(n)[j]."""
    p = torch.zeros(n, n)
    p[torch.arange(n), bit_reversal_order(n)] = 1.0
    return p


def oscar_rotation(covariance: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """R = U . H . P_br from a D x D (or batched [..., D, D]) covariance; returns (R, eigenvalues).

    U holds the eigenvectors sorted by eigenvalue, largest first; H mixes the decorrelated
    eigen-directions so every channel carries an even share; P_br spreads the channels fed by
    consecutive eigen-directions across the quantization groups.
    """
    cov = covariance.to(torch.float64)
    cov = (cov + cov.transpose(-1, -2)) / 2
    values, vectors = torch.linalg.eigh(cov)
    order = values.argsort(dim=-1, descending=True)
    values = values.gather(-1, order)
    vectors = vectors.gather(-1, order.unsqueeze(-2).expand_as(vectors))
    d = cov.shape[-1]
    rotation = vectors @ hadamard(d).to(torch.float64) @ bit_reversal_permutation(d).to(torch.float64)
    return rotation.to(torch.float32), values.to(torch.float32)


def orthogonality_errors(rotation: torch.Tensor) -> torch.Tensor:
    """max |R^T R - I| of each matrix in [..., D, D], in fp64 so the check adds no error of its own."""
    r = rotation.to(torch.float64)
    return (r.transpose(-1, -2) @ r - torch.eye(r.shape[-1], dtype=torch.float64)).abs().amax(dim=(-2, -1))


def max_orthogonality_error(rotation: torch.Tensor) -> float:
    """max |R^T R - I| over a rotation or a stack of them."""
    return float(orthogonality_errors(rotation).max())
