"""A process goodserve starts for itself (the engine process, its worker or tensor-parallel ranks, a
disaggregated prefill engine) stops when the process that started it says so, not on a signal sent
to every process at once.

A terminal's Ctrl-C reaches the whole process group, and a service manager's stop (systemd's, whose
default KillMode is the whole control group) SIGTERMs every process of the service together. The
serving process then drains: it finishes the requests in flight, then stops its children (their
pipes closed, a stop message, SIGKILL as the last resort). A child that died on the signal itself
would fail the very requests the drain is finishing. An orphan (its parent gone) still obeys SIGTERM.
"""

from __future__ import annotations

import atexit
import os
import signal
from multiprocessing.process import BaseProcess


def leave_stopping_to_the_parent() -> None:
    """Ignore SIGINT, and SIGTERM while the parent lives. First thing in the child's main thread."""
    parent = os.getppid()

    def stop_if_orphaned(signum: int, frame) -> None:
        if os.getppid() != parent:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # A handler, not SIG_IGN: an ignored signal would stay ignored in the processes this one starts.
    signal.signal(signal.SIGTERM, stop_if_orphaned)


def kill_at_exit(process: BaseProcess) -> None:
    """The parent's side: process killed at this one's exit if it still runs (a shutdown that ran
    unregisters it: `atexit.unregister(process.kill)`). multiprocessing's own exit hook would SIGTERM
    a daemonic child, which ignores it, and then wait for it for ever; this one, registered later,
    runs first. Not in a process multiprocessing started, which runs that hook and no atexit one as it
    ends: there the owner stops its children itself (the engine process shuts its executor down)."""
    atexit.register(process.kill)
