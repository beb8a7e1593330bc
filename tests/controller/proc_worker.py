"""A tiny worker process for tests: register, lease one shard, print it, then hang."""

import sys
import time

from controller.client import ControllerClient
from common.rpc import RpcConfig

if __name__ == "__main__":
    addr, token, index, dataset = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    c = ControllerClient(addr, RpcConfig(token=token), role="worker", index=index)
    c.register()
    lease = c.get_shard(dataset).lease
    print(lease.shard_id, flush=True)
    while True:  # "training" until killed
        c.heartbeat(step=1)
        time.sleep(0.1)
