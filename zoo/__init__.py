"""Zoo: Llama and DeepSeek-V3 in Equinox, every intermediate named, for training with host offloading.

The names below are the package's face (`zoo.build`, `zoo.SIZES`, ...), each imported from its home on
first use: `import zoo.config` (the ground floor) loads no block and no family, and research code that
imports `zoo.nn` or `zoo.model` pays for nothing else.
"""

import importlib

# name -> the module it lives in (a submodule: the module itself)
_HOMES = {
    "tags": "zoo.tags",
    **dict.fromkeys(("MLAConfig", "ModelConfig", "MoEConfig", "RopeConfig"), "zoo.config"),
    **dict.fromkeys(("count_params", "flops_per_token"), "zoo.counts"),
    **dict.fromkeys(("SIZES", "get_size"), "zoo.families"),
    **dict.fromkeys(("capture", "capture_layers"), "zoo.intermediates"),
    **dict.fromkeys(("CausalLM", "abstract", "build", "loss_fn", "next_token_loss"), "zoo.model"),
}

__all__ = sorted(_HOMES)


def __getattr__(name: str):
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'zoo' has no attribute {name!r}")
    module = importlib.import_module(home)
    value = module if home == f"{__name__}.{name}" else getattr(module, name)
    globals()[name] = value  # the next lookup is a plain attribute
    return value
