"""A rank ends with the process that started it, whatever it is doing.

The rank's loop notices a dead parent between frames (`WorkerProcess.serve`), releases its
pools and exits. A rank blocked inside a command (a weight group's rendezvous, a runner
stuck in a collective) never gets back to its loop, and would hold its memory for as long as
the command's own timeout. So, from any state:

- on Linux, the kernel sends the rank SIGTERM when its parent goes (`PR_SET_PDEATHSIG`, set
  at start; the rank installs no handler for it, so it ends there and then);
- everywhere, a watchdog thread checks the parent every `interval_s`; when it is gone and
  the loop has not ended by itself within `PARENT_GONE_GRACE_S`, the process exits at once.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import sys
import threading

log = logging.getLogger("omni_core.worker")

PR_SET_PDEATHSIG = 1  # linux/prctl.h
PARENT_GONE_GRACE_S = 3.0  # the loop's own, graceful exit (pools released) gets this long


def set_death_signal(parent_pid: int) -> bool:
    """Ask the kernel for SIGTERM when the parent dies (Linux); whether it was set. Only when
    `parent_pid` is this process's parent: the signal follows the real parent, not another
    process the config names."""
    if not sys.platform.startswith("linux") or os.getppid() != parent_pid:
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))
    except (OSError, AttributeError) as exc:
        log.warning("could not ask for a signal at the parent's death (%s); the watchdog thread still checks", exc)
        return False
    return True


def watch_parent(parent_pid: int, interval_s: float, what: str, exit_code: int) -> threading.Event:
    """Start the watchdog; set the returned event once the rank's loop has ended by itself."""
    ended = threading.Event()

    def watch() -> None:
        while not ended.wait(interval_s):
            if os.getppid() == parent_pid:
                continue
            if ended.wait(PARENT_GONE_GRACE_S):  # the loop noticed too, and is releasing its pools
                return
            log.error(
                "%s: parent process %d is gone and the rank is blocked in a command; exiting now", what, parent_pid
            )
            for stream in (sys.stdout, sys.stderr):
                with contextlib.suppress(OSError, ValueError):  # a closed pipe: its reader is gone
                    stream.flush()
            os._exit(exit_code)

    threading.Thread(target=watch, name="omni-core-parent-watch", daemon=True).start()
    return ended
