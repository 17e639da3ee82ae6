"""The causal LM: emitted tags, scan compile time, shape checks, bf16, tied embeddings, and training.

Most models here are filled from numpy (`filled`) rather than `zoo.build`, which compiles an
initialiser per config (seconds on CPU); `test_build` covers `build`.
Training steps compile with XLA's backend optimisation off (the numbers are the same, the compile is faster).
"""

import dataclasses
import pathlib
import subprocess
import sys
from functools import partial
import time

import equinox as eqx
import jax
import jax.numpy as jnp
import jaxtyping
import numpy as np
import pytest
from jax.extend import core as jex_core

import zoo
from zoo.nn.moe import resolve_moe_impl
from zoo import tags
from zoo.config import LayerSpec
from zoo.families import SIZES
from zoo.model import count_leaves, loss_fn, plan_stacks, stack_layout, trainable_mask
from zoo.nn.mlp import MLPWI_0, MLPWO

LLAMA = SIZES["llama_tiny_a"]
DSV3 = SIZES["dsv3_tiny_a"]
DSV3_CAPACITY = DSV3.replace(moe=dataclasses.replace(DSV3.moe, impl="capacity", capacity_factor=2.0))
# without the dense prefix: one scanned stack, quicker to compile
DSV3_MOE_ONLY = DSV3.replace(num_layers=2, first_k_dense_replace=0)
DSV3_CAPACITY_MOE_ONLY = DSV3_CAPACITY.replace(num_layers=2, first_k_dense_replace=0)
DSV3_NO_Q_LORA = DSV3.replace(mla=dataclasses.replace(DSV3.mla, q_lora_rank=None))
DSV3_NO_DENSE_MLP = DSV3.replace(first_k_dense_replace=0, moe=dataclasses.replace(DSV3.moe, n_shared_experts=0))
# Qwen3-MoE with dense layers among sparse ones (decoder_sparse_step=2: dense, MoE, dense, MoE): one
# scanned stack whose period holds a dense-MLP block and a MoE block.
QWEN3_MOE_MIXED = SIZES["qwen3_moe_tiny_a"].replace(num_layers=4, decoder_sparse_step=2)
TINY = sorted(n for n in SIZES if n.endswith("_tiny_a"))
FAST_COMPILE = {"xla_backend_optimization_level": 0}


def filled(c, seed=0, std=0.05):
    """The model of config `c` with N(0, std) weights, norms 1 and a zero correction bias."""
    rng = np.random.default_rng(seed)

    def leaf(path, x):
        names = [getattr(k, "name", "") for k in path]
        if any("norm" in n for n in names):
            return jnp.ones(x.shape, x.dtype)
        if "e_score_correction_bias" in names:
            return jnp.zeros(x.shape, x.dtype)
        return jnp.asarray(rng.normal(size=x.shape) * std, x.dtype)

    return jax.tree_util.tree_map_with_path(leaf, zoo.abstract(c))


def random_tokens(c, seed=1, batch=2, seq=16):
    return jnp.asarray(np.random.default_rng(seed).integers(0, c.vocab_size, (batch, seq)), jnp.int32)


# Module-level, so that models of one config share a compiled forward.
logits_of = jax.jit(lambda m, t: m(t), compiler_options=FAST_COMPILE)


# --- (a) tags --------------------------------------------------------------------------------


def traced_tags(jaxpr, in_scan=False, found=None):
    """(name, shape, inside a scan body) of every checkpoint_name in `jaxpr` and its nested jaxprs."""
    found = [] if found is None else found
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "name":
            found.append((eqn.params["name"], eqn.invars[0].aval.shape, in_scan))
        for value in eqn.params.values():
            for sub in value if isinstance(value, (list, tuple)) else (value,):
                if isinstance(sub, jex_core.ClosedJaxpr):
                    sub = sub.jaxpr
                if isinstance(sub, jex_core.Jaxpr):
                    traced_tags(sub, in_scan or eqn.primitive.name == "scan", found)
    return found


TAG_CONFIGS = {
    **{name: SIZES[name] for name in TINY},  # every family
    "dsv3_capacity": DSV3_CAPACITY,
    "dsv3_no_q_lora": DSV3_NO_Q_LORA,
    "dsv3_no_dense_mlp": DSV3_NO_DENSE_MLP,
    "qwen3_moe_mixed": QWEN3_MOE_MIXED,
    "gpt_oss_ragged": SIZES["gpt_oss_tiny_a"].replace(
        moe=dataclasses.replace(SIZES["gpt_oss_tiny_a"].moe, impl="ragged")
    ),
}


@pytest.mark.parametrize("name", sorted(TAG_CONFIGS))
def test_emitted_tags_are_exactly_the_traced_ones(name):
    c = TAG_CONFIGS[name]
    jaxpr = jax.make_jaxpr(lambda m, t: m(t))(zoo.abstract(c), jax.ShapeDtypeStruct((2, 16), jnp.int32))
    found = traced_tags(jaxpr.jaxpr)
    assert {n for n, _, _ in found} == set(tags.emitted_tags(c))
    # every tag lives in a scanned layer body, where remat/offload policies apply
    assert all(in_scan for _, _, in_scan in found)
    # the tagged tensors have the rank their vocabulary entry documents; routed-expert tags document
    # "ragged | capacity" shapes ([A, .] sorted assignments, or [experts, capacity, .] buffers)
    for tag_name, shape, _ in found:
        variants = [v.split() for v in tags.TAGS[tag_name].shape.split("|")]
        documented = (
            variants[-1]
            if (c.moe is not None and resolve_moe_impl(c.moe.impl) == "capacity" and len(variants) > 1)
            else variants[0]
        )
        assert len(shape) == len(documented), (tag_name, shape, documented)


def test_tag_variants_differ():
    # the three DeepSeek-V3 variants really exercise different rules of emitted_tags
    assert tags.QUERY_WA_PROJ in tags.emitted_tags(DSV3)
    assert tags.QUERY_WA_PROJ not in tags.emitted_tags(DSV3_NO_Q_LORA)
    assert MLPWI_0 not in tags.emitted_tags(DSV3_NO_DENSE_MLP)
    assert tags.MOE_MLPWI_0 not in tags.emitted_tags(LLAMA)
    # Qwen3-MoE's dense layers add the dense-MLP tags its all-sparse fixture lacks
    assert MLPWI_0 not in tags.emitted_tags(SIZES["qwen3_moe_tiny_a"])
    assert {MLPWI_0, tags.MOE_MLPWI_0} <= set(tags.emitted_tags(QWEN3_MOE_MIXED))


def test_unknown_tag_is_refused():
    with pytest.raises(ValueError, match="unknown tag 'mlp_out'"):
        tags.tag(jnp.zeros(2), "mlp_out")


def test_the_vocabulary_is_what_the_blocks_declare():
    """zoo.tags.TAGS is the union of the blocks' EMITS, kind by kind; GQA and MLA share the attention
    tags' records (with their own FLOPs)."""
    from zoo.model import DecoderBlock
    from zoo.nn import GatedMLP, GQAttention, MLAttention, MoE

    declared = [e.tag for b in (DecoderBlock, GQAttention, GatedMLP, MLAttention, MoE) for e in b.EMITS]
    assert list(tags.TAGS.values()) == list(dict.fromkeys(declared))
    assert [t.block for t in tags.TAGS.values()] == sorted((t.block for t in tags.TAGS.values()), key=tags.KINDS.index)
    assert {e.tag.name for e in MLAttention.EMITS} > {e.tag.name for e in GQAttention.EMITS}


def test_importing_the_blocks_defines_every_tag():
    """`import zoo.nn` defines every block, the decoder layer's input tag included, so the vocabulary
    is whole before any model is built: importing zoo.model adds no tag."""
    code = "import zoo.nn, zoo.tags; a = list(zoo.tags.TAGS); import zoo.model; print(a == list(zoo.tags.TAGS), len(a))"
    root = pathlib.Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, check=True).stdout
    assert out.split() == ["True", str(len(tags.TAGS))]


def test_a_block_emitting_an_undeclared_tag_fails(monkeypatch):
    """A block that tags a tensor under a name no block declares fails when traced; declared (its
    record and its FLOPs in EMITS), the same block traces; two records of one name are refused."""
    from typing import ClassVar

    from zoo.nn import GatedMLP

    monkeypatch.setattr(tags, "TAGS", dict(tags.TAGS))  # declarations below stay in this test

    class TaggedMLP(GatedMLP):
        def __call__(self, x):
            return tags.tag(super().__call__(x), "mlp_residual")

    block = TaggedMLP(8, 16, key=jax.random.key(0))
    x = jax.ShapeDtypeStruct((1, 4, 8), jnp.float32)
    with pytest.raises(ValueError, match="^unknown tag 'mlp_residual': no block declares it"):
        jax.eval_shape(block, x)

    residual = tags.TagInfo("mlp_residual", "B T D", "the MLP's output, again", tags.MLP, ((*tags.IN_BLOCK, "embed"),))

    @tags.declares
    class DeclaredMLP(TaggedMLP):
        EMITS: ClassVar[tuple] = (*GatedMLP.EMITS, tags.Emit(residual, lambda s: 0.0))

    assert jax.eval_shape(DeclaredMLP(8, 16, key=jax.random.key(0)), x).shape == (1, 4, 8)
    assert list(tags.TAGS)[list(tags.TAGS).index(MLPWO) + 1] == "mlp_residual"  # with its kind's tags
    with pytest.raises(ValueError, match="tag 'mlp_residual' declared twice, differently"):

        @tags.declares
        class Conflicting(TaggedMLP):
            EMITS: ClassVar[tuple] = (tags.Emit(dataclasses.replace(residual, shape="B T F"), lambda s: 0.0),)


def test_a_block_is_read_from_its_own_declarations(monkeypatch):
    """What a block is, its PARAMS and EMITS say, and nothing else restates: built into the layers, a
    block's tags are priced by the planner (their FLOPs), its output is kept from offload when it only
    feeds the residual add, and LoRA adapts exactly the projections it declares. So a new block is its
    file (and the line of zoo.nn.decoder.make_block that builds it)."""
    from typing import ClassVar

    from zoo import lora, offload
    from zoo import sharding as zs
    from zoo.nn import GatedMLP
    from zoo.plan.pricing import producer_flops
    from zoo.nn import decoder

    monkeypatch.setattr(tags, "TAGS", dict(tags.TAGS))  # declarations below stay in this test
    monkeypatch.setattr(offload, "TAGS", tags.TAGS)  # which zoo.offload reads by name
    residual = tags.TagInfo(
        "mlp_residual",
        "B T D",
        "the MLP's output, again",
        tags.MLP,
        ((*tags.IN_BLOCK, "embed"),),
        only_feeds_residual=True,
    )

    @tags.declares
    class ResidualMLP(GatedMLP):
        PARAMS: ClassVar[dict] = {**GatedMLP.PARAMS, "w_down": zs.compute("mlp", "embed")}  # no projection LoRA adapts
        EMITS: ClassVar[tuple] = (*GatedMLP.EMITS, tags.Emit(residual, lambda s: 7.0))

        def __call__(self, x):
            return tags.tag(super().__call__(x), "mlp_residual")

    c = LLAMA.replace(num_layers=3)  # a config zoo.model.block_classes has not read yet
    assert GatedMLP in decoder.block_classes(c, c.layer_spec(0))
    monkeypatch.setattr(decoder, "GatedMLP", ResidualMLP)
    c = LLAMA.replace(num_layers=5)
    assert ResidualMLP in decoder.block_classes(c, c.layer_spec(0))
    ((stack, *_),) = stack_layout(c)
    assert producer_flops(c, "mlp_residual", stack, 2, 16) == 7.0
    assert set(offload.backward_never_reads(c)) == {MLPWO, "mlp_residual"}
    assert lora.family_targets(zoo.abstract(c)) == {"wq", "wk", "wv", "wo", "w_gate", "w_up"}


# --- (b) compile time does not grow with depth -----------------------------------------------


def with_layers(c, layers: int):
    """`c` at another depth, its per-layer pattern (sliding/full) repeated."""
    types = None if c.layer_types is None else [c.layer_types[i % len(c.layer_types)] for i in range(layers)]
    return c.replace(num_layers=layers, layer_types=types)


def lowered_step(layers: int, base=LLAMA):
    """The loss-and-gradient program of `base` at this depth, lowered (not compiled)."""

    def loss(m, t):  # a fresh function: no cache hit from an earlier measurement
        return loss_fn(m, t)

    return jax.jit(jax.value_and_grad(loss)).lower(
        zoo.abstract(with_layers(base, layers)), jax.ShapeDtypeStruct((2, 16), jnp.int32)
    )


def lowered_lines(layers: int, base=LLAMA) -> int:
    """Lines of the step's StableHLO at this depth: what XLA gets to compile."""
    return lowered_step(layers, base).as_text().count("\n")


def compile_seconds(layers: int, base=LLAMA) -> float:
    # CPU time of this process (all its threads), not wall time: steadier when other processes share the cores.
    # With XLA:CPU's fusion emitters, as users compile (conftest.py turns them off for the rest of the run:
    # with the elemental emitter Gemma 3's 32 layers compiled in 2.2x the time of its 4).
    start = time.process_time()
    lowered_step(layers, base).compile(compiler_options={**FAST_COMPILE, "xla_cpu_use_fusion_emitters": True})
    return time.process_time() - start


# One config per way the layers are cut into scanned stacks (test_stack_layout_of_the_real_sizes checks
# each family's cut): one dense block repeated (Llama; Qwen2's and Qwen3's stack the same way), one MoE
# block repeated (Qwen3-MoE; Mixtral's likewise), Gemma 3's period of 6, GPT-OSS's period of 2, and a
# period holding a dense and a MoE block. Each config compiles at two depths, 2-3 times (~25 s of CPU):
# Llama's in the default run, the others in the slow tier; the programs XLA gets are held flat for all.
COMPILE_TIME_CONFIGS = {
    **{name: SIZES[name] for name in ("llama_tiny_a", "qwen3_moe_tiny_a", "gemma3_tiny_a", "gpt_oss_tiny_a")},
    "qwen3_moe_mixed": QWEN3_MOE_MIXED,
}


@pytest.mark.parametrize("size", sorted(COMPILE_TIME_CONFIGS))
def test_scanned_program_does_not_grow_with_depth(size):
    # 8 and 32 layers cut into the same stacks, only longer ones (Gemma 3: 1 and 5 periods of 6, then 2
    # layers): the program XLA compiles is the same size; unrolled, 32 layers would be ~4x.
    base = COMPILE_TIME_CONFIGS[size]
    assert lowered_lines(32, base) == lowered_lines(8, base)


@pytest.mark.usefixtures("fresh_compiles")
@pytest.mark.parametrize(
    "size",
    [s if s == "llama_tiny_a" else pytest.param(s, marks=pytest.mark.slow) for s in sorted(COMPILE_TIME_CONFIGS)],
)
def test_scan_compile_time_does_not_grow_with_depth(size):
    # (backend optimisation off to save test time; an unrolled stack would still be ~8x the ops).
    # Gemma 3's local/global pattern, GPT-OSS's alternation and Qwen3-MoE's dense-then-sparse period
    # scan their period: still flat in depth.
    base = COMPILE_TIME_CONFIGS[size]
    shallow, deep = [], []
    for _ in range(3):  # min over interleaved measurements; stop once the answer is clear
        shallow.append(compile_seconds(4, base))
        deep.append(compile_seconds(32, base))
        if len(deep) >= 2 and min(deep) < 1.5 * min(shallow):
            break
    assert min(deep) < 1.5 * min(shallow), (shallow, deep)


# --- how layers are cut into scanned stacks ----------------------------------------------------

# (name, first layer, period, repeats) of each stack, for the real sizes whose layers differ.
REAL_LAYOUTS = {
    "llama3.1_405b": [("dense_layers", 0, 1, 126)],
    "deepseek_v3_671b": [("dense_layers", 0, 1, 3), ("moe_layers", 3, 1, 58)],
    "kimi_k2_1t": [("dense_layers", 0, 1, 1), ("moe_layers", 1, 1, 60)],
    # 62 layers, every sixth global: ten periods of 5 sliding + 1 global, then two sliding layers
    "gemma3_27b": [("dense_layers_0_59", 0, 6, 10), ("dense_layers_60_61", 60, 1, 2)],
    "gpt_oss_20b": [("moe_layers", 0, 2, 12)],
    "gpt_oss_120b": [("moe_layers", 0, 2, 18)],
    "qwen3_235b_a22b": [("moe_layers", 0, 1, 94)],
    # one stack of one block, as Llama's and Qwen3-MoE's (whose compile time is measured flat in depth)
    "qwen2.5_7b": [("dense_layers", 0, 1, 28)],
    "qwen3_8b": [("dense_layers", 0, 1, 36)],
    "mixtral_8x7b": [("moe_layers", 0, 1, 32)],
}


def assert_plan_covers(specs, plan):
    """A plan's stacks cover the layers in order, and each repeats one period of specs exactly."""
    layer = 0
    for first, period, repeats in plan:
        assert first == layer and period >= 1 and repeats >= 1
        for r in range(repeats):
            assert list(specs[first + r * period : first + (r + 1) * period]) == list(specs[first : first + period])
        layer += period * repeats
    assert layer == len(specs)


@pytest.mark.parametrize("name", sorted(REAL_LAYOUTS))
def test_stack_layout_of_the_real_sizes(name):
    c = SIZES[name]
    layout = stack_layout(c)
    assert layout == REAL_LAYOUTS[name]
    assert_plan_covers([c.layer_spec(i) for i in range(c.num_layers)], [segment for _, *segment in layout])


def test_gemma3_27b_period_is_five_sliding_then_one_global():
    c = SIZES["gemma3_27b"]
    period = [c.layer_spec(j) for j in range(6)]
    assert [s.window for s in period] == [1024] * 5 + [None]
    assert [s.local_rope for s in period] == [True] * 5 + [False]
    assert [c.layer_spec(i).window for i in (60, 61)] == [1024, 1024]
    model = zoo.abstract(c)
    assert [(s.period, s.repeats) for s in model.stacks] == [(6, 10), (1, 2)]
    assert model.stacks[0].layers[5].attn.window is None and model.stacks[0].layers[0].attn.window == 1024


def test_qwen3_moe_dense_layers_keep_the_stack_count_bounded():
    c = SIZES["qwen3_30b_a3b"]  # 48 layers
    assert stack_layout(c.replace(decoder_sparse_step=2)) == [("layers", 0, 2, 24)]
    # Irregular dense layers: a few stacks around them, as many at twice the depth.
    irregular = c.replace(mlp_only_layers=[0, 5, 17])
    layout = stack_layout(irregular)
    assert [tuple(segment) for _, *segment in layout] == [(0, 5, 2), (10, 1, 7), (17, 1, 1), (18, 1, 30)]
    assert [name for name, *_ in layout] == ["layers", "moe_layers_10_16", "dense_layers", "moe_layers_18_47"]
    assert len(stack_layout(irregular.replace(num_layers=96))) == len(layout)


@pytest.mark.parametrize(
    "pattern, plan",
    [
        ("AAAA", [(0, 1, 4)]),  # a run is a period of 1, not 2 x 2 (ties go to the shorter period)
        ("ABABAB", [(0, 2, 3)]),
        ("AABABAB", [(0, 1, 1), (1, 2, 3)]),  # a prefix
        ("ABABABC", [(0, 2, 3), (6, 1, 1)]),  # a tail
        ("ABCABCAB", [(0, 3, 2), (6, 1, 1), (7, 1, 1)]),
        ("ABCD", [(0, 1, 1), (1, 1, 1), (2, 1, 1), (3, 1, 1)]),  # nothing repeats
    ],
)
def test_plan_stacks_cuts_the_fewest_stacks(pattern, plan):
    specs = [LayerSpec(window=None if ch == "A" else ord(ch), local_rope=False, moe=False) for ch in pattern]
    assert plan_stacks(specs) == plan
    assert_plan_covers(specs, plan)


def test_plan_stacks_covers_random_patterns():
    rng = np.random.default_rng(0)
    for _ in range(50):
        period = [
            LayerSpec(window=int(w) or None, local_rope=False, moe=bool(m))
            for w, m in rng.integers(0, 2, (rng.integers(1, 5), 2))
        ]
        n = int(rng.integers(1, 40))
        specs = [period[i % len(period)] for i in range(n)]
        for i in rng.integers(0, n, rng.integers(0, 3)):  # a few irregular layers
            specs[i] = LayerSpec(window=3, local_rope=True, moe=False)
        plan = plan_stacks(specs)
        assert_plan_covers(specs, plan)
        runs = 1 + sum(a != b for a, b in zip(specs, specs[1:]))
        assert len(plan) <= runs  # never more stacks than scanning each run of one spec


# ~18 s; the presets on a model with dense and MoE stacks: tests/test_offload.py (dsv3_tiny_a),
# the stack layout: test_stack_layout_of_the_real_sizes
@pytest.mark.slow
def test_qwen3_moe_dense_and_sparse_blocks_of_one_period_take_the_offload_presets():
    """A period holding a dense-MLP block and a MoE block: presets that place the mlp and moe tags
    differently give the loss and gradients of `none`, and the inspector finds every tag where each
    policy puts it (the mlp tags in the dense block, the moe tags in the sparse one)."""
    from zoo.placement import inspect_placement, stack_names
    from zoo.offload import expected_placement, load_preset, placement_matches, remat_policy

    c = QWEN3_MOE_MIXED
    model, tokens = filled(c), random_tokens(c)
    presets = ("none", "full", "minimal", "minimal_offloaded")
    policies = {name: remat_policy(load_preset(name), c) for name in presets}

    def every_policy(m):  # one compile; each policy from its own barrier copy, so none shares work
        return [
            jax.value_and_grad(lambda mm, rp=rp: loss_fn(mm, tokens, remat_policy=rp))(jax.lax.optimization_barrier(m))
            for rp in policies.values()
        ]

    results = dict(zip(presets, jax.jit(every_policy).lower(model).compile(FAST_COMPILE)(model)))
    loss0, grads0 = results["none"]
    for name in presets[1:]:
        loss, grads = results[name]
        np.testing.assert_allclose(float(loss), float(loss0), rtol=1e-6, err_msg=name)
        for g, g0 in zip(jax.tree.leaves(grads), jax.tree.leaves(grads0)):
            assert float(jnp.max(jnp.abs(g - g0))) <= 1e-6 * (float(jnp.max(jnp.abs(g0))) or 1.0), name

    abstract_tokens = jax.ShapeDtypeStruct(tokens.shape, tokens.dtype)
    for name in presets[1:]:
        policy = load_preset(name)
        grad = jax.grad(lambda m, t, rp=policies[name]: loss_fn(m, t, remat_policy=rp))
        found = inspect_placement(grad, zoo.abstract(c), abstract_tokens, stacks=stack_names(model)).by_tag()
        expected = expected_placement(policy, c)
        assert set(found) == set(expected) and {MLPWI_0, tags.MOE_MLPWI_0} <= set(found), name
        for tag_name, want in expected.items():
            assert placement_matches(want, found[tag_name]), (name, tag_name, want, found[tag_name])
    assert expected_placement(load_preset("minimal_offloaded"), c)[MLPWI_0] == "host"


# --- (c) shape checks ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llama_abstract():
    return zoo.abstract(LLAMA)


def _type_error(fn, *args):
    with pytest.raises(jaxtyping.TypeCheckError) as info:
        jax.eval_shape(fn, *args)
    return str(info.value)


def test_rank_one_tokens_are_refused(llama_abstract):
    message = _type_error(lambda m, t: m(t), llama_abstract, jax.ShapeDtypeStruct((16,), jnp.int32))
    assert "parameter 'tokens'" in message and "i32[16]" in message and "batch seq" in message


def test_float_tokens_are_refused(llama_abstract):
    message = _type_error(lambda m, t: m(t), llama_abstract, jax.ShapeDtypeStruct((2, 16), jnp.float32))
    assert "parameter 'tokens'" in message and "f32[2,16]" in message


def test_block_positions_must_match_the_sequence(llama_abstract):
    block = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), llama_abstract.stack("dense_layers").layers[0]
    )
    x = jax.ShapeDtypeStruct((2, 16, LLAMA.hidden_size), jnp.float32)
    message = _type_error(lambda b, x, p: b(x, p), block, x, jax.ShapeDtypeStruct((8,), jnp.int32))
    assert "parameter 'positions'" in message and "seq=16" in message


def test_rope_needs_a_heads_axis(llama_abstract):
    rope = llama_abstract.stack("dense_layers").layers[0].attn.rope
    x = jax.ShapeDtypeStruct((2, 16, LLAMA.head_dim), jnp.float32)
    message = _type_error(lambda x, p: rope(x, p), x, jax.ShapeDtypeStruct((16,), jnp.int32))
    assert "parameter 'x'" in message and "batch seq heads dim" in message


def test_block_with_wrong_embed_dim_fails_naming_both_sizes(llama_abstract):
    # The block's own annotations bind `embed` from x alone, so this is caught by the first weight it
    # meets (the RMSNorm weight), not by the type checker; the message still names both shapes.
    block = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), llama_abstract.stack("dense_layers").layers[0]
    )
    x = jax.ShapeDtypeStruct((2, 16, 32), jnp.float32)
    with pytest.raises((TypeError, ValueError), match=r"\(64,\).*\(2, 16, 32\)"):
        jax.eval_shape(lambda b, x, p: b(x, p), block, x, jax.ShapeDtypeStruct((16,), jnp.int32))


# --- build ----------------------------------------------------------------------------------


def test_build():
    m = zoo.build(LLAMA, key=jax.random.key(0))
    assert count_leaves(m) == zoo.count_params(LLAMA)
    shapes = jax.tree.map(lambda x: (x.shape, x.dtype), m)
    assert shapes == jax.tree.map(lambda x: (x.shape, x.dtype), zoo.abstract(LLAMA))
    # weights have std 1/sqrt(fan_in) (unit-variance outputs); norms start at 1
    wq = np.asarray(m.stack("dense_layers").layers[0].attn.wq)
    assert wq.std() == pytest.approx(LLAMA.hidden_size**-0.5, rel=0.05)
    wo = np.asarray(m.stack("dense_layers").layers[0].attn.wo)
    assert wo.std() == pytest.approx((LLAMA.num_heads * LLAMA.head_dim) ** -0.5, rel=0.05)
    assert not np.allclose(wq[0], wq[1])  # layers differ
    assert np.all(np.asarray(m.final_norm.weight) == 1)
    assert np.all(np.isfinite(np.asarray(logits_of(m, random_tokens(LLAMA)))))
    # a second build of the config reuses the compiled initialiser and gives the same weights
    from zoo.model import _INITIALISERS

    cached = len(_INITIALISERS)
    again = zoo.build(LLAMA, key=jax.random.key(0))
    assert len(_INITIALISERS) == cached
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(m), jax.tree.leaves(again)))
    # under a caller's trace (Trainer.init jits build into its own program) nothing is compiled here
    traced = jax.eval_shape(lambda k: zoo.build(LLAMA, key=k), jax.random.key(1))
    assert jax.tree.map(lambda x: (x.shape, x.dtype), traced) == shapes and len(_INITIALISERS) == cached


# --- (d) bf16 compute ------------------------------------------------------------------------


@pytest.mark.parametrize("c", [LLAMA, DSV3_MOE_ONLY], ids=["llama", "dsv3"])
def test_bf16_compute_is_close_to_float32(c):
    tokens = random_tokens(c)
    f32 = logits_of(filled(c), tokens)
    bf16 = logits_of(filled(c.replace(compute_dtype="bfloat16")), tokens)  # same weights (float32 params)
    assert f32.dtype == bf16.dtype == jnp.float32
    f32, bf16 = np.asarray(f32), np.asarray(bf16)
    assert not np.array_equal(f32, bf16)  # bf16 really was used
    per_position = np.abs(bf16 - f32).max(-1) / np.abs(f32).max()
    if c.moe is None:
        assert per_position.max() < 0.03, per_position.max()
    else:
        # bf16 noise in the router's input can flip a near-tie between experts for a token, which moves
        # that token's logits by O(1); the rest stay close
        assert np.mean(per_position < 0.03) > 0.9, np.sort(per_position)
    # and the predictions mostly agree
    assert np.mean(bf16.argmax(-1) == f32.argmax(-1)) > 0.9


# --- (e) tied embeddings ---------------------------------------------------------------------


def test_tied_embeddings_use_embed_transpose():
    tied_config = LLAMA.replace(tie_word_embeddings=True)
    untied = filled(LLAMA)
    tied = eqx.tree_at(
        lambda m: (m.embed, m.stacks, m.final_norm),
        filled(tied_config),
        (untied.embed, untied.stacks, untied.final_norm),
    )
    assert tied.lm_head is None
    assert count_leaves(tied) == count_leaves(untied) - LLAMA.vocab_size * LLAMA.hidden_size
    # the untied model with lm_head = embed.T computes the same function
    same = eqx.tree_at(lambda m: m.lm_head, untied, untied.embed.T)
    tokens = random_tokens(LLAMA)
    np.testing.assert_allclose(
        np.asarray(logits_of(tied, tokens)), np.asarray(logits_of(same, tokens)), rtol=1e-5, atol=1e-5
    )
    assert not np.allclose(np.asarray(logits_of(untied, tokens)), np.asarray(logits_of(same, tokens)), atol=1e-3)

    # the embedding's gradient collects both uses: lookup and output head
    grad = jax.jit(jax.grad(loss_fn), compiler_options=FAST_COMPILE)
    g_tied, g_same = grad(tied, tokens), grad(same, tokens)
    np.testing.assert_allclose(
        np.asarray(g_tied.embed), np.asarray(g_same.embed + g_same.lm_head.T), rtol=1e-4, atol=1e-6
    )


def test_named_tied_size_has_no_lm_head():
    assert SIZES["llama_1b"].tie_word_embeddings and zoo.abstract(SIZES["llama_1b"]).lm_head is None


# --- (f) training ----------------------------------------------------------------------------


@pytest.mark.parametrize("c", [LLAMA, DSV3, DSV3_CAPACITY_MOE_ONLY], ids=["llama", "dsv3_ragged", "dsv3_capacity"])
def test_sgd_on_a_repeated_batch_lowers_the_loss(c):
    model = filled(c)
    params, static = eqx.partition(model, eqx.is_array)
    mask = trainable_mask(params)
    tokens = random_tokens(c)

    def loss(p, t):
        logits, aux = eqx.combine(p, static).forward_with_aux(t)
        return zoo.next_token_loss(logits, t), aux

    def step(p, t):
        (value, aux), g = jax.value_and_grad(loss, has_aux=True)(p, t)
        p = jax.tree.map(lambda p, g, train: p - 0.1 * g if train else p, p, g, mask)
        return p, value, g, aux

    step = jax.jit(step, compiler_options=FAST_COMPILE)
    losses = []
    for _ in range(8):
        params, value, grads, aux = step(params, tokens)
        losses.append(float(value))
    assert np.all(np.isfinite(losses))
    assert losses[-1] < 0.8 * losses[0], losses
    assert max(losses) <= losses[0] + 0.5, losses  # no blow-up on the way

    if c.moe is not None:
        # the correction bias is a buffer: no gradient, never updated
        assert np.all(np.asarray(grads.stack("moe_layers").layers[0].ffn.e_score_correction_bias) == 0)
        assert np.all(np.asarray(params.stack("moe_layers").layers[0].ffn.e_score_correction_bias) == 0)
        # routing statistics, stacked over the MoE layers
        per_layer = np.asarray(aux.tokens_per_expert)
        assert per_layer.shape == (c.num_moe_layers, c.moe.n_routed_experts)
        np.testing.assert_array_equal(per_layer.sum(-1), tokens.size * c.moe.num_experts_per_tok)
        assert aux.dropped.shape == (c.num_moe_layers,)
    else:
        assert aux is None


# --- the loss ---------------------------------------------------------------------------------


def test_next_token_loss_matches_numpy():
    rng = np.random.default_rng(11)
    logits = rng.normal(size=(3, 7, 11)).astype(np.float32) * 3
    tokens = rng.integers(0, 11, size=(3, 7))
    mask = (rng.uniform(size=(3, 7)) > 0.3).astype(np.float32)
    mask[0, 1] = 1.0

    def nll(b, t):  # predicting tokens[b, t + 1] from logits[b, t]
        z = logits[b, t].astype(np.float64)
        return np.log(np.exp(z - z.max()).sum()) + z.max() - z[tokens[b, t + 1]]

    all_nll = np.array([[nll(b, t) for t in range(6)] for b in range(3)])
    loss = jax.jit(zoo.next_token_loss)(jnp.asarray(logits), jnp.asarray(tokens, jnp.int32))
    assert float(loss) == pytest.approx(all_nll.mean(), rel=1e-5)
    masked = jax.jit(zoo.next_token_loss)(jnp.asarray(logits), jnp.asarray(tokens, jnp.int32), jnp.asarray(mask))
    weights = mask[:, 1:]  # mask[:, 0] targets nothing
    assert float(masked) == pytest.approx((all_nll * weights).sum() / weights.sum(), rel=1e-5)


@pytest.mark.parametrize("name", ["llama_tiny_a", "gemma3_tiny_a"])
def test_pad_token_row_gets_no_gradient_from_its_lookups(name):
    """transformers builds every family's embedding with padding_idx=pad_token_id: PyTorch gives that
    row no gradient from the lookup. Tied heads (Gemma 3) still train the row through the head."""
    c, pad = SIZES[name], 3
    tokens = random_tokens(c).at[:, ::3].set(pad)

    def embed_grad(config):  # same seed and shapes: the same weights
        return np.asarray(jax.grad(lambda m: loss_fn(m, tokens))(filled(config)).embed)

    plain, padded = embed_grad(c), embed_grad(c.replace(pad_token_id=pad))
    others = np.arange(c.vocab_size) != pad
    np.testing.assert_array_equal(padded[others], plain[others])
    assert np.abs(plain[pad]).max() > 0
    if c.tie_word_embeddings:
        assert np.abs(padded[pad]).max() > 0 and not np.allclose(padded[pad], plain[pad])
    else:
        assert not padded[pad].any()


def test_dense_is_one_row_axis_matmul_forward_and_backward():
    # zoo.nn.mlp.dense merges the leading axes into one row axis. Written over [batch, seq] rows, XLA:CPU
    # computed the weight gradient from transposed copies of the activations and of the incoming
    # gradient, and the step ran 5-10% slower (docs/benchmarks.md). Same values as the einsum, and
    # the compiled forward + backward copies and transposes nothing.
    from zoo.nn.mlp import dense

    x = jax.random.normal(jax.random.key(0), (4, 128, 64))
    w = jax.random.normal(jax.random.key(1), (64, 256))
    np.testing.assert_allclose(dense(x, w), jnp.einsum("btd,df->btf", x, w), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dense(x[0, 0], w), x[0, 0] @ w, rtol=1e-5, atol=1e-5)
    assert dense(x[0, 0], w).shape == (256,)

    def loss(x, w):
        return jnp.sum(jnp.sin(dense(x, w)))

    got = jax.grad(loss, argnums=(0, 1))(x, w)
    want = jax.grad(lambda x, w: jnp.sum(jnp.sin(jnp.einsum("btd,df->btf", x, w))), argnums=(0, 1))(x, w)
    for g, e in zip(got, want):
        np.testing.assert_allclose(g, e, rtol=1e-4, atol=1e-4)
    hlo = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(x, w).compile().as_text()
    assert hlo.count(" dot(") + hlo.count("ynn_fusion") >= 3, hlo  # forward, input and weight gradients
    moved = [ln for ln in hlo.splitlines() if " copy(" in ln or " transpose(" in ln or "copy_bitcast" in ln]
    assert not moved, "\n".join(moved)


@pytest.mark.parametrize("activation", ["silu", "gelu_tanh", "clamped_swiglu"])
def test_gated_activation_keeps_two_tensors_and_jaxs_derivatives(activation, monkeypatch):
    # zoo.nn.mlp.gated: the gated MLP's activation keeps its two partial derivatives for the backward
    # pass instead of the five [tokens, mlp] tensors of JAX's own derivative (the `100m` step's
    # compiled temp 21% smaller, docs/benchmarks.md). Same values, gradients, forward-mode and second
    # derivatives as JAX's derivative of the plain function; the residuals of a GatedMLP shrink to
    # the two partials and the down projection's input.
    import zoo.nn.mlp as M
    from zoo._compat import saved_residuals
    from zoo.config import MoEConfig
    from zoo.nn.mlp import ACTIVATIONS, GatedMLP, gated
    from zoo.nn.moe import expert_activation

    if activation == "clamped_swiglu":  # GPT-OSS's experts: both inputs clamped, so some partials are 0
        fn = expert_activation(MoEConfig(activation="clamped_swiglu", swiglu_limit=1.5, swiglu_alpha=1.702))
    else:
        fn = ACTIVATIONS[activation]
    g, u, dg, du = (2 * jax.random.normal(k, (6, 40)) for k in jax.random.split(jax.random.key(0), 4))

    def scalar(f):
        return lambda g, u: jnp.sum(jnp.sin(f(g, u)))

    def close(a, b):  # float32 roundoff of the same derivative formulas, grouped differently
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * float(jnp.abs(b).max()))

    ours, plain = partial(gated, fn), fn
    np.testing.assert_array_equal(ours(g, u), plain(g, u))
    for a, b in zip(jax.grad(scalar(ours), (0, 1))(g, u), jax.grad(scalar(plain), (0, 1))(g, u)):
        close(a, b)
    close(jax.jvp(ours, (g, u), (dg, du))[1], jax.jvp(plain, (g, u), (dg, du))[1])
    hvp = [jax.jvp(jax.grad(scalar(f)), (g, u), (dg, du))[1] for f in (ours, plain)]  # grad of a custom_jvp
    close(hvp[0], hvp[1])
    if activation == "clamped_swiglu":
        assert (jax.grad(scalar(ours))(g, u) == 0).any()  # the clamp is reached: its zero slope is kept
        return

    mlp = GatedMLP(16, 40, activation=activation, key=jax.random.key(1))
    params, static = eqx.partition(mlp, eqx.is_array)
    x = jax.random.normal(jax.random.key(2), (2, 3, 16))

    def kept():  # what the backward pass keeps, the arguments left out
        found = saved_residuals()(lambda p, x: eqx.combine(p, static)(x), params, x)
        return [r[0] for r in found if "argument" not in r[1]]

    residuals = kept()
    assert sum(r.shape[-1:] == (40,) and r.size == 6 * 40 for r in residuals) == 3  # [tokens, mlp]
    # and the input once, for both projections' weight gradients (one reshape of x, not one each)
    assert sum(r.size == 6 * 16 for r in residuals) == 1, residuals
    monkeypatch.setattr(M, "gated", lambda fn, gate, up: fn(gate, up))  # JAX's own derivative: more
    assert sum(r.shape[-1:] == (40,) and r.size == 6 * 40 for r in kept()) >= 5
