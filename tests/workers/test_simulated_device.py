"""The simulated device: per-process files, free = capacity - live holders, hostile files ignored."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

import msgspec
import pytest

from omni_core.workers.config import WorkerConfig
from omni_core.workers.simulated_device import (
    MAX_FILE_BYTES,
    MAX_FILES_READ,
    SimulatedDevice,
    SimulatedOutOfMemory,
    SimulatedResidency,
)

MiB = 1 << 20


@pytest.fixture
def device(tmp_path) -> SimulatedDevice:
    return SimulatedDevice(str(tmp_path / "gpu0"), 64 * MiB)


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid  # reaped: no process has it (until the kernel reuses it, far later)


def test_free_is_capacity_minus_every_live_file(device):
    assert device.free_bytes() == 64 * MiB  # no directory yet: nobody holds anything
    talker = SimulatedResidency(device, "talker", 0)
    talker.report(10 * MiB)
    device.write("other", 0, os.getppid(), 5 * MiB)  # a third process (alive: our parent)
    assert device.free_bytes() == 49 * MiB
    talker.report(3 * MiB)
    assert device.free_bytes() == 56 * MiB
    listing = device.holders()
    assert [h.engine_pid for h in listing.holders] == [os.getppid(), os.getppid()]
    assert [(h.pid, h.nbytes, h.label) for h in listing.holders] == [
        (os.getppid(), 5 * MiB, "stage other rank 0"),
        (os.getpid(), 3 * MiB, "stage talker rank 0"),
    ]
    talker.remove()
    assert device.free_bytes() == 59 * MiB


def test_writes_are_atomic_renames_and_leave_no_temporary_files(device):
    residency = SimulatedResidency(device, "dit", 1)
    for nbytes in (1, 2, 3):
        residency.report(nbytes * MiB)
    assert os.listdir(device.directory) == [f"dit-rank1-{os.getpid()}.json"]
    with open(device.path_of("dit", 1, os.getpid())) as f:
        assert json.load(f) == {
            "stage": "dit",
            "rank": 1,
            "pid": os.getpid(),
            "resident_bytes": 3 * MiB,
            "engine_pid": os.getppid(),  # the rank's parent: its engine, named in others' refusals
        }


def test_a_dead_process_file_holds_nothing(device):
    device.write("crashed", 0, dead_pid(), 40 * MiB)
    assert device.free_bytes() == 64 * MiB and device.holders().holders == ()


def test_malformed_absurd_and_foreign_files_are_ignored(device):
    os.makedirs(device.directory)
    pid = os.getpid()
    bad = {
        f"a-rank0-{pid}.json": b"{not json",
        f"b-rank0-{pid}.json": b"[1, 2]",
        f"c-rank0-{pid}.json": json.dumps({"pid": pid, "resident_bytes": 65 * MiB}).encode(),  # > capacity
        f"d-rank0-{pid}.json": json.dumps({"pid": pid, "resident_bytes": -1}).encode(),
        f"e-rank0-{pid}.json": json.dumps({"pid": pid + 1, "resident_bytes": MiB}).encode(),  # not its pid
        f"f-rank0-{pid}.json": json.dumps({"pid": pid, "resident_bytes": "1"}).encode(),
        f"g-rank0-{pid}.json": b" " * (MAX_FILE_BYTES + 1),
        "notes.txt": b"hello",
    }
    for name, body in bad.items():
        with open(os.path.join(device.directory, name), "wb") as f:
            f.write(body)
    os.mkdir(os.path.join(device.directory, f"h-rank0-{pid}.json"))  # a directory by that name
    device.write("good", 0, pid, 2 * MiB)
    assert device.free_bytes() == 62 * MiB
    listing = device.holders()
    assert [h.label for h in listing.holders] == ["stage good rank 0"]
    assert listing.skipped == 8  # every bad file of our name shape is counted, the .txt is not ours


def test_at_most_the_cap_of_files_is_read(device, monkeypatch):
    import omni_core.workers.simulated_device as sim

    monkeypatch.setattr(sim, "MAX_FILES_READ", 5)
    for rank in range(8):
        device.write("s", rank, os.getpid(), MiB)
    holders, skipped = device.read()
    assert (len(holders), skipped) == (5, 3)
    assert MAX_FILES_READ == 1024


def test_configuration_is_checked_and_travels_in_the_worker_config(tmp_path):
    with pytest.raises(ValueError, match=r"capacity_bytes must be an integer in 1\.\.2\*\*60"):
        SimulatedDevice(str(tmp_path), 0)
    with pytest.raises(ValueError, match="directory must be a non-empty path"):
        SimulatedDevice("", MiB)
    config = WorkerConfig(address="ipc:///x", rank=0, simulated_device=SimulatedDevice(str(tmp_path), MiB))
    back = msgspec.json.decode(msgspec.json.encode(config), type=WorkerConfig)
    assert back.simulated_device == SimulatedDevice(str(tmp_path), MiB)
    with pytest.raises(msgspec.ValidationError, match="capacity_bytes"):
        msgspec.json.decode(
            b'{"address": "x", "rank": 0, "simulated_device": {"directory": "d", "capacity_bytes": -5}}',
            type=WorkerConfig,
        )


def test_a_claim_must_fit_beside_the_other_holders_and_writes_nothing_when_refused(tmp_path):
    device = SimulatedDevice(str(tmp_path / "gpu1"), 1000)
    mine, theirs = SimulatedResidency(device, "a", 0), SimulatedResidency(device, "b", 0, pid=os.getppid())
    mine.claim(600)
    with pytest.raises(SimulatedOutOfMemory, match=r"b rank 0 would hold 600 bytes beside 600 held by others"):
        theirs.claim(600)
    assert theirs.resident_bytes is None and device.used_bytes() == 600  # refused: no file written
    mine.claim(device.capacity_bytes)  # its own figure is replaced, not added to
    mine.claim(100)
    theirs.claim(device.capacity_bytes - 100)
    assert device.free_bytes() == 0 and os.listdir(device.directory) != []
    assert not any(name.startswith(".") for name in os.listdir(device.directory))  # no lock file left


def test_a_reading_never_mixes_figures_from_before_and_after_a_claim(device, monkeypatch):
    """While a reading is half done, one holder shrinks and another claims the room: the reading
    must not add the first holder's old figure to the second one's new figure (a used figure
    over the capacity that no moment of the device ever had)."""
    device.write("outgoing", 0, os.getppid(), 48 * MiB)
    device.write("incoming", 0, os.getpid(), 8 * MiB)
    parse = SimulatedDevice._parse
    handed_over = threading.Event()

    def hand_over() -> None:
        # The holder read first shrinks, then the other one claims what it left.
        first, second = order
        device.write(first[0], 0, first[1], 8 * MiB)
        device.claim(second[0], 0, second[1], 48 * MiB)
        handed_over.set()

    order: list[tuple[str, int]] = []

    def parse_then_hand_over(self, path, match):
        holder = parse(self, path, match)
        if not order:
            stage, pid = match["stage"], int(match["pid"])
            other = ("incoming", os.getpid()) if stage == "outgoing" else ("outgoing", os.getppid())
            order.extend([(stage, pid), other])
            worker = threading.Thread(target=hand_over, daemon=True)
            worker.start()
            handed_over.wait(2.0)  # an unlocked reading lets the hand-over finish here
        return holder

    monkeypatch.setattr(SimulatedDevice, "_parse", parse_then_hand_over)
    assert device.used_bytes() <= device.capacity_bytes
    monkeypatch.setattr(SimulatedDevice, "_parse", parse)
    assert handed_over.wait(30)  # the claim went through once the reading ended
    assert device.used_bytes() == 56 * MiB


def test_a_dead_process_file_and_a_dead_writer_temporary_are_reaped(device):
    dead = dead_pid()
    device.write("crashed", 0, dead, 40 * MiB)
    temporary = os.path.join(device.directory, f".{dead}-abc123.tmp")  # killed before its rename
    live_temporary = os.path.join(device.directory, f".{os.getpid()}-abc123.tmp")  # a write under way
    for path in (temporary, live_temporary):
        with open(path, "w") as f:
            f.write("{")
    SimulatedResidency(device, "alive", 0).report(MiB)
    assert device.free_bytes() == 63 * MiB
    assert sorted(os.listdir(device.directory)) == sorted(
        [f".{os.getpid()}-abc123.tmp", f"alive-rank0-{os.getpid()}.json"]
    )


def test_a_fifo_or_a_symlink_under_a_holder_name_is_skipped_without_blocking(device):
    os.makedirs(device.directory, mode=0o700)
    pid = os.getpid()
    os.mkfifo(os.path.join(device.directory, f"fifo-rank0-{pid}.json"))  # a plain open() would block forever
    target = os.path.join(device.directory, "elsewhere")
    with open(target, "w") as f:
        json.dump({"pid": pid, "resident_bytes": 60 * MiB}, f)
    os.symlink(target, os.path.join(device.directory, f"link-rank0-{pid}.json"))
    device.write("good", 0, pid, 2 * MiB)
    listing = device.holders()
    assert [h.label for h in listing.holders] == ["stage good rank 0"] and listing.skipped == 2
    assert device.free_bytes() == 62 * MiB


def test_the_directory_is_made_0700_and_its_files_0600(device):
    SimulatedResidency(device, "s", 0).report(MiB)
    assert os.stat(device.directory).st_mode & 0o777 == 0o700
    assert os.stat(device.path_of("s", 0, os.getpid())).st_mode & 0o777 == 0o600


@pytest.mark.parametrize("make", ["group_writable", "symlink", "file"])
def test_a_directory_others_could_write_to_or_a_stand_in_is_refused_naming_the_fix(tmp_path, make):
    from omni_core.workers.ledger_files import ENV_LEDGER_DIR, LedgerError

    path = tmp_path / "gpu0"
    if make == "group_writable":
        path.mkdir()
        path.chmod(0o770)
        expected = "writable by group or others .*chmod 700"
    elif make == "symlink":
        (tmp_path / "real").mkdir(mode=0o700)
        path.symlink_to(tmp_path / "real")
        expected = "is a symlink"
    else:
        path.write_text("")
        expected = "cannot use the device ledger directory|not a directory"
    device = SimulatedDevice(str(path), 64 * MiB)
    with pytest.raises(LedgerError, match=expected) as refused:
        SimulatedResidency(device, "s", 0).report(MiB)
    assert ENV_LEDGER_DIR in str(refused.value)
    with pytest.raises(LedgerError):
        device.free_bytes()  # nor is it read: what others planted there would be believed


@pytest.mark.skipif(os.geteuid() != 0, reason="handing a directory to another user needs root")
def test_a_directory_of_another_user_is_refused(tmp_path):
    from omni_core.workers.ledger_files import LedgerError

    path = tmp_path / "gpu0"
    path.mkdir(mode=0o700)
    os.chown(path, 12345, -1)  # planted by someone else, before this user's first rank
    with pytest.raises(LedgerError, match="belongs to uid 12345, not to this user"):
        SimulatedResidency(SimulatedDevice(str(path), 64 * MiB), "s", 0).report(MiB)
