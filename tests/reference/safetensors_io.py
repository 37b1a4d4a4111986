"""Minimal reader and writer of the safetensors format, with numpy only.

The reference tests read Tetra's dumps (params, grads, batches) without the `safetensors` package,
which Debian's python3-torch does not ship. Format: u64 little-endian header length N, N bytes of
JSON {"name": {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}, then the
raw little-endian data; offsets are relative to the end of the header.
"""
import json
import struct

import numpy as np

# BF16 has no numpy dtype: it is read as uint16 and widened to float32 (its upper 16 bits).
_DTYPES = {"F32": np.float32, "F64": np.float64, "I32": np.int32, "I64": np.int64,
           "BF16": np.uint16, "F16": np.float16, "U8": np.uint8}
_NAMES = {np.dtype(np.float32): "F32", np.dtype(np.float64): "F64", np.dtype(np.int32): "I32",
          np.dtype(np.int64): "I64", np.dtype(np.float16): "F16", np.dtype(np.uint8): "U8"}


def read_safetensors(path):
    """Returns ({name: np.ndarray}, metadata dict). BF16 tensors come back as float32."""
    with open(path, "rb") as f:
        blob = f.read()
    if len(blob) < 8:
        raise ValueError(f"{path}: {len(blob)} bytes, too short for a safetensors header")
    (n,) = struct.unpack("<Q", blob[:8])
    if 8 + n > len(blob):
        raise ValueError(f"{path}: header length {n} exceeds file size {len(blob)}")
    header = json.loads(blob[8:8 + n].decode("utf-8"))
    metadata = header.pop("__metadata__", {}) or {}
    data = memoryview(blob)[8 + n:]
    tensors = {}
    for name, info in header.items():
        dtype = _DTYPES.get(info["dtype"])
        if dtype is None:
            raise ValueError(f"{path}: tensor {name}: unsupported dtype {info['dtype']}")
        begin, end = info["data_offsets"]
        shape = tuple(int(s) for s in info["shape"])
        count = int(np.prod(shape, dtype=np.int64))
        if end - begin != count * np.dtype(dtype).itemsize or end > len(data):
            raise ValueError(f"{path}: tensor {name}: offsets [{begin}, {end}) do not fit shape "
                             f"{list(shape)} of {info['dtype']} in {len(data)} data bytes")
        arr = np.frombuffer(data[begin:end], dtype=np.dtype(dtype).newbyteorder("<")).reshape(shape)
        if info["dtype"] == "BF16":
            arr = (arr.astype(np.uint32) << 16).view(np.float32)
        tensors[name] = arr.copy()
    return tensors, metadata


def write_safetensors(path, tensors, metadata=None):
    """Writes {name: np.ndarray} (F32/F64/I32/I64/F16/U8), in sorted name order."""
    header, chunks, offset = {}, [], 0
    for name in sorted(tensors):
        arr = np.ascontiguousarray(tensors[name])
        if arr.dtype not in _NAMES:
            raise ValueError(f"tensor {name}: unsupported numpy dtype {arr.dtype}")
        raw = arr.astype(arr.dtype.newbyteorder("<"), copy=False).tobytes()
        header[name] = {"dtype": _NAMES[arr.dtype], "shape": list(arr.shape),
                        "data_offsets": [offset, offset + len(raw)]}
        chunks.append(raw)
        offset += len(raw)
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    head = json.dumps(header, separators=(",", ":")).encode("utf-8")
    head += b" " * (-len(head) % 8)  # keep the data 8-byte aligned, as the reference writer does
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(head)))
        f.write(head)
        for raw in chunks:
            f.write(raw)
