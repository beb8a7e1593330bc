"""Sparse optimizers over one table's rows.

Every optimizer updates only the rows a push touches, with "exact" semantics:
the caller sums duplicate ids first, so each touched row gets one update with
its aggregated gradient. Weight decay is L2 for every kind (``g += wd * w``
before the update), applied here rather than by TBE so all kinds agree.

===============  ==========================  ===============================
kind             where it runs               per-row state (TableRows.state)
===============  ==========================  ===============================
rowwise_adagrad  fbgemm TBE, fused backward  momentum  float32 [n]
adagrad          fbgemm TBE, fused backward  momentum  float32 [n, dim]
sgd              fbgemm TBE, fused backward  (none)
adam             torch, vectorized           m, v float32 [n, dim]; step int64 [n]
ftrl             torch, vectorized           z, n float32 [n, dim]
===============  ==========================  ===============================

TBE has no "apply these gradients" call: the fused kinds run a forward with one
row per bag, then ``out.backward(grads)``. Adam and FTRL (refused by TBE on CPU)
run over the TBE weight storage (``split_embedding_weights()`` views). Formulas:

* rowwise adagrad: ``m += mean(g^2); w -= lr * g / (sqrt(m) + eps)``
* adagrad:         ``m += g^2;       w -= lr * g / (sqrt(m) + eps)``
* adam (per-row step t): ``m = b1 m + (1-b1) g; v = b2 v + (1-b2) g^2;
  w -= lr * (m / (1-b1^t)) / (sqrt(v / (1-b2^t)) + eps)``
* ftrl-proximal (McMahan et al. 2013), per element::

      sigma = (sqrt(n + g^2) - sqrt(n)) / alpha;  z += g - sigma * w;  n += g^2
      w = 0 if |z| <= l1 else -(z - sign(z) l1) / ((beta + sqrt(n)) / alpha + l2)

Example::

    opt = make_optimizer(cfg, tbe, weights, capacity=1000, dim=16)
    opt.apply(rows, grads)        # rows unique int64 [k], grads float32 [k, dim]
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ps.config import OptimizerConfig, OptimizerKind

TBE_KINDS = (OptimizerKind.ROWWISE_ADAGRAD, OptimizerKind.ADAGRAD, OptimizerKind.SGD)


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

    def reset_rows(self, rows: torch.Tensor) -> None:
        """Put the state of freshly allocated rows at its initial value."""
        for name, t in self.state_tensors().items():
            t[rows] = self._initial(name)

    def _initial(self, name: str) -> float:
        return 0.0

    def export_state(self, rows: torch.Tensor) -> dict[str, np.ndarray]:
        return {k: t.index_select(0, rows).cpu().numpy() for k, t in self.state_tensors().items()}

    def import_state(self, rows: torch.Tensor, state: dict[str, np.ndarray]) -> None:
        for k, t in self.state_tensors().items():
            t[rows] = torch.as_tensor(state[k]).to(device=t.device, dtype=t.dtype)

    def memory_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.state_tensors().values())

    # update -----------------------------------------------------------------------
    def _decayed(self, rows: torch.Tensor, grads: torch.Tensor) -> torch.Tensor:
        if self.cfg.weight_decay:
            return grads + self.cfg.weight_decay * self.weights.index_select(0, rows)
        return grads

    def apply(self, rows: torch.Tensor, grads: torch.Tensor) -> None:
        """Update ``rows`` (unique, int64, on device) with ``grads`` [k, dim] (on device)."""
        raise NotImplementedError


class FusedTbeOptimizer(SparseOptimizer):
    """rowwise_adagrad / adagrad / sgd: the optimizer fused in the TBE backward."""

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

    def state_tensors(self) -> dict[str, torch.Tensor]:
        return {} if self._momentum is None else {"momentum": self._momentum}

    def _initial(self, name: str) -> float:
        return self.cfg.initial_accumulator

    def apply(self, rows: torch.Tensor, grads: torch.Tensor) -> None:
        k = rows.numel()
        if k == 0:
            return
        grads = self._decayed(rows, grads)
        offsets = torch.arange(k + 1, dtype=torch.int64, device=rows.device)
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
    def apply(self, rows: torch.Tensor, grads: torch.Tensor) -> None:
        if rows.numel() == 0:
            return
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
        self.weights[rows] = w
        self.m[rows] = m
        self.v[rows] = v
        self.step[rows] = step


class FtrlOptimizer(SparseOptimizer):
    """FTRL-proximal, per element, with z and n state."""

    kind = OptimizerKind.FTRL

    def __init__(self, cfg: OptimizerConfig, weights: torch.Tensor) -> None:
        super().__init__(cfg, weights)
        self.z = torch.zeros_like(weights)
        self.n = torch.full_like(weights, cfg.initial_accumulator)

    def state_tensors(self) -> dict[str, torch.Tensor]:
        return {"z": self.z, "n": self.n}

    def _initial(self, name: str) -> float:
        return self.cfg.initial_accumulator if name == "n" else 0.0

    @torch.no_grad()
    def apply(self, rows: torch.Tensor, grads: torch.Tensor) -> None:
        if rows.numel() == 0:
            return
        c = self.cfg
        g = self._decayed(rows, grads)
        w = self.weights.index_select(0, rows)
        n = self.n.index_select(0, rows)
        z = self.z.index_select(0, rows)
        n_new = n + g * g
        sigma = (n_new.sqrt() - n.sqrt()) / c.ftrl_alpha
        z = z + g - sigma * w
        shrunk = z - torch.sign(z) * c.ftrl_l1
        w_new = -shrunk / ((c.ftrl_beta + n_new.sqrt()) / c.ftrl_alpha + c.ftrl_l2)
        w_new = torch.where(z.abs() <= c.ftrl_l1, torch.zeros_like(w_new), w_new)
        self.weights[rows] = w_new
        self.z[rows] = z
        self.n[rows] = n_new


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
