"""The registry of model families: every family is one module of this package.

A module `zoo/families/<name>.py` defines its name (`NAME`, the `ModelConfig.family` it answers to) and
`FAMILY = FamilyDef(...)` (zoo.families._family): whether it has routed experts (`moe`) or latent
attention (`mla`), its Hugging Face mapping (a `zoo.families._hf.Family`: model_type, architecture,
config.json defaults, read/write, tensor rules) and its named sizes. Every module here is found by
name, so nothing else lists it: `SIZES` merges the sizes (hence Hydra's `model=<size>` options and
`python -m zoo.tools.sizes`), `check` holds a config to its family's kind (the training run's model
group, the loader), `zoo.hf` loads and saves its checkpoints (`model=hf` included), and the tests
parametrize over `names()` and over the fixtures tests/make_fixtures.py writes. docs/models.md
"Adding a family" says how. A module whose name starts with `_` is no family: what the families share
lives there (`_family.py`, `_hf.py`, `_qwen.py`).

The registry stands above `zoo.config` (a config names its family by a string and knows nothing of
them) and below the loader and the trainer, which read it.
"""

import functools
import importlib
import pkgutil

from zoo.config import ModelConfig
from zoo.families._family import FamilyDef

# Listed first: Llama and DeepSeek-V3, the two kinds of block the others vary (grouped-query attention
# with a dense MLP; latent attention with routed and shared experts). The rest follow by name.
_FIRST = ("llama", "deepseek_v3")


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
    module = importlib.import_module(f"{__name__}.{name}")
    if module.NAME != name or module.FAMILY.name != name:
        raise ValueError(
            f"zoo/families/{name}.py defines family {module.FAMILY.name!r}; the module, its NAME and its family share "
            "one name"
        )
    return module.FAMILY


def registered() -> tuple[FamilyDef, ...]:
    """Every family's definition, in the order of `names()` (importing their modules)."""
    return tuple(get(n) for n in _module_names())


def moe_families() -> tuple[str, ...]:
    return tuple(n for n in names() if get(n).moe)


def mla_families() -> tuple[str, ...]:
    return tuple(n for n in names() if get(n).mla)


def check(c: ModelConfig) -> ModelConfig:
    """`c`, when its family is registered and its sections are the family's kind: latent attention
    (`mla`) and routed experts (`moe`) exactly where the family has them. Otherwise a ValueError naming
    the field, `model.<field>: ...`, as ModelConfig's own rules do. A ModelConfig checks its fields on
    its own; its family is a name only the registry knows."""
    fam = c.family
    if fam not in names():
        raise ValueError(f"model.family: got {fam!r}; choose one of {', '.join(names())}")
    kind = get(fam)
    if kind.mla and c.mla is None:
        raise ValueError(f"model.mla: {fam} needs an mla section")
    if not kind.mla and c.mla is not None:
        raise ValueError(
            f"model.family: {fam} has no mla section; choose a latent-attention family ({', '.join(mla_families())})"
        )
    if kind.moe and c.moe is None:
        raise ValueError(f"model.moe: {fam} needs a moe section")
    if not kind.moe and c.moe is not None:
        raise ValueError(
            f"model.family: {fam} has no moe section; choose a mixture-of-experts family ({', '.join(moe_families())})"
        )
    return c


def _sizes() -> dict[str, ModelConfig]:
    sizes: dict[str, ModelConfig] = {}
    for family in registered():
        for name, size in family.sizes().items():
            if name in sizes:
                raise ValueError(f"zoo/families/{family.name}.py: size {name!r} is already defined")
            if size.family != family.name:
                raise ValueError(f"zoo/families/{family.name}.py: size {name!r} is of family {size.family!r}")
            sizes[name] = check(size)
    return sizes


# Every family's named sizes, in the order of `names()`.
SIZES: dict[str, ModelConfig] = _sizes()


def get_size(name: str) -> ModelConfig:
    if name not in SIZES:
        raise ValueError(f"unknown model size {name!r}; known sizes: {sorted(SIZES)}")
    return SIZES[name]
