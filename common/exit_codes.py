"""Exit codes of every ``metaps`` command: one table, so a Job's ``podFailurePolicy``,
a launch script and a person reading ``kubectl get pods`` agree on what an exit means.

====  ==============  ==================================================================
code  name            meaning
====  ==============  ==================================================================
0     OK              done: the command (or the run it served) ended as asked
1     FAILED          an error (a bad input says what in one line; a crash in a traceback)
2     USAGE           the command line was wrong (argparse)
3     REFUSED         ``deliver``: the gate refused the candidate (nothing published)
4     RUN_FAILED      the controller failed the run (``run_failed``), or the run's final
                      checkpoint could not be written (a full disk, an I/O error: the worker
                      told the controller, which failed the run): retrying the pod cannot
                      help; the agent does not restart it; the worker Job's podFailurePolicy
                      fails the Job on it
5     SUPERSEDED      the controller fenced this process off: a newer incarnation of its
                      node registered (a replaced pod); it stops without touching state
130   SIGINT          stopped by Ctrl-C
143   SIGTERM         stopped by SIGTERM (pod deleted, scaled down, drained): not a failure
====  ==============  ==================================================================
"""

from __future__ import annotations

OK = 0
FAILED = 1
USAGE = 2
REFUSED = 3
RUN_FAILED = 4
SUPERSEDED = 5
SIGINT = 130
SIGTERM = 143

# The controller's ``stop`` command says why in its reason's first word; the process
# that obeys it exits with the matching code (see :func:`for_stop`).
STOP_SUPERSEDED = "superseded"
STOP_RUN_FAILED = "run_failed"
STOP_RUN_ENDED = "run_ended"


def for_stop(reason: str) -> int:
    """The exit code of a process the controller told to stop with ``reason``."""
    word = reason.split(":", 1)[0].strip()
    return {STOP_SUPERSEDED: SUPERSEDED, STOP_RUN_FAILED: RUN_FAILED}.get(word, OK)
