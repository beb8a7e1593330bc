"""Your own model (``[model] kind = "custom"``): the contract check's one-line errors, the adapter,
the ``class`` key, and the declared dims as the one source of the PS tables' dims.

Each broken model is a real module written to ``tmp_path`` and named by ``class`` /
``class_dir``, as a user's job would; the error must be a :class:`MetapsError` of one line
naming the class and what is wrong (head, expected vs got).
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import torch

from common.config import to_dict
from common.errors import ConfigError, MetapsError
from meta_io.batch import PlainBatch
from meta_io.synth.generator import GeneratorConfig, generator_schema
from metaps.job import job_from_mapping, load_job
from models import ModelConfig, build_model, loss
from models.custom import CustomModel, ModelContractError
from models.custom_import import import_model_class
from models.meta import meta_step, plain_step
from models.meta_config import AdaptTarget, MetaConfig
from models.testing import random_features, random_meta_batch, random_rows, unique_ids_of

EXAMPLES = Path(__file__).resolve().parents[2] / "docs" / "examples"
SCHEMA = generator_schema(GeneratorConfig(rows=10, n_user_features=2, n_item_features=2, n_context_features=1,
                                          n_multi_hot=2))

HEADER = """
import torch
from torch import nn


class Base(nn.Module):
    def __init__(self, spec):
        super().__init__()
        self.heads = list(spec.heads)
        self.lin = nn.Linear(sum(spec.features.values()) + len(spec.dense), len(self.heads))

    def z(self, features, dense):
        return self.lin(torch.cat([*features.values(), dense], dim=-1))
"""

BROKEN = {
    "tensor_out": "return self.z(features, dense)",
    "missing_head": "return {self.heads[0]: self.z(features, dense)[..., 0]}",
    "extra_head": "z = self.z(features, dense)\n        return {**{h: z[..., i] for i, h in enumerate(self.heads)}, 'ltv': z[..., 0]}",
    "shape": "z = self.z(features, dense)\n        return {h: z[..., i:i + 1] for i, h in enumerate(self.heads)}",
    "dtype": "z = self.z(features, dense).double()\n        return {h: z[..., i] for i, h in enumerate(self.heads)}",
    "nan": "z = self.z(features, dense) * float('nan')\n        return {h: z[..., i] for i, h in enumerate(self.heads)}",
    "detached": "z = self.z(features, dense).detach()\n        return {h: z[..., i] for i, h in enumerate(self.heads)}",
    "dense_only": "z = self.lin.bias + dense.sum(-1, keepdim=True) * self.lin.weight[:, 0]\n        return {h: z[..., i] for i, h in enumerate(self.heads)}",
    "no_params": "z = torch.cat([*features.values(), dense], dim=-1).sum(-1, keepdim=True).expand(*dense.shape[:-1], len(self.heads))\n        return {h: z[..., i] for i, h in enumerate(self.heads)}",
    "raises": "raise RuntimeError('boom\\nsecond line')",
    "data_dependent": "z = self.z(features, dense)\n        if z.sum() > 0:\n            z = z + 1\n        return {h: z[..., i] for i, h in enumerate(self.heads)}",
}


def _write(tmp_path: Path, name: str, body: str) -> ModelConfig:
    """A module ``m_<name>`` with class ``Model(Base)`` whose forward is ``body``; its ModelConfig."""
    src = HEADER + f"\n\nclass Model(Base):\n    def forward(self, features, dense):\n        {body}\n"
    (tmp_path / f"m_{name}.py").write_text(src)
    return ModelConfig(kind="custom", class_path=f"m_{name}:Model", class_dir=str(tmp_path), hidden=[8],
                       default_dim=8)


def _one_line(exc: BaseException, *names: str) -> str:
    msg = str(exc)
    assert isinstance(exc, MetapsError) and "\n" not in msg, repr(msg)
    for n in names:
        assert n in msg, f"{n!r} not in: {msg}"
    return msg


@pytest.mark.parametrize("case,words", [
    ("tensor_out", ["must return a dict head -> logits", "got Tensor of shape [6, 2]"]),
    ("missing_head", ["heads expected ['click', 'conversion']", "missing ['conversion']"]),
    ("extra_head", ["extra ['ltv']"]),
    ("shape", ["head 'click'", "expected logits of shape [6]", "got [6, 1]"]),
    ("dtype", ["head 'click'", "expected dtype float32, got torch.float64"]),
    ("nan", ["head 'click'", "non-finite logits"]),
    ("detached", ["outputs are not differentiable"]),
    ("dense_only", ["no gradient reaches the embedding rows"]),
    ("no_params", ["no gradient reaches its parameters"]),
    ("raises", ["forward failed on a synthetic batch", "RuntimeError: boom"]),
    ("data_dependent", ["fails in the meta step", "vmap"]),
])
def test_a_broken_model_is_one_line_naming_what_is_wrong(tmp_path: Path, case: str, words: list[str]) -> None:
    cfg = _write(tmp_path, case, BROKEN[case])
    with pytest.raises(ModelContractError) as exc:
        build_model(SCHEMA, cfg)
    _one_line(exc.value, f"model.class 'm_{case}:Model'", *words)


def test_batchnorm_and_changing_buffers_are_refused(tmp_path: Path) -> None:
    (tmp_path / "m_bn.py").write_text(HEADER + textwrap.dedent("""
        class Model(Base):
            def __init__(self, spec):
                super().__init__(spec)
                self.norm = nn.BatchNorm1d(len(self.heads))
            def forward(self, features, dense):
                z = self.z(features, dense)
                return {h: z[..., i] for i, h in enumerate(self.heads)}

        class Running(Base):
            def __init__(self, spec):
                super().__init__(spec)
                self.register_buffer("mean", torch.zeros(len(self.heads)))
            def forward(self, features, dense):
                z = self.z(features, dense)
                self.mean.mul_(0.9).add_(0.1 * z.detach().mean(0).reshape(-1)[: self.mean.numel()])
                return {h: z[..., i] for i, h in enumerate(self.heads)}
    """))
    base = dict(kind="custom", class_dir=str(tmp_path), hidden=[8], default_dim=8)
    with pytest.raises(ModelContractError) as exc:
        build_model(SCHEMA, ModelConfig(class_path="m_bn:Model", **base))
    _one_line(exc.value, "'m_bn:Model'", "norm is a BatchNorm1d", "LayerNorm")
    with pytest.raises(ModelContractError) as exc:
        build_model(SCHEMA, ModelConfig(class_path="m_bn:Running", **base))
    _one_line(exc.value, "'m_bn:Running'", "changes buffer(s) ['mean']", "vmap")


def test_not_importable_not_a_module_and_a_failing_constructor(tmp_path: Path) -> None:
    (tmp_path / "m_misc.py").write_text(HEADER + textwrap.dedent("""
        def not_a_class(spec):
            return None

        class Picky(Base):
            def __init__(self, spec):
                raise ValueError("needs a 'price' column")
    """))
    (tmp_path / "m_broken_import.py").write_text("import no_such_dependency_xyz\n")
    base = dict(kind="custom", class_dir=str(tmp_path), hidden=[8], default_dim=8)
    cases = [
        ("no_such_module:Model", ConfigError, ["module 'no_such_module' not found", f"class_dir {tmp_path}",
                                               "PYTHONPATH"]),
        ("m_misc:Nope", ConfigError, ["module 'm_misc'", "has no attribute 'Nope'"]),
        ("m_broken_import:Model", ConfigError, ["importing 'm_broken_import' failed", "no_such_dependency_xyz"]),
        ("m_misc:not_a_class", ModelContractError, ["expected a torch.nn.Module subclass", "function"]),
        ("m_misc:Picky", ModelContractError, ["m_misc:Picky(spec) raised ValueError: needs a 'price' column"]),
    ]
    for path, err, words in cases:
        with pytest.raises(err) as exc:
            build_model(SCHEMA, ModelConfig(class_path=path, **base))
        _one_line(exc.value, f"model.class {path!r}" if err is ModelContractError else f"model.class = {path!r}",
                  *words)


def test_the_class_key_is_checked_and_round_trips(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as exc:
        job_from_mapping({"data": {"train": "x"}, "model": {"kind": "custom"}})
    _one_line(exc.value, "model.class is required", '"module:Class"')
    with pytest.raises(ConfigError) as exc:
        job_from_mapping({"data": {"train": "x"}, "model": {"kind": "custom", "class": "two_tower.TwoTower"}})
    _one_line(exc.value, 'model.class must be "module:Class"', "'two_tower.TwoTower'")
    with pytest.raises(ConfigError) as exc:
        job_from_mapping({"data": {"train": "x"}, "model": {"kind": "dnn", "class": "a:B"}})
    _one_line(exc.value, "model.class = 'a:B' is only read with model.kind = \"custom\"")
    with pytest.raises(ConfigError) as exc:  # the Python name is not a TOML key
        job_from_mapping({"data": {"train": "x"}, "model": {"kind": "custom", "class_path": "a:B"}})
    _one_line(exc.value, "unknown key 'model.class_path'", "'class'")
    job = job_from_mapping({"data": {"train": "x"}, "model": {"kind": "custom", "class": "two_tower:TwoTower"}})
    assert job.model.class_path == "two_tower:TwoTower" and to_dict(job.model)["class"] == "two_tower:TwoTower"
    assert "class_path" not in to_dict(job.model)
    from metaps.roles.overrides import apply_overrides, parse_sets  # --set names the TOML key too

    data = apply_overrides({"data": {"train": "x"}, "model": {"kind": "custom"}}, parse_sets(["model.class=a.b:C"]))
    assert job_from_mapping(data).model.class_path == "a.b:C"
    with pytest.raises(ConfigError) as exc:
        apply_overrides({}, parse_sets(["model.clas=a:B"]))
    _one_line(exc.value, "did you mean 'model.class'")


def test_class_dir_is_the_job_files_folder_made_absolute(tmp_path: Path) -> None:
    (tmp_path / "jobs").mkdir()
    job_file = tmp_path / "jobs" / "job.toml"
    job_file.write_text('[data]\ntrain = "x"\n[model]\nkind = "custom"\nclass = "two_tower:TwoTower"\n')
    assert load_job(job_file).model.class_dir == str(job_file.parent.resolve())
    job_file.write_text('[data]\ntrain = "x"\n[model]\nkind = "custom"\nclass = "two_tower:TwoTower"\n'
                        'class_dir = "../towers"\n')
    assert load_job(job_file).model.class_dir == str((tmp_path / "towers").resolve())
    job_file.write_text('[data]\ntrain = "x"\n[model]\nkind = "dnn"\n')
    assert load_job(job_file).model.class_dir == ""  # a zoo model imports nothing


def test_a_job_mapping_from_the_api_takes_the_working_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A notebook passes a dict: its class_dir is the notebook's folder (the working directory), made
    absolute before a launch copies the job into a run dir where a relative one would name nothing."""
    from metaps import api

    monkeypatch.chdir(tmp_path)
    job = {"data": {"train": "x"}, "model": {"kind": "custom", "class": "two_tower:TwoTower"}}
    assert api.load_job(job).model.class_dir == str(tmp_path.resolve())
    job["model"]["class_dir"] = "towers"
    assert api.load_job(job).model.class_dir == str((tmp_path / "towers").resolve())


def test_the_two_tower_example_trains_plain_and_meta_and_declares_its_dims() -> None:
    cfg = ModelConfig(kind="custom", class_path="two_tower:TwoTower", class_dir=str(EXAMPLES), hidden=[16],
                      default_dim=8)
    dims = cfg.embedding_dims(SCHEMA.tables)
    assert dims["item"] == 16 and dims["user"] == 8  # the class declares item; default_dim for the rest
    model = build_model(SCHEMA, cfg)
    assert isinstance(model, CustomModel) and model.dims == dims
    assert model.net.user_side == ["user_id", "user_f0", "user_f1"] and "item_id" in model.net.item_side
    again = build_model(SCHEMA, cfg)  # deterministic init, from cfg.seed
    for (n, a), (_, b) in zip(model.named_parameters(), again.named_parameters()):
        assert torch.equal(a, b), n
    g = torch.Generator().manual_seed(1)
    fb = random_features(SCHEMA, (12,), vocab=30, generator=g)
    uniq = unique_ids_of(SCHEMA, fb)
    rows = random_rows(uniq, dims, generator=g)
    total, dense_grads, row_grads = plain_step(model, PlainBatch(features=fb, unique_ids=uniq), rows)
    assert torch.isfinite(total) and set(row_grads) == set(uniq) and set(dense_grads) == {
        n for n, _ in model.named_parameters()}
    assert float(row_grads["item"].abs().sum()) > 0 and float(row_grads["user"].abs().sum()) > 0
    probs = model.predict(fb, rows, uniq)
    assert set(probs) == {"click", "conversion"} and all(((p > 0) & (p < 1)).all() for p in probs.values())
    mb = random_meta_batch(SCHEMA, tasks=3, support=4, query=4, vocab=30, generator=g)
    step = meta_step(model, mb, random_rows(mb.unique_ids, dims, generator=g),
                     MetaConfig(inner_steps=2, inner_lr=0.1, adapt=AdaptTarget.BOTH))
    assert torch.isfinite(step.outer_loss) and any(float(v.abs().sum()) > 0 for v in step.dense_grads.values())
    total, _ = loss(model(fb, rows, uniq), fb, model.heads)
    assert torch.isfinite(total)


def test_declared_dims_must_agree_with_table_dims_and_the_schema(tmp_path: Path) -> None:
    cfg = dict(kind="custom", class_path="two_tower:TwoTower", class_dir=str(EXAMPLES), hidden=[8], default_dim=8)
    with pytest.raises(ConfigError) as exc:
        ModelConfig(**cfg, table_dims={"item": 8}).embedding_dims(SCHEMA.tables)
    _one_line(exc.value, "model.table_dims.item = 8 disagrees", "embedding_dims['item'] = 16")
    assert ModelConfig(**cfg, table_dims={"item": 16}).embedding_dims(SCHEMA.tables)["item"] == 16
    with pytest.raises(ConfigError) as exc:
        ModelConfig(**cfg).embedding_dims(["user", "ad"])
    _one_line(exc.value, "declares embedding_dims for unknown tables ['item']")
    (tmp_path / "m_dims.py").write_text(HEADER + "\n\nclass Model(Base):\n    embedding_dims = {'item': 6}\n")
    with pytest.raises(ConfigError) as exc:
        ModelConfig(kind="custom", class_path="m_dims:Model", class_dir=str(tmp_path)).embedding_dims(SCHEMA.tables)
    _one_line(exc.value, "embedding_dims['item'] must be a positive multiple of 4", "got 6")


def test_a_ctrmodel_subclass_is_built_as_the_zoo_is(tmp_path: Path) -> None:
    (tmp_path / "m_sub.py").write_text(textwrap.dedent("""
        from torch import nn
        from models.base import CtrModel

        class Linear(CtrModel):
            def __init__(self, schema, config, dims, heads):
                super().__init__(schema, config, dims, heads)
                self.out = nn.Linear(self.encoder.flat_dim, len(self.heads))
            def logits(self, enc):
                return self.out(enc.flat())
    """))
    model = build_model(SCHEMA, ModelConfig(kind="custom", class_path="m_sub:Linear", class_dir=str(tmp_path)))
    assert type(model).__name__ == "Linear" and import_model_class("m_sub:Linear", str(tmp_path)) is type(model)
