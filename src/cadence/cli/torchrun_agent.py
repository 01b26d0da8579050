"""``python -m cadence.cli.torchrun_agent TORCHRUN_ARGS...``: the agent of a ``cadence train --nproc N`` job on
one node (:func:`launcher_main`), torch's launcher in this process. Before it runs, its workers are made to end
with it, and a finished job's agent waits for the other nodes' agents only briefly (:func:`prepare_agent`);
when the job gives up, the failed ranks are recorded for ``cadence train`` (:func:`write_report`).

Its own module, which nothing in the package imports, so that ``python -m`` runs it once."""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from typing import Any

from cadence.cli.launcher_logs import hold_failure_lines
from cadence.cli.torchrun import REPORT_ENV, bad_input
from cadence.runtime.parent_death import AGENT_PID_ENV

logger = logging.getLogger("cadence")

__all__ = ["EXIT_BARRIER_S", "launcher_main", "name_rendezvous_events_cheaply", "prepare_agent", "write_report"]

EXIT_BARRIER_S = 30.0
"""How long an agent whose workers all succeeded waits for the other nodes' agents (torch's default:
300 s); ``$CADENCE_EXIT_BARRIER_S`` sets another bound."""


def prepare_agent() -> None:
    """In the agent's process, before torch's ``main``: export this process's pid to the workers
    (each ends with this agent: :func:`cadence.runtime.parent_death.die_with_agent`), bound the
    exit barrier (:func:`bound_the_exit_barrier`) and make the rendezvous's event records cheap
    (:func:`name_rendezvous_events_cheaply`)."""
    os.environ[AGENT_PID_ENV] = str(os.getpid())
    bound_the_exit_barrier(_exit_barrier_s())
    name_rendezvous_events_cheaply()


def name_rendezvous_events_cheaply() -> None:
    """Make torch's dynamic rendezvous name its events from the calling frame's code.

    It records an event at each of its operations (joining, every poll while a rendezvous is in
    progress, each keep-alive, closing), named by ``get_method_name()``, which calls
    ``inspect.stack()`` twice: that reads every frame's source lines and looks up every frame's
    module among all imported ones. In the agents of a two-rank ``cadence train --nproc 2`` job with
    one restart (the goodput smoke test, profiled with py-spy) this was about a fifth of the CPU of all
    its processes. The name is the same: the function ``depth`` frames up from the caller."""
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous

    def get_method_name(depth: int = 2) -> str:
        try:
            return sys._getframe(depth).f_code.co_name
        except ValueError:  # a shallower stack, as inspect.stack() answers it
            return "no_method_name"

    if hasattr(dynamic_rendezvous, "get_method_name"):
        dynamic_rendezvous.get_method_name = get_method_name


def _exit_barrier_s() -> float:
    try:
        return max(0.0, float(os.environ.get("CADENCE_EXIT_BARRIER_S", "") or EXIT_BARRIER_S))
    except ValueError:
        return EXIT_BARRIER_S


def bound_the_exit_barrier(seconds: float) -> None:
    """Make torch's launcher build its agent with ``exit_barrier_timeout=seconds``.

    An agent whose workers all ended successfully waits in an *exit barrier* for the other nodes'
    agents, by default for 300 s, and ``torchrun`` has no flag for it: one dead peer agent (its
    machine lost after its workers finished) held a finished job for five minutes. A bound of
    seconds is enough for cadence's jobs: a worker exits 0 only after the job's final barrier
    (``end_distributed(ok=True)``), which every rank of every node passed, so the other agents'
    workers are ending too and their agents arrive within about a second. The agent class is
    replaced in ``torch.distributed.launcher.api``, where ``launch_agent`` looks it up, by a subclass
    that only passes the constructor's own ``exit_barrier_timeout``."""
    import torch.distributed.launcher.api as launcher_api

    base: type = launcher_api.LocalElasticAgent
    if getattr(base, "cadence_exit_barrier_s", None) is not None:  # bounded already (a second call)
        base = base.__mro__[1]

    class BoundedExitBarrierAgent(base):
        cadence_exit_barrier_s = seconds

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            kwargs.setdefault("exit_barrier_timeout", seconds)
            super().__init__(*args, **kwargs)

    launcher_api.LocalElasticAgent = BoundedExitBarrierAgent  # type: ignore[misc]


BAD_INPUT_LINGER_S = 5.0
"""How long the agent of a job of several nodes stays up after its ranks ended on bad input (exit 2)."""


def _several_nodes(argv: list[str]) -> bool:
    """Whether torchrun's ``argv`` runs a job on more than one node (``--nnodes N`` or ``MIN:MAX``)."""
    for i, arg in enumerate(argv):
        if arg.startswith("--nnodes="):
            value = arg.split("=", 1)[1]
        elif arg == "--nnodes" and i + 1 < len(argv):
            value = argv[i + 1]
        else:
            continue
        try:
            return int(value.split(":")[-1]) > 1
        except ValueError:
            return False
    return False


def launcher_main(argv: list[str]) -> None:
    """``python -m cadence.cli.torchrun_agent TORCHRUN_ARGS...``: torch's launcher (``torch.distributed.run``'s
    ``main``) in this process. When the job gives up (``ChildFailedError``: a rank failed with no
    restart left), the failed ranks -- global rank, local rank, pid, exit code (negative: the
    signal) and the message a rank recorded for it (:func:`cadence.cli.torchrun.record_for_launcher`) -- go to the JSON file
    ``$CADENCE_TORCHRUN_REPORT`` (first observed failure first); then the error propagates as under
    ``torchrun`` (its report, exit status 1), except for a job ended by bad input (:func:`cadence.cli.torchrun.bad_input`):
    exit status 2, quietly, for ``cadence train`` to print the ranks' one line (torch's own lines about
    a rank that exited 2 are left out: :func:`~cadence.cli.launcher_logs.hold_failure_lines`)."""
    report = os.environ.pop(REPORT_ENV, None)  # not for the workers
    prepare_agent()  # the workers end with this process; a finished job waits briefly for the other nodes
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main

    own = None  # torch's main copies the failed rank's error file to its own (each rank gets one of its own)
    if report and not os.environ.get("TORCHELASTIC_ERROR_FILE"):
        own = os.environ["TORCHELASTIC_ERROR_FILE"] = report + ".error.json"
    lines = hold_failure_lines() if report else None
    try:
        main(argv)
    except ChildFailedError as e:
        if report and bad_input(write_report(report, e)) is not None:
            if lines is not None:
                lines.drop()
            if _several_nodes(argv):
                # The other nodes' ranks meet the same bad input about now. This agent may host the
                # rendezvous store: had it gone at once, their agents would fail on the lost store (a
                # traceback) before they see their own ranks' one line.
                time.sleep(BAD_INPUT_LINGER_S)
            raise SystemExit(2) from None  # cadence train prints the ranks' one line
        raise
    finally:
        if lines is not None:
            lines.release()
        if own is not None:
            try:
                os.unlink(own)
            except OSError:
                pass


def write_report(path: str, error: Any) -> list[dict[str, Any]]:
    """Write the failed ranks of ``error`` (a ``ChildFailedError``) to ``path``; return them ([] when
    that failed)."""
    try:
        first, _ = error.get_first_failure()
        ranks = sorted(error.failures, key=lambda r: (r != first, error.failures[r].timestamp, r))
        failures: list[dict[str, Any]] = [
            {"rank": int(r), "local_rank": int(error.failures[r].local_rank), "pid": int(error.failures[r].pid),
             "exitcode": int(error.failures[r].exitcode)} for r in ranks]
        for failure, r in zip(failures, ranks):
            message = error.failures[r].error_file_data.get("message")  # what record_for_launcher wrote
            message = message.get("message") if isinstance(message, dict) else message
            if failure["exitcode"] == 2 and isinstance(message, str):
                failure["message"] = message
        with open(path, "w") as f:
            json.dump({"failures": failures}, f)
        return failures
    except Exception as e:  # the report is a courtesy: never hide the job's own error
        logger.warning("could not record the failed ranks in %s: %s", path, e)
        return []


if __name__ == "__main__":
    launcher_main(sys.argv[1:])
