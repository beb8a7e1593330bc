"""Identity from the environment: Indexed Job indexes and hostnames, PS address specs."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from metaps.deploy.identity import completion_index, pod_name, ps_addresses, registered_ps_addresses, resolve_shard
from common.errors import ConfigError


def test_shard_auto_is_the_statefulset_ordinal() -> None:
    assert resolve_shard("auto", 4, hostname="metaps-ps-3", env={}) == 3
    assert resolve_shard("auto", 12, hostname="job-a-ps-11", env={}) == 11
    assert resolve_shard("2", 4) == 2


def test_shard_auto_in_an_indexed_job_is_the_completion_index() -> None:
    # an Indexed Job pod is named NAME-ps-K-<random>: the index, not the name, is the shard
    assert resolve_shard("auto", 4, hostname="metaps-ps-1-x7k2p", env={"JOB_COMPLETION_INDEX": "2"}) == 2
    with pytest.raises(ConfigError, match=r"\$JOB_COMPLETION_INDEX 4\) out of range: \[ps\] shards = 4"):
        resolve_shard("auto", 4, env={"JOB_COMPLETION_INDEX": "4"})


@pytest.mark.parametrize("value,host,msg", [
    ("auto", "metaps-ps", "does not end in -<ordinal>"),
    ("auto", "metaps-ps-4", "--shard auto (pod metaps-ps-4) out of range: [ps] shards = 4"),
    ("-1", None, "--shard -1 out of range"),
    ("x", None, "expected a shard index or 'auto'"),
])
def test_bad_shard_is_one_clear_error(value: str, host: str | None, msg: str) -> None:
    with pytest.raises(ConfigError, match=msg.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")
                       .replace("]", r"\]")):
        resolve_shard(value, 4, hostname=host, env={})


def test_pod_name_prefers_the_downward_api_value() -> None:
    assert pod_name({"METAPS_POD_NAME": "metaps-ps-1", "HOSTNAME": "other"}) == "metaps-ps-1"
    assert pod_name({"HOSTNAME": "metaps-ps-0"}) == "metaps-ps-0"


def test_completion_index() -> None:
    assert completion_index({"JOB_COMPLETION_INDEX": "5"}) == 5
    with pytest.raises(ConfigError, match="needs \\$JOB_COMPLETION_INDEX"):
        completion_index({})


def test_ps_address_specs() -> None:
    assert ps_addresses("metaps-ps-{k}.metaps-ps:5000", 2) == ["metaps-ps-0.metaps-ps:5000",
                                                               "metaps-ps-1.metaps-ps:5000"]
    assert ps_addresses("a:1,b:2", 2) == ["a:1", "b:2"]
    with pytest.raises(ConfigError, match="1 address\\(es\\) for \\[ps\\] shards = 2"):
        ps_addresses("a:1", 2)
    with pytest.raises(ConfigError, match="no PS addresses"):
        ps_addresses("", 2)
    calls: Iterator[Exception | list[str]] = iter([ValueError("PS shard(s) [1] have not registered"), ["h0:1"],
                                                   ["h0:1", "h1:1"]])

    def from_ctl() -> list[str]:
        v = next(calls)
        if isinstance(v, Exception):
            raise v
        return v

    assert ps_addresses("controller", 2, from_ctl, wait_s=30) == ["h0:1", "h1:1"]
    with pytest.raises(ConfigError, match="does not know every PS shard after 0s: 1 of 2"):
        ps_addresses("controller", 2, lambda: ["h0:1"], wait_s=0)


def test_registered_ps_addresses_from_status() -> None:
    st = {"nodes": [{"role": "worker", "index": 0, "address": ""},
                    {"role": "ps", "index": 1, "address": "p1:5000"}, {"role": "ps", "index": 0, "address": "p0:5000"}]}
    assert registered_ps_addresses(st) == ["p0:5000", "p1:5000"]
    with pytest.raises(ValueError, match="\\[0\\] have not registered"):
        registered_ps_addresses({"nodes": [{"role": "ps", "index": 1, "address": "p1:5000"}]})


def _job(tmp_path: Path, dense_sync: str = "ps") -> Any:
    from metaps.job import load_job
    from common.toml_writer import write

    p = write(tmp_path / "job.toml", {"data": {"train": "metaio/train"}, "ps": {"shards": 2},
                                       "train": {"workers": 3, "dense_sync": dense_sync}})
    return load_job(p)


def test_worker_rank_from_the_indexed_job(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from metaps.deploy.pod import resolve_worker

    job = _job(tmp_path, "allreduce")
    monkeypatch.setenv("JOB_COMPLETION_INDEX", "2")
    assert resolve_worker(job, "job.toml", "auto", "w-{k}.ps:5000", "") == (2, ["w-0.ps:5000", "w-1.ps:5000"])
    monkeypatch.setenv("JOB_COMPLETION_INDEX", "3")
    with pytest.raises(ConfigError, match="JOB_COMPLETION_INDEX 3 out of range: \\[train\\] workers = 3"):
        resolve_worker(job, "job.toml", "auto", "a:1,b:2", "")


def test_worker_rank_errors(tmp_path: Path) -> None:
    from metaps.deploy.pod import resolve_worker

    job = _job(tmp_path)
    with pytest.raises(ConfigError, match="--rank auto \\(PS mode\\): the controller gives the index"):
        resolve_worker(job, "job.toml", "auto", "a:1,b:2", "")
    with pytest.raises(ConfigError, match="job.toml: --rank 3 out of range: \\[train\\] workers = 3"):
        resolve_worker(job, "job.toml", "3", "a:1,b:2", "")
    assert resolve_worker(job, "job.toml", "1", "a:1,b:2", "") == (1, ["a:1", "b:2"])
