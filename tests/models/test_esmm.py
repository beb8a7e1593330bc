"""ESMM: p_ctcvr = p_ctr * p_cvr, the logit of the conversion head, both bottoms."""

import pytest
import torch

from models import ModelConfig, build_model, loss
from models.esmm import log1mexp
from models.testing import random_features, random_rows, synthetic_schema, unique_ids_of


def _setup(bottom: str):
    g = torch.Generator().manual_seed(0)
    schema = synthetic_schema()
    model = build_model(schema, ModelConfig(kind="esmm", bottom=bottom, hidden=[8], expert_hidden=[8], n_experts=3))
    fb = random_features(schema, (3, 4), generator=g)
    uniq = unique_ids_of(schema, fb)
    return model, fb, uniq, random_rows(uniq, model.dims, g)


@pytest.mark.parametrize("bottom", ["shared", "mmoe"])
def test_ctcvr_is_ctr_times_cvr(bottom) -> None:
    model, fb, uniq, rows = _setup(bottom)
    probs = model.predict(fb, rows, uniq)
    idx = model.lookup_index(fb, uniq, rows)
    a, b = model.tower_logits(model.encoder(fb, rows, idx))
    torch.testing.assert_close(probs["click"], torch.sigmoid(a))
    torch.testing.assert_close(probs["conversion"], torch.sigmoid(a) * torch.sigmoid(b))
    logits = model(fb, rows, uniq)
    torch.testing.assert_close(torch.sigmoid(logits["conversion"]), probs["conversion"])
    assert (probs["conversion"] <= probs["click"]).all()


@pytest.mark.parametrize("bottom", ["shared", "mmoe"])
def test_loss_is_bce_on_click_and_ctcvr(bottom) -> None:
    model, fb, uniq, rows = _setup(bottom)
    rows = {t: r.requires_grad_() for t, r in rows.items()}
    total, per_head = loss(model(fb, rows, uniq), fb, model.heads)
    p = model.predict(fb, rows, uniq)
    m = fb.mask
    y_click = fb.labels["click"][m]
    y_ctcvr = (fb.labels["click"] * fb.labels["conversion"])[m]
    bce = torch.nn.functional.binary_cross_entropy
    torch.testing.assert_close(per_head["click"], bce(p["click"][m], y_click))
    torch.testing.assert_close(per_head["conversion"], bce(p["conversion"][m], y_ctcvr), rtol=1e-4, atol=1e-5)
    total.backward()
    for name, prm in model.named_parameters():
        assert prm.grad is not None and prm.grad.abs().sum() > 0, name


def test_log1mexp_is_stable_with_finite_gradients() -> None:
    x = torch.tensor([-1e-7, -1e-3, -0.5, -0.7, -5.0, -50.0], dtype=torch.float64, requires_grad=True)
    y = log1mexp(x)
    # The naive formula in float64 is accurate to ~1e-9 absolute on this range.
    torch.testing.assert_close(y, torch.log(1 - torch.exp(x.detach())), rtol=0, atol=1e-8)
    y.sum().backward()
    assert torch.isfinite(x.grad).all()


def test_saturated_towers_give_finite_loss_and_grads() -> None:
    model, fb, uniq, rows = _setup("shared")
    with torch.no_grad():
        model.tower_out.bias.fill_(60.0)  # p_ctr, p_cvr ~ 1
    rows = {t: r.requires_grad_() for t, r in rows.items()}
    total, _ = loss(model(fb, rows, uniq), fb, model.heads)
    total.backward()
    assert torch.isfinite(total)
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())
