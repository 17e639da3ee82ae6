"""Offload policies: per named intermediate keep on device, offload to pinned host, or recompute;
parameters and optimizer state in device or pinned host memory.

A policy becomes one `jax.checkpoint` policy applied to the body of every scanned layer stack.
"""

import dataclasses
from typing import Callable, Optional

import jax

from zoo.tags import TAGS, emitted_tags

ACTIONS = ("device", "offload", "remat")
MEMORY_KINDS = ("device", "pinned_host")


@dataclasses.dataclass
class OffloadConfig:
    """`tags`: tag -> device | offload | remat; tags left out are recomputed.

    `checkpoint: false` applies no checkpoint at all: the backward pass keeps every intermediate
    (the `none` preset: fastest, most memory).
    """

    name: str = "none"
    checkpoint: bool = False
    tags: dict[str, str] = dataclasses.field(default_factory=dict)
    params: str = "device"
    opt_state: str = "device"

    def __post_init__(self):
        for tag_name, action in self.tags.items():
            if tag_name not in TAGS:
                raise ValueError(f"offload.tags.{tag_name}: unknown tag; valid tags: {', '.join(TAGS)}")
            if action not in ACTIONS:
                raise ValueError(f"offload.tags.{tag_name}={action!r}: unknown action; choose one of {ACTIONS}")
        for field in ("params", "opt_state"):
            if getattr(self, field) not in MEMORY_KINDS:
                raise ValueError(f"offload.{field}={getattr(self, field)!r}: choose one of {MEMORY_KINDS}")

    def names(self, action: str) -> list[str]:
        return [t for t, a in self.tags.items() if a == action]


def check_tags_emitted(policy: OffloadConfig, model_config) -> None:
    """A policy naming a tag the model never emits would silently do nothing: refuse it."""
    emitted = emitted_tags(model_config)
    missing = [t for t in policy.tags if t not in emitted]
    if missing:
        raise ValueError(
            f"offload.tags.{missing[0]}: the {model_config.family} model never emits this tag; "
            f"it emits: {', '.join(emitted)}"
        )


def remat_policy(policy: OffloadConfig) -> Optional[Callable]:
    """The `jax.checkpoint` policy for the scanned layer body (None: no checkpoint, keep everything)."""
    if not policy.checkpoint:
        return None
    saved, offloaded = policy.names("device"), policy.names("offload")
    cp = jax.checkpoint_policies
    if offloaded:
        return cp.save_and_offload_only_these_names(
            names_which_can_be_saved=saved,
            names_which_can_be_offloaded=offloaded,
            offload_src="device",
            offload_dst="pinned_host",
        )
    if saved:
        return cp.save_only_these_names(*saved)
    return cp.nothing_saveable
