"""zoo.model.plan_stacks judges every start of every period at once; it cuts any layer pattern as the
search over every candidate cut does (kept here as the reference), and a deep config in linear time."""

import random

from zoo.config import LayerSpec
from zoo.model import _runs, plan_stacks

KINDS = [
    LayerSpec(None, False, False),
    LayerSpec(None, False, True),
    LayerSpec(4, True, False),
    LayerSpec(4, False, True),
]


def reference(specs, max_period=8):
    """Every candidate cut, built and compared: quadratic in the layers."""
    n = len(specs)
    candidates = [_runs(specs, 0, n)]
    for p in range(2, min(max_period, n) + 1):
        for a in range(n):
            r = 0
            while a + (r + 1) * p <= n and list(specs[a + r * p : a + (r + 1) * p]) == list(specs[a : a + p]):
                r += 1
            if r >= 2:
                candidates.append(_runs(specs, 0, a) + [(a, p, r)] + _runs(specs, a + r * p, n))
    return min(candidates, key=lambda segs: (len(segs), sum(p for _, p, _ in segs)))


def test_the_cut_is_the_reference_searchs():
    rng = random.Random(0)
    for _ in range(200):
        kinds = KINDS[: rng.randint(1, 4)]
        pattern = [rng.choice(kinds) for _ in range(rng.randint(1, 7))]
        head = [rng.choice(kinds) for _ in range(rng.randint(0, 3))]
        tail = [rng.choice(kinds) for _ in range(rng.randint(0, 3))]
        body = (pattern * 10)[: rng.randint(0, 40)] if rng.random() < 0.6 else [rng.choice(kinds) for _ in range(30)]
        specs = head + body + tail
        assert plan_stacks(specs) == reference(specs), specs


def test_a_deep_config_is_cut_as_a_shallow_one_of_its_pattern():
    """DeepSeek-V3's shape (dense layers, then dense and MoE alternating) 100,000 layers deep: the
    reference would take hours."""
    dense, moe = KINDS[0], KINDS[1]
    shallow = reference([dense] * 3 + [dense, moe] * 20)
    assert plan_stacks([dense] * 3 + [dense, moe] * 50_000) == [(a, p, r if r < 20 else 50_000) for a, p, r in shallow]
