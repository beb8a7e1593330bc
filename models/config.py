"""``[model]`` section of the job TOML: which model of the zoo, and its sizes.

Example (TOML)::

    [model]
    kind = "esmm"
    hidden = [128, 64]
    bottom = "mmoe"
    n_experts = 4
    default_dim = 16
    table_dims = { item = 32 }

The embedding dimension of every table comes from here (``default_dim`` unless
``table_dims`` overrides it, or a custom model's class declares it). The PS
tables must be created with the same dims: both are wired from
:meth:`ModelConfig.embedding_dims`, the one place dims are decided.

A model of the user's own (``kind = "custom"``) is named by import path::

    [model]
    kind = "custom"
    class = "my_towers:TwoTower"    # ModelConfig.class_path (``class`` is not a Python name)
    class_dir = ""                  # '' = the job file's folder (made absolute when the job is read)

This module stays torch-free: the class is imported (:mod:`models.custom_import`)
only when its dims are asked for or the model is built.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Sequence

from common.errors import ConfigError


class ModelKind(str, enum.Enum):
    """The models of the zoo."""

    DNN = "dnn"  # wide & deep
    DEEPFM = "deepfm"
    DCNV2 = "dcnv2"
    ESMM = "esmm"
    CUSTOM = "custom"  # the user's class, [model] class (docs/design/models.md, "Your own model")


class BottomKind(str, enum.Enum):
    """Multi-task bottom of ESMM: one shared MLP, or a mixture of experts with per-task gates."""

    SHARED = "shared"
    MMOE = "mmoe"


@dataclass(frozen=True)
class ModelConfig:
    """Model architecture and embedding dims.

    Args:
        kind: which model (``dnn``, ``deepfm``, ``dcnv2``, ``esmm``), or ``custom``: the user's class
            named by ``class``.
        hidden: deep MLP widths (for ESMM: the widths of each task tower).
        dropout: dropout probability after every hidden activation of the deep MLPs (wide & deep's,
            DeepFM's and DCN-v2's deep part; ESMM's shared bottom or every MMoE expert, and its
            towers); a custom model reads it as ``spec.dropout``. On in training steps, the meta
            inner loop included (``vmap`` draws a mask per task); off (eval mode) when scoring,
            evaluating, adapting for delivery and in the exported network. 0 (the default) builds
            no dropout layer. A small-data knob, with ``[ps] dense_optimizer.weight_decay``; off by
            default, as it makes the vectorized and looped meta steps differ (parity checks).
        bottom: ESMM multi-task bottom, ``shared`` or ``mmoe``.
        n_experts: MMoE experts.
        expert_hidden: widths of each expert MLP (and of the shared bottom).
        cross_layers: DCN-v2 cross layers.
        cross_rank: DCN-v2 rank of each cross matrix; 0 = full rank.
        default_dim: embedding dim of every table not in ``table_dims``
            (a multiple of 4, as the PS's TBE tables require).
        table_dims: per-table dim overrides.
        seed: seed of the (deterministic) dense parameter init.
        class_path: TOML key ``class``: with ``kind = "custom"``, the model's import path
            ``"module:Class"`` (``"my_towers:TwoTower"``, a dotted module allowed): a torch ``nn.Module``
            built from a ``models.custom.ModelSpec`` that returns one logit per head, or a ``CtrModel``
            subclass (docs/design/models.md, "Your own model"). Checked on a tiny synthetic batch when
            the model is built. The class may declare ``embedding_dims = {table: dim}``: the PS tables
            are sized from it (a ``table_dims`` entry must agree).
        class_dir: a folder ``class`` is also imported from (after ``PYTHONPATH``); '' = the job file's
            folder. A relative path is the job file's folder joined with it; both are made absolute
            when the job file is read, so the run directory's copy of the job and every process of a
            fleet find the same folder. A folder that does not exist is skipped (a Kubernetes pod
            imports the class from its image's ``PYTHONPATH``).

    Example::

        cfg = ModelConfig(kind=ModelKind.DEEPFM, hidden=[64, 32], table_dims={"item": 32})
        dims = cfg.embedding_dims(schema.tables)   # {"user": 16, "item": 32, ...}
    """

    kind: ModelKind = ModelKind.DNN
    hidden: list[int] = field(default_factory=lambda: [128, 64])
    dropout: float = 0.0
    bottom: BottomKind = BottomKind.SHARED
    n_experts: int = 4
    expert_hidden: list[int] = field(default_factory=lambda: [64])
    cross_layers: int = 2
    cross_rank: int = 0
    default_dim: int = 16
    table_dims: dict[str, int] = field(default_factory=dict)
    seed: int = 0
    class_path: str = field(default="", metadata={"toml": "class"})
    class_dir: str = ""

    def validate(self) -> None:
        # Accept plain strings from Python callers; the TOML loader already converts.
        object.__setattr__(self, "kind", ModelKind(self.kind))
        object.__setattr__(self, "bottom", BottomKind(self.bottom))
        for name in ("hidden", "expert_hidden"):
            widths = list(getattr(self, name))
            if not widths or any((not isinstance(w, int)) or w < 1 for w in widths):
                raise ValueError(f"{name} must be a non-empty list of ints >= 1, got {widths}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")
        if self.n_experts < 1:
            raise ValueError(f"n_experts must be >= 1, got {self.n_experts}")
        if self.cross_layers < 1:
            raise ValueError(f"cross_layers must be >= 1, got {self.cross_layers}")
        if self.cross_rank < 0:
            raise ValueError(f"cross_rank must be >= 0 (0 = full rank), got {self.cross_rank}")
        _check_dim("default_dim", self.default_dim)
        for table, dim in self.table_dims.items():
            _check_dim(f"table_dims.{table}", dim)
        if self.kind == ModelKind.CUSTOM:
            module, _, attr = self.class_path.partition(":")
            if not self.class_path:
                raise ValueError('model.class is required with model.kind = "custom": the import path '
                                 '"module:Class" of your model (e.g. "my_towers:TwoTower")')
            if not module or not attr or not all(p.isidentifier() for p in module.split(".") + attr.split(".")):
                raise ValueError(f'model.class must be "module:Class" (e.g. "my_towers:TwoTower"), '
                                 f"got {self.class_path!r}")
        elif self.class_path:
            raise ValueError(f'model.class = {self.class_path!r} is only read with model.kind = "custom" '
                             f"(got kind = {ModelKind(self.kind).value!r})")

    def __post_init__(self) -> None:
        self.validate()

    def embedding_dims(self, tables: Sequence[str]) -> dict[str, int]:
        """Dim of every table: ``table_dims[t]`` or ``default_dim``.

        Args:
            tables: the schema's tables (``schema.tables``).

        Raises:
            ValueError: ``table_dims`` names a table the schema does not have
                (a typo would otherwise silently fall back to ``default_dim``).
            ConfigError: a custom class that is not importable, or whose declared
                ``embedding_dims`` name an unknown table, a bad dim, or disagree with ``table_dims``.
        """
        unknown = sorted(set(self.table_dims) - set(tables))
        if unknown:
            raise ValueError(f"model.table_dims names unknown tables {unknown}; schema tables: {list(tables)}")
        dims = {t: self.table_dims.get(t, self.default_dim) for t in tables}
        if self.kind == ModelKind.CUSTOM:
            from models.custom_import import declared_dims, import_model_class

            declared = declared_dims(import_model_class(self.class_path, self.class_dir), self.class_path)
            unknown = sorted(set(declared) - set(tables))
            if unknown:
                raise ConfigError(f"model.class {self.class_path!r} declares embedding_dims for unknown tables "
                                 f"{unknown}; schema tables: {list(tables)}")
            for t, d in declared.items():
                try:
                    _check_dim(f"model.class {self.class_path!r}: embedding_dims[{t!r}]", d)
                except ValueError as exc:
                    raise ConfigError(str(exc)) from None
                if t in self.table_dims and self.table_dims[t] != d:
                    raise ConfigError(f"model.table_dims.{t} = {self.table_dims[t]} disagrees with model.class "
                                     f"{self.class_path!r}, which declares embedding_dims[{t!r}] = {d}")
                dims[t] = d
        return dims


def _check_dim(name: str, dim: int) -> None:
    if not isinstance(dim, int) or dim < 4 or dim % 4:
        raise ValueError(f"{name} must be a positive multiple of 4 (TBE row alignment), got {dim}")
