"""Meta-SGD: learned, positive inner learning rates, meta-trained in the outer loop.

``[meta] learn_inner_lr`` picks the granularity::

    off      one fixed inner_lr                      (no parameters; the G-Meta recipe)
    tensor   one rate per dense tensor, one per table   log_rate []     per entry
    element  one rate per dense element, per table dim  log_rate = p.shape / [dim_t]

A rate is ``exp(log_rate)`` (positive whatever the optimizer does), initialised
to ``inner_lr``. The inner update of an adapted tensor ``x`` is then
``x - rate_x * grad`` (elementwise for ``element``; a table's ``[dim]`` rate
broadcasts over its rows). The outer loss depends on the rates even with
``first_order`` (``d x_K / d rate = -grad``), so ``meta_step`` returns their
outer gradients beside the model's, under :data:`PREFIX` names; the worker keeps
them with the dense parameters (PS dense store or all-reduce), so they are
synchronised, checkpointed and restored like any dense parameter.

A bundle reads the recipe with :meth:`MetaLearner.inner_recipe`, or rebuilds the
learner from a checkpoint's dense values with :meth:`MetaLearner.load_dense`.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

import numpy as np
import torch
from torch import Tensor, nn

from metaps.core.errors import ConfigError
from models.meta_config import InnerLr, MetaConfig

PREFIX = "meta_learner."
"""Dense-store name prefix of the learner's parameters (apart from the model's own names)."""


class MetaLearner(nn.Module):
    """The inner-loop recipe of one model, with its learned rates (if any).

    Args:
        model: the model whose dense parameters (names, shapes) and tables (``model.dims``)
            the inner loop adapts.
        cfg: the ``[meta]`` section.

    Example::

        learner = MetaLearner(model, MetaConfig(learn_inner_lr="element"))
        res = meta_step(model, batch, rows, learner)      # res.dense_grads has meta_learner.* too
        learner.inner_recipe()["rows_lr"]["user_id"]       # tensor [dim]: the learned rates
    """

    def __init__(self, model: nn.Module, cfg: MetaConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.dense_names: list[str] = [n for n, _ in model.named_parameters()] if cfg.adapts_dense else []
        dims: dict[str, int] = dict(getattr(model, "dims", {}))
        self.tables: list[str] = sorted(dims) if cfg.adapts_rows else []
        mode = InnerLr(cfg.learn_inner_lr)
        init = math.log(cfg.inner_lr)
        shapes = dict((n, tuple(p.shape)) for n, p in model.named_parameters())

        def log_rate(shape: tuple[int, ...]) -> nn.Parameter:
            return nn.Parameter(torch.full(shape if mode == InnerLr.ELEMENT else (), init))

        self.dense_log_lr = nn.ParameterList(
            [log_rate(shapes[n]) for n in self.dense_names] if mode != InnerLr.OFF else []
        )
        self.rows_log_lr = nn.ParameterList(
            [log_rate((dims[t],)) for t in self.tables] if mode != InnerLr.OFF else []
        )

    @property
    def inner_steps(self) -> int:
        """``cfg.inner_steps`` (a learner stands in wherever a MetaConfig is read)."""
        return int(self.cfg.inner_steps)

    @property
    def inner_lr(self) -> float:
        """``cfg.inner_lr``: the fixed rate, and the learned rates' initial value."""
        return float(self.cfg.inner_lr)

    @property
    def learned(self) -> bool:
        """Whether the rates are parameters (``learn_inner_lr != off``)."""
        return InnerLr(self.cfg.learn_inner_lr) != InnerLr.OFF

    # -- the functional view used inside meta_step ------------------------------------------
    def meta_params(self) -> dict[str, Tensor]:
        """Detached current values, by local name (``dense_log_lr.0``, ...)."""
        return {n: p.detach() for n, p in self.named_parameters()}

    def rates(self, meta_params: Mapping[str, Tensor] | None) -> dict[str, dict[str, Any]]:
        """``{"dense": {param: rate}, "rows": {table: rate}}``: a float, or a tensor when learned.

        Args:
            meta_params: :meth:`meta_params` (or values to differentiate through); None = fixed rates.
        """
        if not self.learned or meta_params is None:
            lr = float(self.cfg.inner_lr)
            return {"dense": {n: lr for n in self.dense_names}, "rows": {t: lr for t in self.tables}}
        return {
            "dense": {n: meta_params[f"dense_log_lr.{i}"].exp() for i, n in enumerate(self.dense_names)},
            "rows": {t: meta_params[f"rows_log_lr.{i}"].exp() for i, t in enumerate(self.tables)},
        }

    # -- what ships ---------------------------------------------------------------------------
    @torch.no_grad()
    def inner_recipe(self) -> dict[str, Any]:
        """The inner loop as data: steps, adapt target, first order, and every rate.

        Returns:
            ``{"inner_steps", "inner_lr", "first_order", "adapt", "learn_inner_lr",
            "dense_lr": {param name: float tensor}, "rows_lr": {table: float tensor}}``;
            a rate is ``[]`` (tensor / off) or the parameter's shape / ``[dim]`` (element).
        """
        rates = self.rates(self.meta_params() if self.learned else None)
        as_t = lambda v: v.detach().clone() if isinstance(v, Tensor) else torch.tensor(v)  # noqa: E731
        return {
            "inner_steps": int(self.cfg.inner_steps),
            "inner_lr": float(self.cfg.inner_lr),
            "first_order": bool(self.cfg.first_order),
            "adapt": self.cfg.adapt.value,
            "learn_inner_lr": InnerLr(self.cfg.learn_inner_lr).value,
            "dense_lr": {n: as_t(v) for n, v in rates["dense"].items()},
            "rows_lr": {t: as_t(v) for t, v in rates["rows"].items()},
        }

    # -- dense-store plumbing ----------------------------------------------------------------
    def store_named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """``(PREFIX + name, parameter)``: how the worker stores them beside the model's."""
        return [(PREFIX + n, p) for n, p in self.named_parameters()]

    @torch.no_grad()
    def load_dense(self, values: Mapping[str, Any]) -> None:
        """Load the rates from dense-store values (a checkpoint's ``dense(names)``).

        Args:
            values: ``PREFIX + name`` -> array, for every :meth:`store_named_parameters` name.

        Raises:
            ConfigError: a rate is missing (the checkpoint was trained with another
                ``learn_inner_lr``) or has the wrong number of values; nothing is loaded then.
        """
        checked = []
        for name, p in self.store_named_parameters():
            if name not in values:
                raise ConfigError(
                    f"dense value '{name}' missing ([meta] learn_inner_lr = "
                    f"'{InnerLr(self.cfg.learn_inner_lr).value}'): was the checkpoint trained with another setting?"
                )
            v = np.asarray(values[name], dtype=np.float32)
            if v.size != p.numel():
                raise ConfigError(f"dense value '{name}': expected {p.numel()} values {tuple(p.shape)}, got {v.size}")
            checked.append((p, v))
        for p, v in checked:
            p.copy_(torch.from_numpy(v.reshape(p.shape)))
