"""Issue 35, items 1, 2 and 5, from the attacker's side: another local user (or a caller with
no key) names shared-memory buckets to a rank. The rank must never create, extend, write or
read a file that is not the named sender's own bucket; a refusal leaves nothing written and
the version where it was; and buckets the senders released stop pinning host memory.

Another user is a real uid where the test runs as root (files chown'd, a sender process that
drops to that uid), else the receiver's `uid_of` seam says the sender runs as someone else.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import secrets
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
import torch

from omni_core.protocol import Bucket, ShmSource
from omni_core.runners.base import RunnerArgumentError
from omni_core.weight_buckets import SHM_DIR, process_uid
from omni_core.weights_sender import WeightSender
from omni_core.workers.weight_receiver import WeightReceiver

from .test_weight_receiver import RecordingRunner, weights_like

ROOT = os.geteuid() == 0
OTHER_UID = 4242  # no such user needed: a uid is a number
SECRET = b"root-only secret!\n"  # 18 bytes, as in the victim
MiB = 1 << 20


@pytest.fixture
def victim(tmp_path: Path) -> Path:
    """A file the rank must never touch: 0600, 18 bytes (root's own where the test is root)."""
    path = tmp_path / "victim"
    path.write_bytes(SECRET)
    path.chmod(0o600)
    return path


@pytest.fixture
def planted() -> Iterator[list[Path]]:
    """Names an attacker made under /dev/shm, removed afterwards."""
    made: list[Path] = []
    yield made
    for path in made:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def shm_name(tag: str) -> Path:
    return SHM_DIR / f"omni-attack-{os.getpid()}-{tag}-{secrets.token_hex(3)}"


def forged(source: ShmSource, handle: Path | str, sender_pid: int | None = None) -> ShmSource:
    bucket = source.buckets[0]
    return ShmSource(
        buckets=(
            msgspec.structs.replace(
                bucket, handle=str(handle), sender_pid=bucket.sender_pid if sender_pid is None else sender_pid
            ),
        )
    )


def one_bucket(sender: WeightSender, runner: RecordingRunner, value: float) -> ShmSource:
    source = sender.share(weights_like(runner, value))
    assert isinstance(source, ShmSource) and len(source.buckets) == 1
    return source


def unchanged(victim: Path) -> bool:
    return victim.read_bytes() == SECRET and victim.stat().st_size == len(SECRET)


def weights_are(runner: RecordingRunner, value: float) -> bool:
    return all(torch.equal(w, torch.full_like(w, value)) for w in runner.weights)


@contextlib.contextmanager
def process_as(uid: int) -> Iterator[int]:
    """A live process running as `uid` (root only): a sender another user started."""
    read_fd, write_fd = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover - the child
        os.close(write_fd)
        os.setgid(uid)
        os.setuid(uid)
        os.read(read_fd, 1)
        os._exit(0)
    os.close(read_fd)
    try:
        deadline = time.monotonic() + 10
        while process_uid(child) != uid and time.monotonic() < deadline:
            time.sleep(0.01)
        yield child
    finally:
        os.close(write_fd)
        os.waitpid(child, 0)


# ---------------------------------------------------------------------- item 1: the swap race

_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _exchanger():  # type: ignore[no-untyped-def]
    """Atomically swap two names (renameat2 RENAME_EXCHANGE): the bucket's name flips between
    the sender's file and an attacker's symlink in one step, as fast as the kernel allows."""
    libc = ctypes.CDLL(None, use_errno=True)
    renameat2 = getattr(libc, "renameat2", None)
    if renameat2 is None:
        return None
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]

    def exchange(a: Path, b: Path) -> None:
        if renameat2(_AT_FDCWD, bytes(a), _AT_FDCWD, bytes(b), _RENAME_EXCHANGE) != 0:
            raise OSError(ctypes.get_errno(), "renameat2")

    return exchange


class Swapper(threading.Thread):
    """The attacker: flips the bucket's name between the sender's file and its symlinks (to the
    victim, then to a path that does not exist) every half millisecond, and at once whenever
    `kick` asks, which the test does right after each call the rank makes by that name: the
    schedule a patient attacker wins by retrying (363 tries in the issue) given every time."""

    def __init__(self, bucket: Path, links: tuple[Path, Path], exchange) -> None:  # type: ignore[no-untyped-def]
        super().__init__(daemon=True)
        self.bucket, self.links, self.exchange = bucket, links, exchange
        self.cond = threading.Condition()
        self.flips = 0
        self.stopped = False

    def run(self) -> None:
        with self.cond:
            while not self.stopped:
                self.cond.wait(timeout=0.0005)
                # flips 0, 1 swap in and out the victim's link; 2, 3 the missing path's
                self.exchange(self.bucket, self.links[(self.flips // 2) % 2])
                self.flips += 1
                self.cond.notify_all()

    def kick(self) -> None:
        with self.cond:
            target = self.flips + 1
            self.cond.notify_all()
            self.cond.wait_for(lambda: self.flips >= target or self.stopped, timeout=1.0)

    def stop(self) -> None:
        with self.cond:
            self.stopped = True
            self.cond.notify_all()
        self.join(10)
        if self.flips % 2:  # leave the sender's file under its name
            self.exchange(self.bucket, self.links[(self.flips // 2) % 2])


def test_a_symlink_swapped_in_under_the_bucket_never_creates_extends_or_reads_a_file(
    runner: RecordingRunner, victim: Path, tmp_path: Path, planted: list[Path], monkeypatch
) -> None:
    """Item 1: a thread flips the bucket's name between the sender's file and symlinks to a
    root-only 0600 file and to a path that does not exist, while the rank takes the update 400
    times (a fresh rank each time: nothing cached); each call the rank makes by that name is
    followed by a flip. Whatever each attempt met, the victim keeps its 18 bytes, the missing
    path is never created, and every update the rank took holds the sender's weights."""
    exchange = _exchanger()
    if exchange is None:
        pytest.skip("libc has no renameat2")
    missing = tmp_path / "never-created"
    with WeightSender() as sender:
        source = one_bucket(sender, runner, 0.5)
        bucket = Path(source.buckets[0].handle)
        to_victim, to_missing = shm_name("to-victim"), shm_name("to-missing")
        planted.extend([to_victim, to_missing])
        to_victim.symlink_to(victim)
        to_missing.symlink_to(missing)
        swapper = Swapper(bucket, (to_victim, to_missing), exchange)
        receiving = threading.get_ident()

        def then_flip(call):  # type: ignore[no-untyped-def]
            def wrapped(path, *args, **kwargs):  # type: ignore[no-untyped-def]
                try:
                    return call(path, *args, **kwargs)
                finally:
                    if threading.get_ident() == receiving and bucket.name in os.fsdecode(path):
                        swapper.kick()

            return wrapped

        for name in ("open", "stat", "lstat"):
            monkeypatch.setattr(os, name, then_flip(getattr(os, name)))
        taken = refused = 0
        swapper.start()
        try:
            for _ in range(400):
                receiver = WeightReceiver(torch.device("cpu"), 0)
                RecordingRunner.writes = []
                try:
                    receiver.apply(source, runner)
                    taken += 1
                except RunnerArgumentError as exc:
                    refused += 1
                    assert RecordingRunner.writes == [], f"refused after writing: {exc}"
                finally:
                    receiver.close()
                attempt = taken + refused
                assert unchanged(victim), f"attempt {attempt}: the victim is {victim.stat().st_size} bytes now"
                assert not missing.exists(), f"attempt {attempt}: the rank created {missing}"
                assert weights_are(runner, 0.5), f"attempt {attempt}: an update took bytes other than the sender's"
        finally:
            swapper.stop()
            monkeypatch.undo()
    assert unchanged(victim), f"victim now {victim.stat().st_size} bytes: {victim.read_bytes()[:24]!r}"
    assert not missing.exists() and not missing.is_symlink(), "the rank created the symlink's target"
    assert swapper.flips > 400 and refused > 0 and taken + refused == 400, (swapper.flips, taken, refused)


# ---------------------------------------------------------------------- item 2: whose file


def test_a_symlink_bucket_is_refused_and_nothing_is_read(
    runner: RecordingRunner, tmp_path: Path, planted: list[Path]
) -> None:
    """Item 2: a symlink in /dev/shm to a file the caller may not name (a checkpoint outside
    allowed_reload_sources, a root-only file) is refused as a symlink; the rank never opens its
    target, so its bytes never become the weights."""
    secret = tmp_path / "outside-allowed-roots.bin"
    secret.write_bytes(torch.full((4096 // 4,), 9.0).numpy().tobytes())  # plausible weights
    link = shm_name("link")
    planted.append(link)
    link.symlink_to(secret)
    before = [w.clone() for w in runner.weights]
    with WeightSender() as sender:
        attack = forged(one_bucket(sender, runner, 1.0), link, sender_pid=os.getpid())
        with pytest.raises(RunnerArgumentError, match="is a symbolic link"):
            WeightReceiver(torch.device("cpu"), 0).apply(attack, runner)
    assert RecordingRunner.writes == [] and all(torch.equal(a, b) for a, b in zip(before, runner.weights, strict=True))


def test_a_symlinked_directory_component_is_refused(runner: RecordingRunner, tmp_path: Path) -> None:
    """The bucket's directory itself is reached without following a symlink."""
    real = tmp_path / "real"
    real.mkdir()
    linked = tmp_path / "linked"
    linked.symlink_to(real, target_is_directory=True)
    (real / "bucket").write_bytes(bytes(4096))
    source = ShmSource(
        buckets=(
            Bucket(handle=str(linked / "bucket"), nbytes=4096, sender_pid=os.getpid(), tensors=forged_specs(runner)),
        )
    )
    with pytest.raises(RunnerArgumentError, match="symbolic link"):
        WeightReceiver(torch.device("cpu"), 0, shm_dir=linked).apply(source, runner)
    assert RecordingRunner.writes == []


def forged_specs(runner: RecordingRunner):  # type: ignore[no-untyped-def]
    with WeightSender() as sender:
        return one_bucket(sender, runner, 0.0).buckets[0].tensors


def plant_file(path: Path, nbytes: int, owner: int | None = None) -> Path:
    path.write_bytes(torch.full((nbytes // 4,), 7.0).numpy().tobytes())
    if owner is not None:
        os.chown(path, owner, owner)
    return path


def test_a_file_another_user_planted_is_refused_for_a_sender_of_this_user(
    runner: RecordingRunner, planted: list[Path]
) -> None:
    """Item 2: a file another user owns, claimed for a live sender of the rank's own user, is
    not that sender's bucket. As root the file is really chown'd; otherwise the seam says the
    sender runs as another uid than the file's owner."""
    with WeightSender() as sender:
        source = one_bucket(sender, runner, 1.0)
        path = shm_name("foreign")
        planted.append(path)
        if ROOT:
            plant_file(path, source.buckets[0].nbytes, owner=OTHER_UID)
            receiver = WeightReceiver(torch.device("cpu"), 0)
            match = f"owned by uid {OTHER_UID}, but its sender pid {os.getpid()} runs as uid 0"
        else:
            plant_file(path, source.buckets[0].nbytes)
            receiver = WeightReceiver(torch.device("cpu"), 0, uid_of=lambda pid: os.geteuid() + 1)
            match = f"owned by uid {os.geteuid()}, but its sender pid"
        with pytest.raises(RunnerArgumentError, match=match):
            receiver.apply(forged(source, path, sender_pid=os.getpid()), runner)
    assert RecordingRunner.writes == []


def test_pid_1_as_the_sender_is_refused(runner: RecordingRunner, planted: list[Path]) -> None:
    """Item 2: `sender_pid: 1` is always alive; it never vouches for a planted file."""
    with WeightSender() as sender:
        source = one_bucket(sender, runner, 1.0)
        path = plant_file(shm_name("init"), source.buckets[0].nbytes)
        planted.append(path)
        with pytest.raises(RunnerArgumentError, match=r"sender pid 1 of bucket .* is init"):
            WeightReceiver(torch.device("cpu"), 0).apply(forged(source, path, sender_pid=1), runner)
    assert RecordingRunner.writes == []


@pytest.mark.skipif(not ROOT, reason="a process of another uid needs root to start")
def test_a_sender_of_another_uid_vouches_for_its_own_files_only(runner: RecordingRunner, planted: list[Path]) -> None:
    """A live process of another user, named as the sender of the rank user's file, is refused;
    the same process with a file it owns is a legitimate sender (a trainer of another user)."""
    with WeightSender() as sender, process_as(OTHER_UID) as other:
        source = one_bucket(sender, runner, 1.0)
        nbytes = source.buckets[0].nbytes
        mine = plant_file(shm_name("mine"), nbytes)
        theirs = plant_file(shm_name("theirs"), nbytes, owner=OTHER_UID)
        planted.extend([mine, theirs])
        receiver = WeightReceiver(torch.device("cpu"), 0)
        with pytest.raises(
            RunnerArgumentError, match=f"owned by uid 0, but its sender pid {other} runs as uid {OTHER_UID}"
        ):
            receiver.apply(forged(source, mine, sender_pid=other), runner)
        assert RecordingRunner.writes == []
        receiver.apply(forged(source, theirs, sender_pid=other), runner)
        assert weights_are(runner, 7.0)


def test_a_hard_link_a_fifo_and_a_short_file_are_refused(runner: RecordingRunner, planted: list[Path]) -> None:
    """A second name for someone's file, a FIFO (whose open would wait for a writer forever)
    and a file shorter than announced: each refused at once, nothing written."""
    with WeightSender() as sender:
        source = one_bucket(sender, runner, 1.0)
        bucket = Path(source.buckets[0].handle)
        second = shm_name("hardlink")
        fifo = shm_name("fifo")
        short = plant_file(shm_name("short"), 16)
        planted.extend([second, fifo, short])
        os.link(bucket, second)
        os.mkfifo(fifo)
        receiver = WeightReceiver(torch.device("cpu"), 0)
        for path, match in ((second, "has 2 names"), (fifo, "not a regular file"), (short, "holds 16 bytes")):
            started = time.monotonic()
            with pytest.raises(RunnerArgumentError, match=match):
                receiver.apply(forged(source, path), runner)
            assert time.monotonic() - started < 5
    assert RecordingRunner.writes == []


def test_the_rank_maps_its_buckets_read_only_and_private(runner: RecordingRunner) -> None:
    """Nothing the rank does through a bucket reaches the sender's file: the mapping is
    read-only (and private), and the descriptor it came from is closed."""
    with WeightSender() as sender:
        source = one_bucket(sender, runner, 0.5)
        receiver = WeightReceiver(torch.device("cpu"), 0)
        fds_before = len(os.listdir("/proc/self/fd"))
        receiver.apply(source, runner)
        assert len(os.listdir("/proc/self/fd")) == fds_before, "a bucket's descriptor was left open"
        name = Path(source.buckets[0].handle).name
        with open("/proc/self/maps") as maps:
            perms = [line.split()[1] for line in maps if line.rstrip().endswith(name)]
        # The sender's own mapping is shared read-write (rw-s); the rank's is r--p.
        assert "r--p" in perms and all(p in ("r--p", "rw-s") for p in perms), perms
        receiver.close()


# ---------------------------------------------------------------------- item 5: released buckets


def deleted_shm_mappings() -> tuple[int, int]:
    """(count, bytes) of this process's mappings of /dev/shm files that no longer exist."""
    count = total = 0
    with open("/proc/self/maps") as maps:
        for line in maps:
            if "/dev/shm/" in line and line.rstrip().endswith("(deleted)"):
                start, end = (int(x, 16) for x in line.split()[0].split("-"))
                count += 1
                total += end - start
    return count, total


def test_twenty_released_senders_leave_no_growth_in_dev_shm() -> None:
    """Item 5: 20 trainers in turn share 4 MiB, update the rank and release their buckets. The
    rank keeps at most the last update's mapping of a released file (until the next update
    starts), never one per sender: no growth of mapped bytes or mappings."""
    runner = RecordingRunner(torch.device("cpu"), weights_bytes=4 * MiB, tensor_count=2, hidden=64, kv_bytes=1024)
    runner.load_weights()
    runner.allocate_caches()
    receiver = WeightReceiver(torch.device("cpu"), 0)
    base_count, base_bytes = deleted_shm_mappings()
    peak = (0, 0)
    for step in range(20):
        with WeightSender(bucket_bytes=8 * MiB) as sender:  # a fresh sender: new files each time
            receiver.apply(sender.share(weights_like(runner, float(step))), runner)
        # released: the sender unlinked its file; the rank still maps this last one
        count, nbytes = deleted_shm_mappings()
        peak = max(peak, (count - base_count, nbytes - base_bytes))
        assert receiver.buckets.mapped_bytes <= 4 * MiB + 4096
    assert weights_are(runner, 19.0)
    assert peak[0] <= 1 and peak[1] <= 4 * MiB + 4096, f"released buckets still mapped: {peak}"
    with WeightSender(bucket_bytes=8 * MiB) as live:  # the next update releases the last one too
        receiver.apply(live.share(weights_like(runner, 1.0)), runner)
        assert deleted_shm_mappings() == (base_count, base_bytes)
        assert len(receiver.buckets) == 1
    receiver.close()


def test_the_cache_of_live_buckets_is_bounded_by_bytes() -> None:
    """Buckets of senders that are still alive but moved on are kept up to `retained_bytes`,
    whatever their count; those of the update in hand are always kept."""
    runner = RecordingRunner(torch.device("cpu"), weights_bytes=64 * 1024, tensor_count=2, hidden=16, kv_bytes=1024)
    runner.load_weights()
    runner.allocate_caches()
    receiver = WeightReceiver(torch.device("cpu"), 0, retained_bytes=128 * 1024)
    senders = [WeightSender() for _ in range(6)]
    try:
        for step, sender in enumerate(senders):
            receiver.apply(sender.share(weights_like(runner, float(step))), runner)
            assert receiver.buckets.mapped_bytes <= 64 * 1024 + 128 * 1024 + 4096
        assert len(receiver.buckets) == 3  # the update in hand and two more 64 KiB buckets
        # The newest survivors are reused, not reopened.
        reopened = receiver.reopened
        receiver.apply(senders[-2].share(weights_like(runner, 2.0)), runner)
        assert receiver.reopened == reopened
    finally:
        for sender in senders:
            sender.close()
        receiver.close()
