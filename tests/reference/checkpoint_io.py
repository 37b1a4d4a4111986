"""Reads a Tetra checkpoint directory (trainer/checkpoint/checkpoint.h) into global tensors, with
numpy only: manifest.json's tensor index maps every slice (a rectangle of the tensor's global 2-D
view, and the row-major range of it that the slice holds) to a tensor of a rank's safetensors file.
"""
import json
import os

import numpy as np

from safetensors_io import read_safetensors


def read_checkpoint(path):
    """({key: global np.float32 array}, manifest) of the checkpoint directory `path`. Elements no
    slice covers are NaN."""
    with open(os.path.join(path, "manifest.json")) as f:
        manifest = json.load(f)
    files, out = {}, {}
    for key, t in manifest["tensors"].items():
        shape = [int(s) for s in t["shape"]]
        gcols = shape[-1] if len(shape) > 1 else 1  # the global 2-D view's columns (sharding.h)
        flat = np.full(int(np.prod(shape)), np.nan, dtype=np.float32)
        for s in t["slices"]:
            if s["file"] not in files:
                files[s["file"]] = read_safetensors(os.path.join(path, s["file"]))[0]
            data = files[s["file"]][s["tensor"]].reshape(-1)
            row0, _, col0, cols = s["region"]
            begin, end = s["range"]
            e = np.arange(begin, end)
            flat[(row0 + e // cols) * gcols + col0 + e % cols] = data
        out[key] = flat.reshape(shape)
    return out, manifest
