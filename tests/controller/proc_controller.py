"""Run a controller as its own process for restart tests (built from plain objects)."""

import sys

from controller.config import ControllerConfig, DdsConfig
from controller.types import DatasetKind, DatasetSpec
from controller.server import ControllerServer
from common.rpc import RpcConfig
from ps.fleet_admin import GrpcPsFleet

if __name__ == "__main__":
    state_dir, port, token = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    cfg = ControllerConfig(tick_s=0.05, dds=DdsConfig(batches_per_shard=2, lease_s=3.0))
    datasets = [DatasetSpec("train", (40, 40), DatasetKind.TRAIN, epochs=2), DatasetSpec("eval", (20,), DatasetKind.EVAL)]
    srv = ControllerServer(cfg, state_dir, datasets, RpcConfig(token=token), ps_fleet=GrpcPsFleet(RpcConfig(token=token)))
    srv.start(f"127.0.0.1:{port}")
    print("ready", flush=True)
    srv.wait()
    srv.stop()
