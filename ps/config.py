"""Configuration of the parameter server: the ``[ps]`` section of the job TOML.

Example (job TOML)::

    [ps]
    shards = 2
    num_vshards = 256

    [ps.table_defaults]
    dim = 16
    capacity = 100000
    optimizer = { kind = "rowwise_adagrad", lr = 0.05 }
    admission = { min_count = 2 }
    eviction = { policy = "lfu", evict_fraction = 0.05 }

    [[ps.tables]]          # per-table override; unset fields use table_defaults
    name = "item"
    dim = 32
    optimizer = { kind = "adam", lr = 0.001 }

Load it with ``common.config.load_toml(PsConfig, "job.toml", section="ps")``
and resolve the tables of a schema with ``cfg.table_configs(names)``.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from dataclasses import dataclass, field
from typing import Optional

from ps.intra_op import MAX_THREADS as MAX_INTRA_OP_THREADS

__all__ = [
    "OptimizerKind",
    "OptimizerConfig",
    "AdmissionConfig",
    "EvictionPolicy",
    "EvictionConfig",
    "InitKind",
    "TableConfig",
    "TableDefaults",
    "TableOverride",
    "DeviceKind",
    "NonfiniteMode",
    "ValueDtype",
    "SyncMode",
    "PsConfig",
]


class OptimizerKind(str, enum.Enum):
    ROWWISE_ADAGRAD = "rowwise_adagrad"
    ADAGRAD = "adagrad"
    SGD = "sgd"
    ADAM = "adam"
    FTRL = "ftrl"
    ADAMW = "adamw"  # dense parameters only: Adam with decoupled weight decay


class EvictionPolicy(str, enum.Enum):
    NONE = "none"
    LFU = "lfu"
    TTL = "ttl"


class InitKind(str, enum.Enum):
    NORMAL = "normal"
    UNIFORM = "uniform"
    ZEROS = "zeros"


class DeviceKind(str, enum.Enum):
    AUTO = "auto"
    CPU = "cpu"
    CUDA = "cuda"


class NonfiniteMode(str, enum.Enum):
    REJECT = "reject"
    DROP = "drop"


class ValueDtype(str, enum.Enum):
    FP32 = "fp32"
    FP16 = "fp16"


class SyncMode(str, enum.Enum):
    ASYNC = "async"
    SYNC = "sync"


@dataclass(frozen=True)
class OptimizerConfig:
    """Optimizer of one embedding table (or of the dense parameters).

    Weight decay is L2 (``g += weight_decay * w`` before the update) for every kind but
    ``adamw``, whose decay is decoupled (``w *= 1 - lr * weight_decay``, then the Adam step:
    Loshchilov & Hutter, torch.optim.AdamW). Under Adam an L2 term is divided by the
    gradient's running RMS like the gradient, so it hardly regularizes; ``adamw`` is the
    weight decay a small-data user expects on the dense network.

    Args:
        kind: rowwise_adagrad / adagrad / sgd (fused in fbgemm TBE), adam / ftrl (torch);
            adamw (Adam with decoupled weight decay) for ``[ps] dense_optimizer`` only.
        lr: learning rate (FTRL uses ``ftrl_alpha`` instead).
        eps: added to the denominator (adagrad kinds, adam, adamw).
        weight_decay: decay coefficient: L2 added to the gradient (``g += weight_decay * w``), or with
            ``adamw`` decoupled (``w *= 1 - lr * weight_decay`` before the step). On the dense
            parameters it applies to the model's, not to the meta learner's (``meta_learner.*``:
            learned inner rates, kept as log rates a decay would pull to a rate of 1).
        beta1, beta2: Adam / AdamW moments.
        ftrl_alpha, ftrl_beta, ftrl_l1, ftrl_l2: FTRL-proximal (McMahan et al. 2013).
        initial_accumulator: start value of adagrad accumulators and FTRL ``n``.

    Example::

        OptimizerConfig(kind=OptimizerKind.ADAM, lr=1e-3)
    """

    kind: OptimizerKind = OptimizerKind.ROWWISE_ADAGRAD
    lr: float = 0.05
    eps: float = 1e-8
    weight_decay: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.999
    ftrl_alpha: float = 0.05
    ftrl_beta: float = 1.0
    ftrl_l1: float = 0.0
    ftrl_l2: float = 0.0
    initial_accumulator: float = 0.0

    def validate(self) -> None:
        if not self.lr > 0:
            raise ValueError(f"optimizer lr must be > 0, got {self.lr}")
        if not self.eps >= 0:
            raise ValueError(f"optimizer eps must be >= 0, got {self.eps}")
        if not self.weight_decay >= 0:
            raise ValueError(f"optimizer weight_decay must be >= 0, got {self.weight_decay}")
        for name in ("beta1", "beta2"):
            v = getattr(self, name)
            if not 0.0 <= v < 1.0:
                raise ValueError(f"optimizer {name} must be in [0, 1), got {v}")
        if not self.ftrl_alpha > 0:
            raise ValueError(f"optimizer ftrl_alpha must be > 0, got {self.ftrl_alpha}")
        for name in ("ftrl_beta", "ftrl_l1", "ftrl_l2", "initial_accumulator"):
            v = getattr(self, name)
            if not v >= 0:
                raise ValueError(f"optimizer {name} must be >= 0, got {v}")
        if self.kind == OptimizerKind.FTRL and self.ftrl_beta == 0 and self.initial_accumulator == 0:
            # the FTRL weight divides by (beta + sqrt(n)) / alpha: both zero is 0/0 on a fresh row
            raise ValueError("ftrl needs ftrl_beta > 0 or initial_accumulator > 0 (else the first update divides by zero)")


@dataclass(frozen=True)
class AdmissionConfig:
    """When a new id gets a row.

    * ``min_count > 1``: admitted once seen in that many pushes;
    * ``probability < 1``: admitted with that probability per sighting,
      deterministic per (id, sighting count, seed);
    * both set: whichever comes first; both default (1, 1.0): admitted at once.

    Until admitted an id reads as its initial value and its gradients are dropped
    (and counted).
    """

    min_count: int = 1
    probability: float = 1.0

    def validate(self) -> None:
        if self.min_count < 1:
            raise ValueError(f"admission min_count must be >= 1, got {self.min_count}")
        if not 0.0 <= self.probability <= 1.0:
            raise ValueError(f"admission probability must be in [0, 1], got {self.probability}")
        if self.probability == 0.0 and self.min_count == 1:
            raise ValueError("admission probability 0 with min_count 1 would never admit any id")

    @property
    def immediate(self) -> bool:
        """True when every id is admitted at its first sighting (no tracking needed)."""
        return self.min_count <= 1 and self.probability >= 1.0


@dataclass(frozen=True)
class EvictionConfig:
    """What happens when a table is full and a new id is admitted.

    Args:
        policy: ``lfu`` evicts the least frequently pushed rows; ``ttl`` evicts rows
            untouched for more than ``ttl_steps`` table steps (oldest first, and
            falls back to the oldest rows when too few have expired); ``none``
            drops the new ids' gradients (counted as ``full_dropped``).
        ttl_steps: idle steps after which a row counts as expired (ttl).
        evict_fraction: fraction of capacity freed at once, so eviction is amortized.
    """

    policy: EvictionPolicy = EvictionPolicy.LFU
    ttl_steps: int = 0
    evict_fraction: float = 0.05

    def validate(self) -> None:
        if self.ttl_steps < 0:
            raise ValueError(f"eviction ttl_steps must be >= 0, got {self.ttl_steps}")
        if not 0.0 < self.evict_fraction <= 1.0:
            raise ValueError(f"eviction evict_fraction must be in (0, 1], got {self.evict_fraction}")


def _check_dim_capacity(dim: int, capacity: int, init_scale: float, where: str) -> None:
    if dim < 4 or dim % 4 != 0:
        raise ValueError(
            f"{where}dim must be a positive multiple of 4 (fbgemm TBE requires dim % 4 == 0), got {dim}"
        )
    if capacity < 1:
        raise ValueError(f"{where}capacity must be >= 1, got {capacity}")
    if capacity > 2**31 - 1:
        raise ValueError(f"{where}capacity must be < 2^31 (fbgemm TBE row limit), got {capacity}")
    if not init_scale >= 0:
        raise ValueError(f"{where}init_scale must be >= 0, got {init_scale}")


def _check_table_optimizer(opt: "OptimizerConfig", where: str) -> None:
    if OptimizerKind(opt.kind) not in TABLE_OPTIMIZERS:
        raise ValueError(f"{where}optimizer.kind '{OptimizerKind(opt.kind).value}' is for [ps] dense_optimizer only; "
                         f"a table takes one of {[k.value for k in TABLE_OPTIMIZERS]}")


def _check_clip(cfg: "TableConfig | TableDefaults", where: str) -> None:
    for key in ("grad_clip_norm", "grad_clip_value"):
        v = getattr(cfg, key)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
            raise ValueError(f"{where}{key} must be a finite number > 0, or 0 = off; got {v!r}")


@dataclass(frozen=True)
class TableConfig:
    """One embedding table as stored on ONE PS shard.

    Args:
        name: table name (from the schema's id columns).
        dim: row length; a multiple of 4 (fbgemm TBE).
        capacity: rows per shard (fixed; eviction makes room).
        optimizer, admission, eviction: see their classes.
        init: initial row distribution; deterministic per (table, id, seed). An ftrl
            table must use ``zeros`` (or ``init_scale = 0``): FTRL-Proximal derives
            w from its state and starts every row at w = 0.
        init_scale: std (normal) or half-width (uniform).
        grad_clip_norm: if > 0, each id's summed gradient is scaled down to this L2
            norm when above it, before weight decay and the optimizer (0 = off).
        grad_clip_value: if > 0, each gradient element is clamped to
            [-grad_clip_value, grad_clip_value] first (0 = off).

    Example::

        TableConfig(name="user", dim=16, capacity=1000)
    """

    name: str
    dim: int = 16
    capacity: int = 100_000
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)
    eviction: EvictionConfig = field(default_factory=EvictionConfig)
    init: InitKind = InitKind.NORMAL
    init_scale: float = 0.01
    grad_clip_norm: float = 0.0
    grad_clip_value: float = 0.0

    def validate(self) -> None:
        if not self.name or "/" in self.name:
            raise ValueError(f"table name must be non-empty and contain no '/', got {self.name!r}")
        where = f"table '{self.name}': "
        _check_dim_capacity(self.dim, self.capacity, self.init_scale, where)
        _check_clip(self, where)
        _check_table_optimizer(self.optimizer, where)
        if self.optimizer.kind == OptimizerKind.FTRL and InitKind(self.init) != InitKind.ZEROS and self.init_scale != 0:
            raise ValueError(
                f"{where}optimizer kind 'ftrl' (FTRL-Proximal: w derived from z and n, w = 0 at the start) "
                f"needs init = \"zeros\", got init = \"{InitKind(self.init).value}\" with init_scale {self.init_scale}"
            )
        self.optimizer.validate()
        self.admission.validate()
        self.eviction.validate()


@dataclass(frozen=True)
class TableDefaults:
    """Defaults applied to every table (``[ps.table_defaults]``): TableConfig minus name."""

    dim: int = 16
    capacity: int = 100_000
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)
    eviction: EvictionConfig = field(default_factory=EvictionConfig)
    init: InitKind = InitKind.NORMAL
    init_scale: float = 0.01
    grad_clip_norm: float = 0.0
    grad_clip_value: float = 0.0

    def validate(self) -> None:
        _check_dim_capacity(self.dim, self.capacity, self.init_scale, "table_defaults: ")
        _check_clip(self, "table_defaults: ")
        _check_table_optimizer(self.optimizer, "table_defaults: ")


@dataclass(frozen=True)
class TableOverride:
    """Per-table override (``[[ps.tables]]``); a field left unset (None) uses the default.

    Nested sections (optimizer, admission, eviction) replace the default section
    as a whole: unset keys inside them take the section's own defaults.
    """

    name: str
    dim: Optional[int] = None
    capacity: Optional[int] = None
    optimizer: Optional[OptimizerConfig] = None
    admission: Optional[AdmissionConfig] = None
    eviction: Optional[EvictionConfig] = None
    init: Optional[InitKind] = None
    init_scale: Optional[float] = None
    grad_clip_norm: Optional[float] = None
    grad_clip_value: Optional[float] = None

    def validate(self) -> None:
        if not self.name:
            raise ValueError("a [[ps.tables]] override needs a name")


@dataclass(frozen=True)
class PsConfig:
    """The ``[ps]`` section: the PS fleet, its tables and its storage rules.

    Args:
        shards: number of PS processes.
        num_vshards: virtual shards (``vshard = mix64(id) % num_vshards``), fixed per job.
        host, base_port: where shards listen: shard K binds base_port + K (``metaps launch`` refuses one
            in use); base_port 0: each shard binds a port of its own and publishes it.
        seed: seeds initial rows and probabilistic admission.
        device: where tables live (auto = cuda when available).
        table_defaults, tables: table settings (see :meth:`table_configs`).
        dense_optimizer: optimizer of the dense parameters (adam/adamw/adagrad/sgd), run by the PS
            (``[train] dense_sync = "ps"``) or in the worker (train-local, all-reduce): the same
            ``ps.dense_store`` code either way. Its ``weight_decay`` is the dense network's L2 /
            weight decay (decoupled with ``adamw``).
        nonfinite_grads: reject a push holding NaN/Inf, or drop those ids (counted).
        value_dtype: wire format of pulled rows.
        max_request_rows: largest pull/push a shard accepts in one request.
        sync, max_staleness: consistency mode (semantics owned by the service).
        server_threads: gRPC handler threads of one shard. No handler ever waits on
            another worker (staleness and barrier waits happen in the client), so a few
            suffice whatever the number of workers.
        intra_op_threads: threads one large pull or push of a shard is split over (its
            id-map lookup, gather and rowwise-Adagrad update, span by span; ``ps.intra_op``).
            1 (the default) = each request on its gRPC handler thread, as before. Worth it
            on a box with spare cores per shard and few data-plane calls at once; results
            are the same bits whatever the value.
        wait_timeout_s: longest a worker waits for slower workers (bounded staleness,
            sync barriers); a client-supplied barrier timeout is capped to it.
        max_pause_lease_s: cap on a PauseWrites lease (a pause ends by itself after it).
        max_freeze_lease_s: cap on a FreezeVshards lease (a freeze thaws by itself after it).
        clock_lease_s: a worker's step clock not renewed by its requests for this long
            expires: it stops holding the other workers back (a worker that died for
            good); the worker rejoins when it comes back. Must exceed the longest step.
            0 = clocks never expire.
        checkpoint_full_every: a coordinated checkpoint is full every this many; the
            ones between are deltas over the newest committed one (only the rows changed
            since it plus the ids evicted since it; restore reads base + deltas). 1 (the
            default) = always full, as before: a delta chain makes a restore read
            several checkpoints and retention keep their base, so turn it on (e.g. 4-8)
            when checkpoints are frequent and a small fraction of rows changes between them.

    Example::

        cfg = load_toml(PsConfig, "job.toml", section="ps")
        tables = cfg.table_configs(schema_table_names)
    """

    shards: int = 2
    num_vshards: int = 256
    host: str = "127.0.0.1"
    base_port: int = 0
    seed: int = 0
    device: DeviceKind = DeviceKind.AUTO
    table_defaults: TableDefaults = field(default_factory=TableDefaults)
    tables: list[TableOverride] = field(default_factory=list)
    dense_optimizer: OptimizerConfig = field(
        default_factory=lambda: OptimizerConfig(kind=OptimizerKind.ADAM, lr=1e-3)
    )
    nonfinite_grads: NonfiniteMode = NonfiniteMode.REJECT
    value_dtype: ValueDtype = ValueDtype.FP32
    max_request_rows: int = 1 << 20
    sync: SyncMode = SyncMode.ASYNC
    max_staleness: int = 4
    server_threads: int = 8
    intra_op_threads: int = 1
    wait_timeout_s: float = 60.0
    max_pause_lease_s: float = 600.0
    max_freeze_lease_s: float = 600.0
    clock_lease_s: float = 60.0
    checkpoint_full_every: int = 1

    def validate(self) -> None:
        if isinstance(self.checkpoint_full_every, bool) or not isinstance(self.checkpoint_full_every, int) \
                or self.checkpoint_full_every < 1:
            raise ValueError(f"checkpoint_full_every must be an integer >= 1 (1 = always full), "
                             f"got {self.checkpoint_full_every!r}")
        if self.server_threads < 2:
            raise ValueError(f"server_threads must be >= 2, got {self.server_threads}")
        if isinstance(self.intra_op_threads, bool) or not isinstance(self.intra_op_threads, int) \
                or not 1 <= self.intra_op_threads <= MAX_INTRA_OP_THREADS:
            raise ValueError(f"intra_op_threads must be an integer in [1, {MAX_INTRA_OP_THREADS}] (1 = off), "
                             f"got {self.intra_op_threads!r}")
        for name in ("wait_timeout_s", "max_pause_lease_s", "max_freeze_lease_s"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v > 0):
                raise ValueError(f"{name} must be a finite number > 0, got {v}")
        if not (math.isfinite(self.clock_lease_s) and self.clock_lease_s >= 0):
            raise ValueError(f"clock_lease_s must be a finite number >= 0 (0 = off), got {self.clock_lease_s}")
        if self.shards < 1:
            raise ValueError(f"shards must be >= 1, got {self.shards}")
        if self.num_vshards < self.shards:
            raise ValueError(f"num_vshards must be >= shards ({self.shards}), got {self.num_vshards}")
        if not 0 <= self.base_port <= 65535:
            raise ValueError(f"base_port must be in [0, 65535], got {self.base_port}")
        if self.max_request_rows < 1:
            raise ValueError(f"max_request_rows must be >= 1, got {self.max_request_rows}")
        if self.max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0, got {self.max_staleness}")
        if self.dense_optimizer.kind not in DENSE_OPTIMIZERS:
            raise ValueError(
                f"dense_optimizer.kind must be one of {[k.value for k in DENSE_OPTIMIZERS]}, "
                f"got {self.dense_optimizer.kind.value!r}"
            )
        seen: set[str] = set()
        for ov in self.tables:
            if ov.name in seen:
                raise ValueError(f"table '{ov.name}' is overridden twice in [[ps.tables]]")
            seen.add(ov.name)
            self._resolve(ov.name, ov)  # validates the merged table now, not at first use

    def _resolve(self, name: str, ov: TableOverride | None) -> TableConfig:
        d = self.table_defaults
        kwargs = {f.name: getattr(d, f.name) for f in dataclasses.fields(TableDefaults)}
        if ov is not None:
            for key in kwargs:
                v = getattr(ov, key)
                if v is not None:
                    kwargs[key] = v
        cfg = TableConfig(name=name, **kwargs)
        cfg.validate()
        return cfg

    def table_configs(self, names: list[str]) -> list[TableConfig]:
        """Resolve defaults + overrides for the given table names (in that order).

        Args:
            names: the schema's table names (duplicates are collapsed).

        Raises:
            ValueError: an override names a table not in ``names``, or a merged
                table is invalid.

        Example::

            PsConfig().table_configs(["user", "item"])[0].dim  # 16
        """
        uniq = list(dict.fromkeys(names))
        by_name = {ov.name: ov for ov in self.tables}
        unknown = sorted(set(by_name) - set(uniq))
        if unknown:
            raise ValueError(
                f"[[ps.tables]] overrides unknown table(s) {unknown}; the schema's tables are {sorted(uniq)}"
            )
        return [self._resolve(n, by_name.get(n)) for n in uniq]


DENSE_OPTIMIZERS = (OptimizerKind.ADAM, OptimizerKind.ADAMW, OptimizerKind.ADAGRAD, OptimizerKind.SGD)
"""Optimizer kinds :class:`ps.dense_store.DenseStore` supports."""

TABLE_OPTIMIZERS = (OptimizerKind.ROWWISE_ADAGRAD, OptimizerKind.ADAGRAD, OptimizerKind.SGD, OptimizerKind.ADAM,
                    OptimizerKind.FTRL)
"""Optimizer kinds an embedding table takes (:func:`ps.optimizers.build`)."""
