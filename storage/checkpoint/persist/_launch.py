"""How the persist worker process is started: its command line, its niceness and its
environment (the worker's side is :mod:`._child`; the handle that starts it,
:class:`._calls.WorkerCalls`)."""

from __future__ import annotations

import os
import subprocess
import sys

#: The worker's nice increment: persistence yields the cores to training.
NICE = 10
#: The signals the worker ignores (see below).
IGNORED = ("SIGINT", "SIGTERM", "SIGHUP", "SIGUSR1", "SIGUSR2")

# Niced once its imports are done: a worker that imported torch at nice +10 on a host
# whose cores the job keeps busy took tens of seconds to start, and the first async save,
# or a preemption save waiting behind it, waited for that.
# The signals of IGNORED are ignored first thing: they are meant for the training
# process, which gets them too when they go to its whole group or to every process of
# the job (Ctrl-C in a terminal, a hangup, a scheduler preempting the job or warning it
# first: Slurm's ``--signal=USR1@90``), and which may answer with a last save that this
# worker writes. The worker inherits none of the trainer's handlers: each of these
# would kill it by its default action, and the save in flight with it.
# The worker's life is the training process's: it exits when that one closes its socket
# or dies, whoever else holds the socket (SIGKILL still stops it).
# ``python -c`` puts the working directory ('') first on sys.path, before the package and
# the standard library, where the training script (``python train.py``) has its own
# directory: it goes before any import, or a neighbour who can write the directory the job
# runs in (shared scratch) had the worker import their ``traceback.py`` as this user.
_COMMAND = (
    "import sys; sys.path[:1] = [p for p in sys.path[:1] if p != '']; "
    "import signal; [signal.signal(getattr(signal, s), signal.SIG_IGN) for s in {ignored}]; "
    "from storage.checkpoint.persist._child import main; import os; os.nice({nice}); "
    "main({fd}, {trainer})"
)


def launch(fd: int) -> subprocess.Popen[bytes]:
    """Start the worker, serving the socket ``fd`` (passed to it, and to it only)."""
    command = _COMMAND.format(nice=NICE, fd=fd, trainer=os.getpid(), ignored=IGNORED)
    return subprocess.Popen(
        [sys.executable, "-c", command],
        pass_fds=[fd],
        stdin=subprocess.DEVNULL,
        env=_environ(),
    )


def _environ() -> dict[str, str]:
    """The worker's environment: this process's, with the directories this package was
    imported from first on ``PYTHONPATH``. The worker imports it before it is sent this
    process's ``sys.path``: a script that found the package through its own
    ``sys.path`` (a checkout, not installed) started a worker that died at import."""
    roots = [
        os.path.dirname(os.path.dirname(os.path.abspath(module.__file__ or "")))
        for module in (sys.modules["storage"], sys.modules["extensions"])
    ]
    environ = dict(os.environ)
    paths = [*dict.fromkeys(roots), *filter(None, environ.get("PYTHONPATH", "").split(os.pathsep))]
    environ["PYTHONPATH"] = os.pathsep.join(paths)
    return environ


def umask() -> int | None:
    """This process's umask, read without changing it (``os.umask`` sets it to read it:
    a file another thread created meanwhile would take the value set); ``None`` where
    the kernel does not say (before Linux 4.7)."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    return None
