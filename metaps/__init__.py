"""metaps: parameter-server training for large recommender models.

Two floors: ``metaps.core`` is the ground-floor plumbing every subsystem may import
(errors, config loading, RPC helpers, auth, metrics, logging); the rest of ``metaps``
is the top floor that composes the subsystems (the ``metaps`` CLI, the job file,
the launcher, run reports). The subsystems are top-level packages: ``meta_io``,
``ps``, ``workers``, ``models``, ``controller``, ``delivery``.

From Python: ``from metaps import api`` (docs/api.md). It is not re-exported here: this
package is the ground floor, which imports no top-floor module (tests/test_imports.py),
and ``import metaps`` stays free of torch for the CLI's start-up.
"""

__version__ = "0.1.0"
