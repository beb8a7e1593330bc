"""common.toml_writer: output parses back with tomllib to the same data; no-TOML values are refused."""

from __future__ import annotations

import math
import tomllib
from pathlib import Path

import pytest

from common.toml_writer import TomlWriteError, dumps, write


def test_round_trip_of_a_job_shaped_mapping() -> None:
    data = {
        "top": 1,
        "data": {"train": 'a "quoted" \\ path é\n', "eval": ""},
        "ps": {"shards": 2, "tables": [], "empty": {}, "ratio": 0.1, "on": True,
               "table_defaults": {"dim": 8, "optimizer": {"kind": "adam", "lr": 1e-3}}},
        "faults": {"faults": [{"target": "worker", "index": 1, "factor": 2.5}, {"target": "ps", "index": 0}]},
        "controller": {"dds": {"worker_batches_per_shard": {"0": 3, "12": 1}}},
        "odd key": {"x.y": [1, 2, [3, 4]], "nested": [{"a": {"b": 1}}]},
    }
    assert tomllib.loads(dumps(data)) == data


def test_special_floats() -> None:
    back = tomllib.loads(dumps({"s": {"a": math.inf, "b": -math.inf, "c": math.nan, "d": 1e300}}))["s"]
    assert back["a"] == math.inf and back["b"] == -math.inf and math.isnan(back["c"]) and back["d"] == 1e300


def test_a_none_key_is_unset_and_left_out() -> None:
    """TOML has no null: a table's None key (a config's unset optional field) is left out, and an
    unset ``[[ps.tables]]`` override reads back as the same override."""
    from common.config import from_mapping, to_dict
    from ps.config import PsConfig

    assert tomllib.loads(dumps({"ps": {"host": None, "shards": 2, "tables": [{"name": "u", "dim": None}]}})) == \
        {"ps": {"shards": 2, "tables": [{"name": "u"}]}}
    cfg = PsConfig(tables=[from_mapping(PsConfig, {"tables": [{"name": "item", "capacity": 9}]}).tables[0]])
    assert from_mapping(PsConfig, tomllib.loads(dumps({"ps": to_dict(cfg)}))["ps"]) == cfg


@pytest.mark.parametrize("bad, where", [({"x": {"l": [None]}}, r"x.l\[0\]"), ({"x": {"o": object()}}, "x.o"),
                                        ({"x": {"l": [1, None]}}, r"x.l\[1\]"), ({"x": {1: 2}}, "x")])
def test_values_without_a_toml_form_are_refused_by_key(bad: dict, where: str) -> None:
    with pytest.raises(TomlWriteError, match=where):
        dumps(bad)


def test_write_is_atomic_and_readable(tmp_path: Path) -> None:
    p = write(tmp_path / "job.toml", {"train": {"workers": 4}})
    assert tomllib.loads(p.read_text()) == {"train": {"workers": 4}}
    assert not list(tmp_path.glob("*.tmp"))


def test_set_keys_keeps_comments_and_places_new_keys_in_their_table() -> None:
    from common.toml_writer import set_keys

    src = "# head\n[ps]  # the PS\nshards = 2   # two\n\n# next section\n[ps.table_defaults]\ndim = 16\n"
    out = set_keys(src, [(["ps", "host"], "h"), (["ps", "table_defaults", "dim"], 8), (["train", "workers"], 3)])
    assert out.startswith("# head\n[ps]  # the PS\nshards = 2   # two\nhost = \"h\"\n\n# next section\n")
    assert tomllib.loads(out) == {"ps": {"shards": 2, "host": "h", "table_defaults": {"dim": 8}},
                                  "train": {"workers": 3}}
    with pytest.raises(TomlWriteError, match="ps.shards is not a table"):
        set_keys(src, [(["ps", "shards", "x"], 1)], where="job.toml")
    with pytest.raises(TomlWriteError, match="ps.host"):
        set_keys(src, [(["ps", "host"], None)])
