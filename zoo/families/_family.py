"""`FamilyDef`, what one module of `zoo/families/` defines (its `FAMILY`), and `sized`, the kit its
named sizes are written with. It stands apart from the registry (`zoo.families`), which imports the
family modules: they import it, not the registry."""

import dataclasses
from typing import Callable, Optional

from zoo.config import ModelConfig, MoEConfig
from zoo.families._hf import Family

# The dimensions of a named size, in the order a model card lists them: vocabulary, hidden width,
# layers, query heads, kv heads, head dim, MLP width, context length (`sized`'s `dims`).
DIMS = (
    "vocab_size",
    "hidden_size",
    "num_layers",
    "num_heads",
    "num_kv_heads",
    "head_dim",
    "intermediate_size",
    "max_position_embeddings",
)


def sized(family: str, dims: tuple, **fields) -> ModelConfig:
    """A named size of `family`: its `dims` (see `DIMS`; a None head dim is ModelConfig's default, as
    latent attention has it) and its other fields."""
    shape = {name: value for name, value in zip(DIMS, dims, strict=True) if value is not None}
    return ModelConfig(family=family, **shape, **fields)


def routed(
    experts: int,
    top_k: int,
    width: int,
    router: str,
    *,
    shared: int = 0,
    groups: int = 1,
    top_groups: int = 1,
    scale: float = 1.0,
    **fields,
) -> MoEConfig:
    """A family's routed experts: `experts` of MLP width `width`, `top_k` per token, a `router` of that
    kind, `shared` shared experts, `groups` expert groups of which the `top_groups` best are searched
    (DeepSeek-V3; by default none, as every other family), the weights scaled by `scale`; and the other
    MoEConfig fields."""
    return MoEConfig(
        n_routed_experts=experts,
        num_experts_per_tok=top_k,
        moe_intermediate_size=width,
        n_shared_experts=shared,
        router=router,
        n_group=groups,
        topk_group=top_groups,
        routed_scaling_factor=scale,
        **fields,
    )


@dataclasses.dataclass(frozen=True)
class Recipe:
    """A named size's training recipe: its peak learning rate and linear warmup (optimizer steps),
    what train.py uses unless optimizer.lr / optimizer.warmup_steps are given, and where they come from."""

    lr: float
    warmup_steps: int
    source: str


# A recipe's value where the model's publisher gives no learning rate: Llama's published peak for the
# nearest of its sizes by the size's published total parameters (Llama 2's 7B 3e-4 and 70B 1.5e-4,
# Llama 3's 405B 8e-5; the boundaries: 22.1B and 168B, their geometric means), with Llama 2's 2,000
# warmup steps. Scaled, not published.
SCALED = "scaled"


def scaled(total_params: float) -> Recipe:
    lr = 3e-4 if total_params <= 22.1e9 else 1.5e-4 if total_params <= 168e9 else 8e-5
    return Recipe(lr, 2000, "scaled: none published; Llama's peak for its size class, Llama 2's warmup")


@dataclasses.dataclass(frozen=True)
class FamilyDef:
    """One family. `hf` is its Hugging Face mapping (None: no checkpoint mapping); `sizes()` returns
    the named `ModelConfig`s, built on demand (the registry checks each against this family)."""

    name: str
    moe: bool = False
    mla: bool = False
    hf: Optional[Family] = None
    sizes: Callable[[], dict] = dict
    # The published parameter counts of its real sizes, held by tests/test_config.py: name ->
    # (total, active or None, relative tolerance, source).
    published: dict = dataclasses.field(default_factory=dict)
    # The family whose blocks it reuses with a flag or two: checks repeated per family run it in the
    # slow tier only (tests/tiers.py), its transformers parity stays in the default one.
    like: Optional[str] = None
    # Its published training routes every token (no capacity drops): `model.moe.impl=capacity` on it
    # prints a note (zoo.train.run.dropless_note).
    dropless: bool = False
    # Its published active parameter counts leave out the embedding table (OpenAI's convention).
    active_without_embedding: bool = False
    # The published sizes' training recipes (size name -> Recipe, or SCALED where none is published):
    # train.py's learning rate and warmup for them unless optimizer.lr / optimizer.warmup_steps are
    # given (docs/training.md, "Recipes"). `recipe(name)` resolves them.
    recipes: dict = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        if self.mla and not self.moe:
            raise ValueError(f"family {self.name}: mla without moe is not a combination zoo builds")
        if not set(self.recipes) <= set(self.published) | {"llama_1b"}:
            raise ValueError(f"family {self.name}: recipes for sizes it does not publish: {sorted(self.recipes)}")

    def recipe(self, size: str) -> Optional[Recipe]:
        """The recipe of the named size (None: it has none)."""
        found = self.recipes.get(size)
        return scaled(self.published[size][0]) if found == SCALED else found
