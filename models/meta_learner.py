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

With ``[meta] meta_emb`` the learner also holds the MetaEmb generator of each
``meta_emb_tables`` table (:mod:`models.meta_emb`: ``meta_emb_w.<i>`` /
``meta_emb_b.<i>``, tables sorted), stored, synced and shipped the same way, and
the unseen-id rule's initial rows (:meth:`MetaLearner.set_init_rows`, from the
``[ps]`` config in a trainer, from the bundle's recipe in serving).
"""

from __future__ import annotations

import logging
import math
from typing import Any, Mapping

import numpy as np
import torch
from torch import Tensor, nn

from common.errors import ConfigError
from common.log import kv
from models import meta_emb as memb
from models.meta_config import InnerLr, MetaConfig

log = logging.getLogger(__name__)

PREFIX = "meta_learner."
"""Dense-store name prefix of the learner's parameters (apart from the model's own names)."""


class DivergenceWatch:
    """Counts the tasks whose inner step diverged (support loss rose or went non-finite) over training's
    diagnosed steps, and logs one WARNING per window of ``window`` diagnosed steps whose diverged share
    exceeds ``share`` (not one per step).

    Args:
        window: diagnosed meta steps per window (a worker diagnoses its logged steps).
        share: the diverged share of a window's tasks above which it warns.

    Counts are telemetry: steps overlapping on threads may race on them (no lock: the learner is a module).
    """

    def __init__(self, window: int = 10, share: float = 0.1) -> None:
        self.window, self.share = int(window), float(share)
        self.diverged = 0.0
        """Diverged tasks in the current window."""
        self.tasks = 0.0
        """Real tasks in the current window."""
        self.steps = 0
        """Diagnosed steps in the current window."""
        self.total_diverged = 0.0
        """Diverged tasks since the start."""
        self.total_tasks = 0.0
        """Diagnosed real tasks since the start."""
        self.warnings = 0
        """Windows warned about."""

    def observe(self, diverged: float, tasks: float) -> bool:
        """Add one diagnosed step (its diverged and real task counts); True when this closes a window that warned.

        Args:
            diverged: tasks of the step whose inner step diverged.
            tasks: real tasks of the step.
        """
        self.diverged += diverged
        self.tasks += tasks
        self.total_diverged += diverged
        self.total_tasks += tasks
        self.steps += 1
        if self.steps < self.window:
            return False
        share = self.diverged / self.tasks if self.tasks > 0 else 0.0
        warned = share > self.share
        if warned:
            self.warnings += 1
            log.warning(
                "inner step diverged (support loss rose or went non-finite) on %.1f%% of tasks over the last %d "
                "diagnosed steps: lower [meta] inner_lr / inner_lr_rows or set inner_clip", 100.0 * share, self.steps,
                extra=kv(diverged_share=round(share, 4), tasks=self.tasks, steps=self.steps),
            )
        self.diverged, self.tasks, self.steps = 0.0, 0.0, 0
        return warned


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
        shapes = dict((n, tuple(p.shape)) for n, p in model.named_parameters())

        def log_rate(shape: tuple[int, ...], rate: float) -> nn.Parameter:
            return nn.Parameter(torch.full(shape if mode == InnerLr.ELEMENT else (), math.log(rate)))

        self.dense_log_lr = nn.ParameterList(
            [log_rate(shapes[n], cfg.inner_lr) for n in self.dense_names] if mode != InnerLr.OFF else []
        )
        self.rows_log_lr = nn.ParameterList(  # each table's own rate, from [meta] inner_lr_rows (or inner_lr)
            [log_rate((dims[t],), cfg.rows_lr) for t in self.tables] if mode != InnerLr.OFF else []
        )
        self.divergence = DivergenceWatch()
        """Training: the share of tasks whose inner step raised their support loss, warned about per window."""
        self.emb_tables: list[str] = sorted(dict.fromkeys(cfg.meta_emb_tables)) if cfg.meta_emb else []
        """MetaEmb: the tables whose unseen ids get generated rows."""
        unknown = [t for t in self.emb_tables if t not in dims]
        if unknown:
            raise ConfigError(f"[meta] meta_emb_tables: {unknown} are not tables of the model (tables: {sorted(dims)})")
        encoder = getattr(model, "encoder", None)
        self.layouts: list[Any] = list(getattr(model, "layouts", [])) if self.emb_tables else []
        n_dense = len(getattr(encoder, "dense_columns", []))
        self.emb_labels: list[str] = (
            [h.name for h in getattr(model, "heads", [])] if self.emb_tables and cfg.meta_emb_labels else []
        )
        """MetaEmb: heads whose support labels the generators read (``[meta] meta_emb_labels``)."""
        widths = [memb.input_dim(self.layouts, n_dense, t, len(self.emb_labels)) for t in self.emb_tables]
        self.meta_emb_w = nn.ParameterList([nn.Parameter(torch.zeros(dims[t], w)) for t, w in zip(self.emb_tables, widths)])
        self.meta_emb_b = nn.ParameterList([nn.Parameter(torch.zeros(dims[t])) for t in self.emb_tables])
        self.init_rows: dict[str, memb.InitRows] | None = None
        """table -> the PS's initial rows (the unseen rule); None until :meth:`set_init_rows`."""

    @property
    def inner_steps(self) -> int:
        """``cfg.inner_steps`` (a learner stands in wherever a MetaConfig is read)."""
        return int(self.cfg.inner_steps)

    @property
    def rows_lr(self) -> float:
        """``cfg.rows_lr``: the rows' fixed rate (``inner_lr_rows``, or ``inner_lr``), the learned ones' start."""
        return float(self.cfg.rows_lr)

    @property
    def adapts(self) -> bool:
        """``cfg.adapts``: a gradient step or the Newton offset (the offset-only recipe) adapts each task."""
        return bool(self.cfg.adapts)

    @property
    def inner_lr(self) -> float:
        """``cfg.inner_lr``: the fixed rate, and the learned rates' initial value."""
        return float(self.cfg.inner_lr)

    @property
    def learned(self) -> bool:
        """Whether the rates are parameters (``learn_inner_lr != off``)."""
        return InnerLr(self.cfg.learn_inner_lr) != InnerLr.OFF

    @property
    def meta_emb(self) -> bool:
        """Whether unseen ids of some table get generated rows (``[meta] meta_emb``)."""
        return bool(self.emb_tables)

    @property
    def has_parameters(self) -> bool:
        """Whether the learner has dense values to store, sync and ship (rates or generators)."""
        return any(True for _ in self.parameters())

    def set_init_rows(self, init_rows: Mapping[str, memb.InitRows]) -> None:
        """The unseen rule's reference: table -> the PS's initial-row function (a RowInitializer).

        Raises:
            ConfigError: a ``meta_emb_tables`` table has none.
        """
        missing = [t for t in self.emb_tables if t not in init_rows]
        if missing:
            raise ConfigError(f"[meta] meta_emb_tables: no initial-row rule for tables {missing}")
        self.init_rows = {t: init_rows[t] for t in self.emb_tables}

    def unseen(self, rows: Mapping[str, Tensor], unique_ids: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """table -> bool ``[U_t]``: the ids of each meta_emb table that read their initial row.

        Raises:
            ConfigError: meta_emb is on but no initial-row rule was set.
        """
        if not self.emb_tables:
            return {}
        if self.init_rows is None:
            raise ConfigError(
                "[meta] meta_emb = true needs the unseen-id rule (the PS's initial rows): use the trainer's or the "
                "bundle's inner loop (MetaLearner.set_init_rows), not a bare [meta] config"
            )
        return {t: memb.unseen_mask(rows[t], unique_ids[t], self.init_rows[t]) for t in self.emb_tables}

    def cold_rows(
        self, meta_params: Mapping[str, Tensor], rows: Mapping[str, Tensor], cold: Mapping[str, Tensor],
        support: Any, sidx: Any, straight_through: bool,
    ) -> dict[str, Tensor]:
        """One task's rows with its ``cold`` slots (table -> bool ``[K_t]``) replaced by generated rows.

        A pure tensor function of ``meta_params`` (runs under ``vmap``; the outer gradient reaches
        the generators through it).
        """
        out = dict(rows)
        for i, t in enumerate(self.emb_tables):
            gen = memb.generate(meta_params[f"meta_emb_w.{i}"], meta_params[f"meta_emb_b.{i}"], self.layouts, t,
                                    rows, support, sidx, self.emb_labels)
            out[t] = memb.substitute(rows[t], gen, cold[t], straight_through)
        return out

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
            lr, rows_lr = float(self.cfg.inner_lr), self.rows_lr
            return {"dense": {n: lr for n in self.dense_names}, "rows": {t: rows_lr for t in self.tables}}
        return {
            "dense": {n: meta_params[f"dense_log_lr.{i}"].exp() for i, n in enumerate(self.dense_names)},
            "rows": {t: meta_params[f"rows_log_lr.{i}"].exp() for i, t in enumerate(self.tables)},
        }

    # -- what ships ---------------------------------------------------------------------------
    @torch.no_grad()
    def inner_recipe(self) -> dict[str, Any]:
        """The inner loop as data: steps, adapt target, first order, and every rate.

        Returns:
            ``{"inner_steps", "inner_lr", "inner_lr_rows" (the rows' fixed rate or start), "inner_clip",
            "first_order", "adapt", "learn_inner_lr", "dense_lr": {param name: float tensor},
            "rows_lr": {table: float tensor}}``;
            a rate is ``[]`` (tensor / off) or the parameter's shape / ``[dim]`` (element).
        """
        rates = self.rates(self.meta_params() if self.learned else None)
        as_t = lambda v: v.detach().clone() if isinstance(v, Tensor) else torch.tensor(v)  # noqa: E731
        return {
            "inner_steps": int(self.cfg.inner_steps),
            "inner_lr": float(self.cfg.inner_lr),
            "inner_lr_rows": self.rows_lr,
            "inner_clip": float(self.cfg.inner_clip),
            "first_order": bool(self.cfg.first_order),
            "adapt": self.cfg.adapt.value,
            "learn_inner_lr": InnerLr(self.cfg.learn_inner_lr).value,
            "dense_lr": {n: as_t(v) for n, v in rates["dense"].items()},
            "rows_lr": {t: as_t(v) for t, v in rates["rows"].items()},
            "meta_emb_tables": list(self.emb_tables),
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
                    f"'{InnerLr(self.cfg.learn_inner_lr).value}', meta_emb = {str(self.cfg.meta_emb).lower()}, "
                    f"meta_emb_tables = {self.emb_tables}): was the checkpoint trained with another setting?"
                )
            v = np.asarray(values[name], dtype=np.float32)
            if v.size != p.numel():
                raise ConfigError(f"dense value '{name}': expected {p.numel()} values {tuple(p.shape)}, got {v.size}")
            checked.append((p, v))
        for p, v in checked:
            p.copy_(torch.from_numpy(v.reshape(p.shape)))
