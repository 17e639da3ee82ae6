"""Building blocks: each a final Equinox module, a pure function of its fields.

Modules act on batched activations `[batch seq ...]` (routing and sharding need the whole batch);
weights are stored in einsum layout (`[in, ..., out]`), cast to the compute dtype where they are used.
"""

from zoo.nn.attention import GQAttention
from zoo.nn.mla import MLAttention
from zoo.nn.mlp import SwiGLU
from zoo.nn.moe import MoE, MoEAux
from zoo.nn.norm import RMSNorm
from zoo.nn.rope import Rope

__all__ = ["GQAttention", "MLAttention", "MoE", "MoEAux", "RMSNorm", "Rope", "SwiGLU"]
