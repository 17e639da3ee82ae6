"""Every choice Zoo makes because of the backend it runs on, in one record.

Zoo's maths is the same on every backend; what differs is how it is compiled and which of two
equivalent programs runs faster. Those choices live here, each with the measurement behind it, and
the modules that act on them read `choices(platform)` instead of testing the platform themselves.
train.py prints the record at startup (`describe`). Only XLA:CPU has measured choices: elsewhere
XLA's defaults and the paths a GPU is expected to prefer.

(Not a choice of this record: the attention kernel's `auto`, which
`zoo.nn.attention_kernels.resolve_impl` resolves from what cuDNN supports and `blockwise_from_seq`
below.)
"""

import dataclasses
from typing import Optional

import jax

# XLA:CPU's compile option for LLVM's optimisations off: compiles run several times faster, steps
# slower (docs/benchmarks.md, "Compile time on CPU").
LLVM_OFF = {"xla_backend_optimization_level": 0}


@dataclasses.dataclass(frozen=True)
class BackendChoices:
    platform: str
    # train.py's step: LLVM's optimisations on from this many model FLOPs per run under
    # `xla.cpu_fast_compile=auto` (the faster steps repay the longer compile: train.py's default
    # run compiled in 4.5 -> 7.2 s and stepped in 128 -> 52 ms, even after ~35 steps, ~0.03 TFLOP).
    # None: XLA's default options.
    step_llvm_from_run_flops: Optional[float] = None
    # A model's initialiser (it runs once): LLVM level 1 from this many parameters per device, else
    # level 0; unoptimised, its threefry random numbers run ~5x slower (compile + run: llama_tiny_a
    # 1.8 s at level 0 vs 4.3 s at XLA's default; qwen2_100m 10.1 s at level 0 vs 3.9 s at level 1).
    # None: XLA's defaults.
    init_llvm_from_params: Optional[float] = None
    # The optimizer state's initialiser: LLVM off (a few elementwise ops: the compile is its cost).
    state_init_llvm_off: bool = False
    # Sampling programs: LLVM on from this many parameters under `cpu_fast_compile=auto`, off below:
    # every token runs the whole decode step, and at level 0 its loops (RMSNorm, RoPE, the cache's
    # attention, the argmax over the vocabulary) ran Qwen2.5-0.5B's greedy decoding several times
    # slower, while its compile took about as long at either level. None: XLA's defaults.
    decode_llvm_from_params: Optional[float] = None
    # The token loop runs the layers unrolled over weights sliced out of their stacks once per call,
    # not a scan that slices them out every token (on CPU that slice is a copy of every layer's
    # weights per token: about 1.4 GB of Qwen2.5-0.5B's 2 GB).
    decode_unstacks_layers: bool = False
    # `model.attention_impl=auto` takes the blockwise kernel from this many query positions on. CPU:
    # blockwise took 0.87x of the XLA path's time at T=128 (one tile), 0.50x at 256, 0.19x at 4096.
    # Elsewhere (not measured) from 1024, where the XLA path's float32 scores reach 4 MiB per head.
    blockwise_from_seq: int = 1024
    # The head's float32 weight gradient contracts a transposed copy of the hidden states (rows last)
    # so XLA:CPU's Eigen dot runs it (165 -> 177 GFLOP/s on the 2-core machine; the step 1-3% faster).
    head_grad_rows_last: bool = False
    # Rows per tile of the dropless experts' grouped matmul (zoo.nn.grouped_matmul). CPU: 128 ran a
    # float32 gradient of 4096 rows, 256 x 512, in 0.75x the time of 512-row tiles and 0.56x of
    # 256 with 8 experts (0.71x and 0.79x with 32), timed as docs/notes.md's MoE entry says. Elsewhere
    # not measured: 256.
    grouped_matmul_tile: int = 256

    def describe(self) -> str:
        """One line for train.py's startup output."""
        if self.platform != "cpu":
            return (
                f"backend {self.platform} (zoo.backend): XLA's default compile options; blockwise attention from "
                f"{self.blockwise_from_seq} positions; expert tiles of {self.grouped_matmul_tile} rows"
            )
        return (
            f"backend cpu (zoo.backend): LLVM's optimisations for steps from {self.step_llvm_from_run_flops / 1e12:g} TFLOP per run "
            f"(xla.cpu_fast_compile=auto), initialisers from {self.init_llvm_from_params / 1e6:g}M parameters, sampling from "
            f"{self.decode_llvm_from_params / 1e6:g}M; blockwise attention from {self.blockwise_from_seq} positions; the head's "
            f"float32 gradient rows-last; decoding unrolls the layers; expert tiles of {self.grouped_matmul_tile} rows"
        )


CPU = BackendChoices(
    platform="cpu",
    step_llvm_from_run_flops=5e10,
    init_llvm_from_params=20e6,
    state_init_llvm_off=True,
    decode_llvm_from_params=20e6,
    decode_unstacks_layers=True,
    blockwise_from_seq=256,
    head_grad_rows_last=True,
    grouped_matmul_tile=128,
)


def choices(platform: Optional[str] = None) -> BackendChoices:
    """The record for `platform` ("cpu", "gpu", "tpu"; None: JAX's default backend)."""
    platform = platform or jax.default_backend()
    return CPU if platform == "cpu" else BackendChoices(platform=platform)
