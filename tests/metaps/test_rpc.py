"""common.rpc: token auth, message limits, health, TLS on real loopback servers."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Iterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.rpc import RpcConfig, add_health, add_port, make_channel, make_server

_IDENTITY = dict(request_deserializer=None, response_serializer=None)


def _echo(request: bytes, context: grpc.ServicerContext) -> bytes:
    return request


def _repeat(request: bytes, context: grpc.ServicerContext) -> Iterator[bytes]:
    for _ in range(3):
        yield request


def _count(request_iterator: Iterator[bytes], context: grpc.ServicerContext) -> bytes:
    return str(sum(len(r) for r in request_iterator)).encode()


def _start(cfg: RpcConfig, tls: bool = False) -> tuple[grpc.Server, int]:
    server = make_server(cfg, max_workers=4)
    handler = grpc.method_handlers_generic_handler(
        "test.Echo",
        {
            "Echo": grpc.unary_unary_rpc_method_handler(_echo),
            "Repeat": grpc.unary_stream_rpc_method_handler(_repeat),
            "Count": grpc.stream_unary_rpc_method_handler(_count),
        },
    )
    server.add_generic_rpc_handlers((handler,))
    add_health(server)
    port = add_port(server, "127.0.0.1:0" if not tls else "localhost:0", cfg)
    server.start()
    return server, port


@pytest.fixture
def authed() -> Iterator[tuple[RpcConfig, int]]:
    cfg = RpcConfig(token="s3cret", max_message_bytes=64 * 1024)
    server, port = _start(cfg)
    yield cfg, port
    server.stop(0)


def _calls(channel: grpc.Channel):
    return (
        channel.unary_unary("/test.Echo/Echo"),
        channel.unary_stream("/test.Echo/Repeat"),
        channel.stream_unary("/test.Echo/Count"),
    )


def test_token_accepted_for_every_call_shape(authed) -> None:
    cfg, port = authed
    with make_channel(f"127.0.0.1:{port}", cfg) as ch:
        echo, repeat, count = _calls(ch)
        assert echo(b"hi", timeout=5) == b"hi"
        assert list(repeat(b"x", timeout=5)) == [b"x"] * 3
        assert count(iter([b"ab", b"cde"]), timeout=5) == b"5"


@pytest.mark.parametrize("token", ["", "wrong"])
def test_missing_or_wrong_token_is_unauthenticated(authed, token: str) -> None:
    cfg, port = authed
    with make_channel(f"127.0.0.1:{port}", RpcConfig(token=token)) as ch:
        echo, repeat, count = _calls(ch)
        for call in (lambda: echo(b"hi", timeout=5), lambda: list(repeat(b"x", timeout=5)),
                     lambda: count(iter([b"a"]), timeout=5)):
            with pytest.raises(grpc.RpcError) as err:
                call()
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert "auth token" in err.value.details()


def test_health_is_serving_without_token(authed) -> None:
    _, port = authed
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
    assert resp.status == health_pb2.HealthCheckResponse.SERVING


def test_message_limit_enforced_on_both_ends(authed) -> None:
    cfg, port = authed
    big = b"x" * (cfg.max_message_bytes + 1)
    with make_channel(f"127.0.0.1:{port}", cfg) as ch:
        echo, _, _ = _calls(ch)
        with pytest.raises(grpc.RpcError) as err:
            echo(big, timeout=5)  # refused by the client's send limit
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    # A client with a larger limit gets through its own check; the server refuses.
    with make_channel(f"127.0.0.1:{port}", RpcConfig(token="s3cret", max_message_bytes=1 << 20)) as ch:
        echo, _, _ = _calls(ch)
        with pytest.raises(grpc.RpcError) as err:
            echo(big, timeout=5)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="max_message_bytes"):
        RpcConfig(max_message_bytes=10).validate()
    with pytest.raises(ValueError, match="tls_cert and tls_key"):
        RpcConfig(tls_cert="a.pem").validate()
    with pytest.raises(ValueError, match="timeout_s"):
        RpcConfig(timeout_s=0).validate()


def test_token_from_environment(monkeypatch) -> None:
    monkeypatch.setenv("METAPS_TOKEN", "envtok")
    assert RpcConfig().resolved_token() == "envtok"
    assert RpcConfig(token="explicit").resolved_token() == "explicit"


def test_tls_with_token(tmp_path: Path) -> None:
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=localhost",
         "-addext", "subjectAltName=DNS:localhost", "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True, timeout=60,
    )
    cfg = RpcConfig(token="t", tls_cert=str(cert), tls_key=str(key), tls_ca=str(cert))
    server, port = _start(cfg, tls=True)
    try:
        with make_channel(f"localhost:{port}", cfg) as ch:
            echo, _, _ = _calls(ch)
            assert echo(b"secure", timeout=10) == b"secure"
        no_token = RpcConfig(tls_cert=str(cert), tls_key=str(key), tls_ca=str(cert))
        with make_channel(f"localhost:{port}", no_token) as ch:
            with pytest.raises(grpc.RpcError) as err:
                _calls(ch)[0](b"x", timeout=10)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    finally:
        server.stop(0)
