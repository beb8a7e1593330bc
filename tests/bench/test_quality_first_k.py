"""bench.quality's --first-k list and --baseline-offset-prior: parsing, and the per-K summary over
seeds (pure functions; the first-k layout itself is tested row by row in tests/workers)."""

from __future__ import annotations

import pytest

from bench.quality import first_k_summary, main, parse_first_k


def test_parse_first_k() -> None:
    assert parse_first_k("8") == [8]
    assert parse_first_k("4,8,16,32") == [4, 8, 16, 32]
    assert parse_first_k("0") == [] and parse_first_k("") == []
    for bad in ("4,x", "4,4", "-1", "0,8"):
        with pytest.raises(SystemExit, match="--first-k"):
            parse_first_k(bad)


def _seed(gains: dict[int, tuple[float, float, float, float]]) -> dict:
    return {"first_k_by_k": {k: {"click_adapted_minus_base": a, "conversion_adapted_minus_base": b,
                                 "click_adapted_minus_plain_finetuned": c,
                                 "conversion_adapted_minus_plain_finetuned": d}
                             for k, (a, b, c, d) in gains.items()}}


def test_first_k_summary_spreads_and_goals_per_k() -> None:
    per = [_seed({4: (0.03, 0.02, 0.01, 0.01), 8: (0.025, 0.011, 0.002, -0.001)}),
           _seed({4: (0.021, 0.012, 0.003, 0.004), 8: (0.019, 0.03, 0.001, 0.002)}),
           _seed({4: (0.02, 0.01, 0.001, 0.001), 8: (0.04, 0.02, 0.003, 0.004)})]
    out = first_k_summary(per, [4, 8])
    assert out[4]["click_adapted_minus_base"] == {"median": 0.021, "min": 0.02, "max": 0.03}
    assert out[8]["conversion_adapted_minus_plain_finetuned"] == {"median": 0.002, "min": -0.001, "max": 0.004}
    assert out[4]["goals_met_every_seed"] == {"click_adapted_minus_base>=0.02": True,
                                              "conversion_adapted_minus_base>=0.01": True,
                                              "adapted>plain_finetuned(both heads)": True}
    # one seed below the click goal, one seed with plain + ft ahead on conversion
    assert out[8]["goals_met_every_seed"] == {"click_adapted_minus_base>=0.02": False,
                                              "conversion_adapted_minus_base>=0.01": True,
                                              "adapted>plain_finetuned(both heads)": False}


def test_bad_first_k_flag_fails_before_any_work(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit, match="--first-k"):
        main(["--quick", "--cold-only", "--seeds", "3", "--first-k", "8,x"])


def test_bad_baseline_prior_fails_before_any_work() -> None:
    with pytest.raises(SystemExit, match="--baseline-offset-prior: expected lambda > 0, got 0.0"):
        main(["--quick", "--cold-only", "--seeds", "3", "--baseline-offset-prior", "0"])
