"""A small "trainer" process for liveness tests: leases train shards, one step per batch.

Like ``workers/worker.py`` it heartbeats from a thread (with its step) and reports
every step (ReportMetrics with a batch time) and every shard. Appends its pid to
``pidfile`` when it starts.

    python -m tests.controller.proc_trainer ADDR TOKEN INDEX PIDFILE [STEP_S]
"""

import os
import sys
import threading
import time

from controller.client import ControllerClient
from common.rpc import RpcConfig

if __name__ == "__main__":
    addr, token, index, pidfile = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    step_s = float(sys.argv[5]) if len(sys.argv) > 5 else 0.05
    c = ControllerClient(addr, RpcConfig(token=token, timeout_s=10.0), role="worker", index=index)
    reg = c.register()
    with open(pidfile, "a") as fh:
        fh.write(f"{os.getpid()}\n")
    step = 0

    def beat() -> None:
        while True:
            try:
                c.heartbeat(step=step)
            except Exception:  # the controller may be busy; keep going
                pass
            time.sleep(reg.heartbeat_s)

    threading.Thread(target=beat, daemon=True).start()
    for lease in c.shards("train", poll_s=0.05):
        for _ in range(lease.start, lease.stop):
            time.sleep(step_s)
            step += 1
            c.report_metrics(batch_times_s=[step_s], samples_per_s=64 / step_s)
        c.report_shard(lease, "done", samples=64 * (lease.stop - lease.start))
