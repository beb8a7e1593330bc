"""bench.fleet_quality's pure helpers: the per-cell comparison and the parity goal (no fleet started)."""

from __future__ import annotations

import pytest

from bench.fleet_quality import EVALS, HEADS, compare, parity_goal


def _scores(auc: float, **over: float) -> dict[str, dict[str, float]]:
    """Every evaluation and head at ``auc``; ``over`` sets ``EVAL__HEAD`` cells."""
    out = {e: {h: auc for h in HEADS} for e in EVALS}
    for key, v in over.items():
        e, h = key.split("__")
        out[e][h] = v
    return out


def test_compare_is_fleet_minus_local_per_cell() -> None:
    c = compare(_scores(0.80), _scores(0.80, first_k_adapted__conversion=0.79))
    assert c["first_k_adapted"]["conversion"] == pytest.approx({"local": 0.80, "fleet": 0.79, "diff": -0.01})
    assert c["all"]["click"]["diff"] == 0.0
    assert set(c) == set(EVALS) and all(set(c[e]) == set(HEADS) for e in EVALS)


def test_goal_is_met_within_the_tolerance_and_names_the_worst_cell() -> None:
    per_seed = {3: compare(_scores(0.80), _scores(0.80, all__click=0.798)),
                4: compare(_scores(0.80), _scores(0.801))}
    g = parity_goal(per_seed, tol=0.003)
    assert g["met"] is True
    assert g["worst_margin"] == pytest.approx(0.001)
    assert g["worst"] == {"seed": 3, "eval": "all", "head": "click", "diff": pytest.approx(-0.002)}
    assert g["max_abs_diff"] == pytest.approx(0.002)


def test_goal_is_missed_by_one_seed_one_head_and_says_by_how_much() -> None:
    per_seed = {3: compare(_scores(0.80), _scores(0.80)),
                5: compare(_scores(0.84), _scores(0.84, first_k_base__conversion=0.835))}
    g = parity_goal(per_seed, tol=0.003)
    assert g["met"] is False
    assert g["worst_margin"] == pytest.approx(-0.002)
    assert (g["worst"]["seed"], g["worst"]["eval"], g["worst"]["head"]) == (5, "first_k_base", "conversion")


def test_goal_is_one_sided_a_better_fleet_passes() -> None:
    g = parity_goal({3: compare(_scores(0.80), _scores(0.81))}, tol=0.003)
    assert g["met"] is True and g["worst_margin"] == pytest.approx(0.013)
    assert g["max_abs_diff"] == pytest.approx(0.01)


def test_goal_of_no_seed_is_an_error() -> None:
    with pytest.raises(ValueError, match="no seeds"):
        parity_goal({})


def test_parse_variant_layout_and_overrides() -> None:
    from bench.fleet_quality import parse_variant

    assert parse_variant("order=1x1, controller.dds.batches_per_shard=100000") == (
        "order", 1, 1, ["controller.dds.batches_per_shard=100000"])
    assert parse_variant("sync=ps.sync=sync") == ("sync", None, None, ["ps.sync=sync"])
    assert parse_variant("big=4x3") == ("big", 4, 3, [])


@pytest.mark.parametrize("text", ["nolabel", "=1x1", "x=", "x=0x1", "x=sync"])
def test_parse_variant_refuses_a_bad_spec_in_one_line(text: str) -> None:
    from bench.fleet_quality import parse_variant

    with pytest.raises(SystemExit, match="--variant") as exc:
        parse_variant(text)
    assert "\n" not in str(exc.value)
