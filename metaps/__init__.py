"""metaps: parameter-server training for large recommender models.

The shared plumbing lives here (config loading, RPC helpers, auth, metrics,
the ``metaps`` CLI). The subsystems are top-level packages: ``meta_io``,
``ps``, ``workers``, ``models``, ``controller``, ``delivery``.
"""

__version__ = "0.1.0"
