"""Masked BCE and the head -> target mapping."""

import torch

from models.losses import HeadSpec, heads_for_schema, loss, masked_bce
from models.testing import random_features, synthetic_schema


def test_heads_for_schema_gate_post_click_labels() -> None:
    schema = synthetic_schema(labels=("click", "conversion"))
    assert heads_for_schema(schema) == [HeadSpec("click", "click"), HeadSpec("conversion", "conversion", gate="click")]


def test_masked_bce_mean_over_real_rows_and_zero_when_empty() -> None:
    logits = torch.tensor([0.0, 2.0, -1.0, 5.0])
    y = torch.tensor([1.0, 0.0, 1.0, float("nan")])  # garbage label on the padding row
    mask = torch.tensor([True, True, True, False])
    want = torch.nn.functional.binary_cross_entropy_with_logits(logits[:3], y[:3])
    torch.testing.assert_close(masked_bce(logits, y, mask), want)
    empty = masked_bce(logits, y, torch.zeros(4, dtype=torch.bool))
    assert empty.item() == 0.0


def test_loss_uses_ctcvr_target_for_conversion() -> None:
    schema = synthetic_schema()
    fb = random_features(schema, (20,), generator=torch.Generator().manual_seed(0), pad_rows=0.0)
    fb.labels["conversion"] = torch.ones(20)  # conversion without click must not count as positive
    outputs = {"click": torch.zeros(20), "conversion": torch.randn(20)}
    total, per_head = loss(outputs, fb, schema)
    want = torch.nn.functional.binary_cross_entropy_with_logits(outputs["conversion"], fb.labels["click"])
    torch.testing.assert_close(per_head["conversion"], want)
    torch.testing.assert_close(total, per_head["click"] + per_head["conversion"])
