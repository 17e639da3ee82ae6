"""The registry of model families: every family is one module of this package.

A module `zoo/families/<name>.py` defines `FAMILY = FamilyDef(...)`: the family's name (`ModelConfig.family`),
whether it has routed experts (`moe`) or latent attention (`mla`), its Hugging Face mapping (a
`zoo.hf.rules.Family`: model_type, architecture, config.json defaults, read/write, tensor rules) and its
named sizes. Every module here is found by name, so nothing else lists it: `zoo.config` validates
`family` and merges the sizes into `SIZES` (hence Hydra's `model=<size>` options and `python -m zoo.tools.sizes`),
`zoo.hf` loads and saves its checkpoints (`model=hf` included), and the tests parametrize over
`names()` and over the fixtures tests/make_fixtures.py writes. docs/models.md "Adding a family" says how.
A module whose name starts with `_` is no family: families that share code keep it there (`_qwen.py`).
"""

import dataclasses
import functools
import importlib
import pkgutil
from typing import Any, Callable, Optional

from zoo import tags


@dataclasses.dataclass(frozen=True)
class FamilyDef:
    """One family. `hf` is a `zoo.hf.rules.Family` (or None: no checkpoint mapping); `sizes()` returns
    the named `ModelConfig`s, built on demand because building one validates it against this registry."""

    name: str
    moe: bool = False
    mla: bool = False
    hf: Optional[Any] = None
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


# Listed first: Llama and DeepSeek-V3, the two kinds of block the others vary (grouped-query attention
# with a dense MLP; latent attention with routed and shared experts). The rest follow by name.
_FIRST = (tags.LLAMA, tags.DEEPSEEK_V3)


@functools.cache
def _module_names() -> tuple[str, ...]:
    found = [m.name for m in pkgutil.iter_modules(__path__) if not m.name.startswith("_")]
    return tuple(sorted(found, key=lambda n: (_FIRST.index(n) if n in _FIRST else len(_FIRST), n)))


def names() -> tuple[str, ...]:
    """Every family, Llama and DeepSeek-V3 first, then by name; listing them imports nothing."""
    return _module_names()


def get(name: str) -> FamilyDef:
    """The family `name` (importing its module); KeyError when there is none."""
    if name not in _module_names():
        raise KeyError(name)
    family = importlib.import_module(f"{__name__}.{name}").FAMILY
    if family.name != name:
        raise ValueError(f"zoo/families/{name}.py defines family {family.name!r}; the module and the family share one name")
    return family


def registered() -> tuple[FamilyDef, ...]:
    """Every family's definition, in the order of `names()` (importing their modules)."""
    return tuple(get(n) for n in _module_names())


def moe_families() -> tuple[str, ...]:
    return tuple(n for n in names() if get(n).moe)


def mla_families() -> tuple[str, ...]:
    return tuple(n for n in names() if get(n).mla)
