"""Safetensors files and a checkpoint directory's tensors across its shards. Every problem raises
`CheckpointError` naming the file and the tensor.

What the `safetensors` library (0.8.0) does here and what it cannot:
- Checking a file: the library validates each header on open (offsets that overlap or leave gaps,
  shapes that disagree with the byte counts); zoo adds the truncation checks that name the file.
- Writing a dict of arrays (`write_safetensors`): the library's `save_file`.
- Writing a model (`SafetensorsStream`, for `save_pretrained`): hand-written, because the library
  takes every tensor of a file at once (`save_file`, `serialize_file`), so a 5 GB shard would sit on
  the host whole; the stream writes each tensor as its leaf comes, in the library's exact layout
  (tests hold the bytes equal).
- Reading: through views of one `np.memmap` per file, not the library. A view costs nothing until
  used, and a slice of it (or of a transposed or reshaped view) reads only the pages it covers, which
  is what lets a sharded load read just its devices' slices through the rules' transposes, reshapes
  and splits; the library's `get_slice` slices only the file's `[out, in]` layout, its numpy reader
  returns a fresh copy of every tensor, and it cannot read float8 into numpy (AttributeError
  `numpy.float8_e4m3fn`), which DeepSeek-V3's weights are. Speed decides nothing either way:
  `python bench/safetensors_read.py` (64 [1024, 1024] float32 tensors, medians of 5 alternating runs,
  2 shared and loaded CPU cores) measured library / memory map at 1.09 and 0.85 in two sessions for
  whole tensors, 0.92 and 1.42 for one eighth of each: equal within the noise.

DeepSeek-V3's published FP8 weights (`float8_e4m3fn`, each with a float32 `<name>_scale_inv` of
one scale per `weight_block_size` block) are dequantised on read: `w = q * scale_inv[block]`.
"""

import json
import math
import os
import pathlib
from typing import Any, Optional, Sequence

import ml_dtypes
import numpy as np

from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from zoo.errors import CheckpointError


_ST_DTYPES = {
    "F64": np.float64,
    "F32": np.float32,
    "F16": np.float16,
    "BF16": ml_dtypes.bfloat16,
    "F8_E4M3": ml_dtypes.float8_e4m3fn,
    "F8_E5M2": ml_dtypes.float8_e5m2,
    "I64": np.int64,
    "I32": np.int32,
    "I16": np.int16,
    "I8": np.int8,
    "U8": np.uint8,
    "BOOL": np.bool_,
}
FLOAT_DTYPES = ("F32", "BF16", "F16", "F64")
FP8_DTYPE = "F8_E4M3"  # the block-quantised weights DeepSeek-V3 publishes
SCALE_SUFFIX = "_scale_inv"


class SafetensorsFile:
    """One `.safetensors` file: the header is parsed and checked against the file size up front."""

    def __init__(self, path: pathlib.Path):
        self.path = path
        if not path.is_file():  # a folder named like one (open() raised IsADirectoryError), a device
            raise CheckpointError(f"{path}: not a file; a .safetensors name belongs to the model's weight files")
        size = path.stat().st_size
        with open(path, "rb") as f:
            raw_len = f.read(8)
            if len(raw_len) < 8:
                raise CheckpointError(
                    f"{path}: truncated or not a safetensors file (shorter than its 8-byte header length); download "
                    "or copy it again"
                )
            header_len = int.from_bytes(raw_len, "little")
            # A safetensors header is a JSON object: a file whose ninth byte is not `{` is something
            # else (an HTML error page, a Git LFS pointer, random bytes), whatever length its first 8 bytes read as.
            if f.read(1) != b"{":
                lfs = " (a Git LFS pointer: run git lfs pull)" if raw_len == b"version " else ""
                raise CheckpointError(
                    f"{path}: not a safetensors file{lfs} (it does not start with a header length and a JSON header); "
                    "download or copy the model's .safetensors file again"
                )
            if 8 + header_len > size:
                raise CheckpointError(
                    f"{path}: truncated: the header claims {header_len} bytes, the file has {size}; download or copy "
                    "it again"
                )
            try:
                f.seek(8)
                header = json.loads(f.read(header_len))
            except (UnicodeDecodeError, json.JSONDecodeError) as e:
                raise CheckpointError(f"{path}: not a safetensors file (header is not JSON: {e})") from None
        header.pop("__metadata__", None)
        self.header = header
        self._map: Optional[np.memmap] = None
        self.data_start = 8 + header_len
        end = max((v["data_offsets"][1] for v in header.values()), default=0)
        if self.data_start + end > size:
            raise CheckpointError(
                f"{path}: truncated: tensors need {self.data_start + end} bytes, the file has {size}; download or "
                "copy it again"
            )
        try:  # the library's checks of the layout: offsets that overlap, leave gaps or disagree with shape x dtype
            safe_open(path, framework="np")
        except SafetensorError as e:
            raise CheckpointError(
                f"{path}: not a valid safetensors file ({str(e).splitlines()[0]}); download or copy it again"
            ) from None

    def names(self) -> list[str]:
        return list(self.header)

    def dtype(self, name: str) -> str:
        return self.header[name]["dtype"]

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.header[name]["shape"])

    def get(self, name: str) -> np.ndarray:
        """A read-only view through a memory map; nothing is read until it is used."""
        info = self.header[name]
        if info["dtype"] not in _ST_DTYPES:
            raise CheckpointError(f"{self.path}: tensor {name!r} has unsupported dtype {info['dtype']}")
        dtype = np.dtype(_ST_DTYPES[info["dtype"]])
        start, end = info["data_offsets"]
        if math.prod(info["shape"]) == 0:
            return np.zeros(info["shape"], dtype)
        if self._map is None:  # one map of the whole file, shared by every tensor's view
            self._map = np.memmap(self.path, dtype=np.uint8, mode="r")
        return self._map[self.data_start + start : self.data_start + end].view(dtype).reshape(info["shape"])


def write_safetensors(path: pathlib.Path, tensors: dict[str, np.ndarray], metadata: Optional[dict] = None) -> None:
    """Write `tensors` with the safetensors library (to a temporary name, then renamed into place); the
    library writes each array from its own memory, so nothing is copied first."""
    tmp = path.with_name(path.name + ".tmp")
    save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, tmp, metadata=metadata)
    os.replace(tmp, path)


# The library's layout (its Rust `Dtype` enum order): larger dtypes first, then by name, so each tensor
# starts aligned to its item size. `SafetensorsStream` writes the same layout.
_ST_ORDER = ("BOOL", "U8", "I8", "F8_E5M2", "F8_E4M3", "I16", "F16", "BF16", "I32", "F32", "F64", "I64")
_ST_CODES = {np.dtype(v): k for k, v in _ST_DTYPES.items()}


class SafetensorsStream:
    """One safetensors file written a tensor at a time. The names, shapes and dtypes are given up front,
    so the header goes first and each tensor's bytes go to their place as they come: the host holds one
    tensor, not the file. The library cannot do this (`save_file` / `serialize_file` take every tensor
    of the file at once), so this writer is here; it lays the file out exactly as the library does
    (header, tensor order, padding), and tests/test_hf.py holds its bytes equal to `save_file`'s.

    Written under `<name>.tmp`; `close()` checks every tensor came and renames the file into place."""

    def __init__(
        self, path: pathlib.Path, specs: Sequence[tuple[str, Sequence[int], Any]], metadata: Optional[dict] = None
    ):
        self.path = pathlib.Path(path)
        order = sorted(
            ((n, tuple(sh), np.dtype(dt)) for n, sh, dt in specs),
            key=lambda t: (-_ST_ORDER.index(_ST_CODES[t[2]]), t[0]),
        )
        header: dict = {"__metadata__": dict(metadata)} if metadata else {}
        self._where: dict[str, tuple[int, tuple[int, ...], np.dtype]] = {}
        offset = 0
        for name, shape, dtype in order:
            end = offset + math.prod(shape) * dtype.itemsize
            header[name] = {"dtype": _ST_CODES[dtype], "shape": list(shape), "data_offsets": [offset, end]}
            self._where[name] = (offset, shape, dtype)
            offset = end
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        self._data_start = 8 + len(raw)
        self._tmp = self.path.with_name(self.path.name + ".tmp")
        self._file = open(self._tmp, "wb")
        self._file.write(len(raw).to_bytes(8, "little") + raw)
        self._file.truncate(self._data_start + offset)

    def write(self, name: str, array: np.ndarray) -> None:
        offset, shape, dtype = self._where[name]
        if array.shape != shape or array.dtype != dtype:
            raise ValueError(
                f"{self.path}: tensor {name!r} is {array.dtype}{list(array.shape)}, the header says "
                f"{dtype}{list(shape)}"
            )
        self._file.seek(self._data_start + offset)
        np.ascontiguousarray(array).tofile(self._file)
        del self._where[name]

    @property
    def done(self) -> bool:
        return not self._where

    def close(self) -> None:
        self._file.close()
        if self._where:
            self._tmp.unlink()
            raise ValueError(f"{self.path}: tensors {sorted(self._where)[:3]} were never written")
        os.replace(self._tmp, self.path)


def dequantize_blocks(q: np.ndarray, scale_inv: np.ndarray, block: Sequence[int]) -> np.ndarray:
    """float32 `q * scale_inv` where each scale covers a `block[0] x block[1]` tile of `q` (the last tiles
    may be partial), one row of tiles at a time so no repeated scale matrix is built."""
    rows, cols = q.shape
    b0, b1 = block
    out = np.empty(q.shape, np.float32)
    for i in range(scale_inv.shape[0]):
        r = slice(i * b0, min((i + 1) * b0, rows))
        out[r] = q[r].astype(np.float32) * np.repeat(scale_inv[i].astype(np.float32), b1)[:cols]
    return out


class CheckpointReader:
    """All tensors of a checkpoint directory, by hub name, across its shards; remembers which it handed out.

    `fp8_block`: the `weight_block_size` of an FP8 checkpoint's `quantization_config` (None: float only)."""

    def __init__(self, directory: pathlib.Path, fp8_block: Optional[tuple[int, int]] = None):
        self.directory = directory
        self.fp8_block = fp8_block
        index_path = directory / "model.safetensors.index.json"
        self.files: dict[str, SafetensorsFile] = {}
        self.location: dict[str, str] = {}
        self.used: set[str] = set()
        if index_path.exists():
            try:
                weight_map = json.loads(index_path.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise CheckpointError(
                    f"{index_path}: unreadable ({type(e).__name__}: {e}); download or copy it again"
                ) from None
            for name, file in weight_map.items():
                if file not in self.files:
                    if not (directory / file).exists():
                        raise CheckpointError(
                            f"{index_path}: names shard {file!r}, which is missing from {directory}; download or copy "
                            "it again"
                        )
                    self.files[file] = SafetensorsFile(directory / file)
                if name not in self.files[file].header:
                    raise CheckpointError(
                        f"{index_path}: tensor {name!r} is mapped to {file}, which does not contain it; download or "
                        "copy it again"
                    )
                self.location[name] = file
        else:
            paths = sorted(directory.glob("*.safetensors"))
            if not paths:
                raise CheckpointError(
                    f"{directory}: no *.safetensors files; a Hugging Face checkpoint directory (config.json + "
                    "*.safetensors) is needed"
                )
            for p in paths:
                self.files[p.name] = SafetensorsFile(p)
                for name in self.files[p.name].names():
                    self.location[name] = p.name

    def __contains__(self, name: str) -> bool:
        return name in self.location

    def file_of(self, name: str) -> SafetensorsFile:
        return self.files[self.location[name]]

    def check(self, name: str, expected_shape: Sequence[int]) -> None:
        """`name` is there, floating point (or FP8 with its block scales) and of `expected_shape`; marks
        it used. Reads only the header."""
        if name not in self.location:
            raise CheckpointError(
                f"{self.directory}: checkpoint is missing tensor {name!r} (expected shape {list(expected_shape)}); "
                "the config.json does not describe these weights"
            )
        file = self.file_of(name)
        dtype, shape = file.dtype(name), file.shape(name)
        if dtype == FP8_DTYPE and self.fp8_block is not None:
            self._check_scale(name, shape)
        elif dtype not in FLOAT_DTYPES:
            fp8 = " (an FP8 checkpoint's config.json names its quantization_config)" if dtype.startswith("F8") else ""
            raise CheckpointError(
                f"{file.path}: tensor {name!r} has dtype {dtype}; a floating-point tensor ({', '.join(FLOAT_DTYPES)}) "
                f"is expected{fp8}"
            )
        if shape != tuple(expected_shape):
            raise CheckpointError(
                f"{file.path}: tensor {name!r} has shape {list(shape)}, the config implies {list(expected_shape)}; "
                "config.json and the weights disagree (download or copy the directory again)"
            )
        self.used.add(name)

    def _check_scale(self, name: str, shape: tuple[int, ...]) -> None:
        scale = name + SCALE_SUFFIX
        file = self.file_of(name)
        if len(shape) != 2 or scale not in self.location:
            raise CheckpointError(
                f"{file.path}: FP8 tensor {name!r} has no {scale!r} block scales; download the checkpoint again"
            )
        want = tuple(-(-n // b) for n, b in zip(shape, self.fp8_block))
        got_file = self.file_of(scale)
        if got_file.shape(scale) != want or got_file.dtype(scale) not in FLOAT_DTYPES:
            raise CheckpointError(
                f"{got_file.path}: {scale!r} is {got_file.dtype(scale)}{list(got_file.shape(scale))}; blocks of "
                f"{list(self.fp8_block)} over {list(shape)} need a float tensor of shape {list(want)}"
            )
        self.used.add(scale)

    def get(self, name: str, expected_shape: Sequence[int]) -> np.ndarray:
        """The tensor `name` (see `check`): a memory-mapped view, or for FP8 the dequantised float32 tensor."""
        self.check(name, expected_shape)
        file = self.file_of(name)
        arr = file.get(name)
        if file.dtype(name) == FP8_DTYPE:
            return dequantize_blocks(arr, self.file_of(name + SCALE_SUFFIX).get(name + SCALE_SUFFIX), self.fp8_block)
        return arr
