"""metaps: parameter-server training for large recommender models.

This package is the top floor: it composes the subsystems (the ``metaps`` CLI, the
job file, the launcher, run reports, role entry points, Kubernetes generation). The
ground floor every subsystem may import (errors, config loading, RPC helpers, auth,
metrics, logging) is the separate ``common`` package; the subsystems are top-level
packages: ``meta_io``, ``ps``, ``workers``, ``models``, ``controller``, ``delivery``.
No subsystem imports ``metaps`` (tests/test_imports.py).

From Python: ``from metaps import api`` (docs/api.md). It is not re-exported here so
that ``import metaps`` stays free of torch for the CLI's start-up.
"""

__version__ = "0.1.0"
