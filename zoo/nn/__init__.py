"""Building blocks: each a final Equinox module, a pure function of its fields (the leaves that two
classes hold are declared once by an abstract base: `zoo.nn.moe_dispatch.ExpertLeaves`).

Modules act on batched activations `[batch seq ...]` (routing and sharding need the whole batch);
weights are stored in einsum layout (`[in, ..., out]`), cast to the compute dtype where they are used.
Importing it defines every block, and so every tag of the vocabulary (`zoo.tags.TAGS`).
"""

from zoo.nn.attention import GQAttention, attend
from zoo.nn.decoder import DecoderBlock  # noqa: F401 - the layer, built of the blocks below (no projection of its own)
from zoo.nn.mla import MLAttention
from zoo.nn.mlp import GatedMLP, SwiGLU
from zoo.nn.moe import MoE, MoEAux
from zoo.nn.norm import RMSNorm
from zoo.nn.rope import Rope

__all__ = ["GQAttention", "GatedMLP", "MLAttention", "MoE", "MoEAux", "RMSNorm", "Rope", "SwiGLU", "attend"]
