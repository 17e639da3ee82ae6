"""Collectives of a compiled XLA program, read from its HLO text.

`collectives(compiled.as_text())` lists every all-gather, all-reduce, reduce-scatter, all-to-all,
ragged-all-to-all and collective-permute (async `-start`/`-done` pairs count once) with its operand
and result shapes, its group size, and how many times one run of the program executes it: a
collective inside a `while` body (a `lax.scan`, e.g. over layers or microbatches) runs once per
iteration, and XLA records the trip count of such loops (`known_trip_count`). `summarize` totals
them by kind, which is what a per-step communication report needs.

Text, not an API: the compiled module is what runs (after SPMD partitioning, fusion and
scheduling), and every backend prints it. Collectives over groups of one device move nothing (XLA:CPU
keeps some, e.g. a psum over an axis of size 1) and are marked `trivial`.
"""

import dataclasses
import math
import pathlib
import re
import tempfile
from typing import Any, Iterable, NamedTuple, Optional

from zoo._compat import persistent_cache_bypassed

KINDS = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "ragged-all-to-all", "collective-permute")

_BYTES = {
    "pred": 1,
    "s2": 1,
    "u2": 1,
    "s4": 1,
    "u4": 1,
    "s8": 1,
    "u8": 1,
    "s16": 2,
    "u16": 2,
    "s32": 4,
    "u32": 4,
    "s64": 8,
    "u64": 8,
    "f16": 2,
    "bf16": 2,
    "f32": 4,
    "f64": 8,
    "c64": 8,
    "c128": 16,
}  # sub-byte types counted as one byte each: an upper bound; f8 variants below

_SHAPE = re.compile(r"\b([a-z][a-z0-9]*)\[([0-9,]*)\]")
_COMPUTATION = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*\(.*\)\s*->\s*.*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
_CALLEES = re.compile(r"\b(?:body|condition|to_apply|calls|true_computation|false_computation)=%?([\w.\-]+)")
_BRANCHES = re.compile(r"\bbranch_computations=\{([^}]*)\}")
_TRIP_COUNT = re.compile(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"(\d+)"')


@dataclasses.dataclass(frozen=True)
class Array:
    dtype: str
    dims: tuple[int, ...]

    @property
    def bytes(self) -> int:
        return math.prod(self.dims) * dtype_bytes(self.dtype)

    def __str__(self) -> str:
        return f"{self.dtype}[{','.join(map(str, self.dims))}]"


@dataclasses.dataclass(frozen=True)
class Collective:
    kind: str  # one of KINDS
    name: str  # the instruction's name in the module
    computation: str  # the computation holding it
    operands: tuple[Array, ...]
    results: tuple[Array, ...]
    group_size: Optional[int]  # devices per replica group; None when the text does not say
    executions: int  # per run of the program (loop trip counts multiplied in)
    trip_count_known: bool  # False if some enclosing loop's trip count is unknown (counted once)
    trivial: bool  # every group is a single device: nothing moves
    op_name: str  # jax's metadata op_name ("" when absent)

    @property
    def operand_bytes(self) -> int:
        return sum(a.bytes for a in self.operands)

    @property
    def result_bytes(self) -> int:
        return sum(a.bytes for a in self.results)

    @property
    def bytes(self) -> int:
        """The larger side, per execution: the gathered result of an all-gather, the unscattered input
        of a reduce-scatter, the buffer of an all-reduce / all-to-all / permute."""
        return max(self.operand_bytes, self.result_bytes)

    @property
    def dtypes(self) -> set[str]:
        return {a.dtype for a in self.operands + self.results}


def dtype_bytes(dtype: str) -> int:
    if dtype in _BYTES:
        return _BYTES[dtype]
    if dtype.startswith("f8") or dtype.startswith("f4") or dtype.startswith("f6"):
        return 1
    if dtype in ("token", "tuple", "opaque"):
        return 0
    raise ValueError(f"unknown HLO element type {dtype!r}")


def parse_shapes(text: str) -> tuple[Array, ...]:
    """Every array shape in `text` (a shape or a tuple of shapes); layouts and comments are ignored."""
    text = re.sub(r"\{[^{}]*\}", "", re.sub(r"/\*.*?\*/", "", text))
    return tuple(Array(d, tuple(int(x) for x in dims.split(",") if x)) for d, dims in _SHAPE.findall(text))


def _split_instruction(rhs: str):
    """`<shape> <opcode>(<operands>), attrs` -> (shape text, opcode, operand text, attrs text)."""
    if rhs.startswith("("):
        depth, i = 0, 0
        for i, ch in enumerate(rhs):
            depth += ch == "("
            depth -= ch == ")"
            if depth == 0:
                break
        shape, rest = rhs[: i + 1], rhs[i + 1 :].lstrip()
    else:
        shape, _, rest = rhs.partition(" ")
    m = re.match(r"([a-z][\w\-]*)\(", rest)
    if not m:
        return shape, None, "", rest
    depth, start = 0, m.end() - 1
    end = len(rest)
    for j in range(start, len(rest)):
        depth += rest[j] == "("
        depth -= rest[j] == ")"
        if depth == 0:
            end = j
            break
    return shape, m.group(1), rest[start + 1 : end], rest[end + 1 :]


def _group_size(attrs: str) -> tuple[Optional[int], bool]:
    """(devices per group, whether every group is one device) from replica_groups / source_target_pairs."""
    m = re.search(r"source_target_pairs=\{(.*?)\}\}", attrs)
    if m:
        pairs = re.findall(r"\{(\d+),(\d+)", m.group(1) + "}")
        return None, all(a == b for a, b in pairs)
    m = re.search(r"replica_groups=\{(\{[\d,\s]*\}(?:,\s*\{[\d,\s]*\})*)\}", attrs)
    if m:
        first = re.match(r"\{([\d,\s]*)\}", m.group(1)).group(1)
        size = len([x for x in first.split(",") if x.strip()])
        return size, size == 1
    m = re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", attrs)
    if m:
        sizes = {k.strip("'\" "): int(v) for k, v in re.findall(r"([^,=]+)=(\d+)", m.group(1))}
        size = math.prod(sizes.get(a.strip("'\" "), 1) for a in m.group(2).split(",") if a.strip())
        return size, size == 1
    m = re.search(r"replica_groups=\[([\d,]+)\]<=", attrs)
    if m:
        size = int(m.group(1).split(",")[-1])
        return size, size == 1
    return None, False


@dataclasses.dataclass
class _Instr:
    name: str
    shape: str
    opcode: Optional[str]
    operands: list[str]
    attrs: str
    computation: str
    text: str = ""  # the whole right-hand side, as printed


def _parse(text: str):
    computations: dict[str, list[_Instr]] = {}
    entry = None
    current = None
    for line in text.splitlines():
        header = _COMPUTATION.match(line)
        if header and not line.startswith(" "):
            current = header.group(2)
            computations[current] = []
            if header.group(1):
                entry = current
            continue
        if current is None:
            continue
        if line.strip() == "}":
            current = None
            continue
        m = _INSTRUCTION.match(line)
        if not m:
            continue
        shape, opcode, operands, attrs = _split_instruction(m.group(2))
        computations[current].append(
            _Instr(m.group(1), shape, opcode, re.findall(r"%([\w.\-]+)", operands), attrs, current, m.group(2))
        )
    return computations, entry


_CONDITION = re.compile(r"\bcondition=%?([\w.\-]+)")
_CONSTANT = re.compile(r"\bconstant\((-?\d+)\)")


def _counted_loop_bound(computations: dict[str, list[_Instr]], attrs: str) -> Optional[int]:
    """The trip count of a `lax.scan` / `fori_loop` style while loop before XLA annotates it (as in
    the HLO right after SPMD partitioning): the condition is `counter < N` for a constant N, and
    jax's counters start at 0 and step by 1."""
    m = _CONDITION.search(attrs)
    condition = computations.get(m.group(1), []) if m else []
    constants = {}
    for ins in condition:
        value = _CONSTANT.search(ins.text) if ins.opcode == "constant" else None
        if value:
            constants[ins.name] = int(value.group(1))
    root = condition[-1] if condition else None
    if root is None or root.opcode != "compare" or "direction=LT" not in root.attrs or len(root.operands) != 2:
        return None
    return constants.get(root.operands[1])


def _executions(computations: dict[str, list[_Instr]], entry: Optional[str]) -> tuple[dict[str, int], set[str]]:
    """Runs of each computation per program run, and the computations below a loop of unknown trip count."""
    runs: dict[str, int] = {}
    unknown: set[str] = set()
    if entry is None:
        return {c: 1 for c in computations}, unknown

    def visit(comp: str, times: int, uncertain: bool):
        runs[comp] = runs.get(comp, 0) + times
        if uncertain:
            unknown.add(comp)
        for ins in computations.get(comp, ()):
            callees = _CALLEES.findall(ins.attrs)
            for b in _BRANCHES.findall(ins.attrs):
                callees += re.findall(r"%?([\w.\-]+)", b)
            if not callees:
                continue
            trip, sure = 1, True
            if ins.opcode == "while":
                m = _TRIP_COUNT.search(ins.attrs)
                trip = int(m.group(1)) if m else _counted_loop_bound(computations, ins.attrs)
                trip, sure = (trip, True) if trip is not None else (1, False)
            for callee in callees:
                if callee not in computations:
                    continue
                looped = ins.opcode == "while" and re.search(rf"\bbody=%?{re.escape(callee)}\b", ins.attrs)
                visit(callee, times * (trip if looped else 1), uncertain or (bool(looped) and not sure))

    visit(entry, 1, False)
    return runs, unknown


def collectives(hlo_text: str) -> list[Collective]:
    """Every collective of a compiled module's text (`jax.jit(f).lower(...).compile().as_text()`)."""
    computations, entry = _parse(hlo_text)
    runs, unknown = _executions(computations, entry)
    shapes = {ins.name: ins.shape for instrs in computations.values() for ins in instrs}
    done_of = {}
    for instrs in computations.values():
        for ins in instrs:
            if ins.opcode and ins.opcode.endswith("-done") and ins.operands:
                done_of[ins.operands[0]] = ins
    out = []
    for comp, instrs in computations.items():
        for ins in instrs:
            op = ins.opcode or ""
            kind = op[: -len("-start")] if op.endswith("-start") else op
            if kind not in KINDS:
                continue
            operands = tuple(a for name in ins.operands for a in parse_shapes(shapes.get(name, "")))
            if op.endswith("-start"):
                done = done_of.get(ins.name)
                results = parse_shapes(done.shape) if done is not None else parse_shapes(ins.shape)[len(operands) :]
            else:
                results = parse_shapes(ins.shape)
            group, trivial = _group_size(ins.attrs)
            meta = re.search(r'op_name="([^"]*)"', ins.attrs)
            out.append(
                Collective(
                    kind=kind,
                    name=ins.name,
                    computation=comp,
                    operands=operands,
                    results=results,
                    group_size=group,
                    executions=runs.get(comp, 0),
                    trip_count_known=comp not in unknown,
                    trivial=trivial,
                    op_name=meta.group(1) if meta else "",
                )
            )
    return out


def summarize(found: Iterable[Collective], include_trivial: bool = False) -> dict[str, dict[str, int]]:
    """Per kind: `count` (instructions), `executions` (per program run) and `bytes` (per program run,
    the larger side of each collective times its executions). Kinds that never occur are left out."""
    table: dict[str, dict[str, int]] = {}
    for c in found:
        if c.trivial and not include_trivial:
            continue
        row = table.setdefault(c.kind, {"count": 0, "executions": 0, "bytes": 0})
        row["count"] += 1
        row["executions"] += c.executions
        row["bytes"] += c.bytes * c.executions
    return {k: table[k] for k in KINDS if k in table}


def by_kind_and_dtype(
    found: Iterable[Collective], include_trivial: bool = False
) -> dict[str, dict[str, dict[str, int]]]:
    """`summarize`'s rows split by element type: kind -> dtype (several joined by `+`) -> count,
    executions, bytes per program run."""
    table: dict[str, dict[str, dict[str, int]]] = {}
    for c in found:
        if c.trivial and not include_trivial:
            continue
        row = table.setdefault(c.kind, {}).setdefault(
            "+".join(sorted(c.dtypes)), {"count": 0, "executions": 0, "bytes": 0}
        )
        row["count"] += 1
        row["executions"] += c.executions
        row["bytes"] += c.bytes * c.executions
    return {k: dict(sorted(table[k].items())) for k in KINDS if k in table}


class Dumps(NamedTuple):
    """`compile_with_dumps`'s result: the executable and three of XLA's dumps of it (None where XLA
    wrote none)."""

    compiled: Any
    partitioned: Optional[str]  # the HLO right after SPMD partitioning
    assignment: Optional[str]  # the buffer assignment of the optimised program (`buffer_assignment`)
    live_range: Optional[str]  # its buffers' live ranges over the schedule, and the ones live at the peak


def compile_with_dumps(lowered, compiler_options: Optional[dict] = None, partitioned: bool = True) -> Dumps:
    """`lowered` (a `jax.stages.Lowered`) compiled once with XLA dumping into a temporary directory,
    and three of its dumps read back: the HLO right after SPMD partitioning (`partitioned`; the
    collectives and their dtypes as the partitioner chose them, before any backend-specific rewrite:
    XLA:CPU later widens bf16 collectives to float32, which a GPU does not), the buffer assignment of
    the optimised program (`buffer_assignment` reads it) and its live ranges (`live_at_peak`)."""
    with tempfile.TemporaryDirectory() as d:
        options = dict(compiler_options or {})
        # The pass filter only limits the per-pass dumps; the buffer assignment is written regardless.
        options.update({"xla_dump_to": d, "xla_dump_hlo_pass_re": "spmd-partitioning" if partitioned else "^$"})
        # A program served from JAX's persistent compilation cache would not be compiled, and so dump nothing.
        with persistent_cache_bypassed():
            compiled = lowered.compile(options)
        texts = []
        for pattern in (
            "*after_spmd-partitioning*.txt",
            "*after_optimizations-buffer-assignment.txt",
            "*after_optimizations-live-range.txt",
        ):
            found = sorted(pathlib.Path(d).glob(pattern))
            texts.append(found[-1].read_text() if found else None)
        return Dumps(compiled, texts[0] if partitioned else None, texts[1], texts[2])


def compile_with_partitioned_hlo(lowered, compiler_options: Optional[dict] = None):
    """`(compiled, text)`: `lowered` compiled once, and its HLO text right after SPMD partitioning
    (`compile_with_dumps`). A single-device program is not partitioned: RuntimeError."""
    compiled, text, _, _ = compile_with_dumps(lowered, compiler_options)
    if text is None:
        raise RuntimeError("XLA wrote no HLO after SPMD partitioning (a single-device program is not partitioned)")
    return compiled, text


@dataclasses.dataclass(frozen=True)
class Buffer:
    """One value of a compiled program's buffer assignment: where it lives and what made it."""

    name: str  # the instruction's name in the module (for an argument: its parameter's)
    bytes: int
    kind: str  # "argument", "output", "temp", "thread-local", "constant" or "other"
    shape: str
    op_name: str  # jax's metadata op_name: an argument's path (state['params']...) or the op's scope
    memory_space: int = 0  # XLA's colour: 0 is device memory; host memory has its own (S(5) on GPU)


_ALLOCATION = re.compile(r"^allocation (\d+): size (\d+), (.*):\s*$")
_VALUE = re.compile(r"^\s*value: <\d+ ([\w.\-]+)(?: @[^>]*)?> \(size=(\d+),offset=(\d+)\): (\S+)")
_OP_NAME = re.compile(r'^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=.*?\bmetadata=\{[^}]*?op_name="((?:[^"\\]|\\.)*)"')
_PARAMETER = re.compile(r"^\s*%?([\w.\-]+)\s*=.*?\bparameter\((\d+)\)")


def op_names(hlo_text: str) -> tuple[dict[str, str], dict[int, str]]:
    """(instruction name -> jax's op_name, entry parameter number -> op_name) of a module's text."""
    names, params = {}, {}
    in_entry = False
    for line in hlo_text.splitlines():
        if line.startswith("ENTRY"):
            in_entry = True
        elif line and not line.startswith(" ") and line.strip() != "}":
            in_entry = False
        m = _OP_NAME.match(line)
        if m:
            names[m.group(1)] = m.group(2).replace("\\'", "'").replace('\\"', '"')
        p = _PARAMETER.match(line) if in_entry else None
        if p:
            params[int(p.group(2))] = names.get(p.group(1), p.group(1))
    return names, params


def buffer_assignment(text: str, hlo_text: str = "") -> list[Buffer]:
    """The values of XLA's buffer-assignment dump (`compile_with_dumps`), named by `hlo_text` (the
    compiled module's text: `compiled.as_text()`): one Buffer per argument allocation (named by its
    path), and one per value of every other allocation (values of one temp allocation at different
    offsets or times share its bytes: the allocation's size is the true total)."""
    names, params = op_names(hlo_text)
    out: list[Buffer] = []
    current = None
    for line in text.splitlines():
        a = _ALLOCATION.match(line)
        if a:
            size, attrs = int(a.group(2)), a.group(3)
            colour = re.search(r"\bcolor (\d+)", attrs)
            param = re.search(r"\bparameter (\d+)", attrs)
            if param:
                kind = "argument"
            elif "preallocated-temp" in attrs:
                kind = "temp"
            else:
                kind = next((k for k in ("output", "thread-local", "constant") if k in attrs), "other")
            current = (kind, int(colour.group(1)) if colour else 0)
            if param:
                n = int(param.group(1))
                shape = re.search(r"shape \|([^|]*)\|", attrs)
                out.append(
                    Buffer(f"parameter {n}", size, kind, shape.group(1) if shape else "", params.get(n, ""), current[1])
                )
                current = None  # its values are the parameter itself
            continue
        v = _VALUE.match(line)
        if v and current is not None:
            name = v.group(1)
            out.append(
                Buffer(
                    name,
                    int(v.group(2)),
                    current[0],
                    re.sub(r"\{[^}]*\}$", "", v.group(4)),
                    names.get(name, ""),
                    current[1],
                )
            )
    return out


@dataclasses.dataclass(frozen=True)
class LiveValue:
    """A value live at the peak of XLA's simulation of a compiled program's memory."""

    name: str  # the instruction's name, with the tuple index XLA gives it (`fusion.12{1}`; `{}` dropped)
    bytes: int  # as XLA's live-range dump counts it (its shape's size, before any layout padding)
    op_name: str  # jax's metadata op_name of the instruction ("" when absent)
    argument: bool = False  # one of the program's arguments (an entry parameter)


_PEAK_HEADER = re.compile(r"^\s*Live ranges at (\d+) \(peak\):\s*$")
_PEAK_VALUE = re.compile(r"^\s*([\w.\-]+)(\{[\d,]*\})?: (\d+) bytes")


def live_at_peak(live_range_text: str, hlo_text: str = "") -> list[LiveValue]:
    """The values live at the peak of a compiled program's memory, largest first, from XLA's
    live-range dump (`compile_with_dumps(...).live_range`), named by `hlo_text` (`compiled.as_text()`).
    Unlike the buffer assignment's values, which share their allocation over the step, these are the
    ones that coexist where the program holds the most: arguments included."""
    names, _ = op_names(hlo_text)
    entry = hlo_text[hlo_text.find("\nENTRY") :] if "\nENTRY" in hlo_text else ""
    arguments = {m.group(1) for m in map(_PARAMETER.match, entry.splitlines()[1:]) if m}
    out, inside = [], False
    for line in live_range_text.splitlines():
        if _PEAK_HEADER.match(line):
            inside = True
            continue
        if inside:
            m = _PEAK_VALUE.match(line)
            if not m:
                break
            index = m.group(2) if m.group(2) not in (None, "{}") else ""
            name = m.group(1)
            out.append(LiveValue(name + index, int(m.group(3)), names.get(name, ""), name in arguments))
    return sorted(out, key=lambda v: -v.bytes)


def partitioned_hlo(lowered, compiler_options: Optional[dict] = None) -> str:
    """The HLO text of `lowered` right after SPMD partitioning (see `compile_with_partitioned_hlo`)."""
    return compile_with_partitioned_hlo(lowered, compiler_options)[1]


@dataclasses.dataclass(frozen=True)
class Rematerialized:
    """A value XLA's rematerialization pass computes a second time to stay within its memory limit
    (its clone is named `<value>.remat`): the program the compiler runs holds less than the one
    written, and runs the clone's producer again."""

    name: str  # the clone's name in the module
    result: tuple[Array, ...]
    op_name: str  # jax's metadata op_name ("" when absent)

    @property
    def bytes(self) -> int:
        return sum(a.bytes for a in self.result)


_REMAT = re.compile(r"\.remat\d*$")


def rematerialized(hlo_text: str) -> list[Rematerialized]:
    """The values of a compiled module (`compiled.as_text()`) that XLA rematerialized, each once
    however often its clone runs. JAX's own recomputation (jax.checkpoint) is written in the program
    before XLA sees it and is not listed."""
    out = []
    for instrs in _parse(hlo_text)[0].values():
        for i in instrs:
            if _REMAT.search(i.name):
                name = re.search(r'op_name="([^"]*)"', i.attrs)
                out.append(Rematerialized(i.name, parse_shapes(i.shape), name.group(1) if name else ""))
    return out
