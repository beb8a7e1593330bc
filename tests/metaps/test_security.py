"""Secure by default: per-run token, no secret in any file or log, private modes,
no unauthenticated serving without --insecure (hand-started roles: test_security_handstart.py),
one-line errors for missing TLS files.

The fleet test launches a real fleet (controller, PS and worker agents on
127.0.0.1) from a job file with *no* token and checks what an outsider sees.
"""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import grpc
import pytest

from common.atomic_write import json_default
from common.errors import ConfigError
from metaps.job import load_job
from metaps.launch import LaunchConfig, Launcher
from common.rpc import RpcConfig, make_channel
from common.security import REDACTED, SecurityError, check_bind, is_loopback, redact
from protos import controller_pb2, controller_pb2_grpc, ps_pb2, ps_pb2_grpc
from ps.checkpoint import latest_checkpoint, read_manifest
from tests.metaps.fleet_data import fleet_pids, make_data, reaping, wait_for, write_job_file
from tests.ps.conftest import write_job as write_ps_job

REPO = Path(__file__).resolve().parents[2]


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("METAPS_TOKEN", "METAPS_RUN_DIR")}
    return {**env, "PYTHONPATH": str(REPO), **extra}


def _mode(p: Path) -> int:
    return stat.S_IMODE(p.lstat().st_mode)


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return make_data(tmp_path_factory.mktemp("security-data"))


# ---------------------------------------------------------------- helpers
def test_redaction_and_repr_never_show_the_token() -> None:
    cfg = RpcConfig(token="s3cret-value")
    assert "s3cret-value" not in repr(cfg)
    assert json_default(cfg)["token"] == REDACTED
    assert redact({"rpc": {"token": "x", "timeout_s": 1.0}, "l": [{"token": "y"}]}) == \
        {"rpc": {"token": REDACTED, "timeout_s": 1.0}, "l": [{"token": REDACTED}]}
    assert redact({"rpc": {"token": ""}}) == {"rpc": {"token": ""}}
    assert RpcConfig(token=REDACTED).resolved_token() in ("", os.environ.get("METAPS_TOKEN", ""))


def test_bind_rules() -> None:
    assert is_loopback("127.0.0.1") and is_loopback("127.0.0.3") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("") and not is_loopback("10.1.2.3")
    with pytest.raises(SecurityError, match="refusing to bind '0.0.0.0' without an auth token"):
        check_bind(["0.0.0.0"], "", insecure=False, what="metaps ps")
    check_bind(["0.0.0.0"], "", insecure=True, what="metaps ps")
    check_bind(["0.0.0.0"], "tok", insecure=False, what="metaps ps")


# ---------------------------------------------------------------- the launcher's token
def _job(tmp: Path, data: dict[str, Path], **rpc: Any) -> Path:
    return write_job_file(tmp / "job.toml", data, workers=1, ps=1, rpc={"token": "", **rpc})


def test_launch_generates_a_token_kept_in_a_0600_run_file_and_never_written(data, tmp_path, monkeypatch) -> None:
    """The run's token lives in RUN/rpc.token (0600), which RUN/job.toml names: every child and
    every CLI client given --config RUN/job.toml (status, cut, run-report) reads it there."""
    monkeypatch.delenv("METAPS_TOKEN", raising=False)
    tokens = []
    for i in range(2):
        run = tmp_path / f"run{i}"
        la = Launcher(LaunchConfig(config=str(_job(tmp_path, data)), run_dir=str(run), progress=False))
        tok = run / "rpc.token"
        token = tok.read_text().strip()
        assert _mode(tok) == 0o600 and "METAPS_TOKEN" not in la.fleet.env
        assert len(token) >= 40 and la.job.rpc.resolved_token() == token
        text = (run / "job.toml").read_text()
        assert token not in text and f'token = "{REDACTED}"' in text and f'token_file = "{tok}"' in text
        assert load_job(run / "job.toml").rpc.resolved_token() == token  # what `metaps status` reads
        assert la.job.to_dict()["rpc"]["token"] == REDACTED
        # the run is the group's to read (a serving system, a backup in the shared volume's group);
        # the token stays the owner's alone
        assert _mode(run) == 0o750 and _mode(run / "job.toml") == 0o640
        assert all(_mode(run / d) == 0o750 for d in ("logs", "ps", "workers", "checkpoints"))
        tokens.append(token)
    assert tokens[0] != tokens[1]
    # a token the user gives (config or $METAPS_TOKEN) is used, kept in the run's file and redacted
    la = Launcher(LaunchConfig(config=str(_job(tmp_path, data, token="mine-123")), run_dir=str(tmp_path / "r3"),
                               progress=False))
    assert la.job.rpc.resolved_token() == "mine-123" == (tmp_path / "r3" / "rpc.token").read_text().strip()
    assert "mine-123" not in (tmp_path / "r3" / "job.toml").read_text()
    # a new run from a launched run's job.toml gets a token of its own (the old run's file stays its own)
    (tmp_path / "run0" / "controller").mkdir(exist_ok=True)
    la = Launcher(LaunchConfig(config=str(tmp_path / "run0" / "job.toml"), run_dir=str(tmp_path / "r4"),
                               progress=False))
    assert la.job.rpc.token_file == str(tmp_path / "r4" / "rpc.token")
    assert la.job.rpc.resolved_token() not in tokens


def test_status_names_a_missing_or_loose_run_token_file_in_one_line(data, tmp_path, monkeypatch) -> None:
    """`metaps status --config RUN/job.toml` whose token file is gone or readable by others: one
    line naming the file (before any call)."""
    monkeypatch.delenv("METAPS_TOKEN", raising=False)
    run = tmp_path / "run"
    Launcher(LaunchConfig(config=str(_job(tmp_path, data)), run_dir=str(run), progress=False))
    tok = run / "rpc.token"

    def status() -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "metaps", "status", "--config", str(run / "job.toml"),
                               "--controller", "127.0.0.1:1"], cwd=REPO, env=_env(), capture_output=True,
                              text=True, timeout=120)

    tok.chmod(0o644)
    r = status()
    assert r.returncode == 1 and r.stderr.strip().splitlines() == [
        f"metaps status: error: [rpc] token_file {tok}: mode 0644 lets group/others read the token; "
        f"run `chmod 600 {tok}` (Kubernetes: defaultMode 0400)"], r.stderr
    tok.unlink()
    r = status()
    assert r.returncode == 1 and r.stderr.strip().splitlines() == [
        f"metaps status: error: [rpc] token_file {tok}: no such file"], r.stderr


def test_launch_token_file_is_created_0600_and_passed_by_path(data, tmp_path, monkeypatch) -> None:
    monkeypatch.delenv("METAPS_TOKEN", raising=False)
    tok = tmp_path / "secret" / "run.token"
    la = Launcher(LaunchConfig(config=str(_job(tmp_path, data)), run_dir=str(tmp_path / "run"), progress=False,
                               token_file=str(tok)))
    assert _mode(tok) == 0o600
    token = tok.read_text().strip()
    assert len(token) >= 40 and la.job.rpc.resolved_token() == token
    assert "METAPS_TOKEN" not in la.fleet.env
    text = (tmp_path / "run" / "job.toml").read_text()
    assert token not in text and f'token_file = "{tok}"' in text


def test_launch_refuses_a_world_readable_token_file(data, tmp_path) -> None:
    tok = tmp_path / "run.token"
    tok.write_text("abc\n")
    tok.chmod(0o644)
    with pytest.raises(ConfigError, match=r"run.token: mode 0644 lets group/others read the token; run `chmod 600"):
        Launcher(LaunchConfig(config=str(_job(tmp_path, data)), run_dir=str(tmp_path / "run"), progress=False,
                              token_file=str(tok)))
    assert not (tmp_path / "run").exists()


def test_launch_with_a_missing_tls_cert_is_one_line_before_anything_starts(data, tmp_path) -> None:
    cfg = _job(tmp_path, data, tls_cert=str(tmp_path / "nope.crt"), tls_key=str(tmp_path / "nope.key"))
    proc = subprocess.run([sys.executable, "-m", "metaps", "launch", "--config", str(cfg), "--run-dir",
                           str(tmp_path / "run"), "--no-progress"],
                          cwd=REPO, env=_env(), check=False, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == [f"metaps launch: error: [rpc] tls_cert {tmp_path / 'nope.crt'}: no such file"]
    assert not (tmp_path / "run").exists()


# ---------------------------------------------------------------- hand-started roles
def _ps_job(tmp: Path, host: str = "127.0.0.1", extra_rpc: str = "") -> Path:
    job = write_ps_job(tmp, shards=1)
    text = job.read_text()
    text = "\n".join(line for line in text.splitlines() if not line.startswith("token = "))
    text = text.replace("[ps]\n", f'[ps]\nhost = "{host}"\n').replace("[rpc]\n", f"[rpc]\n{extra_rpc}")
    out = tmp / f"job-{host}.toml"
    out.write_text(text + f'\n[run]\ndir = "{tmp / "run"}"\n')  # the run's rpc.token lookup stays in tmp
    return out


def _metaps(*args: str) -> list[str]:
    return [sys.executable, "-m", "metaps", *args]


def test_public_bind_without_a_token_is_refused_in_one_line(tmp_path) -> None:
    ps = subprocess.run(_metaps("ps", "--config", str(_ps_job(tmp_path, "0.0.0.0")), "--shard", "0"),
                        cwd=REPO, env=_env(), check=False, capture_output=True, text=True, timeout=300)
    assert ps.returncode == 1, ps.stderr[-2000:]
    lines = ps.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("metaps ps: error: refusing to bind '0.0.0.0' "
                                                   "without an auth token"), lines
    assert "--insecure" in lines[0]
    ctl = subprocess.run(_metaps("controller", "--config", str(_ps_job(tmp_path, "0.0.0.0")), "--address", "0.0.0.0:0",
                                 "--state-dir", str(tmp_path / "ctl")),
                         cwd=REPO, env=_env(), check=False, capture_output=True, text=True, timeout=300)
    assert ctl.returncode == 1
    lines = ctl.stderr.strip().splitlines()
    assert len(lines) == 1 and "refusing to bind '0.0.0.0' without an auth token" in lines[0], lines
    assert not (tmp_path / "ctl").exists()


def test_missing_tls_key_is_one_line_naming_the_file(tmp_path) -> None:
    crt = tmp_path / "server.crt"
    crt.write_text("not a real cert")
    cfg = _ps_job(tmp_path, extra_rpc=f'tls_cert = "{crt}"\ntls_key = "{tmp_path / "missing.key"}"\n')
    ps = subprocess.run(_metaps("ps", "--config", str(cfg), "--shard", "0"),
                        cwd=REPO, env=_env(METAPS_TOKEN="t"), check=False, capture_output=True, text=True, timeout=300)
    assert ps.returncode == 1
    assert ps.stderr.strip().splitlines() == [f"metaps ps: error: [rpc] tls_key {tmp_path / 'missing.key'}: no such file"]


def test_insecure_serves_without_a_token_loudly(tmp_path) -> None:
    # without --insecure a loopback PS generates and requires a token (test_security_handstart.py);
    # --insecure keeps the old unauthenticated behaviour, on loopback and on a public bind, with a warning
    procs = {}
    for name, host, extra in (("loop", "127.0.0.1", ["--insecure"]), ("public", "0.0.0.0", ["--insecure"])):
        d = tmp_path / name
        d.mkdir()
        log = (d / "ps.log").open("wb")
        procs[name] = (subprocess.Popen(_metaps("ps", "--config", str(_ps_job(d, host)), "--shard", "0", "--port", "0",
                                                "--ready-file", str(d / "ready"), *extra),
                                        cwd=REPO, env=_env(), stdout=log, stderr=subprocess.STDOUT), d)
    try:
        for name, (proc, d) in procs.items():
            wait_for(lambda: (d / "ready").exists() or proc.poll() is not None, 300, f"the {name} PS to start")
            assert proc.poll() is None, (d / "ps.log").read_text()[-3000:]
            log = (d / "ps.log").read_text()
            assert 'WARNING common.security role=ps msg="NO AUTH TOKEN (--insecure)' in log, log[-3000:]
            assert not (d / "run" / "rpc.token").exists()  # --insecure generates no token
            # unauthenticated, but it does serve
            port = json.loads((d / "ready").read_text())["port"]
            with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
                ps_pb2_grpc.ParameterServerStub(ch).Stats(ps_pb2.StatsRequest(), timeout=30)
    finally:
        for proc, _ in procs.values():
            proc.send_signal(signal.SIGTERM)
        for proc, _ in procs.values():
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


# ---------------------------------------------------------------- a launched fleet, seen from outside
@pytest.mark.timeout(900)
def test_launched_fleet_refuses_outsiders_and_leaks_no_token(data, tmp_path) -> None:
    cfg = write_job_file(tmp_path / "job.toml", data, workers=1, ps=1, rpc={"token": ""},
                         train={"epochs": 50},  # far more than the test waits for
                         faults={"faults": [{"target": "worker", "index": 0, "kind": "slow", "factor": 3.0}]})
    run = tmp_path / "run"
    proc = subprocess.Popen(_metaps("launch", "--config", str(cfg), "--run-dir", str(run), "--no-progress"),
                            cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    cmdlines: list[str] = []
    with reaping(proc, run):
        wait_for(lambda: 'msg="step"' in _read(run / "logs" / "worker-0.log") or proc.poll() is not None, 400,
                 "the first training step")
        assert proc.poll() is None, proc.stdout.read()[-5000:] if proc.stdout else ""
        ready = json.loads((run / "ps" / "ps-0.ready").read_text())
        env = dict(kv.split("=", 1) for kv in Path(f"/proc/{ready['pid']}/environ").read_text().split("\0") if "=" in kv)
        assert "METAPS_TOKEN" not in env  # the children read the run's 0600 token file that job.toml names
        token = (run / "rpc.token").read_text().strip()
        assert len(token) >= 40 and _mode(run / "rpc.token") == 0o600
        for pid in fleet_pids(str(run)):
            try:
                cmdlines.append(Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace"))
            except OSError:
                pass
        ps_addr = f"127.0.0.1:{ready['port']}"
        ctl_addr = (run / "controller" / "address").read_text().strip()
        for cfg_rpc in (None, RpcConfig(token="wrong-token", timeout_s=30.0)):
            ch_ps = make_channel(ps_addr, cfg_rpc) if cfg_rpc else grpc.insecure_channel(ps_addr)
            ch_ctl = make_channel(ctl_addr, cfg_rpc) if cfg_rpc else grpc.insecure_channel(ctl_addr)
            ps_stub, ctl_stub = ps_pb2_grpc.ParameterServerStub(ch_ps), controller_pb2_grpc.ControllerStub(ch_ctl)
            for call in (lambda: ps_stub.Push(ps_pb2.PushRequest(), timeout=30),
                         lambda: ps_stub.Checkpoint(ps_pb2.CheckpointRequest(dir=str(tmp_path / "evil"), step=1),
                                                    timeout=30),
                         lambda: ctl_stub.Shutdown(controller_pb2.ShutdownRequest(reason="outsider"), timeout=30),
                         lambda: ctl_stub.GetStatus(controller_pb2.GetStatusRequest(), timeout=30)):
                with pytest.raises(grpc.RpcError) as err:
                    call()
                assert err.value.code() is grpc.StatusCode.UNAUTHENTICATED, err.value.details()
            ch_ps.close()
            ch_ctl.close()
        # with the token: served, but paths stay under RUN/checkpoints
        with make_channel(ps_addr, RpcConfig(token=token, timeout_s=30.0)) as ch:
            stub = ps_pb2_grpc.ParameterServerStub(ch)
            stub.Stats(ps_pb2.StatsRequest(), timeout=30)
            with pytest.raises(grpc.RpcError) as err:
                stub.Checkpoint(ps_pb2.CheckpointRequest(dir=str(tmp_path / "evil"), step=1), timeout=30)
            assert err.value.code() is grpc.StatusCode.PERMISSION_DENIED
        assert not (tmp_path / "evil").exists()
        assert proc.poll() is None
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=240)
        left = fleet_pids(str(run))
    assert proc.returncode == 130, out[-5000:]
    assert left == []
    assert token.encode() not in out.encode()
    assert cmdlines and not [c for c in cmdlines if token in c]

    # the token is in no file of the run but its 0600 token file (logs, job.toml, report, checkpoints incl.
    # LMDB, tb, plots)
    files = [Path(d) / f for d, _, fs in os.walk(run) for f in fs]
    assert len(files) > 10
    leaked = [str(f) for f in files if not f.is_symlink() and token.encode() in f.read_bytes()
              and f != run / "rpc.token"]
    assert leaked == []
    assert f'token = "{REDACTED}"' in (run / "job.toml").read_text()
    rep = json.loads((run / "report.json").read_text())
    assert rep["status"] == "interrupted" and rep["config"]["rpc"]["token"] == REDACTED
    ckpt = latest_checkpoint(run / "checkpoints")
    assert ckpt is not None and read_manifest(ckpt)["info"]["job"]["rpc"]["token"] == REDACTED

    # modes: the run dir 0750, job.toml, report.json and the checkpoint's files 0640 (the group reads
    # them: a serving system or a backup in the run's group); the token 0600; nothing under the run
    # open to others or writable by the group
    assert _mode(run) == 0o750 and _mode(run / "job.toml") == 0o640 and _mode(run / "report.json") == 0o640
    assert _mode(ckpt) == 0o750 and _mode(ckpt / "manifest.json") == 0o640 and _mode(run / "rpc.token") == 0o600
    open_to_others = [f"{p} {_mode(p):04o}" for p in [*files, *(Path(d) for d, _, _ in os.walk(run))]
                      if not p.is_symlink() and _mode(p) & 0o027]
    assert open_to_others == []


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""
