"""Host memory of writing a model as safetensors: zoo's streamed `save_pretrained` against the
library's `save_file` of the whole state dict (what one shard file costs when written at once).

    python bench/export_memory.py [checkpoint dir, default tests/data/dsv3_tiny_a]

Prints the peak memory `tracemalloc` traces (numpy's buffers included) during each write, next to
the model's bytes and its largest leaf.
"""

import pathlib
import sys
import tempfile
import tracemalloc

import jax

from zoo import hf


def traced_peak(fn) -> int:
    tracemalloc.start()
    fn()
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return peak


def main():
    src = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else pathlib.Path(__file__).parent.parent / "tests/data/dsv3_tiny_a")
    model = hf.from_pretrained(src)
    leaves = [x.nbytes for x in jax.tree.leaves(model)]
    with tempfile.TemporaryDirectory() as d:
        out = pathlib.Path(d)
        streamed = traced_peak(lambda: hf.save_pretrained(model, out / "streamed"))
        whole = traced_peak(lambda: hf.write_safetensors(out / "library.safetensors", hf.to_hf_state_dict(model)))
    print(f"model {sum(leaves)} B, largest leaf {max(leaves)} B; traced peak: streamed save_pretrained {streamed} B, "
          f"library save_file of the state dict {whole} B")


if __name__ == "__main__":
    main()
