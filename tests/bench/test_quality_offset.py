"""bench.quality: the meta trainings and "plain + ft" get the same ``[meta]`` inner-loop keys (offset included)."""

from __future__ import annotations

from bench.quality import shared_inner_keys
from models.meta_config import MetaConfig


def test_both_arms_get_the_offset_keys() -> None:
    assert shared_inner_keys("mean", 8, 0, 16.0) == {}  # the defaults: the job of before
    keys = shared_inner_keys("mean", 8, 2, 4.0)
    assert keys == {"offset_steps": 2, "offset_prior": 4.0}
    plain_ft = MetaConfig(inner_steps=1, inner_lr=0.1, **keys)  # how cold_start_sweep builds "plain + ft"
    assert (plain_ft.offset_steps, plain_ft.offset_prior) == (2, 4.0)
    both = shared_inner_keys("sum_per_support", 8, 1, 16.0)
    assert both == {"inner_loss_reduction": "sum_per_support", "inner_support_size": 8, "offset_steps": 1,
                    "offset_prior": 16.0}

