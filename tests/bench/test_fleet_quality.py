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


def test_local_spread_is_the_range_and_std_over_shuffles_and_places_the_fleet() -> None:
    from bench.fleet_quality import local_spread

    runs = {3: {0: _scores(0.80), 1: _scores(0.78, all__conversion=0.70), 2: _scores(0.76)},
            4: {0: _scores(0.70), 1: _scores(0.70)}}
    fleet = {3: compare(_scores(0.80), _scores(0.77)), 4: compare(_scores(0.70), _scores(0.71))}
    out = local_spread(runs, fleet)
    cell = out["per_seed"][3]["all"]["click"]
    assert cell["min"] == pytest.approx(0.76) and cell["max"] == pytest.approx(0.80)
    assert cell["range"] == pytest.approx(0.04) and cell["std"] == pytest.approx(0.02)  # ddof 1
    assert out["per_seed"][3]["all"]["conversion"]["min"] == pytest.approx(0.70)
    assert out["per_seed"][4]["all"]["click"]["range"] == 0.0
    assert out["summary"]["all"]["click"]["mean_std"] == pytest.approx(0.01)
    assert out["summary"]["all"]["conversion"]["max_range"] == pytest.approx(0.10)
    # the fleet against train-local's mean over orders: seed 3 0.77 - 0.78, seed 4 0.71 - 0.70
    assert cell["mean"] == pytest.approx(0.78) and cell["fleet_minus_mean"] == pytest.approx(-0.01)
    assert out["summary"]["all"]["click"]["fleet_minus_mean"] == pytest.approx(0.0)
    assert out["summary"]["all"]["conversion"]["fleet_minus_mean"] == pytest.approx(((0.77 - (0.80 + 0.70 + 0.76) / 3) + 0.01) / 2)
    # seed 3: 0.77 lies inside every [0.76 or 0.70, 0.80] cell; seed 4: 0.71 is outside [0.70, 0.70]
    assert (out["fleet_in_range"], out["cells"]) == (len(EVALS) * len(HEADS), 2 * len(EVALS) * len(HEADS))


def test_local_spread_of_one_shuffle_is_an_error() -> None:
    from bench.fleet_quality import local_spread
    from common.errors import MetapsError

    with pytest.raises(MetapsError, match="seed 3 has 1 train-local shuffle"):
        local_spread({3: {0: _scores(0.8)}}, {})
