"""Errors raised by the parameter server's storage and service.

``BadRequest`` is raised *before* anything is changed: a table is always left
exactly as it was when a request is refused.
"""

from __future__ import annotations

from common.errors import MetapsError


class BadRequest(MetapsError):
    """A pull/push/import names an unknown table or carries malformed data.

    The message names the table and what was expected vs what was got, e.g.
    ``table 'user': grads shape (3, 8) does not match ids [3] x dim 16``.
    """


class CheckpointError(MetapsError):
    """A checkpoint directory or file is missing, incomplete or corrupt.

    The message names the directory, file and (where relevant) LMDB key.
    """


class CheckpointNotFound(CheckpointError):
    """The directory is not a committed checkpoint (no such directory, or no manifest)."""


class CheckpointWriteError(MetapsError):
    """A checkpoint could not be written (an I/O error on its files); its partial files
    were removed and nothing was committed.

    Not a :class:`CheckpointError`: the checkpoints already committed are intact (a
    restore of them is unaffected). The message is one line naming the file.
    """


class CheckpointNoSpace(CheckpointWriteError):
    """A checkpoint file hit a full disk or quota (ENOSPC / EDQUOT); partial files removed."""
