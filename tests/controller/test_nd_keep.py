"""``[controller.nd] keep``: a validated, documented key that the product's PsMover uses."""

from __future__ import annotations

from pathlib import Path

import pytest

from controller.config import NdConfig
from common.errors import ConfigError


def test_keep_defaults_to_one_and_rejects_negative() -> None:
    assert NdConfig().keep == 1
    NdConfig(keep=0).validate()
    with pytest.raises(ValueError, match=r"nd\.keep must be >= 0, got -1"):
        NdConfig(keep=-1).validate()


def _job(tmp: Path, keep: str) -> Path:
    schema = tmp / "schema.json"
    schema.write_text('{"version": 1, "task_key": "user_id", "labels": ["click"], "columns": ['
                      '{"name": "user_id", "kind": "sparse", "table": "user"}, {"name": "click", "kind": "label"}]}')
    p = tmp / "job.toml"
    p.write_text(f'[data]\ntrain = "unused"\nschema = "{schema}"\n[delivery]\nout = "unused"\n'
                 f'[controller.nd]\nkeep = {keep}\n')
    return p


def test_keep_comes_from_the_job_file(tmp_path: Path) -> None:
    from metaps.job import load_job

    assert load_job(str(_job(tmp_path, "0"))).controller.nd.keep == 0
    with pytest.raises(ConfigError, match="keep"):
        load_job(str(_job(tmp_path, "-2")))
