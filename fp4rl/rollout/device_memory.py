"""Device memory whose addresses outlive it: a range of virtual addresses reserved once, with
physical memory mapped in and given back at will (the CUDA driver's virtual memory management,
`cuMemAddressReserve` / `cuMemCreate` / `cuMemMap`, reached through ctypes).

The engine keeps its KV pages here (`fp4rl.rollout.kv_cache.KVCache`), so that
`Engine.release_kv` can give the pages' memory back to a colocated trainer while the CUDA graphs
captured over them stay valid: `acquire_kv` maps fresh memory at the same addresses, and the
graphs replay as before instead of being captured again (BENCHMARKS.md, "Graphs kept across a
release of the KV pages").

A tensor viewing this memory does not own it and must not be touched while it is unmapped:
the engine refuses to generate then, as it did when it dropped its pages.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools

import torch

_SUCCESS = 0
_ALLOCATION_PINNED = 1  # CU_MEM_ALLOCATION_TYPE_PINNED
_LOCATION_DEVICE = 1  # CU_MEM_LOCATION_TYPE_DEVICE
_ACCESS_READ_WRITE = 3  # CU_MEM_ACCESS_FLAGS_PROT_READWRITE
_GRANULARITY_RECOMMENDED = 1  # CU_MEM_ALLOC_GRANULARITY_RECOMMENDED
_ATTRIBUTE_VMM_SUPPORTED = 102  # CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED


class _Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _AllocFlags(ctypes.Structure):
    _fields_ = [
        ("compressionType", ctypes.c_ubyte),
        ("gpuDirectRDMACapable", ctypes.c_ubyte),
        ("usage", ctypes.c_ushort),
        ("reserved", ctypes.c_ubyte * 4),
    ]


class _AllocationProp(ctypes.Structure):
    _fields_ = [
        ("type", ctypes.c_int),
        ("requestedHandleTypes", ctypes.c_int),
        ("location", _Location),
        ("win32HandleMetaData", ctypes.c_void_p),
        ("allocFlags", _AllocFlags),
    ]


class _AccessDesc(ctypes.Structure):
    _fields_ = [("location", _Location), ("flags", ctypes.c_int)]


class DriverError(RuntimeError):
    """A CUDA driver call failed; the message names the call, its arguments and the error."""


@functools.cache
def _driver() -> ctypes.CDLL:
    return ctypes.CDLL("libcuda.so.1")


def _call(name: str, *args, what: str = "") -> None:
    lib = _driver()
    status = getattr(lib, name)(*args)
    if status != _SUCCESS:
        text = ctypes.c_char_p()
        lib.cuGetErrorString(status, ctypes.byref(text))
        reason = text.value.decode() if text.value else f"CUresult {status}"
        raise DriverError(f"{name}({what}) failed: {reason}")


def unsupported(device: torch.device) -> str | None:
    """Why `ReservedMemory` cannot serve ``device``, or None when it can."""
    device = torch.device(device)
    if device.type != "cuda":
        return f"{device} is not a CUDA device"
    index = torch.cuda.current_device() if device.index is None else device.index
    return _unsupported_on(index)


@functools.cache
def _unsupported_on(index: int) -> str | None:
    try:
        _driver().cuMemAddressReserve  # noqa: B018 - the symbol's presence is the question
    except (OSError, AttributeError) as err:
        return f"the CUDA driver's virtual memory calls are not available ({err})"
    torch.cuda.init()  # the driver initialized, as its calls below need
    ordinal, supported = ctypes.c_int(), ctypes.c_int()
    _call("cuDeviceGet", ctypes.byref(ordinal), ctypes.c_int(index), what=f"cuda:{index}")
    _call("cuDeviceGetAttribute", ctypes.byref(supported), _ATTRIBUTE_VMM_SUPPORTED, ordinal,
          what=f"cuda:{index}, virtual memory management supported")  # fmt: skip
    if not supported.value:
        return f"cuda:{index} does not support the driver's virtual memory management"
    return None


def _on_its_device(method):
    """Run a `ReservedMemory` method with its device current: the driver's calls act in the
    current context."""

    @functools.wraps(method)
    def run(self, *args, **kwargs):
        with torch.cuda.device(self.device):
            return method(self, *args, **kwargs)

    return run


class ReservedMemory:
    """``nbytes`` of device memory (rounded up to the driver's granularity) at addresses fixed
    for this object's life. `unmap` gives the physical memory back and `map` takes fresh
    memory at the same addresses; `view` hands out byte tensors over it. Mapped and zeroed on
    creation."""

    def __init__(self, nbytes: int, device: torch.device | str) -> None:
        device = torch.device(device)
        why = unsupported(device)
        if why is not None:
            raise ValueError(f"reserved device memory: {why}")
        index = torch.cuda.current_device() if device.index is None else device.index
        self.device = torch.device("cuda", index)
        self._reserve(nbytes)
        self._handle: ctypes.c_uint64 | None = None
        self.map()

    @_on_its_device
    def _reserve(self, nbytes: int) -> None:
        torch.zeros(1, device=self.device)  # the device's primary context exists
        location = _Location(_LOCATION_DEVICE, self.device.index)
        self._prop = _AllocationProp(_ALLOCATION_PINNED, 0, location)
        self._access = _AccessDesc(location, _ACCESS_READ_WRITE)
        granularity = ctypes.c_size_t()
        _call(
            "cuMemGetAllocationGranularity",
            ctypes.byref(granularity),
            ctypes.byref(self._prop),
            _GRANULARITY_RECOMMENDED,
            what=str(self.device),
        )
        step = granularity.value
        self.nbytes = -(-max(nbytes, 1) // step) * step
        base = ctypes.c_uint64()
        _call(
            "cuMemAddressReserve",
            ctypes.byref(base),
            ctypes.c_size_t(self.nbytes),
            ctypes.c_size_t(step),
            ctypes.c_uint64(0),
            ctypes.c_uint64(0),
            what=f"{self.nbytes} bytes",
        )
        self.base = base.value

    @property
    def mapped(self) -> bool:
        return self._handle is not None

    @_on_its_device
    def map(self) -> None:
        """Back the addresses with fresh physical memory, zeroed; a no-op when mapped."""
        if self.mapped:
            return
        handle, size = ctypes.c_uint64(), ctypes.c_size_t(self.nbytes)
        args = ("cuMemCreate", ctypes.byref(handle), size, ctypes.byref(self._prop))
        what = f"{self.nbytes} bytes on {self.device}"
        try:
            _call(*args, ctypes.c_uint64(0), what=what)
        except DriverError:
            # torch's caching allocator may hold the memory a trainer freed: give it back to
            # the driver and ask once more, as torch does before it reports running out.
            torch.cuda.empty_cache()
            _call(*args, ctypes.c_uint64(0), what=what)
        try:
            _call(
                "cuMemMap",
                ctypes.c_uint64(self.base),
                size,
                ctypes.c_size_t(0),
                handle,
                ctypes.c_uint64(0),
                what=f"{self.nbytes} bytes at {self.base:#x}",
            )
            try:
                _call(
                    "cuMemSetAccess",
                    ctypes.c_uint64(self.base),
                    size,
                    ctypes.byref(self._access),
                    ctypes.c_size_t(1),
                    what=f"{self.nbytes} bytes at {self.base:#x}",
                )
            except DriverError:
                _call("cuMemUnmap", ctypes.c_uint64(self.base), size)
                raise
        except DriverError:
            _call("cuMemRelease", handle)
            raise
        self._handle = handle
        self.view(0, self.nbytes).zero_()

    @_on_its_device
    def unmap(self) -> None:
        """Give the physical memory back, once the device is done with it; the addresses stay
        reserved. A no-op when unmapped."""
        if not self.mapped:
            return
        torch.cuda.synchronize(self.device)  # no queued kernel still reads the pages
        _call(
            "cuMemUnmap",
            ctypes.c_uint64(self.base),
            ctypes.c_size_t(self.nbytes),
            what=f"{self.nbytes} bytes at {self.base:#x}",
        )
        handle, self._handle = self._handle, None
        _call("cuMemRelease", handle)

    def view(self, offset: int, nbytes: int) -> torch.Tensor:
        """A uint8 tensor over ``nbytes`` from ``offset``; it does not own the memory."""
        if not self.mapped:
            raise RuntimeError("reserved device memory: viewed while unmapped")
        if offset < 0 or nbytes < 0 or offset + nbytes > self.nbytes:
            raise ValueError(
                f"reserved device memory: bytes {offset}..{offset + nbytes} outside "
                f"0..{self.nbytes}"
            )
        return torch.as_tensor(_Interface(self.base + offset, nbytes), device=self.device)

    @_on_its_device
    def close(self) -> None:
        """Unmap, then free the addresses; the object is unusable after."""
        if self.base is None:
            return
        self.unmap()
        _call("cuMemAddressFree", ctypes.c_uint64(self.base), ctypes.c_size_t(self.nbytes))
        self.base = None

    def __del__(self) -> None:
        if getattr(self, "base", None) is not None:
            with contextlib.suppress(Exception):  # at interpreter exit the driver may be gone
                self.close()


class _Interface:
    """A CUDA array interface over raw bytes, for `torch.as_tensor`."""

    def __init__(self, address: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (address, False),
            "version": 3,
            "stream": None,
        }
