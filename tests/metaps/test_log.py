"""Structured log lines: key=value fields; third-party INFO on the root logger is dropped."""

from __future__ import annotations

import logging

from common.log import KeyValueFormatter, _DropRootInfo, kv


def _record(name: str, level: int, msg: str, **fields) -> logging.LogRecord:
    rec = logging.LogRecord(name, level, __file__, 1, msg, None, None)
    if fields:
        rec.kv = fields
    return rec


def test_key_value_format() -> None:
    line = KeyValueFormatter().format(_record("ps.servicer", logging.INFO, "serving", port=5001, shard=0))
    assert 'INFO ps.servicer' in line and 'msg="serving"' in line and line.endswith("port=5001 shard=0")


def test_root_info_is_dropped_but_warnings_and_named_loggers_pass() -> None:
    f = _DropRootInfo()
    assert not f.filter(_record("root", logging.INFO, "Successfully loaded: 'fbgemm_gpu_py.so'"))
    assert f.filter(_record("root", logging.WARNING, "something real"))
    assert f.filter(_record("workers.worker", logging.INFO, "step"))


def test_kv_helper() -> None:
    assert kv(a=1) == {"kv": {"a": 1}}


def test_log_lines_follow_the_current_stderr_after_the_old_one_closed(monkeypatch) -> None:
    """configure() under a replaced stderr (a test's capture) that is later closed: later records go
    to the stderr of their time, with no "--- Logging error ---" report (it flooded a later test's
    captured stderr with 869 lines)."""
    import io
    import logging
    import sys

    from common import log as mlog

    root = logging.getLogger()
    saved = list(root.handlers)
    for h in saved:
        root.removeHandler(h)
    first = io.StringIO()
    monkeypatch.setattr(sys, "stderr", first)
    try:
        mlog.configure("INFO")
        first.close()
        second = io.StringIO()
        monkeypatch.setattr(sys, "stderr", second)
        logging.getLogger("metaps.test").warning("after the close")
        assert 'msg="after the close"' in second.getvalue() and "Logging error" not in second.getvalue()
    finally:
        for h in list(root.handlers):
            root.removeHandler(h)
        for h in saved:
            root.addHandler(h)


def test_values_with_spaces_quotes_or_equals_read_back_as_one_field() -> None:
    """A reason with spaces (``reason=the PS died``) used to split into words; quoted logfmt-style,
    every value reads back whole through the parser the launcher's log tail uses."""
    from metaps.progress import parse_kv_line

    fields = {"reason": "the PS died", "what": "rows scored", "path": "/tmp/a b/c", "quote": 'say "hi"',
              "eq": "a=b", "back": "C:\\x\\n", "multi": "line one\nline two", "plain": "ok", "n": 5, "empty": ""}
    line = KeyValueFormatter().format(_record("metaps.x", logging.INFO, 'done "now"', **fields))
    assert "\n" not in line and "plain=ok" in line and "n=5" in line and 'reason="the PS died"' in line
    rec = parse_kv_line(line)
    assert rec is not None
    assert rec["msg"] == 'done "now"'
    assert {k: rec[k] for k in fields if k != "n"} == {k: v for k, v in fields.items() if k != "n"}
    assert rec["n"] == 5.0
