"""metaps: parameter-server training for large recommender models.

Two floors: ``metaps.core`` is the ground-floor plumbing every subsystem may import
(errors, config loading, RPC helpers, auth, metrics, logging); the rest of ``metaps``
is the top floor that composes the subsystems (the ``metaps`` CLI, the job file,
the launcher, run reports). The subsystems are top-level packages: ``meta_io``,
``ps``, ``workers``, ``models``, ``controller``, ``delivery``.
"""

__version__ = "0.1.0"
