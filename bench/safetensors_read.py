"""Reading safetensors: zoo.hf's memory-mapped views against the safetensors library's numpy reader.

    python bench/safetensors_read.py [--mb 256] [--repeats 5]

Writes a checkpoint of 64 float32 [out, in] matrices (`--mb` in all), then alternates the two
readers `--repeats` times each and prints the median seconds of (a) every tensor read whole into a
float32 buffer of the zoo layout (transposed, as `from_pretrained` does) and (b) one eighth of each
tensor's zoo-layout columns (what one of 8 devices holds in a sharded load). The page cache is warm
for both (the file was just written and read), so this measures the copies, not the disk.
"""

import argparse
import pathlib
import statistics
import tempfile
import time

import numpy as np
from safetensors import safe_open

from zoo.hf.files import SafetensorsFile, write_safetensors


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--mb", type=int, default=256)
    p.add_argument("--repeats", type=int, default=5)
    a = p.parse_args()
    n = 64
    side = int((a.mb * 2**20 / 4 / n) ** 0.5)
    with tempfile.TemporaryDirectory() as d:
        path = pathlib.Path(d) / "model.safetensors"
        rng = np.random.default_rng(0)
        write_safetensors(path, {f"w{i}": rng.standard_normal((side, side), np.float32) for i in range(n)})
        names = [f"w{i}" for i in range(n)]

        def memmap_whole():
            f = SafetensorsFile(path)
            for k in names:
                out = np.empty((side, side), np.float32)
                out[...] = f.get(k).T

        def library_whole():
            with safe_open(path, framework="np") as f:
                for k in names:
                    out = np.empty((side, side), np.float32)
                    out[...] = f.get_tensor(k).T

        cols = slice(0, side // 8)

        def memmap_slice():
            f = SafetensorsFile(path)
            for k in names:
                np.ascontiguousarray(f.get(k).T[:, cols])

        def library_slice():  # the hub rows of the zoo columns: the library's get_slice reads just those
            with safe_open(path, framework="np") as f:
                for k in names:
                    np.ascontiguousarray(f.get_slice(k)[cols].T)

        for label, fns in (("whole tensors", (memmap_whole, library_whole)), ("1/8 of each tensor", (memmap_slice, library_slice))):
            times = {fn.__name__: [] for fn in fns}
            for _ in range(a.repeats):
                for fn in fns:
                    t0 = time.perf_counter()
                    fn()
                    times[fn.__name__].append(time.perf_counter() - t0)
            med = {k: statistics.median(v) for k, v in times.items()}
            (m, mt), (lib, lt) = med.items()
            print(f"{label}: {m} {mt:.3f}s, {lib} {lt:.3f}s (library / memmap = {lt / mt:.2f}) over {n} x [{side}, {side}] float32, {a.repeats} runs each")


if __name__ == "__main__":
    main()
