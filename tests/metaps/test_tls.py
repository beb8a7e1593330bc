"""TLS on every gRPC endpoint: ``[rpc] tls_cert`` + ``tls_key`` (servers), ``tls_ca`` (clients).

A hand-started controller and PS (no token: they generate the run's ``rpc.token``)
serve TLS with a freshly generated self-signed certificate; the PS registers with
the controller over TLS; a client with the CA and the token is served, a client
without the token is UNAUTHENTICATED and a plaintext client is refused at the
transport (UNAVAILABLE). Real processes, real gRPC on 127.0.0.1.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import grpc
import pytest

from controller.client import ControllerClient
from common.rpc import RpcConfig, make_channel
from protos import controller_pb2, controller_pb2_grpc, ps_pb2, ps_pb2_grpc
from tests.metaps.fleet_data import make_data, wait_for, write_job_file

REPO = Path(__file__).resolve().parents[2]


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("METAPS_TOKEN", "METAPS_RUN_DIR", "METAPS_CONTROLLER")}
    return {**env, "PYTHONPATH": str(REPO)}


def self_signed(tmp: Path) -> tuple[Path, Path]:
    """A throwaway self-signed server certificate for localhost / 127.0.0.1 (openssl CLI): (key, cert)."""
    key, cert = tmp / "server.key", tmp / "server.crt"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True, timeout=60)
    key.chmod(0o600)
    return key, cert


@pytest.mark.timeout(600)
def test_hand_started_fleet_talks_tls_and_refuses_plaintext(tmp_path) -> None:
    key, cert = self_signed(tmp_path)
    data = make_data(tmp_path / "data")
    tls = {"tls_cert": str(cert), "tls_key": str(key), "tls_ca": str(cert)}
    job = write_job_file(tmp_path / "job.toml", data, workers=1, ps=1, rpc={"token": "", **tls})
    run = tmp_path / "runs"
    logs = {n: tmp_path / f"{n}.log" for n in ("controller", "ps")}
    ctl = subprocess.Popen([sys.executable, "-m", "metaps", "controller", "--config", str(job), "--address",
                            "127.0.0.1:0", "--state-dir", str(run / "controller")],
                           cwd=REPO, env=_env(), stdout=logs["controller"].open("wb"), stderr=subprocess.STDOUT)
    ps = None
    try:
        wait_for(lambda: (run / "controller" / "address").exists() or ctl.poll() is not None, 300, "the controller")
        assert ctl.poll() is None, logs["controller"].read_text()[-3000:]
        ctl_addr = (run / "controller" / "address").read_text().strip()
        ps = subprocess.Popen([sys.executable, "-m", "metaps", "ps", "--config", str(job), "--shard", "0", "--port", "0",
                               "--controller", ctl_addr, "--ready-file", str(tmp_path / "ps.ready")],
                              cwd=REPO, env=_env(), stdout=logs["ps"].open("wb"), stderr=subprocess.STDOUT)
        wait_for(lambda: (tmp_path / "ps.ready").exists() or ps.poll() is not None, 300, "the PS")
        assert ps.poll() is None, logs["ps"].read_text()[-3000:]
        ps_addr = f"127.0.0.1:{json.loads((tmp_path / 'ps.ready').read_text())['port']}"
        token_file = str(run / "rpc.token")
        secure = RpcConfig(token_file=token_file, tls_ca=str(cert), timeout_s=30.0)

        # TLS + token: served; the PS registered with the controller over TLS with the same token
        with ControllerClient(ctl_addr, secure, retry_s=5.0) as c:
            wait_for(lambda: any(n["role"] == "ps" for n in c.status()["nodes"]), 120, "the PS to register")
        with make_channel(ps_addr, secure) as ch:
            ps_pb2_grpc.ParameterServerStub(ch).Stats(ps_pb2.StatsRequest(), timeout=30)

        # TLS without the token: UNAUTHENTICATED
        with make_channel(ps_addr, RpcConfig(tls_ca=str(cert))) as ch:
            with pytest.raises(grpc.RpcError) as err:
                ps_pb2_grpc.ParameterServerStub(ch).Push(ps_pb2.PushRequest(), timeout=30)
            assert err.value.code() is grpc.StatusCode.UNAUTHENTICATED

        # plaintext, even with the right token: refused at the transport, before any handler
        plain = RpcConfig(token_file=token_file, timeout_s=10.0)
        for addr in (ps_addr, ctl_addr):
            for ch in (make_channel(addr, plain), grpc.insecure_channel(addr)):
                with ch:
                    calls = (lambda: ps_pb2_grpc.ParameterServerStub(ch).Stats(ps_pb2.StatsRequest(), timeout=10),
                             lambda: controller_pb2_grpc.ControllerStub(ch).Shutdown(
                                 controller_pb2.ShutdownRequest(reason="plaintext"), timeout=10))
                    with pytest.raises(grpc.RpcError) as err:
                        calls[addr == ctl_addr]()
                    assert err.value.code() is grpc.StatusCode.UNAVAILABLE, err.value.details()
        assert ctl.poll() is None and ps.poll() is None

        with make_channel(ctl_addr, secure) as ch:
            controller_pb2_grpc.ControllerStub(ch).Shutdown(controller_pb2.ShutdownRequest(reason="test"), timeout=30)
        assert ctl.wait(120) == 0
    finally:
        for proc in (ps, ctl):
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in (ps, ctl):
            if proc is not None:
                try:
                    proc.wait(60)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
