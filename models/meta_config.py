"""``[meta]``: the G-Meta inner loop settings (torch-free, so parsing a job file stays cheap)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class AdaptTarget(str, enum.Enum):
    """Which parameters the inner loop adapts."""

    DENSE = "dense"
    ROWS = "rows"
    BOTH = "both"


class InnerReduction(str, enum.Enum):
    """How the inner loop reduces its loss over a task's support rows."""

    MEAN = "mean"
    """The mean over the task's real support rows: one step's size does not grow with their number."""
    SUM_PER_SUPPORT = "sum_per_support"
    """The sum over the task's real support rows divided by ``inner_support_size`` S: equal to
    ``mean`` at S real rows, ``K/S`` times it at K rows (the step grows with the evidence)."""


class InnerLr(str, enum.Enum):
    """Learned inner learning rates (Meta-SGD), meta-trained in the outer loop."""

    OFF = "off"
    """One fixed ``inner_lr`` for every adapted parameter."""
    TENSOR = "tensor"
    """One learned rate per dense parameter tensor and per embedding table."""
    ELEMENT = "element"
    """One learned rate per dense parameter element and per embedding dimension of a table."""


_ZERO_MEANS = {"inner_lr_rows": "the rows use inner_lr", "inner_clip": "no clipping"}


@dataclass(frozen=True)
class MetaConfig:
    """Inner loop of the meta step.

    Args:
        inner_steps: SGD steps on each task's support set (0 = no gradient step: no adaptation at all
            unless ``offset_steps > 0``, the offset-only recipe; see :attr:`adapts`).
        inner_lr: inner SGD learning rate of the dense parameters (and of the embedding rows when
            ``inner_lr_rows = 0``).
        first_order: stop gradients through the inner gradients (FOMAML).
        adapt: adapt the dense parameters, the gathered embedding rows, or both.
        vectorize: ``vmap`` over tasks (True) or loop over them (reference).
        learn_inner_lr: Meta-SGD: ``off`` (the fixed ``inner_lr``), ``tensor`` or ``element``
            (learned rates, initialised to ``inner_lr``, kept positive as ``exp(log_rate)``,
            trained by the outer loop with the dense optimizer and stored with the dense
            parameters under ``meta_learner.*``). Default ``off``: it is the published G-Meta
            recipe and changes nothing for existing jobs.
        meta_emb: MetaEmb (Pan et al. 2019) cold-id initialization: during adaptation, the row
            of an *unseen* id of a ``meta_emb_tables`` table (its row equals the PS's
            deterministic initial row of that id) is replaced by a generated row, a learned
            linear map of the mean of the other features (other tables' pooled embeddings and
            the dense features) over that id's support rows. The generator is meta-trained by
            the outer loop (a dense parameter under ``meta_learner.*``) and ships in bundles;
            see docs/design/meta_learning.md. Default off.
        meta_emb_tables: the tables whose unseen ids get generated rows (e.g. ``["user"]``);
            required (non-empty) when ``meta_emb`` is on; each must be a model table.
        meta_emb_cold_weight: weight ``a`` of the simulated cold-start loss in training: each
            task's outer loss is ``(1 - a) * L(as pulled) + a * L(every meta_emb_tables id of
            the task treated as unseen)``, so the generator learns from warm ids too (MetaEmb's
            cold + warm-up objective). 0 trains it only on ids that really are unseen.
        meta_emb_labels: also feed the generator the mean of each head's label over the id's
            support rows (beside the features): the generated row can then carry what only the
            id's own labels reveal (a user's click propensity), amortizing part of the inner loop.
            Off: the published MetaEmb (features only). Adaptation needs labeled support rows
            anyway, so serving has them.
        support_loss_weight: weight ``w`` (>= 0) of the base model's own loss on each task's
            support rows in the outer objective: per task ``L(Q; adapted) + w * L(S; base,
            unadapted, the pulled rows)``, weighted over tasks like the query loss. G-Meta's
            outer loss sees only the query half of each task's rows; with ``w > 0`` the base
            also learns from the support half, as a plain model learns from every row.
            Default 0.0: the published G-Meta objective, unchanged. See docs/design/meta_learning.md.
        inner_loss_reduction: the inner (support) loss of every inner step, wherever the inner loop
            runs (training, MetaEmb, adapted evaluation, a bundle's adaptation): ``mean`` over the
            task's real support rows (default, the published recipe), or ``sum_per_support``: their
            SUM divided by ``inner_support_size`` S, so a task with K real support rows takes a step
            K/S times the ``mean`` step (equal at K = S): the step follows the evidence, as a
            Bayesian update's shift grows with n. Outer losses and reported support losses stay means.
        inner_support_size: S of ``sum_per_support``: the training Meta-IO layout's support rows per
            task (``metaps data build``'s support size); required (>= 1) with ``sum_per_support``,
            ignored with ``mean``. A training batch with more support slots than S is an error, and
            ``metaps launch`` / ``train-local`` refuse a job whose S differs from ``data.train``'s
            manifest (preflight).
        offset_steps: after the gradient inner steps, fit one scalar logit offset per task and head on
            the task's real support rows by this many damped Newton iterations of the support BCE plus
            ``offset_prior / 2 * b^2``, and add it to that head's logit on the query rows
            (:mod:`models.meta_offset`). Applies wherever the inner loop runs (training's query loss,
            adapted evaluation, the plain model's fine-tuning in ``bench.quality``, a bundle's
            adaptation); under ``first_order`` the offset is detached in training. With ``inner_steps = 0``
            it is the offset-only recipe: no gradient step, the offset fitted on the base model's support
            logits (:attr:`adapts` is True). ESMM: the offset is on the CTCVR logit the loss uses (see the
            module). Default 0: off, the inner loop of before.
        offset_prior: ``lambda`` (> 0, finite), the prior precision of the offset: the Newton
            curvature is at least lambda and the offset shrinks towards 0 on little evidence
            (``lambda -> inf``: no offset). Ignored when ``offset_steps = 0``. Default 16.0: chosen in
            bench.quality (first-k, K = 8) among 1, 4 and 16 (docs/BENCHMARKS.md, "Issue 16: a Newton
            logit offset"); smaller values let the offset explain away what the base would learn.
        inner_lr_rows: inner SGD learning rate of the gathered embedding rows; 0 (default): ``inner_lr``,
            one rate for both groups (the recipe of before). A row's gradient is the mean support
            loss's, and a row is touched by few of a task's support rows (an item id by one of K,
            a row's gradient shrinks ~1/K), while the dense layers see every row: a separate, larger
            rate lets one step move the rows as much as the dense layers (docs/design/meta_learning.md
            gives the measured ratio). With ``learn_inner_lr`` it is the initial value of each table's
            learned rate (the dense rates start at ``inner_lr``).
        inner_clip: the largest L2 norm of one inner update of one task, per parameter group (the
            dense parameters together, the rows together): an update ``u = rate * grad`` whose norm
            exceeds it is scaled to that norm (so a large rate or many steps cannot throw the
            weights far; the direction is kept). 0 (default): off, the plain SGD step of before.

    Example::

        cfg = MetaConfig(inner_steps=2, inner_lr=0.05, first_order=False, adapt=AdaptTarget.ROWS)
    """

    inner_steps: int = 1
    inner_lr: float = 0.1
    first_order: bool = True
    adapt: AdaptTarget = AdaptTarget.BOTH
    vectorize: bool = True
    learn_inner_lr: InnerLr = InnerLr.OFF
    meta_emb: bool = False
    meta_emb_tables: list[str] = field(default_factory=list)
    meta_emb_cold_weight: float = 0.5
    meta_emb_labels: bool = False
    support_loss_weight: float = 0.0
    inner_loss_reduction: InnerReduction = InnerReduction.MEAN
    inner_support_size: int = 0
    offset_steps: int = 0
    offset_prior: float = 16.0
    inner_lr_rows: float = 0.0
    inner_clip: float = 0.0

    def validate(self) -> None:
        object.__setattr__(self, "adapt", AdaptTarget(self.adapt))
        object.__setattr__(self, "learn_inner_lr", InnerLr(self.learn_inner_lr))
        if self.inner_steps < 0:
            raise ValueError(f"inner_steps must be >= 0, got {self.inner_steps}")
        if not self.inner_lr > 0:
            raise ValueError(f"inner_lr must be > 0, got {self.inner_lr}")
        for key in ("inner_lr_rows", "inner_clip"):
            v = getattr(self, key)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not (v >= 0 and v < float("inf")):
                raise ValueError(f"{key} must be a finite float >= 0 (0: {_ZERO_MEANS[key]}), got {v!r}")
            object.__setattr__(self, key, float(v))
        object.__setattr__(self, "meta_emb_tables", list(self.meta_emb_tables))
        if self.meta_emb and not self.meta_emb_tables:
            raise ValueError("meta_emb_tables must name at least one table when meta_emb = true, got []")
        if not 0.0 <= self.meta_emb_cold_weight <= 1.0:
            raise ValueError(f"meta_emb_cold_weight must be in [0, 1], got {self.meta_emb_cold_weight}")
        w = self.support_loss_weight
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not (w >= 0 and w < float("inf")):
            raise ValueError(f"support_loss_weight must be a finite float >= 0, got {w!r}")
        object.__setattr__(self, "support_loss_weight", float(w))
        try:
            object.__setattr__(self, "inner_loss_reduction", InnerReduction(self.inner_loss_reduction))
        except ValueError:
            raise ValueError(f"inner_loss_reduction must be one of {[r.value for r in InnerReduction]}, "
                             f"got {self.inner_loss_reduction!r}") from None
        n = self.inner_support_size
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"inner_support_size must be an int >= 0, got {n!r}")
        if self.inner_loss_reduction is InnerReduction.SUM_PER_SUPPORT and n < 1:
            raise ValueError("inner_support_size must be >= 1 (the training layout's support rows per task) "
                             f"when inner_loss_reduction = 'sum_per_support', got {n}")
        k = self.offset_steps
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            raise ValueError(f"offset_steps must be an int >= 0, got {k!r}")
        lam = self.offset_prior
        if isinstance(lam, bool) or not isinstance(lam, (int, float)) or not (lam > 0 and lam < float("inf")):
            raise ValueError(f"offset_prior must be a finite float > 0, got {lam!r}")
        object.__setattr__(self, "offset_prior", float(lam))

    def __post_init__(self) -> None:
        self.validate()

    @property
    def rows_lr(self) -> float:
        """The rows' inner rate: ``inner_lr_rows``, or ``inner_lr`` when it is 0."""
        return float(self.inner_lr_rows or self.inner_lr)

    @property
    def adapts(self) -> bool:
        """Whether a task is adapted at all: a gradient step (``inner_steps > 0``) or the Newton offset
        (``offset_steps > 0``, alone: the offset-only recipe). False: base scores only."""
        return self.inner_steps > 0 or self.offset_steps > 0

    @property
    def adapts_dense(self) -> bool:
        return self.adapt in (AdaptTarget.DENSE, AdaptTarget.BOTH)

    @property
    def adapts_rows(self) -> bool:
        return self.adapt in (AdaptTarget.ROWS, AdaptTarget.BOTH)
