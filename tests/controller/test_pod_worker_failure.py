"""A pod's worker that fails (no agent watches it) reports itself down before it exits.

Seen in the pods harness: a worker whose push passed its deadline exited 1, and the
controller, whose heartbeat timeout was minutes, kept it alive as the checkpoint leader, so
the run could not end. :func:`metaps.deploy.pod.leave_on_failure` against a real controller:
the failed worker's lease is requeued, it is no longer live, and the lead moves to a live worker.
"""

from __future__ import annotations

from types import SimpleNamespace

from metaps.deploy.pod import leave_on_failure

from .conftest import RPC, client


def test_a_failed_pod_worker_hands_back_its_lease_and_the_lead(controller) -> None:
    srv = controller()
    w0, w1 = client(srv, index=0), client(srv, index=1)
    try:
        lease = w0.get_shard("train").lease
        assert srv.status()["run"]["leader"] == 0
        requeued = leave_on_failure(SimpleNamespace(rpc=RPC), 0, srv.address,
                                    "worker failed: shard 0 refused push: DEADLINE_EXCEEDED")
        assert requeued == [lease.shard_id]
        nodes = {(n["role"], n["index"]): n for n in srv.status()["nodes"]}
        assert nodes[("worker", 0)]["state"] == "dead" and nodes[("worker", 1)]["state"] == "alive"
        assert srv.status()["run"]["leader"] == 1  # the lead went to the live worker
        assert w1.get_shard("train").lease.shard_id == lease.shard_id  # its shard, handed out again
        down = [e for e in srv.status()["events"] if e["kind"] == "node_down" and e["node"] == "worker:0"]
        assert down and "DEADLINE_EXCEEDED" in down[-1]["evidence"]["reason"]
        # a controller that cannot be reached: one error line, no exception (it finds out by timeout)
        assert leave_on_failure(SimpleNamespace(rpc=RPC), 1, "127.0.0.1:1", "x") == []
    finally:
        w0.close()
        w1.close()
