"""A progress hook for tests (``common.eta.ProgressHook``): records every reading and checks a stage."""

from __future__ import annotations


class Recorder:
    """A progress hook that keeps every reading: (stage, done, total)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int, int]] = []

    def __call__(self, stage: str, done: int, total: int) -> None:
        self.calls.append((str(stage), done, total))

    def stages(self) -> list[str]:
        out: list[str] = []
        for s, _d, _t in self.calls:
            if not out or out[-1] != s:
                out.append(s)
        return out

    def of(self, stage: str) -> list[tuple[int, int]]:
        return [(d, t) for s, d, t in self.calls if s == stage]


def check_stage(readings: list[tuple[int, int]], total: int) -> None:
    """Starts at 0, never goes down, the total fixed, ends at the total."""
    assert readings[0][0] == 0 and readings[-1] == (total, total), readings
    assert all(t == total for _d, t in readings), readings
    assert all(b[0] >= a[0] for a, b in zip(readings, readings[1:])), readings
