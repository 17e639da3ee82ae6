"""Building blocks: each a final Equinox module, a pure function of its fields.

Modules act on batched activations `[batch seq ...]` (routing and sharding need the whole batch);
weights are stored in einsum layout (`[in, ..., out]`), cast to the compute dtype where they are used.
"""

from zoo.nn.attention import GQAttention, attend
from zoo.nn.mla import MLAttention
from zoo.nn.mlp import GatedMLP, SwiGLU
from zoo.nn.moe import MoE, MoEAux
from zoo.nn.norm import RMSNorm
from zoo.nn.rope import Rope

__all__ = ["GQAttention", "GatedMLP", "MLAttention", "MoE", "MoEAux", "RMSNorm", "Rope", "SwiGLU", "attend"]
