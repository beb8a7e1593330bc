"""Building blocks of the zoo: MLPs, K parallel MLPs, DCN-v2 cross net, FM.

All blocks are stateless apart from parameters (no BatchNorm: running stats
do not mix with ``vmap`` over tasks and tiny support sets), and work with any
leading shape ``*L``.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch
from torch import Tensor, nn


def signed_log1p(x: Tensor) -> Tensor:
    """Fixed dense-feature transform ``sign(x) * log1p(|x|)`` (no learned statistics)."""
    return torch.sign(x) * torch.log1p(torch.abs(x))


class MLP(nn.Module):
    """``Linear -> ReLU (-> Dropout)`` per width; output width ``widths[-1]``.

    Args:
        in_dim: input features.
        widths: hidden widths, e.g. ``[128, 64]``.
        dropout: dropout probability after each activation (0 = none).

    Example::

        mlp = MLP(40, [64, 32])
        y = mlp(torch.randn(8, 5, 40))   # [8, 5, 32]
    """

    def __init__(self, in_dim: int, widths: Sequence[int], dropout: float = 0.0) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        for w in widths:
            layers += [nn.Linear(in_dim, w), nn.ReLU()]
            if dropout > 0:
                layers.append(nn.Dropout(dropout))
            in_dim = w
        self.net = nn.Sequential(*layers)
        self.out_dim = in_dim

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)


class BatchedLinear(nn.Module):
    """K independent linear maps evaluated in one einsum (experts, gates, towers).

    ::

        x [*L, in]      (shared input)   --\\
        x [*L, K, in]   (one per k)      ----> y [*L, K, out]
        weight [K, in, out], bias [K, out]

    Args:
        k: number of parallel maps.
        in_dim: input features.
        out_dim: output features.

    Example::

        lin = BatchedLinear(4, 16, 8)
        lin(torch.randn(10, 16)).shape      # [10, 4, 8]
        lin(torch.randn(10, 4, 16)).shape   # [10, 4, 8]
    """

    def __init__(self, k: int, in_dim: int, out_dim: int) -> None:
        super().__init__()
        self.k, self.in_dim, self.out_dim = k, in_dim, out_dim
        bound = 1.0 / math.sqrt(in_dim)  # nn.Linear's default init range
        self.weight = nn.Parameter(torch.empty(k, in_dim, out_dim).uniform_(-bound, bound))
        self.bias = nn.Parameter(torch.empty(k, out_dim).uniform_(-bound, bound))

    def forward(self, x: Tensor, shared_input: bool) -> Tensor:
        if shared_input:
            return torch.einsum("...i,kio->...ko", x, self.weight) + self.bias
        return torch.einsum("...ki,kio->...ko", x, self.weight) + self.bias


class BatchedMLP(nn.Module):
    """K parallel MLPs (``BatchedLinear -> ReLU`` per width): ``[*L, (K,) in] -> [*L, K, out]``.

    Args:
        k: number of MLPs (experts, or task towers).
        in_dim: input features.
        widths: hidden widths shared by all K.
        dropout: dropout after each activation.

    Example::

        experts = BatchedMLP(4, 40, [32])
        experts(torch.randn(8, 40), shared_input=True).shape   # [8, 4, 32]
    """

    def __init__(self, k: int, in_dim: int, widths: Sequence[int], dropout: float = 0.0) -> None:
        super().__init__()
        self.layers = nn.ModuleList()
        for w in widths:
            self.layers.append(BatchedLinear(k, in_dim, w))
            in_dim = w
        self.drop = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.out_dim = in_dim

    def forward(self, x: Tensor, shared_input: bool) -> Tensor:
        for i, layer in enumerate(self.layers):
            x = self.drop(torch.relu(layer(x, shared_input=shared_input and i == 0)))
        return x


class CrossNetV2(nn.Module):
    """DCN-v2 cross network: ``x_{l+1} = x0 * (W_l x_l + b_l) + x_l``.

    Full rank: ``W_l`` is ``[d, d]``. Low rank (``rank > 0``): ``W_l = U_l V_l^T``
    with ``U_l, V_l`` of shape ``[d, rank]`` (cheaper when ``d`` is large).

    Args:
        dim: input (and output) width ``d``.
        layers: number of cross layers.
        rank: 0 for full rank, else the rank of each ``W_l``.

    Example::

        cross = CrossNetV2(64, layers=2, rank=8)
        cross(torch.randn(5, 64)).shape   # [5, 64]
    """

    def __init__(self, dim: int, layers: int, rank: int = 0) -> None:
        super().__init__()
        self.rank = rank
        if rank == 0:
            self.w = nn.ModuleList(nn.Linear(dim, dim) for _ in range(layers))
        else:
            self.v = nn.ModuleList(nn.Linear(dim, rank, bias=False) for _ in range(layers))
            self.w = nn.ModuleList(nn.Linear(rank, dim) for _ in range(layers))

    def forward(self, x0: Tensor) -> Tensor:
        x = x0
        for i, w in enumerate(self.w):
            h = w(x) if self.rank == 0 else w(self.v[i](x))
            x = x0 * h + x
        return x


def fm_interaction(fields: Tensor) -> Tensor:
    """FM second-order term ``sum_{i<j} <v_i, v_j>`` over fields: ``[*L, F, D] -> [*L]``.

    Computed as ``0.5 * ((sum_f v_f)^2 - sum_f v_f^2)`` summed over D (O(F*D)).
    """
    square_of_sum = fields.sum(-2).pow(2)
    sum_of_square = fields.pow(2).sum(-2)
    return 0.5 * (square_of_sum - sum_of_square).sum(-1)
