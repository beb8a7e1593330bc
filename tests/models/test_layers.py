"""Building blocks against their textbook formulas."""

import torch

from models.layers import BatchedLinear, BatchedMLP, CrossNetV2, fm_interaction, signed_log1p
from models.mmoe import MMoE, SharedBottom


def test_fm_equals_pairwise_sum() -> None:
    v = torch.randn(3, 5, 4)
    want = sum((v[:, i] * v[:, j]).sum(-1) for i in range(5) for j in range(i + 1, 5))
    torch.testing.assert_close(fm_interaction(v), want)


def test_batched_linear_equals_k_linears() -> None:
    lin = BatchedLinear(3, 6, 2)
    x = torch.randn(4, 6)
    xs = torch.randn(4, 3, 6)
    for k in range(3):
        torch.testing.assert_close(lin(x, shared_input=True)[:, k], x @ lin.weight[k] + lin.bias[k])
        torch.testing.assert_close(lin(xs, shared_input=False)[:, k], xs[:, k] @ lin.weight[k] + lin.bias[k])
    assert BatchedMLP(3, 6, [5, 2])(x, shared_input=True).shape == (4, 3, 2)


def test_cross_net_full_rank_formula() -> None:
    cross = CrossNetV2(5, layers=2)
    x0 = torch.randn(3, 5)
    x = x0
    for w in cross.w:
        x = x0 * (x @ w.weight.T + w.bias) + x
    torch.testing.assert_close(cross(x0), x)
    assert CrossNetV2(5, layers=2, rank=2)(x0).shape == (3, 5)


def test_mmoe_equals_gated_sum_of_experts() -> None:
    mmoe = MMoE(6, n_tasks=2, n_experts=3, widths=[4])
    x = torch.randn(5, 6)
    experts = [torch.relu(x @ mmoe.experts.layers[0].weight[e] + mmoe.experts.layers[0].bias[e]) for e in range(3)]
    out = mmoe(x)
    for k in range(2):
        gate = torch.softmax(x @ mmoe.gates.weight[k] + mmoe.gates.bias[k], -1)
        want = sum(gate[:, e : e + 1] * experts[e] for e in range(3))
        torch.testing.assert_close(out[:, k], want)
    shared = SharedBottom(6, 2, [4])(x)
    assert shared.shape == (5, 2, 4) and torch.equal(shared[:, 0], shared[:, 1])


def test_signed_log1p() -> None:
    x = torch.tensor([-1000.0, -1.0, 0.0, 2.0])
    torch.testing.assert_close(signed_log1p(x), torch.tensor([-6.9087548, -0.6931472, 0.0, 1.0986123]))
