"""Multi-task bottoms: shared-bottom and MMoE (``[model] bottom = "shared"|"mmoe"``).

Both map the flat input to one representation per task::

    shared:  x [*L, in] -> MLP(expert_hidden) -> [*L, h] -> broadcast -> [*L, K, h]

    mmoe:    x [*L, in] -> E experts (BatchedMLP)            -> e [*L, E, h]
             x [*L, in] -> K gates: softmax(Linear(in, E))   -> g [*L, K, E]
             out[k] = sum_e g[k, e] * e[e]                    -> [*L, K, h]

Experts and gates are evaluated as one einsum each, not a loop over experts.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor, nn

from models.layers import MLP, BatchedLinear, BatchedMLP


class SharedBottom(nn.Module):
    """One MLP shared by all K tasks.

    Args:
        in_dim: input width.
        n_tasks: K.
        widths: MLP widths.
        dropout: dropout after each activation.

    Example::

        SharedBottom(40, 2, [32])(torch.randn(8, 40)).shape   # [8, 2, 32]
    """

    def __init__(self, in_dim: int, n_tasks: int, widths: Sequence[int], dropout: float = 0.0) -> None:
        super().__init__()
        self.n_tasks = n_tasks
        self.mlp = MLP(in_dim, widths, dropout)
        self.out_dim = self.mlp.out_dim

    def forward(self, x: Tensor) -> Tensor:
        h = self.mlp(x).unsqueeze(-2)
        return h.expand(*h.shape[:-2], self.n_tasks, h.shape[-1])


class MMoE(nn.Module):
    """Multi-gate mixture of experts.

    Args:
        in_dim: input width.
        n_tasks: K (one gate each).
        n_experts: E.
        widths: widths of each expert MLP.
        dropout: dropout after each expert activation.

    Example::

        MMoE(40, n_tasks=2, n_experts=4, widths=[32])(torch.randn(8, 40)).shape   # [8, 2, 32]
    """

    def __init__(self, in_dim: int, n_tasks: int, n_experts: int, widths: Sequence[int], dropout: float = 0.0) -> None:
        super().__init__()
        self.experts = BatchedMLP(n_experts, in_dim, widths, dropout)
        self.gates = BatchedLinear(n_tasks, in_dim, n_experts)
        self.out_dim = self.experts.out_dim

    def forward(self, x: Tensor) -> Tensor:
        experts = self.experts(x, shared_input=True)  # [*L, E, h]
        gates = torch.softmax(self.gates(x, shared_input=True), dim=-1)  # [*L, K, E]
        return torch.einsum("...ke,...eh->...kh", gates, experts)
