"""gRPC plumbing shared by the PS, the controller and their clients.

* message size limits set on both ends (:data:`DEFAULT_MAX_MESSAGE_BYTES`);
* a shared-token check: every call carries ``authorization: Bearer <token>``
  metadata; a server built with :func:`make_server` refuses calls without it
  (``UNAUTHENTICATED``);
* optional TLS from PEM files (``[rpc] tls_cert`` + ``tls_key`` on servers,
  ``tls_ca`` on clients): servers bind with ``grpc.ssl_server_credentials``,
  clients use ``grpc.ssl_channel_credentials``; a missing, unreadable or
  non-PEM file is a one-line :class:`~common.errors.ConfigError` naming
  the key (:meth:`RpcConfig.check_files`);
* a port that cannot be bound is a one-line :class:`BindError`;
* the standard gRPC health service on every server.

Example::

    server = make_server(RpcConfig(token="s3cret"), max_workers=8)
    ps_pb2_grpc.add_ParameterServerServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    channel = make_channel(f"127.0.0.1:{port}", RpcConfig(token="s3cret"))
"""

from __future__ import annotations

import hmac
import os
from concurrent import futures
from dataclasses import dataclass, field
from typing import Any, Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from common.errors import BindError, ConfigError
from common.security import REDACTED, TOKEN_ENV, read_token_file

DEFAULT_MAX_MESSAGE_BYTES = 256 * 1024 * 1024
_AUTH_KEY = "authorization"


@dataclass(frozen=True)
class RpcConfig:
    """RPC settings shared by every service of a job (``[rpc]`` in the job TOML).

    Args:
        token: shared secret; '' (or ``<redacted>``, what job files written by
            ``metaps launch`` hold) means: read ``token_file``, else ``$METAPS_TOKEN``, else
            the run's ``<[run] dir>/rpc.token``; with none of them a loopback PS or controller
            generates that file (0600) and requires it (``--insecure``: no auth, loudly).
            Never logged or written out.
        token_file: a file (mode 0600) holding the token, e.g. a mounted Secret.
        max_message_bytes: send and receive limit on both ends.
        tls_cert: the server's PEM certificate (chain); with ``tls_key`` every server of the
            job accepts TLS only.
        tls_key: the server's PEM private key (given with ``tls_cert``).
        tls_ca: PEM CA bundle clients verify the server against; a client with
            ``tls_ca`` or ``tls_cert`` set talks TLS. All empty means plaintext.
        timeout_s: default deadline of a unary call.
    """

    token: str = field(default="", repr=False)
    token_file: str = ""
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    tls_cert: str = ""
    tls_key: str = ""
    tls_ca: str = ""
    timeout_s: float = 30.0

    def validate(self) -> None:
        if self.max_message_bytes < 1024:
            raise ValueError(f"max_message_bytes must be >= 1024, got {self.max_message_bytes}")
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("tls_cert and tls_key must be given together")
        if self.timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s}")
        if self.token and self.token != REDACTED and self.token_file:
            raise ValueError("token and token_file are both set; give one (the file keeps the secret out of the job file)")

    def resolved_token(self) -> str:
        """The token in force: ``token``, else ``token_file``'s content, else ``$METAPS_TOKEN``, else ''."""
        if self.token and self.token != REDACTED:
            return self.token
        if self.token_file:
            return read_token_file(self.token_file)
        return os.environ.get(TOKEN_ENV, "")

    def check_files(self) -> None:
        """Every configured TLS file and the token file exist and are readable.

        Raises:
            ConfigError: naming the key and the file (no traceback, nothing started).
        """
        given = [(key, getattr(self, key)) for key in ("tls_cert", "tls_key", "tls_ca") if getattr(self, key)]
        pems = [(key, path, _read_file(key, path)) for key, path in given]  # missing files first
        for key, path, pem in pems:
            if b"-----BEGIN " not in pem:
                raise ConfigError(f"[rpc] {key} {path}: not a PEM file (no '-----BEGIN' line)")
        if self.token_file:
            read_token_file(self.token_file)


def _read_file(key: str, path: str) -> bytes:
    """The bytes of a configured PEM file, or a ConfigError naming ``[rpc] key`` and the file."""
    try:
        with open(path, "rb") as fh:
            return fh.read()
    except FileNotFoundError:
        raise ConfigError(f"[rpc] {key} {path}: no such file") from None
    except OSError as exc:
        raise ConfigError(f"[rpc] {key} {path}: cannot read it ({exc.strerror})") from None


def channel_options(cfg: RpcConfig) -> list[tuple[str, Any]]:
    return [
        ("grpc.max_send_message_length", cfg.max_message_bytes),
        ("grpc.max_receive_message_length", cfg.max_message_bytes),
        ("grpc.enable_retries", 0),  # our clients retry with their own backoff
        ("grpc.keepalive_time_ms", 30_000),
        # A restarted peer is found again within ~1 s instead of gRPC's default
        # backoff (up to 120 s), so clients ride through a PS restart quickly.
        ("grpc.initial_reconnect_backoff_ms", 200),
        ("grpc.min_reconnect_backoff_ms", 200),
        ("grpc.max_reconnect_backoff_ms", 1000),
        # A replaced pod keeps its DNS name (NAME-ps-K.NAME-ps) but gets a new address: look the
        # name up again within a second of a failed connection (gRPC's default waits 30 s), or a
        # killed PS's replacement stays "unreachable" to the controller's recovery for that long.
        ("grpc.dns_min_time_between_resolutions_ms", 1000),
    ]


class _TokenAuthInterceptor(grpc.ServerInterceptor):
    """Refuses every call whose metadata lacks the job's bearer token.

    The refusal handler has the same streaming shape as the method it
    replaces, so unary and streaming methods alike fail with UNAUTHENTICATED
    (not a serialization error).
    """

    _MESSAGE = "missing or wrong auth token (metadata 'authorization: Bearer <token>')"

    def __init__(self, token: str, exempt: tuple[str, ...] = ("/grpc.health.v1.Health/",)) -> None:
        self._expected = f"Bearer {token}".encode()
        self._exempt = exempt

        def deny(request: Any, context: grpc.ServicerContext) -> None:
            context.abort(grpc.StatusCode.UNAUTHENTICATED, self._MESSAGE)

        def deny_stream(request: Any, context: grpc.ServicerContext) -> Any:
            context.abort(grpc.StatusCode.UNAUTHENTICATED, self._MESSAGE)
            yield  # pragma: no cover - abort raises

        self._deny = {
            (False, False): grpc.unary_unary_rpc_method_handler(deny),
            (False, True): grpc.unary_stream_rpc_method_handler(deny_stream),
            (True, False): grpc.stream_unary_rpc_method_handler(deny),
            (True, True): grpc.stream_stream_rpc_method_handler(deny_stream),
        }

    def _authorized(self, metadata: Any) -> bool:
        for key, value in metadata or ():
            if key == _AUTH_KEY:
                got = value.encode() if isinstance(value, str) else bytes(value)
                if hmac.compare_digest(got, self._expected):
                    return True
        return False

    def intercept_service(self, continuation: Callable, handler_call_details: Any) -> Any:
        if handler_call_details.method.startswith(self._exempt):
            return continuation(handler_call_details)
        if self._authorized(handler_call_details.invocation_metadata):
            return continuation(handler_call_details)
        handler = continuation(handler_call_details)
        if handler is None:  # unknown method: let gRPC answer UNIMPLEMENTED
            return None
        return self._deny[(bool(handler.request_streaming), bool(handler.response_streaming))]


def make_server(cfg: RpcConfig, max_workers: int = 8) -> grpc.Server:
    """A thread-pool gRPC server with size limits and (if a token is set) auth."""
    interceptors = []
    token = cfg.resolved_token()
    if token:
        interceptors.append(_TokenAuthInterceptor(token))
    return grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers),
        interceptors=interceptors,
        # no SO_REUSEPORT: a port another server holds is refused (BindError), never shared with it
        options=[*channel_options(cfg), ("grpc.so_reuseport", 0)],
    )


def add_port(server: grpc.Server, address: str, cfg: RpcConfig) -> int:
    """Bind ``address`` (``host:0`` picks a free port) with TLS if configured.

    Raises:
        BindError: the address cannot be bound (one line naming it).
    """
    try:
        if cfg.tls_cert:
            creds = grpc.ssl_server_credentials([(_read_file("tls_key", cfg.tls_key),
                                                  _read_file("tls_cert", cfg.tls_cert))])
            port = server.add_secure_port(address, creds)
        else:
            port = server.add_insecure_port(address)
    except RuntimeError:  # grpc >= 1.60 raises instead of returning 0
        port = 0
    if port == 0:
        tls = " with [rpc] tls_cert/tls_key (a cert and key that do not match?)" if cfg.tls_cert else ""
        raise BindError(f"cannot bind gRPC to {address}{tls}: the port is in use or the host is not "
                        f"an address of this machine")
    return port


def check_bindable(address: str) -> None:
    """Bind ``address`` (``host:port``) with a plain socket and release it: a port in use or a
    host that is not this machine's is found before a role loads its state (and before gRPC's
    own multi-line bind error).

    Raises:
        BindError: the address cannot be bound (one line naming it).
    """
    import socket

    host, _, port = address.rpartition(":")
    host = host.strip("[]")
    try:
        infos = socket.getaddrinfo(host or None, int(port), type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        family, kind, proto, _, sockaddr = infos[0]
        with socket.socket(family, kind, proto) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(sockaddr)
    except (OSError, ValueError, IndexError) as exc:
        why = getattr(exc, "strerror", None) or str(exc)
        raise BindError(f"cannot bind gRPC to {address}: {why}") from None


def add_health(server: grpc.Server) -> health.HealthServicer:
    """Register the standard health service; callers set statuses on it."""
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    return servicer


def make_channel(address: str, cfg: RpcConfig) -> grpc.Channel:
    """A channel with size limits, TLS if configured and the token attached."""
    opts = channel_options(cfg)
    token = cfg.resolved_token()
    if cfg.tls_ca or cfg.tls_cert:
        ca = _read_file("tls_ca", cfg.tls_ca) if cfg.tls_ca else None
        creds = grpc.ssl_channel_credentials(root_certificates=ca)
        if token:
            creds = grpc.composite_channel_credentials(
                creds, grpc.access_token_call_credentials(token)
            )
        return grpc.secure_channel(address, creds, options=opts)
    channel = grpc.insecure_channel(address, options=opts)
    if token:
        channel = grpc.intercept_channel(channel, _TokenClientInterceptor(token))
    return channel


class _TokenClientInterceptor(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    """Adds ``authorization: Bearer <token>`` to every outgoing call."""

    def __init__(self, token: str) -> None:
        self._md = (_AUTH_KEY, f"Bearer {token}")

    def _details(self, d: Any) -> Any:
        md = list(d.metadata or ()) + [self._md]
        return d._replace(metadata=md) if hasattr(d, "_replace") else _CallDetails(d, md)

    def intercept_unary_unary(self, continuation, client_call_details, request):  # type: ignore[override]
        return continuation(self._details(client_call_details), request)

    def intercept_unary_stream(self, continuation, client_call_details, request):  # type: ignore[override]
        return continuation(self._details(client_call_details), request)

    def intercept_stream_unary(self, continuation, client_call_details, request_iterator):  # type: ignore[override]
        return continuation(self._details(client_call_details), request_iterator)

    def intercept_stream_stream(self, continuation, client_call_details, request_iterator):  # type: ignore[override]
        return continuation(self._details(client_call_details), request_iterator)


class _CallDetails(grpc.ClientCallDetails):
    def __init__(self, base: Any, metadata: list[tuple[str, str]]) -> None:
        self.method = base.method
        self.timeout = base.timeout
        self.metadata = metadata
        self.credentials = base.credentials
        self.wait_for_ready = getattr(base, "wait_for_ready", None)
        self.compression = getattr(base, "compression", None)
