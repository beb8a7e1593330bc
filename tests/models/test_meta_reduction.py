"""``[meta] inner_loss_reduction``: ``mean`` (the published recipe) or ``sum_per_support`` (the sum over
a task's real support rows / ``inner_support_size`` S), wherever the inner loop runs.

Real parts only: the project's model, its functional meta step, learned rates, and a delivered bundle
(LMDB, the test fleet of tests/delivery) adapting against the trainer's own adaptation.
"""

from __future__ import annotations

import pytest
import torch

from common.config import from_mapping, to_dict
from common.errors import ConfigError
from models import ModelConfig, build_model
from models.meta import AdaptTarget, MetaConfig, MetaLearner, _adapt, adapt_and_predict, meta_step
from models.testing import assert_steps_identical, random_features, random_meta_batch, random_rows, synthetic_schema, unique_ids_of
from tests.delivery.conftest import Fleet, assert_bundle_adapts_like_the_trainer, tiny  # noqa: F401  (tiny: the session fixture)

S = 4
TINY = dict(hidden=[8], default_dim=4)


def _model():
    schema = synthetic_schema(n_sparse=2, n_multi_hot=1, n_text=0, n_dense=2, vector_dim=4, max_len=3)
    return schema, build_model(schema, ModelConfig(kind="dnn", **TINY))


def test_config_is_validated_naming_the_key() -> None:
    with pytest.raises(ConfigError, match="inner_loss_reduction"):
        from_mapping(MetaConfig, {"inner_loss_reduction": "sum"}, where="job.toml [meta]")
    with pytest.raises(ConfigError, match="inner_support_size"):
        from_mapping(MetaConfig, {"inner_loss_reduction": "sum_per_support"}, where="job.toml [meta]")
    with pytest.raises(ConfigError, match="inner_support_size"):
        from_mapping(MetaConfig, {"inner_support_size": -1}, where="job.toml [meta]")
    cfg = from_mapping(MetaConfig, {"inner_loss_reduction": "sum_per_support", "inner_support_size": 8})
    assert from_mapping(MetaConfig, to_dict(cfg)) == cfg  # the bundle recipe round-trips it


@pytest.mark.parametrize("learn", ["off", "element"])
def test_mean_is_bit_identical_to_the_default(learn) -> None:
    """``mean`` ignores ``inner_support_size``: the same bits as a config without the keys (padded rows
    present, so a scaled loss would differ)."""
    schema, model = _model()
    g = torch.Generator().manual_seed(1)
    mb = random_meta_batch(schema, tasks=4, support=6, query=3, vocab=8, generator=g, pad_rows=0.3, pad_tasks=1)
    rows = random_rows(mb.unique_ids, model.dims, g, scale=0.5)
    base = dict(inner_steps=2, inner_lr=0.1, learn_inner_lr=learn)
    old = meta_step(model, mb, rows, MetaLearner(model, MetaConfig(**base)))
    new = meta_step(model, mb, rows, MetaLearner(model, MetaConfig(**base, inner_loss_reduction="mean",
                                                                   inner_support_size=3)))
    assert_steps_identical(old, new)


@pytest.mark.parametrize("learn", ["off", "element"])
def test_sum_per_support_at_k_equal_s_equals_mean(learn) -> None:
    """Every task with exactly S real support rows: the same step as ``mean`` (training and evaluation)."""
    schema, model = _model()
    g = torch.Generator().manual_seed(2)
    mb = random_meta_batch(schema, tasks=3, support=S, query=3, vocab=8, generator=g, pad_rows=0.0)
    rows = random_rows(mb.unique_ids, model.dims, g, scale=0.5)
    base = dict(inner_steps=2, inner_lr=0.1, learn_inner_lr=learn)
    mean = meta_step(model, mb, rows, MetaLearner(model, MetaConfig(**base)))
    summ = meta_step(model, mb, rows, MetaLearner(model, MetaConfig(**base, inner_loss_reduction="sum_per_support",
                                                                    inner_support_size=S + 2)))
    assert summ.metrics["support_loss_after"] != mean.metrics["support_loss_after"]  # S/(S+2): a smaller step
    exact = meta_step(model, mb, rows, MetaLearner(model, MetaConfig(**base, inner_loss_reduction="sum_per_support",
                                                                     inner_support_size=S)))
    assert_steps_identical(mean, exact)
    # the evaluation path too (learned rates included), with padding slots beyond the S real rows
    mb = random_meta_batch(schema, tasks=3, support=S + 2, query=3, vocab=8, generator=g, pad_rows=0.0)
    mb.support.mask[:, S:] = False
    rows = random_rows(mb.unique_ids, model.dims, g, scale=0.5)
    ln = MetaLearner(model, MetaConfig(**base))
    ln_s = MetaLearner(model, MetaConfig(**base, inner_loss_reduction="sum_per_support", inner_support_size=S))
    ln_s.load_state_dict(ln.state_dict())
    p_mean = adapt_and_predict(model, mb.support, mb.query, rows, mb.unique_ids, ln)
    p_sum = adapt_and_predict(model, mb.support, mb.query, rows, mb.unique_ids, ln_s)
    for h in p_mean:
        assert torch.equal(p_mean[h], p_sum[h]), h


def test_meta_emb_follows_the_reduction() -> None:
    """MetaEmb (generated rows for unseen ids, simulated cold start) with learned rates: K = S equals
    ``mean`` bit for bit; a larger S (a shorter step) changes the outcome."""
    from tests.models.test_meta_support_loss import _cold_rows, _learner

    schema, model = _model()
    g = torch.Generator().manual_seed(6)
    mb = random_meta_batch(schema, tasks=3, support=S, query=3, vocab=8, generator=g, pad_rows=0.0)
    rows = random_rows(mb.unique_ids, model.dims, g, scale=0.5)
    init = _cold_rows(model, mb, rows)
    kw = dict(inner_steps=1, inner_lr=0.1, learn_inner_lr="element", meta_emb=True, meta_emb_tables=["user"],
              meta_emb_cold_weight=0.3)
    mean = meta_step(model, mb, rows, _learner(model, init, **kw))
    assert_steps_identical(mean, meta_step(model, mb, rows, _learner(model, init, **kw, inner_loss_reduction="sum_per_support",
                                                     inner_support_size=S)))
    shorter = meta_step(model, mb, rows, _learner(model, init, **kw, inner_loss_reduction="sum_per_support",
                                                   inner_support_size=2 * S))
    assert shorter.metrics["support_loss_after"] != mean.metrics["support_loss_after"]
    p_mean = adapt_and_predict(model, mb.support, mb.query, rows, mb.unique_ids, _learner(model, init, **kw))
    p_short = adapt_and_predict(model, mb.support, mb.query, rows, mb.unique_ids,
                                _learner(model, init, **kw, inner_loss_reduction="sum_per_support",
                                         inner_support_size=2 * S))
    assert max(float((p_mean[h] - p_short[h]).abs().max()) for h in p_mean) > 1e-5


def test_k_equal_2s_takes_exactly_twice_the_first_step() -> None:
    schema, model = _model()
    g = torch.Generator().manual_seed(3)
    sup = random_features(schema, (2 * S,), vocab=8, generator=g, pad_rows=0.0)
    uniq = unique_ids_of(schema, sup)
    rows = random_rows(uniq, model.dims, g, scale=0.5)
    params = {n: p.detach() for n, p in model.named_parameters()}
    index = model.lookup_index(sup, uniq, rows)
    one = dict(inner_steps=1, inner_lr=0.1, adapt=AdaptTarget.BOTH)
    pm, rm, before_m, _ = _adapt(model, params, rows, sup, index, MetaConfig(**one))
    ps_, rs, before_s, _ = _adapt(model, params, rows, sup, index,
                                  MetaConfig(**one, inner_loss_reduction="sum_per_support", inner_support_size=S))
    assert torch.equal(before_m, before_s)  # the reported support loss stays the mean
    moved = 0.0
    for n in params:
        dm, ds = pm[n] - params[n], ps_[n] - params[n]
        torch.testing.assert_close(ds, 2.0 * dm, rtol=1e-5, atol=1e-6)  # float rounding of p - lr g only
        moved = max(moved, float(dm.abs().max()))
    for t in rows:
        torch.testing.assert_close(rs[t] - rows[t], 2.0 * (rm[t] - rows[t]), rtol=1e-5, atol=1e-6)  # float rounding of p - lr g only
    assert moved > 1e-4


def test_a_training_batch_wider_than_the_support_size_is_an_error() -> None:
    schema, model = _model()
    g = torch.Generator().manual_seed(4)
    mb = random_meta_batch(schema, tasks=2, support=S + 1, query=2, vocab=8, generator=g)
    rows = random_rows(mb.unique_ids, model.dims, g)
    cfg = MetaConfig(inner_loss_reduction="sum_per_support", inner_support_size=S)
    with pytest.raises(ConfigError, match=r"inner_support_size = 4 .* 5 support slots"):
        meta_step(model, mb, rows, cfg)


META = MetaConfig(inner_steps=2, inner_lr=0.05, adapt=AdaptTarget.BOTH,
                  inner_loss_reduction="sum_per_support", inner_support_size=3)


def test_a_bundle_adapts_like_the_trainer_with_sum_per_support(tmp_path, tiny) -> None:  # noqa: F811
    fleet = Fleet(tiny)
    fleet.train(seed=3, fraction=0.7)
    rec = assert_bundle_adapts_like_the_trainer(
        tiny, fleet, tmp_path, META, MetaConfig(inner_steps=2, inner_lr=0.05, adapt=AdaptTarget.BOTH), 1e-4,
        "sum_per_support")
    assert rec["inner_loss_reduction"] == "sum_per_support" and rec["inner_support_size"] == 3
