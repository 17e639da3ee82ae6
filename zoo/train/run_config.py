"""Structured configs of train.py's groups and the validation that turns any bad input into one line.

Each Hydra group (`conf/<group>/*.yaml`) is merged into its dataclass here; unknown keys, wrong types
and failed `__post_init__` checks become a `ConfigError` whose message is
`<key>: <what is wrong>; <fix>`. `validate` then runs the cross-group checks (mesh against the device
count, batch against the data-parallel size, sequence against the model's context, tags the offload
policy names, every parameter dim against its mesh axes) before JAX compiles anything.
"""

import dataclasses
import importlib.util
import math
from typing import Any, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException, ValidationError

from zoo import families
from zoo.config import ModelConfig
from zoo.errors import ConfigError  # noqa: F401 (re-exported: every tool catches it from here)
from zoo.hf.pretrained import PretrainedSource, check_weights, fit_tokenizer, hf_option, model_from_node
from zoo.lora import LoraConfig
from zoo.lora import check as check_lora
from zoo.nn.attention_kernels import min_blockwise_seq, resolve_impl
from zoo.nn.moe import resolve_moe_impl
from zoo.offload import OffloadConfig, check_tags_emitted
from zoo.ranges import ranged

# The hardware profile's schema lives with the planner; re-exported: the trainer and its tests take it from here.
from zoo.hardware import (  # noqa: F401
    AUTO_HARDWARE,
    HARDWARE_OF_KIND,
    PLATFORMS,
    HardwareConfig,
    check_hardware_platform,
)
from zoo.sharding import (
    CONTEXT,
    CONTEXT_BALANCED,
    DEFAULT_RULES,
    MESH_AXES,
    MeshShape,
    ShardingError,
    check_replication,
    param_specs,
    resolve_mesh_shape,
)
from zoo.train.config_checks import (
    absent_block_line,
    check_expert_parallel_line,
    check_mesh_fits,
    known_keys,
    number_as_bool_line,
)
from zoo.train.xla_flags import MAX_CPU_DEVICES, flag_name, unknown_flags, unknown_tpu_flags

# The mesh axes mesh.context_parallel may split the sequence over: tensor splits the heads inside
# attention, expert the tokens' routes to their experts.
CONTEXT_AXES = ("data", "fsdp")


class TrainingStopped(RuntimeError):
    """Training stopped itself for a reason it can state in one line (a non-finite loss): no traceback."""


class RunInterrupted(TrainingStopped):
    """A Ctrl-C stopped training during a step: one line, and exit code 130, as for a Ctrl-C anywhere else."""


@ranged(
    "mesh",
    **dict.fromkeys(("devices", *MESH_AXES), "-1 or [1, inf): -1 fills the devices left"),
    max_replicated_mb="[0, inf)",
)
@dataclasses.dataclass
class MeshConfig:
    """Mesh axes (-1: fills the devices left) and the logical-axis rules (logical dim -> mesh axes)."""

    name: str = "custom"  # the conf/mesh option (messages name it)
    devices: int = -1  # how many of jax.devices() the mesh spans; -1: all of them
    data: int = 1
    fsdp: int = -1
    tensor: int = 1
    expert: int = 1
    rules: dict[str, list[str]] = dataclasses.field(
        default_factory=lambda: {k: list(v) for k, v in DEFAULT_RULES.items()}
    )
    # With fsdp > 1, a parameter larger than this left whole on every device is refused (it would cost
    # 4x its size per device with its gradient and AdamW moments).
    max_replicated_mb: float = 16.0
    # Sequence parallelism over the tensor axis (Megatron-style): adds tensor to rules.seq, so the
    # activations between blocks (residual, norms, kept layer inputs) are split along the sequence
    # over the tensor ranks instead of replicated on them (zoo.model.DecoderBlock says where they
    # are gathered and scattered). Needs mesh.tensor > 1 and a sequence the seq axes divide.
    sequence_parallel: bool = False
    # Context parallelism over this mesh axis (data or fsdp; null: off): the sequence, rather than the
    # batch, is split over it through the whole layer, attention included. Each device keeps its
    # chunk's queries and all-gathers the keys and values of the whole sequence once per layer
    # (zoo.nn.context_parallel). The axis leaves rules.batch and heads rules.seq (before tensor,
    # which sequence parallelism may add); rules[zoo.sharding.CONTEXT] records it for the model.
    context_parallel: Optional[str] = None
    # Under context parallelism, deal the causal work out evenly: the sequence is cut in 2 x shards
    # chunks and device r keeps chunks r and 2 x shards - 1 - r (zoo.sharding.CONTEXT_BALANCED), so
    # no device waits with the last chunk's keys (about twice the average work with contiguous chunks).
    # Needs a sequence that 2 x the context shards divide.
    context_balance: bool = True

    def __post_init__(self):
        if self.context_parallel is not None:
            axis = self.context_parallel
            if axis not in CONTEXT_AXES:
                why = (
                    "splits the heads inside attention (mesh.sequence_parallel splits the sequence over it between "
                    "the blocks)"
                    if axis == "tensor"
                    else ("routes the tokens to their experts" if axis == "expert" else "is not a mesh axis")
                )
                raise ConfigError(
                    f"mesh.context_parallel: {axis!r} {why}; use one of {', '.join(CONTEXT_AXES)} (or null: off)"
                )
            rules = {k: list(v) for k, v in self.rules.items()}
            rules["batch"] = [a for a in rules.get("batch", []) if a != axis]
            rules["seq"] = [axis, *(a for a in rules.get("seq", []) if a != axis)]
            rules[CONTEXT] = [axis]
            if self.context_balance:
                rules[CONTEXT_BALANCED] = [axis]
            self.rules = rules
        if self.sequence_parallel and "tensor" not in self.rules.get("seq", []):
            self.rules = {**self.rules, "seq": [*self.rules.get("seq", []), "tensor"]}
        for logical, axes in self.rules.items():
            for a in axes:
                if a not in MESH_AXES:
                    raise ConfigError(
                        f"mesh.rules.{logical}: unknown mesh axis {a!r}; use some of {', '.join(MESH_AXES)}"
                    )

    @property
    def axes(self) -> dict[str, int]:
        return {a: getattr(self, a) for a in MESH_AXES}


OPTIMIZERS = ("adamw",)


@ranged(
    "optimizer",
    lr="(0, inf)",
    warmup_steps="[0, inf)",
    decay_steps="(0, inf): null decays over trainer.steps",
    min_lr_ratio="[0, 1]",
    b1="[0, 1)",
    b2="[0, 1)",
    eps="(0, inf)",
    weight_decay="[0, inf)",
    grad_clip="[0, inf): 0 disables",
)
@dataclasses.dataclass
class OptimizerConfig:
    """AdamW with linear warmup, cosine decay to lr * min_lr_ratio, and global-norm clipping."""

    name: str = "adamw"
    lr: float = 3e-3
    warmup_steps: int = 10
    decay_steps: Optional[int] = None  # null: trainer.steps
    min_lr_ratio: float = 0.1
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1  # matrices only; norms and the MoE bias are never decayed
    grad_clip: float = 1.0  # global-norm clip; 0 disables

    def __post_init__(self):
        if self.name not in OPTIMIZERS:
            raise ConfigError(f"optimizer.name: unknown optimizer {self.name!r}; choose one of {', '.join(OPTIMIZERS)}")


DATASETS = ("markov", "uniform", "text")


# The data keys only some options read. Given to another option, such a key would be accepted and
# silently ignored (data.path with the synthetic markov data trains on synthetic tokens): refused instead.
DATA_KEYS_OF = {
    **{k: ("text",) for k in ("path", "tokenizer", "text_field", "format", "shuffle", "eval_fraction", "eval_path")},
    "branching": ("markov",),  # uniform tokens have no likely successors
}


def foreign_data_key_line(key: str, value: Any = None, name: Optional[str] = None) -> Optional[str]:
    """The one line for `data.<key>` given to a data option that does not read it (None: it does, or
    the key is not one of DATA_KEYS_OF). `name`: the chosen option, when known."""
    owners = DATA_KEYS_OF.get(key)
    if owners is None or name in owners or (name is not None and name not in DATASETS):
        return None  # (an unknown data.name is DataConfig's to report)
    chosen = f"data={name}" if name else "the chosen data option"
    example = f" data.{key}={value}" if value is not None else ""
    if owners == ("text",):
        what = "has a held-out split" if key.startswith("eval_") else "reads it"
        return (
            f"data.{key}: only data=text {what}, and {chosen} is synthetic tokens; set `data=text` (python "
            f"train.py data=text{example})"
        )
    source = (
        "takes its tokens from the text"
        if name == "text"
        else "draws i.i.d. tokens"
        if name == "uniform"
        else "does not draw from a Markov chain"
    )
    return f"data.{key}: only data=markov reads it ({chosen} {source}); drop it, or set `data=markov`"


# What a data path left null means (DataConfig).
_DATA_NULL = {"path": "the shipped corpus", "tokenizer": "UTF-8 bytes", "eval_path": "no separate eval file"}


# Seeds: what numpy's and JAX's generators take (a seed outside it overflows or is refused as they start).
SEED_RANGE = "[0, 2**32)"


@ranged(
    "data",
    batch_size="(0, inf)",
    seq_len="[2, inf): next-token loss needs 2 tokens",
    branching="(0, inf)",
    seed=SEED_RANGE,
    eval_fraction="[0, 1): 0 holds nothing out",
)
@dataclasses.dataclass
class DataConfig:
    """Synthetic tokens, or real text. markov: each token has `branching` likely successors (learnable,
    loss falls to about log(branching)); uniform: i.i.d. tokens (nothing to learn; throughput only);
    text: a text/jsonl file or folder through zoo.data (see zoo/data/README.md)."""

    name: str = "markov"
    batch_size: int = 16  # global sequences per optimizer step
    seq_len: int = 64
    branching: int = 4  # markov only
    seed: int = 0
    # text only (conf/data/text.yaml):
    path: Optional[str] = None  # a .txt/.jsonl file or a folder of them; null: the shipped corpus
    tokenizer: Optional[str] = None  # a Hugging Face tokenizer.json (or its folder); null: UTF-8 bytes, 256 ids
    text_field: str = "text"  # the key of each .jsonl line that holds the document
    # .jsonl lines: auto (messages: a chat; prompt + response: a pair; else text_field), text, prompt_response, chat
    format: str = "auto"
    shuffle: bool = True  # a new order of the windows each epoch; false: corpus order
    eval_fraction: float = 0.0  # windows held out for evaluation (evenly spread); 0: none
    eval_path: Optional[str] = None  # a separate file or folder to evaluate on (instead of eval_fraction)

    def __post_init__(self):
        if self.name not in DATASETS:
            raise ConfigError(f"data.name: unknown dataset {self.name!r}; choose one of {', '.join(DATASETS)}")
        for name in ("path", "tokenizer", "eval_path"):  # `data.path=` (an unset shell variable) is not null
            if getattr(self, name) is not None and not str(getattr(self, name)).strip():
                raise ConfigError(
                    f"data.{name}: empty (an unset shell variable?); give a path, or leave data.{name} out (null: "
                    f"{_DATA_NULL[name]})"
                )
        if self.name == "text":
            from zoo.data.text import FORMATS  # zoo.data (grain, about 1.1 s; tokenizers) only for text runs

            if self.format not in FORMATS:
                raise ConfigError(f"data.format: unknown format {self.format!r}; choose one of {', '.join(FORMATS)}")
        if self.eval_fraction and self.eval_path:
            raise ConfigError(
                "data.eval_fraction: set it or data.eval_path, not both; data.eval_fraction=0 to evaluate on "
                "data.eval_path"
            )
        if self.name != "text" and (self.eval_fraction or self.eval_path):
            key = "data.eval_fraction" if self.eval_fraction else "data.eval_path"
            raise ConfigError(
                f"{key}: only data=text has a held-out split ({self.name} data is endless); drop it or use data=text"
            )


def _jaxlib_version() -> str:
    import importlib.metadata

    try:
        return importlib.metadata.version("jaxlib")
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


@ranged("xla", cpu_devices=f"[1, {MAX_CPU_DEVICES}]: simulated devices beyond that take minutes to start")
@dataclasses.dataclass
class XlaConfig:
    """XLA flags set before JAX starts, merged with the XLA_FLAGS already in the environment."""

    name: str = "default"
    flags: list[str] = dataclasses.field(default_factory=list)
    # The TPU compiler's flags (libtpu reads them from LIBTPU_INIT_ARGS, merged with the environment's
    # there; other backends never see them): its scheduler's host-offload overlap, say (conf/xla/tpu_*.yaml).
    tpu_flags: list[str] = dataclasses.field(default_factory=list)
    # Simulate this many CPU devices (--xla_force_host_platform_device_count); null: leave as is.
    cpu_devices: Optional[int] = None
    # On CPU only: true compiles with xla_backend_optimization_level=0 (LLVM optimisations off: faster
    # compiles, slower steps), false with XLA's default level; auto picks by what pays: LLVM's
    # optimisations when the run's model FLOPs reach `step_llvm_from_run_flops` (zoo.backend).
    cpu_fast_compile: Any = "auto"
    # On CPU only: which fused ops XLA:CPU hands to its YNNPACK library
    # (--xla_cpu_experimental_ynn_fusion_type): "dot" (matmuls only) keeps elementwise and reduce
    # fusions in XLA's own code, which ran the train step faster on the 2-core machine
    # (docs/benchmarks.md); null leaves XLA's default (dot, eltwise, reduce in jax 0.10.2).
    cpu_ynn_fusions: Optional[str] = "dot"

    def __post_init__(self):
        for f in self.flags:
            if not f.startswith("--xla_"):
                raise ConfigError(f"xla.flags: {f!r} is not an XLA flag; write it as --xla_<name>=<value>")
        # XLA aborts the process on a flag it does not know, when JAX starts; say so first, in one line.
        for f in unknown_flags(self.flags):
            raise ConfigError(
                f"xla.flags: {flag_name(f)} is not a flag this jaxlib ({_jaxlib_version()}) knows, and XLA would "
                "refuse "
                f"to start; remove it or check its spelling"
            )
        for f in self.tpu_flags:
            if not f.startswith("--xla_"):
                raise ConfigError(f"xla.tpu_flags: {f!r} is not an XLA flag; write it as --xla_<name>=<value>")
        for f in unknown_tpu_flags(self.tpu_flags):
            raise ConfigError(
                f"xla.tpu_flags: {flag_name(f)} is not a flag the installed libtpu knows, and the TPU backend would "
                "refuse "
                f"to start; remove it or check its spelling"
            )
        if self.cpu_ynn_fusions is not None and not set(self.cpu_ynn_fusions.split(",")) <= {
            "dot",
            "eltwise",
            "reduce",
        }:
            raise ConfigError(
                f"xla.cpu_ynn_fusions: got {self.cpu_ynn_fusions!r}; give a comma list of dot, eltwise, reduce or null"
            )
        if self.cpu_fast_compile not in (True, False, "auto"):
            raise ConfigError(f"xla.cpu_fast_compile: got {self.cpu_fast_compile!r}; give true, false or auto")


@ranged(
    "trainer",
    steps="(0, inf)",
    grad_accum="(0, inf)",
    seed=SEED_RANGE,
    log_every="(0, inf)",
    moe_bias_update_rate="[0, inf): 0 disables",
    moe_imbalance_warn="0 or (1, inf): the max/mean expert load is >= 1; 0 disables",
    loss_chunk_size="[0, inf): sequence positions per chunk, any size, or 0 for the whole logits",
    eval_every="[0, inf): 0 evaluates at the end only",
    eval_batches="(0, inf)",
)
@dataclasses.dataclass
class TrainerConfig:
    steps: int = 100
    grad_accum: int = 1  # microbatches per step (scanned inside the one jitted step)
    seed: int = 0  # parameter init
    log_every: int = 10  # progress line every n steps (metrics.jsonl gets every step)
    # DeepSeek's aux-loss-free balancing: bias += rate * sign(mean_load - load) each step; 0 disables.
    moe_bias_update_rate: float = 0.001
    # Router entropy and correction-bias range per MoE layer in metrics.jsonl, expert token-share
    # histograms in TensorBoard; false leaves them out of the step (the A/B of their cost).
    moe_metrics: bool = True
    # The progress line names the most imbalanced MoE layer while its expert load max/mean exceeds this; 0 disables.
    moe_imbalance_warn: float = 2.0
    progress: bool = True
    tensorboard: bool = False  # event files in the output dir (needs tensorboardX: pip install -e '.[tensorboard]')
    # The head + loss run over chunks of this many sequence positions (of every row), so the float32
    # logits exist [batch, chunk, vocab] at a time, forward and backward; 0: the whole logits at once.
    loss_chunk_size: int = 512
    # With held-out text (data.eval_fraction or data.eval_path): its loss every eval_every steps
    # (0: only at the end) and at the end, over its first eval_batches batches (of data.batch_size).
    eval_every: int = 100
    eval_batches: int = 8

    def __post_init__(self):
        pass  # ranges only (`ranged`)


def auto_hardware(hw: HardwareConfig, device) -> tuple[HardwareConfig, Optional[str]]:
    """`hardware=auto` replaced by the profile of `device`'s kind (conf/hardware), or a nominal
    profile of its platform where none is known; with one line for the startup output where the
    profile is not a known one (None otherwise). Any other profile is returned as it is."""
    if not hw.auto:
        return hw, None
    from zoo.offload import conf_dir

    kind = getattr(device, "device_kind", device.platform)
    name = HARDWARE_OF_KIND.get(kind) or (device.platform if device.platform == "cpu" else None)
    given = {
        f.name: getattr(hw, f.name)
        for f in dataclasses.fields(hw)
        if f.name != "name" and getattr(hw, f.name) != f.default
    }
    if name is not None and (conf_dir() / "hardware" / f"{name}.yaml").exists():
        # keys given on the command line (+hardware.host_bytes_per_device=...) apply to the profile taken
        return dataclasses.replace(
            load_group("hardware", OmegaConf.load(conf_dir() / "hardware" / f"{name}.yaml")), **given
        ), None
    nominal = HardwareConfig(
        name=f"unknown ({kind})",
        nominal=True,
        platform=device.platform,
        note="hardware=auto: no profile for this device kind; peak_flops is a nominal 1 TFLOP/s",
    )
    return nominal, (
        f"hardware=auto: no profile for a {kind!r} in conf/hardware, so MFU is against a nominal 1 TFLOP/s; "
        f"measure one (python -m zoo.tools.measure_hardware name=<name>) and pass hardware=<name>"
    )


@ranged("checkpoint", every_n_steps="(0, inf)", keep_last="(0, inf): null keeps all")
@dataclasses.dataclass
class CheckpointConfig:
    """Orbax checkpoints of the train state (params with the MoE biases, optimizer state, step).

    `dir: null` disables checkpointing. A run whose `dir` already holds checkpoints resumes from the
    latest complete one (same model required; a different mesh or process count is resharded)."""

    dir: Optional[str] = None  # e.g. checkpoints/run1, or '${hydra:runtime.output_dir}/checkpoints'
    every_n_steps: int = 100  # save when the step count is a multiple of this, and at the end
    keep_last: Optional[int] = 3  # complete checkpoints kept (older ones are deleted); null keeps all
    async_save: bool = True  # write in a background thread while training goes on
    resume: bool = True  # false: refuse to start when dir already holds checkpoints

    def __post_init__(self):
        if self.dir is not None and not str(self.dir).strip():
            raise ConfigError("checkpoint.dir: empty; give a directory or null to disable checkpointing")


@ranged("distributed", num_processes="[1, inf)", process_id="[0, inf)", timeout_s="(0, inf)")
@dataclasses.dataclass
class DistributedConfig:
    """JAX's multi-controller runtime (`jax.distributed.initialize`), one process per host or per GPU.

    All null and no SLURM job step: one process. Under SLURM (srun, or hydra/launcher=slurm) the
    missing values come from SLURM's environment, as JAX reads it."""

    coordinator_address: Optional[str] = None  # host:port of process 0
    num_processes: Optional[int] = None
    process_id: Optional[int] = None
    local_device_ids: Optional[list[int]] = None  # null: JAX's default (all, or SLURM_LOCALID under SLURM)
    timeout_s: int = 300  # give up (one error line) when the processes have not all joined by then
    auto_detect: bool = True  # read SLURM's environment; false: only the keys above

    def __post_init__(self):
        a = self.coordinator_address
        if a is not None:
            host, sep, port = str(a).rpartition(":")
            if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ConfigError(f"distributed.coordinator_address: {a!r} is not host:port; e.g. 10.0.0.1:1234")
        if self.process_id is not None:
            if self.num_processes is not None and self.process_id >= self.num_processes:
                raise ConfigError(
                    f"distributed.process_id: {self.process_id} is not below "
                    f"distributed.num_processes={self.num_processes}; "
                    f"use 0..{self.num_processes - 1}"
                )


@dataclasses.dataclass
class TrainConfig:
    model: ModelConfig
    mesh: MeshConfig
    offload: OffloadConfig
    optimizer: OptimizerConfig
    data: DataConfig
    xla: XlaConfig
    trainer: TrainerConfig
    hardware: HardwareConfig
    checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
    distributed: DistributedConfig = dataclasses.field(default_factory=DistributedConfig)
    lora: LoraConfig = dataclasses.field(default_factory=LoraConfig)
    # Not a group: where the initial weights come from when the model group names a path (model=hf).
    pretrained: Optional[PretrainedSource] = dataclasses.field(default=None, metadata={"group": False})


GROUPS: dict[str, type] = {f.name: f.type for f in dataclasses.fields(TrainConfig) if f.metadata.get("group", True)}


def _writable(node):
    """OmegaConf marks frozen dataclasses read-only; a schema must accept the YAML's values."""
    node._set_flag("readonly", None)
    if isinstance(node, DictConfig):
        for k in node.keys():
            child = node._get_node(k)
            if isinstance(child, (DictConfig, ListConfig)):
                _writable(child)
    return node


def _names_path(node: Any) -> bool:
    return (
        isinstance(node, (DictConfig, dict)) and "path" in node.keys()
    )  # `in node` is False for a missing (???) value


def load_model(node: Any) -> tuple[ModelConfig, Optional[PretrainedSource]]:
    """The model group: a named size, or (when it has a `path`, model=hf) a Hugging Face checkpoint
    directory resolved into the full ModelConfig and the source of the run's initial weights."""
    if not _names_path(node):
        try:  # a ModelConfig knows its family by name only; the registry holds it to the family's kind
            return families.check(load_group("model", node)), None
        except ConfigError:
            raise
        except ValueError as e:
            raise ConfigError(str(e).splitlines()[0]) from None

    values = OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) else dict(node)
    try:
        return model_from_node(values)
    except ValueError as e:
        raise ConfigError(str(e).splitlines()[0]) from None


def load_group(group: str, node: Any) -> Any:
    """Merge one composed group into its dataclass and build it (its __post_init__ checks run)."""
    if group == "model" and _names_path(node):
        return load_model(node)[0]
    schema = GROUPS[group]
    line = number_as_bool_line(schema, node, group)
    if line:
        raise ConfigError(line)
    try:
        base = _writable(OmegaConf.structured(schema))
        merged = OmegaConf.merge(base, node if node is not None else {})
        return OmegaConf.to_object(merged)
    except ConfigKeyError as e:
        key = e.full_key or "?"
        known = known_keys(schema, key)
        hint = f"known keys here: {', '.join(known)}" if known else "check the spelling"
        raise ConfigError(f"{group}.{key}: unknown key; {hint}") from None
    except ValidationError as e:
        msg = str(e).splitlines()[0]
        if "is not a ListConfig" in msg:
            raise ConfigError(
                f"{group}.{e.full_key}: not a list; give one in brackets, e.g. {group}.{e.full_key}=[a,b]"
            ) from None
        raise ConfigError(f"{group}.{e.full_key}: {msg}; give a value of the right type") from None
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None) or "?"
        raise ConfigError(f"{group}.{key}: {str(e).splitlines()[0]}; fix this value") from None
    except ConfigError:
        raise
    except ValueError as e:
        # zoo.config / zoo.offload messages already start with `<group>.<key>:`.
        msg = str(e).splitlines()[0]
        if not msg.startswith(f"{group}."):
            msg = f"{group}: {msg}"
        raise ConfigError(msg) from None


def load(cfg: DictConfig) -> TrainConfig:
    """The composed Hydra config -> typed TrainConfig (each group validated on its own)."""
    extra = [k for k in cfg.keys() if k not in GROUPS and k != "hydra"]
    if extra:
        raise ConfigError(f"{extra[0]}: unknown top-level key; the groups are {', '.join(GROUPS)}")
    missing = [g for g in GROUPS if g not in cfg or cfg[g] is None]
    if missing:
        raise ConfigError(f"{missing[0]}: the group is missing; choose an option, e.g. {missing[0]}=<name>")
    data = cfg["data"]
    if isinstance(data, (DictConfig, dict)):
        for key in data.keys():
            line = foreign_data_key_line(str(key), data.get(key), data.get("name"))
            if line:
                raise ConfigError(line)
    lora = cfg.get("lora")
    if isinstance(lora, DictConfig) and lora.get("rank") == 0 and len(lora.keys()) > 1:
        ignored = ", ".join(f"lora.{k}" for k in lora.keys() if k != "rank")
        raise ConfigError(
            f"lora.rank: 0 turns LoRA off, so {ignored} would be ignored and every parameter would train; "
            "give a positive rank (e.g. lora.rank=8), or choose lora=none for full fine-tuning"
        )
    model, pretrained = load_model(cfg["model"])
    try:
        groups = {g: load_group(g, cfg[g]) for g in GROUPS if g != "model"}
    except ConfigError as e:
        raise ConfigError(absent_block_line(str(e), model) or str(e)) from None
    c = TrainConfig(model=model, pretrained=pretrained, **groups)
    if pretrained is not None:
        try:
            fit_tokenizer(c.data, pretrained, model)  # data.tokenizer null: the checkpoint's own
        except ValueError as e:
            raise ConfigError(str(e).splitlines()[0]) from None
    return c


@dataclasses.dataclass(frozen=True)
class Plan:
    """What validation resolved: the mesh shape, the per-microbatch sizes, and the kernels `auto` chose."""

    mesh: MeshShape
    num_devices: int
    microbatch: int
    attention_impl: str = "xla"
    moe_impl: Optional[str] = None  # None: no MoE layers


def validate(c: TrainConfig, available_devices: int, abstract_model=None) -> Plan:
    """Cross-group checks; ConfigError (one line) on the first problem. No compilation happens here."""
    wanted = available_devices if c.mesh.devices == -1 else c.mesh.devices
    if wanted > available_devices:
        raise ConfigError(
            f"mesh.devices: {wanted} requested, {available_devices} available; lower mesh.devices "
            f"(on CPU, xla.cpu_devices={wanted} simulates more)"
        )
    check_mesh_fits(c.mesh, wanted)
    try:
        shape = resolve_mesh_shape(c.mesh.axes, wanted)
    except ShardingError as e:
        msg = str(e)
        if c.mesh.devices == -1 and "does not match" in msg:
            msg += f" (mesh.devices=-1 means all {available_devices} devices)"
        raise ConfigError(msg) from None

    rules = c.mesh.rules
    dp, micro = _check_batch(c, shape, rules)
    m = c.model
    if c.mesh.sequence_parallel and shape.tensor == 1:
        raise ConfigError(
            "mesh.sequence_parallel: splits the sequence over the tensor axis, but mesh.tensor is 1 "
            f"(mesh={c.mesh.name}); "
            f"set mesh.tensor to 2 or more, or mesh.sequence_parallel=false"
        )
    cp = c.mesh.context_parallel
    if cp is not None and shape.sizes[cp] == 1:
        raise ConfigError(
            f"mesh.context_parallel: splits the sequence over the {cp} axis, but mesh.{cp} is 1 (mesh={c.mesh.name}); "
            f"set mesh.{cp} to 2 or more, or mesh.context_parallel=null"
        )
    _check_sequence(c, shape, rules, cp)
    if c.data.seq_len > m.max_position_embeddings:
        raise ConfigError(
            f"data.seq_len: {c.data.seq_len} exceeds model.max_position_embeddings={m.max_position_embeddings}; "
            f"use data.seq_len<={m.max_position_embeddings} or raise model.max_position_embeddings"
        )
    if c.data.name == "markov" and c.data.branching > m.vocab_size:
        raise ConfigError(f"data.branching: {c.data.branching} exceeds model.vocab_size={m.vocab_size}; lower it")
    try:
        check_tags_emitted(c.offload, m)
    except ValueError as e:
        raise ConfigError(str(e).splitlines()[0]) from None
    check_expert_parallel_line(c, shape, dp)
    attention_impl, moe_impl = resolve_kernels(c)
    if cp is not None and attention_impl == "cudnn":
        if m.attention_impl == "cudnn":
            raise ConfigError(
                f"model.attention_impl: cudnn cannot run context-parallel attention (mesh.context_parallel={cp}): its "
                "queries "
                f"start at key 0, not at their chunk; use blockwise, xla or auto"
            )
        import jax

        # what auto runs there (zoo.nn.attention_kernels.context_shard_attention)
        attention_impl = "blockwise" if c.data.seq_len >= min_blockwise_seq(jax.default_backend()) else "xla"
    if c.trainer.tensorboard and importlib.util.find_spec("tensorboardX") is None:
        raise ConfigError(
            "trainer.tensorboard: needs the tensorboardX package; pip install -e '.[tensorboard]' or set "
            "trainer.tensorboard=false"
        )
    if abstract_model is not None:
        _check_model_files(c, abstract_model, rules, shape)
    return Plan(mesh=shape, num_devices=wanted, microbatch=micro, attention_impl=attention_impl, moe_impl=moe_impl)


def _check_batch(c: TrainConfig, shape, rules) -> tuple[int, int]:
    """data.batch_size against gradient accumulation and the data-parallel ways: (dp, microbatch)."""
    batch_axes = [a for a in rules.get("batch", []) if a in MESH_AXES]
    dp = math.prod(shape.sizes[a] for a in dict.fromkeys(batch_axes)) if batch_axes else 1
    accum = c.trainer.grad_accum
    if c.data.batch_size % accum:
        raise ConfigError(
            f"data.batch_size: {c.data.batch_size} is not divisible by trainer.grad_accum={accum}; "
            f"use a multiple of {accum}"
        )
    micro = c.data.batch_size // accum
    if micro % dp:
        desc = "*".join(f"{a}={shape.sizes[a]}" for a in dict.fromkeys(batch_axes)) or "1"
        need = dp * accum
        raise ConfigError(
            f"data.batch_size: {c.data.batch_size} is not divisible by the data-parallel size {dp}"
            + (f" times trainer.grad_accum={accum}" if accum > 1 else "")
            + f" (batch is split over {desc}); use a multiple of {need}"
        )
    return dp, micro


def _check_sequence(c: TrainConfig, shape, rules, cp) -> None:
    """data.seq_len against the ways the sequence is split (sequence and context parallelism)."""
    seq_axes = list(dict.fromkeys(a for a in rules.get("seq", []) if a in MESH_AXES))
    seq_ways = math.prod(shape.sizes[a] for a in seq_axes) if seq_axes else 1
    if c.data.seq_len % seq_ways:
        desc = "*".join(f"{a}={shape.sizes[a]}" for a in seq_axes)
        raise ConfigError(
            f"data.seq_len: {c.data.seq_len} is not divisible by the sequence-parallel size {seq_ways} "
            f"({'mesh.context_parallel and ' if cp else ''}mesh.rules.seq split{'' if cp else 's'} it over {desc}); "
            f"use a multiple of {seq_ways}"
        )
    if cp is not None and c.mesh.context_balance and c.data.seq_len % (2 * shape.sizes[cp]):
        raise ConfigError(
            f"data.seq_len: {c.data.seq_len} does not cut into 2 x {shape.sizes[cp]} equal chunks, which balanced "
            "context "
            f"parallelism deals out (mesh.context_parallel={cp}); use a multiple of {2 * shape.sizes[cp]}, or "
            "mesh.context_balance=false"
        )


def _check_model_files(c: TrainConfig, abstract_model, rules, shape) -> None:
    """The pretrained weights' headers, LoRA's targets and the parameters' sharding, against the model."""
    if c.pretrained is not None:
        try:  # every tensor's name, shape and dtype, from the safetensors headers
            check_weights(c.pretrained, abstract_model)
        except ValueError as e:
            raise ConfigError(str(e).splitlines()[0]) from None
    if c.lora.enabled:
        problem = check_lora(abstract_model, c.lora)  # a target the family lacks, a rank over a projection
        if problem:
            raise ConfigError(problem)
    try:
        specs = param_specs(abstract_model, rules, shape.sizes)
        check_replication(abstract_model, specs, shape.sizes, c.mesh.max_replicated_mb * 2**20)
    except ShardingError as e:
        raise ConfigError(str(e)) from None


def resolve_kernels(c: TrainConfig) -> tuple[str, Optional[str]]:
    """The attention and MoE kernels this run uses on this backend and mesh (what `auto` stands
    for); an attention_impl the backend cannot run for the model's head dims is a ConfigError."""
    from zoo.backend import target_platform

    m = c.model
    packed = c.data.name == "text"  # segment ids; the data's bound on them (>= 2) reaches attend when traced
    try:
        attention = resolve_impl(
            m.attention_impl,
            backend=target_platform(),
            dtype=m.compute_dtype,
            qk_dim=m.qk_head_dim,
            v_dim=m.v_head_dim,
            seq_len=c.data.seq_len,
            has_sinks=m.attention_sinks,
            has_segments=packed,
            max_segments=2 if packed else None,
        )
    except ValueError as e:
        raise ConfigError(str(e).splitlines()[0]) from None
    # The one place a run resolves model.moe.impl; the model is built with the result (`as_built`).
    return attention, (resolve_moe_impl(m.moe.impl) if m.num_moe_layers else None)


def as_built(c: TrainConfig, plan: Plan) -> TrainConfig:
    """The config the run builds its model from: `c` with `model.moe.impl` the kernel validation chose
    (`plan.moe_impl`, what `auto` stands for). `c` keeps what was asked, which the startup lines name
    (`routed experts ragged (model.moe.impl=auto)`)."""
    m = c.model
    if plan.moe_impl is None or m.moe.impl == plan.moe_impl:
        return c
    return dataclasses.replace(c, model=m.replace(moe=dataclasses.replace(m.moe, impl=plan.moe_impl)))


def to_dict(c: TrainConfig) -> dict:
    return dataclasses.asdict(c)


# --- options defined in Python -----------------------------------------------------------------------------
# Hydra options that Python defines once, registered in Hydra's ConfigStore when this module is imported
# (before any command composes conf/): every named model size of zoo.families.SIZES (`model=llama_tiny_a`),
# `model=hf` (every field null but `path`: config.json decides), and `mesh/_defaults`, the values each
# conf/mesh preset starts from and changes (the default rules live once, in zoo.sharding.DEFAULT_RULES).
# Plain nodes, not the dataclasses: validation stays with load_group, whose messages name the key.
MESH_DEFAULTS_NAME = "_defaults"
# The named sizes' learning rate and warmup (zoo.families' recipes), a group of their own that
# conf/config.yaml chooses by the model's name after the optimizer's: optimizer.lr and
# optimizer.warmup_steps on the command line still win, and `--cfg job` shows the values used.
RECIPE_GROUP = "recipe"


def _field_default(f: dataclasses.Field) -> Any:
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


def _register_python_options() -> None:
    store = ConfigStore.instance()
    store.store(
        group="mesh", name=MESH_DEFAULTS_NAME, node={f.name: _field_default(f) for f in dataclasses.fields(MeshConfig)}
    )
    for name, size in families.SIZES.items():
        store.store(group="model", name=name, node=dataclasses.asdict(size))
        recipe = families.get(size.family).recipe(name)
        if recipe is not None:  # conf/config.yaml: `optional recipe: ${model}`, after the optimizer group
            node = {"optimizer": {"lr": recipe.lr, "warmup_steps": recipe.warmup_steps}}
            store.store(group=RECIPE_GROUP, name=name, node=node, package="_global_")
    store.store(group="model", name="hf", node=hf_option())


_register_python_options()
