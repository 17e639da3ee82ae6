"""`python -m zoo.tools.sizes`: every named size with its family, shape and parameter counts (total and
active per token), as a Markdown table. `python -m zoo.tools.sizes <name> ...` prints only those rows."""

import sys

from zoo.config import ModelConfig
from zoo.counts import count_params
from zoo.families import SIZES


def _count(n: int) -> str:
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6)):
        if n >= scale:
            return f"{n / scale:.2f}{unit}"
    return f"{n / 1e3:.1f}K"


def describe(c: ModelConfig) -> str:
    """The blocks that set the family apart, in a few words."""
    parts = ["MLA" if c.uses_mla else f"GQA {c.num_heads}/{c.num_kv_heads}"]
    if c.moe is not None:
        parts.append(f"MoE {c.moe.num_experts_per_tok}/{c.moe.n_routed_experts} ({c.moe.router})")
    if c.sliding_window is not None:
        parts.append(f"window {c.sliding_window}")
    return ", ".join(parts)


def table(names: list[str]) -> str:
    rows = [
        "| size | family | layers | hidden | blocks | total | active |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name in names:
        c = SIZES[name]
        total, active = count_params(c), count_params(c, active=True)
        rows.append(
            f"| `{name}` | {c.family} | {c.num_layers} | {c.hidden_size} | {describe(c)} | {_count(total)} | "
            f"{_count(active)} |"
        )
    return "\n".join(rows)


def main(argv: list[str]) -> int:
    unknown = [n for n in argv if n not in SIZES]
    if unknown:
        print(f"error: {unknown[0]}: no such size; choose from {', '.join(SIZES)}", file=sys.stderr)
        return 2
    print(table(argv or list(SIZES)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
