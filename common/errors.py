"""Errors shared by every subsystem.

Each error names what is wrong (file, field, id, expected vs got) in its message.
"""

from __future__ import annotations


class MetapsError(Exception):
    """Base class of every error metaps raises on purpose.

    ``exit_code`` is what a ``metaps`` command exits with when it ends on this error
    (:mod:`common.exit_codes`: 1, FAILED, unless a subclass says a retry cannot help).
    """

    exit_code: int = 1


class ConfigError(MetapsError):
    """A job config (TOML) is malformed: unknown key, wrong type, bad value."""


class SchemaError(MetapsError):
    """A schema file is malformed, or data does not match its schema."""


class DataError(MetapsError):
    """Input data is bad: missing column, wrong type, NaN label, corrupt file."""


class BindError(MetapsError, OSError):
    """A server could not bind its address: the port is in use, the host is not this machine's,
    or (gRPC) the TLS key and cert do not match. The message names the address and the role."""
