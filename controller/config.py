"""``[controller]`` of the job TOML: DDS, Monitor, Policy, Agent and checkpoint settings.

Every section is a frozen dataclass with ``validate()``; build them from plain
Python objects in tests, or from TOML through :func:`common.config.from_mapping`.

Example::

    [controller]
    address = "127.0.0.1:0"
    policy = "nd"
    [controller.dds]
    batches_per_shard = 8
    lease_s = 30.0
    [controller.monitor]
    window_s = 10.0
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class PolicyKind(str, enum.Enum):
    """Which straggler policy the controller runs."""

    ND = "nd"      # PS mode, shared cluster: smaller shards, restart, move vshards
    DD = "dd"      # all-reduce mode, dedicated cluster: speed-proportional batches
    NONE = "none"  # detection events only, no actions


@dataclass(frozen=True)
class DdsConfig:
    """Dynamic data sharding.

    Args:
        batches_per_shard: default shard size, in record batches.
        worker_batches_per_shard: per-worker override (key: worker index as a string).
        lease_s: a DOING shard returns to TODO when its worker stops heartbeating this long.
        hang_factor: a shard held longer than ``hang_factor`` x (recent mean shard time)
            is requeued even while its worker heartbeats (a hung worker).
        hang_min_s: lower bound of that hang timeout.
        seed: shuffle seed; epoch ``e`` is shuffled with ``seed + e``.
        warn_failures: from this many failures of one shard on, every failure is an ERROR
            log and an event (the shard is still never dropped).
        slow_shrink: a worker flagged slow gets shards ``slow_shrink`` times smaller.
        tail_split_min_batches: the tail fix. When a dataset's TODO is empty and a worker
            waits for data while another holds a lease with at least this many batches not
            yet started (heartbeat progress), the holder is told to stop that lease early
            (``truncate`` command); its report of the part it trained puts the rest at the
            head of TODO for the idle worker (exactly once: see controller/dds.py). 0: off.

    Example::

        DdsConfig(batches_per_shard=4, lease_s=2.0)
    """

    batches_per_shard: int = 8
    worker_batches_per_shard: dict[str, int] = field(default_factory=dict)
    lease_s: float = 60.0
    hang_factor: float = 4.0
    hang_min_s: float = 120.0
    seed: int = 0
    warn_failures: int = 3
    slow_shrink: int = 4
    tail_split_min_batches: int = 2

    def validate(self) -> None:
        if self.tail_split_min_batches < 0:
            raise ValueError(f"dds.tail_split_min_batches must be >= 0 (0 = off), got {self.tail_split_min_batches}")
        if self.batches_per_shard < 1:
            raise ValueError(f"dds.batches_per_shard must be >= 1, got {self.batches_per_shard}")
        for k, v in self.worker_batches_per_shard.items():
            if not k.isdigit():
                raise ValueError(f"dds.worker_batches_per_shard key must be a worker index, got {k!r}")
            if v < 1:
                raise ValueError(f"dds.worker_batches_per_shard[{k}] must be >= 1, got {v}")
        if self.lease_s <= 0:
            raise ValueError(f"dds.lease_s must be > 0, got {self.lease_s}")
        if self.hang_factor <= 1:
            raise ValueError(f"dds.hang_factor must be > 1, got {self.hang_factor}")
        if self.hang_min_s <= 0:
            raise ValueError(f"dds.hang_min_s must be > 0, got {self.hang_min_s}")
        if self.warn_failures < 1:
            raise ValueError(f"dds.warn_failures must be >= 1, got {self.warn_failures}")
        if self.slow_shrink < 1:
            raise ValueError(f"dds.slow_shrink must be >= 1, got {self.slow_shrink}")


@dataclass(frozen=True)
class MonitorConfig:
    """Monitor windows and straggler detection thresholds.

    Args:
        window_s: length of one fixed window.
        keep_windows: completed windows kept for policies.
        ratio: a node is slow in a window when its value > ratio x median of its peers.
        consecutive: windows in a row a node must be slow before it is flagged.
        min_peers: fewer peers than this and nothing is compared.
    """

    window_s: float = 10.0
    keep_windows: int = 32
    ratio: float = 2.0
    consecutive: int = 3
    min_peers: int = 1

    def validate(self) -> None:
        if self.window_s <= 0:
            raise ValueError(f"monitor.window_s must be > 0, got {self.window_s}")
        if self.keep_windows < 1:
            raise ValueError(f"monitor.keep_windows must be >= 1, got {self.keep_windows}")
        if self.ratio <= 1.0:
            raise ValueError(f"monitor.ratio must be > 1.0, got {self.ratio}")
        if self.consecutive < 1:
            raise ValueError(f"monitor.consecutive must be >= 1, got {self.consecutive}")
        if self.min_peers < 1:
            raise ValueError(f"monitor.min_peers must be >= 1, got {self.min_peers}")


@dataclass(frozen=True)
class NdConfig:
    """AntDT-ND (PS mode) actions.

    Args:
        restart_after: extra slow windows (after the flag) before the worker's agent
            is told to restart it; 0 disables restarts.
        move_vshards: vshards moved away from a slow PS per action; 0 disables moves.
        cooldown_windows: windows between two actions on the same node.
        keep: vshards a slow PS always keeps when vshards move away from it. 1 (default):
            it keeps a little traffic, so its latency stays measured and it can be seen to
            recover; 0: a persistently slow PS can be drained completely (best when its
            slowness is per request rather than per row, but then nothing measures it).
        release_slow_clock: a worker flagged slow leaves the PS step clocks (bounded
            staleness, async mode) until it is no longer flagged or restarts: the others
            stop waiting for it in their pulls, its own pulls never wait (it is behind) and
            its pushes are applied as in pure async. It rejoins at no less than the slowest
            clock present. false: a slow worker holds the fleet to its step rate + max_staleness.
    """

    restart_after: int = 3
    move_vshards: int = 8
    cooldown_windows: int = 6
    keep: int = 1
    release_slow_clock: bool = True

    def validate(self) -> None:
        if not isinstance(self.release_slow_clock, bool):
            raise ValueError(f"nd.release_slow_clock must be true or false, got {self.release_slow_clock!r}")
        if self.restart_after < 0:
            raise ValueError(f"nd.restart_after must be >= 0, got {self.restart_after}")
        if self.move_vshards < 0:
            raise ValueError(f"nd.move_vshards must be >= 0, got {self.move_vshards}")
        if self.cooldown_windows < 0:
            raise ValueError(f"nd.cooldown_windows must be >= 0, got {self.cooldown_windows}")
        if self.keep < 0:
            raise ValueError(f"nd.keep must be >= 0, got {self.keep}")


@dataclass(frozen=True)
class DdConfig:
    """AntDT-DD (all-reduce mode): per-worker batch sizes.

    Args:
        global_batch: the constant sum of every worker's batch size.
        min_change: re-balance only when some worker's size would change by more
            than this fraction (avoids churn from noise).
        smoothing: EMA weight of the newest window's samples/s (1 = no smoothing);
            used by the samples/s-proportional fallback.
        min_size: the smallest batch size any worker is given (>= 1).
        damping: each re-balance moves this fraction of the way from the current
            sizes to the balanced target (1 = jump straight there).
        tolerance: hysteresis; no re-balance while the current sizes' predicted
            step time is within this fraction of the balanced sizes' one.
        fit_windows: recent monitor windows per worker kept to fit its step cost
            ``a + b x batch size`` (>= 2).
    """

    global_batch: int = 1024
    min_change: float = 0.05
    smoothing: float = 0.3
    min_size: int = 1
    damping: float = 0.5
    tolerance: float = 0.05
    fit_windows: int = 8

    def validate(self) -> None:
        if self.global_batch < 1:
            raise ValueError(f"dd.global_batch must be >= 1, got {self.global_batch}")
        if not 0 <= self.min_change < 1:
            raise ValueError(f"dd.min_change must be in [0, 1), got {self.min_change}")
        if not 0 < self.smoothing <= 1:
            raise ValueError(f"dd.smoothing must be in (0, 1], got {self.smoothing}")
        if not 1 <= self.min_size <= self.global_batch:
            raise ValueError(f"dd.min_size must be in [1, dd.global_batch={self.global_batch}], got {self.min_size}")
        if not 0 < self.damping <= 1:
            raise ValueError(f"dd.damping must be in (0, 1], got {self.damping}")
        if not 0 <= self.tolerance < 1:
            raise ValueError(f"dd.tolerance must be in [0, 1), got {self.tolerance}")
        if self.fit_windows < 2:
            raise ValueError(f"dd.fit_windows must be >= 2, got {self.fit_windows}")


@dataclass(frozen=True)
class AgentConfig:
    """The per-node agent.

    Args:
        heartbeat_s: heartbeat period.
        restart_limit: crashes restarted before the agent gives up (exit 1).
        backoff_s: first restart delay; doubles per crash up to ``backoff_max_s``.
        stop_grace_s: SIGTERM -> SIGKILL grace when stopping the child.
    """

    heartbeat_s: float = 2.0
    restart_limit: int = 5
    backoff_s: float = 1.0
    backoff_max_s: float = 60.0
    stop_grace_s: float = 10.0

    def validate(self) -> None:
        if self.heartbeat_s <= 0:
            raise ValueError(f"agent.heartbeat_s must be > 0, got {self.heartbeat_s}")
        if self.restart_limit < 0:
            raise ValueError(f"agent.restart_limit must be >= 0, got {self.restart_limit}")
        if self.backoff_s < 0 or self.backoff_max_s < self.backoff_s:
            raise ValueError(
                f"agent.backoff_s must be >= 0 and <= backoff_max_s, got {self.backoff_s} / {self.backoff_max_s}"
            )
        if self.stop_grace_s <= 0:
            raise ValueError(f"agent.stop_grace_s must be > 0, got {self.stop_grace_s}")


@dataclass(frozen=True)
class ControllerConfig:
    """The AntDT controller (``[controller]``).

    Args:
        address: where the service listens (``host:0`` picks a port; the chosen
            address is written to ``<state_dir>/address``).
        state_dir: LMDB state directory ('' = ``<run.dir>/controller``).
        policy: ``nd`` | ``dd`` | ``none``.
        heartbeat_timeout_s: a node silent this long is dead; its shards are requeued.
        worker_stall_timeout_s: a worker that holds shards but makes no progress (no step,
            no shard report) this long is stalled (SIGSTOP, deadlock): its shards are
            requeued, a ``worker_stalled`` event recorded and its agent told to restart it;
            a worker idle waiting for data is never flagged (controller/liveness.py).
            0 = off. Must exceed ``2 x agent.heartbeat_s``.
        tick_s: period of the background loop (leases, heartbeats, windows, policy).
        checkpoint_interval_s: coordinated checkpoint trigger period (default 5 minutes: a PS
            restart is recovered to a cut at most this old); 0 = off (a PS restart then fails
            the run: there is nothing consistent to restore).
        eval_epochs: passes over the eval dataset.
        max_workers: gRPC server threads.
        fsync: fsync LMDB on every commit. Off by default: a committed txn already
            survives the controller process dying (it is in the page cache); turn it
            on to survive the machine losing power too.

    Example::

        cfg = ControllerConfig(dds=DdsConfig(lease_s=2.0), policy=PolicyKind.ND)
    """

    address: str = "127.0.0.1:0"
    state_dir: str = ""
    policy: PolicyKind = PolicyKind.ND
    heartbeat_timeout_s: float = 30.0
    worker_stall_timeout_s: float = 60.0
    tick_s: float = 0.5
    checkpoint_interval_s: float = 300.0
    eval_epochs: int = 1
    max_workers: int = 16
    fsync: bool = False
    dds: DdsConfig = field(default_factory=DdsConfig)
    monitor: MonitorConfig = field(default_factory=MonitorConfig)
    nd: NdConfig = field(default_factory=NdConfig)
    dd: DdConfig = field(default_factory=DdConfig)
    agent: AgentConfig = field(default_factory=AgentConfig)

    def validate(self) -> None:
        if ":" not in self.address:
            raise ValueError(f"address must be host:port, got {self.address!r}")
        if self.heartbeat_timeout_s <= 0:
            raise ValueError(f"heartbeat_timeout_s must be > 0, got {self.heartbeat_timeout_s}")
        if self.worker_stall_timeout_s < 0:
            raise ValueError(f"worker_stall_timeout_s must be >= 0 (0 = off), got {self.worker_stall_timeout_s}")
        if 0 < self.worker_stall_timeout_s <= 2 * self.agent.heartbeat_s:
            raise ValueError(f"worker_stall_timeout_s must be > 2 x agent.heartbeat_s "
                             f"({2 * self.agent.heartbeat_s:g}s) so heartbeat gaps are not stalls, "
                             f"got {self.worker_stall_timeout_s}")
        if self.tick_s <= 0:
            raise ValueError(f"tick_s must be > 0, got {self.tick_s}")
        if self.checkpoint_interval_s < 0:
            raise ValueError(f"checkpoint_interval_s must be >= 0, got {self.checkpoint_interval_s}")
        if self.eval_epochs < 1:
            raise ValueError(f"eval_epochs must be >= 1, got {self.eval_epochs}")
        if self.max_workers < 2:
            raise ValueError(f"max_workers must be >= 2, got {self.max_workers}")
        for sub in (self.dds, self.monitor, self.nd, self.dd, self.agent):
            sub.validate()
