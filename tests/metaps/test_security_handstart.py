"""Safe when hand-started: a PS or controller started with no token generates one.

A loopback role that finds no ``[rpc] token``, ``token_file``/``--token-file`` or
``$METAPS_TOKEN`` writes a fresh token to ``<[run] dir>/rpc.token`` (0600, the
path logged, the token never) and refuses every call without it; the CLI
clients of the same job (``metaps status``) find the file. ``--insecure`` keeps
the old unauthenticated behaviour, loudly. ``metaps ps`` config errors are one
line on stderr and exit 1, never a traceback.

Real processes, real gRPC on 127.0.0.1.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import socket
import stat
import subprocess
import sys
from pathlib import Path

import grpc
import pytest

from common.rpc import RpcConfig, make_channel
from common.security import RUN_TOKEN_FILE, SecurityError, check_bind, read_token_file, role_rpc
from protos import controller_pb2, controller_pb2_grpc, ps_pb2, ps_pb2_grpc
from tests.metaps.fleet_data import make_data, wait_for, write_job_file
from tests.ps.conftest import write_job as write_ps_job

REPO = Path(__file__).resolve().parents[2]
_LOG_LINE = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d (DEBUG|INFO|WARNING) ")


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("METAPS_TOKEN", "METAPS_RUN_DIR", "METAPS_CONTROLLER")}
    return {**env, "PYTHONPATH": str(REPO), **extra}


def _metaps(*args: str) -> list[str]:
    return [sys.executable, "-m", "metaps", *args]


def _mode(p: Path) -> int:
    return stat.S_IMODE(p.stat().st_mode)


def _stop(*procs: subprocess.Popen[bytes]) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    for proc in procs:
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


# ---------------------------------------------------------------- the lookup, in process
def test_role_rpc_generates_a_private_token_file_for_a_loopback_server_only(tmp_path, monkeypatch, caplog) -> None:
    monkeypatch.delenv("METAPS_TOKEN", raising=False)
    monkeypatch.delenv("METAPS_RUN_DIR", raising=False)
    caplog.set_level(logging.INFO, logger="common.security")
    run = tmp_path / "run"
    # a client finds nothing and generates nothing
    assert role_rpc(RpcConfig(), run_dir=run).resolved_token() == ""
    assert not run.exists()
    # a public bind and --insecure never generate
    assert role_rpc(RpcConfig(), run_dir=run, serve_hosts=["0.0.0.0"], what="metaps ps").resolved_token() == ""
    assert role_rpc(RpcConfig(), run_dir=run, serve_hosts=["127.0.0.1"], insecure=True).resolved_token() == ""
    assert not (run / RUN_TOKEN_FILE).exists()
    # a loopback server does: 0600, logged by path only
    srv = role_rpc(RpcConfig(), run_dir=run, serve_hosts=["127.0.0.1"], what="metaps ps")
    path = run / RUN_TOKEN_FILE
    token = srv.resolved_token()
    assert srv.token_file == str(path.resolve()) and _mode(path) == 0o600 and len(token) >= 40
    assert read_token_file(path) == token
    logged = "\n".join(f"{r.getMessage()} {vars(r)}" for r in caplog.records)  # the message and its fields
    assert str(path.resolve()) in logged and token not in logged
    # a second server and a client of the same run use the same file; nothing else is left there
    assert role_rpc(RpcConfig(), run_dir=run, serve_hosts=["127.0.0.1"]).resolved_token() == token
    assert role_rpc(RpcConfig(), run_dir=run).resolved_token() == token
    assert sorted(p.name for p in run.iterdir()) == [RUN_TOKEN_FILE]
    # $METAPS_RUN_DIR wins over [run] dir, as for the checkpoint root
    monkeypatch.setenv("METAPS_RUN_DIR", str(tmp_path / "other"))
    assert role_rpc(RpcConfig(), run_dir=run).resolved_token() == ""
    monkeypatch.delenv("METAPS_RUN_DIR")
    # an explicit token always wins over the run's file
    assert role_rpc(RpcConfig(token="given"), run_dir=run, serve_hosts=["127.0.0.1"]).resolved_token() == "given"
    monkeypatch.setenv("METAPS_TOKEN", "from-env")
    assert role_rpc(RpcConfig(), run_dir=run).resolved_token() == "from-env"
    assert token not in "\n".join(f"{r.getMessage()} {vars(r)}" for r in caplog.records)


def test_a_serving_role_without_a_token_is_refused_unless_insecure() -> None:
    with pytest.raises(SecurityError, match="metaps ps: refusing to serve without an auth token"):
        check_bind(["127.0.0.1"], "", insecure=False, what="metaps ps", serves=True)
    check_bind(["127.0.0.1"], "", insecure=True, what="metaps ps", serves=True)
    check_bind(["127.0.0.1"], "tok", insecure=False, what="metaps ps", serves=True)
    check_bind(["127.0.0.1"], "", insecure=False, what="metaps worker")  # a client: a warning only


# ---------------------------------------------------------------- hand-started PS + controller
@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return make_data(tmp_path_factory.mktemp("handstart-data"))


@pytest.mark.timeout(600)
def test_hand_started_ps_and_controller_generate_and_require_a_token(data, tmp_path) -> None:
    job = write_job_file(tmp_path / "job.toml", data, workers=1, ps=1, rpc={"token": ""}, train={"max_steps": 3})
    run = tmp_path / "runs"  # the job's [run] dir
    ctl_log, ps_log, worker_log = tmp_path / "controller.log", tmp_path / "ps.log", tmp_path / "worker.log"
    # started together: they race for the token file and must agree on one token
    ctl = subprocess.Popen(_metaps("controller", "--config", str(job), "--address", "127.0.0.1:0",
                                   "--state-dir", str(run / "controller")),
                           cwd=REPO, env=_env(), stdout=ctl_log.open("wb"), stderr=subprocess.STDOUT)
    ps = subprocess.Popen(_metaps("ps", "--config", str(job), "--shard", "0", "--port", "0",
                                  "--ready-file", str(tmp_path / "ps.ready")),
                          cwd=REPO, env=_env(), stdout=ps_log.open("wb"), stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: ((run / "controller" / "address").exists() and (tmp_path / "ps.ready").exists())
                 or ps.poll() is not None or ctl.poll() is not None, 300, "the controller and the PS to serve")
        assert ps.poll() is None and ctl.poll() is None, ps_log.read_text()[-3000:] + ctl_log.read_text()[-3000:]
        tok_file = run / RUN_TOKEN_FILE
        assert _mode(tok_file) == 0o600
        token = read_token_file(tok_file)
        import json

        ps_addr = f"127.0.0.1:{json.loads((tmp_path / 'ps.ready').read_text())['port']}"
        ctl_addr = (run / "controller" / "address").read_text().strip()

        # outsiders: no token, a wrong token -> UNAUTHENTICATED for every mutation
        for cfg in (None, RpcConfig(token="wrong-token")):
            with (make_channel(ps_addr, cfg) if cfg else grpc.insecure_channel(ps_addr)) as ch_ps, \
                    (make_channel(ctl_addr, cfg) if cfg else grpc.insecure_channel(ctl_addr)) as ch_ctl:
                ps_stub, ctl_stub = ps_pb2_grpc.ParameterServerStub(ch_ps), controller_pb2_grpc.ControllerStub(ch_ctl)
                for call in (lambda: ps_stub.Push(ps_pb2.PushRequest(), timeout=30),
                             lambda: ps_stub.PauseWrites(ps_pb2.PauseRequest(), timeout=30),
                             lambda: ctl_stub.Shutdown(controller_pb2.ShutdownRequest(reason="outsider"), timeout=30)):
                    with pytest.raises(grpc.RpcError) as err:
                        call()
                    assert err.value.code() is grpc.StatusCode.UNAUTHENTICATED, err.value.details()
        assert ps.poll() is None and ctl.poll() is None

        # a client reading the generated file is served
        with make_channel(ps_addr, RpcConfig(token_file=str(tok_file))) as ch:
            ps_pb2_grpc.ParameterServerStub(ch).Stats(ps_pb2.StatsRequest(), timeout=30)
        # the CLI finds the file by itself (no flag, no env)
        st = subprocess.run(_metaps("status", "--config", str(job)), cwd=REPO, env=_env(),
                            capture_output=True, text=True, timeout=120, check=False)
        assert st.returncode == 0 and "run         running" in st.stdout, st.stdout + st.stderr
        assert token not in st.stdout + st.stderr
        # so does a hand-started worker: it trains against both (its calls would be refused without it)
        worker = subprocess.run(_metaps("worker", "--config", str(job), "--rank", "0", "--ps", ps_addr,
                                        "--controller", ctl_addr),
                                cwd=REPO, env=_env(), stdout=worker_log.open("wb"), stderr=subprocess.STDOUT,
                                timeout=300, check=False)
        assert worker.returncode == 0, worker_log.read_text()[-3000:]
        assert 'msg="step"' in worker_log.read_text() and "NO AUTH TOKEN" not in worker_log.read_text()
        with make_channel(ctl_addr, RpcConfig(token_file=str(tok_file))) as ch:
            controller_pb2_grpc.ControllerStub(ch).Shutdown(controller_pb2.ShutdownRequest(reason="test"), timeout=30)
        assert ctl.wait(120) == 0
    finally:
        _stop(ps, ctl)
    logs = ps_log.read_text() + ctl_log.read_text()
    assert token not in logs + worker_log.read_text()
    assert logs.count("generated one for this run") == 1, logs[-5000:]  # one winner of the race
    assert logs.count(f"token_file={tok_file.resolve()}") == 2, logs[-5000:]  # both name the file


# ---------------------------------------------------------------- `metaps ps` config errors
def _ps_cfg(tmp: Path, name: str, *, ps: str = "", rpc: str = "") -> Path:
    job = write_ps_job(tmp, shards=1)
    text = job.read_text().replace("[ps]\n", f"[ps]\n{ps}").replace("[rpc]\n", f"[rpc]\n{rpc}")
    out = tmp / f"{name}.toml"
    out.write_text(text + f'\n[run]\ndir = "{tmp / "run"}"\n')
    return out


@pytest.mark.timeout(600)
def test_metaps_ps_config_errors_are_one_line_without_a_traceback(tmp_path) -> None:
    import torch

    bad_pem = tmp_path / "bad.pem"
    bad_pem.write_text("not a certificate\n")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        busy = s.getsockname()[1]
        s.listen()
        cases: dict[str, tuple[list[str], str]] = {
            "unknown-key": (["--shard", "0"], "unknown key 'ps.bogus' in [ps]"),
            "shard-range": (["--shard", "7"], "--shard 7 out of range: [ps] shards = 1"),
            "not-pem": (["--shard", "0"], f"[rpc] tls_cert {bad_pem}: not a PEM file"),
            "port-busy": (["--shard", "0", "--port", str(busy)], f"cannot bind gRPC to 127.0.0.1:{busy}: Address already in use"),
        }
        cfgs = {
            "unknown-key": _ps_cfg(tmp_path, "unknown-key", ps="bogus = 1\n"),
            "shard-range": _ps_cfg(tmp_path, "shard-range"),
            "not-pem": _ps_cfg(tmp_path, "not-pem", rpc=f'tls_cert = "{bad_pem}"\ntls_key = "{bad_pem}"\n'),
            "port-busy": _ps_cfg(tmp_path, "port-busy", ps='host = "127.0.0.1"\n'),
        }
        if not torch.cuda.is_available():
            cases["no-cuda"] = (["--shard", "0"], "[ps] device: ps device 'cuda' requested")
            cfgs["no-cuda"] = _ps_cfg(tmp_path, "no-cuda")
            cfgs["no-cuda"].write_text(cfgs["no-cuda"].read_text().replace('device = "cpu"', 'device = "cuda"'))
        procs = {name: subprocess.Popen(_metaps("ps", "--config", str(cfgs[name]), *argv), cwd=REPO, env=_env(),
                                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for name, (argv, _) in cases.items()}
        results = {name: (*p.communicate(timeout=300), p.returncode) for name, p in procs.items()}
    for name, (out, err, rc) in results.items():
        want = cases[name][1]
        assert rc == 1, (name, rc, err[-3000:])
        assert "Traceback" not in out + err, (name, err[-3000:])
        # stderr: the structured log lines of a started shard, then exactly one error line
        lines = [line for line in err.strip().splitlines() if not _LOG_LINE.match(line)]
        assert len(lines) == 1 and lines[0].startswith("metaps ps: error: ") and want in lines[0], (name, err)
        assert err.strip().splitlines()[-1] == lines[0]
