"""``[deploy] tls_secret``: TLS between the pods, checked on the manifests (no pods).

The Secret (cert-manager's layout: ``tls.crt``, ``tls.key``, ``ca.crt``) is mounted read-only
(0400 + the pod's fsGroup) into the controller, PS and worker pods; the pods' job file names
its files in ``[rpc] tls_cert`` / ``tls_key`` / ``tls_ca``; the probes are TCP probes (a
kubelet's gRPC probe speaks plaintext). ``[rpc] tls_*`` in the job file is refused, naming
``[deploy] tls_secret``. The pods run with TLS on in test_k8s_pods_per_role.py.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from common.errors import ConfigError
from metaps.deploy import jobset
from metaps.deploy.k8s import TLS_DIR, UID, Options, render, tls_dns_names
from metaps.job import job_from_mapping

REPO = Path(__file__).resolve().parents[2]
IMAGE = "registry.example/metaps:0.1.0"
TRAINING = ("ctr-controller", "ctr-ps", "ctr-worker")


def _raw(**deploy: Any) -> dict[str, Any]:
    raw = tomllib.loads((REPO / "configs" / "main_job.toml").read_text())
    raw["deploy"] = {"name": "ctr", "data_input": "raw/train", "data_schema": "raw/schema.json", **deploy}
    return raw


def _docs(raw: dict[str, Any], api: str = "jobs") -> list[dict[str, Any]]:
    raw["deploy"]["api"] = api
    job = job_from_mapping(raw, where="job.toml")
    files = (jobset.render if api == "jobset" else render)(job, raw, Options(image=IMAGE))
    return [d for name, text in files.items() if name != "kustomization.yaml" for d in yaml.safe_load_all(text) if d]


def _pod_specs(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for d in docs:
        if d["kind"] == "Job":
            out[d["metadata"]["name"]] = d["spec"]["template"]["spec"]
        elif d["kind"] == "CronJob":
            out[d["metadata"]["name"]] = d["spec"]["jobTemplate"]["spec"]["template"]["spec"]
        elif d["kind"] == "JobSet":
            for rj in d["spec"]["replicatedJobs"]:
                out[f"ctr-{rj['name']}"] = rj["template"]["spec"]["template"]["spec"]
    return out


@pytest.fixture(scope="module")
def tls_docs() -> list[dict[str, Any]]:
    return _docs(_raw(tls_secret="ctr-tls"))


@pytest.mark.parametrize("api", ["jobs", "jobset"])
def test_the_secret_is_mounted_read_only_in_every_grpc_role_and_the_job_file_names_it(api: str) -> None:
    docs = _docs(_raw(tls_secret="ctr-tls"), api)
    specs = _pod_specs(docs)
    assert set(TRAINING) <= set(specs), sorted(specs)
    for name in TRAINING:
        spec = specs[name]
        vols = {v["name"]: v for v in spec["volumes"]}
        assert vols["tls"] == {"name": "tls", "secret": {"secretName": "ctr-tls", "defaultMode": 0o400}}, name
        assert spec["securityContext"]["fsGroup"] == UID  # 0400 + fsGroup: 0440, readable by the pod's group only
        main = spec["containers"][0]
        assert {"name": "tls", "mountPath": TLS_DIR, "readOnly": True} in main["volumeMounts"], name
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            if probe in main:  # controller and PS: TCP probes, a kubelet's gRPC probe would fail the handshake
                assert set(main[probe]) & {"grpc", "tcpSocket"} == {"tcpSocket"}, (name, probe, main[probe])
    # the roles that speak no gRPC get no certificate
    assert all("tls" not in {v["name"] for v in s["volumes"]} for n, s in specs.items() if n not in TRAINING)
    cms = [d for d in docs if d["kind"] == "ConfigMap"]
    rpc = tomllib.loads(cms[0]["data"]["job.toml"])["rpc"]
    assert (rpc["tls_cert"], rpc["tls_key"], rpc["tls_ca"]) == (
        f"{TLS_DIR}/tls.crt", f"{TLS_DIR}/tls.key", f"{TLS_DIR}/ca.crt")
    assert not any("BEGIN" in str(d) for d in docs)  # the key material stays in the Secret


def test_tls_manifests_validate_strictly(tls_docs: list[dict[str, Any]]) -> None:
    for d in tls_docs:
        if d["kind"] in ("Job", "CronJob", "ConfigMap", "Service"):
            for version in ("1.29.0", "1.32.0"):
                kubernetes_validate.validate(d, version, strict=True)


def test_without_tls_secret_nothing_changes() -> None:
    docs = _docs(_raw())
    specs = _pod_specs(docs)
    assert all("tls" not in {v["name"] for v in s["volumes"]} for s in specs.values())
    assert "grpc" in specs["ctr-ps"]["containers"][0]["startupProbe"]
    rpc = tomllib.loads([d for d in docs if d["kind"] == "ConfigMap"][0]["data"]["job.toml"])["rpc"]
    assert not {"tls_cert", "tls_key", "tls_ca"} & set(rpc)


def test_the_names_the_certificate_must_hold() -> None:
    raw = _raw(tls_secret="ctr-tls")
    raw["ps"]["shards"] = 2
    assert tls_dns_names(job_from_mapping(raw, where="job.toml")) == [
        "ctr-controller", "ctr-ps-0.ctr-ps", "ctr-ps-1.ctr-ps"]
    raw["deploy"]["api"] = "jobset"
    assert tls_dns_names(job_from_mapping(raw, where="job.toml")) == [
        "ctr-controller", "ctr-ps-0-0.ctr-ps", "ctr-ps-0-1.ctr-ps"]


@pytest.mark.parametrize("secret", [True, False])
def test_local_tls_paths_are_refused_in_one_line_naming_tls_secret(secret: bool) -> None:
    raw = _raw(**({"tls_secret": "ctr-tls"} if secret else {}))
    raw.setdefault("rpc", {}).update(tls_cert="/home/me/server.crt", tls_key="/home/me/server.key")
    with pytest.raises(ConfigError) as exc:
        _docs(raw)
    msg = str(exc.value)
    assert "\n" not in msg and "[rpc] tls_cert, tls_key" in msg and '[deploy] tls_secret = "NAME"' in msg, msg


def test_a_bad_secret_name_is_refused_in_one_line() -> None:
    with pytest.raises(ConfigError) as exc:
        job_from_mapping(_raw(tls_secret="My TLS"), where="job.toml")
    msg = str(exc.value)
    assert msg.startswith("job.toml: ") and "tls_secret 'My TLS' is not a Secret name" in msg and "\n" not in msg
