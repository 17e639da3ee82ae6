"""LoRA (zoo.lora): an adapted model with B = 0 is its base, only the adapters get gradients and they
match a plain-JAX W + (alpha/r) A @ B reference, training lowers the loss, and bad adapters are refused."""

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from zoo import lora
from zoo import model as zoo_model
from zoo.families import SIZES
from zoo.train.run_config import ConfigError

TOKENS = jax.random.randint(jax.random.key(1), (2, 16), 0, 64)


@pytest.fixture(scope="module")
def llama():
    c = SIZES["llama_tiny_a"]
    return zoo_model.build(c, key=jax.random.key(0))


def cfg(**kw):
    return lora.LoraConfig(**{"rank": 4, "alpha": 8.0, "targets": ["wq", "wv", "wo", "w_up"], **kw})


def tokens_for(model):
    return TOKENS % model.config.vocab_size


def test_zero_b_is_the_base_model(llama):
    c = cfg()
    adapters = lora.init(llama, c, key=jax.random.key(2))
    assert lora.count(adapters) > 0
    toks = tokens_for(llama)
    loss = jax.jit(zoo_model.loss_fn)
    assert float(loss(lora.attach(llama, adapters, c), toks)) == float(loss(llama, toks))


def _reference_model(model, adapters, c):
    """The adapted weights built by hand, outside the scan: W + (alpha/r) A @ B per layer."""
    for s, per_pos in enumerate(adapters):
        for j, sites in enumerate(per_pos):
            for key, ab in sites.items():
                path = key.split(".")

                def where(m, path=path, s=s, j=j):
                    x = m.stacks[s].layers[j]
                    for p in path:
                        x = getattr(x, p)
                    return x

                w = where(model)
                delta = jnp.einsum("lir,lro->lio", ab["a"], ab["b"])
                model = eqx.tree_at(where, model, w + c.scale * delta.reshape(w.shape))
    return model


def test_gradients_only_for_adapters_and_match_reference(llama):
    c = cfg()
    adapters = lora.init(llama, c, key=jax.random.key(2))
    # Non-zero B so that the A gradients are non-zero too.
    adapters = jax.tree.map(lambda x: x + 0.05 * jax.random.normal(jax.random.key(3), x.shape), adapters)
    toks = tokens_for(llama)
    loss, grads = jax.jit(jax.value_and_grad(lambda ad: zoo_model.loss_fn(lora.attach(llama, ad, c), toks)))(adapters)
    ref_loss, ref_grads = jax.jit(
        jax.value_and_grad(lambda ad: zoo_model.loss_fn(_reference_model(llama, ad, c), toks))
    )(adapters)
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5)
    for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
        assert float(jnp.abs(r).max()) > 0
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-3, atol=1e-6)
    # The frozen base gets no gradient through the adapted model.
    base_grads = jax.jit(jax.grad(lambda m: zoo_model.loss_fn(lora.attach(m, adapters, c), toks)))(llama)
    attn = base_grads.stacks[0].layers[0].attn
    assert float(jnp.abs(attn.wq).max()) == 0.0 and float(jnp.abs(attn.wk).max()) > 0


def test_a_few_steps_lower_the_loss(llama):
    c = cfg()
    adapters = lora.init(llama, c, key=jax.random.key(2))
    tx = optax.adam(1e-2)
    opt = tx.init(adapters)
    toks = tokens_for(llama)

    @jax.jit
    def step(ad, opt):
        loss, g = jax.value_and_grad(lambda ad: zoo_model.loss_fn(lora.attach(llama, ad, c), toks))(ad)
        upd, opt = tx.update(g, opt, ad)
        return optax.apply_updates(ad, upd), opt, loss

    losses = []
    for _ in range(8):
        adapters, opt, loss = step(adapters, opt)
        losses.append(float(loss))
    assert losses[-1] < losses[0] - 0.05, losses
    # Merged weights give the attached model's logits (export / generate with adapters merged).
    attached = lora.attach(llama, adapters, c)
    merged = lora.merge(attached)
    assert not any(
        isinstance(x, lora.LoRAWeight)
        for x in jax.tree.leaves(merged, is_leaf=lambda x: isinstance(x, lora.LoRAWeight))
    )
    np.testing.assert_allclose(np.asarray(merged(toks)), np.asarray(attached(toks)), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "model_name, kw, message",
    [
        ("llama_tiny_a", {"targets": ["wkv_a"]}, "lora.targets: this model has no 'wkv_a' projection"),
        ("dsv3_tiny_a", {"targets": ["wk"]}, "lora.targets: this model has no 'wk' projection"),
        ("llama_tiny_a", {"rank": 100000}, "lora.rank: 100000 exceeds"),
    ],
)
def test_check_refuses(model_name, kw, message):
    abstract = zoo_model.abstract(SIZES[model_name])
    assert lora.check(abstract, cfg(**kw)).startswith(message)


def test_check_accepts_latent_attention():
    abstract = zoo_model.abstract(SIZES["dsv3_tiny_a"])
    assert lora.check(abstract, cfg(targets=["wkv_a", "wo", "w_up"])) is None
    adapters = lora.init_shapes(abstract, cfg(targets=["wkv_a", "wo", "w_up"]))
    assert lora.count(adapters) > 0


def test_adapters_of_another_family_are_refused(llama):
    c = cfg()
    adapters = lora.init(llama, c, key=jax.random.key(2))
    assert lora.check_family(adapters, llama, c, llama.config.family) is None
    # Same shapes, another family: refused by the family the adapters were saved with.
    same_shapes = zoo_model.abstract(SIZES["qwen3_tiny_a"])
    assert lora.check_family(adapters, same_shapes, c, llama.config.family).startswith(
        "lora: the saved adapters were made for"
    )
    other = zoo_model.abstract(SIZES["dsv3_tiny_a"])
    assert lora.check_family(adapters, other, cfg(targets=["wo"])).startswith("lora: the saved adapters do not fit")


@pytest.mark.parametrize(
    "kw, key",
    [
        ({"rank": -1}, "lora.rank"),
        ({"dropout": 1.0}, "lora.dropout"),
        ({"dropout": -0.1}, "lora.dropout"),
        ({"targets": ["q_proj"]}, "lora.targets"),
    ],
)
def test_config_errors(kw, key):
    with pytest.raises(ConfigError, match=f"^{key}:"):
        cfg(**kw)


@pytest.mark.parametrize(
    "fan_in_axes, spec, x_shape, w_shape",
    [(1, "BTD,DKH->BTKH", (2, 5, 12), (12, 3, 4)), (2, "BTNH,NHD->BTD", (2, 5, 3, 4), (3, 4, 12))],
)
def test_dropout_runs_the_adapter_on_a_dropped_input(fan_in_axes, spec, x_shape, w_shape):
    """`project` with dropout: x @ W + s * (mask * x / (1 - p)) @ A @ B, mask ~ Bernoulli(1 - p) from
    the weight's key; without a key, the merged weight; averaged over keys, the merged result."""
    k = iter(jax.random.split(jax.random.key(0), 4))
    x = jax.random.normal(next(k), x_shape)
    fan_in = int(np.prod(w_shape[:fan_in_axes]))
    fan_out = int(np.prod(w_shape[fan_in_axes:]))
    base, a, b = (jax.random.normal(next(k), s) for s in (w_shape, (fan_in, 3), (3, fan_out)))
    p, scale = 0.3, 2.0
    keyed = lora.LoRAWeight(base, a, b, jax.random.key(7), scale, fan_in_axes, p)
    rows = x.reshape(*x.shape[: x.ndim - fan_in_axes], fan_in)
    mask = jax.random.bernoulli(jax.random.key(7), 1 - p, rows.shape)
    want = jnp.einsum(spec, x, base) + (scale * (jnp.where(mask, rows / (1 - p), 0) @ a @ b)).reshape(
        jnp.einsum(spec, x, base).shape
    )
    np.testing.assert_allclose(lora.project(spec, x, keyed, jnp.float32), want, rtol=1e-5, atol=1e-5)
    merged = jnp.einsum(spec, x, base + scale * (a @ b).reshape(w_shape))
    unkeyed = lora.LoRAWeight(base, a, b, None, scale, fan_in_axes, p)
    np.testing.assert_allclose(lora.project(spec, x, unkeyed, jnp.float32), merged, rtol=1e-5, atol=1e-5)
    # Inverted dropout is unbiased: the mean over masks is the merged projection.
    mean = jax.vmap(lambda kk: lora.project(spec, x, eqx.tree_at(lambda w: w.key, keyed, kk), jnp.float32))(
        jax.random.split(jax.random.key(8), 4000)
    ).mean(0)
    assert float(jnp.abs(mean - merged).max()) < 0.05 * float(jnp.abs(merged).max())


# ~34 s: every adaptable projection of DeepSeek-V3; the definition: test_dropout_runs_the_adapter_on_a_dropped_input
@pytest.mark.slow
def test_dropout_is_on_only_with_a_key_and_otherwise_the_merged_model():
    """DeepSeek-V3's every adaptable projection (latent attention, the dense MLP, the shared experts),
    B != 0: attached with a key and dropout, the loss moves and changes with the key; with a dropout
    too small to drop anything (the unmerged path), it is the merged model's; without a key
    (evaluation, sampling), exactly the merged model's. (Grouped-query attention's projections:
    `test_dropout_runs_the_adapter_on_a_dropped_input` and the slow train.py run.)"""
    model = zoo_model.build(SIZES["dsv3_tiny_a"], key=jax.random.key(0))
    c = cfg(targets=sorted(lora.family_targets(model)), dropout=0.5)
    adapters = jax.tree.map(lambda x: x + 0.05, lora.init(model, c, key=jax.random.key(2)))
    toks = tokens_for(model)

    def loss(config, ad, key=None):
        return zoo_model.loss_fn(lora.attach(model, ad, config, key=key), toks)

    merged = float(jax.jit(lambda ad: zoo_model.loss_fn(lora.merge(lora.attach(model, ad, c)), toks))(adapters))
    assert float(jax.jit(lambda ad: loss(c, ad))(adapters)) == merged
    keyed = jax.jit(lambda ad, k: loss(c, ad, k))
    one, two = (float(keyed(adapters, jax.random.key(k))) for k in (3, 4))
    assert one != merged and two != one
    tiny = dataclasses.replace(c, dropout=1e-9)  # 1 - 1e-9 is 1.0 in float32: every unit kept
    np.testing.assert_allclose(
        float(jax.jit(lambda ad: loss(tiny, ad, jax.random.key(3)))(adapters)), merged, rtol=2e-6
    )
    grads = jax.jit(jax.grad(lambda ad: loss(c, ad, jax.random.key(3))))(adapters)
    assert all(bool(jnp.isfinite(g).all()) and float(jnp.abs(g).max()) > 0 for g in jax.tree.leaves(grads))


@pytest.mark.slow  # two train.py processes: ~100 s on the loaded 2-core machine
def test_train_py_lora_base_on_host_checkpoints_only_adapters_and_resumes(tmp_path):
    """Through train.py (8 simulated devices): a real checkpoint (model=hf) fine-tuned with adapters on
    the shipped text, the frozen base in pinned host memory, dropout on the adapters' inputs and two
    microbatches per step; the loss falls, the checkpoint holds
    only the adapters and their optimizer state, and a second run resumes from it."""
    import json
    import os
    import pathlib
    import subprocess
    import sys

    root = pathlib.Path(__file__).resolve().parents[1]
    args = [
        sys.executable,
        str(root / "train.py"),
        "model=hf",
        f"model.path={root / 'tests/data/llama_tiny_a'}",
        "data=text",
        f"data.path={root / 'zoo/data/corpus/shakespeare'}",
        "lora=default",
        "lora.base_on_host=true",
        "lora.dropout=0.05",
        "data.batch_size=16",
        "data.seq_len=32",
        "trainer.grad_accum=2",
        "optimizer.lr=1e-2",
        "optimizer.warmup_steps=2",
        f"checkpoint.dir={tmp_path / 'ck'}",
    ]

    def run(steps, name):
        p = subprocess.run([*args, f"trainer.steps={steps}", f"hydra.run.dir={tmp_path / name}"], cwd=tmp_path,
                           env=dict(os.environ), capture_output=True, text=True, timeout=600)  # fmt: skip
        assert p.returncode == 0, p.stderr[-3000:]
        return p.stdout, json.loads((tmp_path / name / "summary.json").read_text())

    out, summary = run(6, "a")
    assert (
        "lora: rank 8, alpha 16, dropout 0.05 (adapters unmerged while training) on " in out
        and "frozen base in pinned host memory" in out
    )
    assert summary["memory_kinds"]["base"] == ["pinned_host"] and summary["memory_kinds"]["params"] == ["device"]
    assert summary["last_loss"] < summary["first_loss"] - 0.3, summary
    saved = json.loads((tmp_path / "ck" / "6" / "state" / "_METADATA").read_text())["tree_metadata"]
    tops = {eval(k)[0] for k in saved}  # noqa: S307 - orbax writes tuple reprs of the paths
    assert tops == {"params", "opt_state", "step"}, tops
    params = [eval(k) for k in saved if eval(k)[0] == "params"]  # noqa: S307
    assert params and all(p[-1] in ("a", "b") for p in params)
    out, summary = run(8, "b")
    assert "resuming from step 6" in out and summary["start_step"] == 6 and summary["steps_run"] == 2
    # The same checkpoint.dir without adapters: one line, exit 2, before compiling.
    p = subprocess.run(
        [a for a in args if not a.startswith("lora")] + ["trainer.steps=10", f"hydra.run.dir={tmp_path / 'c'}"],
        cwd=tmp_path,
        env=dict(os.environ),
        capture_output=True,
        text=True,
        timeout=600,
    )
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert p.returncode == 2 and len(lines) == 1, p.stderr[-2000:]
    assert "holds lora.rank=8 lora.targets=[wq,wk,wv,wo,w_gate,w_up,w_down], this run trains no adapters;" in lines[0]


@pytest.mark.slow  # a train.py run, an export and a sampling run: ~60 s on the 2-core machine
def test_a_lora_checkpoint_exports_and_samples_merged(tmp_path):
    """A LoRA checkpoint (adapters only) restores as the merged model: each adapted weight is the
    base checkpoint's plus alpha/r * A @ B of the saved adapters, an untouched weight is the base's;
    zoo.tools.export writes it (transformers' layout, loaded back with the same logits) and zoo.tools.generate
    samples from it. With the base checkpoint gone, one line, exit 2."""
    import json
    import os
    import pathlib
    import shutil
    import subprocess
    import sys

    import numpy as np
    import orbax.checkpoint as ocp

    from zoo.hf import from_pretrained
    from zoo.model import CausalLM
    from zoo.train.checkpoint import restore_model

    root = pathlib.Path(__file__).resolve().parents[1]
    base_dir = tmp_path / "base"
    shutil.copytree(root / "tests/data/llama_tiny_a", base_dir)
    ck = tmp_path / "ck"
    train = [
        sys.executable, str(root / "train.py"), "model=hf", f"model.path={base_dir}", "data=text",
        f"data.path={root / 'zoo/data/corpus/shakespeare'}", "lora=default", "lora.rank=4", "lora.targets=[wq,w_down]",
        "data.batch_size=4", "data.seq_len=32", "optimizer.lr=1e-2", "trainer.steps=3", f"checkpoint.dir={ck}",
        f"hydra.run.dir={tmp_path / 'run'}", "mesh=single", "xla.cpu_devices=1",
    ]  # fmt: skip
    p = subprocess.run(train, cwd=tmp_path, env=dict(os.environ), capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]

    merged, meta = restore_model(ck)
    assert meta["lora"]["rank"] == 4
    raw = ocp.PyTreeCheckpointer().restore(ck / "3" / "state")["params"]
    base = from_pretrained(base_dir)
    scale = meta["lora"]["alpha"] / meta["lora"]["rank"]
    sites = raw[0][0]
    for site, pick in (("attn.wq", lambda b: b.attn.wq), ("ffn.w_down", lambda b: b.ffn.w_down)):
        a, b = np.asarray(sites[site]["a"]), np.asarray(sites[site]["b"])
        assert np.abs(b).max() > 0, "the adapters did not train"
        w0 = np.asarray(pick(base.stacks[0].layers[0]), np.float32)
        want = w0 + (scale * np.matmul(a, b)).reshape(w0.shape)
        np.testing.assert_allclose(np.asarray(pick(merged.stacks[0].layers[0]), np.float32), want, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(
        np.asarray(merged.stacks[0].layers[0].attn.wk), np.asarray(base.stacks[0].layers[0].attn.wk)
    )

    out = tmp_path / "out"
    p = subprocess.run(
        [sys.executable, "-m", "zoo.tools.export", str(ck), str(out)],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    tokens = jnp.arange(16, dtype=jnp.int32)[None] % merged.config.vocab_size
    exported = from_pretrained(out)
    assert isinstance(exported, CausalLM)
    np.testing.assert_allclose(np.asarray(exported(tokens)), np.asarray(merged(tokens)), rtol=1e-5, atol=1e-5)
    assert json.loads((out / "config.json").read_text())["model_type"] == "llama"

    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "zoo.tools.generate",
            f"checkpoint.dir={ck}",
            "prompt=to be",
            "tokenizer=bytes",
            "max_new_tokens=4",
        ],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert p.returncode == 0 and p.stdout.strip(), p.stderr[-3000:]

    shutil.rmtree(base_dir)
    p = subprocess.run(
        [sys.executable, "-m", "zoo.tools.export", str(ck), str(tmp_path / "out2")],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=600,
    )
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert p.returncode == 2 and len(lines) == 1 and "holds LoRA adapters over the base model" in lines[0], p.stderr[
        -2000:
    ]
    assert not (tmp_path / "out2").exists()


def test_the_inspector_counts_the_adapters_and_the_frozen_base_where_it_lives(tmp_path, capsys):
    """zoo.tools.inspect_step of a LoRA run: params are the adapters (their bytes), the frozen base is reported
    with its own bytes and memory kind (pinned_host with lora.base_on_host), and the total counts it."""
    import json
    import re

    from zoo.counts import count_params
    from zoo.tools.inspect_step import main

    args = [
        "model=llama_tiny_a",
        "mesh=single",
        "lora=default",
        "lora.rank=2",
        "lora.base_on_host=true",
        f"inspect.out={tmp_path / 'inspect.json'}",
    ]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert re.search(r"^policy .*; LoRA: params are the adapters, the frozen base in pinned_host$", out, re.M), out
    rep = json.loads((tmp_path / "inspect.json").read_text())
    state = rep["scale"]["state_bytes_per_device"]
    assert (
        state["frozen_base"] == 4 * count_params(SIZES["llama_tiny_a"]) and state["frozen_base_memory"] == "pinned_host"
    )
    assert (
        state["params"] < state["frozen_base"] / 10
        and state["total"] == 2 * state["params"] + state["opt_state"] + state["frozen_base"]
    )
    assert (
        "frozen LoRA base per device: " in out
        and " in pinned_host (no gradient, no optimizer state; in the total)" in out
    )
