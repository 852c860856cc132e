"""The node's ledger of one device, shared by every omni-core engine on the host: who holds
what on it, and one incoming wake at a time.

Two engines (or an engine and a plain vLLM) on one GPU each gate their own wakes; waking at
once, each maps part of what it needs and waits for the memory the other is mapping, until
both deadlines expire and both roll back: a livelock that repeats with every retry. The ledger
breaks it: a wake that may wait for memory (a swap's `memory_wait_s`) first takes the device's
incoming lock, so waiting wakes on one device run one after another, across engines; the one
that cannot get the lock within its wait is refused naming the wake that holds it. A wake that
does not wait takes its chance as before (it fails fast and rolls back, P-16).

Where it lives: a directory per device. For a simulated device (CPU runs), its own directory;
for a GPU, `<base>/<GPU UUID>` where the operator sets `<base>` with OMNI_CORE_DEVICE_LEDGER_DIR
(default `<tmp>/omni-core-devices-<uid>`), where each rank also keeps a holder file
(`simulated_device.SimulatedDevice`'s format) so a refusal names the other engines' ranks.
Engines of other users do not share it (their processes cannot read a 0700 directory); NVML
still lists their pids. Everything in it is outside input (`ledger_files`): a directory or lock
file that cannot be trusted is refused with `LedgerError`, which says what to remove or set.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import re
import tempfile
import time
from collections.abc import Callable, Iterator

from omni_core.workers.ledger_files import (
    ENV_LEDGER_DIR,
    LedgerError,
    open_regular,
    printable,
    read_capped,
    secure_directory,
)
from omni_core.workers.memory_gate import WakeRefused
from omni_core.workers.simulated_device import SimulatedDevice, SimulatedResidency

log = logging.getLogger("omni_core.workers.device_ledger")

INCOMING_LOCK = "incoming.lock"
# The lock file also names its holder, for the refusal of the next wake; never more than this.
MAX_OWNER_BYTES = 512
# How often a waiting wake tries the lock again: short against any wait worth setting.
POLL_S = 0.01


# What NVML calls a GPU or a MIG instance ("GPU-8f2e...", "MIG-..."): a directory name, nothing more.
_UUID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")


def ledger_base() -> str:
    """Where this user's device ledgers live: the operator's OMNI_CORE_DEVICE_LEDGER_DIR, else
    a directory of this user's under the temporary directory."""
    chosen = os.environ.get(ENV_LEDGER_DIR, "")
    return chosen or os.path.join(tempfile.gettempdir(), f"omni-core-devices-{os.getuid()}")


def gpu_ledger_directory(gpu_uuid: str) -> str:
    """The ledger of one GPU for this user's engines. The base is made or checked here
    (LedgerError): whoever could write to it could swap a device's directory for their own."""
    if not _UUID_RE.match(gpu_uuid) or gpu_uuid in (".", ".."):
        raise LedgerError(f"GPU UUID {gpu_uuid[:64]!r} cannot name a ledger directory (letters, digits, '.-_' only)")
    base = ledger_base()
    secure_directory(base)
    return os.path.join(base, gpu_uuid)


def _open_lock(directory: str) -> int:
    secure_directory(directory)
    path = os.path.join(directory, INCOMING_LOCK)
    try:
        return open_regular(path, os.O_RDWR | os.O_CREAT)
    except OSError as err:  # ELOOP: a symlink planted under the lock's name
        raise LedgerError(
            f"cannot open the device ledger's lock {path!r} ({err.strerror or err}); remove it (rm {path}): "
            "the next wake creates it again"
        ) from None


def incoming_owner(directory: str) -> str:
    """Who holds (or last held) the device's incoming lock, as it wrote itself; "" if unknown."""
    raw = read_capped(os.path.join(directory, INCOMING_LOCK), MAX_OWNER_BYTES)
    return printable(raw or b"", MAX_OWNER_BYTES)


@contextlib.contextmanager
def one_incoming_wake(
    directory: str,
    who: str,
    wait_s: float,
    *,
    clock: Callable[[], float] = time.monotonic,
    pause: Callable[[float], None] = time.sleep,
) -> Iterator[float]:
    """Hold the device's incoming lock for the body (a wake's maps); yields the seconds spent
    waiting for it. WakeRefused, before anything is mapped, if another wake holds it past
    `wait_s`: nothing changed, the tags stay asleep (NO_MEMORY). So is a wake whose ledger
    cannot be trusted (LedgerError): refused, never the rank's failure."""
    try:
        fd = _open_lock(directory)
    except LedgerError as err:
        raise WakeRefused(f"this wake cannot take its turn on the device: {err}") from None
    try:
        started = clock()
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if clock() - started >= wait_s:
                    raise WakeRefused(
                        f"another wake holds the device's incoming lock ({incoming_owner(directory) or 'unnamed'}) "
                        f"after {wait_s:.3f} s of waiting; wakes that wait for memory on one device run one at a "
                        "time across engines: retry once it is done, or give this wake a longer memory_wait_s"
                    ) from None
                pause(POLL_S)
        os.ftruncate(fd, 0)
        os.pwrite(fd, who.encode()[:MAX_OWNER_BYTES], 0)
        yield clock() - started
    finally:
        os.close(fd)  # closing drops the lock


class LedgerMember:
    """A process's place in a GPU's node ledger outside an omni-core rank: `omni_fast` inside
    plain vLLM. It registers its holdings (a holder file, as a rank's) and announces each
    change, and its wakes take the device's incoming lock, so omni-core's waiting wakes and
    vLLM's run one at a time on the device and each names the other when refused."""

    def __init__(self, directory: str, capacity_bytes: int, stage: str, rank: int, wait_s: float) -> None:
        self.directory = directory
        self.residency = SimulatedResidency(SimulatedDevice(directory, capacity_bytes), stage, rank)
        self.wait_s = wait_s
        self.who = f"stage {stage} rank {rank}, pid {os.getpid()} (engine pid {os.getppid()})"
        self._problem = ""  # the last problem logged

    def announce(self, resident_bytes: int) -> None:
        """This process's resident bytes now. A ledger that cannot be written is logged once
        per problem: the driver still refuses what does not fit, only the names are lost."""
        try:
            self.residency.report(resident_bytes)
        except (OSError, LedgerError) as err:
            if str(err) != self._problem:
                self._problem = str(err)
                log.warning("the node ledger %s did not take %s's holdings: %s", self.directory, self.who, err)

    def incoming(self) -> contextlib.AbstractContextManager[object]:
        """The device's incoming lock for a wake (WakeRefused naming its holder past wait_s);
        none with wait_s = 0: the wake takes its chance, as an omni-core wake without a wait."""
        if self.wait_s <= 0:
            return contextlib.nullcontext()
        return one_incoming_wake(self.directory, self.who, self.wait_s)
