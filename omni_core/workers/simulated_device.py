"""A simulated device: the capacity a GPU would have, for CPU runs (CI) of a swap.

A CPU has no device memory to run out of, so a swap's memory gate would have nothing to
wait for. A simulated device stands in: a directory shared by the processes "on" it and a
capacity in bytes. Each rank writes its resident bytes to its own file
`{stage}-rank{r}-{pid}.json` on every change (write to a temporary name, then rename: a
reader sees the old figure or the new one, never half a file), and

    free = capacity - sum of the resident bytes in the files of live processes.

A file whose pid is dead holds nothing (a killed rank leaves its file behind): the next
reading reaps it, and the temporary file of a writer killed before its rename. Any file that
is not one of ours or does not parse is ignored: the directory is shared, and what is in it
is not trusted (`ledger_files`: a 0700 directory of this user, regular files only, never
followed through a symlink, read up to a cap). A test adds a file of its own to play a third
process on the GPU.

A wake's map is checked as a driver checks it (`claim`): under an exclusive lock on the
directory, the bytes every other live file holds plus this process's new figure
must fit the capacity, or the map fails with SimulatedOutOfMemory (which the memory gate
treats like a driver's OOM: not free yet). Without it two ranks admitted on the same free
figure would both map past the capacity. Loading and sleeping only report (a test may start
more stages than the device holds and sleep one, as the swap smoke runs do).

Plain data (a msgspec Struct): it travels inside `WorkerConfig` to every rank and sits in
`StageSpec` as given. No torch here; the engine imports it.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass

import msgspec

from omni_core.workers.ledger_files import read_capped, secure_directory

# At most this many files are read per query (a runaway directory must not make every
# allocation of a wake scan it all); the rest are skipped and `holders` says how many.
MAX_FILES_READ = 1024
# A holder's file is a few dozen bytes; anything larger is not ours and is not read.
MAX_FILE_BYTES = 4096
# Beyond any device that exists (and msgpack's int range): a capacity past it is a typo.
MAX_CAPACITY_BYTES = 1 << 60
_FILE_RE = re.compile(r"^(?P<stage>[A-Za-z0-9_.-]{1,64})-rank(?P<rank>\d{1,6})-(?P<pid>\d{1,10})\.json$")
# A writer's temporary file, named by its pid so a dead writer's can be reaped.
_TMP_RE = re.compile(r"^\.(?P<pid>\d{1,10})-[A-Za-z0-9_]{1,32}\.tmp$")


class SimulatedOutOfMemory(RuntimeError):
    """A map refused for lack of memory: by a simulated device, or a test's driver double."""


@dataclass(frozen=True)
class Holder:
    """A process holding device memory: its pid, bytes, and what it is where known."""

    pid: int
    nbytes: int
    label: str = ""  # e.g. "stage talker rank 0"; "" where only the pid is known (NVML)
    engine_pid: int | None = None  # the engine that started it, where its ledger file says

    def describe(self) -> str:
        what = f"{self.label}, " if self.label else ""
        engine = f" (engine pid {self.engine_pid})" if self.engine_pid is not None else ""
        return f"{what}pid {self.pid}{engine}: {self.nbytes} bytes ({self.nbytes / 2**30:.2f} GiB)"


@dataclass(frozen=True)
class HolderList:
    """Who holds the device memory, as far as the source can tell."""

    holders: tuple[Holder, ...]
    skipped: int = 0  # files/processes not read or not usable (malformed, over the cap)
    problem: str = ""  # why the list is empty or partial (NVML unavailable, ...)


def pid_alive(pid: int) -> bool:
    """True while `pid` names a process (ours to signal or not)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process: alive
    return True


class SimulatedDevice(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """`directory` shared by the ranks on this "device", `capacity_bytes` its memory."""

    directory: str
    capacity_bytes: int

    def __post_init__(self) -> None:
        if not isinstance(self.directory, str) or not self.directory:
            raise ValueError(f"simulated_device.directory must be a non-empty path, got {self.directory!r}")
        if (
            not isinstance(self.capacity_bytes, int)
            or isinstance(self.capacity_bytes, bool)
            or not 0 < self.capacity_bytes <= MAX_CAPACITY_BYTES
        ):
            raise ValueError(
                f"simulated_device.capacity_bytes must be an integer in 1..2**60, got {self.capacity_bytes!r}"
            )

    # ------------------------------------------------------------------ reading

    @contextlib.contextmanager
    def _locked(self, mode: int) -> Iterator[None]:
        """The device's directory locked (shared for a reading, exclusive for a claim), so a
        reading never mixes one holder's figure from before a claim with another's after it."""
        secure_directory(self.directory)
        # The directory itself: no lock file to clean up.
        lock = os.open(self.directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            fcntl.flock(lock, mode)  # released when the descriptor closes
            yield
        finally:
            os.close(lock)

    def read(self) -> tuple[list[Holder], int]:
        """The live holders' files (at most MAX_FILES_READ read) and how many were skipped, as
        of one moment between claims."""
        with self._locked(fcntl.LOCK_SH):
            return self._read_unlocked()

    def _read_unlocked(self) -> tuple[list[Holder], int]:
        holders: list[Holder] = []
        skipped = 0
        try:
            entries = os.scandir(self.directory)
        except FileNotFoundError:
            return [], 0  # nobody has written yet
        with entries:
            read = 0
            for entry in entries:
                match = _FILE_RE.match(entry.name)
                if match is None:
                    _reap_temporary(entry.path, entry.name)
                    continue  # strangers' files
                if read >= MAX_FILES_READ:
                    skipped += 1
                    continue
                read += 1
                holder = self._parse(entry.path, match)
                if holder is None:
                    skipped += 1
                elif pid_alive(holder.pid):
                    holders.append(holder)
                else:
                    _reap(entry.path)  # a killed rank's: it holds nothing
        return holders, skipped

    def _parse(self, path: str, match: re.Match[str]) -> Holder | None:
        """The file's holder, or None when it is not a sane file of ours."""
        raw = read_capped(path, MAX_FILE_BYTES)  # None: gone, a symlink, a FIFO, not a file
        if raw is None or len(raw) > MAX_FILE_BYTES:
            return None
        try:
            data = json.loads(raw)
            nbytes, pid = data["resident_bytes"], data["pid"]
        except (ValueError, TypeError, KeyError):
            return None  # malformed, not an object
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in (nbytes, pid)):
            return None
        if pid != int(match["pid"]) or not 0 <= nbytes <= self.capacity_bytes:
            return None  # a file lying about whose it is, or holding more than the device has
        engine_pid = data.get("engine_pid")
        named = isinstance(engine_pid, int) and not isinstance(engine_pid, bool) and engine_pid > 0
        return Holder(pid, nbytes, f"stage {match['stage']} rank {int(match['rank'])}", engine_pid if named else None)

    def used_bytes(self) -> int:
        return sum(h.nbytes for h in self.read()[0])

    def free_bytes(self) -> int:
        return max(0, self.capacity_bytes - self.used_bytes())

    def holders(self) -> HolderList:
        holders, skipped = self.read()
        return HolderList(tuple(sorted(holders, key=lambda h: -h.nbytes)), skipped)

    # ------------------------------------------------------------------ writing

    def path_of(self, stage: str, rank: int, pid: int) -> str:
        return os.path.join(self.directory, f"{stage}-rank{rank}-{pid}.json")

    def write(self, stage: str, rank: int, pid: int, resident_bytes: int) -> None:
        """Atomically set this process's resident bytes (write, then rename over the old file);
        the file names the engine (the rank's parent) so other engines' refusals can."""
        if resident_bytes < 0:
            raise ValueError(f"resident_bytes must be >= 0, got {resident_bytes}")
        secure_directory(self.directory)
        path = self.path_of(stage, rank, pid)
        body = json.dumps(
            {"stage": stage, "rank": rank, "pid": pid, "resident_bytes": resident_bytes, "engine_pid": os.getppid()}
        )
        fd, tmp = tempfile.mkstemp(prefix=f".{os.getpid()}-", suffix=".tmp", dir=self.directory)  # 0600
        try:
            with os.fdopen(fd, "w") as f:
                f.write(body)
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise

    def claim(self, stage: str, rank: int, pid: int, resident_bytes: int) -> None:
        """Set this process's resident bytes if they fit beside every other live holder's, as
        one step against the other processes (an exclusive lock); SimulatedOutOfMemory if not."""
        with self._locked(fcntl.LOCK_EX):
            others = sum(h.nbytes for h in self._read_unlocked()[0] if h.pid != pid)
            if others + resident_bytes > self.capacity_bytes:
                raise SimulatedOutOfMemory(
                    f"out of memory on the simulated device {self.directory}: {stage} rank {rank} would hold "
                    f"{resident_bytes} bytes beside {others} held by others, over its {self.capacity_bytes}"
                )
            self.write(stage, rank, pid, resident_bytes)

    def remove(self, stage: str, rank: int, pid: int) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path_of(stage, rank, pid))


def _reap(path: str) -> None:
    with contextlib.suppress(OSError):  # another reader reaped it first
        os.unlink(path)


def _reap_temporary(path: str, name: str) -> None:
    """A temporary file of a writer that died before its rename: nobody will finish it."""
    match = _TMP_RE.match(name)
    if match is not None and not pid_alive(int(match["pid"])):
        _reap(path)


class SimulatedResidency:
    """One rank's file on a simulated device: what the backend reports its bytes through,
    and the rank's free-memory source (the device's free bytes as every file says)."""

    def __init__(self, device: SimulatedDevice, stage: str, rank: int, pid: int | None = None) -> None:
        self.device = device
        self.stage, self.rank = stage, rank
        self.pid = os.getpid() if pid is None else pid
        self.resident_bytes: int | None = None  # last figure written
        self.reserve_bytes = 0  # exact accounting: nothing to keep back

    def report(self, resident_bytes: int) -> None:
        if resident_bytes != self.resident_bytes:  # a write per change, none for a no-op
            self.device.write(self.stage, self.rank, self.pid, resident_bytes)
            self.resident_bytes = resident_bytes

    def claim(self, resident_bytes: int) -> None:
        """A wake's map: the new figure only if the device holds it (SimulatedOutOfMemory)."""
        self.device.claim(self.stage, self.rank, self.pid, resident_bytes)
        self.resident_bytes = resident_bytes

    def remove(self) -> None:
        self.device.remove(self.stage, self.rank, self.pid)
        self.resident_bytes = None

    def free_bytes(self) -> int:
        return self.device.free_bytes()

    def holders(self) -> HolderList:
        return self.device.holders()

    def describe(self) -> str:
        return f"simulated device {self.device.directory} ({self.device.capacity_bytes} bytes)"
