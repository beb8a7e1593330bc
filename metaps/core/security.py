"""Secure-by-default plumbing: per-run tokens, redaction, bind checks, private modes.

* :func:`generate_token` makes a run's shared secret; :func:`read_token_file`
  and :func:`write_token_file` keep one in a 0600 file (``[rpc] token_file``);
* :func:`redact` is the one place secrets are blanked before a config is
  serialized (job files, ``report.json``, checkpoint manifests, JSON dumps);
* :func:`check_bind` refuses a non-loopback bind without a token (unless
  ``--insecure``) and warns loudly about a loopback one;
* :data:`PRIVATE_UMASK` / :func:`make_private_dir`: run directories 0700,
  files 0600.

Example::

    token = generate_token()
    write_token_file("/secrets/run.token", token)
    safe = redact({"rpc": {"token": token}})        # {"rpc": {"token": "<redacted>"}}
    check_bind("0.0.0.0", token="", insecure=False, what="metaps ps")   # SecurityError
"""

from __future__ import annotations

import ipaddress
import logging
import os
import secrets
import socket
import stat
from pathlib import Path
from typing import Any

from metaps.core.errors import ConfigError, MetapsError
from metaps.core.log import kv

log = logging.getLogger(__name__)

TOKEN_ENV = "METAPS_TOKEN"
"""How ``metaps launch`` hands the token to its children (never argv, never a shared file)."""
REDACTED = "<redacted>"
"""What a secret is replaced by in any serialized config; never a usable token."""
SECRET_KEYS = frozenset({"token"})
"""Mapping keys whose (non-empty string) values are secrets."""
PRIVATE_UMASK = 0o077
"""Files 0600, directories 0700 for everything a fleet process creates."""
_WILDCARD = ("", "0.0.0.0", "::", "[::]", "*")


class SecurityError(MetapsError):
    """A security rule refused an action (e.g. a public bind without a token)."""


def generate_token() -> str:
    """A fresh random token (256 bits, URL-safe text)."""
    return secrets.token_urlsafe(32)


def redact(obj: Any) -> Any:
    """A copy of ``obj`` (nested dicts/lists) with every secret value replaced by :data:`REDACTED`.

    Args:
        obj: plain data (mappings, lists, scalars); other values are returned as is.
    """
    if isinstance(obj, dict):
        return {k: (REDACTED if k in SECRET_KEYS and isinstance(v, str) and v else redact(v))
                for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(redact(v) for v in obj)
    return obj


def read_token_file(path: str | Path) -> str:
    """The token stored in ``path`` (surrounding whitespace stripped).

    Raises:
        ConfigError: missing, unreadable, empty, or readable by group/others
            (the message names the file and what to do).
    """
    p = Path(path)
    try:
        st = p.stat()
        if stat.S_IMODE(st.st_mode) & 0o077:
            raise ConfigError(f"[rpc] token_file {p}: mode {stat.S_IMODE(st.st_mode):04o} lets group/others read "
                              f"the token; run `chmod 600 {p}` (Kubernetes: defaultMode 0400)")
        text = p.read_text().strip()
    except FileNotFoundError:
        raise ConfigError(f"[rpc] token_file {p}: no such file") from None
    except OSError as exc:
        raise ConfigError(f"[rpc] token_file {p}: cannot read it ({exc.strerror})") from None
    if not text:
        raise ConfigError(f"[rpc] token_file {p}: the file is empty")
    return text


def write_token_file(path: str | Path, token: str) -> Path:
    """Create ``path`` (mode 0600, must not exist) holding ``token``.

    Raises:
        ConfigError: the file exists or cannot be created.
    """
    p = Path(path)
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        raise ConfigError(f"--token-file {p}: exists already") from None
    except OSError as exc:
        raise ConfigError(f"--token-file {p}: cannot create it ({exc.strerror})") from None
    with os.fdopen(fd, "w") as fh:
        os.fchmod(fh.fileno(), 0o600)
        fh.write(token + "\n")
    return p


def make_private_dir(path: str | Path) -> Path:
    """``mkdir -p path`` and ``chmod 700`` the last component."""
    p = Path(path)
    p.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(p, 0o700)
    return p


def set_private_umask() -> int:
    """Make this process create files 0600 and directories 0700; returns the old umask."""
    return os.umask(PRIVATE_UMASK)


def is_loopback(host: str) -> bool:
    """True when ``host`` (an IP, ``[v6]`` or a name) reaches this machine only.

    Wildcards (``''``, ``0.0.0.0``, ``::``) are not loopback; a name is loopback
    when every address it resolves to is.
    """
    h = host.strip()
    if h.startswith("[") and h.endswith("]"):
        h = h[1:-1]
    if h in _WILDCARD:
        return False
    try:
        return ipaddress.ip_address(h).is_loopback
    except ValueError:
        pass
    if h == "localhost":
        return True
    try:
        infos = socket.getaddrinfo(h, None)
    except OSError:
        return False
    addrs = {i[4][0] for i in infos}
    return bool(addrs) and all(ipaddress.ip_address(str(a).split("%")[0]).is_loopback for a in addrs)


def add_cli_args(parser: Any, *, checkpoint_root: bool = False) -> None:
    """``--token-file``, ``--insecure`` (and ``--checkpoint-root``) for a role's subcommand.

    Args:
        parser: the subcommand's argparse parser.
        checkpoint_root: also add ``--checkpoint-root`` (roles that take paths over the wire).
    """
    parser.add_argument("--token-file", default="",
                        help="file (mode 0600) holding the auth token (overrides [rpc] token_file)")
    parser.add_argument("--insecure", action="store_true",
                        help="allow binding a non-loopback address without an auth token")
    if checkpoint_root:
        parser.add_argument("--checkpoint-root", default="",
                            help="the only directory tree Checkpoint/Restore/CheckpointDone requests may name "
                                 "(default $METAPS_RUN_DIR/checkpoints, else the run dir's checkpoints/)")


def role_rpc(rpc: Any, token_file: str = "") -> Any:
    """The job's ``[rpc]`` for a role process: ``--token-file`` applied, every file checked.

    Args:
        rpc: the job's ``metaps.core.rpc.RpcConfig``.
        token_file: ``--token-file`` ('' = keep ``[rpc] token_file``).

    Raises:
        ConfigError: a missing/unreadable TLS or token file (one line naming it).
    """
    import dataclasses

    if token_file:
        rpc = dataclasses.replace(rpc, token_file=token_file)
    rpc.check_files()
    return rpc


def checkpoint_root(explicit: str, run_dir: str | Path) -> Path:
    """Where a role's wire paths are confined: ``explicit``, else ``$METAPS_RUN_DIR/checkpoints``,
    else ``<run_dir>/checkpoints`` (absolute)."""
    if explicit:
        return Path(explicit).resolve()
    env = os.environ.get("METAPS_RUN_DIR", "")
    return (Path(env or run_dir) / "checkpoints").resolve()


def launch_token(raw: dict[str, Any], rpc: Any, token_file: str = "") -> tuple[str, dict[str, str]]:
    """Settle a launched run's token and take the secret out of its job mapping.

    The token is ``[rpc] token``, else the token file's content, else
    ``$METAPS_TOKEN``, else a fresh :func:`generate_token`. With a token file
    (``--token-file`` or ``[rpc] token_file``; created 0600 with the token when
    missing) children read that file; otherwise they get ``$METAPS_TOKEN``.
    Either way ``raw``'s ``[rpc] token`` becomes :data:`REDACTED`. TLS files are
    checked here too, so a missing one fails before anything starts.

    Args:
        raw: the parsed job TOML the launcher will write as ``RUN/job.toml`` (edited in place).
        rpc: its ``metaps.core.rpc.RpcConfig``.
        token_file: ``metaps launch --token-file`` ('' = ``[rpc] token_file``).

    Returns:
        (the token, extra environment for every child process).
    """
    import dataclasses

    dataclasses.replace(rpc, token_file="").check_files()
    given = rpc.token if rpc.token != REDACTED else ""
    sec = raw.setdefault("rpc", {})
    path = token_file or rpc.token_file
    env: dict[str, str] = {}
    if path:
        p = Path(path).resolve()
        if p.exists():
            token = read_token_file(p)
            if given and given != token:
                raise ConfigError(f"[rpc] token and token file {p} hold different tokens; give one")
        else:
            token = given or os.environ.get(TOKEN_ENV, "") or generate_token()
            write_token_file(p, token)
            log.info("token file written", extra=kv(path=str(p), mode="0600"))
        sec["token_file"] = str(p)
    else:
        token = given or os.environ.get(TOKEN_ENV, "") or generate_token()
        env[TOKEN_ENV] = token
    sec["token"] = REDACTED
    return token, env


def check_bind(hosts: list[str], token: str, *, insecure: bool, what: str) -> None:
    """Refuse to serve on a non-loopback address without a token.

    Args:
        hosts: every host this process will bind (gRPC, /metrics).
        token: the resolved token ('' = no auth).
        insecure: the operator's ``--insecure``: allow a public bind without a token.
        what: the command, for messages (``metaps ps``).

    Raises:
        SecurityError: a non-loopback host, no token, no ``--insecure``.
    """
    if token:
        return
    public = [h for h in hosts if not is_loopback(h)]
    if public and not insecure:
        raise SecurityError(
            f"{what}: refusing to bind {public[0]!r} without an auth token (anyone who can reach it could "
            f"push rows, write checkpoints, shut the fleet down); set [rpc] token_file, [rpc] token or "
            f"$METAPS_TOKEN, bind 127.0.0.1, or pass --insecure")
    log.warning("NO AUTH TOKEN: calls to and from this process are unauthenticated (loopback only); "
                "set [rpc] token_file or $METAPS_TOKEN",
                extra=kv(command=what, hosts=",".join(hosts), insecure=insecure))


__all__ = [
    "PRIVATE_UMASK",
    "TOKEN_ENV",
    "launch_token",
    "add_cli_args",
    "checkpoint_root",
    "role_rpc",
    "REDACTED",
    "SecurityError",
    "check_bind",
    "generate_token",
    "is_loopback",
    "make_private_dir",
    "read_token_file",
    "redact",
    "set_private_umask",
    "write_token_file",
]
