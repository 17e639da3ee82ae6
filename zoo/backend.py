"""Every choice Zoo makes because of the backend it runs on, in one record.

Zoo's maths is the same on every backend; what differs is how it is compiled and which of two
equivalent programs runs faster. Those choices live here, each with the measurement behind it, and
the modules that act on them read `choices(platform)` instead of testing the platform themselves.
train.py prints the record at startup (`describe`). XLA:CPU and TPU have measured choices (TPU:
docs/benchmarks.md, "TPU v5e"); a GPU takes XLA's defaults and the paths it is expected to prefer.

(Not a choice of this record: the attention kernel's `auto`, which
`zoo.nn.attention_kernels.resolve_impl` resolves from `fused_attention` below, what cuDNN supports
and `blockwise_from_seq`.)
"""

import contextlib
import contextvars
import dataclasses
import importlib.util
import os
import pathlib
from collections.abc import Iterator
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
    # How the dropless experts' grouped matmul runs (zoo.nn.grouped_matmul): "tiles" (a loop over
    # tiles of rows, any backend), "megablox" (the Pallas TPU kernel `gmm`, falling back to
    # "ragged_dot" for widths its tiles cannot cut), "ragged_dot" (`lax.ragged_dot`, native on TPU).
    # TPU v5e, value and gradient, bf16 (`python bench/tpu.py --setups kernels`): 16 experts, 32768
    # uneven rows, 512 -> 512: megablox 2.24 ms, ragged_dot 2.21, tiles 6.44; 8 experts, 8192 rows,
    # 4096 -> 8192: megablox 20.1 ms, ragged_dot 31.9 (docs/benchmarks.md, "TPU v5e").
    grouped_matmul: str = "tiles"
    # The fused attention kernel `model.attention_impl=auto` takes where it can run the case (None:
    # none; cuDNN on a GPU is resolve_impl's own rule). TPU: Pallas splash attention, which ran
    # llama_1b's attention (8 x 2048, 32 heads over 8, head dim 64, value and gradient) in 18.0 ms
    # against 20.1 for blockwise and 51.4 for XLA's, and 37.6 / 64.5 ms at 2 x 8192; MLA's heads
    # 10.0 / 14.3 ms (`python bench/tpu.py --setups kernels`).
    fused_attention: Optional[str] = None
    # Splash's backward (zoo.nn.attention_kernels.splash_attention) as one fused dq/dk/dv kernel while
    # the query gradients it writes beyond the one it returns stay within this many bytes, else as two
    # kernels (dq; then dk and dv), which compute the scores once more but write one dq. The fused kernel
    # writes a partial dq per block of keys (kv_len / block copies, summed after the kernel, in the
    # queries' dtype, head dim in whole lanes of 128). TPU v5e, one DeepSeek-V3 layer (MLA: 128 heads,
    # qk 192) at 2 x 4096, compiled for the chip: four partials of 0.54 GB, 2.15 GB live at the step's
    # peak, which was in that kernel (MaxText runs the two kernels: docs/benchmarks.md, "Against
    # MaxText"). llama_1b at 8 x 2048 (0.13 GB more) ran its attention's value and gradient fused in
    # 13.2 ms against 17.0 for the two kernels (blocks of 512). None: always fused, the TPU's default:
    # on the chip, that DeepSeek-V3 layer with a 1 GiB limit (two kernels) peaked at 13.39 GB against
    # 14.70 fused, and its step took 327.4 ms against 298.2 under `none` (405.4 against 394.4 under
    # `full`; `python bench/peer_maxtext.py --shapes dsv3_4096`): a batch that fits only with the two
    # kernels is where a limit pays.
    splash_fused_backward_max_bytes: Optional[int] = None
    # The random-number generator of the parameters' initialiser (jax.random.key's `impl`; None: JAX's
    # default, threefry). TPU: "rbg", XLA's RngBitGenerator: on a v5e llama_1b's 4-layer initialiser
    # compiled in 8.5-8.7 s against 19.6-20.3 s with threefry (alternated, two rounds; both ran in
    # 0.02-0.03 s), so Trainer.init took 7.6 s. Other bits than threefry's, from the same
    # distributions; a LoRA run's base keeps threefry (a checkpoint rebuilds it from the seed on any
    # machine).
    init_prng: Optional[str] = None
    # The chunked loss's transient as the compiler allocates it (zoo.plan.working_set.loss_working_bytes):
    # the float32 [rows, chunk, vocabulary] buffers of one chunk it keeps at once, and whether the
    # head's gradient accumulates in the gradient's own buffer (no separate float32 accumulator, the
    # head's cast to the compute dtype fused into its matmuls). TPU v5e: one buffer, in place (the
    # compiled peaks of llama_1b's layers at 6, 8 and 12 x 2048 with chunks of 512 are the state, the
    # kept residuals and 0.97-1.04 of one chunk; growing the chunk from 512 to 1024 rows added 0.95 of
    # one: docs/benchmarks.md, "TPU v5e"). CPU: 1.75 buffers and a separate accumulator (llama_100m at
    # 8 x 512, float32: XLA:CPU's temp grew by 1.74 buffers from chunks of 256 to 512). Elsewhere
    # not measured: one buffer, the accumulator and the cast counted.
    loss_chunk_buffers: float = 1.0
    head_gradient_in_place: bool = False
    # How the compiler stores an activation: the elements of its two minor dimensions in whole tiles
    # of this many (zoo.plan.pricing counts a kept tag's bytes so). TPU: 8 x 128. Every kept tag in the
    # v5e's compiled buffers fits it (XLA's memory-usage report of the step, llama_1b and dsv3_100m):
    # llama_1b's [..., 32, 64] queries take their own size, its [..., 8, 64] keys and values twice it,
    # dsv3_100m's [..., 8, 96] queries 4/3 and [..., 8, 64] keys and values twice, its [..., 4096, 160]
    # and [..., 4096, 512] tensors their own size. 1: stored as they are.
    layout_tile_elements: int = 1

    def describe(self) -> str:
        """One line for train.py's startup output."""
        if self.platform != "cpu":
            fused = f"{self.fused_attention} attention where it runs the case, else " if self.fused_attention else ""
            return (
                f"backend {self.platform} (zoo.backend): XLA's default compile options; {fused}blockwise attention "
                "from "
                f"{self.blockwise_from_seq} positions; routed experts' grouped matmul: {self.grouped_matmul}"
                + (f" (tiles of {self.grouped_matmul_tile} rows)" if self.grouped_matmul == "tiles" else "")
            )
        return (
            f"backend cpu (zoo.backend): LLVM's optimisations for steps from {self.step_llvm_from_run_flops / 1e12:g} "
            "TFLOP per run "
            f"(xla.cpu_fast_compile=auto), initialisers from {self.init_llvm_from_params / 1e6:g}M parameters, "
            "sampling from "
            f"{self.decode_llvm_from_params / 1e6:g}M; blockwise attention from {self.blockwise_from_seq} positions; "
            "the head's "
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
    loss_chunk_buffers=1.75,
)


TPU = BackendChoices(
    platform="tpu",
    grouped_matmul="megablox",
    fused_attention="splash",
    init_prng="rbg",
    head_gradient_in_place=True,
    layout_tile_elements=8 * 128,
)


def choices(platform: Optional[str] = None) -> BackendChoices:
    """The record for `platform` ("cpu", "gpu", "tpu"; None: the platform being traced for,
    `target_platform`)."""
    platform = platform or target_platform()
    return {"cpu": CPU, "tpu": TPU}.get(platform) or BackendChoices(platform=platform)


_TARGET: contextvars.ContextVar[Optional[str]] = contextvars.ContextVar("zoo_target_platform", default=None)


def target_platform() -> str:
    """The platform the program being traced is for: JAX's default backend, or the one
    `lowering_for` names (a TPU program compiled ahead of time on a machine without one)."""
    return _TARGET.get() or jax.default_backend()


@contextlib.contextmanager
def lowering_for(platform: str) -> Iterator[None]:
    """While tracing inside this block, the backend choices and kernels are those of `platform`
    (`jax.jit(...).lower(...)` on abstract values placed on that platform's devices, e.g. a TPU
    topology from `jax.experimental.topologies`)."""
    token = _TARGET.set(platform)
    try:
        yield
    finally:
        _TARGET.reset(token)


def expected_platform(environ=os.environ) -> str:
    """The platform JAX will start on ("cpu", "gpu", "tpu"), told before it starts (XLA reads its
    flags once, when the first backend starts, so the flags a backend does not read are left out
    from the start): JAX_PLATFORMS' first entry if set, else a TPU where libtpu is installed and the
    machine has TPU chips, a GPU where a CUDA plugin is installed, else the CPU."""
    wanted = [p.strip() for p in environ.get("JAX_PLATFORMS", "").split(",") if p.strip()]
    if wanted:
        return {"cuda": "gpu", "rocm": "gpu"}.get(wanted[0], wanted[0])
    if (libtpu_installed() or environ.get("TPU_LIBRARY_PATH")) and _has_tpu_chips():
        return "tpu"
    if any(importlib.util.find_spec(m) is not None for m in ("jax_cuda13_plugin", "jax_cuda12_plugin")):
        return "gpu"
    return "cpu"


def libtpu_installed() -> bool:
    """Whether the TPU compiler's package is importable as a package: a directory named `libtpu`
    without one (a `pip install --target` folder, say, found from the working directory) is a
    namespace package JAX cannot start a TPU from."""
    try:
        spec = importlib.util.find_spec("libtpu")
    except (ImportError, ValueError):
        return False
    return spec is not None and spec.origin is not None


def _has_tpu_chips() -> bool:
    """TPU chips show as /dev/accel* (v4 and later) or /dev/vfio/* (v5e and later, some images)."""
    dev = pathlib.Path("/dev")
    return any(dev.glob("accel*")) or any(p.name != "vfio" for p in (dev / "vfio").glob("*"))


# --- Pallas TPU kernels on another backend --------------------------------------------------------

_INTERPRET: contextvars.ContextVar[bool] = contextvars.ContextVar("zoo_pallas_interpret", default=False)


@contextlib.contextmanager
def pallas_interpreted() -> Iterator[None]:
    """While tracing inside this block, the Pallas TPU kernels (splash attention, megablox's grouped
    matmul) may be chosen on any backend and run in Pallas' interpret mode: the same kernels, as
    slow XLA loops. How the CPU tests check them against the XLA paths; never a speed choice."""
    token = _INTERPRET.set(True)
    try:
        yield
    finally:
        _INTERPRET.reset(token)


def pallas_interpret(platform: Optional[str] = None) -> Optional[bool]:
    """How a Pallas TPU kernel runs here: False compiled (on a TPU), True interpreted (inside
    `pallas_interpreted`), None not at all (another backend)."""
    platform = platform or target_platform()
    if platform == "tpu":
        return False
    return True if _INTERPRET.get() else None
