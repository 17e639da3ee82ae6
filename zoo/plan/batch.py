"""The batch searched with the policy (plan.batch_search=true): per candidate per-device batch, the
fastest assignment that fits (or `none`, where it fits and is faster), and the batch with the most
tokens per second per device. Memory grows with the batch, so the search stops at the first batch
nothing fits. MaxText's estimator searches the batch for fit alone and assumes offloading is faster;
this one prices each batch's policy with the same cost model as the plan."""

import dataclasses
import math
from typing import Callable, Optional

from zoo.plan.problem import Estimate, Infeasible, Problem, fmt_bytes
from zoo.plan.search import describe, search


@dataclasses.dataclass
class BatchRow:
    """One per-device batch: the plan's estimate there (None: nothing fits), and whether it is `none`."""

    batch: int
    estimate: Optional[Estimate]
    none: bool = False
    seq: int = 1

    @property
    def tokens_per_s(self) -> float:
        return self.batch * self.seq / self.estimate.time_s if self.estimate else 0.0


def batch_candidates(limit: int = 4096) -> list[int]:
    """1, 2, 3, 4, 6, 8, 12, 16, ...: each power of two and the midpoint above it, up to `limit`."""
    out, b = [], 1
    while b <= limit:
        out.append(b)
        if b >= 2 and b + b // 2 <= limit:
            out.append(b + b // 2)
        b *= 2
    return sorted(set(out))


def search_batches(
    problem_at: Callable[[int], tuple[Problem, Optional[Estimate]]], seq: int, limit: int = 4096, echo=print
) -> list[BatchRow]:
    """`problem_at(b)`: the problem at per-device batch b and `none`'s estimate there (None where it is
    not priced apart). Every candidate batch up to the first where nothing fits."""
    rows = []
    for b in batch_candidates(limit):
        p, none = problem_at(b)
        try:
            e = search(p)
        except Infeasible:
            e = None
        use_none = (
            none is not None
            and none.peak_bytes <= p.budget
            and none.host_bytes <= p.host_budget
            and (e is None or none.time_s < 0.99 * e.time_s)
        )
        rows.append(BatchRow(b, none if use_none else e, use_none, seq))
        echo(
            f"batch {b}: "
            + (f"{rows[-1].tokens_per_s:.0f} tokens/s per device" if rows[-1].estimate else "nothing fits")
        )
        if rows[-1].estimate is None:
            break
    return rows


def best_batch(rows: list[BatchRow]) -> Optional[BatchRow]:
    """The row with the most tokens per second; of those within 0.5% of it, the largest batch (what the
    estimate does not price, a step's fixed costs and the optimizer update, it spreads over more tokens)."""
    fits = [r for r in rows if r.estimate is not None]
    if not fits:
        return None
    top = max(r.tokens_per_s for r in fits)
    return max((r for r in fits if r.tokens_per_s >= 0.995 * top), key=lambda r: r.batch)


def batch_table(rows: list[BatchRow], budget: float) -> str:
    pick = best_batch(rows)
    lines = [f"the batch searched (per device, HBM budget {fmt_bytes(budget)}):"]
    table = [("", "batch", "estimated step", "tokens/s per device", "HBM peak", "policy")]
    for r in rows:
        e = r.estimate
        table.append(
            (
                "*" if r is pick else "",
                str(r.batch),
                f"{1e3 * e.time_s:.1f} ms" if e else "-",
                f"{r.tokens_per_s:.0f}" if e else "-",
                fmt_bytes(e.peak_bytes) if e else "-",
                ("none (nothing checkpointed)" if r.none else describe(e.assignment)) if e else "nothing fits",
            )
        )
    widths = [max(len(t[i]) for t in table) for i in range(len(table[0]))]
    lines += ["  ".join(v.ljust(w) for v, w in zip(t, widths)).rstrip() for t in table]
    return "\n".join(lines)


def per_device_to_global(batch: int, global_now: int, per_device_now: int) -> int:
    """The data.batch_size that gives `batch` per device, from a composed run's pair."""
    return batch * max(1, math.ceil(global_now / max(1, per_device_now)))
