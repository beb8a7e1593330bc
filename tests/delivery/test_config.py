"""DeliveryConfig validation and interval parsing."""

from __future__ import annotations

from pathlib import Path

import pytest

from delivery.config import DeliveryConfig, RowDtype, parse_interval
from common.config import from_mapping
from common.errors import ConfigError


def test_parse_interval_units():
    assert parse_interval("10m") == 600.0
    assert parse_interval("1.5h") == 5400.0
    assert parse_interval("45") == 45.0
    assert parse_interval("250ms") == 0.25
    for bad in ("", "soon", "-5m", "0s", "10 minutes"):
        with pytest.raises(ValueError, match="interval"):
            parse_interval(bad)


def test_config_from_toml_mapping_and_errors():
    cfg = from_mapping(DeliveryConfig, {"out": "b", "dtype": "fp16", "every": "10m", "keep": 3}, where="job.toml")
    assert cfg.out == Path("b") and cfg.dtype is RowDtype.FP16 and cfg.every_s == 600.0
    with pytest.raises(ConfigError, match=r"job.toml: .*keep must be >= 1, got 0"):
        from_mapping(DeliveryConfig, {"out": "b", "keep": 0}, where="job.toml")
    with pytest.raises(ConfigError, match=r"'dtype': expected one of \['fp32', 'fp16'\]"):
        from_mapping(DeliveryConfig, {"out": "b", "dtype": "int8"}, where="job.toml")
    with pytest.raises(ConfigError, match=r"max_auc_drop must be in \[0, 1\]"):
        from_mapping(DeliveryConfig, {"out": "b", "max_auc_drop": 2.0}, where="job.toml")
