"""A controller process for the durable-recovery tests: dies (``os._exit(137)``, no shutdown
path) when its PS recovery reaches a chosen step, after that step's record is durable.

argv: state_dir port token crash_at heartbeat_timeout_s
crash_at: '' (never), ``pause``, ``restored:K`` (after shard K's restore), ``rolled_back``, ``resume``.
"""

import os
import sys
from typing import Any

from controller.config import ControllerConfig, DdsConfig
from controller.server import ControllerServer
from controller.types import DatasetKind, DatasetSpec
from common.rpc import RpcConfig
from ps.fleet_admin import GrpcPsFleet

TRAIN = DatasetSpec("train", (8, 8), DatasetKind.TRAIN, epochs=1)


def main() -> None:
    state_dir, port, token, crash_at, hb = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4], float(sys.argv[5])
    cfg = ControllerConfig(tick_s=0.05, heartbeat_timeout_s=hb, dds=DdsConfig(batches_per_shard=2, lease_s=30.0))
    rpc = RpcConfig(token=token, timeout_s=5.0)
    srv = ControllerServer(cfg, state_dir, [TRAIN], rpc, ps_fleet=GrpcPsFleet(rpc))
    what, _, shard = crash_at.partition(":")

    def hook(step: str, detail: dict[str, Any]) -> None:
        if step == what and (not shard or str(detail.get("shard")) == shard):
            print(f"crashing at {crash_at}", flush=True)
            os._exit(137)

    if crash_at:
        srv.recovery.fault_hook = hook
    srv.start(f"127.0.0.1:{port}")
    print("ready", flush=True)
    srv.wait()
    srv.stop()


if __name__ == "__main__":
    main()
