"""The CUDA driver's virtual-memory calls, made directly (ctypes on libcuda).

vLLM's CuMemAllocator maps and unmaps through its C extension (`python_create_and_map`,
`python_unmap_and_release`). The same three driver calls made from here wake 16 GiB of
realistic weights at 51.6 GB/s on an H200 where the extension reaches 46.4-47.7 GB/s, with
everything else equal (benchmarks/results/wake_gpu.md): so the `fast` path maps with these. The
allocation handle is vLLM's: (device, size, d_mem, p_memHandle), where p_memHandle points at
the cell that holds the physical handle, so either side can release what the other created.
"""

from __future__ import annotations

import ctypes
import threading
from typing import Any

_CU_MEM_ALLOCATION_TYPE_PINNED = 1
_CU_MEM_LOCATION_TYPE_DEVICE = 1
_CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 3
_ADDRESS_ALIGNMENT_BYTES = 2 << 20


class _Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _AllocFlags(ctypes.Structure):
    _fields_ = [
        ("compressionType", ctypes.c_ubyte),
        ("gpuDirectRDMACapable", ctypes.c_ubyte),
        ("usage", ctypes.c_ushort),
        ("reserved", ctypes.c_ubyte * 4),
    ]


class _AllocProp(ctypes.Structure):  # CUmemAllocationProp
    _fields_ = [
        ("type", ctypes.c_int),
        ("requestedHandleTypes", ctypes.c_int),
        ("location", _Location),
        ("win32HandleMetaData", ctypes.c_void_p),
        ("allocFlags", _AllocFlags),
    ]


class _AccessDesc(ctypes.Structure):  # CUmemAccessDesc
    _fields_ = [("location", _Location), ("flags", ctypes.c_int)]


class CudaDriverError(RuntimeError):
    """A driver call failed; the message names the call, the bytes and the driver's error
    (CUDA_ERROR_OUT_OF_MEMORY included, which the memory gate recognises)."""


class CudaDriver:
    """cuMemCreate + cuMemMap + cuMemSetAccess, and cuMemUnmap + cuMemRelease, as vLLM's
    extension makes them (pinned device memory, no compression, read-write access)."""

    _lock = threading.Lock()
    _loaded: Any = None

    def __init__(self) -> None:
        self.cu = self._library()
        self._props: dict[int, tuple[_AllocProp, _AccessDesc]] = {}

    @classmethod
    def _library(cls) -> Any:
        with cls._lock:
            if cls._loaded is None:
                cu = ctypes.CDLL("libcuda.so.1")
                u64, sz, vp = ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p
                cu.cuMemCreate.argtypes = [ctypes.POINTER(u64), sz, ctypes.POINTER(_AllocProp), u64]
                cu.cuMemMap.argtypes = [u64, sz, sz, u64, u64]
                cu.cuMemSetAccess.argtypes = [u64, sz, ctypes.POINTER(_AccessDesc), sz]
                cu.cuMemUnmap.argtypes = [u64, sz]
                cu.cuMemRelease.argtypes = [u64]
                cu.cuMemAddressReserve.argtypes = [ctypes.POINTER(u64), sz, sz, u64, u64]
                cu.cuMemAddressFree.argtypes = [u64, sz]
                cu.cuMemRetainAllocationHandle.argtypes = [ctypes.POINTER(u64), u64]
                cu.cuCtxGetCurrent.argtypes = [ctypes.POINTER(vp)]
                cu.cuDevicePrimaryCtxRetain.argtypes = [ctypes.POINTER(vp), ctypes.c_int]
                cu.cuCtxSetCurrent.argtypes = [vp]
                cu.cuGetErrorName.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
                cu.cuGetErrorString.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
                cls._loaded = cu
            return cls._loaded

    # ------------------------------------------------------------------ primitives

    def check(self, rc: int, what: str) -> None:
        if rc != 0:
            name, text = ctypes.c_char_p(), ctypes.c_char_p()
            self.cu.cuGetErrorName(rc, ctypes.byref(name))
            self.cu.cuGetErrorString(rc, ctypes.byref(text))
            raise CudaDriverError(f"{what} failed: {(name.value or b'?').decode()} ({(text.value or b'?').decode()})")

    def ensure_context(self, device: int) -> None:
        """The device's primary context current on this thread (a thread torch never used has none)."""
        ctx = ctypes.c_void_p()
        self.check(self.cu.cuCtxGetCurrent(ctypes.byref(ctx)), "cuCtxGetCurrent")
        if not ctx.value:
            self.check(self.cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), device), "cuDevicePrimaryCtxRetain")
            self.check(self.cu.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")

    def _prop(self, device: int) -> tuple[_AllocProp, _AccessDesc]:
        if device not in self._props:
            where = _Location(_CU_MEM_LOCATION_TYPE_DEVICE, device)
            self._props[device] = (
                _AllocProp(type=_CU_MEM_ALLOCATION_TYPE_PINNED, location=where),
                _AccessDesc(location=where, flags=_CU_MEM_ACCESS_FLAGS_PROT_READWRITE),
            )
        return self._props[device]

    def reserve(self, nbytes: int) -> int:
        """A virtual address range of `nbytes` (no memory behind it yet)."""
        ptr = ctypes.c_uint64()
        self.check(
            self.cu.cuMemAddressReserve(ctypes.byref(ptr), nbytes, _ADDRESS_ALIGNMENT_BYTES, 0, 0),
            f"cuMemAddressReserve of {nbytes} bytes",
        )
        return ptr.value

    def free_range(self, ptr: int, nbytes: int) -> None:
        self.check(self.cu.cuMemAddressFree(ptr, nbytes), "cuMemAddressFree")

    def map_into(self, device: int, nbytes: int, ptr: int, cell: ctypes.c_uint64) -> None:
        """Create `nbytes` of device memory, map it at `ptr`, give the device access; the
        physical handle goes into `cell`. Nothing stays allocated when a step fails."""
        prop, access = self._prop(device)
        self.check(
            self.cu.cuMemCreate(ctypes.byref(cell), nbytes, ctypes.byref(prop), 0), f"cuMemCreate of {nbytes} bytes"
        )
        mapped = False
        try:
            self.check(self.cu.cuMemMap(ptr, nbytes, 0, cell.value, 0), f"cuMemMap of {nbytes} bytes")
            mapped = True
            self.check(self.cu.cuMemSetAccess(ptr, nbytes, ctypes.byref(access), 1), "cuMemSetAccess")
        except CudaDriverError:
            if mapped:
                self.cu.cuMemUnmap(ptr, nbytes)
            self.cu.cuMemRelease(cell.value)
            raise

    def unmap_from(self, nbytes: int, ptr: int, handle: int) -> None:
        self.check(self.cu.cuMemUnmap(ptr, nbytes), f"cuMemUnmap of {nbytes} bytes")
        self.check(self.cu.cuMemRelease(handle), "cuMemRelease")

    # ------------------------------------------------------------------ vLLM's handles

    def create_and_map(self, device: int, size: int, d_mem: int, p_handle: int) -> None:
        """vLLM's `python_create_and_map(device, size, d_mem, p_memHandle)`."""
        self.ensure_context(device)
        self.map_into(device, size, d_mem, ctypes.c_uint64.from_address(p_handle))

    def unmap_and_release(self, device: int, size: int, d_mem: int, p_handle: int) -> None:
        """vLLM's `python_unmap_and_release(device, size, d_mem, p_memHandle)`."""
        self.ensure_context(device)
        self.unmap_from(size, d_mem, ctypes.c_uint64.from_address(p_handle).value)
