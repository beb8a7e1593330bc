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
``table_dims`` overrides it). The PS tables must be created with the same dims:
both are wired from :meth:`ModelConfig.embedding_dims`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Sequence


class ModelKind(str, enum.Enum):
    """The models of the zoo."""

    DNN = "dnn"  # wide & deep
    DEEPFM = "deepfm"
    DCNV2 = "dcnv2"
    ESMM = "esmm"


class BottomKind(str, enum.Enum):
    """Multi-task bottom of ESMM: one shared MLP, or a mixture of experts with per-task gates."""

    SHARED = "shared"
    MMOE = "mmoe"


@dataclass(frozen=True)
class ModelConfig:
    """Model architecture and embedding dims.

    Args:
        kind: which model (``dnn``, ``deepfm``, ``dcnv2``, ``esmm``).
        hidden: deep MLP widths (for ESMM: the widths of each task tower).
        dropout: dropout after every hidden layer. Off by default: it makes the
            vectorized and looped meta-steps differ and breaks parity checks.
        bottom: ESMM multi-task bottom, ``shared`` or ``mmoe``.
        n_experts: MMoE experts.
        expert_hidden: widths of each expert MLP (and of the shared bottom).
        cross_layers: DCN-v2 cross layers.
        cross_rank: DCN-v2 rank of each cross matrix; 0 = full rank.
        default_dim: embedding dim of every table not in ``table_dims``
            (a multiple of 4, as the PS's TBE tables require).
        table_dims: per-table dim overrides.
        seed: seed of the (deterministic) dense parameter init.

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

    def __post_init__(self) -> None:
        self.validate()

    def embedding_dims(self, tables: Sequence[str]) -> dict[str, int]:
        """Dim of every table: ``table_dims[t]`` or ``default_dim``.

        Args:
            tables: the schema's tables (``schema.tables``).

        Raises:
            ValueError: ``table_dims`` names a table the schema does not have
                (a typo would otherwise silently fall back to ``default_dim``).
        """
        unknown = sorted(set(self.table_dims) - set(tables))
        if unknown:
            raise ValueError(f"model.table_dims names unknown tables {unknown}; schema tables: {list(tables)}")
        return {t: self.table_dims.get(t, self.default_dim) for t in tables}


def _check_dim(name: str, dim: int) -> None:
    if not isinstance(dim, int) or dim < 4 or dim % 4:
        raise ValueError(f"{name} must be a positive multiple of 4 (TBE row alignment), got {dim}")
