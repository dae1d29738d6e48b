"""Turning Python objects into (pointer, bytes, is_cuda, keepalive) without copying.

Accepted: torch tensors (CPU and CUDA), anything with ``__cuda_array_interface__`` (CuPy,
Numba...), DLPack producers (through torch), anything with ``__array_interface__`` (numpy),
and any object exporting the buffer protocol (bytearray, memoryview, array.array, mmap,
bytes for sending). Every one must be C-contiguous. The keepalive object holds the memory
(and, for buffers, the buffer export, so a bytearray cannot be resized under a transfer).
"""

from __future__ import annotations

import ctypes
from typing import Any, NamedTuple

from ._errors import BadArgument


class BufferInfo(NamedTuple):
    ptr: int
    nbytes: int
    cuda: bool
    keep: Any
    readonly: bool


def _c_contiguous(shape, strides, itemsize) -> bool:
    if strides is None:
        return True
    expected = itemsize
    for dim, stride in zip(reversed(shape), reversed(strides)):
        if dim != 1 and stride != expected:
            return False
        expected *= dim
    return True


def _prod(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _from_torch(t) -> BufferInfo:
    if not t.is_contiguous():
        raise BadArgument("tensor is not contiguous: call .contiguous() first")
    nbytes = t.numel() * t.element_size()
    return BufferInfo(t.data_ptr(), nbytes, t.device.type == "cuda", t, False)


def _itemsize(typestr: str) -> int:
    return int(typestr[2:])


def describe(obj: Any, writable: bool) -> BufferInfo:
    """(ptr, nbytes, cuda, keepalive, readonly) of ``obj``; raises BadArgument otherwise."""
    mod = type(obj).__module__
    if mod.startswith("torch") and hasattr(obj, "data_ptr"):
        return _from_torch(obj)
    cai = getattr(obj, "__cuda_array_interface__", None)
    if cai is not None:
        shape = tuple(cai["shape"])
        size = _itemsize(cai["typestr"])
        if not _c_contiguous(shape, cai.get("strides"), size):
            raise BadArgument("CUDA array is not C-contiguous")
        ptr, readonly = cai["data"]
        if writable and readonly:
            raise BadArgument("CUDA array is read-only: cannot receive into it")
        return BufferInfo(int(ptr or 0), _prod(shape) * size, True, obj, bool(readonly))
    ai = getattr(obj, "__array_interface__", None)
    if ai is not None:
        shape = tuple(ai["shape"])
        size = _itemsize(ai["typestr"])
        if not _c_contiguous(shape, ai.get("strides"), size):
            raise BadArgument("array is not C-contiguous: use numpy.ascontiguousarray first")
        ptr, readonly = ai["data"]
        if writable and readonly:
            raise BadArgument("array is read-only: cannot receive into it")
        return BufferInfo(int(ptr or 0), _prod(shape) * size, False, obj, bool(readonly))
    if hasattr(obj, "__dlpack__"):
        try:
            import torch.utils.dlpack as dl  # type: ignore[import-not-found]
        except ImportError:
            raise BadArgument("DLPack objects are taken through torch; install torch") from None
        return _from_torch(dl.from_dlpack(obj))
    try:
        view = memoryview(obj)
    except TypeError:
        raise BadArgument(
            f"{type(obj).__name__} is not an array, tensor or buffer (expected a numpy array, "
            "a torch tensor, an object with __cuda_array_interface__ or the buffer protocol)"
        ) from None
    if not view.c_contiguous:
        raise BadArgument("buffer is not C-contiguous")
    nbytes = view.nbytes
    if nbytes == 0:
        raise BadArgument("buffer is empty")
    if not view.readonly:
        # A ctypes view on the buffer: its address, and an export that pins the buffer.
        holder = (ctypes.c_char * nbytes).from_buffer(view.cast("B"))
        return BufferInfo(ctypes.addressof(holder), nbytes, False, (obj, view, holder), False)
    if writable:
        raise BadArgument("buffer is read-only: cannot receive into it")
    try:
        import numpy as np  # type: ignore[import-not-found]
    except ImportError:
        raise BadArgument("read-only buffers (bytes) need numpy installed, or pass a bytearray") from None
    arr = np.frombuffer(view, dtype=np.uint8)
    return BufferInfo(int(arr.ctypes.data), nbytes, False, (obj, view, arr), True)
