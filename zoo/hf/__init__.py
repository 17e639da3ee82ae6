"""Hugging Face checkpoints in and out: `from_pretrained`, `to_hf_state_dict`, `save_pretrained`,
`config_from_hf`, `config_to_hf`, for every zoo family.

Reads a directory with `config.json` (transformers 5's `rope_parameters` / `layer_types` or the hub's
legacy keys) and one or many `*.safetensors` files (with the index json of a sharded checkpoint).
Tensors are memory-mapped and copied once, leaf by leaf, into the stacked layout of the zoo model, so
a checkpoint is never held twice. Layout: `files` (safetensors), `convert` (config keys, tensor rules,
load and save shared by all families) and one module per family: `llama`, `deepseek_v3`, `qwen`
(Qwen2, Qwen3, Qwen3-MoE), `mixtral`, `gemma3`, `gpt_oss`.
"""

from zoo.hf.convert import (
    Family, Rule, block_rules, config_from_hf, config_to_hf, families, family_of, from_pretrained, load_config,
    save_pretrained, supported_model_types, to_hf_state_dict, top_rules,
)
from zoo.hf.files import CheckpointError, CheckpointReader, SafetensorsFile, write_safetensors

__all__ = [
    "CheckpointError", "CheckpointReader", "Family", "Rule", "SafetensorsFile", "block_rules", "config_from_hf",
    "config_to_hf", "families", "family_of", "from_pretrained", "load_config", "save_pretrained",
    "supported_model_types", "to_hf_state_dict", "top_rules", "write_safetensors",
]
