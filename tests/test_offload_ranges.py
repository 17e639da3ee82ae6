"""A remat/offload policy per layer range (`offload.ranges`): the config, its validation, the cut
scans, what the traced program keeps on host per range, and the inspector's per-range view.

Ranges count the model's layers 0-based across its stacks; a range's layers run as scans of their own
(the stacks are cut at the ranges' boundaries) under the range's preset. The maths must not change:
the loss and gradients of any split equal those of `none`.
"""

import pathlib
import re
import shutil
import sys

import in_process
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import zoo
from zoo import offload
from zoo.families import SIZES
from zoo.tools.inspect_step import range_sections
from zoo.placement import _analyse_forward_scan, _names_in, _walk, inspect_placement, scan_names
from zoo.offload import load_preset, remat_policy, resolve, scan_policies

ROOT = pathlib.Path(__file__).resolve().parents[1]
LLAMA4 = SIZES["llama_tiny_a"].replace(num_layers=4)  # one stack of 4 layers
DSV3 = SIZES["dsv3_tiny_a"]  # dense layer 0, then MoE layers 1-2: two stacks
GEMMA3 = SIZES["gemma3_tiny_a"]  # stacks of layers 0-2 and 3 (sliding, then global)
GPT_OSS = SIZES["gpt_oss_tiny_a"]  # one stack, a period of two blocks repeated twice


def _compose(*overrides):
    from zoo.tools.kit import compose
    from zoo.train.run_config import load

    return load(compose(overrides))


# --- the config ------------------------------------------------------------------------------------


def test_ranges_are_parsed_sorted_and_named_in_the_description():
    p = load_preset("full", ranges={5: "none", "0-3": "llama_qkv_offload"})
    assert p.ranges == {"5": "none", "0-3": "llama_qkv_offload"}  # Hydra reads `{5: none}` with an int key
    assert [(r.first, r.last, r.preset) for r in offload.parse_ranges(p.ranges)] == [
        (0, 3, "llama_qkv_offload"),
        (5, 5, "none"),
    ]
    assert p.describe() == "full + layers 0-3 llama_qkv_offload + layers 5 none"
    segs = offload.layer_policies(p, 8)
    assert [(s.first, s.stop, s.config.name, s.label) for s in segs] == [
        (0, 4, "llama_qkv_offload", "offload.ranges.0-3"),
        (4, 5, "full", "offload"),
        (5, 6, "none", "offload.ranges.5"),
        (6, 8, "full", "offload"),
    ]
    # A range's preset is loaded as the top-level one is; where state lives stays the top level's.
    host = load_preset("full", "params_host", ranges={"0": "none"})
    ((_, config),) = offload.range_configs(host)
    assert config.params == "pinned_host" and not config.checkpoint and config.tags == {}


def test_hydra_composes_ranges_from_the_command_line():
    c = _compose("model=llama_tiny_a", "offload=full", "+offload.ranges={0:llama_qkv_offload}")
    assert c.offload.name == "full" and c.offload.ranges == {"0": "llama_qkv_offload"}
    c = _compose("model=dsv3_tiny_a", "offload=[full,optimizer_host]", "+offload.ranges={0-1:minimal,2:none}")
    assert c.offload.ranges == {"0-1": "minimal", "2": "none"} and c.offload.opt_state == "pinned_host"
    rp = remat_policy(c.offload, c.model)
    assert [(a, b) for a, b, _ in rp.segments] == [(0, 2), (2, 3)]


def test_the_xla_host_offload_switch_sees_a_range_that_offloads():
    from zoo.train.run import uses_host_memory

    assert not uses_host_memory(load_preset("full"))
    assert uses_host_memory(load_preset("full", ranges={"0": "qkv_proj_offloaded"}))
    assert not uses_host_memory(load_preset("full", ranges={"0": "save_qkv_proj"}))


# --- validation: one line naming the key and the fix ---------------------------------------------------

BAD = {
    "{1-0:full}": (
        r"^offload.ranges.1-0: not a layer range; write first-last \(0-based, inclusive, first <= last\) or "
        r"one layer, e\.g\. \+offload"
    ),
    "{a-b:full}": r"^offload.ranges.a-b: not a layer range; ",
    "{0-1:full,1:none}": r"^offload.ranges.1: overlaps offload.ranges.0-1 \(layer 1\); make the ranges disjoint",
    "{0:nope}": r"^offload.ranges.0: unknown preset 'nope'; choose one of custom, .*full.*",
    "{0:params_host}": (
        r"^offload.ranges.0: params_host only sets where parameters or optimizer state live.*set offload.params"
    ),
    "{0:/nonexistent/mine.yaml}": (
        r"^offload.ranges.0: no file /nonexistent/mine.yaml; give an existing offload policy YAML \(e\.g\. one "
        r"zoo\.tools\.plan wrote\) or a preset name$"
    ),
    "{0-5:full}": (
        r"^offload.ranges.0-5: layer 5 is past the model's last layer \(the llama model has 2 layers, 0-1\); "
        r"keep every range within 0-1$"
    ),
}


@pytest.mark.parametrize("ranges", list(BAD))
def test_bad_ranges_are_one_line_before_any_compile(ranges):
    from zoo.train.run_config import ConfigError, validate

    with pytest.raises(ConfigError) as e:
        c = _compose("model=llama_tiny_a", f"+offload.ranges={ranges}")
        validate(c, len(jax.devices()))
    msg = str(e.value)
    assert "\n" not in msg
    assert re.match(BAD[ranges], msg), msg


@pytest.fixture
def extra_presets(tmp_path, monkeypatch):
    """conf/offload plus presets a whole-model policy would refuse on Llama."""
    conf = tmp_path / "conf"
    shutil.copytree(offload.conf_dir() / "offload", conf / "offload")
    (conf / "offload" / "keep_mlpwo.yaml").write_text("name: keep_mlpwo\ncheckpoint: true\ntags:\n  mlpwo: offload\n")
    (conf / "offload" / "mla_only.yaml").write_text("name: mla_only\ncheckpoint: true\ntags:\n  mla_q: device\n")
    (conf / "offload" / "nested.yaml").write_text("name: nested\ncheckpoint: true\nranges:\n  0: full\n")
    (conf / "offload" / "typo.yaml").write_text("name: typo\ncheckpoint: true\ntags:\n  query_proj: host\n")
    monkeypatch.setattr(offload, "conf_dir", lambda: conf)
    return conf


def test_a_range_is_refused_what_the_whole_model_policy_would_be(extra_presets):
    llama = SIZES["llama_tiny_a"]
    # As whole-model policies, both are refused on Llama ...
    for name, why in (
        ("keep_mlpwo", "the backward pass never reads mlpwo"),
        ("mla_only", "the llama model never emits this tag"),
    ):
        with pytest.raises(ValueError, match=why):
            resolve(load_preset(name), llama)
        # ... and so is a range that uses them, naming the range and its preset.
        with pytest.raises(ValueError) as e:
            resolve(load_preset("full", ranges={"1": name}), llama)
        assert str(e.value).startswith(f"offload.ranges.1: preset {name}: offload.tags.") and why in str(e.value)
        resolve(
            load_preset("full", ranges={"1": name}), GEMMA3 if name == "keep_mlpwo" else DSV3
        )  # where the tag is read / emitted
    with pytest.raises(
        ValueError, match=r"^offload.ranges.0: preset typo: offload.tags.query_proj: 'host' is not an action"
    ):
        load_preset("none", ranges={"0": "typo"})
    with pytest.raises(ValueError, match=r"^offload.ranges.0: preset nested has ranges of its own"):
        load_preset("none", ranges={"0": "nested"})


def test_a_range_takes_a_policy_file_as_it_takes_a_preset(tmp_path):
    """A value ending in .yaml is a file (zoo.tools.plan plan.split=true writes them), loaded and checked as
    a preset is; where state lives stays the top level's."""
    mine = tmp_path / "mine.yaml"
    mine.write_text("name: mine\ncheckpoint: true\ntags:\n  query_proj: offload\nparams: device\n")
    ((_, config),) = offload.range_configs(load_preset("full", "params_host", ranges={"0": str(mine)}))
    assert config.name == "mine" and config.tags == {"query_proj": "offload"} and config.params == "pinned_host"
    for text, message in (
        ("params: pinned_host\n", "only sets where parameters or optimizer state live"),
        ("name: x\ncheckpoint: true\nranges:\n  0: full\n", "has ranges of its own"),
        ("name: x\ncheckpoint: true\ntags:\n  query_proj: host\n", "offload.tags.query_proj: 'host' is not an action"),
        ("- a list\n", "is not a YAML mapping"),
    ):  # fmt: skip
        mine.write_text(text)
        with pytest.raises(ValueError, match=rf"^offload.ranges.0: .*{re.escape(message)}"):
            load_preset("none", ranges={"0": str(mine)})


# The commands of the tests marked `in_process` run in one pytest process through their entry points
# (tests/in_process.py), JAX started with conftest.py's flags (8 devices), as these commands start it.


@in_process.MARK
def test_train_py_refuses_a_bad_range_in_one_line_with_exit_2(tmp_path, request, capfd, monkeypatch):
    if not in_process.INNER:
        return in_process.outcome(request)
    base = [
        sys.executable,
        str(ROOT / "train.py"),
        "model=llama_tiny_a",
        "trainer.steps=1",
        f"hydra.run.dir={tmp_path / 'run'}",
    ]
    for arg, line in (
        (
            "+offload.ranges={0-5:full}",
            (
                "error: offload.ranges.0-5: layer 5 is past the model's last layer (the llama model has 2 layers, "
                "0-1); keep every range within 0-1"
            ),
        ),
        (
            "offload.ranges={0:full}",
            "error: offload.ranges: the chosen offload option does not list it; add it with +offload.ranges={0:full}",
        ),
        (
            "+offload.ranges={0:nope/mine.yaml}",
            (
                "error: offload.ranges.0: no file nope/mine.yaml; give an existing offload policy YAML (e.g. one "
                "zoo.tools.plan wrote) or a preset name"
            ),
        ),
    ):
        p = in_process.run([*base, arg], tmp_path, capfd, monkeypatch)
        assert p.returncode == 2, p.stderr[-2000:]
        assert p.stderr.strip().splitlines() == [line]


@in_process.MARK
def test_train_py_trains_with_ranges_and_records_them(tmp_path, request, capfd, monkeypatch):
    import json

    if not in_process.INNER:
        return in_process.outcome(request)
    args = [
        "model=llama_tiny_a",
        "mesh=single",
        "data.batch_size=4",
        "data.seq_len=16",
        "xla.cpu_fast_compile=true",
        "trainer.progress=false",
        "trainer.steps=2",
        "offload=full",
        "+offload.ranges={0:llama_qkv_offload}",
        f"hydra.run.dir={tmp_path / 'run'}",
    ]
    p = in_process.run([sys.executable, str(ROOT / "train.py"), *args], tmp_path, capfd, monkeypatch)
    assert p.returncode == 0, p.stderr[-3000:]
    assert ", offload full, layers 0 llama_qkv_offload, " in p.stdout.splitlines()[0]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["offload"] == "full" and summary["offload_ranges"] == {"0": "llama_qkv_offload"}


def test_a_ranged_policy_needs_the_model():
    with pytest.raises(ValueError, match="offload.ranges: the policy of a layer range needs the model"):
        remat_policy(load_preset("full", ranges={"0": "none"}))


# --- the cut: the maths does not change -------------------------------------------------------------

SPLITS = {
    "llama": (LLAMA4, "none", {"0-1": "llama_qkv_offload", "3": "full"}),
    # a range across the stack boundary (dense layer 0, MoE layer 1), the rest under minimal_offloaded
    "dsv3": (DSV3, "minimal_offloaded", {"0-1": "full"}),
    # a range cutting the first stack (layers 0-2) inside
    "gemma3": (GEMMA3, "full", {"1": "qkv_proj_offloaded", "2-3": "none"}),
    # cuts inside the repeating period (layers 0-1 are one scan step)
    "gpt_oss": (GPT_OSS, "none", {"1-2": "minimal_offloaded"}),
}


# Gemma 3 and GPT-OSS cut inside their periods: the slow tier. In the default tier, Llama and DeepSeek-V3
# (the core families) here, and a cut inside GPT-OSS's period in test_pieces_count_layers_across_stacks
# and test_the_cut_keeps_moe_statistics_in_model_order.
@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=pytest.mark.slow) if n in ("gemma3", "gpt_oss") else n for n in SPLITS]
)
def test_a_split_policy_gives_the_loss_and_gradients_of_none(name):
    config, top, ranges = SPLITS[name]
    model = zoo.build(config, key=jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (2, 16), 0, config.vocab_size)
    split = remat_policy(load_preset(top, ranges=ranges), config)
    assert isinstance(split, zoo.model.RangedPolicy) and len(split.segments) >= 2

    def both(m):
        return [
            jax.value_and_grad(lambda mm, rp=rp: zoo.loss_fn(mm, tokens, remat_policy=rp))(
                jax.lax.optimization_barrier(m)
            )
            for rp in (None, split)
        ]

    (loss0, grads0), (loss, grads) = jax.jit(both).lower(model).compile({"xla_backend_optimization_level": 0})(model)
    np.testing.assert_allclose(float(loss), float(loss0), rtol=1e-6)
    # The gradients land in the model's own stacked parameters, every layer of every stack.
    assert jax.tree.structure(grads) == jax.tree.structure(model)
    for g, g0 in zip(jax.tree.leaves(grads), jax.tree.leaves(grads0)):
        assert g.shape == g0.shape
        scale = float(jnp.max(jnp.abs(g0))) or 1.0
        assert float(jnp.max(jnp.abs(g - g0))) <= 4e-6 * scale
    # Not trivially equal: each stack's gradient is non-zero in every layer.
    for stack in grads.stacks:
        q = stack.layers[0].attn_norm.weight
        assert bool(jnp.all(jnp.abs(q).reshape(q.shape[0], -1).max(axis=1) > 0))


def test_the_cut_keeps_moe_statistics_in_model_order():
    from zoo.model import run_layers

    model = zoo.build(GPT_OSS, key=jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (2, 16), 0, GPT_OSS.vocab_size)
    _, aux0 = jax.jit(lambda m, t: run_layers(m, t))(model, tokens)
    segments = [(0, 1, None), (1, 3, None), (3, 4, None)]
    _, aux = jax.jit(lambda m, t: run_layers(m, t, segments=segments))(model, tokens)
    assert aux.tokens_per_expert.shape[0] == 4
    np.testing.assert_array_equal(np.asarray(aux.tokens_per_expert), np.asarray(aux0.tokens_per_expert))
    # Layers differ in their routing: a permuted order would not pass.
    assert not np.array_equal(np.asarray(aux0.tokens_per_expert[0]), np.asarray(aux0.tokens_per_expert[1]))


def test_pieces_count_layers_across_stacks():
    model = zoo.abstract(GEMMA3)
    names = scan_names(model, load_preset("full", ranges={"1": "none", "3": "none"}))
    assert names == ["dense_layers_0_2[0-0]", "dense_layers_0_2[1-1]", "dense_layers_0_2[2-2]", "dense_layers_3_3"]
    pieces = model.stacks[0].cut(1, 3)
    assert [(p.first, p.num_layers) for p in pieces] == [(1, 2)]
    gpt = zoo.abstract(GPT_OSS).stacks[0]  # period 2: layers (0, 1) and (2, 3) are its two scan steps
    assert [(p.first, p.period, p.repeats) for p in gpt.cut(1, 4)] == [(1, 1, 1), (2, 2, 1)]
    assert [(p.first, p.period, p.repeats) for p in gpt.cut(1, 3)] == [(1, 1, 1), (2, 1, 1)]
    assert gpt.cut(0, 4) == [gpt]


# --- what the program keeps on host, per scan -----------------------------------------------------------


def _forward_scans(fn, *args):
    """(scan length, per-layer outputs on host) of each forward scan of the traced program, in order:
    the residuals that scan saves for the backward pass, read straight from the jaxpr."""
    scans = []

    def visit(eqn):
        if eqn.primitive.name == "scan" and not eqn.params["reverse"] and _names_in(eqn.params["jaxpr"].jaxpr):
            scans.append(eqn)

    _walk(jax.make_jaxpr(fn)(*args).jaxpr, visit)
    out = []
    for eqn in scans:
        records, other, _ = _analyse_forward_scan(eqn, "")
        host = sorted(r.tag for r in records if r.placement in ("host", "host+device"))
        out.append((int(eqn.params["length"]), host, [o for o in other if o.memory == "host"]))
    return out


@pytest.mark.parametrize(
    "config, top, ranges, expected",
    [
        # Llama, 4 layers: the middle two offload Q/K/V and the layer input, the others none.
        (LLAMA4, "full", {"1-2": "llama_qkv_offload"},
         [(1, []), (2, ["decoder_layer_input", "key_proj", "query_proj", "value_proj"]), (1, [])]),
        # DeepSeek-V3: layers 0-1 (the dense stack and the first MoE layer) offload Q/K/V; layer 2 keeps all.
        (DSV3, "none", {"0-1": "qkv_proj_offloaded"},
         [(1, ["key_proj", "query_proj", "value_proj"]), (1, ["key_proj", "query_proj", "value_proj"]), (1, [])]),
        # The same preset at the top level, a range with none: host residuals everywhere but layer 2.
        (DSV3, "qkv_proj_offloaded", {"2": "none"},
         [(1, ["key_proj", "query_proj", "value_proj"]), (1, ["key_proj", "query_proj", "value_proj"]), (1, [])]),
    ],
)  # fmt: skip
def test_host_residuals_only_in_the_ranges_asked_for(config, top, ranges, expected):
    policy = load_preset(top, ranges=ranges)
    rp = remat_policy(policy, config)
    tokens = jax.ShapeDtypeStruct((2, 16), jnp.int32)
    found = _forward_scans(jax.grad(lambda m, t: zoo.loss_fn(m, t, remat_policy=rp)), zoo.abstract(config), tokens)
    assert [(n, host) for n, host, _ in found] == expected
    assert all(not other for _, _, other in found)  # nothing untagged went to host


def test_the_inspector_reports_placement_per_range():
    """Each scan's tags against its own range's policy: none of the `none` range's tags counts as
    recomputed although the other ranges' backward scans recompute the same tags."""
    from zoo.offload import expected_placement, placement_matches

    policy = load_preset("full", ranges={"0": "qkv_proj_offloaded", "2": "none"})
    config = DSV3
    rp = remat_policy(policy, config)
    names = scan_names(zoo.abstract(config), policy)
    assert names == ["dense_layers", "moe_layers[1-1]", "moe_layers[2-2]"]
    placement = inspect_placement(
        jax.grad(lambda m, t: zoo.loss_fn(m, t, remat_policy=rp)),
        zoo.abstract(config),
        jax.ShapeDtypeStruct((2, 16), jnp.int32),
        stacks=names,
    )
    scans = dict(scan_policies(policy, zoo.abstract(config)))
    for r in placement.records:
        assert placement_matches(expected_placement(scans[r.stack].config, config)[r.tag], r.placement), (
            r.stack,
            r.tag,
            r.placement,
        )
    c = type("C", (), {"offload": policy, "model": config})
    sections = range_sections(c, placement, scans)
    assert [(s["layers"], s["source"], s["preset"]) for s in sections] == [
        ("0-0", "offload.ranges.0", "qkv_proj_offloaded"),
        ("1-1", "offload", "full"),
        ("2-2", "offload.ranges.2", "none"),
    ]
    assert sections[0]["host"] == ["key_proj", "query_proj", "value_proj"]
    assert sections[1]["host"] == [] and "query_proj" in sections[1]["recomputed"]
    assert sections[2]["host"] == [] and sections[2]["recomputed"] == [] and "value_proj" in sections[2]["device"]


def test_the_planner_counts_each_range_with_its_own_policy():
    """Layers 1-2 of a 6-layer model (two stacks: 0-1, 2-5) offload the layer input and query_proj
    (llama_qkv_offload); the search assigns the other four layers. The estimate adds both parts."""
    from zoo.plan.cost import evaluate, free_layers
    from zoo.plan.policies import with_ranges
    from zoo.plan.problem import Problem, StackCost, TagCost

    tags = [
        TagCost("decoder_layer_input", {"a": 100.0, "b": 100.0}, {}, ("device", "offload")),
        TagCost("query_proj", {"a": 50.0, "b": 60.0}, {"a": 1e9, "b": 2e9}),
    ]
    stacks = {
        "a": StackCost(layers=2, forward_flops_per_layer=1e10, layer_range="0-1"),
        "b": StackCost(layers=4, forward_flops_per_layer=1e10, layer_range="2-5"),
    }
    p = Problem(tags=tags, stacks=stacks, rate=1e12, link=1e9, budget=1e12, step_flops=1e12, latency=0.0)
    llama6 = SIZES["llama_tiny_a"].replace(num_layers=6)
    ranged = with_ranges(p, load_preset("full", ranges={"1-2": "llama_qkv_offload"}), llama6)
    (f,) = ranged.fixed
    assert f.layers == {"a": 1, "b": 1} and f.assignment == {"decoder_layer_input": "offload", "query_proj": "offload"}
    assert free_layers(ranged) == {"a": 1, "b": 3}
    e = evaluate(ranged, {"decoder_layer_input": "device", "query_proj": "remat"})
    assert e.device_tag_bytes == 100 * 1 + 100 * 3  # the free layers' inputs
    assert e.host_tag_bytes == (100 + 50) * 1 + (100 + 60) * 1  # the range's layers
    assert e.recompute_s == pytest.approx((1e9 * 1 + 2e9 * 3) / 1e12)  # query_proj of the free layers only
    # A range over every layer: the estimate of its preset's assignment, whatever the free one.
    whole = with_ranges(p, load_preset("none", ranges={"0-5": "llama_qkv_offload"}), llama6)
    assert free_layers(whole) == {"a": 0, "b": 0}
    got = evaluate(whole, {"decoder_layer_input": "device", "query_proj": "device"}).as_dict()
    want = evaluate(p, {"decoder_layer_input": "offload", "query_proj": "offload"}).as_dict()
    assert {k: v for k, v in got.items() if k != "assignment"} == pytest.approx(
        {k: v for k, v in want.items() if k != "assignment"}
    )


def test_the_planner_counts_the_copies_of_the_stacks_a_range_cuts():
    """A range boundary strictly inside a stack costs RANGE_CUT_COPIES of that stack's parameters in
    the backward phase (slices and joined gradients); a boundary on a stack's edge costs nothing."""
    from zoo.plan.cost import RANGE_CUT_COPIES, cut_bytes, evaluate
    from zoo.plan.policies import with_ranges
    from zoo.plan.problem import Problem, StackCost, TagCost

    tags = [TagCost("query_proj", {"a": 50.0, "b": 60.0}, {"a": 1e9, "b": 2e9})]
    stacks = {
        "a": StackCost(layers=2, forward_flops_per_layer=1e10, param_bytes_per_layer=1000.0, layer_range="0-1"),
        "b": StackCost(layers=4, forward_flops_per_layer=1e10, param_bytes_per_layer=3000.0, layer_range="2-5"),
    }
    p = Problem(
        tags=tags,
        stacks=stacks,
        rate=1e12,
        link=1e9,
        budget=1e12,
        step_flops=1e12,
        latency=0.0,
        param_bytes=14000.0,
        grad_bytes=14000.0,
    )
    assert cut_bytes(p, [2]) == 0.0 and cut_bytes(p, [1]) == 2000.0 and cut_bytes(p, [3, 4]) == 12000.0
    llama6 = SIZES["llama_tiny_a"].replace(num_layers=6)
    base = evaluate(p, {"query_proj": "remat"}).backward_phase_bytes
    on_edge = with_ranges(p, load_preset("full", ranges={"0-1": "full"}), llama6)
    inside = with_ranges(p, load_preset("full", ranges={"1-2": "full"}), llama6)
    assert evaluate(on_edge, {"query_proj": "remat"}).backward_phase_bytes == base
    assert evaluate(inside, {"query_proj": "remat"}).backward_phase_bytes == base + RANGE_CUT_COPIES * (
        2000.0 + 12000.0
    )


@pytest.mark.slow  # five compiles of a ~100M-parameter gradient: ~60 s on the 2-core machine
def test_the_planners_range_estimates_follow_the_compiled_memory():
    """llama_100m (8 layers, vocab 1024), batch 2 x 256, on one CPU device: the planner's
    backward-phase bytes under each policy, less under `full`, against the compiled gradient's temp
    memory less under `full` (XLA:CPU, optimisation level 0). The ranged policies' difference is
    mostly the copies of the cut stack (`RANGE_CUT_COPIES`); without them the planner would say 46 MB
    where the program takes 231 MB. Prints the table docs/offload.md quotes."""
    from zoo.plan.cost import evaluate
    from zoo.plan.options import PlanConfig
    from zoo.plan.policies import preset_assignment
    from zoo.plan.traced import problem_from_config
    from zoo.tools.kit import prepare_step
    from zoo.offload import conf_dir

    base = ["model=llama_100m", "model.vocab_size=1024", "mesh=single", "data.batch_size=2", "data.seq_len=256"]
    cases = {
        "full": ["offload=full"],
        "minimal": ["offload=minimal"],
        "full, layers 0-3 minimal": ["offload=full", "+offload.ranges={0-3:minimal}"],
        "minimal, layers 4-7 full": ["offload=minimal", "+offload.ranges={4-7:full}"],
        "full, layers 0-3 full": ["offload=full", "+offload.ranges={0-3:full}"],
    }
    planned, compiled = {}, {}
    for name, extra in cases.items():
        c, _, _, trainer, _ = prepare_step(base + extra)
        p, _ = problem_from_config(
            c, trainer, PlanConfig(link="pcie_gen5", hbm_budget_gb=80.0), conf_dir() / "hardware"
        )
        planned[name] = evaluate(p, preset_assignment(p, c.offload, c.model)).backward_phase_bytes
        rp = remat_policy(c.offload, c.model)
        grad = jax.jit(jax.grad(lambda m, t, rp=rp: zoo.loss_fn(m, t, remat_policy=rp)))
        lowered = grad.lower(zoo.abstract(c.model), jax.ShapeDtypeStruct((2, 256), jnp.int32))
        compiled[name] = lowered.compile({"xla_backend_optimization_level": 0}).memory_analysis().temp_size_in_bytes
    print(f"{'policy':26s} {'planner':>9s} {'compiled':>9s}  (MB more than under full)")
    for name in cases:
        dp, dc = (planned[name] - planned["full"]) / 1e6, (compiled[name] - compiled["full"]) / 1e6
        print(f"{name:26s} {dp:9.2f} {dc:9.2f}")
        if name != "full":
            assert dp == pytest.approx(dc, rel=0.25), (name, dp, dc)


@in_process.MARK
def test_the_planner_plans_the_layers_outside_the_ranges(tmp_path, request, capfd, monkeypatch):
    if not in_process.INNER:
        return in_process.outcome(request)
    args = [
        "model=llama_tiny_a",
        "mesh=single",
        "data.batch_size=2",
        "data.seq_len=16",
        "hardware=h100_pcie",
        f"plan.out={tmp_path / 'offload' / 'p.yaml'}",
    ]
    plan = [sys.executable, "-m", "zoo.tools.plan", *args]
    p = in_process.run([*plan, "+offload.ranges={0:llama_qkv_offload}"], tmp_path, capfd, monkeypatch)
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.splitlines()[0] == (
        "note: offload.ranges: layers 0 llama_qkv_offload (1 layer) counted as given; the plan is the policy of the "
        "other 1 layer "
        "(the YAML it writes; the commands below keep the ranges)"
    )
    # layer 0's q/k/v and input on host (one layer of them coming back in flight), layer 1's kept
    assert "tags on device 73.728 kB (and 24.576 kB in flight), on host 24.576 kB" in p.stdout
    assert "+offload.ranges={0:llama_qkv_offload}" in p.stdout.splitlines()[-2]  # the train command
    # plan.split=true (its search and its lines: tests/test_plan_split.py) places every layer itself.
    p = in_process.run([*plan, "plan.split=true", "+offload.ranges={0:full}"], tmp_path, capfd, monkeypatch)
    assert p.returncode == 2 and p.stderr.strip().splitlines() == [
        "error: plan.split: it searches the ranges itself; drop offload.ranges or plan.split=true"
    ]


def test_the_planner_finds_the_split_point_that_beats_one_policy():
    """Six uniform layers, HBM for three layers' tag: keeping it everywhere does not fit, recomputing
    it everywhere costs six recomputes, offloading it is slow (a slow link); the best split keeps it
    in three layers and recomputes it in the other three."""
    from zoo.plan.problem import Problem, StackCost, TagCost
    from zoo.plan.search import search
    from zoo.plan.split import search_split

    p = Problem(
        tags=[TagCost("query_proj", {"a": 100.0}, {"a": 1e9})],
        stacks={"a": StackCost(layers=6, forward_flops_per_layer=1e10, layer_range="0-5")},
        rate=1e12, link=1e3, budget=350.0, step_flops=1e9, latency=0.0,
    )  # fmt: skip
    presets = {
        "keep": {"query_proj": "device"},
        "recompute": {"query_proj": "remat"},
        "offload": {"query_proj": "offload"},
    }
    whole = search(p)  # one assignment for every layer
    assert whole.assignment == {"query_proj": "remat"} and whole.recompute_s == pytest.approx(6e-3)
    split = search_split(p, presets, 6)
    assert split.at == 3 and {split.head, split.tail} == {"keep", "recompute"}
    assert split.estimate.recompute_s == pytest.approx(3e-3) and split.estimate.device_tag_bytes == 300.0
    assert split.estimate.time_s < whole.time_s
    # With HBM for no layer's tag, no split keeps it anywhere: keeping it in one layer recomputes it in
    # five; offloading it instead would hold one layer of it in flight, which does not fit either.
    tight = search_split(p.__class__(**{**p.__dict__, "budget": 150.0}), presets, 6)
    assert (tight.at, tight.head, tight.tail, tight.estimate.device_tag_bytes) == (1, "keep", "recompute", 100.0)
    assert search_split(p.__class__(**{**p.__dict__, "budget": 50.0}), presets, 6) is None
