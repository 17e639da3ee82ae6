"""Zoo: Llama and DeepSeek-V3 in Equinox, every intermediate named, for training with host offloading."""

from zoo import tags
from zoo.config import SIZES, MLAConfig, ModelConfig, MoEConfig, RopeConfig, count_params, flops_per_token, get_size
from zoo.intermediates import capture, capture_layers
from zoo.model import CausalLM, abstract, build, loss_fn, next_token_loss

__all__ = [
    "SIZES", "CausalLM", "MLAConfig", "ModelConfig", "MoEConfig", "RopeConfig", "abstract", "build", "capture",
    "capture_layers", "count_params", "flops_per_token", "get_size", "loss_fn", "next_token_loss", "tags",
]
