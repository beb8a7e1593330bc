"""The ground floor: plumbing every subsystem may import.

Errors, config loading, RPC helpers and auth, logging, atomic writes, hashing,
metrics, evaluation metrics, fault injection and path confinement. Nothing here
imports a subsystem (``ps``, ``controller``, ``workers``, ``meta_io``, ``models``,
``delivery``) or the top floor (the ``metaps`` package: CLI, job composition,
launcher, reports); ``tests/test_imports.py`` checks it.
"""
