"""Config validation (every rule names its field) and parameter counts of the named sizes."""

import dataclasses
import re

import pytest

from zoo import families
from zoo.config import MLAConfig, MoEConfig, RopeConfig, moe_capacity
from zoo.counts import count_params
from zoo.families import SIZES, get_size
from zoo.model import abstract, count_leaves

LLAMA = SIZES["llama_tiny_a"]
DSV3 = SIZES["dsv3_tiny_a"]


def raises_naming(field):
    return pytest.raises(ValueError, match=re.escape(f"model.{field}:"))


# --- validation ------------------------------------------------------------------------------

ROPE_RULES = [
    ("rope.type", dict(type="ntk")),
    ("rope.theta", dict(theta=0.0)),
    ("rope.factor", dict(type="llama3", factor=0.5, original_max_position_embeddings=8192)),
    ("rope.factor", dict(type="yarn", factor=0.5)),
    ("rope.original_max_position_embeddings", dict(type="llama3", factor=8.0)),
    (
        "rope.high_freq_factor",
        dict(
            type="llama3", factor=8.0, original_max_position_embeddings=8192, low_freq_factor=4.0, high_freq_factor=4.0
        ),
    ),
]

MLA_RULES = [
    ("mla.q_lora_rank", dict(q_lora_rank=0)),
    ("mla.kv_lora_rank", dict(kv_lora_rank=0)),
    ("mla.qk_nope_head_dim", dict(qk_nope_head_dim=0)),
    ("mla.qk_rope_head_dim", dict(qk_rope_head_dim=0)),
    ("mla.v_head_dim", dict(v_head_dim=-1)),
    ("mla.qk_rope_head_dim", dict(qk_rope_head_dim=7)),  # odd rope dim
]

MOE_RULES = [
    ("moe.impl", dict(impl="dense")),
    ("moe.n_routed_experts", dict(n_routed_experts=0, n_group=1, topk_group=1)),
    ("moe.num_experts_per_tok", dict(num_experts_per_tok=9)),  # top_k > experts
    ("moe.num_experts_per_tok", dict(num_experts_per_tok=0)),
    ("moe.n_group", dict(n_group=3)),  # 8 experts not divisible by 3 groups
    ("moe.n_group", dict(n_group=0, topk_group=1)),
    ("moe.n_group", dict(n_group=8, topk_group=1, num_experts_per_tok=1)),  # one expert per group
    ("moe.topk_group", dict(topk_group=3)),  # > n_group=2
    ("moe.topk_group", dict(topk_group=0)),
    ("moe.topk_group", dict(n_group=4, topk_group=1, num_experts_per_tok=3)),  # 1 group of 2 cannot supply 3
    ("moe.capacity_factor", dict(capacity_factor=0.0)),
    ("moe.exchange_factor", dict(exchange_factor=-1.0)),
    ("moe.n_shared_experts", dict(n_shared_experts=-1)),
]

MODEL_RULES = [
    *[
        (name, LLAMA, {name: 0})
        for name in (
            "vocab_size",
            "hidden_size",
            "num_layers",
            "num_heads",
            "intermediate_size",
            "max_position_embeddings",
        )
    ],
    ("rms_norm_eps", LLAMA, dict(rms_norm_eps=0.0)),
    ("param_dtype", LLAMA, dict(param_dtype="int8")),
    ("compute_dtype", LLAMA, dict(compute_dtype="float64")),
    ("attention_impl", LLAMA, dict(attention_impl="flash")),
    (
        "attention_bias",
        LLAMA,
        dict(mla=MLAConfig(), attention_bias=True),
    ),  # an mla section: latent attention, no q/k/v biases
    ("num_kv_heads", LLAMA, dict(num_kv_heads=0)),
    ("num_heads", LLAMA, dict(num_heads=4, num_kv_heads=3)),  # heads not divisible by kv heads
    ("head_dim", LLAMA, dict(head_dim=15)),  # odd rope dim
    ("first_k_dense_replace", LLAMA, dict(first_k_dense_replace=1)),
    ("rope.interleaved", LLAMA, dict(rope=RopeConfig(interleaved=True))),
    ("first_k_dense_replace", DSV3, dict(moe=None)),  # a dense prefix without MoE layers
    ("first_k_dense_replace", DSV3, dict(first_k_dense_replace=4)),  # > num_layers=3
    ("first_k_dense_replace", DSV3, dict(first_k_dense_replace=-1)),
]


@pytest.mark.parametrize("field,kw", ROPE_RULES, ids=[f"{f}-{i}" for i, (f, _) in enumerate(ROPE_RULES)])
def test_rope_rules(field, kw):
    with raises_naming(field):
        RopeConfig(**kw)


@pytest.mark.parametrize("field,kw", MLA_RULES, ids=[f"{f}-{i}" for i, (f, _) in enumerate(MLA_RULES)])
def test_mla_rules(field, kw):
    with raises_naming(field):
        dataclasses.replace(DSV3.mla, **kw)


@pytest.mark.parametrize("field,kw", MOE_RULES, ids=[f"{f}-{i}" for i, (f, _) in enumerate(MOE_RULES)])
def test_moe_rules(field, kw):
    with raises_naming(field):
        dataclasses.replace(DSV3.moe, **kw)


# The registry's rules (zoo.families.check): the family a config names, and the sections its kind has.
FAMILY_RULES = [
    ("family", LLAMA, dict(family="gpt2")),
    ("family", LLAMA, dict(mla=MLAConfig())),  # llama with an mla section
    ("family", LLAMA, dict(moe=MoEConfig())),
    ("mla", DSV3, dict(mla=None, rope=RopeConfig())),  # grouped-query attention rotates halves
    ("moe", DSV3, dict(moe=None, first_k_dense_replace=0)),
]


@pytest.mark.parametrize("field,base,kw", MODEL_RULES, ids=[f"{f}-{i}" for i, (f, _, _) in enumerate(MODEL_RULES)])
def test_model_rules(field, base, kw):
    with raises_naming(field):
        base.replace(**kw)


@pytest.mark.parametrize("field,base,kw", FAMILY_RULES, ids=[f"{f}-{i}" for i, (f, _, _) in enumerate(FAMILY_RULES)])
def test_family_rules(field, base, kw):
    config = base.replace(**kw)  # a config checks its own fields; its family is a name the registry knows
    with raises_naming(field):
        families.check(config)


def test_every_size_is_checked_against_its_family():
    assert all(families.check(c) is c for c in SIZES.values())
    assert families.check(LLAMA.replace(family="mistral")) is not None  # the same kind: a valid mistral


def test_rule_cases_are_valid_apart_from_the_broken_field():
    # The bases the rule tests start from are valid, and valid neighbours of the broken values pass,
    # so each ValueError above comes from the rule under test.
    RopeConfig(type="llama3", factor=8.0, original_max_position_embeddings=8192)
    RopeConfig(type="yarn", factor=1.0)
    dataclasses.replace(DSV3.mla, q_lora_rank=None, qk_rope_head_dim=8)
    dataclasses.replace(DSV3.moe, num_experts_per_tok=8, topk_group=2)
    dataclasses.replace(DSV3.moe, n_group=4, topk_group=1, num_experts_per_tok=2)
    dataclasses.replace(DSV3.moe, n_group=1, topk_group=1, n_shared_experts=0)
    LLAMA.replace(num_heads=6, num_kv_heads=3, head_dim=14)
    DSV3.replace(first_k_dense_replace=3)
    DSV3.replace(first_k_dense_replace=0)
    LLAMA.replace(mla=MLAConfig())  # latent attention without q/k/v biases
    DSV3.replace(moe=None, first_k_dense_replace=0)


def test_messages_say_how_to_fix():
    with pytest.raises(ValueError, match="num_heads=4 must be divisible by num_kv_heads=3"):
        LLAMA.replace(num_heads=4, num_kv_heads=3)
    with pytest.raises(ValueError, match=r"top_k=9 must be in 1\.\.n_routed_experts=8"):
        dataclasses.replace(DSV3.moe, num_experts_per_tok=9)
    with pytest.raises(ValueError, match="'ntk'"):
        RopeConfig(type="ntk")


def test_unknown_size():
    with pytest.raises(ValueError, match="llama_tiny_a"):  # the message lists the known sizes
        get_size("llama_7b")
    assert get_size("llama_tiny_a") is LLAMA


def test_moe_capacity():
    c = dataclasses.replace(DSV3.moe, capacity_factor=1.25)  # 8 experts, top 2
    assert moe_capacity(32, c) == 10  # 32 * 2 / 8 * 1.25
    assert moe_capacity(30, c) == 10  # ceil(9.375)
    assert moe_capacity(1, dataclasses.replace(c, capacity_factor=0.01)) == 1
    assert moe_capacity(32, dataclasses.replace(c, capacity_factor=1e30)) == 64  # every assignment, no more


# --- parameter counts ------------------------------------------------------------------------

# Published sizes, total and active, with where each figure is published: each family's `published`
# (zoo/families/<name>.py), name -> (total, active or None, tolerance, source). Tolerance 1% unless the
# published figure is rounded coarser than that (then the rounding's width, said per entry); a pair
# is (total's, active's). "hub" = the parameter count the Hugging Face hub shows from the checkpoint's
# safetensors headers.
PUBLISHED = {name: count for f in families.registered() for name, count in f.published.items()}
# Families that publish active parameters without the embedding table (OpenAI: a lookup touches one
# row) are compared with that convention (zoo.families.FamilyDef.active_without_embedding).
ACTIVE_WITHOUT_EMBEDDING = {name for f in families.registered() if f.active_without_embedding for name in f.published}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_published_parameter_counts(name):
    total, active, tolerance, source = PUBLISHED[name]
    total_tolerance, active_tolerance = tolerance if isinstance(tolerance, tuple) else (tolerance, tolerance)
    c = SIZES[name]
    assert count_params(c) == pytest.approx(total, rel=total_tolerance), source
    if active is not None:
        counted = count_params(c, active=True) - (
            c.vocab_size * c.hidden_size if name in ACTIVE_WITHOUT_EMBEDDING else 0
        )
        assert counted == pytest.approx(active, rel=active_tolerance), source


def test_every_real_size_has_a_published_count():
    tiny_or_ours = re.compile(r"(_tiny_a|_100m|_1b|_2b)$")
    assert {n for n in SIZES if not tiny_or_ours.search(n)} == set(PUBLISHED)


# The CPU-sized model of a family is `<family>_100m`, read from the registry, so a new family's is
# checked without a list here. Llama's (64M) came before the 100M rule and keeps its recorded figures;
# DeepSeek-V3's is `dsv3_100m` (107.6M), named before the families were.
CPU_SIZED = tuple(
    n for n in sorted(SIZES) if n.endswith("_100m") and n == f"{SIZES[n].family}_100m" and n != "llama_100m"
)


def test_the_cpu_sized_list_is_read_from_the_registry():
    assert {"qwen2_100m", "gemma3_100m", "gpt_oss_100m", "qwen3_moe_100m"} <= set(CPU_SIZED)


@pytest.mark.parametrize("name", CPU_SIZED)
def test_cpu_sizes_of_the_families_are_about_100m(name):
    # The CPU-sized model of each family (docs/models.md records each one training): 100M total within 5%.
    assert count_params(SIZES[name]) == pytest.approx(100e6, rel=0.05)


@pytest.mark.parametrize("name", sorted(SIZES))
def test_every_leaf_of_the_model_is_declared_so_the_counts_see_it(name):
    """zoo.counts reads weights through the blocks' PARAMS: every array of the model must be declared
    there (an undeclared one would be missing from the FLOPs), and a token uses top_k of the routed
    experts' declared leaves."""
    from zoo.counts import declared_leaves

    c = SIZES[name]
    model = abstract(c)
    declared = list(declared_leaves(model))
    assert sum(x.size for x, _ in declared) == count_leaves(model) == count_params(c)
    routed = sum(x.size for x, leaf in declared if leaf.axes and leaf.axes[0] == "experts")
    if c.moe is None:
        assert routed == 0 and count_params(c, active=True) == count_params(c)
    else:
        unused = routed * (1 - c.moe.num_experts_per_tok / c.moe.n_routed_experts)
        assert 0 < unused and count_params(c, active=True) == round(count_params(c) - unused)


@pytest.mark.parametrize("name", ["llama_tiny_a", "dsv3_tiny_a"])
def test_count_params_tied_and_without_q_lora(name):
    c = SIZES[name].replace(tie_word_embeddings=True)
    assert count_leaves(abstract(c)) == count_params(c) == count_params(SIZES[name]) - c.vocab_size * c.hidden_size
    if c.mla is not None:
        c = c.replace(
            mla=dataclasses.replace(c.mla, q_lora_rank=None), moe=dataclasses.replace(c.moe, n_shared_experts=0)
        )
        assert count_leaves(abstract(c)) == count_params(c)


def test_sizes_table_lists_every_size_with_its_counts(capsys):
    from zoo.tools import sizes

    assert sizes.main([]) == 0
    out = capsys.readouterr().out
    for name, c in SIZES.items():
        row = next(line for line in out.splitlines() if line.startswith(f"| `{name}` |"))
        assert f" {c.family} " in row and sizes._count(count_params(c)) in row
    assert "| 671.03B | 37.55B |" in out
    assert sizes.main(["no_such_size"]) == 2
    assert capsys.readouterr().err.startswith("error: no_such_size: no such size; choose from llama_tiny_a,")


def test_moe_config_defaults_fit_a_small_moe_without_naming_the_router():
    """A plain top-2 softmax router over 8 experts; DeepSeek-V3's grouped routing only where named."""
    assert MoEConfig().router == "softmax" and MoEConfig(n_routed_experts=3).n_routed_experts == 3
    assert DSV3.moe.router == "sigmoid_grouped" and SIZES["deepseek_v3_671b"].moe.n_group == 8
