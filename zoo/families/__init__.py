"""The registry of model families: a family outside the built-in eight is one module of this package.

A module `zoo/families/<name>.py` defines `FAMILY = FamilyDef(...)`: the family's name (`ModelConfig.family`),
whether it has routed experts (`moe`) or latent attention (`mla`), its Hugging Face mapping (a
`zoo.hf.rules.Family`: model_type, architecture, config.json defaults, read/write, tensor rules) and its
named sizes. Every module here is found by name, so nothing else lists it: `zoo.config` validates
`family` and merges the sizes into `SIZES` (hence Hydra's `model=<size>` options and `python -m zoo.sizes`),
`zoo.hf` loads and saves its checkpoints (`model=hf` included), and the tests parametrize over
`names()` and over the fixtures tests/make_fixtures.py writes. docs/models.md "Adding a family" says how.

The eight families that came before the registry keep their flags below, their Hugging Face mapping in
`zoo/hf/<family>.py` and their sizes in `zoo.config.SIZES`; they are moved here one at a time, each move
changing no traced program.
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
    # prints a note (zoo.nn.moe.capacity_note).
    dropless: bool = False
    # Its published active parameter counts leave out the embedding table (OpenAI's convention).
    active_without_embedding: bool = False

    def __post_init__(self):
        if self.mla and not self.moe:
            raise ValueError(f"family {self.name}: mla without moe is not a combination zoo builds")


# The built-in families' flags: (name, moe, mla, like, dropless). The families moved into a file of
# their own (gemma3.py, gpt_oss.py, mistral.py, mixtral.py) follow them in `names()`.
_BUILTIN = (
    (tags.LLAMA, False, False, None, False),
    (tags.DEEPSEEK_V3, True, True, None, True),
    (tags.QWEN2, False, False, tags.LLAMA, False),  # + q/k/v biases
    (tags.QWEN3, False, False, tags.LLAMA, False),  # + q/k norms
    (tags.QWEN3_MOE, True, False, None, True),
)


@functools.cache
def _module_names() -> tuple[str, ...]:
    return tuple(m.name for m in pkgutil.iter_modules(__path__) if not m.name.startswith("_"))


def names() -> tuple[str, ...]:
    """Every family, the built-in ones first; listing them imports nothing."""
    return tuple(n for n, *_ in _BUILTIN) + _module_names()


def get(name: str) -> FamilyDef:
    """The family `name` (importing its module); KeyError when there is none."""
    for n, moe, mla, like, dropless in _BUILTIN:
        if n == name:
            return FamilyDef(n, moe=moe, mla=mla, like=like, dropless=dropless)
    if name not in _module_names():
        raise KeyError(name)
    family = importlib.import_module(f"{__name__}.{name}").FAMILY
    if family.name != name:
        raise ValueError(f"zoo/families/{name}.py defines family {family.name!r}; the module and the family share one name")
    return family


def registered() -> tuple[FamilyDef, ...]:
    """The families defined by modules of this package (the built-in ones are not among them)."""
    return tuple(get(n) for n in _module_names())


def moe_families() -> tuple[str, ...]:
    return tuple(n for n in names() if get(n).moe)


def mla_families() -> tuple[str, ...]:
    return tuple(n for n in names() if get(n).mla)
