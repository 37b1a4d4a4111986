#!/usr/bin/env python3
"""Write and read Megatron-LM indexed datasets (PREFIX.bin + PREFIX.idx) with numpy alone.

The format (the one trainer/data/indexed_dataset.h reads), all little-endian:
  PREFIX.idx: magic b"MMIDIDX\\x00\\x00", version u64 = 1, dtype code u8, sequence count S u64,
              document count D u64 (= documents + 1), sequence lengths int32[S],
              sequence pointers int64[S] (byte offsets into .bin), document indices int64[D]
              (0, then the sequence index where each document ends)
  PREFIX.bin: the tokens of every sequence back to back, in the dtype.
Each document is written as one sequence.

As a library:
  import indexed_dataset
  indexed_dataset.write("data/train", [np.array([1, 2, 3]), np.array([4, 5])], "uint16")
  docs = indexed_dataset.read("data/train")        # list of numpy arrays, one per sequence

From the command line:
  indexed_dataset.py write PREFIX --tokens A.npy [--tokens B.npy ...] [--dtype auto|uint16|int32]
      each .npy is one 1-D integer array = one document
  indexed_dataset.py read PREFIX [--show N]
      prints the dtype, counts, token range and the first N tokens
"""

import argparse
import os
import struct
import sys

import numpy as np

INDEX_MAGIC = b"MMIDIDX\x00\x00"
INDEX_VERSION = 1
DTYPE_CODES = {
    "uint8": 1, "int8": 2, "int16": 3, "int32": 4, "int64": 5, "float64": 6, "float32": 7,
    "uint16": 8,
}
CODE_DTYPES = {code: name for name, code in DTYPE_CODES.items()}


def best_dtype(max_token):
    """uint16 when every id fits, else int32."""
    return "uint16" if max_token < 65536 else "int32"


def write(prefix, documents, dtype="auto"):
    """Write `documents` (iterable of 1-D integer arrays) as PREFIX.bin + PREFIX.idx.

    Files are written under .tmp names and renamed at the end (old .idx removed first), so an
    interrupted write never leaves a pair that looks complete.
    """
    docs = [np.asarray(d).reshape(-1) for d in documents]
    if dtype == "auto":
        dtype = best_dtype(max((int(d.max()) for d in docs if d.size), default=0))
    if dtype not in DTYPE_CODES:
        raise ValueError(f"unknown dtype {dtype!r}; known: {sorted(DTYPE_CODES)}")
    np_dtype = np.dtype(dtype).newbyteorder("<")
    itemsize = np_dtype.itemsize
    for i, d in enumerate(docs):
        if d.size and np.issubdtype(np_dtype, np.integer):
            info = np.iinfo(np_dtype)
            if int(d.min()) < info.min or int(d.max()) > info.max:
                raise ValueError(f"document {i} has tokens outside {dtype}'s range "
                                 f"[{info.min}, {info.max}]: use int32")

    bin_tmp, idx_tmp = prefix + ".bin.tmp", prefix + ".idx.tmp"
    lengths = np.array([d.size for d in docs], dtype="<i4")
    pointers = np.zeros(len(docs), dtype="<i8")
    if len(docs) > 1:
        pointers[1:] = np.cumsum(lengths[:-1].astype(np.int64)) * itemsize
    doc_indices = np.arange(len(docs) + 1, dtype="<i8")
    try:
        with open(bin_tmp, "wb") as f:
            for d in docs:
                f.write(d.astype(np_dtype).tobytes(order="C"))
            f.flush()
            os.fsync(f.fileno())
        with open(idx_tmp, "wb") as f:
            f.write(INDEX_MAGIC)
            f.write(struct.pack("<Q", INDEX_VERSION))
            f.write(struct.pack("<B", DTYPE_CODES[dtype]))
            f.write(struct.pack("<Q", len(docs)))
            f.write(struct.pack("<Q", len(doc_indices)))
            f.write(lengths.tobytes())
            f.write(pointers.tobytes())
            f.write(doc_indices.tobytes())
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        for path in (bin_tmp, idx_tmp):
            if os.path.exists(path):
                os.remove(path)
        raise
    if os.path.exists(prefix + ".idx"):
        os.remove(prefix + ".idx")
    os.replace(bin_tmp, prefix + ".bin")
    os.replace(idx_tmp, prefix + ".idx")


def read_index(prefix):
    """(dtype name, lengths int32[S], pointers int64[S], document indices int64[D])."""
    path = prefix + ".idx"
    with open(path, "rb") as f:
        raw = f.read()
    if raw[:9] != INDEX_MAGIC:
        raise ValueError(f"{path}: not a Megatron indexed dataset index (bad magic)")
    (version,) = struct.unpack_from("<Q", raw, 9)
    if version != INDEX_VERSION:
        raise ValueError(f"{path}: version {version}, expected {INDEX_VERSION}")
    code = raw[17]
    if code not in CODE_DTYPES:
        raise ValueError(f"{path}: unknown dtype code {code}")
    seq_count, doc_count = struct.unpack_from("<QQ", raw, 18)
    need = 34 + 12 * seq_count + 8 * doc_count
    if len(raw) < need:
        raise ValueError(f"{path}: truncated: {len(raw)} bytes, the header needs {need}")
    off = 34
    lengths = np.frombuffer(raw, dtype="<i4", count=seq_count, offset=off)
    off += 4 * seq_count
    pointers = np.frombuffer(raw, dtype="<i8", count=seq_count, offset=off)
    off += 8 * seq_count
    doc_indices = np.frombuffer(raw, dtype="<i8", count=doc_count, offset=off)
    return CODE_DTYPES[code], lengths, pointers, doc_indices


def read(prefix):
    """The sequences of PREFIX.bin as a list of numpy arrays (in the stored dtype)."""
    dtype, lengths, pointers, _ = read_index(prefix)
    data = np.fromfile(prefix + ".bin", dtype=np.dtype(dtype).newbyteorder("<"))
    itemsize = np.dtype(dtype).itemsize
    return [data[p // itemsize: p // itemsize + n] for p, n in zip(pointers, lengths)]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    w = sub.add_parser("write", help="write .npy token arrays as a dataset")
    w.add_argument("prefix", help="output prefix (PREFIX.bin and PREFIX.idx are written)")
    w.add_argument("--tokens", action="append", required=True,
                   help="a .npy file holding one 1-D integer array = one document (repeatable)")
    w.add_argument("--dtype", default="auto", choices=["auto", "uint16", "int32"])
    r = sub.add_parser("read", help="summarise a dataset")
    r.add_argument("prefix")
    r.add_argument("--show", type=int, default=16, help="print the first N tokens")
    args = parser.parse_args(argv)

    if args.command == "write":
        docs = [np.load(path) for path in args.tokens]
        for path, d in zip(args.tokens, docs):
            if d.ndim != 1 or not np.issubdtype(d.dtype, np.integer):
                parser.error(f"{path}: expected a 1-D integer array, got {d.dtype} {d.shape}")
        try:
            write(args.prefix, docs, args.dtype)
        except (ValueError, OSError) as e:
            parser.error(str(e))
        print(f"wrote {args.prefix}.bin/.idx: {len(docs)} documents, "
              f"{sum(d.size for d in docs)} tokens")
    else:
        try:
            docs = read(args.prefix)
        except (ValueError, OSError) as e:
            parser.error(str(e))
        tokens = np.concatenate(docs) if docs else np.zeros(0, dtype=np.int64)
        dtype = read_index(args.prefix)[0]
        print(f"{args.prefix}: {dtype}, {len(docs)} sequences, {tokens.size} tokens", end="")
        if tokens.size:
            print(f", ids in [{int(tokens.min())}, {int(tokens.max())}]")
            print("first tokens:", tokens[:args.show].tolist())
        else:
            print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
