"""Safetensors files, read through a memory map and written without torch, and a checkpoint directory's
tensors across its shards. Every problem raises `CheckpointError` naming the file and the tensor."""

import json
import math
import os
import pathlib
from typing import Optional

import ml_dtypes
import numpy as np


class CheckpointError(ValueError):
    """A checkpoint directory, config or tensor that cannot be used; the message names it."""


_ST_DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_,
}
_ST_NAMES = {np.dtype(v): k for k, v in _ST_DTYPES.items()}
FLOAT_DTYPES = ("F32", "BF16", "F16", "F64")


class SafetensorsFile:
    """One `.safetensors` file: the header is parsed and checked against the file size up front."""

    def __init__(self, path: pathlib.Path):
        self.path = path
        size = path.stat().st_size
        with open(path, "rb") as f:
            raw_len = f.read(8)
            if len(raw_len) < 8:
                raise CheckpointError(f"{path}: truncated or not a safetensors file (shorter than its 8-byte header length)")
            header_len = int.from_bytes(raw_len, "little")
            if 8 + header_len > size:
                raise CheckpointError(f"{path}: truncated: the header claims {header_len} bytes, the file has {size}")
            try:
                header = json.loads(f.read(header_len))
            except (UnicodeDecodeError, json.JSONDecodeError) as e:
                raise CheckpointError(f"{path}: not a safetensors file (header is not JSON: {e})") from None
        header.pop("__metadata__", None)
        self.header = header
        self.data_start = 8 + header_len
        end = max((v["data_offsets"][1] for v in header.values()), default=0)
        if self.data_start + end > size:
            raise CheckpointError(
                f"{path}: truncated: tensors need {self.data_start + end} bytes, the file has {size}; download or copy it again"
            )

    def names(self) -> list[str]:
        return list(self.header)

    def get(self, name: str) -> np.ndarray:
        """A read-only view through a memory map; nothing is read until it is used."""
        info = self.header[name]
        if info["dtype"] not in _ST_DTYPES:
            raise CheckpointError(f"{self.path}: tensor {name!r} has unsupported dtype {info['dtype']}")
        dtype = np.dtype(_ST_DTYPES[info["dtype"]])
        start, end = info["data_offsets"]
        count = math.prod(info["shape"])
        if count == 0:
            return np.zeros(info["shape"], dtype)
        return np.memmap(self.path, dtype=dtype, mode="r", offset=self.data_start + start, shape=tuple(info["shape"]))


def write_safetensors(path: pathlib.Path, tensors: dict[str, np.ndarray], metadata: Optional[dict] = None) -> None:
    """Write `tensors` in the safetensors layout (to a temporary name, then renamed into place)."""
    header, offset = {}, 0
    for name, arr in tensors.items():
        header[name] = {"dtype": _ST_NAMES[np.dtype(arr.dtype)], "shape": list(arr.shape), "data_offsets": [offset, offset + arr.nbytes]}
        offset += arr.nbytes
    if metadata:
        header["__metadata__"] = metadata
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # tensor data starts 8-byte aligned
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(len(blob).to_bytes(8, "little"))
        f.write(blob)
        for arr in tensors.values():
            f.write(np.ascontiguousarray(arr).tobytes())
    os.replace(tmp, path)


class CheckpointReader:
    """All tensors of a checkpoint directory, by hub name, across its shards; remembers which it handed out."""

    def __init__(self, directory: pathlib.Path):
        self.directory = directory
        index_path = directory / "model.safetensors.index.json"
        self.files: dict[str, SafetensorsFile] = {}
        self.location: dict[str, str] = {}
        self.used: set[str] = set()
        if index_path.exists():
            weight_map = json.loads(index_path.read_text())["weight_map"]
            for name, file in weight_map.items():
                if file not in self.files:
                    if not (directory / file).exists():
                        raise CheckpointError(f"{index_path}: names shard {file!r}, which is missing from {directory}")
                    self.files[file] = SafetensorsFile(directory / file)
                if name not in self.files[file].header:
                    raise CheckpointError(f"{index_path}: tensor {name!r} is mapped to {file}, which does not contain it")
                self.location[name] = file
        else:
            paths = sorted(directory.glob("*.safetensors"))
            if not paths:
                raise CheckpointError(f"{directory}: no *.safetensors files; a Hugging Face checkpoint directory is needed")
            for p in paths:
                self.files[p.name] = SafetensorsFile(p)
                for name in self.files[p.name].names():
                    self.location[name] = p.name

    def __contains__(self, name: str) -> bool:
        return name in self.location

    def get(self, name: str, expected_shape: tuple[int, ...]) -> np.ndarray:
        """The tensor `name`, which must be floating point and of `expected_shape`."""
        if name not in self.location:
            raise CheckpointError(f"{self.directory}: checkpoint is missing tensor {name!r} (expected shape {list(expected_shape)})")
        file = self.files[self.location[name]]
        dtype = file.header[name]["dtype"]
        if dtype not in FLOAT_DTYPES:
            raise CheckpointError(
                f"{file.path}: tensor {name!r} has dtype {dtype}; a floating-point tensor ({', '.join(FLOAT_DTYPES)}) is expected"
            )
        arr = file.get(name)
        if tuple(arr.shape) != tuple(expected_shape):
            raise CheckpointError(
                f"{file.path}: tensor {name!r} has shape {list(arr.shape)}, the config implies {list(expected_shape)}"
            )
        self.used.add(name)
        return arr
