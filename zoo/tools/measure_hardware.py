"""Measure this machine's first device: dense matmul rate and host <-> device bandwidth (pinned host
memory), and write a conf/hardware profile the planner and train.py can use.

The link is measured the way a training step uses it: inside one compiled program, a buffer sent to
pinned host memory and brought back, each direction on its own, and the same traffic under a chain of
matmuls (how much of it the device hides behind compute). A plain `jax.device_put` between memory
kinds is measured too, for comparison only: on a TPU v5e it ran device -> host at 0.59 GB/s while a
step's own offloads moved at about 14 GB/s (docs/benchmarks.md, "TPU v5e").

    python -m zoo.tools.measure_hardware [name=measured] [out=conf/hardware/<name>.yaml] [n=...] [dtype=...]
                                   [transfer_mb=256] [repeats=5] [op_rates=true] [op_kinds=[attention]]
                                   [overwrite=false]

It replaces a profile it wrote itself (an earlier `name=measured`), and no other file (a profile shipped in
conf/hardware, a file of the user's) unless overwrite=true is given.

On CPU the "device" and "pinned host" memories are both host RAM: the transfer figure is a memory copy,
honest for this machine and meaningless for a GPU. The numbers are medians of `repeats` timed runs
after one warm-up; the profile's note records what was run.
"""

import dataclasses
import datetime
import math
import pathlib
import statistics
import sys
import time
from typing import Callable, Optional, Sequence

from zoo.offload import conf_dir
from zoo.ranges import ranged
from zoo.tools.kit import check_output, overwrite_asked, run_tool, split_tool_args


# Counts beyond these take hours, not minutes (a chain is unrolled into one program: a billion matmuls never
# finished compiling), and time nothing better.
MAX_REPEATS = 100
MAX_CHAIN = 256
MAX_COPIES = 32


@ranged(
    "",
    n="[16, inf): null takes 8192 on GPU/TPU, 1024 on CPU",
    transfer_mb="(0, inf)",
    repeats=f"[1, {MAX_REPEATS}]: timed runs of each figure, after one warm-up",
    chain=f"[1, {MAX_CHAIN}]: matmuls per timed call, unrolled in one program",
    copies=f"[2, {MAX_COPIES}]: the op once and `copies` times",
)
@dataclasses.dataclass
class MeasureOptions:
    name: str = "measured"
    out: Optional[str] = None  # null: conf/hardware/<name>.yaml
    n: Optional[int] = None  # matmul size n x n x n; null: 8192 on GPU/TPU, 1024 on CPU
    dtype: Optional[str] = None  # null: bfloat16 on GPU/TPU, float32 on CPU
    transfer_mb: float = 256.0
    repeats: int = 5
    chain: int = 8  # matmuls per timed call (amortises dispatch)
    # Each op-rate shape is timed as one program running it once and one running `copies`
    # independent copies; the difference per copy is the op's time inside a program, the call's own
    # dispatch and wait taken out (on a TPU v5e about 0.85 ms a call, more than a narrow matmul's run).
    copies: int = 3
    # Time the ops a layer is made of over a grid of shapes (`measure_op_rates`), the planner's
    # per-op rates; null: on an accelerator (minutes: on a TPU v5e the grid outran a 520 s run), not on a CPU.
    op_rates: Optional[bool] = None
    # Which of those grids (zoo.op_rates.AXES: matmul, grouped_matmul, grouped_matmul_forward,
    # capacity_einsum, attention, attention_forward); null: all. E.g. op_kinds=[attention] to
    # measure one again (on any device).
    op_kinds: Optional[list[str]] = None

    def __post_init__(self):
        if self.dtype is not None and self.dtype not in ("bfloat16", "float16", "float32"):
            raise ValueError(f"dtype: choose bfloat16, float16 or float32, got {self.dtype!r}")
        if not self.name or "/" in self.name:
            raise ValueError(f"name: {self.name!r} is not a file stem; e.g. name=measured")
        from zoo.op_rates import AXES

        unknown = [k for k in self.op_kinds or () if k not in AXES]
        if unknown or self.op_kinds == []:
            raise ValueError(
                f"op_kinds: {unknown[0] if unknown else '[]'} is not an op kind; choose from {', '.join(AXES)}, "
                "e.g. op_kinds=[attention]"
            )


def median_time(fn, repeats: int) -> float:
    fn()  # warm-up (compile, first touch)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure_matmul(n: int, dtype: str, repeats: int = 5, chain: int = 8, device=None) -> float:
    """FLOP/s of a chain of `chain` dependent n x n matmuls, jitted, on `device`."""
    import jax
    import jax.numpy as jnp

    device = device or jax.devices()[0]
    a = jax.device_put(jax.random.normal(jax.random.key(0), (n, n), jnp.float32).astype(dtype) / math.sqrt(n), device)
    b = jax.device_put(jax.random.normal(jax.random.key(1), (n, n), jnp.float32).astype(dtype) / math.sqrt(n), device)

    one = jax.device_put(jnp.ones((), dtype), device)

    @jax.jit
    def f(x, w, one):
        for _ in range(chain):
            # Scaling by a traced 1 keeps each product its own op: with
            # --xla_cpu_experimental_ynn_fusion_type set (train.py's CPU default), XLA:CPU fuses a
            # chain of bare dots into one YNNPACK subgraph that ran 8-12x slower (jax 0.10.2, 1024^3:
            # 256 GFLOP/s for one dot, 21 for a chain of 4), and an optimization barrier does not
            # survive to its fusion pass.
            x = (x @ w) * one
        return x

    t = median_time(lambda: f(a, b, one).block_until_ready(), repeats)
    return 2.0 * n**3 * chain / t


def measure_hbm(mbytes: float, repeats: int = 5, device=None, copies: int = 3) -> float:
    """Device memory bandwidth, GB/s: bytes read plus written by an elementwise op over `mbytes` MB
    arrays, per second, the call's dispatch taken out as the op rates' are (one array against
    `copies` independent ones in one program)."""
    import jax
    import jax.numpy as jnp

    device = device or jax.devices()[0]
    n = int(mbytes * 1e6) // 4
    xs = [jax.device_put(jnp.full((n,), float(i + 1), jnp.float32), device) for i in range(copies)]
    scale = jax.device_put(jnp.float32(0.5), device)
    run = jax.jit(lambda a, *ys: [y * a + 1.0 for y in ys])
    one = median_time(lambda: jax.block_until_ready(run(scale, xs[0])), repeats)
    many = median_time(lambda: jax.block_until_ready(run(scale, *xs)), repeats)
    per_array = (many - one) / (copies - 1) if many > one else many / copies
    return 2 * n * 4 / per_array / 1e9


def measure_link(mbytes: float, repeats: int = 5, device=None) -> tuple[float, float]:
    """(host->device, device->host) GB/s for one array of `mbytes` MB in pinned host memory."""
    import jax
    import numpy as np
    from jax.sharding import SingleDeviceSharding

    device = device or jax.devices()[0]
    kinds = {m.kind for m in device.addressable_memories()}
    if "pinned_host" not in kinds:
        raise RuntimeError(f"device {device} has no pinned_host memory (memories: {sorted(kinds)})")
    host = SingleDeviceSharding(device, memory_kind="pinned_host")
    dev = SingleDeviceSharding(device, memory_kind="device")
    elems = int(mbytes * 1e6 // 4)
    x_host = jax.device_put(np.ones((elems,), np.float32), host)
    x_dev = jax.device_put(x_host, dev)
    jax.block_until_ready((x_host, x_dev))
    nbytes = elems * 4
    h2d = median_time(lambda: jax.device_put(x_host, dev).block_until_ready(), repeats)
    d2h = median_time(lambda: jax.device_put(x_dev, host).block_until_ready(), repeats)
    return nbytes / h2d / 1e9, nbytes / d2h / 1e9


def measure_program_link(
    mbytes: float, repeats: int = 5, device=None, matmul_n: int = 1024, dtype: str = "float32"
) -> dict:
    """The host link inside compiled programs, as a step's offloads use it, for one `mbytes` MB array:

    - `to_device_gbps`: a program whose argument lives in pinned host memory reads it to the device
      (less the same program's time on a device argument);
    - `to_host_gbps`: a program sends a computed buffer to pinned host memory and brings it back
      (offload and reload, as a saved residual travels), less the same program without the
      transfers and less the reload's time;
    - `overlap`: the same round trip under a chain of `matmul_n` matmuls in one program: `exposed_s`
      is what it added to the chain's time, `hidden_fraction` the share of the round trip's own time
      that the compute covered (1: all of it);
    - `duplex`: whether the link carries both directions at once: a program reading one array in
      while sending another out, with nothing between them, against the two directions' own times
      (True where it took less than 3/4 of their sum; None where nothing moves)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import SingleDeviceSharding

    device = device or jax.devices()[0]
    host = SingleDeviceSharding(device, memory_kind="pinned_host")
    dev = SingleDeviceSharding(device, memory_kind="device")
    elems = int(mbytes * 1e6 // 4)
    nbytes = elems * 4
    x_host = jax.device_put(np.ones((elems,), np.float32), host)
    x_dev = jax.device_put(x_host, dev)
    a = jax.device_put(
        jax.random.normal(jax.random.key(0), (matmul_n, matmul_n), jnp.float32).astype(dtype) / math.sqrt(matmul_n), dev
    )

    def round_trip(x):
        on_host = jax.device_put(x * 2, jax.memory.Space.Host)
        return jax.device_put(on_host, jax.memory.Space.Device) + 1

    def chain(a):
        x = a
        for _ in range(16):
            x = (x @ a) * jnp.asarray(1, a.dtype)  # see measure_matmul: one op per product
        return x

    to_device = jax.jit(lambda x: jax.device_put(x, jax.memory.Space.Device) * 2)
    trip = jax.jit(round_trip)
    # the same programs without the transfers: what they cost besides the link
    in_base, trip_base = jax.jit(lambda x: x * 2), jax.jit(lambda x: x * 2 + 1)
    compute = jax.jit(chain)
    both = jax.jit(lambda a, x: (chain(a), round_trip(x)))
    # One array in while another goes out, the two independent; the outgoing one lands in a donated
    # host buffer, as an updated optimizer state does (a fresh host output takes a slower path on a
    # TPU v5e). The pair's base: the same program without moves.
    in_and_out = jax.jit(
        lambda xh, xd, into: (
            jax.device_put(xh, jax.memory.Space.Device) * 2,
            jax.device_put(xd * 2, jax.memory.Space.Host),
        ),
        donate_argnums=2,
    )
    in_and_out_base = jax.jit(lambda xd: (xd * 2, xd * 2))
    jax.block_until_ready((x_host, x_dev, a))
    t_in = median_time(lambda: to_device(x_host).block_until_ready(), repeats)
    t_trip = median_time(lambda: trip(x_dev).block_until_ready(), repeats)
    in_s = max(t_in - median_time(lambda: in_base(x_dev).block_until_ready(), repeats), 1e-9)
    moved_s = max(t_trip - median_time(lambda: trip_base(x_dev).block_until_ready(), repeats), 2e-9)
    # XLA:CPU ignores memory kinds: nothing moves inside its programs, whatever a noisy timing says
    # (both programs do the same work there, so their difference is the machine's jitter).
    moves = device.platform != "cpu" and moved_s > 0.05 * t_trip
    out_s = moved_s - in_s
    if out_s < 0.1 * moved_s:  # the directions cannot be told apart (on a CPU both memories are RAM): halves
        in_s = out_s = moved_s / 2
    pair_s = duplex = None
    if moves:  # on XLA:CPU nothing moves inside a program: nothing to tell
        landing = [jax.device_put(x_host, host)]

        def pair():
            came, landing[0] = in_and_out(x_host, x_dev, landing[0])
            jax.block_until_ready((came, landing[0]))

        t_pair = median_time(pair, repeats)
        pair_s = t_pair - median_time(lambda: jax.block_until_ready(in_and_out_base(x_dev)), repeats)
        duplex = bool(pair_s < 0.75 * (in_s + out_s))
    t_chain = median_time(lambda: compute(a).block_until_ready(), repeats)
    t_both = median_time(lambda: jax.block_until_ready(both(a, x_dev)), repeats)
    exposed = max(0.0, t_both - t_chain)
    return {
        "bytes": nbytes,
        "moves": moves,
        "to_device_gbps": nbytes / in_s / 1e9,
        "to_host_gbps": nbytes / out_s / 1e9,
        "round_trip_s": t_trip,
        "in_and_out_s": pair_s,
        "duplex": duplex,
        "overlap": {
            "matmul_chain_s": t_chain,
            "chain_and_round_trip_s": t_both,
            "exposed_s": exposed,
            "hidden_fraction": max(0.0, min(1.0, 1.0 - exposed / t_trip)),
        },
    }


# The shapes `op_rates` times (see `measure_op_rates`): on an accelerator the widths and lengths
# LLM layers have; on a CPU a small grid (its rates are for this machine's planner, at toy sizes).
OP_GRID = {
    "accelerator": {
        "matmul_rows": 16384,
        "widths": (256, 512, 1024, 2048, 4096, 8192),
        "grouped_rows": 65536,
        "groups": 16,
        "grouped_widths": (256, 512, 1024, 2048, 4096),
        "attention_tokens": 16384,
        "attention_heads": 16,
        "seqs": (1024, 2048, 4096, 8192),
        "head_dims": (64, 96, 128, 192, 256),
    },
    "cpu": {
        "matmul_rows": 1024,
        "widths": (64, 256),
        "grouped_rows": 1024,
        "groups": 4,
        "grouped_widths": (64, 256),
        "attention_tokens": 1024,
        "attention_heads": 2,
        "seqs": (256, 512),
        "head_dims": (32, 64),
    },
}


# The most bytes of arguments the copies of one op-rate shape may take (`measure_op_rates`): room
# beside their outputs on a 16 GB device.
ARGUMENT_BUDGET = 4e9


def value_and_grad_call(fn):
    """fn's value and its inputs' cotangents for a given output cotangent: the forward and backward a
    training step runs, without a loss's own reduction in the timing."""
    import jax

    def run(ct, *args):
        out, pull = jax.vjp(fn, *args)
        return out, pull(ct)

    return run


class _OpTimer:
    """Times one op-rate shape at a time on `device` (`measure_op_rates`): its inputs made once per
    shape and copy, its program run once and as copies, the call's dispatch taken out."""

    def __init__(self, device, dtype, repeats: int, copies: int, log: Callable[[str], None]):
        self.device, self.dtype, self.repeats, self.copies, self.log = device, dtype, repeats, copies, log
        self.inputs: dict = {}
        self.dispatch: list[float] = []  # per shape: one call's time less its op's (what `op_time` takes out)

    def normal(self, shape, copy: int = 0):
        """A standard normal array of `shape`, one per shape, copy and grid: a timing depends on the
        shape only, and every array made eagerly is a compile of its own (on a TPU v5e generating each
        case's inputs afresh took longer than timing it); copies differ, so that XLA cannot merge them."""
        import jax

        if (shape, copy) not in self.inputs:
            with jax.default_device(self.device):
                self.inputs[shape, copy] = jax.random.normal(jax.random.key(len(self.inputs)), shape, self.dtype)
        return self.inputs[shape, copy]

    def timed(self, case, a, b):
        try:
            flops, program = case(a, b)
            return flops / self.op_time(program)
        except Exception as e:  # noqa: BLE001 - a shape this device cannot run is a hole in the table, not the end
            self.log(f"op rates: {type(e).__name__}: {str(e).splitlines()[0][:160]}")
            return None

    def op_time(self, program) -> float:
        """Seconds of one op inside a program: (t(n copies) - t(1 copy)) / (n - 1), the call's
        dispatch and wait (the same for both) taken out; n is `copies`, fewer where the copies'
        arguments would pass ARGUMENT_BUDGET (at least 2). An op whose copies add less than one
        call's time (a narrow matmul: tens of microseconds against a TPU's ~0.85 ms call) is timed
        again with enough copies to add four calls' worth (at most MAX_COPIES): at 3 copies a
        16384 x 256 x 256 matmul's difference was noise (326 TFLOP/s on a 197 TFLOP/s chip). Where
        noise leaves no positive difference, t(n copies) / n (the dispatch shared among the copies)."""
        import jax

        fn, args = program(1)
        one = median_time(lambda: jax.block_until_ready(fn(*args)), self.repeats)
        per_copy = sum(a.size * a.dtype.itemsize for a in args)
        most = max(2, int(ARGUMENT_BUDGET // max(per_copy, 1)))
        n, op = 1, one
        for wanted in (self.copies, MAX_COPIES):
            m = min(most, MAX_COPIES, max(2, wanted if n == 1 else math.ceil(4 * one / max(op, 1e-9)) + 1))
            if m <= n or (n > 1 and (n - 1) * op >= one):
                break
            fn, args = program(m)
            many = median_time(lambda: jax.block_until_ready(fn(*args)), self.repeats)
            n, op = m, (many - one) / (m - 1) if many > one else many / m
        self.dispatch.append(one - op)
        return op

    def grid_of(self, kind: str, axes: tuple, case, **record) -> dict:
        """The table of `kind` over the grid `axes` (two lists), flops[i][j] from `case(axes[0][i],
        axes[1][j]) -> (FLOPs, program)` (`case` below), with `record` (how it was measured)."""
        from zoo import op_rates

        names, table, start = op_rates.AXES[kind], [], time.perf_counter()
        self.inputs.clear()  # the previous grid's arrays: device memory this one may need
        for a in axes[0]:
            self.dispatch.clear()
            table.append([self.timed(case, a, b) for b in axes[1]])
            rates = " ".join(f"{r / 1e12:.3g}" if r else "-" for r in table[-1])
            calls = f"; a call's own dispatch {1e3 * statistics.median(self.dispatch):.2f} ms" if self.dispatch else ""
            self.log(f"op rates: {kind} {names[0]}={a}: {rates} TFLOP/s{calls} ({time.perf_counter() - start:.0f} s)")
        return {**record, names[0]: list(axes[0]), names[1]: list(axes[1]), "flops": table}

    def case(self, fn, forward_flops: float, out_shape, arg_shapes, with_backward: bool = True):
        """(FLOPs, program) of `fn`'s value and gradient (3x its forward FLOPs, the output's cotangent
        first), or of its forward alone; `program(n)` is (a jitted call running n independent copies,
        its arguments)."""
        import jax

        body = value_and_grad_call(fn) if with_backward else fn
        shapes = ([out_shape] if with_backward else []) + list(arg_shapes)

        def program(n: int):
            k = len(shapes)
            run = jax.jit(lambda *flat: [body(*flat[i * k : (i + 1) * k]) for i in range(n)])
            return run, [self.normal(s, i) for i in range(n) for s in shapes]

        return (3.0 if with_backward else 1.0) * forward_flops, program


def _matmul_grids(t: _OpTimer, g: dict, wanted, add) -> None:
    """The dense matmul, the routed experts' grouped matmul (value and gradient, and forward alone) and
    the capacity path's einsum, each over a grid of k x n."""
    import jax
    import jax.numpy as jnp

    from zoo import backend
    from zoo.nn.grouped_matmul import grouped_matmul

    if "matmul" in wanted:
        rows, widths = g["matmul_rows"], g["widths"]
        cell = lambda k, n: t.case(lambda x, w: x @ w, 2.0 * rows * k * n, (rows, n), [(rows, k), (k, n)])  # noqa: E731
        add("matmul", t.grid_of("matmul", (widths, widths), cell, rows=rows))
    rows, groups, widths = g["grouped_rows"], g["groups"], g["grouped_widths"]
    shares = jnp.linspace(0.5, 1.5, groups)  # uneven, as dropless routing is
    sizes = jnp.floor(rows * shares / shares.sum()).astype(jnp.int32)
    sizes = jax.device_put(sizes.at[-1].add(rows - sizes.sum()), t.device)
    choices = backend.choices(t.device.platform)
    impl = choices.grouped_matmul

    def grouped(x, w):
        return grouped_matmul(x, w, sizes, impl=impl, tile=choices.grouped_matmul_tile)

    for kind, with_backward in (("grouped_matmul", True), ("grouped_matmul_forward", False)):
        if kind in wanted:

            def cell(k, n, b=with_backward):
                return t.case(grouped, 2.0 * rows * k * n, (rows, n), [(rows, k), (groups, k, n)], b)

            add(kind, t.grid_of(kind, (widths, widths), cell, impl=impl, rows=rows, groups=groups))
    if "capacity_einsum" in wanted:
        per_group = rows // groups  # the capacity path's buffers: every expert given the same rows

        def capacity(k, n):
            einsum = lambda x, w: jnp.einsum("ecd,edf->ecf", x, w)  # noqa: E731
            flops = 2.0 * per_group * groups * k * n
            return t.case(einsum, flops, (groups, per_group, n), [(groups, per_group, k), (groups, k, n)])

        table = t.grid_of("capacity_einsum", (widths, widths), capacity, rows=per_group * groups, groups=groups)
        add("capacity_einsum", table)


def _attention_grids(t: _OpTimer, g: dict, wanted, add) -> None:
    """Causal self-attention as `model.attention_impl=auto` runs it here, value and gradient and the
    forward alone, over a grid of sequence length x head dim."""
    from zoo.config import attended_keys
    from zoo.nn.attention_kernels import attend, resolve_impl

    tokens, heads, seqs, dims = g["attention_tokens"], g["attention_heads"], g["seqs"], g["head_dims"]
    platform = t.device.platform
    impl = resolve_impl("auto", backend=platform, dtype=t.dtype, qk_dim=dims[0], v_dim=dims[0], seq_len=seqs[-1])

    def attention_case(seq, d, with_backward):
        batch, dv = max(1, tokens // seq), {96: 64, 192: 128}.get(d, d)
        return t.case(
            lambda q, k, v: attend(q, k, v, scale=d**-0.5, impl=impl),
            2.0 * batch * seq * attended_keys(seq, None) * heads * (d + dv),
            (batch, seq, heads, dv),
            [(batch, seq, heads, x) for x in (d, d, dv)],
            with_backward,
        )

    for kind, with_backward in (("attention", True), ("attention_forward", False)):
        if kind in wanted:
            cell = lambda s, d, b=with_backward: attention_case(s, d, b)  # noqa: E731
            add(kind, t.grid_of(kind, (seqs, dims), cell, impl=impl, tokens=tokens, heads=heads))


def measure_op_rates(
    device=None,
    *,
    repeats: int = 5,
    copies: int = 3,
    grid: Optional[dict] = None,
    kinds: Optional[Sequence[str]] = None,
    log: Callable[[str], None] = lambda s: None,
    on_table: Callable[[dict], None] = lambda rates: None,
) -> dict:
    """FLOP/s of value and gradient (forward and backward, 3x the forward's FLOPs) of the ops a layer
    is made of, per shape, in bfloat16 on an accelerator (float32 on a CPU), as the planner counts
    them (zoo.tools.plan, `op_rate`):

    - `matmul`: [rows, k] @ [k, n], a grid of k x n;
    - `grouped_matmul`: the routed experts' grouped matmul as `zoo.backend` runs it on this platform
      (megablox on TPU), `groups` uneven groups summing to `rows`, a grid of k x n;
    - `grouped_matmul_forward`: the same, the forward alone (1x its FLOPs): what recomputing an
      expert's projection costs;
    - `capacity_einsum`: the capacity path's experts, `groups` buffers of rows / groups, a grid of k x n;
    - `attention`: causal self-attention as `model.attention_impl=auto` runs it here (splash on TPU),
      `tokens` = batch x seq, `heads` heads, a grid of seq x head dim (the values' head dim equals the
      queries' but for 96 and 192, MLA's shapes, where it is 64 and 128); FLOPs as the planner counts
      the `context` tag's (`zoo.nn.attention.context_flops`: the causal mean of attended keys);
    - `attention_forward`: the same, the forward alone (1x its FLOPs): what recomputing `context` costs.

    A shape that fails (out of memory, a kernel's limit) is recorded as null, and the planner
    interpolates around it; a grid where every shape failed is left out. `kinds`: the grids to
    measure (None: all); `on_table(rates so far)` after each one, so a caller can keep what a run
    stopped midway has measured."""
    import jax
    import jax.numpy as jnp

    from zoo import op_rates

    device = device or jax.devices()[0]
    accel = device.platform != "cpu"
    g = grid or OP_GRID["accelerator" if accel else "cpu"]
    dtype = jnp.bfloat16 if accel else jnp.float32
    timer = _OpTimer(device, dtype, repeats, copies, log)
    wanted = list(kinds or op_rates.AXES)
    out: dict = {"dtype": str(jnp.dtype(dtype))}

    def add(kind: str, table: dict) -> None:
        if all(v is None for row in table["flops"] for v in row):
            log(f"op rates: {kind}: no shape ran on this device; left out of the table")
        else:
            out[kind] = table
        on_table(dict(out))

    _matmul_grids(timer, g, wanted, add)
    _attention_grids(timer, g, wanted, add)
    return out


def fit_line(opts: MeasureOptions, device, n: int, dtype: str) -> Optional[str]:
    """One line for sizes whose arrays outgrow the memory that holds them, before anything is allocated
    (an n of 200000 was an out-of-memory traceback, a transfer_mb of 1e12 numpy's): the matmul chain's
    operands, product and intermediate (4 x n x n), and the largest set of `transfer_mb` arrays
    (`measure_hbm`'s `copies` inputs and outputs, `measure_program_link`'s four), on the device (a CPU's:
    host RAM); None where they fit or the memory is not known."""
    import numpy as np

    from zoo.train.machine_fit import device_memory_bytes, host_memory_bytes

    accel = device.platform != "cpu"
    memory = device_memory_bytes(device) if accel else host_memory_bytes()
    if not memory:
        return None
    where = (
        f"this {device.platform} device has {memory / 1e9:.1f} GB"
        if accel
        else f"this machine has {memory / 1e9:.1f} GB of host memory (a CPU device's)"
    )
    matmul = 4 * n * n * np.dtype(dtype).itemsize
    if matmul > memory:
        fits = 16
        while 4 * (2 * fits) ** 2 * np.dtype(dtype).itemsize <= memory / 2:
            fits *= 2
        return (
            f"n: a {n}x{n} {dtype} matmul chain holds {matmul / 1e9:.1f} GB (operands, product, intermediate), and "
            f"{where}; give a smaller n, e.g. n={fits}"
        )
    arrays = max(4, 2 * opts.copies * (4 if accel else 1)) * opts.transfer_mb * 1e6
    if arrays > memory:
        return (
            f"transfer_mb: {opts.transfer_mb:g} MB arrays take {arrays / 1e9:.1f} GB at once (the link's four, the "
            f"bandwidth's {opts.copies} copies in and out), and {where}; give a smaller transfer_mb, e.g. "
            "transfer_mb=256"
        )
    return None


def measure(opts: MeasureOptions, write: Callable[[dict], None] = lambda profile: None) -> dict:
    """The profile; `write(profile)` once the matmul rate and the link are measured, and again after
    each op-rate grid (minutes each on an accelerator), so a run stopped midway leaves what it measured."""
    from zoo import op_rates
    from zoo.errors import ConfigError
    from zoo.train.machine_fit import started_devices

    device = started_devices()[0]  # a JAX_PLATFORMS this machine cannot start: one line
    accel = device.platform != "cpu"
    n = opts.n or (8192 if accel else 1024)
    dtype = opts.dtype or ("bfloat16" if accel else "float32")
    line = fit_line(opts, device, n, dtype)
    if line:
        raise ConfigError(line)
    flops = measure_matmul(n, dtype, opts.repeats, opts.chain, device)
    h2d, d2h = measure_link(opts.transfer_mb, opts.repeats, device)
    hbm_mb = opts.transfer_mb * (4 if accel else 1)
    hbm_gbps = measure_hbm(hbm_mb, opts.repeats, device, opts.copies)
    program = measure_program_link(opts.transfer_mb, opts.repeats, device, matmul_n=n, dtype=dtype)
    to_device, to_host = (program["to_device_gbps"], program["to_host_gbps"]) if program["moves"] else (h2d, d2h)
    stats = device.memory_stats() or {}
    hbm = int(stats.get("bytes_limit", 0))
    kind = getattr(device, "device_kind", device.platform)
    when = datetime.date.today().isoformat()
    ov = program["overlap"]

    def profile(rates: Optional[dict], measuring: bool) -> dict:
        kinds = [k for k in rates or {} if k in op_rates.AXES]
        return {
            "name": opts.name,
            "peak_flops": float(flops),
            "matmul_flops": float(flops),
            "hbm_bytes": hbm,
            "hbm_gbps": float(f"{hbm_gbps:.4g}"),
            "host_link_gbps": float(round(min(to_device, to_host), 3)),
            "host_to_device_gbps": float(round(to_device, 3)),
            "device_to_host_gbps": float(round(to_host, 3)),
            **({"host_link_duplex": program["duplex"]} if program["moves"] else {}),
            "nominal": False,
            "note": note
            + (f"; op_rates: per shape (measure_op_rates): {', '.join(kinds)}" if kinds else "")
            + ("; written while op rates were still being measured" if measuring else ""),
            "platform": device.platform,
            **({"op_rates": {k: v for k, v in rates.items() if k in kinds or k == "dtype"}} if kinds else {}),
            "_detail": {
                "h2d_gbps": to_device,
                "d2h_gbps": to_host,
                "plain_h2d_gbps": h2d,
                "plain_d2h_gbps": d2h,
                "overlap": ov,
                "moves": program["moves"],
                "n": n,
                "dtype": dtype,
                "device": str(kind),
            },
        }

    note = (
        f"measured {when} on {kind} ({device.platform}) by zoo.tools.measure_hardware: {n}x{n} {dtype} matmul "
        f"x{opts.chain} "
        f"-> {flops / 1e12:.3f} TFLOP/s; {opts.transfer_mb:g} MB "
        + (
            f"inside a program: host->device {to_device:.2f} GB/s, device->host {to_host:.2f} GB/s, "
            f"{'both directions at once' if program['duplex'] else 'one direction at a time'}, "
            f"{100 * ov['hidden_fraction']:.0f}% of a round trip hidden under matmuls; plain device_put {h2d:.2f} / "
            f"{d2h:.2f} GB/s"
            if program["moves"]
            else (
                f"by plain device_put (inside a program nothing moves): host->device {h2d:.2f}, device->host "
                f"{d2h:.2f} GB/s"
            )
        )
        + f"; device memory {hbm_gbps:.0f} GB/s (read + write, elementwise over {hbm_mb:g} MB)"
        + f"; medians of {opts.repeats}; "
        + ("hbm_bytes from memory_stats bytes_limit" if hbm else "no device memory statistics (hbm_bytes 0)")
        + ("; on CPU both memories are host RAM, so the link figure is a memory copy" if not accel else "")
    )
    if not (opts.op_rates if opts.op_rates is not None else accel or opts.op_kinds is not None):
        return profile(None, False)
    write(profile(None, True))
    rates = measure_op_rates(
        device,
        repeats=opts.repeats,
        copies=opts.copies,
        kinds=opts.op_kinds,
        log=lambda line: print(line, file=sys.stderr),
        on_table=lambda so_far: write(profile(so_far, True)),
    )
    return profile(rates, False)


def to_yaml(profile: dict) -> str:
    import yaml

    body = {k: v for k, v in profile.items() if not k.startswith("_")}
    header = (
        "# Measured by python -m zoo.tools.measure_hardware (see note). peak_flops is the measured matmul rate, not a\n"
        "# datasheet peak, so MFU against this profile is relative to what matmuls reach on this machine.\n"
    )
    return header + yaml.safe_dump(body, sort_keys=False, width=200)


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)

    def body() -> int:
        # Arguments are `key=value` (no prefix); reuse the prefixed parser by adding one.
        bad = [a for a in argv if "=" not in a]
        if bad:
            raise ValueError(
                f"{bad[0]}: arguments are key=value; keys: "
                f"{', '.join(f.name for f in dataclasses.fields(MeasureOptions))}"
            )
        prefixed = [f"measure.{a}" for a in argv]
        try:
            opts, rest = split_tool_args(prefixed, "measure", MeasureOptions)
            overwrite = overwrite_asked(prefixed, "measure")
        except ValueError as e:  # the keys are given without the prefix the parser adds
            raise ValueError(str(e).replace("measure.", "")) from None
        assert not rest
        out = pathlib.Path(opts.out) if opts.out else conf_dir() / "hardware" / f"{opts.name}.yaml"
        # before measuring, not after: writable, and no shipped profile or other file replaced without overwrite=true
        check_output(out, "out" if opts.out else "name", "measure_hardware", "overwrite=true", overwrite)
        profile = measure(opts, write=lambda partial: out.write_text(to_yaml(partial)))
        out.write_text(to_yaml(profile))
        d = profile["_detail"]
        link = (
            f"inside a program host->device {d['h2d_gbps']:.2f} GB/s, device->host {d['d2h_gbps']:.2f} GB/s, "
            f"{100 * d['overlap']['hidden_fraction']:.0f}% of a round trip hidden under matmuls "
            f"(plain device_put {d['plain_h2d_gbps']:.2f} / {d['plain_d2h_gbps']:.2f} GB/s)"
            if d["moves"]
            else f"host->device {d['h2d_gbps']:.2f} GB/s, device->host {d['d2h_gbps']:.2f} GB/s by plain "
            "device_put (inside a program this backend moves nothing)"
        )
        print(
            f"{d['device']}: matmul {d['n']}x{d['n']} {d['dtype']} {profile['matmul_flops'] / 1e12:.3f} TFLOP/s; "
            f"{link}; "
            f"HBM {profile['hbm_bytes'] / 1e9:.1f} GB at {profile['hbm_gbps']:.4g} GB/s"
        )
        print(
            f"wrote {out}; use it with hardware={out.stem}" if out.parent == conf_dir() / "hardware" else f"wrote {out}"
        )
        return 0

    return run_tool(body, "python -m zoo.tools.measure_hardware", argv)


if __name__ == "__main__":
    raise SystemExit(main())
