"""tests/conftest.py's heavy-first list names real test modules, and the collection starts with them."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import HEAVY_FIRST

ROOT = Path(__file__).resolve().parents[1]


def test_every_heavy_first_module_exists_once() -> None:
    missing = [p for p in HEAVY_FIRST if not (ROOT / p).is_file()]
    assert not missing, f"tests/conftest.py HEAVY_FIRST names modules that do not exist (renamed? remove them): {missing}"
    assert len(set(HEAVY_FIRST)) == len(HEAVY_FIRST), "HEAVY_FIRST lists a module twice"


def test_heavy_modules_are_collected_first_and_xdist_keeps_the_order(request: pytest.FixtureRequest) -> None:
    if hasattr(request.config.option, "loadscopereorder"):
        assert request.config.option.loadscopereorder is False
    order = list(dict.fromkeys(item.nodeid.split("::", 1)[0] for item in request.session.items))
    heavy = [p for p in order if p in HEAVY_FIRST]
    # this session's heavy modules lead, in HEAVY_FIRST's order (a run of a subset: the subset's)
    assert order[:len(heavy)] == heavy == sorted(heavy, key=HEAVY_FIRST.index), order[:len(heavy) + 3]
