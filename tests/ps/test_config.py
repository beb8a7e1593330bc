"""PsConfig from TOML: defaults, overrides, validation errors naming the key."""

from __future__ import annotations

from pathlib import Path

import pytest

from common.config import load_toml
from common.errors import ConfigError
from ps.config import EvictionPolicy, OptimizerKind, PsConfig


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "job.toml"
    p.write_text(text)
    return p


def test_defaults_and_overrides(tmp_path: Path) -> None:
    p = write(tmp_path, """
[ps]
shards = 3
[ps.table_defaults]
dim = 8
capacity = 500
admission = { min_count = 2 }
[[ps.tables]]
name = "item"
dim = 32
optimizer = { kind = "adam", lr = 0.001 }
eviction = { policy = "ttl", ttl_steps = 10 }
""")
    cfg = load_toml(PsConfig, p, section="ps")
    user, item = cfg.table_configs(["user", "item", "user"])
    assert (user.name, user.dim, user.capacity, user.admission.min_count) == ("user", 8, 500, 2)
    assert user.optimizer.kind == OptimizerKind.ROWWISE_ADAGRAD
    assert (item.dim, item.capacity, item.optimizer.kind, item.optimizer.lr) == (32, 500, OptimizerKind.ADAM, 0.001)
    assert item.eviction.policy == EvictionPolicy.TTL and item.eviction.policy == "ttl"
    assert cfg.dense_optimizer.kind == OptimizerKind.ADAM and cfg.dense_optimizer.lr == 1e-3
    assert PsConfig().table_configs(["a"])[0].dim == 16


@pytest.mark.parametrize("body,pattern", [
    ("[ps.table_defaults]\ndim = 6", r"dim must be a positive multiple of 4 \(fbgemm TBE requires dim % 4 == 0\), got 6"),
    ("[[ps.tables]]\nname = 'item'\ndim = 10", r"table 'item': dim must be a positive multiple of 4"),
    ("[ps.table_defaults]\ncapacity = 0", r"capacity must be >= 1, got 0"),
    ("[ps.table_defaults]\noptimizer = { lr = 0.0 }", r"lr must be > 0, got 0.0"),
    ("[ps.table_defaults]\nadmission = { probability = 1.5 }", r"probability must be in \[0, 1\], got 1.5"),
    ("[ps.table_defaults]\neviction = { policy = 'lru' }", r"ps.table_defaults.eviction.policy'?: expected one of \['none', 'lfu', 'ttl'\]"),
    ("[ps]\nnonfinite_grads = 'ignore'", r"expected one of \['reject', 'drop'\]"),
    ("[ps]\ndense_optimizer = { kind = 'ftrl' }", r"dense_optimizer.kind must be one of \['adam', 'adamw', 'adagrad', 'sgd'\]"),
    ("[ps.table_defaults]\noptimizer = { kind = 'adamw' }",
     r"table_defaults: optimizer.kind 'adamw' is for \[ps\] dense_optimizer only; a table takes one of"),
    ("[[ps.tables]]\nname = 'item'\noptimizer = { kind = 'adamw' }",
     r"table 'item': optimizer.kind 'adamw' is for \[ps\] dense_optimizer only"),
    ("[ps]\nshards = 4\nnum_vshards = 2", r"num_vshards must be >= shards \(4\), got 2"),
    ("[ps]\nbogus = 1", r"unknown key 'ps.bogus'"),
])
def test_bad_values_name_the_key(tmp_path: Path, body: str, pattern: str) -> None:
    with pytest.raises(ConfigError, match=pattern):
        load_toml(PsConfig, write(tmp_path, body), section="ps")


def test_override_of_unknown_table_is_an_error(tmp_path: Path) -> None:
    cfg = load_toml(PsConfig, write(tmp_path, "[[ps.tables]]\nname = 'itme'\n"), section="ps")
    with pytest.raises(ValueError, match=r"overrides unknown table\(s\) \['itme'\]; the schema's tables are \['item', 'user'\]"):
        cfg.table_configs(["user", "item"])
