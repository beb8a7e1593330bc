"""Role entry points (app floor): one module per ``metaps`` role or tool command.

``ps`` (``metaps ps``), ``ps_link`` (a shard's link to the controller), ``worker``
(``worker``, ``train-local``), ``controller`` (``controller``, ``agent``), ``data``
(``gen-data``, ``meta-io``), ``deliver`` (``deliver``, ``predict``). They compose the
subsystems with the job file (:mod:`metaps.job`); the subsystems never import them
(docs/design/architecture.md).
"""
