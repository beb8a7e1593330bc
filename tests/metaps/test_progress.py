"""metaps.progress: step log lines parsed and tailed, tables rendered from controller status."""

from __future__ import annotations

import io
import logging
from pathlib import Path

import pytest
from rich.console import Console

from common.log import KeyValueFormatter, kv
from metaps.progress import (
    JobEta,
    ProgressDisplay,
    duration_text,
    StepLogTail,
    one_line,
    parse_kv_line,
    render,
)

STATUS = {
    "datasets": [{"dataset": "train", "kind": "train", "epoch": 0, "epochs": 1, "finished": False,
                  "shards_done": 3, "shards_doing": 1, "shards_todo": 1, "shards_total": 5,
                  "batches_done": 12, "batches_total": 17}],
    "nodes": [{"role": "worker", "index": 0, "state": "alive", "slow": False, "step": 7, "restarts": 0,
               "rss_bytes": 300 * 2**20},
              {"role": "worker", "index": 1, "state": "alive", "slow": True, "step": 3, "restarts": 1,
               "rss_bytes": 310 * 2**20}],
    "events": [{"seq": 0, "time": 1e9, "node": "worker:1", "kind": "slow_detected", "evidence": {}, "action": ""}],
    "finished": False,
}


def _line(**fields: object) -> str:
    """A real common.log line, produced by the project's formatter."""
    rec = logging.LogRecord("workers.worker", logging.INFO, __file__, 1, "step", None, None)
    rec.kv = kv(**fields)["kv"]
    return KeyValueFormatter().format(rec)


def test_parse_kv_line_reads_the_log_format() -> None:
    rec = parse_kv_line(_line(rank=1, step=12, loss=0.6931, samples_per_s=250.5))
    assert rec is not None and rec["msg"] == "step"
    assert (rec["rank"], rec["step"], rec["loss"], rec["samples_per_s"]) == (1.0, 12.0, 0.6931, 250.5)
    assert parse_kv_line("Traceback (most recent call last):") is None


def test_step_log_tail_follows_growing_files_and_partial_lines(tmp_path: Path) -> None:
    p = tmp_path / "worker-0.log"
    tail = StepLogTail({0: p, 1: tmp_path / "worker-1.log"})
    tail.poll()  # files missing: nothing, no error
    assert tail.latest() == {} and tail.max_step() == 0
    first, second = _line(rank=0, step=1, loss=0.9, samples_per_s=10.0), _line(rank=0, step=2, loss=0.8,
                                                                               samples_per_s=20.0)
    p.write_text(first + "\nsomething else\n" + second[:20])
    tail.poll()
    assert [h["step"] for h in tail.history[0]] == [1]
    with p.open("a") as fh:
        fh.write(second[20:] + "\n")
    tail.poll()
    assert [h["step"] for h in tail.history[0]] == [1, 2]
    assert tail.latest()[0]["loss"] == 0.8 and tail.max_step() == 2


def test_render_shows_shards_slow_nodes_and_events() -> None:
    console = Console(record=True, width=160)
    console.print(render(STATUS, {0: {"step": 7, "loss": 0.61, "samples_per_s": 123.4}}, 42.0))
    text = console.export_text()
    for needle in ("3/5", "12/17", "worker:1", "SLOW", "slow_detected", "123.4", "0.61", "elapsed 42s"):
        assert needle in text, needle


def test_render_without_status_says_so() -> None:
    console = Console(record=True, width=120)
    console.print(render(None, {}, 1.0))
    assert "controller status unavailable" in console.export_text()


def test_one_line_summary_and_non_terminal_display(caplog: pytest.LogCaptureFixture) -> None:
    s = one_line(STATUS, {0: {"loss": 0.5, "samples_per_s": 10.0}, 1: {"loss": 0.7, "samples_per_s": 5.0}})
    assert s == {"train_shards": "3/5", "samples_per_s": 15.0, "loss": 0.6, "slow": "worker:1", "events": 1}
    display = ProgressDisplay(Console(file=io.StringIO()), live=True, log_every_s=0.0)
    assert display._live is None  # not a terminal: log lines instead of a live view
    with caplog.at_level(logging.INFO, logger="metaps.progress"):
        display.update(STATUS, {}, 3.0)
    display.close()
    rec = [r for r in caplog.records if r.getMessage() == "progress"]
    assert rec and rec[0].kv["train_shards"] == "3/5" and rec[0].kv["slow"] == "worker:1"


def test_live_view_on_a_terminal() -> None:
    buf = io.StringIO()
    display = ProgressDisplay(Console(file=buf, force_terminal=True, width=140), live=True)
    assert display._live is not None
    display.update(STATUS, {0: {"step": 7, "loss": 0.61, "samples_per_s": 123.4}}, 5.0)
    display.close()
    assert "SLOW" in buf.getvalue() and "3/5" in buf.getvalue()


def _cov(done: int, total: int = 400) -> dict[str, object]:
    return {**STATUS, "coverage": {"done_batches": done, "total_batches": total, "complete": False}}


def test_job_eta_is_the_rate_over_the_window_and_restarts_on_a_rollback() -> None:
    eta = JobEta(window_s=10.0)
    first = eta.update(100, 400, now=0.0)
    assert (first.done, first.total, first.pct, first.batches_per_s, first.eta_s) == (100, 400, 25.0, None, None)
    r = eta.update(120, 400, now=10.0)  # 2 batches/s: 280 left -> 140 s
    assert r.batches_per_s == 2.0 and r.eta_s == 140.0 and r.pct == 30.0
    r = eta.update(125, 400, now=20.0)  # slowed to 0.5 batches/s: the window forgets the fast start
    assert r.batches_per_s == 0.5 and r.eta_s == 550.0
    r = eta.update(90, 400, now=21.0)  # a PS recovery rolled work back: no rate until it moves again
    assert r.batches_per_s is None and r.eta_s is None and r.done == 90
    assert eta.update(400, 400, now=30.0).eta_s == 0.0
    assert eta.from_status(STATUS, 31.0) is None  # no coverage yet: no figures, not zeros


def test_duration_text() -> None:
    assert [duration_text(v) for v in (None, 42.4, 185, 3725)] == ["-", "42s", "3m05s", "1h02m"]


def test_log_lines_carry_percent_and_eta_off_a_terminal(caplog: pytest.LogCaptureFixture) -> None:
    display = ProgressDisplay(Console(file=io.StringIO()), live=False, log_every_s=0.0)
    with caplog.at_level(logging.INFO, logger="metaps.progress"):
        display.update(_cov(100), {}, 3.0)
        display.eta._points[-1] = (display.eta._points[-1][0] - 10.0, 100)  # the first reading, 10 s ago
        display.update(_cov(120), {}, 13.0)
    display.close()
    recs = [r.kv for r in caplog.records if r.getMessage() == "progress"]
    assert recs[0]["done"] == "100/400" and recs[0]["pct"] == 25.0 and recs[0]["eta_s"] is None
    last = recs[-1]
    assert last["done"] == "120/400" and last["pct"] == 30.0
    assert 1.9 < last["batches_per_s"] < 2.1 and 130 < last["eta_s"] < 150, last


def test_live_view_draws_the_job_bar() -> None:
    buf = io.StringIO()
    display = ProgressDisplay(Console(file=buf, force_terminal=True, width=140), live=True)
    display.update(_cov(100), {}, 5.0)
    display.close()
    out = buf.getvalue()
    assert "100/400 batches" in out and "25%" in out and "ETA" in out


def test_task_progress_logs_percent_and_eta_off_a_terminal(caplog: pytest.LogCaptureFixture) -> None:
    from metaps.progress import TaskProgress

    with caplog.at_level(logging.INFO, logger="metaps.progress"):
        with TaskProgress("rows scored", total=1000, console=Console(file=io.StringIO()), log_every_s=0.0) as p:
            p.update(250)
            p.eta._points[0] = (p.eta._points[0][0] - 5.0, 250)  # the first reading, 5 s ago
            p.update(500)
    recs = [r.kv for r in caplog.records if r.getMessage() == "progress"]
    assert recs[-1]["what"] == "rows scored" and recs[-1]["pct"] == 50.0 and recs[-1]["total"] == 1000
    assert 9 < recs[-1]["eta_s"] < 11, recs[-1]  # 250 rows in 5 s: 500 left -> 10 s
    with caplog.at_level(logging.INFO, logger="metaps.progress"):
        with TaskProgress("rows", total=None, console=None, log_every_s=0.0) as p:
            p.update(10)
    last = [r.kv for r in caplog.records if r.getMessage() == "progress"][-1]
    assert last["done"] == 10 and "pct" not in last and "eta_s" not in last  # unknown total: a count and a rate


def test_task_progress_draws_a_bar_on_a_terminal() -> None:
    from metaps.progress import TaskProgress

    buf = io.StringIO()
    with TaskProgress("rows scored", total=1000, console=Console(file=buf, force_terminal=True, width=120)) as p:
        p.update(400)
    assert "rows scored" in buf.getvalue() and "40%" in buf.getvalue() and "400/1,000" in buf.getvalue()
