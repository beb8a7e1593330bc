"""Sparse optimizers over one table's rows.

Every optimizer updates only the rows a push touches, with "exact" semantics:
the caller sums duplicate ids first, so each touched row gets one update with
its aggregated gradient. Weight decay is L2 for every kind (``g += wd * w``
before the update), applied here rather than by TBE so all kinds agree.

===============  ==========================  ===============================
kind             where it runs               per-row state (TableRows.state)
===============  ==========================  ===============================
rowwise_adagrad  torch, vectorized (CPU)(*) momentum  float32 [n]
adagrad          fbgemm TBE, fused backward  momentum  float32 [n, dim]
sgd              fbgemm TBE, fused backward  (none)
adam             torch, vectorized           m, v float32 [n, dim]; step int64 [n]
ftrl             torch, vectorized           z, n float32 [n, dim]
===============  ==========================  ===============================

(*) bit-identical to fbgemm's fused backward (``ps.rowwise_update``); CUDA tables
and dims not a multiple of 8 keep TBE.

TBE has no "apply these gradients" call: the fused kinds run a forward with one
row per bag, then ``out.backward(grads)``. Adam and FTRL (refused by TBE on CPU)
run over the TBE weight storage (``split_embedding_weights()`` views). Formulas:

* rowwise adagrad: ``m += mean(g^2); w -= lr * g / (sqrt(m) + eps)``
* adagrad:         ``m += g^2;       w -= lr * g / (sqrt(m) + eps)``
* adam (per-row step t): ``m = b1 m + (1-b1) g; v = b2 v + (1-b2) g^2;
  w -= lr * (m / (1-b1^t)) / (sqrt(v / (1-b2^t)) + eps)``
* ftrl: McMahan et al. 2013 (KDD, "Ad Click Prediction: a View from the
  Trenches"), Algorithm 1, FTRL-Proximal *per coordinate*. The weight is not a
  variable: it is a function of the state (z, n), stored in the table as a
  cache (for pulls and for the next update) that every write of z, n refreshes,
  imports included::

      w(z, n) = 0                                            if |z| <= l1
              = -(z - sign(z) l1) / ((beta + sqrt(n)) / alpha + l2)   otherwise
      w = w(z, n);  sigma = (sqrt(n + g^2) - sqrt(n)) / alpha
      z += g - sigma * w;  n += g^2;  stored w = w(z, n)

  Rows start at z = 0, n = initial_accumulator (0 in the paper), i.e. w = 0,
  so FTRL tables must be zero-initialised (``TableConfig.validate`` refuses
  another ``init``): a never-pushed id and a coordinate the L1 term zeroes both
  read exactly 0.0. This is *not* TensorFlow's ``tf.train.Ftrl`` (which keeps w
  as a variable and starts it at the initializer's value).

**Update screening** (nothing non-finite is ever stored): a row whose update
would make its weight or optimizer state NaN/Inf (finite but huge gradients:
``g^2`` overflows float32 above ~1.8e19) is not written. :meth:`apply` returns
the mask of rows it wrote, the table counts the others
(``update_nonfinite_dropped``). Adam and FTRL compute the new values in torch
and check them before the scatter. The fused kinds update in place inside
fbgemm, so they keep an upper bound of every stored magnitude (weights and
momentum) and, from the push's largest gradient, bound what the update can
reach; only a push that could come near the float32 range pays for the exact
path: snapshot the touched rows (``index_select``), apply, check them, put the
bad ones back. A finite check costs one reduction when everything is finite
(NaN/Inf propagate through a sum; a non-finite sum falls back to per-row checks).

Example::

    opt = make_optimizer(cfg, tbe, weights, capacity=1000, dim=16)
    ok = opt.apply(rows, grads)   # rows unique int64 [k], grads float32 [k, dim]; ok bool [k]
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from ps import intra_op, rowwise_update
from ps.config import OptimizerConfig, OptimizerKind

TBE_KINDS = (OptimizerKind.ROWWISE_ADAGRAD, OptimizerKind.ADAGRAD, OptimizerKind.SGD)

FLOAT32_MAX = float(torch.finfo(torch.float32).max)
SAFE_MAGNITUDE = FLOAT32_MAX / 16
"""Fused updates whose bounded result stays below this skip the exact (snapshot) path."""
_SMALLEST_NORMAL_ROOT = 1.1e-19
"""|g| below which float32 g^2 may underflow to 0 (the adagrad denominator then rests on eps)."""
_REFRESH_EVERY = 64
"""Exact pushes between two O(capacity) recomputations of a fused table's magnitude bound."""


def finite_rows(*tensors: torch.Tensor) -> torch.Tensor | None:
    """None when every element of ``tensors`` is finite, else bool [k]: rows all finite in every tensor.

    Args:
        tensors: each [k] or [k, ...], same k. A finite sum proves every element
            finite (NaN/Inf propagate), so the common case costs one reduction each.
    """
    if all(bool(torch.isfinite(t.sum())) for t in tensors):
        return None
    ok: torch.Tensor | None = None
    for t in tensors:
        f = torch.isfinite(t)
        if f.dim() > 1:
            f = f.flatten(1).all(dim=1)
        ok = f if ok is None else ok & f
    assert ok is not None
    return ok


def clip_rows(grads: torch.Tensor, norm: float = 0.0, value: float = 0.0) -> tuple[torch.Tensor, int]:
    """Per-row gradient clipping, vectorized; returns (grads, rows changed).

    Args:
        grads: float32 [k, dim], finite (one aggregated gradient per row).
        norm: if > 0, rows with L2 norm above it are scaled to norm ``norm``
            (the norm is taken in float64, so a huge finite row clips instead of
            overflowing to Inf).
        value: if > 0, every element is clamped to [-value, value] first.
    """
    out, changed = clip_rows_mask(grads, norm, value)
    return out, 0 if changed is None else int(changed.sum())


def clip_rows_mask(grads: torch.Tensor, norm: float = 0.0, value: float = 0.0) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`clip_rows` with the clipped rows as a mask: (grads, bool [k] or None when clipping is off)."""
    if grads.numel() == 0 or (norm <= 0 and value <= 0):
        return grads, None
    changed = torch.zeros(grads.shape[0], dtype=torch.bool, device=grads.device)
    if value > 0:
        changed |= (grads.abs() > value).any(dim=1)
        grads = grads.clamp(-value, value)
    if norm > 0:
        n = grads.double().square().sum(dim=1).sqrt()
        over = n > norm
        changed |= over
        scale = torch.where(over, norm / n, torch.ones_like(n)).to(grads.dtype)
        grads = grads * scale.unsqueeze(1)
    return grads, changed


class SparseOptimizer:
    """Base: holds the weights view and the per-row state tensors (capacity rows)."""

    kind: OptimizerKind

    def __init__(self, cfg: OptimizerConfig, weights: torch.Tensor) -> None:
        self.cfg = cfg
        self.weights = weights  # [C, dim] view into TBE storage
        self.device = weights.device

    # state ------------------------------------------------------------------------
    def state_tensors(self) -> dict[str, torch.Tensor]:
        """Per-row state, each with capacity rows (first dim)."""
        return {}

    def state_spec(self, dim: int) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
        """name -> (row shape, numpy dtype) of each state entry in TableRows."""
        return {k: (tuple(t.shape[1:]), _np_dtype(t.dtype)) for k, t in self.state_tensors().items()}

    def reset_rows(self, rows: torch.Tensor | slice) -> None:
        """Put the state of freshly allocated rows (an index tensor, or a slice of consecutive rows) at its initial value."""
        for name, t in self.state_tensors().items():
            t[rows] = self._initial(name)

    def _initial(self, name: str) -> float:
        return 0.0

    def export_state(self, rows: torch.Tensor) -> dict[str, np.ndarray]:
        return {k: t.index_select(0, rows).cpu().numpy() for k, t in self.state_tensors().items()}

    def import_state(self, rows: torch.Tensor, state: dict[str, np.ndarray]) -> None:
        for k, t in self.state_tensors().items():
            t[rows] = torch.as_tensor(state[k]).to(device=t.device, dtype=t.dtype)

    def rows_written(self, rows: torch.Tensor) -> int:
        """Hook: ``rows`` got weights/state from outside :meth:`apply` (new rows, imports).

        Returns how many rows' stored weights the optimizer rewrote (FTRL derives
        them from its state); 0 for the other kinds.
        """
        return 0

    def rows_initialized(self, rows: torch.Tensor, weight_absmax: float) -> int:
        """Hook: ``rows`` were just given initial weights (largest |w| ``weight_absmax``)
        and :meth:`reset_rows` state. Same contract as :meth:`rows_written`; kinds whose
        bookkeeping needs only the magnitude override it to skip re-reading the rows."""
        return self.rows_written(rows)

    def rows_imported(self, rows: torch.Tensor, weights: torch.Tensor) -> int:
        """Hook: ``rows`` were just given ``weights`` [k, dim] and imported state.
        Same contract as :meth:`rows_written` (default: that)."""
        return self.rows_written(rows)

    def memory_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.state_tensors().values())

    # update -----------------------------------------------------------------------
    def _decayed(self, rows: torch.Tensor, grads: torch.Tensor) -> torch.Tensor:
        if self.cfg.weight_decay:
            return grads + self.cfg.weight_decay * self.weights.index_select(0, rows)
        return grads

    def apply(self, rows: torch.Tensor, grads: torch.Tensor, grad_absmax: float | None = None) -> torch.Tensor | None:
        """Update ``rows`` (unique, int64, on device) with ``grads`` [k, dim] (on device).

        Args:
            rows: the rows to update.
            grads: their gradients.
            grad_absmax: ``max |grads|`` when the caller already has it (the push's finite
                check), so the fused kinds skip their own pass; None: computed when needed.

        Returns:
            None when every row was written, else bool [k] (on device): True for
            the rows written; the others would have become NaN/Inf and are unchanged.
        """
        raise NotImplementedError


class FusedTbeOptimizer(SparseOptimizer):
    """rowwise_adagrad / adagrad / sgd: the optimizer fused in the TBE backward.

    ``bound_w`` / ``bound_m`` are upper bounds of |weight| / momentum over the
    rows in use (raised by every write; recomputed exactly over the storage at
    most every ``_REFRESH_EVERY`` exact pushes). See the module docstring.
    """

    def __init__(self, cfg: OptimizerConfig, weights: torch.Tensor, tbe: Any) -> None:
        super().__init__(cfg, weights)
        self.kind = cfg.kind
        self.tbe = tbe
        states = tbe.split_optimizer_states()
        self._momentum: torch.Tensor | None = None
        if cfg.kind in (OptimizerKind.ROWWISE_ADAGRAD, OptimizerKind.ADAGRAD):
            m = states[0][0]
            if cfg.kind == OptimizerKind.ADAGRAD:
                m = m.view(weights.shape[0], weights.shape[1])
            self._momentum = m
            m.fill_(cfg.initial_accumulator)
        self.bound_w = 0.0
        self.bound_m = float(cfg.initial_accumulator)
        # rowwise adagrad on CPU: the same update as TBE's fused backward, bit for bit, without
        # its forward pass and autograd (ps.rowwise_update); other kinds and CUDA keep TBE
        self._vectorized = (
            cfg.kind == OptimizerKind.ROWWISE_ADAGRAD and weights.device.type == "cpu"
            and rowwise_update.supported(int(weights.shape[1]))
        )
        self.exact_pushes = 0  # pushes that took the snapshot path (for tests / stats)
        self._since_refresh = _REFRESH_EVERY

    def state_tensors(self) -> dict[str, torch.Tensor]:
        return {} if self._momentum is None else {"momentum": self._momentum}

    def _initial(self, name: str) -> float:
        return self.cfg.initial_accumulator

    def rows_written(self, rows: torch.Tensor) -> int:
        if rows.numel():
            self.bound_w = max(self.bound_w, float(self.weights.index_select(0, rows).abs().amax()))
            if self._momentum is not None:
                self.bound_m = max(self.bound_m, float(self._momentum.index_select(0, rows).abs().amax()))
        return 0

    def rows_initialized(self, rows: torch.Tensor, weight_absmax: float) -> int:
        if rows.numel():
            self.bound_w = max(self.bound_w, float(weight_absmax))
            if self._momentum is not None:
                self.bound_m = max(self.bound_m, abs(float(self.cfg.initial_accumulator)))
        return 0

    def rows_imported(self, rows: torch.Tensor, weights: torch.Tensor) -> int:
        # bound from the imported values (what is stored now) without gathering the rows back
        if rows.numel():
            lo, hi = torch.aminmax(weights)
            self.bound_w = max(self.bound_w, -float(lo), float(hi))
            if self._momentum is not None:
                lo, hi = torch.aminmax(self._momentum.index_select(0, rows))
                self.bound_m = max(self.bound_m, -float(lo), float(hi))
        return 0

    def _growth(self, gmax: float) -> tuple[float, float]:
        """Upper bounds of how much one update can add to |w| and to m, given max |g|."""
        c = self.cfg
        dim = self.weights.shape[1]
        if self.kind == OptimizerKind.SGD:
            return c.lr * gmax, 0.0
        # |g_j| / sqrt(m_new) <= 1 (adagrad) or sqrt(dim) (rowwise: m_new >= g_j^2 / dim) while
        # g^2 is a normal float; below that, the eps in the denominator bounds the step.
        ratio = 1.0 if self.kind == OptimizerKind.ADAGRAD else math.sqrt(dim)
        tiny = _SMALLEST_NORMAL_ROOT * ratio / c.eps if c.eps > 0 else math.inf
        dm = gmax * gmax * (dim if self.kind == OptimizerKind.ROWWISE_ADAGRAD else 1)  # fp32 sum of g^2
        return 2.0 * c.lr * (ratio + tiny), dm

    def _refresh_bounds(self) -> None:
        self.bound_w = float(self.weights.abs().amax()) if self.weights.numel() else 0.0
        if self._momentum is not None and self._momentum.numel():
            self.bound_m = float(self._momentum.abs().amax())
        self._since_refresh = 0

    def _safe(self, dw: float, dm: float) -> bool:
        return self.bound_w + dw < SAFE_MAGNITUDE and self.bound_m + dm < SAFE_MAGNITUDE

    def apply(self, rows: torch.Tensor, grads: torch.Tensor, grad_absmax: float | None = None) -> torch.Tensor | None:
        if rows.numel() == 0:
            return None
        g = self._decayed(rows, grads)  # may hold Inf (decay of a huge weight): gmax Inf -> exact path
        if grad_absmax is None or g is not grads:
            lo, hi = torch.aminmax(g)  # one pass, no |g| temporary; NaN propagates as before
            grad_absmax = float(torch.maximum(-lo, hi))
        dw, dm = self._growth(grad_absmax)
        if not self._safe(dw, dm) and self._since_refresh >= _REFRESH_EVERY:
            self._refresh_bounds()
        if self._safe(dw, dm):
            self._run(rows, g)
            self.bound_w += dw
            self.bound_m += dm
            return None
        # exact path: snapshot the touched rows, apply, put back the rows that went non-finite
        # (weights and momentum are detached storage views: no autograd bookkeeping here)
        self.exact_pushes += 1
        self._since_refresh += 1
        snap_w = self.weights.index_select(0, rows)
        snap_m = None if self._momentum is None else self._momentum.index_select(0, rows)
        self._run(rows, g)
        post_w = self.weights.index_select(0, rows)
        post_m = None if self._momentum is None else self._momentum.index_select(0, rows)
        ok = finite_rows(post_w, *([] if post_m is None else [post_m]))
        if ok is not None:
            bad = ~ok
            self.weights[rows[bad]] = snap_w[bad]
            post_w = post_w[ok]
            if self._momentum is not None:
                assert snap_m is not None and post_m is not None
                self._momentum[rows[bad]] = snap_m[bad]
                post_m = post_m[ok]
        if post_w.numel():
            self.bound_w = max(self.bound_w, float(post_w.abs().amax()))
        if post_m is not None and post_m.numel():
            self.bound_m = max(self.bound_m, float(post_m.abs().amax()))
        return ok

    def _run(self, rows: torch.Tensor, grads: torch.Tensor) -> None:
        if self._vectorized and self._momentum is not None:
            w, m, lr, eps = self.weights, self._momentum, self.cfg.lr, self.cfg.eps
            # rows are unique: spans update disjoint rows, each row with the serial path's bits
            intra_op.run(int(rows.numel()), lambda lo, hi: rowwise_update.rowwise_adagrad_update(
                w, m, rows[lo:hi], grads[lo:hi], lr, eps))
            return
        offsets = torch.arange(rows.numel() + 1, dtype=torch.int64, device=rows.device)
        out = self.tbe(rows, offsets)
        out.backward(grads)


class AdamOptimizer(SparseOptimizer):
    """Adam with a per-row step count (a row's bias correction counts its own updates)."""

    kind = OptimizerKind.ADAM

    def __init__(self, cfg: OptimizerConfig, weights: torch.Tensor) -> None:
        super().__init__(cfg, weights)
        self.m = torch.zeros_like(weights)
        self.v = torch.zeros_like(weights)
        self.step = torch.zeros(weights.shape[0], dtype=torch.int64, device=weights.device)

    def state_tensors(self) -> dict[str, torch.Tensor]:
        return {"m": self.m, "v": self.v, "step": self.step}

    @torch.no_grad()
    def apply(self, rows: torch.Tensor, grads: torch.Tensor, grad_absmax: float | None = None) -> torch.Tensor | None:
        if rows.numel() == 0:
            return None
        c = self.cfg
        g = self._decayed(rows, grads)
        step = self.step.index_select(0, rows) + 1
        m = self.m.index_select(0, rows).mul_(c.beta1).add_(g, alpha=1.0 - c.beta1)
        v = self.v.index_select(0, rows).mul_(c.beta2).addcmul_(g, g, value=1.0 - c.beta2)
        t = step.to(torch.float64).unsqueeze(1)
        bc1 = (1.0 - torch.pow(torch.tensor(c.beta1, dtype=torch.float64, device=t.device), t)).float()
        bc2 = (1.0 - torch.pow(torch.tensor(c.beta2, dtype=torch.float64, device=t.device), t)).float()
        denom = (v / bc2).sqrt_().add_(c.eps)
        w = self.weights.index_select(0, rows) - c.lr * (m / bc1) / denom
        ok = finite_rows(w, m, v)
        if ok is not None:
            rows, w, m, v, step = rows[ok], w[ok], m[ok], v[ok], step[ok]
        self.weights[rows] = w
        self.m[rows] = m
        self.v[rows] = v
        self.step[rows] = step
        return ok


class FtrlOptimizer(SparseOptimizer):
    """FTRL-Proximal (McMahan et al. 2013, Algorithm 1), per coordinate; w is derived from (z, n)."""

    kind = OptimizerKind.FTRL

    def __init__(self, cfg: OptimizerConfig, weights: torch.Tensor) -> None:
        super().__init__(cfg, weights)
        self.z = torch.zeros_like(weights)
        self.n = torch.full_like(weights, cfg.initial_accumulator)

    def state_tensors(self) -> dict[str, torch.Tensor]:
        return {"z": self.z, "n": self.n}

    def _initial(self, name: str) -> float:
        return self.cfg.initial_accumulator if name == "n" else 0.0

    def weights_of(self, z: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
        """The FTRL-Proximal weight of state (z, n): exactly +0.0 where |z| <= l1."""
        c = self.cfg
        w = (torch.sign(z) * c.ftrl_l1 - z) / ((c.ftrl_beta + n.sqrt()) / c.ftrl_alpha + c.ftrl_l2)
        return torch.where(z.abs() <= c.ftrl_l1, torch.zeros_like(w), w)

    @torch.no_grad()
    def rows_written(self, rows: torch.Tensor) -> int:
        """Store w(z, n) for ``rows``; returns how many rows held a different weight."""
        if rows.numel() == 0:
            return 0
        w = self.weights_of(self.z.index_select(0, rows), self.n.index_select(0, rows))
        differ = int((w != self.weights.index_select(0, rows)).any(dim=1).sum())
        if differ:
            self.weights[rows] = w
        return differ

    @torch.no_grad()
    def apply(self, rows: torch.Tensor, grads: torch.Tensor, grad_absmax: float | None = None) -> torch.Tensor | None:
        if rows.numel() == 0:
            return None
        c = self.cfg
        z = self.z.index_select(0, rows)
        n = self.n.index_select(0, rows)
        # w(z, n): the stored weight is exactly that (every write goes through weights_of:
        # apply, and rows_written for new and imported rows), so read it rather than recompute
        w = self.weights.index_select(0, rows)
        g = grads + c.weight_decay * w if c.weight_decay else grads
        n_new = n + g * g
        sigma = (n_new.sqrt() - n.sqrt()) / c.ftrl_alpha
        z_new = z + g - sigma * w
        w_new = self.weights_of(z_new, n_new)
        ok = finite_rows(w_new, z_new, n_new)
        if ok is not None:
            rows, w_new, z_new, n_new = rows[ok], w_new[ok], z_new[ok], n_new[ok]
        self.weights[rows] = w_new
        self.z[rows] = z_new
        self.n[rows] = n_new
        return ok


def make_optimizer(cfg: OptimizerConfig, weights: torch.Tensor, tbe: Any) -> SparseOptimizer:
    """The optimizer of one table (``tbe`` must be built with :func:`tbe_optim_type`)."""
    if cfg.kind in TBE_KINDS:
        return FusedTbeOptimizer(cfg, weights, tbe)
    if cfg.kind == OptimizerKind.ADAM:
        return AdamOptimizer(cfg, weights)
    if cfg.kind == OptimizerKind.FTRL:
        return FtrlOptimizer(cfg, weights)
    raise ValueError(f"unknown optimizer kind {cfg.kind!r}")


def tbe_optim_type(kind: OptimizerKind) -> Any:
    """The fbgemm ``EmbOptimType`` the TBE is built with (SGD storage for torch-side kinds)."""
    from fbgemm_gpu.split_embedding_configs import EmbOptimType

    return {
        OptimizerKind.ROWWISE_ADAGRAD: EmbOptimType.EXACT_ROWWISE_ADAGRAD,
        OptimizerKind.ADAGRAD: EmbOptimType.EXACT_ADAGRAD,
        OptimizerKind.SGD: EmbOptimType.EXACT_SGD,
    }.get(kind, EmbOptimType.EXACT_SGD)


def _np_dtype(dt: torch.dtype) -> np.dtype:
    return np.dtype(torch.empty(0, dtype=dt).numpy().dtype) if dt != torch.bfloat16 else np.dtype("float32")
