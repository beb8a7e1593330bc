"""workers.dd.BatchPlans: a plan is adopted only at a step where every worker holds it."""

from __future__ import annotations

import pytest

from workers.dd import BatchPlans, DdInvariantError, equal_split


def test_plan_zero_is_the_equal_split() -> None:
    assert equal_split(3, 100) == {0: 34, 1: 33, 2: 33}
    assert [BatchPlans(r, 3, 100).size for r in range(3)] == [34, 33, 33]


def test_switch_waits_until_every_worker_holds_the_plan() -> None:
    w0, w1 = BatchPlans(0, 2, 96), BatchPlans(1, 2, 96)
    w0.receive(5, 64)                        # worker 1's command is still in flight
    for p in (w0, w1):
        p.agree([w0.latest, w1.latest], step=1)
    assert (w0.size, w1.size) == (48, 48), "no worker may switch before the other holds the plan"
    w1.receive(5, 32)
    w0.receive(9, 20)                        # a newer plan already reached worker 0 only
    for p in (w0, w1):
        p.agree([w0.latest, w1.latest], step=2)
    assert (w0.current, w1.current) == (5, 5)
    assert w0.size + w1.size == 96


def test_an_agreed_plan_this_worker_lacks_is_an_error() -> None:
    w = BatchPlans(0, 2, 96)
    with pytest.raises(DdInvariantError, match="agreed on batch plan 7 at step 3, but this worker never received it"):
        w.agree([7.0, 7.0], step=3)


def test_malformed_commands_are_ignored() -> None:
    w = BatchPlans(0, 2, 96)
    w.receive(0, 10)
    w.receive(4, 0)
    assert w.latest == 0 and w.size == 48
