"""Job files: every section parsed and validated; errors name the file and the key."""

from __future__ import annotations

from pathlib import Path

import pytest

from common.config import from_mapping, load_toml
from common.errors import ConfigError
from metaps.job import load_job
from common.rpc import RpcConfig

REPO = Path(__file__).resolve().parents[2]


def _write(tmp: Path, text: str) -> Path:
    p = tmp / "job.toml"
    p.write_text(text)
    return p


def test_example_configs_load() -> None:
    for path in sorted((REPO / "configs").glob("*.toml")):
        if path.name.startswith("schema"):
            continue
        job = load_job(path)
        assert job.source == str(path)
        assert job.ps.shards >= 1 and job.train.workers >= 1


def test_defaults_and_overrides(tmp_path: Path) -> None:
    p = _write(tmp_path, '[data]\ntrain = "x"\n[ps]\nshards = 3\n[train]\nmode = "plain"\n')
    job = load_job(p, overrides={"train": {"workers": 5}})
    assert job.ps.shards == 3
    assert job.train.mode.value == "plain" and job.train.workers == 5
    assert job.to_dict()["ps"]["shards"] == 3


@pytest.mark.parametrize(
    "text,needle",
    [
        ('[data]\ntrain = "x"\n[ps]\nshardz = 2\n', "unknown key 'ps.shardz'"),
        ('[data]\ntrain = "x"\n[ps]\nshards = "two"\n', "key 'ps.shards': expected int, got str"),
        ('[data]\ntrain = "x"\n[train]\nmode = "metta"\n', "key 'train.mode': expected one of"),
        ('[data]\ntrain = "x"\n[bogus]\nx = 1\n', "unknown section(s) ['bogus']"),
        ('[data]\ntrain = "x"\n[ps.table_defaults]\ndim = 6\n', "multiple of 4"),
        ('[data]\ntrain = ""\n', "data.train"),
        ('[data]\ntrain = "x"\n[ps\n', "invalid TOML"),
    ],
)
def test_bad_job_files_name_file_and_key(tmp_path: Path, text: str, needle: str) -> None:
    p = _write(tmp_path, text)
    with pytest.raises(ConfigError) as exc:
        load_job(p)
    assert str(p) in str(exc.value)
    assert needle in str(exc.value)


def test_missing_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="config file not found"):
        load_job(tmp_path / "nope.toml")


def test_frozen_and_validated() -> None:
    cfg = from_mapping(RpcConfig, {"token": "t", "timeout_s": 3.0})
    with pytest.raises(Exception):
        cfg.token = "other"  # type: ignore[misc]
    with pytest.raises(ConfigError, match="timeout_s must be > 0"):
        from_mapping(RpcConfig, {"timeout_s": 0.0}, where="x.toml", prefix="rpc")


def test_load_toml_section(tmp_path: Path) -> None:
    p = _write(tmp_path, '[rpc]\ntoken = "abc"\nmax_message_bytes = 2048\n')
    assert load_toml(RpcConfig, p, section="rpc").max_message_bytes == 2048


def test_parsing_a_job_file_imports_no_torch() -> None:
    """Every section's config is torch-free: the controller, agents and `metaps --help` parse
    job files without paying for torch/fbgemm (and metaps.job imports them at the top)."""
    import subprocess
    import sys

    code = ("import sys; from metaps.job import load_job; load_job('configs/local.toml'); "
            "print(sorted(m for m in ('torch', 'fbgemm_gpu') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[2],
                         capture_output=True, text=True, timeout=120, check=True).stdout.strip()
    assert out == "[]", f"parsing a job imported {out}"
