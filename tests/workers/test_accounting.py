"""CUDA_VISIBLE_DEVICES parsing and device resolution against a fake NVML table, and the
available-memory arithmetic with fake numbers. No GPU, no NVML library needed."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from omni_core.workers.accounting import (
    CONTEXT_ESTIMATE_BYTES,
    NVML,
    DeviceResolutionError,
    OwnTally,
    ProcessMemory,
    VisibleDevice,
    available_memory_bytes,
    parse_cuda_visible_devices,
    resolve_physical_device,
)
from omni_core.workers.device_memory import CudaFreeMemory
from omni_core.workers.rank_memory import CACHE_HEADROOM_BYTES, cache_budget, check_budget

GiB = 1 << 30
GPU0 = "GPU-11111111-aaaa-bbbb-cccc-000000000000"
GPU1 = "GPU-22222222-aaaa-bbbb-cccc-000000000001"
GPU2 = "GPU-23333333-aaaa-bbbb-cccc-000000000002"  # shares the prefix "GPU-2" with GPU1
MIG_A = "MIG-aaaaaaaa-0000-1111-2222-333333333333"
MIG_B = "MIG-bbbbbbbb-0000-1111-2222-333333333333"


@dataclass
class FakeDevice:
    uuid: str
    total: int = 80 * GiB
    processes: dict[int, int] = field(default_factory=dict)
    migs: list[FakeDevice] = field(default_factory=list)
    mig_ids: tuple[int, int] = (0, 0)


class FakeNvml:
    """The NvmlApi surface over a table of fake devices (handles are the FakeDevice objects)."""

    def __init__(self, devices: list[FakeDevice]) -> None:
        self.devices = devices

    def device_count(self) -> int:
        return len(self.devices)

    def handle_by_index(self, index: int) -> FakeDevice:
        return self.devices[index]

    def uuid(self, handle: FakeDevice) -> str:
        return handle.uuid

    def mig_handles(self, handle: FakeDevice) -> list[FakeDevice]:
        return handle.migs

    def mig_ids(self, handle: FakeDevice) -> tuple[int, int]:
        return handle.mig_ids

    def total_bytes(self, handle: FakeDevice) -> int:
        return handle.total

    def process_bytes(self, handle: FakeDevice) -> dict[int, int]:
        return dict(handle.processes)


@pytest.fixture
def nvml() -> FakeNvml:
    mig_a = FakeDevice(MIG_A, total=40 * GiB, mig_ids=(1, 0), processes={4242: 3 * GiB})
    mig_b = FakeDevice(MIG_B, total=40 * GiB, mig_ids=(2, 0))
    return FakeNvml(
        [
            FakeDevice(GPU0, processes={4242: 5 * GiB, 999: 30 * GiB}),
            FakeDevice(GPU1, migs=[mig_a, mig_b]),
            FakeDevice(GPU2),
        ]
    )


# ---------------------------------------------------------------- parsing


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("0", [VisibleDevice("index", "0")]),
        ("0,1", [VisibleDevice("index", "0"), VisibleDevice("index", "1")]),
        (" 2 , 0 ", [VisibleDevice("index", "2"), VisibleDevice("index", "0")]),
        ("007", [VisibleDevice("index", "7")]),
        (GPU1, [VisibleDevice("gpu_uuid", GPU1)]),
        ("GPU-1111", [VisibleDevice("gpu_uuid", "GPU-1111")]),
        (f"{MIG_A},{GPU0}", [VisibleDevice("mig_uuid", MIG_A), VisibleDevice("gpu_uuid", GPU0)]),
        (f"MIG-{GPU1}/1/0", [VisibleDevice("mig_legacy", GPU1, 1, 0)]),
    ],
)
def test_parse_accepts_indices_uuids_and_mig(value, expected):
    assert parse_cuda_visible_devices(value) == expected


def test_parse_unset_means_all_devices():
    assert parse_cuda_visible_devices(None) is None


@pytest.mark.parametrize("value", ["", "  ", "-1"])
def test_parse_no_visible_device_is_a_clear_error(value):
    with pytest.raises(DeviceResolutionError, match="hides every GPU"):
        parse_cuda_visible_devices(value)


@pytest.mark.parametrize(
    "value", ["gpu0", "0,abc", "GPU-", "GPU-xyz", "MIG-", "1.5", "0,,1", "cuda:0", "MIG-GPU-1/a/0"]
)
def test_parse_garbage_names_the_bad_entry(value):
    with pytest.raises(DeviceResolutionError, match=r"entry .* is neither a device index") as info:
        parse_cuda_visible_devices(value)
    assert "nvidia-smi -L" in str(info.value)


def test_parse_duplicates_are_refused():
    with pytest.raises(DeviceResolutionError, match="twice"):
        parse_cuda_visible_devices("1,0,1")


# ---------------------------------------------------------------- resolution


def resolve(value, local_index, nvml):
    return resolve_physical_device(parse_cuda_visible_devices(value), local_index, nvml)


def test_resolve_index_maps_local_ordinal_to_the_listed_nvml_index(nvml):
    assert resolve("2,0", 0, nvml).uuid == GPU2
    assert resolve("2,0", 1, nvml).uuid == GPU0
    assert resolve(None, 1, nvml).uuid == GPU1


def test_resolve_gpu_uuid_exact_or_unique_prefix(nvml):
    assert resolve(GPU1, 0, nvml).uuid == GPU1
    assert resolve("GPU-1111", 0, nvml).uuid == GPU0
    assert resolve(GPU1.upper(), 0, nvml).uuid == GPU1  # hex digits in either case
    with pytest.raises(DeviceResolutionError, match="prefix of several devices"):
        resolve("GPU-2", 0, nvml)
    with pytest.raises(DeviceResolutionError, match="matches no device"):
        resolve("GPU-99999999", 0, nvml)


def test_resolve_mig_uuid_and_legacy_form(nvml):
    physical = resolve(MIG_B, 0, nvml)
    assert physical.uuid == MIG_B and physical.handle is nvml.devices[1].migs[1]
    assert resolve(f"MIG-{GPU1}/1/0", 0, nvml).uuid == MIG_A
    with pytest.raises(DeviceResolutionError, match="no MIG device with GPU instance 7"):
        resolve(f"MIG-{GPU1}/7/0", 0, nvml)
    with pytest.raises(DeviceResolutionError, match="MIG UUID"):
        resolve("MIG-cccccccc", 0, nvml)


def test_resolve_out_of_range(nvml):
    with pytest.raises(DeviceResolutionError, match="NVML sees only 3 GPU"):
        resolve("5", 0, nvml)
    with pytest.raises(DeviceResolutionError, match="lists 1 device"):
        resolve("0", 1, nvml)
    with pytest.raises(DeviceResolutionError, match="NVML sees 3 GPU"):
        resolve(None, 3, nvml)


# ---------------------------------------------------------------- measuring


def test_process_figure_counts_only_this_pid(nvml):
    memory = ProcessMemory("cuda:0", nvml=nvml, pid=4242, visible_devices="0")
    figure = memory.measure()
    assert figure.process_bytes == 5 * GiB and figure.source == NVML  # not pid 999's 30 GiB
    mig = ProcessMemory("cuda:0", nvml=nvml, pid=4242, visible_devices=MIG_A)
    assert mig.measure().process_bytes == 3 * GiB and mig.total_bytes() == 40 * GiB


def test_determine_available_memory_subtracts_only_our_use(nvml):
    memory = ProcessMemory("cuda:0", nvml=nvml, pid=4242, visible_devices=GPU0)
    available, figure = memory.determine_available_memory(0.5)
    assert available == 40 * GiB - 5 * GiB and figure.source == NVML
    # Another stage's 30 GiB on the same card does not shrink this one's share.
    assert memory.determine_available_memory(0.9)[0] == int(80 * GiB * 0.9) - 5 * GiB


def test_available_memory_arithmetic():
    assert available_memory_bytes(100, 0.5, 20) == 30
    assert available_memory_bytes(100, 1.0, 0) == 100
    assert available_memory_bytes(100, 0.1, 50) == 0  # never negative
    for bad in (0.0, -0.5, 1.5):
        with pytest.raises(ValueError, match="fraction"):
            available_memory_bytes(100, bad, 0)


class Reserved:
    """torch's reserved bytes, set by the test (what the rank's allocator holds)."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes

    def __call__(self) -> int:
        return self.nbytes


def container(nvml: FakeNvml, reserved: Reserved, **kwargs: object) -> ProcessMemory:
    """A rank in its own PID namespace: it is pid 1 to itself, NVML lists host pids only."""
    return ProcessMemory("cuda:0", nvml=nvml, pid=1, visible_devices="0", tally=OwnTally(reserved), **kwargs)


def test_in_a_pid_namespace_the_figure_is_never_device_wide(nvml, monkeypatch):
    import torch

    # The device-wide figure would be 50 GiB: a neighbour's 30 GiB and this rank's 20 GiB.
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (30 * GiB, 80 * GiB))
    nvml.devices[0].processes = {999: 30 * GiB}
    reserved = Reserved(0)
    memory = container(nvml, reserved)
    reserved.nbytes = 20 * GiB - CONTEXT_ESTIMATE_BYTES  # the model loaded; NVML still lists host pids
    nvml.devices[0].processes = {999: 30 * GiB, 777: 17 * GiB, 888: 17 * GiB}  # no unique match
    figure = memory.measure()
    assert figure.process_bytes == 20 * GiB and figure.source.startswith("own-tally")
    assert "does not list pid 1" in figure.source
    # The KV budget under gpu_memory_fraction=0.4 of 80 GiB: 32 - 20 GiB, less the headroom.
    budget = cache_budget(memory, 0.4)
    assert budget is not None and budget.available_bytes() == 12 * GiB - CACHE_HEADROOM_BYTES
    check_budget(memory, 0.4)  # 20 GiB of 32: the start goes on (device-wide it was refused)


def test_in_a_pid_namespace_the_entry_that_grew_with_the_rank_is_its_own(nvml):
    nvml.devices[0].processes = {999: 30 * GiB, 31337: 600 << 20}  # 31337: this rank's context
    reserved = Reserved(0)
    memory = container(nvml, reserved)
    reserved.nbytes = 8 * GiB
    nvml.devices[0].processes = {999: 30 * GiB, 31337: 8 * GiB + (620 << 20)}
    figure = memory.measure()
    assert figure.process_bytes == 8 * GiB + (620 << 20)
    assert figure.source.startswith("nvml: this process's entry is pid 31337")
    assert memory.context_bytes == 620 << 20  # measured, no longer the estimate
    holders = CudaFreeMemory(memory).holders()
    assert {h.pid: h.label for h in holders.holders} == {999: "", 31337: "this rank"}


def test_a_neighbour_growing_alike_is_not_taken_for_the_rank(nvml):
    nvml.devices[0].processes = {999: 30 * GiB, 31337: 600 << 20}
    reserved = Reserved(0)
    memory = container(nvml, reserved)
    reserved.nbytes = 8 * GiB
    nvml.devices[0].processes = {999: 38 * GiB, 31337: 8 * GiB + (600 << 20)}  # both grew 8 GiB
    figure = memory.measure()
    assert figure.source.startswith("own-tally") and memory.own_entry is None


def test_the_tally_leaves_out_what_the_backend_unmapped(nvml):
    reserved = Reserved(10 * GiB)
    memory = container(nvml, reserved)
    memory.set_unmapped_reserved(lambda: 9 * GiB)  # a cumem pool asleep keeps its addresses
    assert memory.measure().process_bytes == 1 * GiB + CONTEXT_ESTIMATE_BYTES


def test_nvml_missing_falls_back_and_says_why(monkeypatch):
    import torch

    import omni_core.workers.accounting as accounting

    def broken():
        raise OSError("libnvidia-ml.so.1: cannot open shared object file")

    monkeypatch.setattr(accounting, "PynvmlApi", broken)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (70 * GiB, 80 * GiB))
    memory = ProcessMemory("cuda:0", visible_devices="0", tally=OwnTally(Reserved(9 * GiB)))
    figure = memory.measure()
    assert figure.process_bytes == 9 * GiB + CONTEXT_ESTIMATE_BYTES  # never the device-wide 10 GiB
    assert "NVML unavailable: OSError: libnvidia-ml" in figure.source


def test_bad_visible_devices_fails_at_start_not_later(nvml):
    with pytest.raises(DeviceResolutionError, match="'bogus'"):
        ProcessMemory("cuda:0", nvml=nvml, visible_devices="bogus")


def test_cpu_has_no_figure():
    figure = ProcessMemory("cpu").measure()
    assert figure.process_bytes is None and figure.source == "none: no CUDA (device cpu)"
