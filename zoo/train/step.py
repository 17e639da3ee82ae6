"""The training step: one jit with in/out shardings that carry memory kinds, donated state.

`Trainer(cfg, plan)` derives everything from the validated config: the mesh, the NamedShardings of
params / optimizer state (memory kind from `offload.params` / `offload.opt_state`), the optimizer,
the remat/offload policy, the sharded init and the jitted step. `zoo.tools.inspect_step` / `zoo.tools.plan` can lower
the same step on abstract inputs (`Trainer.abstract_state`, `Trainer.lower`) without allocating.

The state is a dict `{"params", "opt_state", "step"}`; `params` is the array half of the model
(`eqx.partition(model, is_array)`), combined with the static half inside the loss.

A step's batch is a token array `[grad_accum, microbatch, seq]` (synthetic data), or for text
(`data.name: text`, packed documents) a dict of such arrays (`zoo.data.BATCH_FIELDS`: tokens,
segment_ids, positions, loss_mask), every one sharded like the tokens. The loss of a packed step is
the mean over all its targets (`zoo.loss.target_weights`), whichever microbatch holds them.
"""

import math
from typing import Any, Callable, Optional

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec
from jaxtyping import Array, Float, PRNGKeyArray

from zoo import backend, lora
from zoo import model as zoo_model
from zoo import sharding as zs
from zoo.counts import flops_per_token
from zoo.hf import CheckpointError, load_sharded
from zoo.loss import chunked_next_token_loss, target_weights
from zoo.nn.attention_kernels import segments_bound
from zoo.nn.moe import router_statistics
from zoo.nn.moe_dispatch import exchanges_in_rounds
from zoo.offload import remat_policy
from zoo.train.run_config import ConfigError, OptimizerConfig, Plan, TrainConfig, as_built
from zoo.train.update import UPDATE_SCOPE, accumulate, global_norm, streamed_update, whole_tree_update, zeros_where


def cpu_optimization(c: TrainConfig, platform: str) -> tuple[Optional[bool], str]:
    """Whether XLA:CPU compiles the step with LLVM's optimisations (None off CPU), and why:
    `xla.cpu_fast_compile` true / false, or auto: on when the run's model FLOPs (steps x step FLOPs)
    reach `zoo.backend`'s `step_llvm_from_run_flops`, where the faster steps repay the longer compile."""
    threshold = backend.choices(platform).step_llvm_from_run_flops
    if threshold is None:
        return None, "not on CPU"
    fast = c.xla.cpu_fast_compile
    if fast != "auto":
        return (not fast), f"xla.cpu_fast_compile={str(fast).lower()}"
    run_flops = run_model_flops(c)
    on = run_flops >= threshold
    return on, (
        f"xla.cpu_fast_compile=auto: the run's {run_flops / 1e12:.2g} TFLOP of model FLOPs "
        f"{'>=' if on else '<'} {threshold / 1e12:g} TFLOP"
    )


def run_model_flops(c: TrainConfig) -> float:
    """The model FLOPs (zoo.counts.flops_per_token: forward + backward, no recomputation) of the run's steps."""
    tokens = c.data.batch_size * c.data.seq_len * c.trainer.grad_accum
    return float(flops_per_token(c.model, c.data.seq_len)) * tokens * c.trainer.steps


def is_array_like(x) -> bool:
    return isinstance(x, (jax.Array, jax.ShapeDtypeStruct))


def _last_name(path) -> str:
    return zs._key_name(path[-1]) if path else ""


def trainable_labels(params):
    """'train' for parameters, 'frozen' for buffers (the MoE correction bias): the optimizer never moves those."""
    return jax.tree_util.tree_map_with_path(lambda p, _: "frozen" if zoo_model.is_buffer_path(p) else "train", params)


def decay_mask(params):
    """Weight decay on matrices only: not on RMSNorm weights (field `weight`) nor buffers."""
    return jax.tree_util.tree_map_with_path(
        lambda p, _: _last_name(p) != "weight" and not zoo_model.is_buffer_path(p), params
    )


def make_schedule(c: OptimizerConfig, total_steps: int) -> optax.Schedule:
    decay = c.decay_steps if c.decay_steps is not None else total_steps
    decay = max(decay, c.warmup_steps + 1)
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0 if c.warmup_steps else c.lr,
        peak_value=c.lr,
        warmup_steps=c.warmup_steps,
        decay_steps=decay,
        end_value=c.lr * c.min_lr_ratio,
    )


def whole_axis(x, sharding) -> Optional[int]:
    """The first axis of `x` that `sharding` does not split (None if it splits them all): where the
    streamed update may cut a large leaf into runs of rows without moving it between devices."""
    spec = tuple(getattr(sharding, "spec", ())) + (None,) * x.ndim
    sizes = dict(getattr(getattr(sharding, "mesh", None), "shape", {}) or {})
    for axis in range(x.ndim):
        names = spec[axis] if isinstance(spec[axis], tuple) else (spec[axis],)
        if math.prod(sizes.get(n, 1) for n in names if n is not None) == 1:
            return axis
    return None


def make_optimizer(
    c: OptimizerConfig, total_steps: int, *, clip: bool = True
) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """AdamW under the schedule, gradients clipped by their global norm (`optimizer.grad_clip` > 0),
    buffers frozen. `clip=False` leaves the clipping to the caller (the streamed update, which
    computes the norm of the whole gradient first) with the state's structure unchanged."""
    schedule = make_schedule(c, total_steps)
    parts = [optax.clip_by_global_norm(c.grad_clip) if clip else optax.identity()] if c.grad_clip > 0 else []
    parts.append(optax.adamw(schedule, b1=c.b1, b2=c.b2, eps=c.eps, weight_decay=c.weight_decay, mask=decay_mask))
    tx = optax.multi_transform({"train": optax.chain(*parts), "frozen": optax.set_to_zero()}, trainable_labels)
    return tx, schedule


def one_document_per_row(tokens: np.ndarray) -> dict:
    """A packed batch of a plain token array `[..., seq]`: each row one document, every target counted."""
    seq = tokens.shape[-1]
    return {
        "tokens": tokens,
        "segment_ids": np.zeros(tokens.shape, np.int32),
        "positions": np.broadcast_to(np.arange(seq, dtype=np.int32), tokens.shape).copy(),
        "loss_mask": np.ones(tokens.shape, np.int32),
    }


def _stack_paths(params) -> Callable:
    """Predicate over leaf paths: True inside a scanned layer stack (moved to device per layer)."""
    del params
    return lambda path: any(zs._key_name(k) == "layers" for k in path)


class Trainer:
    def __init__(self, cfg: TrainConfig, plan: Plan, devices: Optional[list] = None):
        self.cfg = cfg = as_built(cfg, plan)  # the model with the MoE kernel validation resolved
        self.plan = plan
        self.mesh = zs.make_mesh(plan.mesh, devices)
        rules = cfg.mesh.rules
        self.rules = rules
        # The dropless expert-parallel exchange runs a round count the routing decides (zoo.nn.expert_rounds).
        self.exchanges_in_rounds = plan.moe_impl is not None and exchanges_in_rounds(
            plan.moe_impl, rules, plan.mesh.sizes
        )
        abstract = zoo_model.abstract(cfg.model)
        self.abstract_params, self.static = eqx.partition(abstract, is_array_like)
        # LoRA: the trainable `params` are the adapters (zoo.lora); the frozen base is the state's
        # `base`, which gets no gradient, no optimizer state and is not checkpointed.
        self.lora = cfg.lora if cfg.lora.enabled else None
        self.abstract_base = None
        if self.lora is not None:
            self.abstract_base = self.abstract_params
            self.abstract_params = lora.init_shapes(abstract, self.lora)
        # Unclipped: the step clips by the norm it computes itself (zoo.train.update.global_norm, also
        # its grad_norm metric) on both update paths; the state is the same as the clipped chain's.
        self.tx, self.schedule = make_optimizer(cfg.optimizer, cfg.trainer.steps, clip=False)
        self.policy = remat_policy(cfg.offload, weights_of=cfg.model)
        # With LoRA, offload.params is read as the base's place (lora.base_on_host sets it too): the
        # adapters are small and stay on the device.
        base_kind = "pinned_host" if self.lora is not None and self.lora.base_on_host else cfg.offload.params
        self.params_on_host = base_kind == "pinned_host"
        self.opt_on_host = cfg.offload.opt_state == "pinned_host"
        # Host-resident state is updated layer by layer (zoo.train.update), not brought to the device whole.
        self.layerwise_update = (self.params_on_host and self.lora is None) or self.opt_on_host

        sizes = plan.mesh.sizes
        abstract_opt = jax.eval_shape(self.tx.init, self.abstract_params)
        if self.lora is None:
            param_specs = zs.param_specs(self.abstract_params, rules, sizes)
            opt_specs = zs.param_specs(abstract_opt, rules, sizes)
        else:  # adapters and their moments: a few MB at most, replicated
            param_specs = jax.tree.map(lambda _: PartitionSpec(), self.abstract_params)
            opt_specs = jax.tree.map(lambda _: PartitionSpec(), abstract_opt)
        self.param_shardings = zs.named(self.mesh, param_specs, None if self.lora is not None else cfg.offload.params)
        self.opt_shardings = zs.named(self.mesh, opt_specs, cfg.offload.opt_state)
        self.state_shardings = {
            "params": self.param_shardings,
            "opt_state": self.opt_shardings,
            "step": NamedSharding(self.mesh, PartitionSpec()),
        }
        if self.lora is not None:
            self.base_shardings = zs.named(self.mesh, zs.param_specs(self.abstract_base, rules, sizes), base_kind)
            self.state_shardings["base"] = self.base_shardings
        token_spec = zs.logical_to_spec(zs.TOKEN_AXES, rules)
        # Tokens arrive as [grad_accum, microbatch, seq]: the microbatch dim is the sharded batch.
        self.token_sharding = NamedSharding(self.mesh, PartitionSpec(None, *token_spec))
        self.replicated = NamedSharding(self.mesh, PartitionSpec())
        self.packed = cfg.data.name == "text"  # batches are dicts of packed documents
        # The most documents a row of the data holds (cuDNN's packed attention needs a static bound): set_data.
        self.max_segments: Optional[int] = None
        self._step = None

    # --- state ---------------------------------------------------------------------------------

    def _init(self, key):
        model = zoo_model.build(self.cfg.model, key=key)
        params, _ = eqx.partition(model, eqx.is_array)
        if self.lora is not None:
            return self._lora_state(params, key)
        return {"params": params, "opt_state": self.tx.init(params), "step": jnp.zeros((), jnp.int32)}

    def _lora_state(self, base, key):
        adapters = lora.init(eqx.combine(base, self.static), self.lora, key=jax.random.fold_in(key, 1))
        return {"params": adapters, "opt_state": self.tx.init(adapters), "step": jnp.zeros((), jnp.int32), "base": base}

    def saved(self, state):
        """What a checkpoint holds of `state`: everything but the frozen LoRA base (rebuilt from
        trainer.seed or model.path on resume)."""
        return {k: v for k, v in state.items() if k != "base"}

    def with_base(self, saved, base):
        """A restored (saved) state with the frozen base put back."""
        return saved if self.lora is None else {**saved, "base": base}

    def fresh_base(self):
        """The frozen base as `init` makes it (for a resumed LoRA run)."""
        return self.init()["base"]

    def init(self, seed: Optional[int] = None):
        """Parameters and optimizer state created already sharded (and in their memory kind); read from
        the Hugging Face checkpoint when the model group names one (`init_pretrained`)."""
        if self.cfg.pretrained is not None:
            return self.init_pretrained()
        key = self.init_key(seed)
        lowered = jax.jit(self._init, out_shardings=self.state_shardings).lower(key)
        # Init runs once: on CPU its LLVM level is chosen by the parameters a device draws; values agree
        # to float32 rounding.
        return lowered.compile(
            zoo_model.init_compile_options(self.mesh.devices.flat[0].platform, self.params_per_device())
        )(key)

    def init_key(self, seed: Optional[int] = None) -> PRNGKeyArray:
        """The initialiser's key: `trainer.seed` (or `seed`) with the backend's generator
        (`zoo.backend.BackendChoices.init_prng`); threefry for a LoRA base, which checkpoints rebuild
        from the seed wherever they are read."""
        seed = self.cfg.trainer.seed if seed is None else seed
        impl = backend.choices(self.mesh.devices.flat[0].platform).init_prng if self.lora is None else None
        return jax.random.key(seed, impl=impl) if impl else jax.random.key(seed)

    def params_per_device(self) -> int:
        """Parameters one device holds: replicated leaves whole, sharded ones a shard."""
        per_leaf = jax.tree.map(
            lambda x, sh: math.prod(sh.shard_shape(x.shape)), self.abstract_params, self.param_shardings
        )
        return sum(jax.tree.leaves(per_leaf))

    def init_pretrained(self):
        """The parameters read from `cfg.pretrained`'s safetensors straight into their shardings and
        memory kinds, in param_dtype (each process reads only its devices' slices: zoo.hf.load_sharded);
        the optimizer state initialised from them, sharded, as `init` does."""
        try:
            params = load_sharded(
                self.cfg.pretrained.path,
                self.cfg.model,
                self.base_shardings if self.lora is not None else self.param_shardings,
            )
        except CheckpointError as e:  # bad weights (non-finite values): before anything compiles
            raise ConfigError(f"model.path: {str(e).splitlines()[0]}") from None
        llvm_off = backend.LLVM_OFF if backend.choices(self.mesh.devices.flat[0].platform).state_init_llvm_off else None
        if self.lora is not None:
            key = jax.random.key(self.cfg.trainer.seed)
            shardings = {k: v for k, v in self.state_shardings.items() if k != "base"}
            init = jax.jit(
                lambda k: {k2: v for k2, v in self._lora_state(self.abstract_zero_base(), k).items() if k2 != "base"},
                out_shardings=shardings,
            )
            return {**init.lower(key).compile(llvm_off)(key), "base": params}
        opt_init = jax.jit(self.tx.init, out_shardings=self.opt_shardings).lower(params)
        opt_state = opt_init.compile(llvm_off)(params)
        return {
            "params": params,
            "opt_state": opt_state,
            "step": jax.device_put(jnp.zeros((), jnp.int32), self.state_shardings["step"]),
        }

    def abstract_zero_base(self):
        """Base-shaped zeros: the adapters' shapes depend only on the base's (traced inside jit)."""
        return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), self.abstract_base)

    def abstract_state(self):
        """The state as ShapeDtypeStructs carrying their shardings: lower/compile without allocating."""
        shapes = jax.eval_shape(self._init, jax.random.key(0))
        return jax.tree.map(
            lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes, self.state_shardings
        )

    def abstract_tokens(self):
        """A step's batch as ShapeDtypeStructs: the token array, or for packed text the dict of arrays."""
        c = self.cfg
        shape = (c.trainer.grad_accum, self.plan.microbatch, c.data.seq_len)
        one = jax.ShapeDtypeStruct(shape, jnp.int32, sharding=self.token_sharding)
        if not self.packed:
            return one
        from zoo.data.pipeline import BATCH_FIELDS  # packed text only; zoo.data imports grain (about 1.1 s)

        return {k: one for k in BATCH_FIELDS}

    def set_data(self, data) -> None:
        """Take from the data what the compiled programs depend on: the most documents a row holds
        (of the training and the eval split), for attention kernels that need a static bound."""
        bounds = [getattr(d, "max_segments", None) for d in (data, getattr(data, "eval", None)) if d is not None]
        bounds = [b for b in bounds if b is not None]
        self.max_segments = max(2, *bounds) if bounds else None

    def data_shard(self) -> tuple[int, int]:
        """`(index, count)`: this process's devices hold rows `[index*n, (index+1)*n)` of every microbatch,
        n = microbatch / count, so it feeds the index-th of `count` equal slices of each step's batch
        (`(0, 1)` in one process; processes whose devices hold the same rows get the same index)."""
        if getattr(self, "_data_shard", None) is not None:
            return self._data_shard
        micro = self.plan.microbatch
        shape = (self.cfg.trainer.grad_accum, micro, self.cfg.data.seq_len)
        rows = sorted(
            {
                (i[1].start or 0, micro if i[1].stop is None else i[1].stop)
                for i in self.token_sharding.addressable_devices_indices_map(shape).values()
            }
        )
        lo, hi = rows[0][0], max(b for _, b in rows)
        reach = lo
        for a, b in rows:  # the rows of this process's devices must form one block
            if a > reach:
                raise zs.ShardingError(
                    f"mesh: the devices of process {jax.process_index()} hold rows {rows} of the batch, not one block; "
                    "order the mesh so each process's devices are neighbours along the batch axes"
                )
            reach = max(reach, b)
        n = hi - lo
        if micro % n or lo % n:
            raise zs.ShardingError(
                f"mesh: process {jax.process_index()} holds rows {lo}..{hi} of {micro}, not an equal slice; use a "
                "mesh whose batch axes split evenly over processes"
            )
        self._data_shard = (lo // n, micro // n)
        return self._data_shard

    def shard_tokens(self, batch):
        """This process's rows of a step (host `[batch_size / count, seq]` int32, `count` from
        `data_shard`; or a dict of such arrays for packed text) -> the global `[grad_accum,
        microbatch, seq]` array(s), batch-sharded. With several processes, microbatch a holds every
        process's a-th block of rows: the same rows per step as one process reads, grouped
        differently into microbatches when grad_accum > 1. A plain token array given to a packed
        step is one document per row."""
        if self.packed and not isinstance(batch, dict):
            batch = one_document_per_row(np.asarray(batch, np.int32))
        if isinstance(batch, dict):
            if not self.packed:
                raise ValueError(
                    "shard_tokens: a dict batch needs data.name=text (packed documents); give the token array"
                )
            return {k: self._shard_rows(v) for k, v in batch.items()}
        return self._shard_rows(batch)

    def _shard_rows(self, batch):
        c = self.cfg
        index, count = self.data_shard()
        if count == 1 and jax.process_count() == 1:
            batch = jnp.asarray(batch, jnp.int32).reshape(c.trainer.grad_accum, self.plan.microbatch, c.data.seq_len)
            return jax.device_put(batch, self.token_sharding)
        n = self.plan.microbatch // count
        local = np.asarray(batch, np.int32).reshape(c.trainer.grad_accum, n, c.data.seq_len)
        lo = index * n

        def rows(i):
            start = (i[1].start or 0) - lo
            stop = (self.plan.microbatch if i[1].stop is None else i[1].stop) - lo
            return local[i[0], start:stop, i[2]]

        return jax.make_array_from_callback(
            (c.trainer.grad_accum, self.plan.microbatch, c.data.seq_len), self.token_sharding, rows
        )

    # --- the step ------------------------------------------------------------------------------

    def loss_and_aux(self, params, batch, base=None, dropout_key=None):
        """Next-token loss of one microbatch and the MoE routing statistics. `batch` is a token array
        `[microbatch, seq]` (the loss is the mean over its targets) or a packed dict of such fields
        (`tokens`, `segment_ids`, `positions`, `loss_mask`): attention stays within each document,
        RoPE reads `positions`, and the loss is the sum of its targets' losses over `loss_denominator`
        (set by `train_step`; 1.0 gives the plain sum; absent: their count, the mean). With LoRA,
        `dropout_key` (one per step and microbatch) turns on `lora.dropout`."""
        if base is not None:  # LoRA: `params` are the adapters, merged per layer inside the scan
            model = lora.attach(eqx.combine(base, self.static), params, self.lora, key=dropout_key)
        else:
            model = eqx.combine(params, self.static)
        layer_transform = zs.to_device if self.params_on_host else None
        # The chunked loss takes the hidden states in the balanced context order, if any (zoo.model.run_layers).
        chunk = self.cfg.trainer.loss_chunk_size
        packed = isinstance(batch, dict)
        if packed:
            fields = {
                k: zs.constrain(batch[k], zs.TOKEN_AXES) for k in ("tokens", "segment_ids", "positions", "loss_mask")
            }
            tokens, segment_ids = fields["tokens"], fields["segment_ids"]
            with segments_bound(self.max_segments):
                hidden, aux = zoo_model.features(
                    model,
                    tokens,
                    positions=fields["positions"],
                    segment_ids=segment_ids,
                    remat_policy=self.policy,
                    layer_transform=layer_transform,
                    context_order=bool(chunk),
                )
            weights = target_weights(fields["loss_mask"], segment_ids)
            count = weights.sum()
            # Absent, the sum (over 1.0) is divided by the count at the end: the microbatch's own mean.
            denominator = batch.get("loss_denominator", jnp.float32(1.0))
        else:
            tokens = zs.constrain(batch, zs.TOKEN_AXES)
            hidden, aux = zoo_model.features(
                model, tokens, remat_policy=self.policy, layer_transform=layer_transform, context_order=bool(chunk)
            )
            weights = denominator = None
        m = self.cfg.model
        if chunk:
            loss = chunked_next_token_loss(
                hidden,
                model.head_weight(),
                tokens,
                weights,
                chunk_size=chunk,
                final_softcap=m.final_logit_softcap,
                compute_dtype=m.compute_dtype,
                denominator=denominator,
                context_order=True,
            )
        else:
            logits = zs.constrain(model.logits(hidden), zs.LOGIT_AXES)
            loss = zoo_model.next_token_loss(logits, tokens, weights)
            if packed:
                loss = loss * (jnp.maximum(count, 1.0) / denominator)
        if packed and "loss_denominator" not in batch:
            loss = loss / jnp.maximum(count, 1.0)
        return loss, aux

    def with_loss_denominators(self, batch):
        """A packed step's batch with `loss_denominator` [grad_accum]: each microbatch's loss is its
        targets' summed loss over (all the step's targets / grad_accum), so that the mean over
        microbatches is the mean over every target of the step, however they fall."""
        if not isinstance(batch, dict):
            return batch
        accum = self.cfg.trainer.grad_accum
        count = jnp.maximum(target_weights(batch["loss_mask"], batch["segment_ids"]).sum(), 1.0)
        return {**batch, "loss_denominator": jnp.full((accum,), count / accum, jnp.float32)}

    def _device_params(self, params):
        """With params on host: everything but the layer stacks moves to device now; the stacks move
        one layer at a time inside the scan (layer_transform)."""
        if not self.params_on_host:
            return params
        in_stack = _stack_paths(params)
        return jax.tree_util.tree_map_with_path(
            lambda p, x: x if in_stack(p) else jax.device_put(x, jax.memory.Space.Device), params
        )

    def train_step(self, state, tokens):
        # Modules read the mesh and the logical-axis rules from the active layout while traced.
        with zs.activate(self.mesh, self.rules), router_statistics(self.cfg.trainer.moe_metrics):
            return self._train_step(state, self.with_loss_denominators(tokens))

    def _train_step(self, state, tokens):
        c = self.cfg
        accum = c.trainer.grad_accum
        params = state["params"]
        dropping = self.lora is not None and self.lora.dropout > 0
        if self.lora is not None:
            loss_params = params
            base = self._device_params(state["base"])
            grad_fn = jax.value_and_grad(lambda p, mb, k=None: self.loss_and_aux(p, mb, base, k), has_aux=True)
        else:
            loss_params = self._device_params(params)
            grad_fn = jax.value_and_grad(self.loss_and_aux, has_aux=True)
        # LoRA dropout masks: new for every step and microbatch, the same after a resume.
        step_key = jax.random.fold_in(jax.random.key(c.trainer.seed), state["step"]) if dropping else None

        def micro(mb, i=0):
            # With params on host the stacks' gradients come back in host memory and stay there: the
            # streamed update reads them one layer at a time.
            args = (loss_params, mb) + ((jax.random.fold_in(step_key, i),) if dropping else ())
            (loss, aux), grads = grad_fn(*args)
            load = aux.tokens_per_expert.astype(jnp.float32) if aux is not None else jnp.zeros((0, 0), jnp.float32)
            dropped = aux.dropped.astype(jnp.float32) if aux is not None else jnp.zeros((0,), jnp.float32)
            entropy = aux.router_entropy.astype(jnp.float32) if aux is not None else jnp.zeros((0,), jnp.float32)
            rounds = aux.exchange_rounds if aux is not None else jnp.zeros((0,), jnp.int32)
            return loss, grads, load, dropped, entropy, rounds

        first = jax.tree.map(lambda x: x[0], tokens)  # microbatch 0 (of every field of a packed batch)
        if accum == 1:
            loss, grads, load, dropped, entropy, rounds = micro(first)
        else:

            def body(carry, xs):
                loss, grads, load, dropped, entropy, rounds = micro(*xs) if dropping else micro(xs)
                sums = (
                    carry[0] + loss,
                    accumulate(carry[1], grads),
                    carry[2] + load,
                    carry[3] + dropped,
                    carry[4] + entropy,
                )
                return (*sums, jnp.maximum(carry[5], rounds)), None

            zero = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), jax.eval_shape(micro, first))
            zero = (zero[0], zeros_where(loss_params), *zero[2:])  # gradients sum where they arrive
            xs = (tokens, jnp.arange(accum)) if dropping else tokens
            (loss, grads, load, dropped, entropy, rounds), _ = jax.lax.scan(body, zero, xs)
            loss = loss / accum  # load and dropped are counts: they add up over microbatches
            entropy = entropy / accum  # each microbatch's is a mean over its tokens

        new_params, opt_state, grad_norm = self._update(state, grads, accum)

        rate = c.trainer.moe_bias_update_rate
        new_base = state.get("base")
        if rate > 0 and self.lora is not None:
            new_base = self._balance_experts(new_base, load, rate)  # the correction bias is the base's buffer
        elif rate > 0:
            new_params = self._balance_experts(new_params, load, rate)

        metrics = {"loss": loss, "grad_norm": grad_norm, "lr": self.schedule(state["step"])}
        if load.size:
            metrics["expert_load_max_over_mean"] = load.max(axis=-1) / jnp.maximum(load.mean(axis=-1), 1e-9)
            metrics["expert_load_min_over_mean"] = load.min(axis=-1) / jnp.maximum(load.mean(axis=-1), 1e-9)
            metrics["moe_dropped_fraction"] = dropped / jnp.maximum(load.sum(axis=-1), 1.0)
            if self.exchanges_in_rounds:  # the most rounds any microbatch's exchange took, per MoE layer
                metrics["moe_exchange_rounds"] = rounds
            if c.trainer.moe_metrics:
                metrics["router_entropy"] = entropy
                bias_range = self._bias_range(state["base"] if self.lora is not None else params)
                if bias_range is not None:
                    metrics["moe_bias_min"], metrics["moe_bias_max"] = bias_range
                if c.trainer.tensorboard:
                    # Histograms only: [MoE layers, experts] per step is too much for metrics.jsonl at scale.
                    metrics["expert_token_share"] = load / jnp.maximum(load.sum(axis=-1, keepdims=True), 1.0)
        new_state = {"params": new_params, "opt_state": opt_state, "step": state["step"] + 1}
        if self.lora is not None:
            new_state["base"] = new_base
        return new_state, metrics

    def _update(self, state, grads, accum: int):
        """(new params, new optimizer state, gradient norm) from the gradients summed over `accum`
        microbatches: the whole tree at once when the state is on device, else streamed layer by
        layer (zoo.train.update)."""
        params, opt_state = state["params"], state["opt_state"]
        labels = trainable_labels(grads)
        trainable = jax.tree.map(lambda g, lab: g if lab == "train" else None, grads, labels)
        with jax.named_scope(UPDATE_SCOPE):
            if self.layerwise_update:
                norm = global_norm(trainable, divide=accum)
                new_params, opt_state = streamed_update(
                    self.tx,
                    grads,
                    opt_state,
                    params,
                    norm=norm,
                    max_norm=self.cfg.optimizer.grad_clip,
                    divide=accum,
                    chunk_axes=jax.tree.map(whole_axis, params, self.state_shardings["params"]),
                )
                return new_params, opt_state, norm
            return whole_tree_update(
                self.tx,
                grads,
                opt_state,
                params,
                trainable=trainable,
                max_norm=self.cfg.optimizer.grad_clip,
                divide=accum,
            )

    def _bias_range(self, params) -> Optional[tuple[Float[Array, " moe_layers"], Float[Array, " moe_layers"]]]:
        """Per MoE layer (model order), the min and max of the correction bias that routed this step
        (`sigmoid_grouped`); None for routers without one."""
        model = eqx.combine(params, self.static)
        order = model.moe_aux_order()
        lows, highs = [], []
        for s, j, _ in order:
            bias = params.stacks[s].layers[j].ffn.e_score_correction_bias
            if bias is None:
                return None
            bias = zs.to_device(bias) if self.params_on_host else bias
            lows.append(bias.min(axis=-1))
            highs.append(bias.max(axis=-1))
        inverse = np.argsort(np.concatenate([r for _, _, r in order]))
        return jnp.concatenate(lows)[inverse], jnp.concatenate(highs)[inverse]

    def _balance_experts(self, params, load, rate):
        """DeepSeek-V3's auxiliary-loss-free balancing: push overloaded experts' correction bias down
        (`load` has one row per MoE layer, in model order)."""
        model = eqx.combine(params, self.static)
        for s, j, rows in model.moe_aux_order():
            ffn = params.stacks[s].layers[j].ffn
            if ffn.e_score_correction_bias is None:  # routers without a correction bias
                continue
            layer_load = load[rows]
            mean = layer_load.mean(axis=-1, keepdims=True)
            bias = zs.to_device(ffn.e_score_correction_bias) + rate * jnp.sign(mean - layer_load).astype(jnp.float32)
            params = eqx.tree_at(lambda p, s=s, j=j: p.stacks[s].layers[j].ffn.e_score_correction_bias, params, bias)
        return params

    def jitted_step(self):
        if self._step is None:
            self._step = jax.jit(
                self.train_step,
                in_shardings=(self.state_shardings, self.token_sharding),
                out_shardings=(self.state_shardings, self.replicated),
                donate_argnums=0,
            )
        return self._step

    def cpu_optimization(self) -> tuple[Optional[bool], str]:
        """Whether XLA:CPU compiles this step with LLVM's optimisations (None off CPU), and why."""
        return cpu_optimization(self.cfg, self.mesh.devices.flat[0].platform)

    @property
    def compiler_options(self) -> Optional[dict]:
        on, _ = self.cpu_optimization()
        return {"xla_backend_optimization_level": 0} if on is False else None

    def compile(self, state: Any = None, tokens: Any = None):
        """The compiled step (on CPU with the options `cpu_optimization` picks)."""
        return self.lower(state, tokens).compile(self.compiler_options)

    def lower(self, state: Any = None, tokens: Any = None):
        """Lower the step (on abstract inputs by default): for compile(), memory_analysis(), inspection."""
        state = self.abstract_state() if state is None else state
        tokens = self.abstract_tokens() if tokens is None else tokens
        return self.jitted_step().lower(state, tokens)
