"""Sharded training reproduces the single-device run; memory kinds; accumulation; the MoE bias rule.

Runs on the 8 simulated CPU devices of conftest.py. Meshes come from conf/mesh/*.yaml, so the
presets themselves are what is tested.
"""

import dataclasses
import pathlib

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec
from omegaconf import OmegaConf

from zoo.config import SIZES, conf_yaml
from zoo.offload import OffloadConfig
from zoo.sharding import ShardingError, logical_to_spec, param_specs, resolve_mesh_shape
from zoo.train.config import DataConfig, HardwareConfig, OptimizerConfig, TrainConfig, TrainerConfig, XlaConfig, load_group, validate
from zoo.train.data import SyntheticData
from zoo.train.step import Trainer

CONF = pathlib.Path(__file__).resolve().parents[1] / "conf"
STEPS = 3
MODELS = ("llama_tiny_a", "dsv3_tiny_a")
MESHES = ("dp", "fsdp", "fsdp_tp", "fsdp_ep")


def mesh_preset(name: str):
    return load_group("mesh", OmegaConf.load(CONF / "mesh" / f"{name}.yaml"))


def make_config(model: str, mesh: str, offload: OffloadConfig = None, accum: int = 1, batch: int = 8, bias_rate: float = 0.001, dropless: bool = True):
    m = load_group("model", OmegaConf.load(CONF / "model" / f"{model}.yaml"))
    if dropless and m.num_moe_layers:
        # capacity = every assignment: capacity buffers drop nothing, however the batch is split
        m = m.replace(moe=dataclasses.replace(m.moe, capacity_factor=float(m.moe.n_routed_experts)))
    return TrainConfig(
        model=m,
        mesh=mesh_preset(mesh),
        offload=offload or OffloadConfig(),
        optimizer=OptimizerConfig(lr=1e-2, warmup_steps=1),
        data=DataConfig(batch_size=batch, seq_len=16),
        xla=XlaConfig(),
        trainer=TrainerConfig(steps=STEPS, grad_accum=accum, moe_bias_update_rate=bias_rate),
        hardware=HardwareConfig(),
    )


def train(c: TrainConfig, check=None):
    plan = validate(c, len(jax.devices()), None)
    trainer = Trainer(c, plan)
    data = SyntheticData(c.data, c.model.vocab_size)
    state = trainer.init()
    step = trainer.compile(state, trainer.abstract_tokens())
    losses, metrics = [], []
    for i in range(STEPS):
        # One batch over and over: its loss must fall, whatever the initialisation (fresh batches'
        # losses over 3 steps are noise).
        state, m = step(state, trainer.shard_tokens(data.batch(0)))
        if check is not None:
            check(state)
        losses.append(float(m["loss"]))
        metrics.append(jax.device_get(m))
    return np.array(losses), metrics, state, trainer


_REFERENCE: dict = {}


def reference(model: str, dropless: bool = True):
    if (model, dropless) not in _REFERENCE:
        _REFERENCE[model, dropless] = train(make_config(model, "single", dropless=dropless))
    return _REFERENCE[model, dropless]


CASES = [(model, mesh) for model in MODELS for mesh in MESHES if not (model == "llama_tiny_a" and mesh == "fsdp_ep")]


@pytest.mark.parametrize("model, mesh", CASES)
def test_sharded_losses_match_single_device(model, mesh):
    # On a sharded batch each device fills its capacity buffers from its own tokens, so it drops other
    # assignments than one program over the whole batch: compare where nothing drops.
    ref_losses, _, _, _ = reference(model, dropless=True)
    losses, _, state, trainer = train(make_config(model, mesh, dropless=True))
    if trainer.cfg.model.num_moe_layers:
        text = trainer.lower().as_text()
        assert "shard_map" in text or "manual" in text.lower()  # routed per device
        assert ("all_to_all" in text) == (mesh == "fsdp_ep")  # tokens travel to the experts only under EP
    assert trainer.mesh.devices.size == 8
    np.testing.assert_allclose(losses, ref_losses, atol=1e-4, rtol=0)
    assert ref_losses[-1] < ref_losses[0]  # it trains
    # The parameters really are split: some leaf holds less than its full size per device.
    shards = [x.addressable_shards[0].data.size < x.size for x in jax.tree.leaves(state["params"])]
    assert mesh == "dp" or any(shards)


def test_params_and_opt_state_live_on_pinned_host_between_steps():
    ref_losses, _, ref_state, _ = reference("dsv3_tiny_a")
    host = OffloadConfig(name="host", params="pinned_host", opt_state="pinned_host")
    seen = []

    def check(state):
        kinds = {x.sharding.memory_kind for x in jax.tree.leaves({"p": state["params"], "o": state["opt_state"]})}
        seen.append(kinds)

    c = make_config("dsv3_tiny_a", "fsdp", offload=host)
    losses, _, state, _ = train(c, check)
    assert seen == [{"pinned_host"}] * STEPS
    np.testing.assert_allclose(losses, ref_losses, atol=1e-4, rtol=0)
    for a, b in zip(jax.tree.leaves(state["params"]), jax.tree.leaves(ref_state["params"])):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-4)


def test_gradient_accumulation_matches_one_big_batch():
    ref_losses, ref_metrics, _, _ = reference("llama_tiny_a")
    losses, metrics, _, _ = train(make_config("llama_tiny_a", "fsdp", accum=2, batch=16))
    # 16 sequences in 2 microbatches of 8 differ from the reference's 8: compare with a 16-batch run.
    big, big_metrics, _, _ = train(make_config("llama_tiny_a", "fsdp", accum=1, batch=16))
    np.testing.assert_allclose(losses, big, atol=1e-5, rtol=0)
    np.testing.assert_allclose([m["grad_norm"] for m in metrics], [m["grad_norm"] for m in big_metrics], rtol=1e-4)


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
    _, metrics, state, _ = reference("dsv3_tiny_a")
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


def test_indivisible_dim_names_the_mesh_axis():
    from zoo.model import abstract

    with pytest.raises(ShardingError, match=r"^mesh.tensor: dim \d+ of .* not divisible by tensor=3"):
        param_specs(abstract(SIZES["llama_tiny_a"]), mesh_preset("fsdp_tp").rules, {"data": 1, "fsdp": 1, "tensor": 3, "expert": 1})


@pytest.mark.parametrize("size", sorted(SIZES))
def test_model_options_are_the_named_sizes(size):
    text = (CONF / "model" / f"{size}.yaml").read_text()
    assert text == conf_yaml(size), f"conf/model/{size}.yaml is stale: run python -m zoo.write_conf"
    assert load_group("model", OmegaConf.load(CONF / "model" / f"{size}.yaml")) == SIZES[size]


# --- the published 128-device layouts, on the abstract real-size models (nothing allocated) ---------


@pytest.mark.parametrize("size, mesh", [("deepseek_v3_671b", "deepseek_v3_128"), ("llama3.1_405b", "llama3.1_405b_128")])
def test_real_size_state_is_spread_evenly_over_128_devices(size, mesh):
    import math

    from zoo.model import abstract
    from zoo.sharding import check_replication, shard_ways
    from zoo.train.step import make_optimizer

    preset = mesh_preset(mesh)
    sizes = {a: getattr(preset, a) for a in ("data", "fsdp", "tensor", "expert")}
    assert math.prod(sizes.values()) == preset.devices == 128
    params = abstract(SIZES[size])
    tx, _ = make_optimizer(OptimizerConfig(), 100)
    state = {"params": params, "opt_state": jax.eval_shape(tx.init, params)}
    from zoo.train.step import tree_specs

    specs = tree_specs(state, preset.rules, sizes)
    leaves = jax.tree_util.tree_leaves(state)
    spec_leaves = jax.tree_util.tree_leaves(specs, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))
    nbytes = [math.prod(x.shape) * x.dtype.itemsize for x in leaves]
    per_device = [b / shard_ways(s, sizes) for b, s in zip(nbytes, spec_leaves)]
    replicated = [b for b, s in zip(nbytes, spec_leaves) if shard_ways(s, sizes) == 1]
    assert max(replicated) <= 64 * 2**20  # no parameter (or moment) above 64 MB is whole on a device
    assert sum(per_device) == pytest.approx(sum(nbytes) / 128, rel=0.10)  # parameters + AdamW state, evenly spread
    check_replication(params, tree_specs(params, preset.rules, sizes), sizes, preset.max_replicated_mb * 2**20)


def test_a_rule_that_leaves_a_large_leaf_replicated_is_refused():
    from zoo.model import abstract
    from zoo.sharding import check_replication

    preset = mesh_preset("deepseek_v3_128")
    sizes = {a: getattr(preset, a) for a in ("data", "fsdp", "tensor", "expert")}
    rules = {**preset.rules, "latent": []}  # the MLA up-projections' latent dim left unsharded
    params = abstract(SIZES["deepseek_v3_671b"])
    with pytest.raises(ShardingError, match=r"^mesh.rules: parameter stacks.0.layers.0.attn.wq_b .* would be replicated"):
        check_replication(params, param_specs(params, rules, sizes), sizes, 16.0 * 2**20)


@pytest.mark.parametrize("model", MODELS)
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
