"""Measured FLOP rates per op and shape: how fast a machine runs a layer's matmuls, its routed experts'
grouped matmul and its attention kernel, value and gradient, at the widths a model has.

A large square matmul (`hardware.matmul_flops`) is not how a step runs: on a TPU v5e a 512-wide
projection, the experts' grouped matmul at 512 -> 512 and splash attention at head dim 64 all ran far
below its 183 TFLOP/s (docs/benchmarks.md, "TPU v5e"). `python -m zoo.tools.measure_hardware` times a
grid of shapes per op (`zoo.tools.measure_hardware.measure_op_rates`) into a hardware profile's
`op_rates`; the planner prices each tag's producer at its op's rate (`rate`), interpolated over the
grid. A table is

    {"matmul": {"k": [...], "n": [...], "flops": [[...], ...]},          # flops[i][j]: k[i] x n[j]
     "grouped_matmul": {"impl": ..., "k": [...], "n": [...], "flops": [...]},   # dropless experts
     "capacity_einsum": {"k": [...], "n": [...], "flops": [...]},   # the capacity path's experts
     "attention": {"impl": ..., "seq": [...], "head_dim": [...], "flops": [...]},
     "grouped_matmul_forward": {...}, "attention_forward": {...}}   # the forward alone

with FLOP/s counted as the planner counts FLOPs (forward + backward = 3x the forward; the forward
alone: 1x). Entries may be null (a shape the machine could not run). Other keys (rows, groups, dtype,
...) record how it was measured.

The `_forward` grids price a recompute, which runs an op's forward alone, at a rate of its own: on a
TPU v5e splash's forward ran at 0.72-1.04x the rate of its forward and backward together and megablox's
at 0.54-0.94x (docs/benchmarks.md, "The planner against the chip").
"""

import math
from typing import Any, Optional, Union

# op kind -> the names of its two grid axes
AXES = {
    "matmul": ("k", "n"),
    "grouped_matmul": ("k", "n"),
    "grouped_matmul_forward": ("k", "n"),
    "capacity_einsum": ("k", "n"),
    "attention": ("seq", "head_dim"),
    "attention_forward": ("seq", "head_dim"),
}

# A kind whose forward alone has its own grid: what a recompute (the forward again) is priced at.
FORWARD_KIND = {"attention": "attention_forward", "grouped_matmul": "grouped_matmul_forward"}


def check(table: Any, where: str = "hardware.op_rates") -> Optional[str]:
    """None where `table` is a well-formed op-rate table, else a one-line reason naming the key."""
    if table is None:
        return None
    if not isinstance(table, dict):
        return f"{where}: a mapping of op kinds ({', '.join(AXES)}) to grids, got {type(table).__name__}"
    for kind, grid in table.items():
        if kind not in AXES:
            if isinstance(grid, (dict, list)):
                return f"{where}.{kind}: not an op kind; the kinds are {', '.join(AXES)}"
            continue  # a note on how it was measured (dtype, ...)
        if not isinstance(grid, dict):
            return f"{where}.{kind}: a mapping with {', '.join(AXES[kind])} and flops, got {type(grid).__name__}"
        a, b = AXES[kind]
        for axis in (a, b):
            values = grid.get(axis)
            if not values or not all(isinstance(v, (int, float)) and v > 0 for v in values):
                return f"{where}.{kind}.{axis}: a non-empty list of positive sizes, got {values!r}"
            if list(values) != sorted(set(values)):
                return f"{where}.{kind}.{axis}: sizes in increasing order, got {list(values)}"
        flops = grid.get("flops")
        if not isinstance(flops, list) or len(flops) != len(grid[a]):
            return f"{where}.{kind}.flops: one row per {a} ({len(grid[a])}), got {flops!r:.80}"
        for row in flops:
            if not isinstance(row, list) or len(row) != len(grid[b]):
                return f"{where}.{kind}.flops: each row one FLOP/s per {b} ({len(grid[b])}), got {row!r:.80}"
            if any(v is not None and not (isinstance(v, (int, float)) and v > 0) for v in row):
                return f"{where}.{kind}.flops: positive FLOP/s or null, got {row!r:.80}"
        if all(v is None for row in flops for v in row):
            return f"{where}.{kind}.flops: every entry is null; measure again or leave {kind} out"
    return None


def rate(table: Optional[dict], kind: str, a: Union[int, float], b: Union[int, float]) -> Optional[float]:
    """FLOP/s of op `kind` at grid coordinates (a, b) (matmul: contraction k, output width n;
    attention: sequence length, head dim), interpolated bilinearly in log2 of both axes between the
    measured points and held at the grid's edge beyond it; where a surrounding point is null, the
    nearest measured one. None where the table has no such op."""
    grid = (table or {}).get(kind)
    if not grid:
        return None
    xa, xb = AXES[kind]
    ka, kb = _bracket(grid[xa], a), _bracket(grid[xb], b)
    flops = grid["flops"]
    corners = [(i, j, w_i * w_j) for i, w_i in ka for j, w_j in kb]
    if all(flops[i][j] is not None for i, j, _ in corners):
        # Time, not rate, is what adds up along a path between shapes: interpolate 1 / rate.
        return 1.0 / sum(w / flops[i][j] for i, j, w in corners)
    la, lb = math.log2(a), math.log2(b)
    measured = [
        (abs(math.log2(grid[xa][i]) - la) + abs(math.log2(grid[xb][j]) - lb), flops[i][j])
        for i in range(len(grid[xa]))
        for j in range(len(grid[xb]))
        if flops[i][j] is not None
    ]
    return min(measured)[1]


def _bracket(points, x: Union[int, float]) -> list[tuple[int, float]]:
    """The grid indices around `x` and their weights, linear in log2; clamped at the ends."""
    if x <= points[0]:
        return [(0, 1.0)]
    if x >= points[-1]:
        return [(len(points) - 1, 1.0)]
    hi = next(i for i, p in enumerate(points) if p >= x)
    lo = hi - 1
    t = (math.log2(x) - math.log2(points[lo])) / (math.log2(points[hi]) - math.log2(points[lo]))
    return [(i, w) for i, w in ((lo, 1.0 - t), (hi, t)) if w > 0]
