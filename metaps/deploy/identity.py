"""Who am I and where are my peers, from the environment a pod gets.

Kubernetes hands a pod no hand-written addresses, only names::

    PS Indexed Job pod        $JOB_COMPLETION_INDEX = 3     -> shard 3   (``metaps ps --shard auto``;
                              where that is unset, the hostname's trailing number: an Indexed Job
                              pod's hostname is JOB-INDEX, e.g. metaps-ps-3)
    all-reduce Indexed Job    $JOB_COMPLETION_INDEX = 5     -> rank 5    (``metaps worker --rank auto``)
    work-queue Job (PS mode)  pod name, ClaimWorker RPC     -> an index from the controller
    PS addresses              ``{k}`` pattern, e.g. metaps-ps-{k}.metaps-ps:5000 (stable DNS names
                              through the headless Service), or ``controller``: the addresses
                              the PS processes registered with the controller

Example::

    shard = resolve_shard("auto", shards=4, hostname="metaps-ps-3")      # 3
    ps_addresses("metaps-ps-{k}.metaps-ps:5000", shards=2)
    # ['metaps-ps-0.metaps-ps:5000', 'metaps-ps-1.metaps-ps:5000']
"""

from __future__ import annotations

import os
import re
import socket
import time
from collections.abc import Callable, Mapping
from typing import Any

from common.errors import ConfigError

_ORDINAL = re.compile(r"-(\d+)$")


def pod_name(env: Mapping[str, str] | None = None) -> str:
    """This pod's name: ``$METAPS_POD_NAME`` (downward API ``metadata.name``), else the hostname."""
    env = os.environ if env is None else env
    return env.get("METAPS_POD_NAME") or env.get("HOSTNAME") or socket.gethostname()


def pod_ordinal(name: str) -> int:
    """The trailing number of an indexed pod's name (an Indexed Job pod's hostname ``metaps-ps-3`` -> 3).

    Raises:
        ConfigError: the name does not end in ``-<number>``.
    """
    m = _ORDINAL.search(name)
    if not m:
        raise ConfigError(f"--shard auto: pod name {name!r} does not end in -<ordinal> "
                          f"(an Indexed Job pod's hostname is JOB-0, JOB-1, ...); pass --shard K")
    return int(m.group(1))


def resolve_shard(value: str, shards: int, hostname: str | None = None,
                  env: Mapping[str, str] | None = None) -> int:
    """``--shard`` as given (an integer or ``auto``) -> the shard index, checked against ``[ps] shards``.

    Args:
        value: ``"3"`` or ``"auto"`` (``$JOB_COMPLETION_INDEX`` of an Indexed Job pod, else the
            trailing ordinal of the pod name, ``metaps-ps-3``).
        shards: ``[ps] shards`` of the job.
        hostname: the pod name (default :func:`pod_name`).
        env: the environment (default ``os.environ``).

    Raises:
        ConfigError: not an integer or ``auto``, or out of range.
    """
    env = os.environ if env is None else env
    if value == "auto" and env.get("JOB_COMPLETION_INDEX", "") != "":
        shard = completion_index(env)
        where = f"--shard auto ($JOB_COMPLETION_INDEX {shard})"
    elif value == "auto":
        shard = pod_ordinal(hostname or pod_name())
        where = f"--shard auto (pod {hostname or pod_name()})"
    else:
        try:
            shard = int(value)
        except ValueError:
            raise ConfigError(f"--shard {value!r}: expected a shard index or 'auto'") from None
        where = f"--shard {shard}"
    if not 0 <= shard < shards:
        raise ConfigError(f"{where} out of range: [ps] shards = {shards}")
    return shard


def completion_index(env: Mapping[str, str] | None = None) -> int:
    """``$JOB_COMPLETION_INDEX`` of an Indexed Job pod.

    Raises:
        ConfigError: unset or not a non-negative integer.
    """
    env = os.environ if env is None else env
    raw = env.get("JOB_COMPLETION_INDEX", "")
    if not raw.isdigit():
        raise ConfigError(f"--rank/--shard auto in an Indexed Job needs $JOB_COMPLETION_INDEX (a non-negative "
                          f"integer), got {raw!r}")
    return int(raw)


def ps_addresses(spec: str, shards: int,
                 from_controller: Callable[[], list[str]] | None = None,
                 wait_s: float = 300.0) -> list[str]:
    """PS addresses in shard order from ``--ps``.

    Args:
        spec: ``host:port,host:port`` (as is), a pattern with ``{k}`` (expanded for
            k = 0..shards-1), or ``controller`` (ask ``from_controller`` until every
            shard has registered, up to ``wait_s`` seconds).
        shards: ``[ps] shards`` of the job.
        from_controller: returns the registered addresses (raises ValueError while incomplete).
        wait_s: how long to wait for the controller to know every shard.

    Raises:
        ConfigError: empty spec, a pattern without ``{k}`` placeholders that would repeat one
            address, a list of the wrong length, or the controller not knowing the shards in time.
    """
    spec = spec.strip()
    if not spec:
        raise ConfigError("no PS addresses: pass --ps host:port,..., a pattern like ps-{k}.ps:5000, "
                          "or 'controller' (or set METAPS_PS)")
    if spec == "controller":
        if from_controller is None:
            raise ConfigError("--ps controller needs --controller HOST:PORT")
        deadline = time.monotonic() + wait_s
        while True:
            try:
                addrs = from_controller()
                if len(addrs) == shards:
                    return addrs
                err = f"{len(addrs)} of {shards} PS shards registered"
            except ValueError as exc:
                err = str(exc)
            if time.monotonic() > deadline:
                raise ConfigError(f"--ps controller: the controller does not know every PS shard after "
                                  f"{wait_s:.0f}s: {err}")
            time.sleep(0.5)
    if "{k}" in spec:
        return [spec.replace("{k}", str(k)) for k in range(shards)]
    addrs = [a for a in spec.split(",") if a]
    if len(addrs) != shards:
        raise ConfigError(f"--ps {spec!r}: {len(addrs)} address(es) for [ps] shards = {shards}")
    return addrs


def registered_ps_addresses(status: dict[str, Any]) -> list[str]:
    """PS addresses in shard order from a controller status (:meth:`ControllerClient.status`).

    Raises:
        ValueError: a shard below the highest one has no address yet.
    """
    ps = {int(n["index"]): n.get("address", "") for n in status.get("nodes", []) if n.get("role") == "ps"}
    if not ps:
        raise ValueError("no PS shard has registered with the controller yet")
    missing = [k for k in range(max(ps) + 1) if not ps.get(k)]
    if missing:
        raise ValueError(f"PS shard(s) {missing} have not registered an address yet")
    return [ps[k] for k in range(max(ps) + 1)]
