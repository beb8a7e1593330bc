"""The per-role-volume variant of the manifests runs to a delivered bundle in pods (tests.deploy.podsim).

``[deploy] storage = "per-role"``: the built datasets live at ``[deploy] data_source`` (here a
``file://`` folder outside every volume, which every pod reaches as it would an object store);
the data Job builds into its own ephemeral volume and uploads there; each worker copies the
train and eval sets into a generic ephemeral volume of its own, the controller copies their
manifests and indexes only (the PS the train set's, for its schema), and the delivery pod
copies the eval set its gate reads. The shared volume keeps the run directory, the
checkpoints and the bundles only.

One small fleet (data Job, controller, 1 PS shard, 2 workers) trains to complete coverage,
and the delivery CronJob's command, run once, publishes a bundle gated on the staged eval
set. Judged on what the volumes hold: no Meta-IO data file on the shared volume, each
worker's volume holds a byte-identical copy of the source datasets, the controller's and the
PS's the metadata only. Wiring alone (no run) is in test_k8s_manifests.py.

TLS is on (``[deploy] tls_secret``): a Secret in cert-manager's layout made here (a throwaway
CA and a server certificate for the names :func:`metaps.deploy.k8s.tls_dns_names` lists) is
mounted into every gRPC role; the run trains to completion over TLS, and while it runs a
plaintext gRPC dial to the controller and the PS is refused at the transport though their
ports accept a TCP connection (the probes' kind). Manifests alone: test_k8s_tls.py.
"""

from __future__ import annotations

import base64
import hashlib
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from meta_io.synth.generator import GeneratorConfig, generate
from common.toml_writer import write
from metaps.deploy.k8s import tls_dns_names
from metaps.job import load_job
from tests.deploy.podsim import PodSim, netns_available, tail
from tests.deploy.pods import closing_shown, pod_env, render, train_to_completion
from tests.metaps.fleet_data import wait_for

DATASETS = ("metaio/train", "metaio/eval")


def _job_file(path: Path, source: Path) -> Path:
    return write(path, {
        "data": {"train": "metaio/train", "eval": "metaio/eval"},
        "ps": {"shards": 1, "num_vshards": 8, "device": "cpu", "table_defaults": {"dim": 8, "capacity": 4096}},
        "model": {"kind": "dnn", "default_dim": 8, "hidden": [16, 8]},
        "meta": {"inner_steps": 1, "inner_lr": 0.1},
        "train": {"mode": "meta", "workers": 2, "epochs": 2, "overlap": False, "log_every": 5},
        "controller": {"tick_s": 0.2, "checkpoint_interval_s": 5.0,
                       "dds": {"batches_per_shard": 2}, "agent": {"heartbeat_s": 1.0}},
        "rpc": {"timeout_s": 20.0},
        "delivery": {"out": "bundles", "holdout_rows": 300},  # the gate reads [data] eval: staged
        "run": {"dir": "runs", "name": "pr"},
        "deploy": {"name": "mpr", "storage": "per-role", "data_source": source.as_uri(),
                   "data_input": "raw/train", "data_eval_input": "raw/eval", "data_schema": "raw/train/schema.json",
                   "deliver_schedule": "*/30 * * * *", "tls_secret": "mpr-tls"},
    })


def _digest(folder: Path) -> dict[str, str]:
    """Every file under ``folder`` (relative name) -> its sha256."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def _tls_secret(tmp: Path, name: str, dns_names: list[str]) -> dict[str, Any]:
    """A Secret in cert-manager's layout: a throwaway CA (``ca.crt``) and a server certificate
    for ``dns_names`` it signed (``tls.crt``, ``tls.key``), made with the openssl CLI."""
    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=60, cwd=tmp)
    ec = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")
    run("req", "-x509", *ec, "-days", "1", "-subj", "/CN=metaps test CA", "-keyout", "ca.key", "-out", "ca.crt")
    run("req", *ec, "-subj", f"/CN={dns_names[0]}", "-keyout", "tls.key", "-out", "tls.csr")
    (tmp / "ext.cnf").write_text("subjectAltName=" + ",".join(f"DNS:{n}" for n in dns_names)
                                 + "\nextendedKeyUsage=serverAuth,clientAuth\n")
    run("x509", "-req", "-in", "tls.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial", "-days", "1",
        "-extfile", "ext.cnf", "-out", "tls.crt")
    data = {k: base64.b64encode((tmp / k).read_bytes()).decode() for k in ("tls.crt", "tls.key", "ca.crt")}
    return {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": name}, "type": "kubernetes.io/tls",
            "data": data}


def _dial_plaintext_while_serving(sim: PodSim, jobs: dict[str, int], out: dict[str, Any],
                                  stop: threading.Event) -> None:
    """Once each Job's running pod takes a TCP connection on its gRPC port (what its TCP probes
    ask): a plaintext gRPC health call to it, from the hub namespace as a kubelet's gRPC probe
    would dial (a run this small serves for seconds: polled, not left to a 10 s probe period)."""
    while not stop.is_set() and set(jobs) - set(out):
        for job, port in jobs.items():
            pods = [p for p in sim.job_pods(job) if p.phase == "Running" and p.ip] if job not in out else []
            if pods and sim.dial("tcp", f"{pods[0].ip}:{port}").get("serving"):
                p = pods[0]
                plain = sim.dial("health", f"{p.ip}:{port}", 3)
                tcp = sim.dial("tcp", f"{p.ip}:{port}")  # still serving after the refusal
                out[job] = {"pod": p.name, "tcp": tcp, "plaintext": plain, "still_running": p.phase == "Running"}
        time.sleep(0.1)


def _stage_of(sim: PodSim, pod: str) -> Path:
    return sim.root / "ephemeral" / f"{pod}-stage"


@pytest.mark.timeout(600)
def test_the_per_role_fleet_stages_its_data_and_delivers(tmp_path: Path) -> None:
    assert netns_available(), ("this test runs pods in network + mount namespaces: it needs root, iproute2 "
                               "and unshare (the manifests' wiring is still checked by test_k8s_manifests.py)")
    source = tmp_path / "objectstore"  # stands for s3://bucket/prefix: outside every volume of the pods
    source.mkdir()
    os.chmod(source, 0o777)  # the data Job (uid 10001) uploads there
    job_toml = _job_file(tmp_path / "job.toml", source)
    docs = render(job_toml, tmp_path / "manifests")
    (tmp_path / "pki").mkdir()
    names = tls_dns_names(load_job(job_toml))
    assert names == ["mpr-controller", "mpr-ps-0.mpr-ps"], names
    docs.append(_tls_secret(tmp_path / "pki", "mpr-tls", names))  # as cert-manager would have made it
    sim = PodSim(docs, tmp_path / "sim", env=pod_env(), subnet="10.238.0", external=[source])
    t0 = time.monotonic()
    dials: dict[str, Any] = {}
    stop = threading.Event()
    dialer = threading.Thread(target=_dial_plaintext_while_serving, args=(
        sim, {"mpr-controller": 7070, "mpr-ps": 5000}, dials, stop), daemon=True)
    dialer.start()
    with closing_shown(sim):
        data = sim.root / "pvc" / "mpr-data"
        for name, rows, seed in (("train", 1500, 7), ("eval", 400, 8)):
            generate(data / "raw" / name, GeneratorConfig(rows=rows, users=100, items=150, seed=seed, n_files=1,
                                                          row_group_rows=rows), progress=False)
        ctl = train_to_completion(sim, "mpr")
        stop.set()
        dialer.join(30)
        # TLS only: both ports took a TCP connection, and a plaintext gRPC call was refused at the transport
        for job in ("mpr-controller", "mpr-ps"):
            d = dials.get(job)
            assert d is not None and d["still_running"] and d["tcp"].get("serving"), (job, d)
            assert not d["plaintext"].get("serving") and "UNAVAILABLE" in d["plaintext"].get("error", ""), (job, d)

        # the built data went to the source, not the shared volume (which holds the raw logs the data Job read)
        on_shared = [str(p.relative_to(data)) for p in data.rglob("*.arrow")
                     if p.name == "index.arrow" or p.name.startswith(("part-", "leftover-"))]
        assert on_shared == [], on_shared
        assert (data / "runs" / "pr" / "data-ready.json").exists()
        want = {d: _digest(source / d) for d in DATASETS}
        assert all(any(n.startswith("part-") for n in want[d]) for d in DATASETS), want
        # each worker trained from a whole, byte-identical copy of its own
        workers = [p for p in sim.job_pods("mpr-worker") if p.phase == "Succeeded"]
        assert len(workers) == 2
        for p in workers:
            for d in DATASETS:
                assert _digest(_stage_of(sim, p.name) / d) == want[d], (p.name, d)
        # the controller read batch counts only (manifest and index), the PS the train manifest's schema
        for d in DATASETS:
            assert sorted(_digest(_stage_of(sim, ctl.name) / d)) == ["index.arrow", "manifest.json"]
        ps = _stage_of(sim, sim.job_pods("mpr-ps")[0].name)
        assert sorted(_digest(ps)) == ["metaio/train/index.arrow", "metaio/train/manifest.json"]

        # the delivery CronJob's command, once: its gate reads its own copy of the eval set
        pod = sim.trigger_cronjob("mpr-deliver")
        wait_for(lambda: pod.phase in ("Succeeded", "Failed"), 300, "the delivery pod")
        assert pod.phase == "Succeeded", tail(pod.log_path)
        assert _digest(_stage_of(sim, pod.name) / "metaio/eval") == want["metaio/eval"]
        latest = (data / "bundles" / "LATEST").read_text().strip()
        assert (data / "bundles" / latest).is_dir()
        sys.stderr.write(f"[per-role pods] delivered in {time.monotonic() - t0:.1f}s over TLS; plaintext dials: "
                         f"{ {j: d['plaintext'].get('error') for j, d in dials.items()} }\n")
