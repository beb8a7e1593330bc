"""``metaps launch``: run a whole fleet on this machine and leave a run directory.

::

    metaps launch --config configs/local.toml [--workers N] [--ps N] [--run-dir DIR]
                  [--resume-from DIR] [--timeout S] [--no-progress] [--token-file FILE]
                  [--set SECTION.KEY=VALUE ...] [--json]

Everything that can be checked is checked before a process starts or the run
directory is made (:mod:`metaps.roles.launch_checks`, :mod:`metaps.preflight`): the
``--set`` keys, the job file, the datasets (a missing one says which command builds
it), the schema, tables and model, the resume checkpoint, that the run and
checkpoint directories can be written, that the fixed ports are free, the token file.

What it does::

    run dir  <- job.toml (the effective config: counts, run dir, state dir; every process reads it)
    controller                          metaps controller --address HOST:PORT --state-dir RUN/controller
    agent ps:K   -> metaps ps --shard K --port P_K (picked up front: a restart comes back on it)
                     [--restore CKPT with --resume-from]     ... wait for RUN/ps/ps-K.ready
    agent worker:R -> metaps worker --rank R --ps ADDRS --controller ADDR --run-dir RUN
    watch: controller status + worker step logs -> live view; exits / signals / timeout
    end:   PS stats, controller status, (failed or interrupted: workers stopped, then a
           coordinated checkpoint of the PS), stop PS, stop controller, (succeeded: the
           Prometheus targets file emptied), ledger -> report.json, tb/, plots/, summary table

Auth is always on: the run's token is ``[rpc] token``, a token file or
``$METAPS_TOKEN``, else a fresh random one (:func:`common.security.launch_token`);
it lives in a 0600 token file -- the one given (``--token-file``, ``[rpc] token_file``),
else ``RUN/rpc.token`` -- that ``RUN/job.toml`` names (``token_file``), so children
and ``metaps status|cut --config RUN/job.toml`` / ``run-report`` read it there, never
argv; ``RUN/job.toml``, ``report.json`` and manifests say ``token = "<redacted>"``. The
run dir is 0700, its files 0600; the PS and controller accept checkpoint paths
under ``RUN/checkpoints`` only (``--checkpoint-root``).

Every process gets ``METAPS_T0`` (one job start time, for fault-injection clocks)
and its own process group (see :mod:`metaps.fleet`): SIGINT/SIGTERM stop the
whole fleet with no process left behind; a second signal kills at once.

Exit code: 0 when every worker finished; 1 when training failed (a worker's agent
gave up after its restart limit, an agent died more often than that limit, a PS
or the controller died, the controller failed the run -- a PS recovery with no
restorable checkpoint --, the timeout passed, a process did not start); 130/143
when interrupted by SIGINT/SIGTERM. An agent that died (SIGKILL, a crash) is
restarted with its orphaned child stopped and its node reported down
(docs/design/launch.md). report.json and the summary say why, and what fraction
of the requested shards was covered (``coverage: 62% (stopped: launcher
SIGTERM)``; "complete" only when every shard of every requested epoch is done).

Two helpers for fleets started by hand or across hosts (``scripts/``)::

    metaps config-write --config job.toml --set ps.host=10.0.0.2 --out host-job.toml
    metaps run-report --run-dir DIR [--controller ADDR] [--ps ADDRS]

With ``--json`` stdout holds one JSON object (the report's headline fields) and
stderr log lines only: no live view, no tables.

Modules: :mod:`~metaps.launch.config` (inputs, run dir, resume checkpoint),
:mod:`~metaps.launch.launcher` (the fleet's life), :mod:`~metaps.launch.latest`
(``runs/latest``), :mod:`~metaps.launch.commands` (the subcommands).
"""

from metaps.launch.commands import register
from metaps.launch.config import (
    EXIT_FAILED,
    EXIT_OK,
    EXIT_SIGINT,
    EXIT_SIGTERM,
    LaunchConfig,
    _new_run_dir,
    find_resume_checkpoint,
    parse_override,
    write_job,
)
from metaps.launch.launcher import Launcher, Outcome, controller_failed
from metaps.launch.latest import LAST_FAILED, LATEST, mark_latest, settle_latest

__all__ = [
    "EXIT_FAILED", "EXIT_OK", "EXIT_SIGINT", "EXIT_SIGTERM", "LAST_FAILED", "LATEST", "LaunchConfig", "Launcher",
    "Outcome", "_new_run_dir", "controller_failed", "find_resume_checkpoint", "mark_latest", "parse_override",
    "register", "settle_latest", "write_job",
]

