"""ClaimWorker: pod name -> worker index for a Kubernetes work-queue Job (real controller, real LMDB)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import pytest

from controller.client import ControllerError
from tests.controller.conftest import RPC, client


def test_same_name_same_index_new_name_next_dead_index_reused(controller: Callable[..., Any]) -> None:
    srv = controller()
    c = client(srv, register=False)
    assert c.claim_worker("metaps-worker-aaaaa") == 0
    assert c.claim_worker("metaps-worker-bbbbb") == 1
    assert c.claim_worker("metaps-worker-aaaaa") == 0          # a restarted container keeps its id
    w0 = client(srv, index=0)                                   # worker 0 registers, takes a shard, dies
    lease = next(iter(w0.shards("train", poll_s=0.01)))
    assert c.claim_worker("metaps-worker-ccccc") == 2          # 0 and 1 are live (1: claimed, starting)
    assert w0.node_down("worker", 0, "SIGTERM (pod deleted or scaled down)", 143) == [lease.shard_id]
    assert c.claim_worker("metaps-worker-ddddd") == 0          # the leaver's index goes to the newcomer
    assert c.claim_worker("metaps-worker-aaaaa") == 3          # the old holder lost it: a fresh one
    c.close()
    w0.close()


def test_claims_survive_a_controller_restart(controller: Callable[..., Any], tmp_path: Path) -> None:
    srv = controller(state_dir=tmp_path / "st")
    c = client(srv, register=False)
    assert [c.claim_worker(f"w-{i}") for i in range(3)] == [0, 1, 2]
    c.close()
    srv.stop(grace=0)
    srv2 = controller(state_dir=tmp_path / "st")
    c2 = client(srv2, register=False)
    assert c2.claim_worker("w-1") == 1 and c2.claim_worker("w-new") == 3
    c2.close()


@pytest.mark.parametrize("name", ["", "-lead", "a b", "x" * 300])
def test_a_bad_pod_name_is_refused_and_claims_nothing(controller: Callable[..., Any], name: str) -> None:
    srv = controller()
    c = client(srv, register=False)
    with pytest.raises(ControllerError) as e:
        c.claim_worker(name)
    assert e.value.code.name == "INVALID_ARGUMENT" and "is not a pod name" in str(e.value)
    assert c.claim_worker("ok-0") == 0
    c.close()
