"""Which parametrizations of a per-family check run in the slow tier (`python -m pytest -m slow`).

Qwen2 and Qwen3 are Llama's blocks plus a QKV bias or a Q/K norm, which add no tag; Mixtral's
routing (softmax over the top-k logits) is Qwen3-MoE's (softmax, then the top k renormalised), its
experts the same SwiGLU, without the Q/K norm. A check repeated on them runs in the slow tier (the
inspector's placement under every preset too: they emit the tags of the family they reuse). Their
loss and gradients against transformers (tests/test_hf_families.py) stay in the default run.
"""

import pytest

from zoo import families

# The families that say which family's blocks they reuse (zoo.families.FamilyDef.like).
REPEAT_FAMILIES = tuple(n for n in families.names() if families.get(n).like)


def family_of(name: str) -> str:
    """The family of a size name (`qwen3_tiny_a` -> `qwen3`) or of a family name itself."""
    return name[: -len("_tiny_a")] if name.endswith("_tiny_a") else name


def by_family(names):
    """`names` as pytest parameters, the repeat families' marked slow."""
    return [pytest.param(n, marks=pytest.mark.slow) if family_of(n) in REPEAT_FAMILIES else n for n in names]


# A check of a policy or of one of JAX's transforms rather than of a family's maths (every preset
# equals `none`, forward-mode derivatives) runs on the two kinds of block in the default tier:
# Llama (grouped-query attention, dense MLP) and DeepSeek-V3 (latent attention, routed and shared
# experts); every family in the slow tier. Each family's own maths is checked against transformers
# in the default tier (tests/test_hf_families.py).
CORE_FAMILIES = ("llama", "deepseek_v3")


def by_core_family(names):
    """`names` (tiny size names) as pytest parameters, all but the core families' marked slow."""
    from zoo.families import SIZES

    return [n if SIZES[n].family in CORE_FAMILIES else pytest.param(n, marks=pytest.mark.slow) for n in names]
