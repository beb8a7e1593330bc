"""Run an Agent as its own process with the CLI's SIGTERM handling (agent tests)."""

import signal
import sys

from controller.agent import Agent
from controller.config import AgentConfig
from common.rpc import RpcConfig

if __name__ == "__main__":
    addr, token, index = sys.argv[1], sys.argv[2], int(sys.argv[3])
    child = sys.argv[4:]
    agent = Agent(AgentConfig(heartbeat_s=0.1, backoff_s=0.1, stop_grace_s=5.0), "worker", index, addr,
                  RpcConfig(token=token), child)
    signal.signal(signal.SIGTERM, lambda *_: agent.stop())
    sys.exit(agent.run())
