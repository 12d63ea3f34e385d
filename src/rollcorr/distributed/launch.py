"""``rollcorr train trainer.ranks=N``: the same command as N processes, started by torch's own launcher.

    rollcorr train trainer.ranks=2 ...     ≡     torchrun --standalone --nproc-per-node 2 -m rollcorr train ...

``launch`` runs ``torch.distributed.run``'s elastic agent in this process (``elastic_launch``: rendezvous on
localhost, no restarts) with ``python -m rollcorr train <the same arguments>`` as each worker. The run folder is
chosen here first, so every worker and the error message name the same one. Multi-node runs call ``torchrun``
directly (docs/distributed.md); each worker reads its rank from the environment (``group.init_from_env``).

Faults: when a worker exits with an error or is killed, the agent (polling every 0.2 s) stops the others
(SIGTERM, then SIGKILL) — a survivor blocked in a collective with the dead peer also fails at once on the closed
connection, or within half a second at the shared-memory barrier — and ``launch`` prints one line naming the first rank that failed and why. A SIGINT, SIGTERM or
SIGHUP to the launcher: the agent passes SIGTERM to every worker (each finishes its step and saves a checkpoint,
as one process does) and ``launch`` says so in one line instead of the agent's ``SignalException`` traceback.
A signal sent to one worker alone stops every rank after the same step too (the ranks agree on it); each
exits 128 + the signal's number and ``launch`` names the signal. A worker that
refused to start (exit 2: a bad override, a run folder it will not touch) has said why in one line; ``launch``
adds nothing (no "continue with --resume", which would not apply).
"""

from __future__ import annotations

import errno
import os
import resource  # imported here: once descriptors run out, an import fails too
import signal
import sys
import uuid

FAILED_EXIT = 1
REFUSED_EXIT = 2  # ``rollcorr train``'s exit code for a refusal (bad input, a run folder it will not touch)
SIGNAL_EXIT = 128  # a rank stopped by a signal under the launcher exits 128 + its number (the shell's way)


def _root_failure(err) -> tuple[int, object]:
    """The failed rank to name: the first failure that is not the agent's own teardown. When one rank dies the
    agent stops the others with SIGTERM before they run any handler (killed by SIGTERM); which failure it
    records first is a race, so such a rank is named only when every failure is one. A rank killed by another
    signal comes before ranks that exited with an error: theirs is then the collective that failed because it
    was gone (gloo's closed socket, the shared-memory barrier's check), often within the same second, and the
    agent's timestamps are whole seconds."""
    own = -int(signal.SIGTERM)
    causes = {rank: failure for rank, failure in err.failures.items() if (failure.exitcode or 0) != own}
    if not causes:
        return err.get_first_failure()
    killed = {rank: failure for rank, failure in causes.items() if (failure.exitcode or 0) < 0}
    pool = killed or causes
    rank = min(pool, key=lambda r: (pool[r].timestamp, r))
    return rank, pool[rank]


def _cause(failure) -> str:
    """A worker's failure in words: the signal that killed it, its exception (recorded by
    ``torch.distributed.elastic``'s ``record``), or its exit code."""
    exitcode = failure.exitcode or 0
    if exitcode < 0:
        try:
            return f"killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"killed by signal {-exitcode}"
    message = getattr(failure, "message", "") or ""
    if isinstance(message, dict):  # the error file's {"message": "Type: text", "extraInfo": {...}}
        message = message.get("message", "")
    message = str(message)
    if message and "enable traceback" not in message:
        return message.strip().splitlines()[0]
    return f"exited with code {exitcode} (its own error is printed above)"


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0][:200] if text else type(err).__name__


def _fd_hint(err: BaseException) -> str:
    """When the error is (or reads like) running out of file descriptors: the limit and what to do."""
    if getattr(err, "errno", None) != errno.EMFILE and "uv loop" not in str(err) and "open files" not in str(err):
        return ""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return f" (open files are limited to {soft} here, `ulimit -n`; the ranks' sockets need more: raise it)"


MIN_OPEN_FILES = 64  # below this the agent's store and the ranks' sockets run out: with `ulimit -n` 12-14 c10d
# retried its connections for minutes (a hang, then a RendezvousConnectionError traceback); 16-24 fail at once


def launch(train_args: list[str], world: int, run_dir: str | None = None) -> int:
    """Run ``rollcorr train <train_args>`` as ``world`` worker processes (ranks) on this machine; the exit code."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < MIN_OPEN_FILES:
        print(f"rollcorr train: the launcher could not start {world} ranks: open files are limited to {soft} here "
              f"(`ulimit -n`); the ranks' store and sockets need at least {MIN_OPEN_FILES}: raise it; nothing was "
              "trained", file=sys.stderr)
        return FAILED_EXIT
    from torch.distributed import DistError
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    config = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=world, run_id=f"rollcorr-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d", rdzv_endpoint="127.0.0.1:0", max_restarts=0, monitor_interval=0.2,
    )
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # torchrun's default; trainer.threads sets torch's own
    try:
        elastic_launch(config, entrypoint=sys.executable)("-m", "rollcorr", "train", *train_args)
    except ChildFailedError as err:
        rank, failure = _root_failure(err)
        codes = {f.exitcode or 0 for f in err.failures.values()}
        where = f"; continue with rollcorr train --resume {run_dir}" if run_dir else ""
        if REFUSED_EXIT in codes:  # a refusal before training: rank 0 said it in one line; nothing to resume
            return REFUSED_EXIT
        stops = sorted(c for c in codes if SIGNAL_EXIT < c < SIGNAL_EXIT + signal.NSIG)
        if stops:  # the ranks stopped together on a signal (they agree on it after a step), with a checkpoint
            name = signal.Signals(stops[0] - SIGNAL_EXIT).name
            print(f"rollcorr train: {name}: every rank stopped after the same step with a checkpoint{where}",
                  file=sys.stderr)
            return stops[0]
        print(f"rollcorr train: rank {rank} of {world} failed: {_cause(failure)}; every rank stopped{where}",
              file=sys.stderr)
        return FAILED_EXIT
    except (OSError, DistError) as err:  # the agent itself could not start (its store, its sockets, its pipes)
        print(f"rollcorr train: the launcher could not start {world} ranks: {_first_line(err)}{_fd_hint(err)}; "
              "nothing was trained", file=sys.stderr)
        return FAILED_EXIT
    except SignalException as err:  # the agent stopped the workers (SIGTERM to each, which checkpoints and stops)
        where = f"; continue with rollcorr train --resume {run_dir}" if run_dir else ""
        print(f"rollcorr train: {err.sigval.name}: every rank was asked to stop after its step with a checkpoint{where}",
              file=sys.stderr)
        return 128 + int(err.sigval)
    return 0
