"""Offload policies: validation, presets and their composition, and that no policy changes the maths.

Every preset of conf/offload runs on every tiny family; its loss and gradients must equal those of
`none` (no checkpoint) within 1e-6 relative. Presets whose resolved policy is the same compile once.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import zoo
from zoo import families, offload
from zoo.families import SIZES
from zoo.offload import OffloadConfig, load_preset, remat_policy, resolve

from tiers import by_core_family

# Each family's tiny size, in the registry's order.
FAMILIES = tuple(n for f in families.names() for n, c in SIZES.items() if n.endswith("_tiny_a") and c.family == f)
# Every preset of conf/offload (zoo.tools.plan writes its plans under outputs/, never into conf/): a preset
# added there is under test without editing a list. The issue's presets must be among them.
PRESETS = tuple(offload.preset_names())
ISSUE_PRESETS = (
    "none",
    "full",
    "minimal",
    "save_qkv_proj",
    "qkv_proj_offloaded",
    "minimal_offloaded",
    "llama_qkv_offload",
    "deepseek_mla_moe_offload",
    "optimizer_host",
    "params_host",
    "custom",
)


def test_every_preset_of_the_issue_exists_and_loads():
    missing = [p for p in ISSUE_PRESETS if p not in PRESETS]
    assert not missing
    for p in PRESETS:
        load_preset(p)


# --- validation --------------------------------------------------------------------------------


def test_unknown_tag_lists_the_valid_ones():
    with pytest.raises(ValueError) as e:
        OffloadConfig(checkpoint=True, tags={"query_projection": "offload"})
    msg = str(e.value)
    assert msg.startswith("offload.tags.query_projection: unknown tag")
    assert "query_proj" in msg and "moe_mlpwi_0" in msg


def test_unknown_action_lists_the_valid_ones():
    with pytest.raises(
        ValueError, match=r"offload.tags.query_proj: 'host' is not an action; choose one of device, offload, remat"
    ):
        OffloadConfig(checkpoint=True, tags={"query_proj": "host"})


def test_unknown_memory_kind():
    with pytest.raises(
        ValueError, match=r"offload.opt_state: 'host' is not a memory kind; choose one of device, pinned_host"
    ):
        OffloadConfig(opt_state="host")


def test_tag_the_model_never_emits_is_an_error():
    policy = OffloadConfig(checkpoint=True, tags={"mla_q": "offload"})
    with pytest.raises(
        ValueError, match=r"offload.tags.mla_q: the llama model never emits this tag; it emits: decoder_layer_input"
    ):
        resolve(policy, zoo.get_size("llama_tiny_a"))
    with pytest.raises(ValueError, match="never emits"):
        remat_policy(policy, zoo.get_size("llama_tiny_a"))
    resolve(policy, zoo.get_size("dsv3_tiny_a"))  # fine where it exists


def test_q_lora_null_does_not_emit_the_q_latent():
    c = zoo.get_size("dsv3_tiny_a")
    c = c.replace(mla=c.mla.__class__(**{**c.mla.__dict__, "q_lora_rank": None}))
    with pytest.raises(ValueError, match="offload.tags.mla_q: the deepseek_v3 model never emits"):
        resolve(OffloadConfig(checkpoint=True, tags={"mla_q": "device"}), c)
    # A preset's block section may name it: ignored for this configuration, and reported.
    minimal = load_preset("deepseek_mla_moe_offload")
    assert offload.dropped_block_tags(minimal, c) == ["query_wa_proj", "mla_q"]
    assert "mla_q" not in resolve(minimal, c)


def test_block_sections_hold_only_their_kinds_tags():
    with pytest.raises(
        ValueError,
        match=(
            r"offload.block_tags.mla.query_proj: query_proj belongs to the attention block, not mla; move it "
            r"under offload.tags"
        ),
    ):
        OffloadConfig(checkpoint=True, block_tags={"mla": {"query_proj": "device"}})
    with pytest.raises(ValueError, match=r"offload.block_tags.moe.mla_q: .* move it under offload.block_tags.mla"):
        OffloadConfig(checkpoint=True, block_tags={"moe": {"mla_q": "device"}})
    with pytest.raises(ValueError, match=r"offload.block_tags.gpt: unknown block kind; choose one of mlp, mla, moe"):
        OffloadConfig(checkpoint=True, block_tags={"gpt": {}})
    with pytest.raises(ValueError, match=r"offload.family_tags: replaced by offload.block_tags"):
        offload.from_mapping({"checkpoint": True, "family_tags": {"deepseek_v3": {"mla_kv": "device"}}})


def test_optional_block_tags_under_tags_name_their_section():
    # Mixtral has no dense MLP: naming mlpwi_0 under `tags` is refused with the section to use.
    with pytest.raises(
        ValueError, match=r"offload.tags.mlpwi_0: the mixtral model never emits .*offload.block_tags.mlp"
    ):
        resolve(OffloadConfig(checkpoint=True, tags={"mlpwi_0": "device"}), zoo.get_size("mixtral_tiny_a"))


def test_keeping_a_tag_the_backward_never_reads_is_refused():
    keep = OffloadConfig(checkpoint=True, tags={"mlpwo": "offload"})
    with pytest.raises(ValueError, match=r"offload.tags.mlpwo=offload: the backward pass never reads mlpwo"):
        resolve(keep, zoo.get_size("llama_tiny_a"))
    resolve(OffloadConfig(checkpoint=True, tags={"mlpwo": "remat"}), zoo.get_size("llama_tiny_a"))
    # Gemma 3's post-MLP (sandwich) norm reads it: keeping it there is a real choice.
    assert resolve(keep, zoo.get_size("gemma3_tiny_a"))["mlpwo"] == "offload"


def test_per_tag_actions_without_checkpoint_are_refused():
    with pytest.raises(
        ValueError, match=r"offload.tags.query_proj: with offload.checkpoint=false .* set offload.checkpoint=true"
    ):
        OffloadConfig(checkpoint=False, tags={"query_proj": "offload"})


def test_block_tags_apply_to_models_with_that_block():
    p = load_preset("minimal")
    llama, dsv3 = resolve(p, zoo.get_size("llama_tiny_a")), resolve(p, zoo.get_size("dsv3_tiny_a"))
    assert llama["query_proj"] == dsv3["query_proj"] == "device"
    assert dsv3["moe_mlpwi_0"] == "device" and "moe_mlpwi_0" not in llama
    assert dsv3["mla_q"] == "remat"  # a norm, not a projection
    mixtral = resolve(p, zoo.get_size("mixtral_tiny_a"))  # routed experts, no dense MLP, no MLA
    assert mixtral["moe_mlpwi_0"] == "device" and "mlpwi_0" not in mixtral and "mla_q" not in mixtral
    # Explicit tags win over the block section.
    q = load_preset("minimal", tags={**p.tags, "moe_mlpwi_0": "offload"})
    assert resolve(q, zoo.get_size("dsv3_tiny_a"))["moe_mlpwi_0"] == "offload"


def test_modifiers_compose_with_an_activation_policy():
    both = load_preset("llama_qkv_offload", "optimizer_host")
    assert both.opt_state == "pinned_host" and both.params == "device"
    assert both.tags == load_preset("llama_qkv_offload").tags and both.checkpoint
    assert both.describe() == "llama_qkv_offload + opt_state on pinned_host"
    alone = load_preset("optimizer_host")
    assert not alone.checkpoint and alone.tags == {}  # keep every activation, optimizer state on host
    assert load_preset("full", "params_host", "optimizer_host").params == "pinned_host"


def test_a_label_names_presets_merged_then_tag_actions():
    """`policy_from_label`: how bench/tpu.py and plan.measure name a policy."""
    from zoo.offload import policy_from_label

    o = policy_from_label("full+optimizer_host:context=offload,query_proj=device")
    assert o.name == "full+optimizer_host:context=offload,query_proj=device" and o.opt_state == "pinned_host"
    assert o.tags == {**load_preset("full").tags, "context": "offload", "query_proj": "device"} and o.checkpoint
    assert resolve(o, zoo.get_size("llama_tiny_a"))["mlpwi_0"] == "remat"
    with pytest.raises(ValueError, match=r"^full:context: 'context' is not tag=action"):
        policy_from_label("full:context")
    with pytest.raises(ValueError, match=r"^offload=fuller: unknown preset"):
        policy_from_label("fuller:context=offload")


# --- through Hydra, as train.py composes it -------------------------------------------------------


def _compose(*overrides):
    from zoo.tools.kit import compose
    from zoo.train.run_config import load

    return load(compose(overrides))


def test_hydra_composes_a_policy_plus_optimizer_on_host_in_one_command_line():
    a = _compose("model=llama_tiny_a", "offload=[llama_qkv_offload,optimizer_host]").offload
    b = _compose("model=llama_tiny_a", "offload=llama_qkv_offload", "offload.opt_state=pinned_host").offload
    assert a == b
    assert a.opt_state == "pinned_host" and a.tags["query_proj"] == "offload"


def test_hydra_custom_from_the_command_line():
    c = _compose("model=dsv3_tiny_a", "offload=custom", "offload.tags.query_proj=offload", "offload.tags.mla_kv=device")
    assert resolve(c.offload, c.model)["query_proj"] == "offload"
    assert offload.expected_placement(c.offload, c.model)["mla_kv"] == "device"


@pytest.fixture
def new_llama_tag():
    """A tag added to the Llama block at test time, as a new tag is added: a record in its block's `EMITS`
    (`zoo/nn/attention.py`), which `zoo.tags.declares` adds to the vocabulary; no other file names it."""
    from zoo import tags
    from zoo.nn.attention import QUERY_AXES, GQAttention

    name = "query_normed"
    info = tags.TagInfo(name, "B T N H", "the queries after their norm (a test's tag)", tags.ATTENTION, (QUERY_AXES,))
    saved_emits, saved_tags = GQAttention.EMITS, dict(tags.TAGS)
    GQAttention.EMITS = (*saved_emits, tags.Emit(info, lambda s: 5 * s.tokens))
    tags.declares(GQAttention)
    try:
        yield name
    finally:
        GQAttention.EMITS = saved_emits
        tags.TAGS.clear()
        tags.TAGS.update(saved_tags)


def test_a_new_tag_on_the_llama_block_is_set_through_custom_with_no_other_file(new_llama_tag):
    """docs/offload.md, "A new tag on the Llama block": the block's file alone. `offload=custom
    offload.tags.<tag>=offload` composes (no `+`, no line in conf/offload/custom.yaml), validates and
    offloads it; a misspelling of it and a tag the model does not emit are refused in one line."""
    from zoo.train.run_config import ConfigError, validate

    assert new_llama_tag not in (conf := offload.conf_dir() / "offload" / "custom.yaml").read_text(), conf
    c = _compose("model=llama_tiny_a", "offload=custom", f"offload.tags.{new_llama_tag}=offload")
    validate(c, len(jax.devices()))
    assert resolve(c.offload, c.model)[new_llama_tag] == "offload"
    assert offload.expected_placement(c.offload, c.model)[new_llama_tag] == "host"
    assert remat_policy(c.offload, c.model) is not None
    with pytest.raises(
        ConfigError, match=rf"^offload.tags.query_normd: unknown tag \(did you mean {new_llama_tag}\?\); valid tags: "
    ):
        _compose("model=llama_tiny_a", "offload=custom", "offload.tags.query_normd=offload")
    c = _compose("model=llama_tiny_a", "offload=custom", "offload.tags.mla_q=offload")
    with pytest.raises(ConfigError, match=r"^offload.tags.mla_q: the llama model never emits this tag; it emits: .*"):
        validate(c, len(jax.devices()))
    # Other presets keep Hydra's rule: a tag they do not list needs `+`, and the line says so.
    with pytest.raises(Exception, match=rf"Could not override 'offload.tags.{new_llama_tag}'"):
        _compose("model=llama_tiny_a", "offload=full", f"offload.tags.{new_llama_tag}=offload")
    assert _compose("model=llama_tiny_a", "offload=full", f"+offload.tags.{new_llama_tag}=offload").offload.tags == {
        new_llama_tag: "offload"
    }


def test_hydra_custom_tag_the_model_never_emits_fails_before_compiling():
    from zoo.train.run_config import ConfigError, validate

    c = _compose("model=llama_tiny_a", "offload=custom", "offload.tags.mla_q=offload")
    with pytest.raises(ConfigError, match=r"^offload.tags.mla_q: the llama model never emits this tag"):
        validate(c, len(jax.devices()))


def test_hydra_unknown_action_is_one_line():
    from zoo.train.run_config import ConfigError

    with pytest.raises(
        ConfigError, match=r"^offload.tags.query_proj: 'keep' is not an action; choose one of device, offload, remat$"
    ):
        _compose("model=llama_tiny_a", "offload=custom", "offload.tags.query_proj=keep")


# --- the jax policy --------------------------------------------------------------------------------


def test_remat_policy_kinds():
    assert remat_policy(load_preset("none")) is None
    assert remat_policy(load_preset("full")) is jax.checkpoint_policies.nothing_saveable
    # Without a model, every family's section is included (they name disjoint tags).
    assert remat_policy(load_preset("minimal")) is not None


def test_no_checkpoint_recomputes_the_weight_casts_of_a_bfloat16_model():
    """`checkpoint: false` on a model computing in bfloat16 over float32 weights: the backward casts
    the layer's weights again instead of keeping a bfloat16 copy of every layer's weights among the
    residuals (zoo.offload.keep_all_but_weight_casts). The residuals lose exactly those copies, the
    compiled temp memory shrinks by at least their size, and the loss and gradients are those of the
    step with no checkpoint at all."""
    from zoo import model as zoo_model
    from zoo.placement import inspect_placement, stack_names

    f32 = zoo.get_size("llama_tiny_a").replace(num_layers=2, hidden_size=128, intermediate_size=512)
    config = f32.replace(compute_dtype="bfloat16")
    assert remat_policy(load_preset("none"), f32) is None  # nothing is cast: no checkpoint, as before
    policy = remat_policy(load_preset("none"), config)
    assert policy is not None and remat_policy(load_preset("none")) is None
    assert (128, 512) in offload.layer_weight_shapes(config) and (512, 128) in offload.layer_weight_shapes(config)
    model = zoo.build(config, key=jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (1, 8), 0, config.vocab_size)

    def grad(rp):
        return jax.value_and_grad(lambda m: zoo.loss_fn(m, tokens, remat_policy=rp))

    def weight_copies(rp):
        placement = inspect_placement(grad(rp), zoo_model.abstract(config), stacks=stack_names(model))
        shapes = offload.layer_weight_shapes(config)
        return [o for o in placement.other if o.dtype == "bfloat16" and o.shape in shapes]

    kept = weight_copies(None)
    assert len(kept) == 7  # q, k, v, o, gate, up, down
    assert weight_copies(policy) == []
    copy_bytes = sum(o.bytes_per_layer * o.layers for o in kept)
    temp = {rp: jax.jit(grad(rp)).lower(model).compile().memory_analysis().temp_size_in_bytes for rp in (None, policy)}
    assert temp[None] - temp[policy] >= copy_bytes, (temp, copy_bytes)
    (loss, grads), (loss0, grads0) = (jax.jit(grad(rp))(model) for rp in (policy, None))
    assert float(loss) == float(loss0)
    for g, g0 in zip(jax.tree.leaves(grads), jax.tree.leaves(grads0)):
        np.testing.assert_allclose(
            np.asarray(g, np.float32), np.asarray(g0, np.float32), rtol=1e-2, atol=1e-2 * float(jnp.abs(g0).max())
        )


def test_a_stack_of_one_layer_keeps_its_recomputation_apart_from_its_forward():
    """A scan of one trip is no loop once XLA simplifies it: the layer's forward and its backward's
    recomputation share one computation, and XLA's CSE merged the two (on a TPU v5e, DeepSeek-V3's
    one dense layer kept its whole forward under `full`: dsv3_100m's compiled peak at 20 x 4096 fell
    from 5.97 GB to 4.45 GB with the barrier). That stack's backward recomputes behind the
    checkpoint's barrier (prevent_cse); a stack of several layers', whose loop keeps the two apart,
    does not."""
    config = zoo.get_size("dsv3_tiny_a")
    model = zoo.build(config, key=jax.random.key(0))
    assert [s.repeats for s in model.stacks] == [1, config.num_layers - 1]
    tokens = jnp.zeros((1, 8), jnp.int32)
    rp = remat_policy(load_preset("full"), config)
    closed = jax.make_jaxpr(jax.grad(lambda m: zoo.loss_fn(m, tokens, remat_policy=rp)))(model)
    from zoo.placement import _walk

    backward = []
    _walk(closed.jaxpr, lambda e: backward.append(e) if e.primitive.name == "scan" and e.params["reverse"] else None)

    def behind_barrier(scan) -> bool:  # a recomputation in its body lowers behind jax.checkpoint's barrier
        found = []
        _walk(scan.params["jaxpr"].jaxpr, lambda e: found.append(e.params.get("prevent_cse", False)))
        return any(found)

    barred = [behind_barrier(e) for e in backward]
    # Backward scans run the stacks in reverse order: the MoE stack's first, then the dense layer's.
    assert barred == [False, True], barred


# --- the maths does not change -------------------------------------------------------------------


def _policy_key(policy: OffloadConfig, config) -> tuple:
    actions = resolve(policy, config)
    if not policy.checkpoint:
        return ("none", policy.params)  # with params on host: keep_all_but_transfers
    return tuple(sorted((t, a) for t, a in actions.items() if a != "remat"))


@pytest.mark.parametrize("size", by_core_family(FAMILIES))
def test_every_preset_gives_the_loss_and_gradients_of_none(size):
    """One jit holds every distinct policy's loss and gradients (one compile instead of eight: XLA:CPU
    compiles are slow); each starts from its own optimization_barrier copy of the parameters, so XLA
    cannot share work between policies and every policy's backward pass runs as that policy says.
    The routed experts run the capacity kernel with room for every assignment (the same maths as the
    dropless kernel, whose tile loops, compiled once per policy, doubled this test's time); a policy
    over the dropless kernel:
    tests/test_offload_ranges.py::test_a_split_policy_gives_the_loss_and_gradients_of_none[dsv3]."""
    config = zoo.get_size(size)
    if config.moe is not None:
        config = config.replace(
            moe=dataclasses.replace(config.moe, impl="capacity", capacity_factor=float(config.moe.n_routed_experts))
        )
    model = zoo.build(config, key=jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (2, 16), 0, config.vocab_size)
    keys = {name: _policy_key(load_preset(name), config) for name in PRESETS}
    distinct = {}
    for name in PRESETS:
        distinct.setdefault(keys[name], remat_policy(load_preset(name), config))
    assert len(distinct) >= 7  # presets really differ on this family

    def every_policy(m):
        outs = []
        for rp in distinct.values():
            loss = lambda mm, rp=rp: zoo.loss_fn(mm, tokens, remat_policy=rp)  # noqa: E731
            outs.append(jax.value_and_grad(loss)(jax.lax.optimization_barrier(m)))
        return outs

    compiled = jax.jit(every_policy).lower(model).compile({"xla_backend_optimization_level": 0})
    results = dict(zip(distinct, compiled(model)))
    loss0, grads0 = results[keys["none"]]
    leaves0 = jax.tree.leaves(grads0)
    for name in PRESETS:
        loss, grads = results[keys[name]]
        np.testing.assert_allclose(float(loss), float(loss0), rtol=1e-6, err_msg=name)
        for g, g0 in zip(jax.tree.leaves(grads), leaves0):
            # float32 rounding of a recomputed forward: up to 1.2e-6 of the leaf's largest gradient
            # measured (DeepSeek-V3's `save_qkv_proj`, in some orders of the test run only); a policy
            # that changed what the backward sees is off by far more.
            scale = float(jnp.max(jnp.abs(g0))) or 1.0
            assert float(jnp.max(jnp.abs(g - g0))) <= 4e-6 * scale, name


# --- parameters and optimizer state in host memory, through train.py's step -----------------------


def _train(offload_config, steps=2):
    from omegaconf import OmegaConf

    from zoo.train.run_config import DataConfig, HardwareConfig, OptimizerConfig, TrainConfig, TrainerConfig
    from zoo.train.run_config import XlaConfig, load_group, validate
    from zoo.train.batches import SyntheticData
    from zoo.train.step import Trainer

    conf = offload.conf_dir()
    c = TrainConfig(
        model=SIZES["llama_tiny_a"],
        mesh=load_group(
            "mesh", {k: v for k, v in OmegaConf.load(conf / "mesh" / "single.yaml").items() if k != "defaults"}
        ),
        offload=offload_config,
        optimizer=OptimizerConfig(lr=1e-2, warmup_steps=1),
        data=DataConfig(batch_size=4, seq_len=16),
        xla=XlaConfig(),
        trainer=TrainerConfig(steps=steps),
        hardware=HardwareConfig(),
    )
    trainer = Trainer(c, validate(c, len(jax.devices())))
    data = SyntheticData(c.data, c.model.vocab_size)
    state, step = trainer.init(), trainer.jitted_step()
    kinds, losses = [], []
    for i in range(steps):
        state, m = step(state, trainer.shard_tokens(data.batch(i)))
        kinds.append({k: {x.sharding.memory_kind for x in jax.tree.leaves(state[k])} for k in ("params", "opt_state")})
        losses.append(float(m["loss"]))
    return state, losses, kinds


_DEVICE_RUN: list = []


@pytest.mark.parametrize("preset, on_host", [("optimizer_host", "opt_state"), ("params_host", "params")])
def test_state_lives_in_pinned_host_between_steps_and_matches_the_device_run(preset, on_host):
    if not _DEVICE_RUN:
        _DEVICE_RUN.append(_train(load_preset("none")))
    ref_state, ref_losses, ref_kinds = _DEVICE_RUN[0]
    state, losses, kinds = _train(load_preset(preset))
    other = "params" if on_host == "opt_state" else "opt_state"
    assert all(k[on_host] == {"pinned_host"} and k[other] == {"device"} for k in kinds), kinds
    assert all(k == {"params": {"device"}, "opt_state": {"device"}} for k in ref_kinds)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(state["params"]), jax.tree.leaves(ref_state["params"])):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


# --- the streamed (layer-by-layer) optimizer update -------------------------------------------------


def _host(tree):
    return jax.tree.map(lambda x: jax.device_put(x, jax.memory.Space.Host), tree)


def test_streamed_update_is_optax_update_slice_by_slice():
    """zoo.train.update on DeepSeek-V3-shaped trees (a dense and a MoE stack, frozen correction
    biases, norm weights without decay, an embedding and head updated in runs of rows) with parameters
    and state in host memory: three clipped AdamW
    steps from gradients summed over two microbatches give optax's whole-tree results, and the frozen
    buffers never move."""
    import equinox as eqx
    import optax

    from zoo.sharding import memory_kinds
    from zoo.train.run_config import OptimizerConfig
    from zoo.train.step import is_array_like, make_optimizer, trainable_labels
    from zoo.train.update import global_norm, streamed_update

    c = OptimizerConfig(lr=1e-2, warmup_steps=1, decay_steps=3, weight_decay=0.5, grad_clip=0.5)
    tx, unclipped = make_optimizer(c, 3)[0], make_optimizer(c, 3, clip=False)[0]
    # A vocabulary of 300: the embedding and head exceed the largest layer slice, so they are updated in
    # runs of rows, the last run overlapping the one before (300 rows in runs of 256; the head's 64 in 54).
    config = dataclasses.replace(zoo.get_size("dsv3_tiny_a"), vocab_size=300)
    abstract = eqx.partition(zoo.abstract(config), is_array_like)[0]
    keys = iter(jax.random.split(jax.random.key(0), 4 * len(jax.tree.leaves(abstract))))

    def rand():
        return jax.tree.map(lambda s: jax.random.normal(next(keys), s.shape, s.dtype), abstract)

    params = rand()
    sums = [rand() for _ in range(3)]  # gradients summed over 2 microbatches, norms ~20: clipped

    @jax.jit
    def whole(p, s, g):
        u, s = tx.update(jax.tree.map(lambda x: x / 2, g), s, p)
        return optax.apply_updates(p, u), s

    @jax.jit
    def streamed(p, s, g):
        trainable = jax.tree.map(lambda x, lab: x if lab == "train" else None, g, trainable_labels(g))
        return streamed_update(
            unclipped, g, s, p, norm=global_norm(trainable, divide=2), max_norm=c.grad_clip, divide=2
        )

    p_ref, s_ref = params, tx.init(params)
    p_host, s_host = _host(params), _host(tx.init(params))
    for g in sums:
        p_ref, s_ref = whole(p_ref, s_ref, g)
        p_host, s_host = streamed(p_host, s_host, _host(g))
        assert memory_kinds(p_host) == memory_kinds(s_host) == {"pinned_host"}
    for name, a, b in (("params", p_host, p_ref), ("opt_state", s_host, s_ref)):
        assert jax.tree.structure(a) == jax.tree.structure(b)
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
            np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=2e-6, atol=1e-7, err_msg=name)
    counts = [int(x) for x in jax.tree.leaves(s_host) if x.ndim == 0]
    assert counts and set(counts) == {3}  # adam's and the schedule's counts advanced once per step
    biases = [
        (i, j)
        for i, s in enumerate(params.stacks)
        for j, b in enumerate(s.layers)
        if getattr(b.ffn, "e_score_correction_bias", None) is not None
    ]
    assert biases
    for i, j in biases:
        before, after = (
            params.stacks[i].layers[j].ffn.e_score_correction_bias,
            p_host.stacks[i].layers[j].ffn.e_score_correction_bias,
        )
        np.testing.assert_array_equal(np.asarray(after), np.asarray(before))


def test_streamed_step_equals_the_device_step_with_accumulation():
    """Train.py's step, three steps of two microbatches (gradients summed in host memory with params
    on host), clipped AdamW under warmup and decay: optimizer_host, params_host and both give the
    losses, gradient norms, parameters and moments of the all-device step. One jit holds the four
    variants (one compile); each moves its copy of the state to its own memory kinds first."""
    from omegaconf import OmegaConf

    from zoo import sharding as zs
    from zoo.train.run_config import DataConfig, HardwareConfig, OptimizerConfig, TrainConfig, TrainerConfig
    from zoo.train.run_config import XlaConfig, load_group, validate
    from zoo.train.batches import SyntheticData
    from zoo.train.step import Trainer

    conf = offload.conf_dir()

    def trainer(*preset):
        c = TrainConfig(
            model=SIZES["llama_tiny_a"],
            mesh=load_group(
                "mesh", {k: v for k, v in OmegaConf.load(conf / "mesh" / "single.yaml").items() if k != "defaults"}
            ),
            offload=load_preset(*preset),
            optimizer=OptimizerConfig(lr=1e-2, warmup_steps=1, decay_steps=4, grad_clip=0.5),
            data=DataConfig(batch_size=4, seq_len=16),
            xla=XlaConfig(),
            trainer=TrainerConfig(steps=3, grad_accum=2),
            hardware=HardwareConfig(),
        )
        return Trainer(c, validate(c, len(jax.devices())))

    trainers = [
        trainer("none"),
        trainer("optimizer_host"),
        trainer("params_host"),
        trainer("params_host", "optimizer_host"),
    ]
    assert [t.layerwise_update for t in trainers] == [False, True, True, True]

    def every_variant(states, tokens):
        out = []
        for t, s in zip(trainers, states):
            s = jax.tree.map(
                lambda x, sh: jax.device_put(x, jax.memory.Space.Host) if sh.memory_kind == "pinned_host" else x,
                s,
                t.state_shardings,
            )
            new, m = t.train_step(s, tokens)
            out.append((zs.to_device(new), m))
        return out

    ref = trainers[0]
    data = SyntheticData(ref.cfg.data, ref.cfg.model.vocab_size)
    states = [ref.init()] * len(trainers)
    step = (
        jax.jit(every_variant)
        .lower(states, ref.shard_tokens(data.batch(0)))
        .compile({"xla_backend_optimization_level": 0})
    )
    history = []
    for i in range(3):
        out = step(states, ref.shard_tokens(data.batch(i)))
        states = [s for s, _ in out]
        history.append([(float(m["loss"]), float(m["grad_norm"])) for _, m in out])
    assert history[0][0][1] > 0.5  # the clip is active
    for variant in range(1, len(trainers)):
        np.testing.assert_allclose([h[variant] for h in history], [h[0] for h in history], rtol=1e-6)
        for a, b in zip(jax.tree.leaves(states[variant]), jax.tree.leaves(states[0])):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def _update_buffers(*overrides):
    from zoo.placement import update_buffers
    from zoo.tools.kit import prepare_step

    trainer = prepare_step(["mesh=single", "data.batch_size=2", "data.seq_len=16", *overrides])[3]
    return trainer, update_buffers(
        trainer.jitted_step().trace(trainer.abstract_state(), trainer.abstract_tokens()).jaxpr
    )


def test_streamed_update_holds_one_layer_on_device_read_from_the_program():
    """Read from train.py's traced step (as the inspector reads placement): with the state in host
    memory nothing larger than one layer's slice of a leaf comes to the device in the update, where
    the whole-tree update works on whole stacked leaves. Four layers and a vocabulary of 1000, so that
    the embedding and the head (64 x 1000 each) are larger than a layer's largest slice: they come in
    runs of rows."""
    model = ["model=llama_tiny_a", "model.num_layers=4", "model.vocab_size=1000"]
    trainer, whole = _update_buffers(*model, "offload=none")
    stack = [
        x
        for p, x in jax.tree_util.tree_leaves_with_path(trainer.abstract_params)
        if "layers" in jax.tree_util.keystr(p)
    ]
    stacked = max(x.size * x.dtype.itemsize for x in stack)
    layer = stacked // 4
    assert 64 * 1000 * 4 > layer
    assert whole["layer_loops"] == 0 and whole["moved_to_device"] is None
    assert whole["device_outside_loops"]["bytes"] >= stacked
    _, host = _update_buffers(*model, "offload=[full,params_host,optimizer_host]")
    assert host["layer_loops"] == 4  # the gradient norm and the update over the stack, the embedding's rows, the head's
    assert host["device_in_loops"]["bytes"] == host["moved_to_device"]["bytes"] == layer
    _, opt = _update_buffers(*model, "offload=[full,optimizer_host]")  # parameters and gradients stay on device
    assert opt["layer_loops"] == 3
    assert opt["moved_to_device"]["bytes"] == opt["device_in_loops"]["bytes"] == layer


def test_streamed_update_traces_for_every_stack_and_the_expert_biases():
    """DeepSeek-V3's two stacks (dense, MoE) with bias balancing on host-resident parameters."""
    _, host = _update_buffers(
        "model=dsv3_tiny_a", "offload=[full,params_host,optimizer_host]", "trainer.moe_bias_update_rate=0.01"
    )
    assert host["layer_loops"] == 4 and host["moved_to_device"] is not None


def test_streamed_update_cuts_a_large_leaf_along_an_axis_its_sharding_leaves_whole():
    """zoo.train.step.whole_axis: the first axis no mesh axis of size > 1 splits (a size-1 mesh axis
    splits nothing), None when every axis is split, so runs of rows never cross devices."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from zoo.train.step import whole_axis

    mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2, 1), ("fsdp", "tensor", "expert"))
    leaf = jax.ShapeDtypeStruct((1000, 64), np.float32)
    assert whole_axis(leaf, NamedSharding(mesh, PartitionSpec(None, "fsdp"))) == 0
    assert whole_axis(leaf, NamedSharding(mesh, PartitionSpec("tensor", "fsdp"))) is None
    assert whole_axis(leaf, NamedSharding(mesh, PartitionSpec(("fsdp", "tensor"), None))) == 1
    assert whole_axis(leaf, NamedSharding(mesh, PartitionSpec("expert", "fsdp"))) == 0  # size 1: whole
