"""Dense parameters held on a PS shard (when dense sync mode is "ps").

Each named parameter is a float32 CPU tensor with its own optimizer state
(Adam, Adagrad or SGD, torch.optim's formulas), so a push to one parameter
never steps another's state. Weight decay is L2, as for the sparse tables.

Storage is flat: every parameter (and each per-element optimizer state) is a
view of one buffer, in registration order::

    flat      [ mlp.0.weight ........ | mlp.0.bias | out.weight ... ]   float32 [total]
    exp_avg   [ ...                   |            |            ... ]   same layout
    step      one scalar per parameter (a parameter's own count)

A push of every parameter whose step counts agree (a worker's step: the usual
case) is then one fused update over the buffers (~8 tensor ops, whatever the
number of parameters) instead of ~8 per parameter; the arithmetic is
elementwise, so the values are the per-parameter update's, bit for bit
(tests/ps/test_dense_store.py). Any other push runs per parameter on the views.

Example::

    d = DenseStore(OptimizerConfig(kind=OptimizerKind.ADAM, lr=1e-3))
    d.register("mlp.0.weight", (16, 8))        # zeros
    d.register("mlp.0.bias", np.ones(8, np.float32))
    d.push({"mlp.0.bias": np.full(8, 0.1, np.float32)})
    d.pull(["mlp.0.bias"])["mlp.0.bias"].shape  # (8,)
"""

from __future__ import annotations

import threading
from typing import Mapping, Sequence

import numpy as np
import torch

from ps.config import DENSE_OPTIMIZERS, OptimizerConfig, OptimizerKind
from ps.errors import BadRequest


class DenseStore:
    """Named dense parameters with per-parameter optimizers (thread-safe).

    Args:
        cfg: optimizer of every dense parameter (adam, adagrad or sgd).
    """

    def __init__(self, cfg: OptimizerConfig | None = None) -> None:
        self.cfg = cfg or OptimizerConfig(kind=OptimizerKind.ADAM, lr=1e-3)
        if self.cfg.kind not in DENSE_OPTIMIZERS:
            raise ValueError(
                f"dense optimizer must be one of {[k.value for k in DENSE_OPTIMIZERS]}, got {self.cfg.kind.value!r}"
            )
        self.lock = threading.RLock()
        self._params: dict[str, torch.Tensor] = {}
        """name -> a view of :attr:`_flat` (registration order)."""
        self._state: dict[str, dict[str, torch.Tensor]] = {}
        """name -> its state: per-element entries are views of :attr:`_flat_state`; ``step`` is its own scalar."""
        self._flat = torch.zeros(0, dtype=torch.float32)
        self._flat_state: dict[str, torch.Tensor] = {}
        self.pushes = 0

    def _relayout(self, name: str, value: torch.Tensor) -> None:
        """Append parameter ``name`` to the flat buffers (a new registration): existing values and
        states are copied into the new buffers, every view re-pointed."""
        sizes = [p.numel() for p in self._params.values()] + [value.numel()]
        total = sum(sizes)
        flat = torch.empty(total, dtype=torch.float32)
        fresh_state = self._new_state(value)
        keys = [k for k in fresh_state if k != "step"]
        flat_state = {k: torch.empty(total, dtype=torch.float32) for k in keys}
        params: dict[str, torch.Tensor] = {}
        state: dict[str, dict[str, torch.Tensor]] = {}
        at = 0
        for (n, old), size in zip(list(self._params.items()) + [(name, value)], sizes):
            params[n] = flat[at : at + size].view(old.shape)
            params[n].copy_(old)
            st = self._state.get(n, fresh_state)
            state[n] = {"step": st["step"]} if "step" in st else {}
            for k in keys:
                view = flat_state[k][at : at + size].view(old.shape)
                view.copy_(st[k])
                state[n][k] = view
            at += size
        self._flat, self._flat_state, self._params, self._state = flat, flat_state, params, state

    def _new_state(self, p: torch.Tensor) -> dict[str, torch.Tensor]:
        if self.cfg.kind == OptimizerKind.ADAM:
            return {"step": torch.zeros((), dtype=torch.float32), "exp_avg": torch.zeros_like(p),
                    "exp_avg_sq": torch.zeros_like(p)}
        if self.cfg.kind == OptimizerKind.ADAGRAD:
            return {"step": torch.zeros((), dtype=torch.float32),
                    "sum": torch.full_like(p, self.cfg.initial_accumulator)}
        return {}

    @torch.no_grad()
    def _step(self, p: torch.Tensor, state: dict[str, torch.Tensor], g: torch.Tensor) -> None:
        """One update with torch.optim's formulas (Adam / Adagrad without lr decay / SGD).

        Written out rather than calling torch.optim: importing torch.optim pulls in
        torch._dynamo (~3.5 s at PS start-up here) for three lines of math.
        """
        c = self.cfg
        if c.weight_decay:
            g = g.add(p, alpha=c.weight_decay)
        if c.kind == OptimizerKind.SGD:
            p.add_(g, alpha=-c.lr)
            return
        state["step"] += 1
        if c.kind == OptimizerKind.ADAGRAD:
            state["sum"].addcmul_(g, g, value=1.0)
            p.addcdiv_(g, state["sum"].sqrt().add_(c.eps), value=-c.lr)
            return
        t = float(state["step"])
        m, v = state["exp_avg"], state["exp_avg_sq"]
        m.lerp_(g, 1.0 - c.beta1)
        v.mul_(c.beta2).addcmul_(g, g, value=1.0 - c.beta2)
        bc1 = 1.0 - c.beta1**t
        bc2 = 1.0 - c.beta2**t
        denom = (v.sqrt() / (bc2**0.5)).add_(c.eps)
        p.addcdiv_(m, denom, value=-c.lr / bc1)

    # -- registry ------------------------------------------------------------------
    def register(self, name: str, shape_or_value: Sequence[int] | np.ndarray) -> bool:
        """Create a parameter (zeros of a shape, or a copy of a float32 value).

        Idempotent: registering an existing name with the same shape does nothing
        (the stored value wins). Returns True when the parameter was created.

        Raises:
            BadRequest: the name exists with another shape, or the value is not float32.
        """
        if isinstance(shape_or_value, np.ndarray):
            if shape_or_value.dtype != np.float32:
                raise BadRequest(f"dense '{name}': initial value must be float32, got {shape_or_value.dtype}")
            shape = tuple(int(s) for s in shape_or_value.shape)
            value = torch.from_numpy(shape_or_value.copy())
        else:
            shape = tuple(int(s) for s in shape_or_value)
            if any(s < 0 for s in shape):
                raise BadRequest(f"dense '{name}': shape must be non-negative, got {shape}")
            value = torch.zeros(shape, dtype=torch.float32)
        with self.lock:
            if name in self._params:
                have = tuple(self._params[name].shape)
                if have != shape:
                    raise BadRequest(f"dense '{name}': already registered with shape {have}, got {shape}")
                return False
            self._relayout(name, value.requires_grad_(False))
            return True

    def names(self) -> list[str]:
        with self.lock:
            return list(self._params)

    def shapes(self) -> dict[str, tuple[int, ...]]:
        with self.lock:
            return {k: tuple(v.shape) for k, v in self._params.items()}

    def _check_names(self, names: Sequence[str]) -> None:
        unknown = [n for n in names if n not in self._params]
        if unknown:
            raise BadRequest(f"unknown dense parameter(s) {unknown}; registered: {sorted(self._params)}")

    def _check_values(self, values: Mapping[str, np.ndarray], what: str) -> None:
        self._check_names(list(values))
        for k, v in values.items():
            want = tuple(self._params[k].shape)
            if not isinstance(v, np.ndarray) or v.dtype != np.float32:
                raise BadRequest(f"dense '{k}': {what} must be a float32 array, got {getattr(v, 'dtype', type(v).__name__)}")
            if tuple(v.shape) != want and not (v.ndim == 1 and v.size == int(np.prod(want))):
                raise BadRequest(f"dense '{k}': {what} shape {v.shape}, expected {want}")

    # -- reads / writes ------------------------------------------------------------
    def pull(self, names: Sequence[str] | None = None) -> dict[str, np.ndarray]:
        """Copies of the named parameters (all when ``names`` is None)."""
        with self.lock:
            names = list(self._params) if names is None else list(names)
            self._check_names(names)
            return {n: self._params[n].numpy().copy() for n in names}

    def push(self, grads: Mapping[str, np.ndarray]) -> int:
        """One optimizer step per named gradient. All-or-nothing: validated first.

        Raises:
            BadRequest: unknown name, wrong dtype/shape, or NaN/Inf in a gradient.
        """
        with self.lock:
            self._check_values(grads, "gradient")
            for k, g in grads.items():
                if not np.isfinite(g).all():
                    raise BadRequest(f"dense '{k}': gradient holds NaN/Inf; push rejected")
            if self._fused(grads):
                self.pushes += 1
                return len(grads)
            for k, g in grads.items():
                p = self._params[k]
                self._step(p, self._state[k], torch.from_numpy(np.array(g, dtype=np.float32).reshape(p.shape)))
            self.pushes += 1
            return len(grads)

    def _fused(self, grads: Mapping[str, np.ndarray]) -> bool:
        """One update over the flat buffers when ``grads`` names every parameter, in registration
        order, and their step counts agree; False (nothing done) otherwise."""
        if len(grads) != len(self._params) or list(grads) != list(self._params):
            return False
        steps = {float(st["step"]) for st in self._state.values() if "step" in st}
        if len(steps) > 1:
            return False
        g = torch.cat([torch.from_numpy(np.asarray(v, dtype=np.float32)).reshape(-1) for v in grads.values()])
        step = torch.zeros((), dtype=torch.float32) if not steps else torch.tensor(steps.pop(), dtype=torch.float32)
        state = dict(self._flat_state, step=step)
        self._step(self._flat, state, g)
        for st in self._state.values():
            if "step" in st:
                st["step"].copy_(state["step"])
        return True

    def set(self, values: Mapping[str, np.ndarray]) -> None:
        """Overwrite values (restore, all-reduce modes); optimizer state is kept."""
        with self.lock:
            self._check_values(values, "value")
            for k, v in values.items():
                p = self._params[k]
                p.copy_(torch.from_numpy(np.asarray(v, dtype=np.float32).reshape(p.shape)))

    # -- checkpoint ----------------------------------------------------------------
    def state(self) -> dict[str, dict[str, np.ndarray]]:
        """name -> {"value": array, "opt/<key>": array, ...} (copies)."""
        with self.lock:
            out: dict[str, dict[str, np.ndarray]] = {}
            for k, p in self._params.items():
                entry = {"value": p.numpy().copy()}
                for sk, sv in self._state[k].items():
                    entry[f"opt/{sk}"] = sv.numpy().copy()
                out[k] = entry
            return out

    def load_state(self, state: Mapping[str, Mapping[str, np.ndarray]]) -> None:
        """Restore values and optimizer state (registers missing names)."""
        with self.lock:
            for k, entry in state.items():
                value = np.asarray(entry["value"], dtype=np.float32)
                if k in self._params and tuple(self._params[k].shape) != value.shape:
                    raise BadRequest(f"dense '{k}': checkpoint shape {value.shape}, registered {tuple(self._params[k].shape)}")
                self.register(k, value)
                p = self._params[k]
                p.copy_(torch.from_numpy(value))
                fresh = self._new_state(p)
                for sk in fresh:
                    saved = entry.get(f"opt/{sk}")
                    if saved is None:
                        raise BadRequest(f"dense '{k}': checkpoint lacks optimizer state '{sk}' ({self.cfg.kind.value})")
                    saved = np.asarray(saved, dtype=np.float32)
                    if saved.shape != tuple(fresh[sk].shape):
                        raise BadRequest(f"dense '{k}': optimizer state '{sk}' shape {saved.shape}, expected {tuple(fresh[sk].shape)}")
                    fresh[sk] = torch.from_numpy(saved.copy())
                for sk, sv in fresh.items():  # into the flat views (and the parameter's own step)
                    self._state[k][sk].copy_(sv)

    def memory_bytes(self) -> int:
        with self.lock:
            total = sum(p.numel() * 4 for p in self._params.values())
            for st in self._state.values():
                total += sum(sv.numel() * sv.element_size() for sv in st.values())
            return int(total)
