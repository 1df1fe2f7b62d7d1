"""Arrays in and out: numpy / torch <-> safetensors bodies, without importing torch.

Why this module exists: the client must run where torch is not installed, yet hand torch users
torch tensors back. The rule is simple: a torch tensor can only reach us if the caller already
imported torch, so `sys.modules["torch"]` is where we look, and torch is never imported here.
Results come back in the caller's kind (torch in -> torch out on the input's device, numpy in ->
numpy out).

Bodies are encoded here rather than with `safetensors.numpy.save` for three reasons: numpy's
safetensors helpers do not know bfloat16 (ml_dtypes), bf16 torch tensors must travel as their raw
2-byte values (never through float32), and a multi-GB weight upload must stream from the array's
own memory in chunks instead of being copied into one bytes object. Decoding, where the bytes are
untrusted, goes through the reference parser (`safetensors.deserialize`) and is then checked again
against each tensor's dtype and shape.
"""

from __future__ import annotations

import json
import math
import os
import struct
import sys
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import ml_dtypes
import numpy as np
import safetensors

__all__ = [
    "ArrayKind",
    "BytesPayload",
    "FileTensorPayload",
    "Payload",
    "SafetensorsPayload",
    "as_data_array",
    "as_index_array",
    "decode_safetensors",
    "dtype_name",
    "encode_safetensors",
    "from_wire_dtype",
    "is_torch_tensor",
    "read_safetensors_header",
    "wire_dtype",
]

BFLOAT16 = np.dtype(ml_dtypes.bfloat16)
FLOAT8_E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
FLOAT8_E5M2 = np.dtype(ml_dtypes.float8_e5m2)

# numpy dtype <-> safetensors dtype string. Data travels as F32/F16/BF16; counts/offs as I32
# (I64 is accepted by the server and converted); FP8 only in weight uploads (_fp8.py).
_WIRE_FROM_NP: dict[np.dtype[Any], str] = {
    np.dtype(np.float32): "F32",
    np.dtype(np.float16): "F16",
    BFLOAT16: "BF16",
    FLOAT8_E4M3: "F8_E4M3",
    FLOAT8_E5M2: "F8_E5M2",
    np.dtype(np.int32): "I32",
    np.dtype(np.int64): "I64",
    np.dtype(np.float64): "F64",
}
_NP_FROM_WIRE: dict[str, np.dtype[Any]] = {v: k for k, v in _WIRE_FROM_NP.items()}

DATA_DTYPES: tuple[np.dtype[Any], ...] = (np.dtype(np.float32), np.dtype(np.float16), BFLOAT16)
_DATA_DTYPE_TEXT = "float32, float16 or bfloat16 (numpy: ml_dtypes.bfloat16)"

# Names used in WeightInfo.dtype and the JSON form of the API (the server's torch names).
_NAME_FROM_NP: dict[np.dtype[Any], str] = {
    np.dtype(np.float32): "float32",
    np.dtype(np.float16): "float16",
    BFLOAT16: "bfloat16",
    FLOAT8_E4M3: "float8_e4m3fn",
    FLOAT8_E5M2: "float8_e5m2",
}

# safetensors' own limit on the JSON header; a larger length field is a lie or an attack.
MAX_HEADER_BYTES = 100_000_000


def wire_dtype(dtype: np.dtype[Any]) -> str:
    """The safetensors dtype string ("F32", "BF16", ...) of a numpy dtype."""
    try:
        return _WIRE_FROM_NP[np.dtype(dtype)]
    except KeyError:
        raise TypeError(f"dtype {dtype} cannot travel in a safetensors body") from None


def from_wire_dtype(name: str) -> np.dtype[Any]:
    """The numpy dtype of a safetensors dtype string; ValueError for ones the API never uses."""
    try:
        return _NP_FROM_WIRE[name]
    except KeyError:
        raise ValueError(f"unsupported safetensors dtype {name!r}") from None


def dtype_name(dtype: np.dtype[Any]) -> str:
    """"float32" | "float16" | "bfloat16" (or an FP8 name) for a data dtype (the names of the
    JSON API)."""
    return _NAME_FROM_NP[np.dtype(dtype)]


def dtype_from_name(name: str) -> np.dtype[Any]:
    """numpy dtype for "float32" | "float16" | "bfloat16"."""
    for dt, nm in _NAME_FROM_NP.items():
        if nm == name:
            return dt
    raise ValueError(f"unknown dtype name {name!r}; expected float32, float16 or bfloat16")


# --------------------------------------------------------------------------------------------
# torch without importing torch


def _torch() -> Any:
    return sys.modules.get("torch")


def is_torch_tensor(obj: object) -> bool:
    """True when obj is a torch.Tensor. Never imports torch: if torch is not already imported,
    obj cannot be one of its tensors."""
    torch = _torch()
    return torch is not None and isinstance(obj, torch.Tensor)


@dataclass(frozen=True)
class ArrayKind:
    """Where an input came from, so that results can be handed back in the same kind.

    Attributes:
        torch: True for torch tensors, False for numpy arrays.
        device: The torch device of the input (None for numpy).
    """

    torch: bool = False
    device: Any = None

    def wrap(self, arr: np.ndarray) -> Any:
        """Turn a (writable, C-contiguous) numpy result into this kind, without copying on CPU."""
        if not self.torch:
            return arr
        torch = _torch()
        if arr.dtype == BFLOAT16:
            # torch cannot read ml_dtypes; reinterpret the same 2-byte values.
            t = torch.from_numpy(arr.view(np.int16)).view(torch.bfloat16)
        else:
            t = torch.from_numpy(arr)
        if self.device is not None and torch.device(self.device).type != "cpu":
            t = t.to(self.device)
        return t


NUMPY = ArrayKind()


def _shape_text(shape: Sequence[int]) -> str:
    return "(" + ", ".join(str(int(s)) for s in shape) + ("," if len(shape) == 1 else "") + ")"


def _dense_cpu(t: Any, name: str) -> Any:
    """`t` detached, on the CPU, with its values materialized (TypeError / ValueError for a
    tensor that has none to send: torch's own errors there are NotImplementedError and
    RuntimeError, deep inside .cpu() / .contiguous() / .numpy())."""
    torch = _torch()
    t = t.detach()
    if t.is_nested:
        raise TypeError(f"{name} must be a dense tensor; got a nested tensor (pad it, or send "
                        "its parts one by one)")
    if t.layout != torch.strided:
        raise TypeError(f"{name} must be a dense tensor; got layout {t.layout} (convert with "
                        ".to_dense())")
    if t.device.type == "meta":
        raise ValueError(f"{name} is a meta tensor: it has no values to send")
    if t.device.type != "cpu":
        t = t.cpu()
    # A negated view (torch's lazy negation bit) has no numpy form until it is applied.
    return t.resolve_neg()


def _torch_to_numpy(t: Any, name: str, note: str = "") -> tuple[np.ndarray, ArrayKind]:
    torch = _torch()
    kind = ArrayKind(torch=True, device=t.device)
    t = _dense_cpu(t, name).contiguous()
    if t.dtype == torch.bfloat16:
        # Raw bits: view as int16 (same itemsize), then as ml_dtypes.bfloat16. No float32 trip.
        return t.view(torch.int16).numpy().view(BFLOAT16), kind
    if t.dtype in (torch.float32, torch.float16, torch.int32, torch.int64):
        return t.numpy(), kind
    raise TypeError(
        f"{name} must be torch.float32, torch.float16 or torch.bfloat16{note}; got {t.dtype}"
    )


def _little_endian_c(arr: np.ndarray) -> np.ndarray:
    order = arr.dtype.byteorder
    big = order == ">" or (order == "=" and sys.byteorder == "big")
    if big and arr.dtype.itemsize > 1:  # (1-byte dtypes, FP8 included, have no byte order)
        arr = arr.astype(arr.dtype.newbyteorder("<"))
    # (np.ascontiguousarray turns a 0-d array, e.g. a per-tensor FP8 scale, into 1-d)
    return np.ascontiguousarray(arr).reshape(arr.shape)


def as_data_array(obj: object, name: str, shape_hint: str, ndim: int,
                  note: str = "") -> tuple[np.ndarray, ArrayKind]:
    """Check a float operand and return it as a little-endian C-contiguous numpy array.

    Args:
        obj: A numpy array (float32, float16, ml_dtypes.bfloat16) or a torch tensor
            (float32, float16, bfloat16) on any device.
        name: The argument's name, for error messages.
        shape_hint: The expected shape in words, e.g. "(T, K)".
        ndim: The expected number of dimensions.
        note: Added to a dtype error after the accepted dtypes (weights: "or FP8 ...").

    Returns:
        The array (a view when possible) and the kind to hand results back in.

    Raises:
        TypeError: obj is not an array/tensor, or has another dtype.
        ValueError: obj does not have `ndim` dimensions.
    """
    if is_torch_tensor(obj):
        arr, kind = _torch_to_numpy(obj, name, note)
    elif isinstance(obj, np.ndarray):
        arr, kind = obj, NUMPY
    else:
        raise TypeError(
            f"{name} must be a numpy array or torch tensor {shape_hint}; got {type(obj).__name__}"
        )
    if arr.ndim != ndim:
        raise ValueError(f"{name} must be {ndim}-D {shape_hint}; got shape {_shape_text(arr.shape)}")
    dt = arr.dtype.newbyteorder("=") if arr.dtype.byteorder in "<>" else arr.dtype
    if dt not in DATA_DTYPES:
        extra = " (convert with .astype(np.float32))" if dt == np.float64 else ""
        raise TypeError(f"{name} must be {_DATA_DTYPE_TEXT}{note}; got {arr.dtype}{extra}")
    return _little_endian_c(arr), kind


def as_index_array(obj: object, name: str, shape_hint: str) -> np.ndarray:
    """Check counts/offs and return them as a 1-D int32 numpy array.

    Args:
        obj: A 1-D integer numpy array, torch tensor, or a list/tuple of ints.
        name: The argument's name, for error messages.
        shape_hint: The expected shape in words, e.g. "(E,)".

    Raises:
        TypeError: obj is not integer-valued.
        ValueError: obj is not 1-D, or a value does not fit in int32.
    """
    if is_torch_tensor(obj):
        torch = _torch()
        t = obj.detach()  # type: ignore[attr-defined]
        # (every integer dtype, as for a numpy array: torch's uint16/32/64 were refused)
        if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
            raise TypeError(f"{name} must be an integer tensor {shape_hint}; got {t.dtype}")
        arr = _dense_cpu(t, name).numpy()
    elif isinstance(obj, np.ndarray):
        arr = obj
    elif isinstance(obj, (list, tuple)):
        if not all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in obj):
            raise TypeError(f"{name} must be a sequence of ints {shape_hint}; got {obj!r:.80}")
        # Range first, on Python ints: numpy raises OverflowError for a value beyond int64.
        values = [int(v) for v in obj]
        if values and (min(values) < -(2**31) or max(values) >= 2**31):
            raise ValueError(f"{name} has values outside int32; got min {min(values)}, "
                             f"max {max(values)}")
        arr = np.asarray(values, dtype=np.int64).reshape(len(values))
    else:
        raise TypeError(
            f"{name} must be a 1-D integer numpy array, torch tensor or list of ints "
            f"{shape_hint}; got {type(obj).__name__}"
        )
    if arr.dtype.kind not in "iu":
        raise TypeError(f"{name} must be integers {shape_hint} (int32 or int64); got {arr.dtype}")
    if arr.ndim != 1:
        raise ValueError(f"{name} must be 1-D {shape_hint}; got shape {_shape_text(arr.shape)}")
    if arr.size and (int(arr.min()) < -(2**31) or int(arr.max()) >= 2**31):
        raise ValueError(f"{name} has values outside int32; got min {arr.min()}, max {arr.max()}")
    return np.ascontiguousarray(arr, dtype="<i4")


# --------------------------------------------------------------------------------------------
# Payloads: what goes into a request body


class Payload:
    """A request body of known length that can be produced again for every retry."""

    content_type: str = "application/octet-stream"

    @property
    def nbytes(self) -> int:
        raise NotImplementedError

    def iter_chunks(self, chunk_bytes: int) -> Iterator[bytes]:
        """Yield the body in chunks of at most chunk_bytes (fresh on every call)."""
        raise NotImplementedError

    def to_bytes(self) -> bytes:
        return b"".join(self.iter_chunks(max(self.nbytes, 1)))


class BytesPayload(Payload):
    """A body that is already one bytes object (e.g. JSON)."""

    def __init__(self, data: bytes, content_type: str = "application/octet-stream") -> None:
        self.data = data
        self.content_type = content_type

    @property
    def nbytes(self) -> int:
        return len(self.data)

    def iter_chunks(self, chunk_bytes: int) -> Iterator[bytes]:
        view = memoryview(self.data)
        for start in range(0, len(view), chunk_bytes):
            yield bytes(view[start : start + chunk_bytes])

    def to_bytes(self) -> bytes:
        return self.data


def _header_bytes(header: dict[str, Any]) -> bytes:
    raw = json.dumps(header, separators=(",", ":")).encode()
    # Pad with spaces to a multiple of 8 so the data that follows stays 8-byte aligned, as the
    # reference writer does.
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


class SafetensorsPayload(Payload):
    """A safetensors body built from in-memory arrays, read straight from their buffers."""

    def __init__(self, header: bytes, buffers: list[memoryview]) -> None:
        self.header = header
        self.buffers = buffers

    @property
    def nbytes(self) -> int:
        return len(self.header) + sum(b.nbytes for b in self.buffers)

    def iter_chunks(self, chunk_bytes: int) -> Iterator[bytes]:
        yield self.header
        for buf in self.buffers:
            for start in range(0, buf.nbytes, chunk_bytes):
                yield bytes(buf[start : start + chunk_bytes])

    def to_bytes(self) -> bytes:
        return b"".join([self.header, *self.buffers])


def encode_safetensors(
    tensors: Mapping[str, np.ndarray], metadata: Mapping[str, str] | None = None
) -> SafetensorsPayload:
    """Encode arrays as a safetensors body without copying their data.

    Args:
        tensors: name -> little-endian C-contiguous array of a supported dtype (see
            `wire_dtype`); `as_data_array`/`as_index_array` produce such arrays.
        metadata: Optional string metadata for the header's `__metadata__`.
    """
    header: dict[str, Any] = {}
    if metadata:
        header["__metadata__"] = dict(metadata)
    buffers: list[memoryview] = []
    offset = 0
    for name, arr in tensors.items():
        arr = _little_endian_c(arr)
        end = offset + arr.nbytes
        header[name] = {
            "dtype": wire_dtype(arr.dtype),
            "shape": [int(s) for s in arr.shape],
            "data_offsets": [offset, end],
        }
        buffers.append(arr.reshape(-1).view(np.uint8).data)
        offset = end
    return SafetensorsPayload(_header_bytes(header), buffers)


def decode_safetensors(data: bytes | bytearray | memoryview) -> dict[str, np.ndarray]:
    """Decode a safetensors body into writable numpy arrays.

    Raises:
        ValueError: the bytes are not a valid safetensors body, or hold a dtype the API does not
            use.
    """
    try:
        entries = safetensors.deserialize(  # type: ignore[no-untyped-call]
            bytes(data) if isinstance(data, memoryview) else data)
    except Exception as exc:  # SafetensorError, or a panic surfacing as another type
        raise ValueError(f"invalid safetensors body: {exc}") from exc
    out: dict[str, np.ndarray] = {}
    for name, entry in entries:
        dtype = from_wire_dtype(entry["dtype"])
        shape = tuple(int(s) for s in entry["shape"])
        raw = entry["data"]
        if math.prod(shape) * dtype.itemsize != len(raw):
            raise ValueError(
                f"invalid safetensors body: tensor {name!r} of shape {shape} and dtype "
                f"{entry['dtype']} needs {math.prod(shape) * dtype.itemsize} bytes, has {len(raw)}"
            )
        if not isinstance(raw, bytearray):
            raw = bytearray(raw)  # older safetensors return bytes; results must be writable
        wire = dtype if dtype == BFLOAT16 else dtype.newbyteorder("<")
        out[name] = np.frombuffer(raw, dtype=wire).reshape(shape)
    return out


# --------------------------------------------------------------------------------------------
# Files: read one tensor's header entry and stream its bytes without loading the file


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a safetensors file: where its bytes are and what they mean."""

    name: str
    dtype: str  # safetensors dtype string, e.g. "BF16"
    shape: tuple[int, ...]
    start: int  # absolute file offset of the first byte
    nbytes: int


def read_safetensors_header(path: str | os.PathLike[str]) -> dict[str, TensorEntry]:
    """Read a safetensors file's header (not its data) and check it against the file size.

    Raises:
        ValueError: the file is not a valid safetensors file.
        OSError: the file cannot be read.
    """
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise ValueError(f"{os.fspath(path)} is not a safetensors file (shorter than 8 bytes)")
        (hlen,) = struct.unpack("<Q", head)
        if hlen > MAX_HEADER_BYTES or 8 + hlen > size:
            raise ValueError(
                f"{os.fspath(path)} is not a safetensors file (header length {hlen} does not fit "
                f"a file of {size} bytes)"
            )
        raw = f.read(hlen)
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:  # (too deep)
        raise ValueError(f"{os.fspath(path)}: the safetensors header is not JSON: {exc}") from exc
    if not isinstance(header, dict):
        raise ValueError(f"{os.fspath(path)}: the safetensors header is not a JSON object")
    entries: dict[str, TensorEntry] = {}
    for name, spec in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = spec["dtype"]
            if not isinstance(dtype, str):  # (a list here is unhashable below: a TypeError)
                raise TypeError(f"dtype must be a string; got {dtype!r:.40}")
            shape = tuple(int(s) for s in spec["shape"])
            begin, end = (int(v) for v in spec["data_offsets"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"{os.fspath(path)}: bad header entry for {name!r}: {spec!r}") from exc
        itemsize = _NP_FROM_WIRE[dtype].itemsize if dtype in _NP_FROM_WIRE else None
        if (
            begin < 0
            or end < begin
            or 8 + hlen + end > size
            or any(s < 0 for s in shape)
            or (itemsize is not None and end - begin != math.prod(shape) * itemsize)
        ):
            raise ValueError(f"{os.fspath(path)}: header entry for {name!r} does not fit the file")
        entries[name] = TensorEntry(name, dtype, shape, 8 + hlen + begin, end - begin)
    return entries


class FileTensorPayload(Payload):
    """A safetensors body of one tensor (plus `also`, e.g. an FP8 tensor's scale) whose data is
    streamed from slices of a file.

    The file is opened afresh by every `iter_chunks`, so a retried upload resends it whole.
    """

    def __init__(self, path: str | os.PathLike[str], entry: TensorEntry, as_name: str,
                 also: Sequence[tuple[TensorEntry, str]] = ()) -> None:
        self.path = os.fspath(path)
        self.parts = [(entry, as_name), *also]
        header: dict[str, Any] = {}
        offset = 0
        for part, name in self.parts:
            header[name] = {"dtype": part.dtype, "shape": list(part.shape),
                            "data_offsets": [offset, offset + part.nbytes]}
            offset += part.nbytes
        self.header = _header_bytes(header)
        # The file the offsets above were read from (taken right after its header was read).
        # The body is read later, and again on every retry: a file replaced in between (a
        # checkpoint re-saved with os.replace, or rewritten in place) was read at the old
        # offsets and uploaded as garbage weights, with no error, unless it had become shorter.
        self._identity = _file_identity(os.stat(self.path))

    @property
    def nbytes(self) -> int:
        return len(self.header) + sum(part.nbytes for part, _ in self.parts)

    def _check_unchanged(self, f: Any) -> None:
        # The open file (written in place) and the path (replaced by a rename while the body
        # streams: the open file is still the old one).
        try:
            at_path = _file_identity(os.stat(self.path))
        except OSError:
            at_path = None  # (removed)
        if _file_identity(os.fstat(f.fileno())) != self._identity or at_path != self._identity:
            # Raised while the body is being sent: the request is cut short, nothing is stored.
            raise OSError(f"{self.path} changed since its header was read (replaced, rewritten "
                          "or touched); upload it again")

    def iter_chunks(self, chunk_bytes: int) -> Iterator[bytes]:
        yield self.header
        with open(self.path, "rb") as f:
            self._check_unchanged(f)
            last = len(self.parts) - 1
            for i, (part, _) in enumerate(self.parts):
                f.seek(part.start)
                left = part.nbytes
                while left > 0:
                    chunk = f.read(min(chunk_bytes, left))
                    if not chunk:
                        raise OSError(f"{self.path} ended early (was it changed during the "
                                      "upload?)")
                    left -= len(chunk)
                    if i == last and left == 0:
                        # Before the body's last bytes go out: a write during the upload (same
                        # inode, new mtime or size) must not complete the request.
                        self._check_unchanged(f)
                    yield chunk


def _file_identity(st: os.stat_result) -> tuple[int, int, int, int]:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
