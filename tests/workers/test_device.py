"""``[train] device``: validated in the config, resolved on this machine, used by train-local."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from common.errors import ConfigError, MetapsError
from workers.config import resolve_device
from workers.local import local_store, train_local

from tests.workers.conftest import make_job


@pytest.mark.parametrize("bad", ["gpu", "cuda:", "cuda:x", "CPU", ""])
def test_bad_device_names_the_key(worker_data, tmp_path: Path, bad: str) -> None:
    with pytest.raises(ConfigError, match=r"device must be 'cpu', 'cuda', 'cuda:N' or 'auto'") as err:
        make_job(worker_data["meta"], tmp_path, train={"device": bad})
    assert "train" in str(err.value) and "\n" not in str(err.value)


def test_devices_resolve_on_this_machine(worker_data, tmp_path: Path) -> None:
    assert resolve_device("cpu") == "cpu"
    assert resolve_device("auto") == ("cuda" if torch.cuda.is_available() else "cpu")
    job = make_job(worker_data["meta"], tmp_path, train={"device": "auto"})
    assert local_store(job).device == resolve_device("auto")
    if torch.cuda.is_available():
        assert resolve_device("cuda") == "cuda"
        assert local_store(make_job(worker_data["meta"], tmp_path, train={"device": "cuda"})).device == "cuda"
        n = torch.cuda.device_count()
        with pytest.raises(ConfigError, match=f"has {n} CUDA device"):
            resolve_device(f"cuda:{n}")
        return
    # CPU-only machine: asking for CUDA is a one-line ConfigError before any training
    job = make_job(worker_data["meta"], tmp_path, train={"device": "cuda", "max_steps": 1})
    for spec in ("cuda", "cuda:1"):
        with pytest.raises(ConfigError, match=r"\[train\] device = 'cuda.*torch.cuda.is_available\(\) is False") as err:
            resolve_device(spec)
        assert "\n" not in str(err.value) and isinstance(err.value, MetapsError)
    with pytest.raises(ConfigError, match="is_available"):
        train_local(job, tmp_path / "run", checkpoint=False)
    assert not (tmp_path / "run").exists()
