"""``metaps deploy``: run a job on Kubernetes.

::

    metaps deploy k8s --config job.toml --image REG/metaps:0.1.0 [--namespace NS] [--gpu] --out DIR
                      [--run-name NAME] [--warm-start-from CHECKPOINTS]    (day 2: a new run, warm)
                      [--api jobs|jobset]       (one JobSet instead of three Jobs: metaps.deploy.jobset)
    kubectl apply -k DIR

    metaps deploy wait --path runs/main/metaio/manifest.json [--timeout S]   (pods' init container)

See docs/kubernetes.md and :mod:`metaps.deploy.k8s`.
"""

from __future__ import annotations

import argparse
import copy
import logging
import time
from pathlib import Path
from typing import Any

from common.errors import ConfigError
from common.log import kv

log = logging.getLogger(__name__)


def register(subparsers: Any) -> None:
    """Add ``deploy k8s`` and ``deploy wait`` to the ``metaps`` command line.

    Args:
        subparsers: the ``metaps`` parser's subparsers (see :mod:`metaps.cli`).
    """
    p = subparsers.add_parser("deploy", help="generate Kubernetes manifests from the job file")
    sub = p.add_subparsers(dest="deploy_command", metavar="TARGET", required=True)
    k = sub.add_parser("k8s", help="write YAML + kustomization.yaml for `kubectl apply -k DIR`")
    k.add_argument("--config", required=True, help="job TOML (counts, ports, tables, [deploy])")
    k.add_argument("--image", required=True, help="the CPU image, e.g. registry.example/metaps:0.1.0")
    k.add_argument("--namespace", default="", help="Kubernetes namespace (default: kubectl's)")
    k.add_argument("--gpu", action="store_true", help="CUDA image and nvidia.com/gpu limits")
    k.add_argument("--gpu-image", default="", help="the CUDA image (default: IMAGE-cuda)")
    k.add_argument("--out", required=True, help="directory to write (DIR/token is created once, 0600)")
    k.add_argument("--run-name", default="",
                   help="the run's name (default [run] name): a new name is a new run (its own run directory "
                        "and controller state), e.g. the date of a daily run")
    k.add_argument("--warm-start-from", default="",
                   help="checkpoints directory on the shared volume the PS restore the newest committed "
                        "checkpoint of before the run starts (default [deploy] restore_from)")
    k.add_argument("--api", choices=("jobs", "jobset"), default="",
                   help="the workload objects (default [deploy] api, 'jobs'): 'jobs' = controller, PS and worker "
                        "Jobs of their own; 'jobset' = one JobSet (jobset.x-k8s.io/v1alpha2) running the same pods, "
                        "started in order, failed or restarted as a group, admitted at once by Kueue with "
                        "[deploy] queue")
    k.set_defaults(func=_cmd_k8s)
    w = sub.add_parser("wait", help="wait until a file exists (a pod's init container)")
    w.add_argument("--path", required=True, help="file to wait for")
    w.add_argument("--timeout", type=float, default=3600.0, help="give up after this many seconds (exit 1)")
    w.set_defaults(func=_cmd_wait)


def _cmd_k8s(args: argparse.Namespace) -> int:
    from common.config import read_toml
    from metaps.deploy import jobset
    from metaps.deploy.k8s import Options, render, write
    raw = read_toml(args.config)
    if args.run_name:
        raw.setdefault("run", {})["name"] = args.run_name
    if args.warm_start_from:
        raw.setdefault("deploy", {})["restore_from"] = args.warm_start_from
    if args.api:
        raw.setdefault("deploy", {})["api"] = args.api
    from metaps.job import job_from_mapping

    job = job_from_mapping(copy.deepcopy(raw), where=args.config)
    opts = Options(args.image, args.namespace, args.gpu, args.gpu_image)
    files = jobset.render(job, raw, opts) if job.deploy.api == "jobset" else render(job, raw, opts)
    written = write(files, Path(args.out))
    for p in written:
        print(p)
    return 0


def _cmd_wait(args: argparse.Namespace) -> int:
    path = Path(args.path)
    deadline = time.monotonic() + args.timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise ConfigError(f"deploy wait: {path} did not appear within {args.timeout:.0f}s")
        time.sleep(1.0)
    log.info("found", extra=kv(path=str(path)))
    return 0
