"""Secure-by-default plumbing: per-run tokens, redaction, bind checks, private modes.

* :func:`generate_token` makes a run's shared secret; :func:`read_token_file`
  and :func:`write_token_file` keep one in a 0600 file (``[rpc] token_file``);
* :func:`redact` is the one place secrets are blanked before a config is
  serialized (job files, ``report.json``, checkpoint manifests, JSON dumps);
* :func:`launch_token` settles a launched run's token and keeps it in a 0600 file
  (``RUN/rpc.token`` unless one is given) that ``RUN/job.toml`` names;
  :func:`client_rpc` is what ``metaps status``, ``cut`` and ``run-report`` use to find it;
* :func:`role_rpc` settles a role's token: ``[rpc] token``, ``token_file``
  (``--token-file``), ``$METAPS_TOKEN``, else the run's token file
  ``<run dir>/rpc.token`` (:func:`run_token_path`); a serving role (PS,
  controller) bound to loopback that finds none of them *generates* that file
  (0600, path logged, token never), so a hand-started role never serves
  unauthenticated mutations and the clients started for it find the token;
* :func:`check_bind` refuses to serve without a token: a non-loopback bind
  always, any bind of a serving role, unless ``--insecure`` (which warns loudly);
* :data:`RUN_UMASK` / :func:`set_run_umask` / :func:`make_run_dir`: a run's directories
  0750 and files 0640: the owner writes, the run's group (a user's private group; on
  Kubernetes the pods' ``fsGroup``, which the shared volume's setgid directories hand on)
  reads checkpoints, reports and logs (a serving system, a debug pod, a backup under another
  uid), others nothing. Secrets never follow it: a token file is created 0600 whatever the
  umask (:func:`write_token_file`, :func:`launch_token`, a role's generated run token);
  :data:`PRIVATE_UMASK` / :func:`make_private_dir`: 0700 / 0600, owner only.

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
import tempfile
from pathlib import Path
from typing import Any

from common.errors import ConfigError, MetapsError
from common.log import kv

log = logging.getLogger(__name__)

TOKEN_ENV = "METAPS_TOKEN"
"""How ``metaps launch`` hands the token to its children (never argv, never a shared file)."""
REDACTED = "<redacted>"
"""What a secret is replaced by in any serialized config; never a usable token."""
SECRET_KEYS = frozenset({"token"})
"""Mapping keys whose (non-empty string) values are secrets."""
RUN_TOKEN_FILE = "rpc.token"
"""The file in the run dir where a hand-started serving role writes the token it generated."""
PRIVATE_UMASK = 0o077
"""Files 0600, directories 0700: the owner only."""
RUN_UMASK = 0o027
"""Files 0640, directories 0750 for a run's files: the group reads, never writes; others nothing."""
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


def _make_dir(path: str | Path, mode: int) -> Path:
    """``mkdir -p path`` and ``chmod mode`` the last component (whatever the umask)."""
    p = Path(path)
    p.mkdir(parents=True, exist_ok=True, mode=mode)
    os.chmod(p, mode)
    return p


def make_private_dir(path: str | Path) -> Path:
    """``mkdir -p path`` and ``chmod 700`` the last component."""
    return _make_dir(path, 0o700)


def set_private_umask() -> int:
    """Make this process create files 0600 and directories 0700; returns the old umask."""
    return os.umask(PRIVATE_UMASK)


def make_run_dir(path: str | Path) -> Path:
    """``mkdir -p path`` and ``chmod 750`` the last component (a run's folder, group-readable)."""
    return _make_dir(path, 0o750)


def set_run_umask() -> int:
    """Make this process create a run's files 0640 and directories 0750 (:data:`RUN_UMASK`);
    returns the old umask. Token files stay 0600: their writers set the mode."""
    return os.umask(RUN_UMASK)


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
                        help="file (mode 0600) holding the auth token (overrides [rpc] token_file; default: "
                             "[rpc] token, [rpc] token_file, $METAPS_TOKEN, else <run dir>/rpc.token)")
    parser.add_argument("--insecure", action="store_true",
                        help="with no token: serve unauthenticated (no generated token) and allow a "
                             "non-loopback bind; anyone who can reach the port may push, pause or shut down")
    if checkpoint_root:
        parser.add_argument("--checkpoint-root", default="",
                            help="the only directory tree Checkpoint/Restore/CheckpointDone requests may name "
                                 "(default $METAPS_RUN_DIR/checkpoints, else the run dir's checkpoints/)")


def run_token_path(run_dir: str | Path) -> Path:
    """The run's token file: ``$METAPS_RUN_DIR/rpc.token``, else ``<run_dir>/rpc.token`` (absolute).

    A hand-started PS or controller with no token writes a generated one here;
    every role and CLI client of the same job looks here last.
    """
    env = os.environ.get("METAPS_RUN_DIR", "")
    return (Path(env or run_dir) / RUN_TOKEN_FILE).resolve()


def _create_run_token(path: Path) -> bool:
    """Atomically create ``path`` (0600) holding a fresh token; False when another process made it first.

    The token is written to a private temporary file that is then hard-linked to
    ``path``, so a concurrent reader sees either no file or the whole token.

    Raises:
        ConfigError: the directory or the file cannot be created.
    """
    why = "pass --token-file or set $METAPS_TOKEN"
    try:
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o750)  # the run dir: the group reads; the token is 0600
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)  # mode 0600
    except OSError as exc:
        raise ConfigError(f"cannot create the run's token file {path} ({exc.strerror}); {why}") from None
    try:
        with os.fdopen(fd, "w") as fh:
            os.fchmod(fh.fileno(), 0o600)
            fh.write(generate_token() + "\n")
            fh.flush()
            os.fsync(fh.fileno())
        try:
            os.link(tmp, path)
        except FileExistsError:
            return False
        except OSError as exc:
            raise ConfigError(f"cannot create the run's token file {path} ({exc.strerror}); {why}") from None
        return True
    finally:
        os.unlink(tmp)


def role_rpc(rpc: Any, token_file: str = "", *, run_dir: str | Path = "", serve_hosts: list[str] | None = None,
             insecure: bool = False, what: str = "") -> Any:
    """The job's ``[rpc]`` for a role process or CLI client: ``--token-file`` applied, the token
    settled, every file checked.

    The token is ``[rpc] token``, else ``[rpc] token_file`` (``--token-file``),
    else ``$METAPS_TOKEN``, else (with ``run_dir``) the run's token file
    :func:`run_token_path`. A serving role (``serve_hosts`` given) that finds
    none of them, binds loopback only and was not started ``--insecure``
    generates that file (0600; the path is logged, the token never), so it never
    serves unauthenticated mutations; its clients find the same file.

    Args:
        rpc: the job's ``common.rpc.RpcConfig``.
        token_file: ``--token-file`` ('' = keep ``[rpc] token_file``).
        run_dir: the job's ``[run] dir`` ('' = no run token file lookup).
        serve_hosts: the hosts a serving role binds (None: a client, never generates).
        insecure: the operator's ``--insecure``: serve without a token, generate none.
        what: the command, for the log (``metaps ps``).

    Raises:
        ConfigError: a missing/unreadable TLS or token file (one line naming it).
    """
    import dataclasses

    if token_file:
        rpc = dataclasses.replace(rpc, token_file=token_file)
    rpc.check_files()
    if not run_dir or rpc.resolved_token():
        return rpc
    path = run_token_path(run_dir)
    generated = (serve_hosts is not None and not insecure and not path.exists()
                 and all(is_loopback(h) for h in serve_hosts) and _create_run_token(path))
    if generated:
        log.warning("no auth token given: generated one for this run; clients read it from the token file",
                    extra=kv(command=what, token_file=str(path), mode="0600"))
    elif not path.exists():
        return rpc
    else:
        log.info("auth token from the run's token file", extra=kv(command=what, token_file=str(path)))
    read_token_file(path)  # the mode and content checks, one line naming the file
    return dataclasses.replace(rpc, token_file=str(path))


def checkpoint_root(explicit: str, run_dir: str | Path) -> Path:
    """Where a role's wire paths are confined: ``explicit``, else ``$METAPS_RUN_DIR/checkpoints``,
    else ``<run_dir>/checkpoints`` (absolute)."""
    if explicit:
        return Path(explicit).resolve()
    env = os.environ.get("METAPS_RUN_DIR", "")
    return (Path(env or run_dir) / "checkpoints").resolve()


def _another_runs_token(path: Path, own: Path) -> bool:
    """True when ``path`` is the token file ``metaps launch`` wrote in another run's directory
    (the job file is a copy of that run's ``RUN/job.toml``): a new run gets a token of its own."""
    return (path != own and path.name == RUN_TOKEN_FILE and (path.parent / "job.toml").is_file()
            and (path.parent / "controller").is_dir())


def launch_token(raw: dict[str, Any], rpc: Any, token_file: str = "", *,
                 run_dir: str | Path = "") -> tuple[str, dict[str, str]]:
    """Settle a launched run's token, keep it in a 0600 file, and take the secret out of its job mapping.

    The token is ``[rpc] token``, else the token file's content, else
    ``$METAPS_TOKEN``, else a fresh :func:`generate_token`. It lives in a token
    file: ``--token-file`` or ``[rpc] token_file`` when given (created 0600 with
    the token when missing), else the run's own ``RUN/rpc.token``
    (:data:`RUN_TOKEN_FILE`; created 0600 from the start, kept when it exists: a
    ``--resume`` goes on with the run's token). ``raw``'s ``[rpc] token_file``
    names that file, so every child and every CLI client given ``--config
    RUN/job.toml`` (``metaps status``, ``cut``, ``run-report``) reads the token
    from it, and ``[rpc] token`` becomes :data:`REDACTED`. A job file that names
    another launched run's ``rpc.token`` (a copy of its ``job.toml``) does not
    carry that token over: the new run gets its own. TLS files are checked here
    too, so a missing one fails before anything starts. The token is never logged.

    Args:
        raw: the parsed job TOML the launcher will write as ``RUN/job.toml`` (edited in place).
        rpc: its ``common.rpc.RpcConfig``.
        token_file: ``metaps launch --token-file`` ('' = ``[rpc] token_file``).
        run_dir: the run directory ('' = no run token file: with no token file given the
            children get ``$METAPS_TOKEN``).

    Returns:
        (the token, extra environment for every child process: empty when a token file holds it).
    """
    import dataclasses

    dataclasses.replace(rpc, token_file="").check_files()
    given = rpc.token if rpc.token != REDACTED else ""
    sec = raw.setdefault("rpc", {})
    path = token_file or rpc.token_file
    own = (Path(run_dir).resolve() / RUN_TOKEN_FILE) if run_dir else None
    if path and own is not None and _another_runs_token(Path(path).resolve(), own):
        log.info("the job file names another run's token file; this run gets its own",
                 extra=kv(other=str(Path(path).resolve()), token_file=str(own)))
        path = ""
    if not path and own is not None:
        make_run_dir(own.parent)  # the run dir, 0750: the token file made in it is 0600
        path = str(own)
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


def client_rpc(rpc: Any, token_file: str = "", *, run_dir: str | Path = "", config: str = "", what: str = "") -> Any:
    """The job's ``[rpc]`` for a CLI client of a running fleet (``metaps status``, ``cut``,
    ``run-report``): :func:`role_rpc` as a client, and a one-line error when it finds no token
    although the job file says the run had one (``token = "<redacted>"``).

    Args:
        rpc: the job's ``common.rpc.RpcConfig`` (from ``--config``, e.g. ``RUN/job.toml``).
        token_file: ``--token-file`` ('' = the job's ``[rpc] token_file``).
        run_dir: the job's ``[run] dir`` (its ``rpc.token`` is looked at last).
        config: the job file, for the message.
        what: the command, for the log.

    Raises:
        ConfigError: the token file is missing, unreadable or readable by group/others (naming
            it), or the job file's token is redacted and no token was found.
    """
    out = role_rpc(rpc, token_file, run_dir=run_dir, what=what)
    if rpc.token == REDACTED and not out.resolved_token():
        where = run_token_path(run_dir) if run_dir else Path(RUN_TOKEN_FILE)
        raise ConfigError(f"{config or 'the job file'}: [rpc] token is redacted and no token file holds it "
                          f"({where}: no such file); pass --token-file FILE or set ${TOKEN_ENV}")
    return out


def check_bind(hosts: list[str], token: str, *, insecure: bool, what: str, serves: bool = False) -> None:
    """Refuse to serve without a token.

    Args:
        hosts: every host this process will bind (gRPC, /metrics).
        token: the resolved token ('' = no auth).
        insecure: the operator's ``--insecure``: serve without a token (loudly).
        what: the command, for messages (``metaps ps``).
        serves: this process serves gRPC mutations (PS, controller): no token is
            refused on loopback too (:func:`role_rpc` generates one there).

    Raises:
        SecurityError: no token, no ``--insecure``, and a non-loopback host or ``serves``.
    """
    if token:
        return
    public = [h for h in hosts if not is_loopback(h)]
    if public and not insecure:
        raise SecurityError(
            f"{what}: refusing to bind {public[0]!r} without an auth token (anyone who can reach it could "
            f"push rows, write checkpoints, shut the fleet down); set [rpc] token_file, [rpc] token or "
            f"$METAPS_TOKEN, bind 127.0.0.1, or pass --insecure")
    if serves and not insecure:
        raise SecurityError(
            f"{what}: refusing to serve without an auth token; set [rpc] token_file, [rpc] token or "
            f"$METAPS_TOKEN, give [run] dir so one is generated there, or pass --insecure")
    if insecure:
        log.warning("NO AUTH TOKEN (--insecure): calls to and from this process are unauthenticated; anyone "
                    "who can reach its ports may push rows, pause writes or shut the fleet down",
                    extra=kv(command=what, hosts=",".join(hosts), insecure=insecure))
    else:
        log.warning("NO AUTH TOKEN: this process found no token ([rpc] token, token_file, $METAPS_TOKEN, "
                    "the run's rpc.token); an authenticated PS or controller will refuse its calls",
                    extra=kv(command=what, hosts=",".join(hosts), insecure=insecure))


__all__ = [
    "PRIVATE_UMASK",
    "RUN_UMASK",
    "RUN_TOKEN_FILE",
    "TOKEN_ENV",
    "launch_token",
    "add_cli_args",
    "client_rpc",
    "checkpoint_root",
    "role_rpc",
    "run_token_path",
    "REDACTED",
    "SecurityError",
    "check_bind",
    "generate_token",
    "is_loopback",
    "make_private_dir",
    "make_run_dir",
    "read_token_file",
    "redact",
    "set_private_umask",
    "set_run_umask",
    "write_token_file",
]
