"""Dense parameters held on a PS shard (when dense sync mode is "ps").

Each named parameter is a float32 CPU tensor with its own optimizer state
(Adam, AdamW, Adagrad or SGD, torch.optim's formulas), so a push to one parameter
never steps another's state.

Weight decay (the dense network's L2, ``[ps] dense_optimizer.weight_decay``) is L2 in
the gradient (``g += wd * w``) for adam, adagrad and sgd, as for the sparse tables, and
decoupled for adamw (``w *= 1 - lr * wd`` before the Adam step). It applies to every
parameter but the meta learner's (names starting with :data:`DECAY_EXEMPT_PREFIXES`:
learned inner rates are log rates, which a decay would pull to a rate of 1). The rule
is by name, in this class, so a PS and a worker's local store (train-local, all-reduce)
decay the same parameters. It is one ``addcmul`` over the pushed spans with a 0/1 mask
(built once per layout), before the kernel, which then runs with ``weight_decay = 0``;
with ``weight_decay = 0`` (the default) nothing of it runs.

Storage is flat: every parameter (and each per-element optimizer state) is a
view of one buffer, in registration order; the step counts are one float32
tensor with a 0-dim view per parameter::

    flat      [ mlp.0.weight ........ | mlp.0.bias | out.weight ... ]   float32 [total]
    exp_avg   [ ...                   |            |            ... ]   same layout
    steps     [ s_0 | s_1 | s_2 ... ]                                   one per parameter

The update is torch's fused CPU kernel (``torch._fused_adam_``,
``_fused_adagrad_``, ``_fused_sgd_``: what ``torch.optim.Adam(fused=True)``
runs): one vectorized pass over parameter, gradient and state instead of ~8
tensor ops each reading and writing the whole buffer. A push of every parameter
whose step counts agree (a worker's step: the usual case) is one kernel call
over the flat buffers, whatever the number of parameters; any other push runs
the same kernel per parameter on the views. The kernel is elementwise, so both
give the same bits (tests/ps/test_dense_store.py), and it matches torch.optim's
default Adam / Adagrad / SGD to float rounding (same test file).

A push's gradients are copied once into one flat buffer (``np.concatenate``
into a preallocated array) and checked for NaN/Inf with one sum (a finite sum
proves every element finite; only a non-finite sum checks parameter by
parameter, to name the bad one). Issue 36 item 4: 72K parameters (the ``dnn``
model of ``bench.peers``) took ~0.4 ms of CPU a push with ~8 ops per update
and a numpy finiteness check per parameter; see docs/BENCHMARKS.md.

Example::

    d = DenseStore(OptimizerConfig(kind=OptimizerKind.ADAM, lr=1e-3))
    d.register("mlp.0.weight", (16, 8))        # zeros
    d.register("mlp.0.bias", np.ones(8, np.float32))
    d.push({"mlp.0.bias": np.full(8, 0.1, np.float32)})
    d.pull(["mlp.0.bias"])["mlp.0.bias"].shape  # (8,)
"""

from __future__ import annotations

import math
import threading
from typing import Mapping, Sequence

import numpy as np
import torch

from ps.config import DENSE_OPTIMIZERS, OptimizerConfig, OptimizerKind
from ps.errors import BadRequest


DECAY_EXEMPT_PREFIXES = ("meta_learner.",)
"""Dense parameters weight decay leaves alone: the meta learner's (``models.meta_learner.PREFIX``;
tests/ps/test_dense_store.py checks they agree: ``ps`` does not import ``models``)."""

_ALIGN = 16
"""Each parameter's slot in the flat buffers starts at, and spans, a multiple of 16 float32 (a 64-byte
cache line: the fused kernels' work unit, and a multiple of every vector width), so every element
of it takes the kernel's vector path, in a push of every parameter (one call over the flat buffers)
and in a push of some (one call over their slots) alike: the same bits either way."""


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
        """name -> its state: per-element entries are views of :attr:`_flat_state`; ``step`` a 0-dim view of
        :attr:`_steps`."""
        self._flat = torch.zeros(0, dtype=torch.float32)
        self._flat_state: dict[str, torch.Tensor] = {}
        self._steps = torch.zeros(0, dtype=torch.float32)
        """One step count per parameter (registration order); empty for SGD."""
        self._steps_agree: bool | None = True
        """Whether every step count is the same (None: not known, computed at the next push)."""
        self._slots: dict[str, tuple[int, int, int]] = {}
        """name -> (start, stop, padded stop) in the flat buffers; stop - start = numel, padded stop a
        multiple of :data:`_ALIGN`."""
        self._grad = np.zeros(0, dtype=np.float32)
        """The flat gradient buffer a push writes into (:attr:`_flat`'s layout; padding stays 0)."""
        self._grad_t = torch.from_numpy(self._grad)
        self._decay: torch.Tensor | None = None
        """1.0 on the elements weight decay applies to, 0.0 elsewhere (exempt parameters, padding);
        :attr:`_flat`'s layout, built at the first decayed push after a (re)layout."""
        self.pushes = 0

    def _relayout(self, name: str, value: torch.Tensor) -> None:
        """Append parameter ``name`` to the flat buffers (a new registration): existing values and
        states are copied into the new buffers, every view re-pointed."""
        items = list(self._params.items()) + [(name, value)]
        sizes = [p.numel() for _, p in items]
        padded = [-(-n // _ALIGN) * _ALIGN for n in sizes]
        total = sum(padded)
        flat = torch.zeros(total, dtype=torch.float32)
        fresh_state = self._new_state(value)
        keys = [k for k in fresh_state if k != "step"]
        flat_state = {k: torch.zeros(total, dtype=torch.float32) for k in keys}
        has_step = "step" in fresh_state
        steps = torch.zeros(len(sizes) if has_step else 0, dtype=torch.float32)
        params: dict[str, torch.Tensor] = {}
        state: dict[str, dict[str, torch.Tensor]] = {}
        slots: dict[str, tuple[int, int, int]] = {}
        at = 0
        for i, ((n, old), size, pad) in enumerate(zip(items, sizes, padded)):
            params[n] = flat[at : at + size].view(old.shape)
            params[n].copy_(old)
            st = self._state.get(n, fresh_state)
            state[n] = {}
            if has_step:
                steps[i] = st["step"]
                state[n]["step"] = steps[i]  # a 0-dim view
            for k in keys:
                view = flat_state[k][at : at + size].view(old.shape)
                view.copy_(st[k])
                state[n][k] = view
            slots[n] = (at, at + size, at + pad)
            at += pad
        self._flat, self._flat_state, self._params, self._state = flat, flat_state, params, state
        self._steps, self._slots = steps, slots
        self._grad = np.zeros(total, dtype=np.float32)
        self._grad_t = torch.from_numpy(self._grad)
        self._decay = None
        self._steps_agree = None

    def _new_state(self, p: torch.Tensor) -> dict[str, torch.Tensor]:
        if self.cfg.kind in (OptimizerKind.ADAM, OptimizerKind.ADAMW):
            return {"step": torch.zeros((), dtype=torch.float32), "exp_avg": torch.zeros_like(p),
                    "exp_avg_sq": torch.zeros_like(p)}
        if self.cfg.kind == OptimizerKind.ADAGRAD:
            return {"step": torch.zeros((), dtype=torch.float32),
                    "sum": torch.full_like(p, self.cfg.initial_accumulator)}
        return {}

    @torch.no_grad()
    def _update(self, spans: list[tuple[int, int]], steps: list[torch.Tensor]) -> None:
        """One fused optimizer update of the flat-buffer ``spans`` by the gradient buffer.

        The kernels are what ``torch.optim``'s ``fused=True`` runs (Adam, Adagrad without lr
        decay, SGD without momentum), called directly: no optimizer object, no Python per element
        or per op. Weight decay is applied first, masked (module docstring): L2 into the gradient,
        or AdamW's decoupled shrink of the values. The caller has incremented the step counts
        (Adam, Adagrad). Padding elements (zero gradient) compute values nobody reads.

        Args:
            spans: (start, stop) of each updated range (multiples of :data:`_ALIGN`).
            steps: the step count of each span (0-dim float32); empty for SGD.
        """
        c = self.cfg
        p = [self._flat[a:b] for a, b in spans]
        g = [self._grad_t[a:b] for a, b in spans]
        if c.weight_decay:
            mask = self._decay_mask()
            ms = [mask[a:b] for a, b in spans]
            if c.kind == OptimizerKind.ADAMW:  # decoupled: w -= lr * wd * w
                torch._foreach_addcmul_(p, p, ms, value=-c.lr * c.weight_decay)
            else:  # L2: g += wd * w (what the kernels' own weight_decay does, masked)
                torch._foreach_addcmul_(g, p, ms, value=c.weight_decay)
        if c.kind == OptimizerKind.SGD:
            torch._fused_sgd_(p, g, [], weight_decay=0.0, momentum=0.0, lr=c.lr, dampening=0.0,
                              nesterov=False, maximize=False, is_first_step=False)
        elif c.kind == OptimizerKind.ADAGRAD:
            acc = self._flat_state["sum"]
            torch._fused_adagrad_(p, g, [acc[a:b] for a, b in spans], steps, lr=c.lr, lr_decay=0.0,
                                  weight_decay=0.0, eps=c.eps, maximize=False)
        else:  # adam, adamw (its decay applied above)
            m, v = self._flat_state["exp_avg"], self._flat_state["exp_avg_sq"]
            torch._fused_adam_(p, g, [m[a:b] for a, b in spans], [v[a:b] for a, b in spans], [], steps, lr=c.lr,
                               beta1=c.beta1, beta2=c.beta2, weight_decay=0.0, eps=c.eps, amsgrad=False,
                               maximize=False)

    def _decay_mask(self) -> torch.Tensor:
        """:attr:`_decay` for the current layout (built on first use after a relayout)."""
        if self._decay is None:
            mask = torch.zeros(self._flat.numel(), dtype=torch.float32)
            for name, (lo, hi, _) in self._slots.items():
                if not name.startswith(DECAY_EXEMPT_PREFIXES):
                    mask[lo:hi] = 1.0
            self._decay = mask
        return self._decay

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
        """Copies of the named parameters (all when ``names`` is None).

        Every parameter in registration order (a worker's usual request) is one copy of the flat
        buffer, returned as views of that copy.

        Args:
            names: parameter names; None: all.
        """
        with self.lock:
            names = list(self._params) if names is None else list(names)
            self._check_names(names)
            if names == list(self._params):
                flat = self._flat.numpy().copy()
                return {n: flat[lo:hi].reshape(self._params[n].shape) for n, (lo, hi, _) in self._slots.items()}
            return {n: self._params[n].numpy().copy() for n in names}

    def push(self, grads: Mapping[str, np.ndarray]) -> int:
        """One optimizer step per named gradient. All-or-nothing: validated first.

        Args:
            grads: name -> float32 gradient (the parameter's shape, or flat).

        Raises:
            BadRequest: unknown name, wrong dtype/shape, or NaN/Inf in a gradient.
        """
        with self.lock:
            self._check_values(grads, "gradient")
            every = len(grads) == len(self._params) and list(grads) == list(self._params)
            buf = self._grad
            for k, v in grads.items():  # into the flat gradient buffer (its slots' padding stays 0)
                lo, hi, _ = self._slots[k]
                buf[lo:hi] = np.asarray(v).reshape(-1)
            if every:
                finite = math.isfinite(float(self._grad_t.sum()))  # a finite sum proves every element finite
            else:
                finite = all(math.isfinite(float(self._grad_t[lo:hi].sum()))
                             for lo, hi, _ in (self._slots[k] for k in grads))
            if not finite:
                for k, v in grads.items():
                    if not np.isfinite(v).all():
                        raise BadRequest(f"dense '{k}': gradient holds NaN/Inf; push rejected")
            has_step = self._steps.numel() > 0
            if every and self._agree():  # one kernel call over the flat buffers
                if self._flat.numel():
                    if has_step:
                        self._steps += 1
                    self._update([(0, self._flat.numel())], [self._steps[0]] if has_step else [])
            elif grads:  # one kernel call over the pushed parameters' slots, each with its own step
                steps = [self._state[k]["step"] for k in grads] if has_step else []
                if steps:
                    torch._foreach_add_(steps, 1.0)
                    self._steps_agree = None
                self._update([(self._slots[k][0], self._slots[k][2]) for k in grads], steps)
            self.pushes += 1
            return len(grads)

    def _agree(self) -> bool:
        """Whether every parameter's step count is the same (cached until a partial push or a load)."""
        if self._steps_agree is None:
            s = self._steps
            self._steps_agree = bool(s.numel() == 0 or bool((s == s[0]).all()))
        return self._steps_agree

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
                for sk, sv in fresh.items():  # into the flat views (the step: a view of the step counts)
                    self._state[k][sk].copy_(sv)
            self._steps_agree = None

    def memory_bytes(self) -> int:
        with self.lock:
            total = sum(p.numel() * 4 for p in self._params.values())
            for st in self._state.values():
                total += sum(sv.numel() * sv.element_size() for sv in st.values())
            return int(total)
