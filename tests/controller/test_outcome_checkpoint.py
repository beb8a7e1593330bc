"""The run's outcome names the final checkpoint (issue 39, item 4).

The controller's termination message and ``metaps status`` named the newest committed cut.
When the leader (worker 0) has written the final checkpoint and finished, the next live
worker is the leader and may still commit an interval cut, named by its own, lower step
(ckpt-134 after the final ckpt-141): automation reading the outcome took a model 7 steps
old. Now the outcome names the cut the leader reported as final. Real controller over gRPC
on 127.0.0.1, real LMDB; the summary and termination message as ``metaps controller`` writes
them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

from controller.checkpoint import FINAL_CUT
from controller.run_outcome import outcome_checkpoint
from controller.server import ControllerServer
from controller.types import NODE_FINISHED
from metaps.roles.controller import _write_termination_log, status_summary
from tests.controller.conftest import client, drain


def test_the_outcome_names_the_final_checkpoint_not_a_cut_committed_after_it(
        controller: Callable[..., ControllerServer], tmp_path: Path) -> None:
    srv = controller()
    w0, w1 = client(srv, 0), client(srv, 1)
    mid = srv.trigger_checkpoint()  # an interval cut while training: the leader (worker 0) takes it
    w0.checkpoint_done(mid, 120, "/ckpt/ckpt-120")
    running = status_summary(w0.status())[0]
    assert (running["checkpoint"], running["checkpoint_final"]) == ("/ckpt/ckpt-120", False)  # before the final one
    drain(w0, "train")
    drain(w0, "eval")
    w0.checkpoint_done(FINAL_CUT, 141, "/ckpt/ckpt-141")  # the leader's final checkpoint
    w0.node_down("worker", 0, NODE_FINISHED, 0)
    assert srv.outcome.leader() == 1  # worker 1, still waiting for the run's end, leads now
    late = srv.trigger_checkpoint()  # the interval elapses again; the new leader takes the cut at its step
    w1.checkpoint_done(late, 134, "/ckpt/ckpt-134")
    w1.node_down("worker", 1, NODE_FINISHED, 0)
    srv.tick()
    st = w0.status()
    assert st["run"]["state"] == "complete"
    assert [c["dir"] for c in st["checkpoints"] if c["state"] == "committed"][-1] == "/ckpt/ckpt-134"

    summary, lines = status_summary(st)
    assert (summary["checkpoint"], summary["checkpoint_step"], summary["checkpoint_final"]) == \
        ("/ckpt/ckpt-141", 141, True), summary
    assert any(line.startswith("checkpoint  /ckpt/ckpt-141 (") and line.endswith("step 141, final)")
               for line in lines), lines
    term = tmp_path / "termination-log"
    _write_termination_log(term, summary)
    outcome = json.loads(term.read_text())
    assert (outcome["run"], outcome["checkpoint"], outcome["checkpoint_step"], outcome["checkpoint_final"]) == \
        ("complete", "/ckpt/ckpt-141", 141, True), outcome


def test_without_a_final_checkpoint_the_newest_committed_cut_is_named() -> None:
    cuts = [{"cut_id": 1, "state": "committed", "dir": "a", "step": 3},
            {"cut_id": 2, "state": "committed", "dir": "b", "step": 5},
            {"cut_id": 3, "state": "pending", "dir": "", "step": -1}]
    got = outcome_checkpoint(cuts)
    assert got is not None and got["dir"] == "b"
    assert outcome_checkpoint([cuts[2]]) is None and outcome_checkpoint([]) is None
