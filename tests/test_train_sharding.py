"""Sharded training reproduces the single-device run; memory kinds; accumulation; the MoE bias rule.

Runs on the 8 simulated CPU devices of conftest.py. Meshes come from conf/mesh/*.yaml, so the
presets themselves are what is tested.
"""

import dataclasses
import math
import os
import pathlib

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec
from omegaconf import OmegaConf

from zoo.families import SIZES
from zoo.offload import OffloadConfig
from zoo.sharding import ShardingError, logical_to_spec, param_specs, resolve_mesh_shape
from zoo.train.run_config import DataConfig, HardwareConfig, OptimizerConfig, TrainConfig, TrainerConfig, XlaConfig
from zoo.train.run_config import load_group, validate
from zoo.train.batches import SyntheticData
from zoo.train.step import Trainer

CONF = pathlib.Path(__file__).resolve().parents[1] / "conf"
STEPS = 5
# 8 x 20 = 160 tokens, 320 top-2 assignments: no dim of the tiny models is 20, 160 or 320, so a
# collective that carries the global batch (or its routing) shows up by its dims.
SEQ = 20
MODELS = ("llama_tiny_a", "dsv3_tiny_a")
MESHES = ("dp", "fsdp", "fsdp_tp", "fsdp_ep")


def mesh_preset(name: str):
    node = OmegaConf.load(CONF / "mesh" / f"{name}.yaml")
    node.pop("defaults")  # mesh/_defaults: MeshConfig's own defaults, which load_group starts from
    return load_group("mesh", node)


def make_config(
    model: str,
    mesh: str,
    offload: OffloadConfig = None,
    accum: int = 1,
    batch: int = 8,
    bias_rate: float = 0.001,
    dropless: bool = True,
    moe_impl: str = None,
):
    m = SIZES[model]
    if dropless and m.num_moe_layers:
        # capacity = every assignment: capacity buffers drop nothing, however the batch is split
        m = m.replace(moe=dataclasses.replace(m.moe, capacity_factor=float(m.moe.n_routed_experts)))
    if moe_impl is not None:
        m = m.replace(moe=dataclasses.replace(m.moe, impl=moe_impl))
    return TrainConfig(
        model=m,
        mesh=mesh_preset(mesh),
        offload=offload or OffloadConfig(),
        optimizer=OptimizerConfig(lr=1e-2, warmup_steps=1),
        data=DataConfig(batch_size=batch, seq_len=SEQ),
        xla=XlaConfig(),
        trainer=TrainerConfig(steps=STEPS, grad_accum=accum, moe_bias_update_rate=bias_rate),
        hardware=HardwareConfig(),
    )


@dataclasses.dataclass
class Run:
    losses: np.ndarray
    metrics: list
    state: dict
    trainer: Trainer
    step: object  # the compiled step
    partitioned: str = None  # its HLO right after SPMD partitioning (from the same compile), when asked for


def train(c: TrainConfig, check=None, partitioned: bool = False) -> Run:
    from zoo import hlo

    plan = validate(c, len(jax.devices()), None)
    trainer = Trainer(c, plan)
    data = SyntheticData(c.data, c.model.vocab_size)
    state = trainer.init()
    text = None
    if partitioned:
        step, text = hlo.compile_with_partitioned_hlo(
            trainer.lower(state, trainer.abstract_tokens()), trainer.compiler_options
        )
    else:
        step = trainer.compile(state, trainer.abstract_tokens())
    losses, metrics = [], []
    for i in range(STEPS):
        # One batch over and over: its loss must fall, whatever the initialisation (fresh batches'
        # losses over a few steps are noise).
        state, m = step(state, trainer.shard_tokens(data.batch(0)))
        if check is not None:
            check(state)
        losses.append(float(m["loss"]))
        metrics.append(jax.device_get(m))
    return Run(np.array(losses), metrics, state, trainer, step, text)


_REFERENCE: dict = {}


def reference(model: str, dropless: bool = True, batch: int = 8) -> Run:
    if (model, dropless, batch) not in _REFERENCE:
        _REFERENCE[model, dropless, batch] = train(make_config(model, "single", dropless=dropless, batch=batch))
    return _REFERENCE[model, dropless, batch]


_EP_RUNS: dict = {}


def expert_parallel_run(impl: str) -> Run:
    """dsv3_tiny_a on fsdp_ep (fsdp 2 x expert 4), dropless: shared by the tests that read its program."""
    if impl not in _EP_RUNS:
        _EP_RUNS[impl] = train(make_config("dsv3_tiny_a", "fsdp_ep", moe_impl=impl), partitioned=True)
    return _EP_RUNS[impl]


# DeepSeek-V3 on dp, fsdp and fsdp_tp runs in the slow tier: its experts route per device under fsdp_ep
# here (the run test_expert_parallel_train_step_is_local reads too), what dp, fsdp and fsdp_tp change
# (the batch's and the weights' layout) Llama's cases check, and the experts' mlp split over tensor
# tests/test_moe_dispatch.py::test_expert_parallel_matches_single_program.
SLOW_CASES = (("dsv3_tiny_a", "dp"), ("dsv3_tiny_a", "fsdp"), ("dsv3_tiny_a", "fsdp_tp"))
CASES = [
    pytest.param(model, mesh, marks=pytest.mark.slow) if (model, mesh) in SLOW_CASES else (model, mesh)
    for model in MODELS for mesh in MESHES if not (model == "llama_tiny_a" and mesh == "fsdp_ep")
]  # fmt: skip


@pytest.mark.parametrize("model, mesh", CASES)
def test_sharded_losses_match_single_device(model, mesh):
    # On a sharded batch each device fills its capacity buffers from its own tokens, so it drops other
    # assignments than one program over the whole batch: compare where nothing drops.
    ref = reference(model, dropless=True)
    run = expert_parallel_run("capacity") if mesh == "fsdp_ep" else train(make_config(model, mesh, dropless=True))
    if run.trainer.cfg.model.num_moe_layers:
        text = run.trainer.lower().as_text()
        assert "shard_map" in text or "manual" in text.lower()  # routed per device
        assert ("all_to_all" in text) == (mesh == "fsdp_ep")  # tokens travel to the experts only under EP
    assert run.trainer.mesh.devices.size == 8
    # expert parallelism is held to the 1e-5 (test_expert_parallel_train_step_is_local);
    # the other layouts to 1e-4
    np.testing.assert_allclose(run.losses, ref.losses, atol=1e-5 if mesh == "fsdp_ep" else 1e-4, rtol=0)
    assert ref.losses[-1] < ref.losses[0]  # it trains
    # The parameters really are split: some leaf holds less than its full size per device.
    shards = [x.addressable_shards[0].data.size < x.size for x in jax.tree.leaves(run.state["params"])]
    assert mesh == "dp" or any(shards)


ROUTED = ("w_gate", "w_up", "w_down")


@pytest.mark.parametrize("impl", ["capacity", "ragged"])
def test_expert_parallel_train_step_is_local(impl):
    """The real Trainer on fsdp 2 x expert 4: the compiled step exchanges tokens with all-to-all
    over the expert axis, no collective carries the global batch or its routing, every device holds
    1/ep of the routed experts (parameters and AdamW moments), and 5 steps' losses equal the single
    device's within 1e-5 under both kernels (`ragged` dropless, in rounds; `capacity` with room for
    every assignment, against the same single-device run)."""
    from zoo import hlo

    run = expert_parallel_run(impl)
    m, sizes = run.trainer.cfg.model, run.trainer.plan.mesh.sizes
    ep, experts = sizes["expert"], m.moe.n_routed_experts
    assert (ep, sizes["fsdp"]) == (4, 2)
    np.testing.assert_allclose(run.losses, reference("dsv3_tiny_a").losses, atol=1e-5, rtol=0)
    assert max(float(x["moe_dropped_fraction"].max()) for x in run.metrics) == 0.0
    # The dropless exchange's rounds per MoE layer (zoo.nn.expert_rounds): what each step's routing took.
    rounds = [np.asarray(x["moe_exchange_rounds"]) for x in run.metrics] if impl == "ragged" else []
    assert all(r.shape == (m.num_moe_layers,) and r.min() >= 1 for r in rounds) and (
        "moe_exchange_rounds" in run.metrics[0]
    ) == (impl == "ragged")

    found = [c for c in hlo.collectives(run.step.as_text()) if not c.trivial]
    a2a = [c for c in found if c.kind == "all-to-all"]
    assert a2a and all(c.group_size == ep for c in a2a), a2a
    rows = [c for c in a2a if c.dtypes == {"f32"} and len(c.operands[0].dims) == 3]
    if impl == "capacity":  # dispatch and return, forward and backward, in each MoE layer (the layer scan's trip count)
        assert sum(c.executions for c in rows) == 4 * m.num_moe_layers
    else:  # the first round as the capacity kernel's exchange; the later rounds (a loop of run-time
        # length, counted once): forward there and back; backward inputs and output cotangents there,
        # input cotangents back.
        assert sum(c.executions for c in rows if c.trip_count_known) == 4 * m.num_moe_layers
        assert sum(c.executions for c in rows if not c.trip_count_known) == 5 * m.num_moe_layers
    tokens = run.trainer.cfg.data.batch_size * SEQ
    for c in found:
        for a in c.operands + c.results:
            assert tokens not in a.dims and tokens * m.moe.num_experts_per_tok not in a.dims, (
                c.kind,
                c.op_name,
                str(a),
            )
            assert not (run.trainer.cfg.data.batch_size in a.dims and SEQ in a.dims), (c.kind, c.op_name, str(a))

    routed = [
        (jax.tree_util.keystr(path), leaf)
        for path, leaf in jax.tree_util.tree_leaves_with_path(
            {"params": run.state["params"], "opt_state": run.state["opt_state"]}
        )
        if getattr(path[-1], "name", None) in ROUTED
        and leaf.ndim == 4  # [layers, experts, ...]; not the shared or dense MLPs
    ]
    assert sum(name.startswith("['params']") for name, _ in routed) == len(ROUTED)
    assert any(".mu." in name for name, _ in routed) and any(".nu." in name for name, _ in routed)  # AdamW's moments
    for name, leaf in routed:
        shard = leaf.addressable_shards[0].data.shape
        assert leaf.shape[1] == experts and shard[1] == experts // ep, (name, shard)  # [layers, experts, ...]
        assert math.prod(shard) * ep * sizes["fsdp"] == leaf.size, (name, shard)


def test_scale_report_of_the_expert_parallel_step():
    """zoo.tools.scale on the compiled EP step: per-device state bytes equal what the devices hold, and
    the all-to-all traffic is the capacity buffers' bytes times their executions."""
    from zoo.tools import scale
    from zoo.nn.moe_dispatch import expert_capacity

    run = expert_parallel_run("capacity")
    rep = scale.scale_report(run.trainer, run.step, run.partitioned)
    held = lambda tree: sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(tree))  # noqa: E731
    state = rep["state_bytes_per_device"]
    assert state["params"] == state["grads"] == held(run.state["params"])
    assert state["opt_state"] == held(run.state["opt_state"])
    assert state["global_params"] == sum(x.nbytes for x in jax.tree.leaves(run.state["params"]))
    assert rep["devices"] == 8 and rep["per_device_batch"] == 1 and rep["dtypes"]["params"] == ["float32"]

    m = run.trainer.cfg.model
    capacity = expert_capacity(SEQ, m.moe.num_experts_per_tok, m.moe.n_routed_experts, m.moe.capacity_factor)
    buffer = m.moe.n_routed_experts * capacity * m.hidden_size * 4  # one device's [E, C, D] float32
    for section in ("compiled", "partitioned"):
        row = rep["collectives"][section]["by_kind_and_dtype"]["all-to-all"]["f32"]
        assert row["executions"] == 4 * m.num_moe_layers and row["bytes"] == row["executions"] * buffer, (section, row)
        assert rep["collectives"][section]["unknown_trip_counts"] == 0
        kinds = rep["collectives"][section]["by_kind"]
        assert {"all-gather", "reduce-scatter", "all-to-all"} <= set(kinds)  # FSDP weights in, gradients out
    largest = rep["collectives"]["compiled"]["largest"]
    assert largest == sorted(largest, key=lambda c: -c["bytes"]) and len(largest) == scale.LARGEST
    text = scale.render(rep)
    assert "all-to-all" in text and "per device: params" in text


# 25 s of CPU: the slow tier. Its parts each have a default-tier test: test_sharded_losses_match_single_device
# (fsdp_ep), test_gradient_accumulation_matches_one_big_batch,
# test_params_and_opt_state_live_on_pinned_host_between_steps, and
# tests/test_moe_dispatch.py::test_checkpoint_policies_reach_tags_inside_the_shard_map.
@pytest.mark.slow
def test_expert_parallel_with_gradient_accumulation_and_host_offload():
    """fsdp_ep through the Trainer with 2 microbatches, the MoE tags offloaded from inside the
    shard_map, parameters and optimizer state in pinned host memory: the losses of one 16-sequence
    batch on one device."""
    from zoo.offload import load_preset

    policy = load_preset("deepseek_mla_moe_offload", params="pinned_host", opt_state="pinned_host")
    run = train(make_config("dsv3_tiny_a", "fsdp_ep", offload=policy, accum=2, batch=16))
    assert {x.sharding.memory_kind for x in jax.tree.leaves(run.state["params"])} == {"pinned_host"}
    assert "all-to-all" in run.step.as_text()
    np.testing.assert_allclose(run.losses, reference("dsv3_tiny_a", batch=16).losses, atol=1e-5, rtol=0)


def test_params_and_opt_state_live_on_pinned_host_between_steps():
    ref = reference("dsv3_tiny_a")
    host = OffloadConfig(name="host", params="pinned_host", opt_state="pinned_host")
    seen = []

    def check(state):
        kinds = {x.sharding.memory_kind for x in jax.tree.leaves({"p": state["params"], "o": state["opt_state"]})}
        seen.append(kinds)

    c = make_config("dsv3_tiny_a", "fsdp", offload=host)
    run = train(c, check)
    assert seen == [{"pinned_host"}] * STEPS
    np.testing.assert_allclose(run.losses, ref.losses, atol=1e-4, rtol=0)
    for a, b in zip(jax.tree.leaves(run.state["params"]), jax.tree.leaves(ref.state["params"])):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-4)


def test_params_per_device_counts_what_each_device_holds():
    """What picks the initialiser's LLVM level (zoo.model.init_compile_options): a replicated leaf counts
    whole on every device, a sharded one by its shard."""
    from zoo.counts import count_params

    def per_device(mesh):
        c = make_config("llama_tiny_a", mesh)
        return Trainer(c, validate(c, len(jax.devices()), None)).params_per_device()

    total = count_params(SIZES["llama_tiny_a"])
    assert per_device("single") == per_device("dp") == total  # data parallel: every device holds all
    assert total / 8 <= per_device("fsdp") < total / 2  # the large leaves split 8 ways, norms whole


def test_gradient_accumulation_matches_one_big_batch():
    accumulated = train(make_config("llama_tiny_a", "fsdp", accum=2, batch=16))
    # 16 sequences in 2 microbatches of 8 differ from the reference's 8: compare with a 16-batch run.
    big = train(make_config("llama_tiny_a", "fsdp", accum=1, batch=16))
    np.testing.assert_allclose(accumulated.losses, big.losses, atol=1e-5, rtol=0)
    np.testing.assert_allclose(
        [m["grad_norm"] for m in accumulated.metrics], [m["grad_norm"] for m in big.metrics], rtol=1e-4
    )


def test_moe_bias_is_a_buffer_the_optimizer_never_moves():
    import equinox as eqx
    import jax.numpy as jnp

    from zoo.model import abstract
    from zoo.train.step import make_optimizer

    params, _ = eqx.partition(abstract(SIZES["dsv3_tiny_a"]), lambda x: isinstance(x, jax.ShapeDtypeStruct))
    params = jax.tree.map(lambda s: jnp.ones(s.shape, s.dtype), params)
    tx, _ = make_optimizer(OptimizerConfig(lr=0.1, warmup_steps=0, weight_decay=0.5), total_steps=10)
    grads = jax.tree.map(jnp.ones_like, params)  # even a (wrong) nonzero gradient must not move it
    updates, _ = jax.jit(tx.update)(grads, jax.jit(tx.init)(params), params)
    assert np.all(np.asarray(updates.stack("moe_layers").layers[0].ffn.e_score_correction_bias) == 0)
    assert np.all(np.asarray(updates.stack("moe_layers").layers[0].ffn.router) != 0)
    assert np.all(np.asarray(updates.final_norm.weight) != 0)


def test_moe_bias_follows_the_balancing_rule():
    ref = reference("dsv3_tiny_a")
    metrics, state = ref.metrics, ref.state
    rate = make_config("dsv3_tiny_a", "single").trainer.moe_bias_update_rate
    b = np.asarray(state["params"].stack("moe_layers").layers[0].ffn.e_score_correction_bias)
    assert b.shape == (2, 8)
    # Each step moves every bias by exactly +-rate (or 0 at the mean): multiples of rate, bounded by steps.
    np.testing.assert_allclose(b / rate, np.round(b / rate), atol=1e-3)
    assert 0 < np.abs(b).max() <= STEPS * rate + 1e-6
    load = np.asarray(metrics[0]["expert_load_max_over_mean"])
    assert load.shape == (2,) and np.all(load >= 1.0)


def test_mesh_fill_and_errors():
    assert resolve_mesh_shape({"data": 1, "fsdp": -1, "tensor": 2, "expert": 1}, 8).fsdp == 4
    with pytest.raises(ShardingError, match=r"^mesh: .* does not match the 8 devices"):
        resolve_mesh_shape({"data": 3, "fsdp": 1, "tensor": 1, "expert": 1}, 8)
    with pytest.raises(ShardingError, match=r"^mesh.fsdp: -1 cannot fill"):
        resolve_mesh_shape({"data": 3, "fsdp": -1, "tensor": 1, "expert": 1}, 8)
    with pytest.raises(ShardingError, match=r"^mesh.expert: only one axis may be -1"):
        resolve_mesh_shape({"data": 1, "fsdp": -1, "tensor": 1, "expert": -1}, 8)


def test_logical_rules_skip_used_mesh_axes():
    rules = mesh_preset("fsdp_tp").rules
    assert tuple(logical_to_spec(("batch", "seq", "embed"), rules)) == (("data", "fsdp", "expert"), None, None)
    assert tuple(logical_to_spec(("embed", "mlp"), rules)) == ("fsdp", "tensor")
    assert tuple(logical_to_spec(("layers", "experts", "embed", "mlp"), rules)) == (None, "expert", "fsdp", "tensor")


@pytest.mark.parametrize("size", sorted(SIZES))
def test_every_leaf_of_every_size_has_a_spec(size):
    from zoo.model import abstract

    model = abstract(SIZES[size])
    specs = param_specs(model, mesh_preset("fsdp_tp").rules)
    leaves = jax.tree.leaves(model)
    is_spec = lambda x: isinstance(x, PartitionSpec)  # noqa: E731
    assert len(jax.tree.leaves(specs, is_leaf=is_spec)) == len(leaves)
    # Stacked layer leaves keep their leading layer axis unsharded.
    for path, spec in jax.tree_util.tree_leaves_with_path(specs, is_leaf=is_spec):
        if any(getattr(k, "name", None) == "layers" for k in path):
            assert spec[0] is None
    # Every leaf is declared by the block that holds it: its axes, and its dtype in use.
    from zoo.sharding import Leaf, leaf_declaration

    for path, _ in jax.tree_util.tree_leaves_with_path(model):
        assert isinstance(leaf_declaration(model, path), Leaf), jax.tree_util.keystr(path)


def test_every_block_declares_its_leaves_with_axes_and_a_dtype_in_use():
    """Each block's PARAMS names real array fields, each with logical axes and a dtype in use (cast to
    the compute dtype, or kept float32). The matmul weights are the ones cast: a router or a norm
    scale cast to bf16 would change the routing, a weight left in float32 would be gathered in float32."""
    import dataclasses

    from zoo.model import CausalLM
    from zoo.nn import GatedMLP, GQAttention, MLAttention, MoE, RMSNorm
    from zoo.nn.moe_dispatch import EXPERT_AXES, ExpertWeights
    from zoo.sharding import LOGICAL_AXES, Leaf

    blocks = (CausalLM, GQAttention, MLAttention, GatedMLP, MoE, ExpertWeights, RMSNorm)
    cast = set()
    for cls in blocks:
        fields = {f.name for f in dataclasses.fields(cls)}
        for name, leaf in cls.PARAMS.items():
            assert name in fields, f"{cls.__name__}.PARAMS declares {name!r}, which is no field"
            assert isinstance(leaf, Leaf) and isinstance(leaf.compute, bool)
            assert all(a is None or a in LOGICAL_AXES for a in leaf.axes), f"{cls.__name__}.{name}: {leaf.axes}"
            if leaf.compute:
                cast.add(name)
    assert cast == {
        "embed",
        "lm_head",
        "wq",
        "wk",
        "wv",
        "wo",
        "bq",
        "bk",
        "bv",
        "bo",
        "wq_a",
        "wq_b",
        "wkv_a",
        "wk_b",
        "wv_b",
        "w_gate",
        "w_up",
        "w_down",
        "b_gate",
        "b_up",
        "b_down",
    }
    # The routed experts' axes the dispatch reads are the MoE block's declaration, not a copy.
    assert EXPERT_AXES == {k: v.axes for k, v in ExpertWeights.PARAMS.items()}
    assert all(MoE.PARAMS[k] is ExpertWeights.PARAMS[k] for k in EXPERT_AXES)


def test_an_undeclared_leaf_is_an_error_naming_it():
    """A block with a weight its PARAMS does not declare is refused, in one line naming the class and
    the field, by the specs and by the compute cast: never sharded or gathered by a guess."""
    from typing import ClassVar

    import equinox as eqx
    import jax.numpy as jnp

    from zoo import sharding as zs
    from zoo.nn import GatedMLP

    class GatedMLPWithScale(GatedMLP):
        w_scale: jax.Array

        def __init__(self):
            super().__init__(8, 16, key=jax.random.key(0))
            self.w_scale = jnp.ones((8,))

    block = GatedMLPWithScale()
    rules = mesh_preset("fsdp_tp").rules
    message = (
        r"^sharding: GatedMLPWithScale.w_scale \(leaf w_scale\) is not declared; add 'w_scale' to "
        r"GatedMLPWithScale.PARAMS[^\n]*$"
    )
    with pytest.raises(ShardingError, match=message):
        param_specs(block, rules)
    mesh = zs.make_mesh(zs.MeshShape(1, 1, 1, 1))
    with zs.activate(mesh, rules), pytest.raises(ShardingError, match=message):
        zs.cast_for_compute(block, "bfloat16")

    class Declared(GatedMLPWithScale):
        PARAMS: ClassVar[dict] = {**GatedMLP.PARAMS, "w_scale": zs.float32("embed")}

    assert tuple(param_specs(Declared(), rules).w_scale) == ("fsdp",)
    with zs.activate(mesh, rules):
        cast = zs.cast_for_compute(Declared(), "bfloat16")
    assert cast.w_scale.dtype == jnp.float32 and cast.w_gate.dtype == jnp.bfloat16
    assert eqx.is_array(cast.w_up)


def test_indivisible_dim_names_the_mesh_axis():
    from zoo.model import abstract

    with pytest.raises(ShardingError, match=r"^mesh.tensor: dim \d+ of .* not divisible by tensor=3"):
        param_specs(
            abstract(SIZES["llama_tiny_a"]),
            mesh_preset("fsdp_tp").rules,
            {"data": 1, "fsdp": 1, "tensor": 3, "expert": 1},
        )


@pytest.mark.parametrize("size", sorted(SIZES))
def test_model_options_are_the_named_sizes(size):
    """`model=<size>` composes (through the ConfigStore node zoo.train.run_config registers) to SIZES[size]."""
    from zoo.tools.kit import compose

    assert load_group("model", compose([f"model={size}"]).model) == SIZES[size]


# --- the published 128-device layouts, on the abstract real-size models (nothing allocated) ---------


@pytest.mark.parametrize(
    "size, mesh", [("deepseek_v3_671b", "deepseek_v3_128"), ("llama3.1_405b", "llama3.1_405b_128")]
)
def test_real_size_state_is_spread_evenly_over_128_devices(size, mesh):

    from zoo.model import abstract
    from zoo.sharding import check_replication, shard_ways
    from zoo.train.step import make_optimizer

    preset = mesh_preset(mesh)
    sizes = {a: getattr(preset, a) for a in ("data", "fsdp", "tensor", "expert")}
    assert math.prod(sizes.values()) == preset.devices == 128
    params = abstract(SIZES[size])
    tx, _ = make_optimizer(OptimizerConfig(), 100)
    state = {"params": params, "opt_state": jax.eval_shape(tx.init, params)}
    specs = param_specs(state, preset.rules, sizes)  # the optimizer state's too (its step counts replicated)
    leaves = jax.tree_util.tree_leaves(state)
    spec_leaves = jax.tree_util.tree_leaves(specs, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))
    nbytes = [math.prod(x.shape) * x.dtype.itemsize for x in leaves]
    per_device = [b / shard_ways(s, sizes) for b, s in zip(nbytes, spec_leaves)]
    replicated = [b for b, s in zip(nbytes, spec_leaves) if shard_ways(s, sizes) == 1]
    assert max(replicated) <= 64 * 2**20  # no parameter (or moment) above 64 MB is whole on a device
    assert sum(per_device) == pytest.approx(sum(nbytes) / 128, rel=0.10)  # parameters + AdamW state, evenly spread
    check_replication(params, param_specs(params, preset.rules, sizes), sizes, preset.max_replicated_mb * 2**20)


def test_a_rule_that_leaves_a_large_leaf_replicated_is_refused():
    from zoo.model import abstract
    from zoo.sharding import check_replication

    preset = mesh_preset("deepseek_v3_128")
    sizes = {a: getattr(preset, a) for a in ("data", "fsdp", "tensor", "expert")}
    rules = {**preset.rules, "latent": []}  # the MLA up-projections' latent dim left unsharded
    params = abstract(SIZES["deepseek_v3_671b"])
    with pytest.raises(
        ShardingError, match=r"^mesh.rules: parameter stacks.0.layers.0.attn.wq_b .* would be replicated"
    ):
        check_replication(params, param_specs(params, rules, sizes), sizes, 16.0 * 2**20)


# DeepSeek-V3's in the slow tier: the gather's dtype is the FSDP rules', not the family's.
@pytest.mark.parametrize("model", ["llama_tiny_a", pytest.param("dsv3_tiny_a", marks=pytest.mark.slow)])
def test_fsdp_gathers_weights_in_the_compute_dtype(model):
    """With bf16 compute, every weight all-gather the partitioner emits moves bf16, not the float32
    master weights (read right after SPMD partitioning: XLA:CPU later widens bf16 collectives)."""
    from zoo import hlo

    c = make_config(model, "fsdp")
    c = dataclasses.replace(c, model=c.model.replace(compute_dtype="bfloat16"))
    trainer = Trainer(c, validate(c, len(jax.devices()), None))
    found = hlo.collectives(hlo.partitioned_hlo(trainer.lower(), trainer.compiler_options))
    gathers = [f for f in found if f.kind == "all-gather" and not f.trivial]
    assert len(gathers) >= 8  # the layers' weights (and the head) are gathered, inside the layer scans
    m = c.model
    # The router is the one weight used in float32 (routing at HIGHEST precision): [embed, experts].
    router = (m.hidden_size, m.moe.n_routed_experts) if m.moe else None
    wide = [str(f.results[0]) for f in gathers if f.results[0].dtype != "bf16" and f.results[0].dims[-2:] != router]
    assert not wide, wide  # no activation, routing data or weight in float32 (the routing runs per device)
    assert any(f.executions >= 2 for f in gathers)  # once per layer: the scan's trip count is read


def test_gradient_norm_is_one_dot_per_leaf_and_never_gathers_a_sharded_leaf():
    """zoo.train.update.sum_of_squares (the step's gradient norm and clipping): the float32 sum of
    squares of a leaf, as a dot of the leaf with itself. Under train.py's XLA:CPU default
    (`xla.cpu_ynn_fusions: dot`) its compiled program writes no leaf-sized square, where optax's
    square-then-sum does (a process of its own: XLA flags are fixed when JAX starts); and on a mesh
    a leaf sharded on an inner dim is not gathered: each device sums its shard, one scalar is
    all-reduced."""
    import subprocess
    import sys

    import jax.numpy as jnp
    import optax
    from jax.sharding import NamedSharding

    from zoo.hlo import collectives
    from zoo.train.run import YNN_FLAG
    from zoo.train.update import global_norm, sum_of_squares

    x = np.random.default_rng(0).normal(size=(4, 64, 256)).astype(np.float32) * 3
    exact = float((x.astype(np.float64) ** 2).sum())
    assert abs(float(jax.jit(sum_of_squares)(jnp.asarray(x))) - exact) <= 1e-6 * exact
    tree = {"a": jnp.asarray(x), "b": None, "c": jnp.asarray(x[0, :3])}
    np.testing.assert_allclose(
        float(global_norm(tree, divide=2)), float(optax.tree.norm({"a": x / 2, "c": x[0, :3] / 2})), rtol=1e-6
    )

    # The entry computation's leaf-sized results other than the leaf itself: a square written out.
    script = """
import jax, jax.numpy as jnp, optax
from zoo.train.update import sum_of_squares
for f in (lambda a: optax.tree.norm(a, squared=True), sum_of_squares):
    hlo = jax.jit(f).lower(jnp.ones((4, 64, 256))).compile().as_text()
    entry = hlo[hlo.index("\\nENTRY"):]
    print(sum("= f32[4,64,256]" in line and " parameter(" not in line for line in entry.splitlines()))
"""
    env = {**os.environ, "XLA_FLAGS": f"{YNN_FLAG}=dot", "JAX_PLATFORMS": "cpu"}
    out = subprocess.run(
        [sys.executable, "-c", script],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=pathlib.Path(__file__).resolve().parents[1],
    )
    assert out.returncode == 0, out.stderr[-2000:]
    optax_squares, dot_squares = (int(n) for n in out.stdout.split())
    assert optax_squares >= 1 and dot_squares == 0, (optax_squares, dot_squares)

    for axis_type in (jax.sharding.AxisType.Auto, jax.sharding.AxisType.Explicit):  # zoo's meshes; research code's
        mesh = jax.make_mesh((8,), ("fsdp",), axis_types=(axis_type,))
        sharded = jax.device_put(x, NamedSharding(mesh, PartitionSpec(None, "fsdp")))
        found = {c.kind for c in collectives(jax.jit(sum_of_squares).lower(sharded).compile().as_text())}
        assert found == {"all-reduce"}, (axis_type, found)
        assert abs(float(jax.jit(sum_of_squares)(sharded)) - exact) <= 1e-6 * exact


# --- sequence parallelism ------------------------------------------------------------------------

# Qwen3 (q/k norms over the gathered heads) and DeepSeek-V3 (MLA, routed experts on gathered tokens) in
# the slow tier: Llama's case covers the default tier's budget.
SP_MODELS = ("llama_tiny_a", *(pytest.param(m, marks=pytest.mark.slow) for m in ("qwen3_tiny_a", "dsv3_tiny_a")))


def sequence_parallel_config(model: str, **data):
    c = make_config(model, "fsdp_tp")
    c.mesh = dataclasses.replace(c.mesh, sequence_parallel=True)
    if data:
        c.data = dataclasses.replace(c.data, **data)
    return c


@pytest.mark.parametrize("model", SP_MODELS)
def test_sequence_parallel_step_matches_single_device(model):
    ref = reference(model, dropless=True)
    run = train(sequence_parallel_config(model), partitioned=True)
    assert run.trainer.rules["seq"] == ("tensor",) or list(run.trainer.rules["seq"]) == ["tensor"]
    np.testing.assert_allclose(run.losses, ref.losses, atol=1e-4, rtol=0)
    # Five steps of AdamW on the same batch: the parameters agree only if every step's gradients did.
    for a, b in zip(jax.tree.leaves(run.state["params"]), jax.tree.leaves(ref.state["params"])):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-4, rtol=0)
    # The partitioned program gathers the sequence whole (20 positions from halves of 10) before the
    # projections, inside the layer scan, forward and backward.
    from zoo import hlo

    seq_gathers = [
        c
        for c in hlo.collectives(run.partitioned)
        if c.kind == "all-gather"
        and c.operands[0].dims[1:2] == (SEQ // 2,)
        and c.results[0].dims[1:2] == (SEQ,)
        and "while" in c.op_name
    ]
    assert len(seq_gathers) >= 2


def collective_executions(seq_len: int) -> int:
    """Collective executions per step of llama_tiny_a on fsdp_tp with sequence parallelism (blockwise
    attention, 256-tiles) at `seq_len`, in the program right after SPMD partitioning."""
    from zoo import hlo

    c = sequence_parallel_config("llama_tiny_a", seq_len=seq_len)
    c.model = c.model.replace(
        attention_impl="blockwise", max_position_embeddings=max(seq_len, c.model.max_position_embeddings)
    )
    c.trainer = dataclasses.replace(c.trainer, loss_chunk_size=0)  # the loss's chunk loop would scale with the length
    trainer = Trainer(c, validate(c, len(jax.devices()), None))
    _, text = hlo.compile_with_partitioned_hlo(trainer.lower(), trainer.compiler_options)
    return sum(row["executions"] for row in hlo.summarize(hlo.collectives(text)).values())


@pytest.mark.slow  # the default tier checks the same on packed rows (test_sequence_parallel_packed_rows_...)
def test_sequence_parallel_attention_gathers_do_not_scale_with_tiles():
    # 512 positions are 3 visible 256-tiles per sequence, 1024 are 10: a collective per tile (a gather of
    # q/k/v, an all-to-all of the output gradient) would add 7 executions per layer and pass.
    assert collective_executions(512) == collective_executions(1024)


def packed_sequence_parallel_step(seq_len: int, mesh_cfg=None):
    """Loss and gradients of llama_tiny_a (blockwise attention) on packed rows (segment ids), jitted
    under the fsdp_tp layout with sequence parallelism (or under `mesh_cfg`), and the program after
    SPMD partitioning."""
    import equinox as eqx

    from zoo import hlo
    from zoo import model as zoo_model
    from zoo import sharding as zs

    config = SIZES["llama_tiny_a"].replace(attention_impl="blockwise", max_position_embeddings=seq_len)
    model = zoo_model.build(config, key=jax.random.key(0))
    rng = np.random.default_rng(0)
    tokens = jax.numpy.asarray(rng.integers(0, config.vocab_size, (4, seq_len)), jax.numpy.int32)
    segments = jax.numpy.asarray(np.sort(rng.integers(0, 3, (4, seq_len)), axis=1), jax.numpy.int32)

    def loss(params, static, tokens, segments):
        return zoo_model.loss_fn(eqx.combine(params, static), tokens, segment_ids=segments)

    params, static = eqx.partition(model, eqx.is_array)
    grad = jax.value_and_grad(loss)
    want = jax.jit(grad, static_argnums=1)(params, static, tokens, segments)
    mesh_cfg = mesh_cfg or dataclasses.replace(mesh_preset("fsdp_tp"), sequence_parallel=True)
    mesh = zs.make_mesh(resolve_mesh_shape(mesh_cfg.axes, 8))
    with zs.activate(mesh, mesh_cfg.rules) as layout:
        params = jax.device_put(params, zs.named(mesh, param_specs(params, mesh_cfg.rules)))
        tokens, segments = (jax.device_put(t, layout.sharding(zs.TOKEN_AXES)) for t in (tokens, segments))
        lowered = jax.jit(grad, static_argnums=1).lower(params, static, tokens, segments)
    compiled, text = hlo.compile_with_partitioned_hlo(lowered)
    return want, compiled(params, tokens, segments), text


def test_sequence_parallel_packed_rows_match_and_exchange_nothing_per_tile():
    runs = {n: packed_sequence_parallel_step(n) for n in (512, 1024)}
    for want, got, _ in runs.values():
        np.testing.assert_allclose(float(got[0]), float(want[0]), rtol=1e-5)
        for a, b in zip(jax.tree.leaves(got[1]), jax.tree.leaves(want[1])):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=1e-4)
    from zoo import hlo

    executions = {
        n: sum(r["executions"] for r in hlo.summarize(hlo.collectives(text)).values())
        for n, (_, _, text) in runs.items()
    }
    assert executions[512] == executions[1024], executions  # 3 visible 256-tiles per row against 10


def _loss_and_grads(c):
    """The trainer's loss and its gradients on the first synthetic batch, under the config's mesh."""
    from zoo import sharding as zs

    trainer = Trainer(c, validate(c, len(jax.devices()), None))
    params = trainer.init()["params"]
    tokens = jax.device_get(SyntheticData(c.data, c.model.vocab_size).batch(0))
    with zs.activate(trainer.mesh, trainer.rules):
        return jax.jit(jax.value_and_grad(lambda p, t: trainer.loss_and_aux(p, t)[0]))(params, tokens)


# 40-90 s each on the 2-core machine: the slow tier. The default tier has the loss-level check
# (tests/test_loss.py::test_vocab_parallel_loss_matches_unsharded) and the sharded steps' losses above.
@pytest.mark.slow
@pytest.mark.parametrize(
    "model, mesh, vocab_rule",
    [("llama_tiny_a", "fsdp_tp", None), ("gemma3_tiny_a", "fsdp", None), ("dsv3_tiny_a", "fsdp_ep", ["expert"])],
)
def test_vocab_parallel_loss_and_gradients_match_single_device(model, mesh, vocab_rule):
    # Under a mesh the chunked loss runs vocabulary-parallel (zoo/loss.py): on fsdp_tp the head's columns
    # are split over tensor and the logsumexp combined across them; Gemma 3 ties the head to the
    # embedding (one kv head: no tensor axis), so it runs on fsdp, its gradient reduce-scattered once;
    # DeepSeek-V3 with the vocabulary over expert (an axis that also splits the batch, as the 671B
    # preset) gathers each expert group's rows in the loss and in the embedding lookup.
    sharded = make_config(model, mesh)
    if vocab_rule:
        sharded.mesh.rules = {**sharded.mesh.rules, "vocab": vocab_rule}
    (ref_loss, ref_grads), (loss, grads) = (_loss_and_grads(c) for c in (make_config(model, "single"), sharded))
    np.testing.assert_allclose(loss, ref_loss, atol=1e-5, rtol=0)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=1e-4)


def test_vocab_parallel_head_gradient_is_one_bf16_reduce_scatter():
    from zoo import hlo

    c = make_config("llama_tiny_a", "fsdp_tp")
    c.model = c.model.replace(compute_dtype="bfloat16")
    trainer = Trainer(c, validate(c, len(jax.devices()), None))
    _, text = hlo.compile_with_partitioned_hlo(trainer.lower(), trainer.compiler_options)
    embed, vocab = c.model.hidden_size, c.model.vocab_size
    tensor, fsdp = trainer.mesh.shape["tensor"], trainer.mesh.shape["fsdp"]
    found = [x for x in hlo.collectives(text) if not x.trivial]
    # the head's gradient: its [embed, vocab / tensor] per-device partial sums, reduce-scattered onto
    # the embed shards once per step, in bf16
    head = [x for x in found if x.operands[0].dims == (embed, vocab // tensor)]
    assert [(x.kind, x.operands[0].dtype, x.results[0].dims, x.executions) for x in head if x.kind != "all-gather"] == [
        ("reduce-scatter", "bf16", (embed // fsdp, vocab // tensor), 1)
    ]
    # no float32 collective carries a vocabulary-sized buffer (the chunked loss all-reduced f32[embed, vocab])
    assert not [
        x
        for x in found
        if x.operands[0].dtype == "f32" and any(d in (vocab, vocab // tensor) for d in x.operands[0].dims)
    ]


# --- context parallelism (mesh.context_parallel) ---------------------------------------------------


def context_parallel_mesh(axis: str = "data", **sizes):
    """fsdp 4 x data 2 (by default) with the sequence split over `axis` (context parallelism)."""
    return dataclasses.replace(mesh_preset("fsdp"), **({"data": 2} | sizes), context_parallel=axis)


def test_context_parallel_packed_rows_match_and_gather_keys_once_per_layer():
    # The sequence split in 2 over data: 256 query positions per device at 512 (1 query tile, up to 2
    # key tiles), 512 at 1024 (2 query tiles against up to 4 key tiles: 7 visible tiles on the second
    # shard). The keys and values are gathered once per layer and their gradients reduce-scattered once,
    # whatever the tiles; any per-tile collective would raise the executions at 1024.
    from zoo import hlo

    layers = SIZES["llama_tiny_a"].num_layers
    runs = {n: packed_sequence_parallel_step(n, context_parallel_mesh()) for n in (512, 1024)}
    executions = {}
    for n, (want, got, text) in runs.items():
        np.testing.assert_allclose(float(got[0]), float(want[0]), rtol=1e-5)
        for a, b in zip(jax.tree.leaves(got[1]), jax.tree.leaves(want[1])):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=1e-4)
        found = hlo.collectives(text)
        kv = {
            kind: sum(
                c.executions
                for c in found
                if c.kind == kind
                and len(c.operands[0].dims) == 4
                and (c.operands[0].dims[1], c.results[0].dims[1]) == dims
            )
            for kind, dims in (("all-gather", (n // 2, n)), ("reduce-scatter", (n, n // 2)))
        }
        assert kv == {"all-gather": 2 * layers, "reduce-scatter": 2 * layers}, kv  # k and v, each layer once
        executions[n] = sum(r["executions"] for r in hlo.summarize(found).values())
    assert executions[512] == executions[1024], executions


CP_CASES = [
    # (model, mesh preset, context axis, sequence parallel, attention impl); 64 positions in 8 or 2 chunks
    ("llama_tiny_a", "fsdp", "fsdp", False, "blockwise"),
    ("dsv3_tiny_a", "fsdp_ep", "fsdp", False, "blockwise"),  # MLA, and the experts' tokens chunk-major
    ("gemma3_tiny_a", "fsdp", "fsdp", False, "blockwise"),  # sliding windows (8) across the chunks
    ("gpt_oss_tiny_a", "fsdp_tp", "fsdp", True, "xla"),  # sinks and windows, with sequence parallelism over tensor
]


# 10-20 s each on the 2-core machine: the slow tier (the default tier has the packed-rows check above).
@pytest.mark.slow
@pytest.mark.parametrize("model, mesh, axis, sp, impl", CP_CASES)
def test_context_parallel_loss_and_gradients_match_single_device(model, mesh, axis, sp, impl):

    def config(mesh, **options):
        c = make_config(model, mesh)
        c.model = c.model.replace(attention_impl=impl)
        c.data = dataclasses.replace(c.data, seq_len=64)
        c.mesh = dataclasses.replace(c.mesh, **options)
        return c

    sharded = config(mesh, context_parallel=axis, sequence_parallel=sp)
    assert sharded.mesh.rules["seq"][0] == axis and axis not in sharded.mesh.rules["batch"]
    (ref_loss, ref_grads), (loss, grads) = (_loss_and_grads(c) for c in (config("single"), sharded))
    np.testing.assert_allclose(loss, ref_loss, atol=1e-5, rtol=0)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=1e-4)
