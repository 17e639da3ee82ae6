"""Hugging Face checkpoints in and out: `from_pretrained`, `load_sharded`, `to_hf_state_dict`,
`save_pretrained`, `config_from_hf`, `config_to_hf`, for every zoo family.

Reads a directory with `config.json` (transformers 5's `rope_parameters` / `layer_types` or the hub's
legacy keys) and one or many `*.safetensors` files (with the index json of a sharded checkpoint),
float or DeepSeek-V3's FP8 blocks (dequantised). Tensors are memory-mapped and each leaf of the zoo
model is read from them in its stacked layout, whole (`from_pretrained`) or one device's slice at a
time (`load_sharded`, which train.py uses), so a checkpoint is never held twice. Layout: `files`
(safetensors), `convert` (which family, config keys, save), `weights` (load), `pretrained` (train.py's
`model=hf` group), `adapters` (LoRA adapters in the peft layout, `zoo.tools.export --adapters-only`).
Each family's own mapping (its config.json keys, defaults and tensor names) is in its file,
`zoo/families/<name>.py`, written with the kit of `zoo/families/_hf.py`; this package reads them
through the registry, `zoo.families`.
"""

from zoo.errors import CheckpointError
from zoo.families._hf import Family, Rule, top_rules
from zoo.hf.convert import (
    block_rules,
    config_from_hf,
    config_to_hf,
    dtype_name,
    families,
    family_of,
    fp8_block,
    save_pretrained,
    supported_model_types,
    to_hf_state_dict,
)
from zoo.hf.files import CheckpointReader, SafetensorsFile, SafetensorsStream, dequantize_blocks, write_safetensors
from zoo.hf.weights import (
    LeafSource,
    capacity_note,
    from_pretrained,
    leaf_sources,
    load_config,
    load_sharded,
    open_checkpoint,
)

__all__ = [
    "CheckpointError",
    "CheckpointReader",
    "Family",
    "LeafSource",
    "Rule",
    "SafetensorsFile",
    "SafetensorsStream",
    "block_rules",
    "capacity_note",
    "config_from_hf",
    "config_to_hf",
    "dequantize_blocks",
    "dtype_name",
    "families",
    "family_of",
    "fp8_block",
    "from_pretrained",
    "leaf_sources",
    "load_config",
    "load_sharded",
    "open_checkpoint",
    "save_pretrained",
    "supported_model_types",
    "to_hf_state_dict",
    "top_rules",
    "write_safetensors",
]
