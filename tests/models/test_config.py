"""ModelConfig: defaults, validation, TOML loading, embedding dims."""

from pathlib import Path

import pytest

from common.config import load_toml
from common.errors import ConfigError
from models.config import BottomKind, ModelConfig, ModelKind


def test_defaults_are_small_and_deterministic() -> None:
    cfg = ModelConfig()
    assert cfg.kind == ModelKind.DNN
    assert cfg.hidden == [128, 64]
    assert cfg.dropout == 0.0
    assert cfg.default_dim == 16
    assert cfg.seed == 0


def test_load_from_toml_section(tmp_path: Path) -> None:
    path = tmp_path / "job.toml"
    path.write_text(
        '[model]\nkind = "esmm"\nbottom = "mmoe"\nhidden = [32, 16]\n'
        "n_experts = 3\ndefault_dim = 8\ntable_dims = { item = 32 }\n"
    )
    cfg = load_toml(ModelConfig, path, section="model")
    assert cfg.kind is ModelKind.ESMM and cfg.bottom is BottomKind.MMOE
    assert cfg.hidden == [32, 16] and cfg.n_experts == 3
    assert cfg.embedding_dims(["user", "item"]) == {"user": 8, "item": 32}


@pytest.mark.parametrize(
    "text, needle",
    [
        ('kind = "xgboost"', "model.kind"),
        ("hidden = []", "hidden"),
        ("dropout = 1.5", "dropout"),
        ("default_dim = 10", "multiple of 4"),
        ("table_dims = { item = 6 }", "table_dims.item"),
        ("n_experts = 0", "n_experts"),
        ("cross_rank = -1", "cross_rank"),
        ("depth = 3", "unknown key 'model.depth'"),
    ],
)
def test_bad_values_name_the_key(tmp_path: Path, text: str, needle: str) -> None:
    path = tmp_path / "job.toml"
    path.write_text(f"[model]\n{text}\n")
    with pytest.raises(ConfigError, match=needle):
        load_toml(ModelConfig, path, section="model")


def test_python_construction_validates_and_accepts_strings() -> None:
    assert ModelConfig(kind="deepfm").kind is ModelKind.DEEPFM
    with pytest.raises(ValueError, match="default_dim"):
        ModelConfig(default_dim=0)


def test_table_dims_for_unknown_table_is_an_error() -> None:
    cfg = ModelConfig(table_dims={"itme": 32})
    with pytest.raises(ValueError, match=r"unknown tables \['itme'\]"):
        cfg.embedding_dims(["user", "item"])
