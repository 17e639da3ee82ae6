"""Offload policies: per named intermediate keep on device, offload to pinned host, or recompute;
parameters and optimizer state in device or pinned host memory.

A policy becomes one `jax.checkpoint` policy applied to every decoder layer of the scanned stacks;
`ranges` gives layer ranges a preset of their own (`layer_policies`), each range then scanned on its own.

Two maps name the tags:
- `tags`: tag -> action, for tags every model emits (the layer input and the attention tags).
  Strict: a tag the model never emits is an error.
- `block_tags`: block kind -> {tag -> action}, for tags of blocks a model may lack (`zoo.tags`):
  `mlp` (dense MLPs: dense layers, DeepSeek's shared experts), `mla` (latent attention), `moe`
  (routed experts). A model applies the sections of the blocks it has and ignores the others, so one
  preset (`minimal`, `deepseek_mla_moe_offload`, ...) serves every family. A section holds only its
  own kind's tags, so a misspelled or misplaced name is still an error, never a no-op. Entries of
  `tags` win over `block_tags`.

Placement rules, which `zoo.tools.inspect_step` reads back from the traced program and the tests hold it to:
- `offload` -> the forward pass copies the tag to pinned host and the backward pass copies it back;
- `device` -> the tag is a residual of the forward scan on device;
- `remat` (and tags left out) -> the backward pass recomputes the tag;
- two exceptions, both structural: `decoder_layer_input` is the input of the checkpointed layer, which
  the scan keeps anyway, so `remat` keeps it on device (`offload` moves it, and with it the scan
  carry, to host); `mlpwo` only feeds the residual add, so the backward pass never reads it and
  keeping or offloading it would do nothing: asking for that is an error (with sandwich norms, as in
  Gemma 3, a norm reads it and it is a tag like the others).
- `checkpoint: false` (the `none` preset) applies no checkpoint: nothing is recomputed, and the
  backward pass keeps whatever it reads, which for some tags is a value derived from them.
"""

import dataclasses
import pathlib
import re
from typing import Any, Callable, NamedTuple, Optional, Sequence, Union

import jax

from zoo.model import RangedPolicy, abstract, split_stacks
from zoo.sharding import leaf_declaration
from zoo.tags import DECODER_LAYER_INPUT, OPTIONAL_KINDS, TAGS, block_kinds, emitted_tags


ACTIONS = ("device", "offload", "remat")
MEMORY_KINDS = ("device", "pinned_host")
# What `expected_placement` says without a checkpoint: not recomputed, not on host; the inspector
# finds `device` (the value itself is a residual) or `unread` (a value derived from it is).
KEPT = "kept"


def backward_never_reads(model_config) -> tuple[str, ...]:
    """The tags this model's backward pass never reads, so that saving or offloading them would be a
    silent no-op (refused): a block's output that only feeds the residual add (its block declares it,
    `TagInfo.only_feeds_residual`: `mlpwo`), unless a norm after the block (Gemma 3's sandwich norms)
    reads it."""
    if getattr(model_config, "sandwich_norms", False):
        return ()
    return tuple(t.name for t in TAGS.values() if t.only_feeds_residual)


# Tags that are the input of the checkpointed layer body: kept by the scan unless offloaded.
CHECKPOINT_INPUTS = (DECODER_LAYER_INPUT,)


def _valid_tags() -> str:
    return ", ".join(TAGS)


def _check_action(key: str, tag_name: str, action) -> None:
    if tag_name not in TAGS:
        import difflib

        near = difflib.get_close_matches(str(tag_name), list(TAGS), n=1, cutoff=0.75)
        hint = f" (did you mean {near[0]}?)" if near else ""
        raise ValueError(f"{key}: unknown tag{hint}; valid tags: {_valid_tags()}")
    if action not in ACTIONS:
        raise ValueError(f"{key}: {action!r} is not an action; choose one of {', '.join(ACTIONS)}")


def _check_read(key: str, tag_name: str, action, model_config) -> None:
    if tag_name in backward_never_reads(model_config) and action != "remat":
        raise ValueError(
            f"{key}={action}: the backward pass never reads {tag_name} (it only feeds the residual add), "
            f"so there is nothing to keep or offload; leave it out or set it to remat"
        )


@dataclasses.dataclass
class OffloadConfig:
    """`tags`: tag -> device | offload | remat; tags left out are recomputed.

    `block_tags`: block kind (mlp, mla, moe) -> {tag -> action} for tags of that kind of block,
    applied to models that have it (see the module docstring). `checkpoint: false` applies no
    checkpoint at all: the backward pass keeps every intermediate it reads (the `none` preset:
    fastest, most memory). `params` / `opt_state`: the memory kind the train state's arrays live in
    between steps.
    """

    name: str = "none"
    checkpoint: bool = False
    tags: dict[str, str] = dataclasses.field(default_factory=dict)
    block_tags: dict[str, dict[str, str]] = dataclasses.field(default_factory=dict)
    params: str = "device"
    opt_state: str = "device"
    # Layer range ("first-last", 0-based, inclusive; or one layer "n") -> the name of a conf/offload
    # preset, or the path of a policy file ending in .yaml (`range_file`), whose activation policy
    # those layers run under (`parse_ranges`); other layers run under
    # this config's. Keys may be ints (Hydra reads `{4: full}` so), hence Any.
    ranges: dict[Any, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        self.ranges = {str(k): v for k, v in (self.ranges or {}).items()}
        range_configs(self)  # the ranges' syntax, overlaps and presets (no model needed)
        for tag_name, action in self.tags.items():
            _check_action(f"offload.tags.{tag_name}", tag_name, action)
        for kind, section in self.block_tags.items():
            if kind not in OPTIONAL_KINDS:
                raise ValueError(
                    f"offload.block_tags.{kind}: unknown block kind; choose one of {', '.join(OPTIONAL_KINDS)} "
                    f"(tags every model emits go under offload.tags)"
                )
            for tag_name, action in (section or {}).items():
                key = f"offload.block_tags.{kind}.{tag_name}"
                _check_action(key, tag_name, action)
                owner = TAGS[tag_name].block
                if owner != kind:
                    where = "offload.tags" if owner not in OPTIONAL_KINDS else f"offload.block_tags.{owner}"
                    raise ValueError(
                        f"{key}: {tag_name} belongs to the {owner} block, not {kind}; move it under {where}"
                    )
        for field in ("params", "opt_state"):
            if getattr(self, field) not in MEMORY_KINDS:
                raise ValueError(
                    f"offload.{field}: {getattr(self, field)!r} is not a memory kind; choose one of "
                    f"{', '.join(MEMORY_KINDS)}"
                )
        if not self.checkpoint and (self.tags or any(self.block_tags.values())):
            named = next((f"tags.{t}" for t in self.tags), None) or next(
                f"block_tags.{kind}.{t}" for kind, s in self.block_tags.items() for t in (s or {})
            )
            raise ValueError(
                f"offload.{named}: with offload.checkpoint=false nothing is recomputed and every tag is kept, "
                f"so per-tag actions would be ignored; set offload.checkpoint=true"
            )

    def names(self, action: str) -> list[str]:
        """Tags of `tags` with this action (block_tags not included; see `actions`)."""
        return [t for t, a in self.tags.items() if a == action]

    def actions(self, kinds: Optional[tuple[str, ...]] = None) -> dict[str, str]:
        """The named tags' actions: the `block_tags` sections of `kinds` overlaid by `tags`. Without
        kinds, every section (they name disjoint tags, so the union is well defined)."""
        merged: dict[str, str] = {}
        for kind, section in self.block_tags.items():
            if kinds is None or kind in kinds:
                merged.update(section or {})
        merged.update(self.tags)
        return merged

    def describe(self) -> str:
        memory = [f"{f} on {getattr(self, f)}" for f in ("params", "opt_state") if getattr(self, f) != "device"]
        ranged = [f"layers {r.key} {r.preset}" for r in parse_ranges(self.ranges)]
        return " + ".join([self.name, *ranged, *memory])

    def without_ranges(self) -> "OffloadConfig":
        """This config's own policy, for the layers outside every range."""
        return dataclasses.replace(self, ranges={})


# --- a policy per layer range ------------------------------------------------------------------


class LayerRange(NamedTuple):
    """One entry of `offload.ranges`: layers first .. last (inclusive) run under `preset`."""

    key: str  # as written: "0-3", "5"
    first: int
    last: int
    preset: str


_RANGE = re.compile(r"^\s*(\d+)\s*(?:-\s*(\d+)\s*)?$")


def parse_ranges(ranges: dict) -> list[LayerRange]:
    """`offload.ranges` -> its ranges sorted by first layer; ValueError (one line naming the key) on
    a malformed range, a preset that is not a name, or overlapping ranges."""
    out = []
    for key, preset in (ranges or {}).items():
        key = str(key)
        m = _RANGE.match(key)
        if not m or (m.group(2) is not None and int(m.group(2)) < int(m.group(1))):
            raise ValueError(
                f"offload.ranges.{key}: not a layer range; write first-last (0-based, inclusive, first <= last) or "
                "one layer, "
                f"e.g. +offload.ranges={{0-3:llama_qkv_offload}}"
            )
        if not isinstance(preset, str) or not preset:
            raise ValueError(
                f"offload.ranges.{key}: {preset!r} is not a preset name; give one of {', '.join(preset_names())}"
            )
        first = int(m.group(1))
        last = first if m.group(2) is None else int(m.group(2))
        out.append(LayerRange(key, first, last, preset))
    out.sort(key=lambda r: r.first)
    for a, b in zip(out, out[1:]):
        if b.first <= a.last:
            raise ValueError(
                f"offload.ranges.{b.key}: overlaps offload.ranges.{a.key} (layer {b.first}); make the ranges disjoint, "
                f"e.g. {a.key}: {a.preset} and {max(a.last + 1, b.first)}-{max(a.last + 1, b.last)}: {b.preset}"
            )
    return out


def range_configs(policy: OffloadConfig) -> list[tuple[LayerRange, OffloadConfig]]:
    """Each range of `policy.ranges` with the OffloadConfig of its preset, loaded from conf/offload as
    the top-level one is (`load_preset`: unknown keys, tags and actions are errors). Only the
    activation policy is the range's: parameters and optimizer state live where the top level says
    (`offload.params`, `offload.opt_state`: one choice for the whole model), so a preset that sets only
    those (a modifier: `params_host`, `optimizer_host`) is refused, as is a preset with ranges of its own."""
    from omegaconf import OmegaConf

    if not policy.ranges:
        return []
    out = []
    available = preset_names()
    for r in parse_ranges(policy.ranges):
        path = range_file(r)
        if path is None and r.preset not in available:
            raise ValueError(
                f"offload.ranges.{r.key}: unknown preset {r.preset!r}; choose one of {', '.join(available)}, "
                f"or give a policy file ending in .yaml"
            )
        try:
            raw = OmegaConf.to_container(OmegaConf.load(path or conf_dir() / "offload" / f"{r.preset}.yaml")) or {}
        except Exception as e:  # a file that is not YAML, or not a mapping
            raise ValueError(
                f"offload.ranges.{r.key}: {r.preset} is not a YAML mapping ({type(e).__name__}); give an offload "
                "policy file"
            ) from None
        if not isinstance(raw, dict):
            raise ValueError(f"offload.ranges.{r.key}: {r.preset} is not a YAML mapping; give an offload policy file")
        if "checkpoint" not in raw:
            raise ValueError(
                f"offload.ranges.{r.key}: {r.preset} only sets where parameters or optimizer state live, one choice "
                "for the "
                "whole model; give the range an activation preset (e.g. full) and set offload.params / "
                "offload.opt_state instead"
            )
        if raw.get("ranges"):
            raise ValueError(
                f"offload.ranges.{r.key}: preset {r.preset} has ranges of its own; give the range a preset without "
                "offload.ranges"
            )
        try:
            if path is None:
                config = load_preset(r.preset, params=policy.params, opt_state=policy.opt_state)
            else:
                config = from_mapping(
                    {k: v for k, v in raw.items() if k != "defaults"}
                    | {"params": policy.params, "opt_state": policy.opt_state}
                )
        except ValueError as e:
            raise ValueError(f"offload.ranges.{r.key}: preset {r.preset}: {str(e).splitlines()[0]}") from None
        out.append((r, config))
    return out


def range_file(r: LayerRange):
    """The policy file a range names (a value ending in `.yaml`: a path, e.g. one `python -m zoo.tools.plan
    plan.split=true` wrote), or None for a preset name. A missing file is a ValueError naming the key."""
    if not r.preset.endswith(".yaml"):
        return None
    path = pathlib.Path(r.preset).expanduser()
    if not path.is_file():
        raise ValueError(
            f"offload.ranges.{r.key}: no file {r.preset}; give an existing offload policy YAML (e.g. one "
            "zoo.tools.plan wrote) or a preset name"
        )
    return path


def check_ranges(policy: OffloadConfig, model_config) -> None:
    """The ranges against the model: each within its layers, and each range's policy valid for it
    (`check_tags_emitted`, as for a whole-model policy)."""
    n = model_config.num_layers
    for r, config in range_configs(policy):
        if r.last >= n:
            raise ValueError(
                f"offload.ranges.{r.key}: layer {r.last} is past the model's last layer (the {model_config.family} "
                "model has "
                f"{n} layers, 0-{n - 1}); keep every range within 0-{n - 1}"
            )
        try:
            check_tags_emitted(config, model_config)
        except ValueError as e:
            raise ValueError(f"offload.ranges.{r.key}: preset {r.preset}: {str(e).splitlines()[0]}") from None


class LayerPolicy(NamedTuple):
    """The layers first .. stop - 1 run under `config` (its `jax.checkpoint` policy: `remat`);
    `label` says where it comes from: `offload.ranges.<key>` or `offload` (the top level)."""

    first: int
    stop: int
    config: OffloadConfig
    label: str


def layer_policies(policy: OffloadConfig, num_layers: int) -> list[LayerPolicy]:
    """Every layer's policy, as consecutive segments covering 0 .. num_layers - 1: the ranges' and,
    between them, the top level's. Without ranges, one segment."""
    out, at = [], 0
    top = policy.without_ranges()
    for r, config in range_configs(policy):
        if r.first > at:
            out.append(LayerPolicy(at, r.first, top, "offload"))
        out.append(LayerPolicy(r.first, min(r.last + 1, num_layers), config, f"offload.ranges.{r.key}"))
        at = r.last + 1
    if at < num_layers:
        out.append(LayerPolicy(at, num_layers, top, "offload"))
    return [p for p in out if p.first < p.stop]


def check_tags_emitted(policy: OffloadConfig, model_config) -> None:
    """A policy naming a tag the model never emits would silently do nothing: refuse it.

    `remat` is the exception: it restates the default, so it changes nothing either way.
    """
    emitted = emitted_tags(model_config)
    for t, a in policy.tags.items():
        _check_read(f"offload.tags.{t}", t, a, model_config)
    for kind in block_kinds(model_config):
        for t, a in (policy.block_tags.get(kind) or {}).items():
            _check_read(f"offload.block_tags.{kind}.{t}", t, a, model_config)
    missing = [t for t, a in policy.tags.items() if t not in emitted and a != "remat"]
    if missing:
        t = missing[0]
        kind = TAGS[t].block
        # For a policy shared by several models (a preset); a model without such blocks ignores the section.
        hint = (
            f"; tags of optional blocks go under offload.block_tags.{kind}, for the models that have {kind} blocks"
            if kind in OPTIONAL_KINDS
            else ""
        )
        raise ValueError(
            f"offload.tags.{t}: the {model_config.family} model never emits this tag; "
            f"it emits: {', '.join(emitted)}{hint}"
        )
    if policy.ranges:
        check_ranges(policy, model_config)


def dropped_block_tags(policy: OffloadConfig, model_config) -> list[str]:
    """Entries of the model's own block sections that this configuration does not emit
    (`q_lora_rank: null` has no query_wa_proj / mla_q). They are ignored for this model; tools print them."""
    emitted = emitted_tags(model_config)
    kinds = block_kinds(model_config)
    return [
        t
        for k, section in policy.block_tags.items()
        if k in kinds
        for t in (section or {})
        if t not in emitted and t not in policy.tags
    ]


def resolve(policy: OffloadConfig, model_config) -> dict[str, str]:
    """Validate the policy against the model and return its action for every emitted tag.

    With `checkpoint: false` every tag is `device` (kept: nothing is recomputed).
    """
    check_tags_emitted(policy, model_config)
    emitted = emitted_tags(model_config)
    if not policy.checkpoint:
        return {t: "device" for t in emitted}
    named = policy.actions(block_kinds(model_config))
    return {t: named.get(t, "remat") for t in emitted}


def expected_placement(policy: OffloadConfig, model_config) -> dict[str, str]:
    """Where each emitted tag should end up in the backward pass (the rules of the module docstring).

    For `checkpoint: false` the answer is `kept` for every tag: not recomputed, not on host; the
    inspector then reports `device` or `unread` (the backward keeps a value derived from the tag).
    """
    actions = resolve(policy, model_config)
    if not policy.checkpoint:
        return {t: KEPT for t in actions}
    out = {}
    for t, a in actions.items():
        if t in backward_never_reads(model_config):
            out[t] = "unread"
        elif a == "offload":
            out[t] = "host"
        elif a == "device" or t in CHECKPOINT_INPUTS:
            out[t] = "device"
        else:
            out[t] = "recomputed"
    return out


def placement_matches(expected: str, found: str) -> bool:
    """Whether the inspector's finding satisfies `expected_placement`'s answer."""
    if expected == KEPT:
        return found in ("device", "unread")
    return expected == found


def keep_all_but_transfers(prim, *_, **__) -> bool:
    """The policy of `checkpoint: false` with parameters in host memory: save every intermediate the
    backward reads (as no checkpoint would), except the layer's weights brought to the device
    (`device_put`) and their casts (`convert_element_type`), which the backward pass redoes. Without
    it the backward would keep every layer's device copy of its weights alive at once."""
    return prim.name not in ("device_put", "convert_element_type")


def layer_weight_shapes(model_config) -> frozenset:
    """The shapes of one layer's matmul weights (the leaves their blocks declare `zoo.sharding.compute`,
    the ones cast to the compute dtype), without the stacks' leading layer axis; empty when the model computes in its
    parameters' dtype (nothing is cast)."""
    import numpy as np

    if np.dtype(model_config.compute_dtype) == np.dtype(model_config.param_dtype):
        return frozenset()
    layers = tuple(s.layers for s in abstract(model_config).stacks)
    leaves = jax.tree_util.tree_leaves_with_path(layers)
    return frozenset(tuple(x.shape[1:]) for path, x in leaves if leaf_declaration(layers, path).compute)


def keep_all_but_weight_casts(weight_shapes: frozenset) -> Callable:
    """The policy of `checkpoint: false` for a model that computes in another dtype than its
    parameters' (bfloat16 compute, float32 master weights): save every intermediate the backward reads,
    as no checkpoint would, except the casts of the layer's weights (`layer_weight_shapes`), which the
    backward does again from the weights the layer scan holds anyway. Kept, they are a second,
    compute-dtype copy of every layer's weights among the residuals, written layer by layer into
    stacked buffers (docs/benchmarks.md). A cast of an activation that has a weight's shape by chance
    is recomputed too, which costs a pass, not a result."""

    def policy(prim, *avals, **_) -> bool:
        # The cast, and the constraint that pins it to the weight's sharding (zoo.sharding.cast_for_compute).
        return not (
            prim.name in ("convert_element_type", "sharding_constraint") and tuple(avals[0].shape) in weight_shapes
        )

    return policy


def remat_policy(
    policy: OffloadConfig, model_config=None, *, weights_of=None
) -> Optional[Union[Callable, RangedPolicy]]:
    """The `jax.checkpoint` policy for the scanned layer body (None: no checkpoint, keep everything;
    with parameters in host memory, `keep_all_but_transfers`; for a model that casts its weights to
    another compute dtype, `keep_all_but_weight_casts`).

    With `model_config`, the policy is validated against the model first (`resolve`). `weights_of`
    (default: `model_config`) is the model whose weight casts `checkpoint: false` recomputes.

    With `offload.ranges`, a `RangedPolicy`: each layer segment's policy (`layer_policies`); it needs
    the model (`model_config` or `weights_of`) for the layer count.
    """
    if policy.ranges:
        model = model_config if model_config is not None else weights_of
        if model is None:
            raise ValueError(
                "offload.ranges: the policy of a layer range needs the model; pass model_config or weights_of"
            )
        if model_config is not None:
            resolve(policy, model_config)
        return RangedPolicy(
            tuple(
                (p.first, p.stop, remat_policy(p.config, model_config, weights_of=weights_of))
                for p in layer_policies(policy, model.num_layers)
            )
        )
    if not policy.checkpoint:
        if policy.params == "pinned_host":
            return keep_all_but_transfers
        weights_of = weights_of if weights_of is not None else model_config
        shapes = layer_weight_shapes(weights_of) if weights_of is not None else frozenset()
        return keep_all_but_weight_casts(shapes) if shapes else None
    if model_config is not None:
        resolve(policy, model_config)
    actions = policy.actions(None if model_config is None else block_kinds(model_config))
    saved = [t for t, a in actions.items() if a == "device"]
    offloaded = [t for t, a in actions.items() if a == "offload"]
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


def scan_policies(policy: OffloadConfig, model) -> list[tuple[str, LayerPolicy]]:
    """Per forward scan of the trainer's step, in program order: its name (the stack's, or a cut
    piece's `<stack>[<first>-<last>]`) and the policy its layers run under. `model`: a CausalLM,
    abstract or not."""
    segments = layer_policies(policy, model.config.num_layers)
    if len(segments) == 1:
        return [(s.name, segments[0]) for s in model.stacks]
    pieces = split_stacks(model.stacks, [(p.first, p.stop, p) for p in segments])
    return [(piece.name, p) for piece, p in pieces]


# --- presets -----------------------------------------------------------------------------------


def conf_dir():
    """The repository's Hydra config directory (`conf/`)."""
    return pathlib.Path(__file__).resolve().parent.parent / "conf"


def preset_names() -> list[str]:
    """The presets of the `conf/offload` group (file stems), sorted."""
    return sorted(p.stem for p in (conf_dir() / "offload").glob("*.yaml"))


def from_mapping(d) -> OffloadConfig:
    """An OffloadConfig from a plain or OmegaConf mapping; unknown keys are an error naming the key."""
    from omegaconf import DictConfig, OmegaConf

    if isinstance(d, DictConfig):
        d = OmegaConf.to_container(d, resolve=True)
    d = {k: v for k, v in dict(d).items() if k != "defaults"}
    fields = {f.name for f in dataclasses.fields(OffloadConfig)}
    if "family_tags" in d:
        raise ValueError(
            "offload.family_tags: replaced by offload.block_tags (sections per block kind: mlp, mla, moe, so one "
            "policy serves every family); move e.g. family_tags.deepseek_v3.mla_kv to block_tags.mla.mla_kv"
        )
    unknown = [k for k in d if k not in fields]
    if unknown:
        raise ValueError(f"offload.{unknown[0]}: unknown key; the keys are {', '.join(sorted(fields))}")
    d = dict(d)
    d["tags"] = dict(d.get("tags") or {})
    d["block_tags"] = {k: dict(v or {}) for k, v in (d.get("block_tags") or {}).items()}
    return OffloadConfig(**d)


# The preset whose tags the command line names without Hydra's `+` (`custom_tag_overrides`).
CUSTOM = "custom"
_TAG_KEY = re.compile(r"^offload\.(tags\.[^.=]+|block_tags\.[^.=]+\.[^.=]+)=")


def custom_tag_overrides(overrides: Sequence[str]) -> list[str]:
    """The command line's overrides, each `offload.tags.<tag>=...` and `offload.block_tags.<kind>.<tag>=...`
    made Hydra's add-or-override (`++`) where the chosen offload option includes `custom`: that preset lists
    no tag, so any tag a block declares (its `EMITS`) is set as `offload=custom offload.tags.<tag>=offload`,
    with no preset file naming it. The tag, its action and whether the model emits it are checked as for any
    policy (`OffloadConfig`, `check_tags_emitted`). train.py and the tools (`zoo.tools.kit.compose`) call this
    before Hydra composes; other options keep Hydra's rule (a key the option does not list needs `+`)."""
    overrides = [str(o) for o in overrides]
    chosen = [o.split("=", 1)[1] for o in overrides if o.lstrip("+").split("=", 1)[0] == "offload" and "=" in o]
    if not chosen or CUSTOM not in re.split(r"[\s,\[\]]+", chosen[-1]):
        return overrides
    return [f"++{o}" if _TAG_KEY.match(o) else o for o in overrides]


def load_preset(*names: str, **overrides) -> OffloadConfig:
    """Merge the presets `names` of conf/offload in order (as Hydra does for `offload=[a,b]`), then
    apply `overrides` (top-level keys). Without Hydra: for tests and research code."""
    from omegaconf import OmegaConf

    available = preset_names()
    merged = OmegaConf.create({})
    for n in names:
        if n not in available:
            raise ValueError(f"offload={n}: unknown preset; choose one of {', '.join(available)}")
        loaded = OmegaConf.load(conf_dir() / "offload" / f"{n}.yaml")
        loaded = {k: v for k, v in OmegaConf.to_container(loaded).items() if k != "defaults"}
        merged = OmegaConf.merge(merged, loaded)
    merged = OmegaConf.merge(merged, overrides)
    return from_mapping(merged)


def policy_from_label(label: str) -> OffloadConfig:
    """The policy a label names, `preset[+preset...][:tag=action,...]` (as the benchmarks and
    `plan.measure` name policies: `minimal:context=device`, `full+optimizer_host`): the presets merged
    in order (`load_preset`), then each tag's action; named by the label."""
    presets, _, actions = label.partition(":")
    o = load_preset(*presets.split("+"))
    tags = dict(o.tags)
    for item in filter(None, actions.split(",")):
        tag, sep, action = item.partition("=")
        if not sep:
            raise ValueError(f"{label}: {item!r} is not tag=action (e.g. {presets}:context=offload)")
        tags[tag] = action
    return dataclasses.replace(o, name=label, tags=tags)
