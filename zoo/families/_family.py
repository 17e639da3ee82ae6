"""`FamilyDef`, what one module of `zoo/families/` defines (its `FAMILY`). It stands apart from the
registry (`zoo.families`), which imports the family modules: they import it, not the registry."""

import dataclasses
from typing import Callable, Optional

from zoo.families._hf import Family


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

    def __post_init__(self):
        if self.mla and not self.moe:
            raise ValueError(f"family {self.name}: mla without moe is not a combination zoo builds")
