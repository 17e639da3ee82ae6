"""Pretrained weights in train.py: Hugging Face checkpoints in (`model=hf`), train.py checkpoints back
out (`zoo.tools.export`), and docs/models.md's fine-tuning walk-through run as written."""

import dataclasses
import hashlib
import json
import math
import os
import pathlib
import re
import shutil
import subprocess
import sys
import time

import in_process
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import this_python

import zoo
from zoo import hf

ROOT = pathlib.Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data"


def compose(overrides):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        return hydra_compose("config", overrides=overrides)


def write_tokenizer(path: pathlib.Path, vocab_size: int) -> pathlib.Path:
    """A BPE tokenizer.json of `vocab_size` ids, trained on a slice of the shipped corpus."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    lines = (ROOT / "zoo" / "data" / "corpus" / "shakespeare").glob("*")
    text = next(iter(sorted(lines))).read_text().splitlines()[:3000]
    tok.train_from_iterator(
        text, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<unk>", "</s>"], show_progress=False)
    )
    assert tok.get_vocab_size() == vocab_size
    tok.save(str(path))
    return path


def fingerprint(d: pathlib.Path) -> dict:
    return {
        str(p.relative_to(d)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.rglob("*")) if p.is_file()
    }


def leaves_by_path(tree) -> dict:
    return {jax.tree_util.keystr(p): x for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


_plain_loss = jax.jit(zoo.loss_fn)


@jax.jit
def _packed_loss(model, batch):
    """The mean next-token loss of a packed text batch, as zoo.loss defines it: attention and
    positions within each document, targets counted by `target_weights`."""
    from zoo.loss import target_weights
    from zoo.model import next_token_loss

    logits = model(batch["tokens"], positions=batch["positions"], segment_ids=batch["segment_ids"])
    return next_token_loss(logits, batch["tokens"], target_weights(batch["loss_mask"], batch["segment_ids"]))


def _loss(model, batch):
    if isinstance(batch, dict):
        return _packed_loss(model, {k: jnp.asarray(v) for k, v in batch.items()})
    return _plain_loss(model, jnp.asarray(batch))


_logits = jax.jit(lambda model, tokens: model(tokens))


# --- model=hf resolves the group from config.json ---------------------------------------------------


def test_hf_option_leaves_every_architecture_field_to_config_json():
    """`model=hf` composes to the path, the runtime fields' values and null for every other ModelConfig
    field (nested ones too), so config.json decides the architecture."""
    from omegaconf import OmegaConf

    from zoo.config import ModelConfig
    from zoo.hf.pretrained import RUNTIME, hf_option

    node = OmegaConf.to_container(compose(["model=hf", "model.path=/some/dir"]).model)
    assert node == {**hf_option(), "path": "/some/dir"}
    assert set(node) == {"path", *(f.name for f in dataclasses.fields(ModelConfig))}
    assert node["rope"] and all(v is None for v in node["rope"].values())
    assert {k: v for k, v in node.items() if v is not None and not isinstance(v, dict)} == {
        "path": "/some/dir",
        **RUNTIME,
    }


def test_model_group_takes_the_architecture_from_config_json_and_runtime_fields_from_the_command_line():
    from zoo.train.run_config import ConfigError, load

    llama, dsv3 = DATA / "llama_tiny_a", DATA / "dsv3_tiny_a"
    c = load(
        compose(
            [
                "model=hf",
                f"model.path={llama}",
                "model.compute_dtype=bfloat16",
                "model.attention_impl=blockwise",
                "model.num_layers=2",
                "model.rope.theta=10000.0",
            ]
        )
    )  # values that agree with config.json are fine
    assert c.model == hf.config_from_hf(json.loads((llama / "config.json").read_text())).replace(
        compute_dtype="bfloat16", attention_impl="blockwise"
    )
    assert (
        c.pretrained.path == str(llama)
        and c.pretrained.model_type == "llama"
        and c.pretrained.weight_files == ["model.safetensors"]
    )
    c = load(
        compose(
            [
                "model=hf",
                f"model.path={dsv3}",
                "model.moe.impl=capacity",
                "model.moe.capacity_factor=2.0",
                "model.param_dtype=bfloat16",
            ]
        )
    )
    assert (c.model.moe.impl, c.model.moe.capacity_factor, c.model.param_dtype) == ("capacity", 2.0, "bfloat16")
    assert (
        load(compose(["model=hf", f"model.path={dsv3}"])).model.moe.impl == "ragged"
    )  # dropless, as the checkpoint was trained
    refused = {
        "model.num_layers=4": rf"^model.num_layers: 4 contradicts {llama}/config.json \(which gives 2\); "
        r"with model.path the architecture comes from the checkpoint: drop model.num_layers "
        r"\(model=hf sets only param_dtype, compute_dtype, attention_impl, moe.impl, moe.capacity_factor\)$",
        "model.rope.theta=5.0": r"^model.rope.theta: 5.0 contradicts .*config.json \(which gives 10000.0\)",
        "model.mla.kv_lora_rank=8": (
            r"^model.mla.kv_lora_rank: 8 contradicts .*config.json \(the checkpoint's model has no mla section\)"
        ),
        "model.moe.impl=capacity": (
            rf"^model.moe.impl: {llama}/config.json describes a dense llama model \(no experts\); drop "
            r"model.moe.impl$"
        ),
        "+model.hidden=3": r"^model.hidden: unknown key; known keys here: attention_bias, ",
    }
    for override, message in refused.items():
        with pytest.raises(ConfigError, match=message):
            load(compose(["model=hf", f"model.path={llama}", override]))
    with pytest.raises(
        ConfigError, match=r"^model.path: missing; give the Hugging Face checkpoint directory, e.g. model.path="
    ):
        load(compose(["model=hf"]))


def test_data_tokenizer_defaults_to_the_checkpoints_own_and_must_agree_with_it(tmp_path):
    from zoo.train.run_config import ConfigError, load

    ckpt = tmp_path / "hf"
    shutil.copytree(DATA / "llama_tiny_a", ckpt, ignore=shutil.ignore_patterns("*.npy", "*.npz", "*.json"))
    shutil.copy(DATA / "llama_tiny_a" / "config.json", ckpt)
    write_tokenizer(ckpt / "tokenizer.json", 200)
    c = load(compose(["model=hf", f"model.path={ckpt}", "data=text"]))
    assert c.data.tokenizer == str(ckpt) and "tokenizer.json" in c.pretrained.files
    assert load(
        compose(["model=hf", f"model.path={ckpt}", f"data.tokenizer={ckpt / 'tokenizer.json'}", "data=text"])
    ).data.tokenizer
    other = write_tokenizer(tmp_path / "other.json", 180)
    with pytest.raises(
        ConfigError,
        match=rf"^data.tokenizer: {other} disagrees with the checkpoint's vocabulary \({ckpt}/tokenizer.json\): "
        r"\d+ tokens are missing or have other ids; leave data.tokenizer null to use the checkpoint's own",
    ):
        load(compose(["model=hf", f"model.path={ckpt}", "data=text", f"data.tokenizer={other}"]))
    assert load(compose(["model=hf", f"model.path={ckpt}"])).data.tokenizer is None  # synthetic data needs none


# --- sharded loading, straight into the mesh ---------------------------------------------------------


@pytest.fixture(scope="module")
def dsv3_sharded(tmp_path_factory):
    """The DeepSeek-V3 fixture re-saved as 64 KB shards with an index, plus a tokenizer and generation config."""
    d = tmp_path_factory.mktemp("dsv3") / "hf"
    model = hf.from_pretrained(DATA / "dsv3_tiny_a")
    hf.save_pretrained(model, d, max_shard_bytes=64 * 1024)
    write_tokenizer(d / "tokenizer.json", 200)
    (d / "generation_config.json").write_text(json.dumps({"bos_token_id": 0, "eos_token_id": 1}))
    assert (d / "model.safetensors.index.json").exists() and len(list(d.glob("*.safetensors"))) > 5
    return d, model


def test_sharded_checkpoint_loads_slice_by_slice_into_8_devices_then_exports(dsv3_sharded, monkeypatch, tmp_path):
    from zoo import sharding as zs
    from zoo.train.hf_export import hf_export
    from zoo.hf import weights
    from zoo.train.checkpoint import Checkpoints
    from zoo.train.batches import make_data
    from zoo.train.run import prepare
    from zoo.train.step import Trainer

    d, reference = dsv3_sharded
    reads = []
    read = weights.LeafSource.read

    def spy(self, index=None):
        out = read(self, index)
        reads.append((self.path, out.shape))
        return out

    monkeypatch.setattr(weights.LeafSource, "read", spy)
    c, plan, devices, _ = prepare(
        compose(
            [
                "model=hf",
                f"model.path={d}",
                "mesh=fsdp",
                "data=text",
                "data.batch_size=8",
                "data.seq_len=16",
                f"checkpoint.dir={tmp_path / 'ckpt'}",
            ]
        )
    )
    assert plan.num_devices == 8 and plan.mesh.sizes["fsdp"] == 8
    trainer = Trainer(c, plan, devices)
    state = trainer.init()

    def dotted(tree) -> dict:  # leaves by attribute path, as the loader names them
        return {weights._path_name(p): x for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}

    params = dotted(state["params"])
    shardings = dict(
        zip(params, jax.tree.leaves(trainer.param_shardings, is_leaf=lambda x: isinstance(x, jax.sharding.Sharding)))
    )
    shard_shapes_read = {}
    for path, shape in reads:
        shard_shapes_read.setdefault(path, set()).add(shape)
    assert sorted(shard_shapes_read) == sorted(params)
    expected = dotted(reference)
    split = 0
    for path, x in params.items():
        sharding = shardings[path]
        assert x.sharding == sharding, path
        shard_shape = sharding.shard_shape(x.shape)
        ways = math.prod(x.shape) // math.prod(shard_shape)
        assert {s.data.shape for s in x.addressable_shards} == {shard_shape}, path
        assert {s.data.nbytes for s in x.addressable_shards} == {x.nbytes // ways}, path
        # What the loader read for this leaf: device-sized slices only, never the whole leaf when it is split.
        assert shard_shapes_read[path] == {shard_shape}, path
        split += ways > 1
        np.testing.assert_array_equal(np.asarray(x), np.asarray(expected[path]), err_msg=path)
    assert split >= len(params) // 2, f"only {split} of {len(params)} leaves are split over the 8 devices"
    opt_shardings = jax.tree.leaves(trainer.opt_shardings, is_leaf=lambda x: isinstance(x, jax.sharding.Sharding))
    assert [
        x.sharding for x in jax.tree.leaves(state["opt_state"])
    ] == opt_shardings  # the optimizer state, sharded as init makes it

    # Step 0's loss in train.py's loss function (chunked head, experts routed per device over 8 devices)
    # is from_pretrained's up to float32 summation order (measured 2.4e-7 relative).
    batch = make_data(c).batch(0)
    with zs.activate(trainer.mesh, trainer.rules):
        first = lambda t: jax.tree.map(lambda x: x[0], t)  # noqa: E731 - microbatch 0 of every field
        loss = jax.jit(lambda p, t: trainer.loss_and_aux(p, first(t))[0])(state["params"], trainer.shard_tokens(batch))
    assert abs(float(loss) - float(_loss(reference, batch))) < 1e-5

    # The run's checkpoint records the source; exporting it carries the tokenizer and generation files.
    ckpt = Checkpoints(c, plan, trainer)
    ckpt.save(1, state)
    ckpt.close()
    meta = json.loads((tmp_path / "ckpt" / "1" / "meta" / "metadata").read_text())
    assert meta["pretrained"]["path"] == str(d) and meta["pretrained"]["model_type"] == "deepseek_v3"
    assert sorted(meta["pretrained"]["files"]) == ["generation_config.json", "tokenizer.json"]
    done = hf_export(tmp_path / "ckpt", tmp_path / "out", dtype="bfloat16")
    assert done["files"] == ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json"]
    assert (tmp_path / "out" / "tokenizer.json").read_bytes() == (d / "tokenizer.json").read_bytes()
    back = hf.from_pretrained(tmp_path / "out")
    for path, x in dotted(back).items():
        np.testing.assert_array_equal(
            np.asarray(x), np.asarray(expected[path]).astype(jnp.bfloat16).astype(np.float32), err_msg=path
        )


def test_pinned_host_parameters_load_into_host_memory(tmp_path):
    from zoo.sharding import memory_kinds
    from zoo.train.run import prepare
    from zoo.train.step import Trainer

    c, plan, devices, _ = prepare(
        compose(
            [
                "model=hf",
                f"model.path={DATA / 'llama_tiny_a'}",
                "mesh=fsdp",
                "mesh.devices=2",
                "offload.params=pinned_host",
                "offload.opt_state=pinned_host",
                "data.batch_size=2",
            ]
        )
    )
    state = Trainer(c, plan, devices).init()
    assert memory_kinds(state["params"]) == {"pinned_host"} and memory_kinds(state["opt_state"]) == {"pinned_host"}
    reference = leaves_by_path(hf.from_pretrained(DATA / "llama_tiny_a"))
    for path, x in leaves_by_path(state["params"]).items():
        np.testing.assert_array_equal(np.asarray(x), np.asarray(reference[path]), err_msg=path)


# --- a train.py checkpoint back out ---------------------------------------------------------------------


def saved_checkpoint(overrides: list, seed: int, step: int):
    """(config, state) of a freshly initialised train.py run of `overrides`, saved as `step` in its checkpoint.dir."""
    from zoo.train.checkpoint import Checkpoints
    from zoo.train.run import prepare
    from zoo.train.step import Trainer

    c, plan, devices, _ = prepare(compose(overrides))
    trainer = Trainer(c, plan, devices)
    state = trainer.init(seed=seed)
    ckpt = Checkpoints(c, plan, trainer)
    ckpt.save(step, state)
    ckpt.close()
    return c, state


def test_restore_model_reads_the_parameters_train_py_saved(tmp_path):
    from zoo.train.checkpoint import restore_model
    from zoo.train.run_config import ConfigError

    c, state = saved_checkpoint(
        [
            "model=llama_tiny_a",
            "mesh=fsdp_tp",
            "mesh.devices=4",
            "mesh.tensor=2",
            "data.batch_size=4",
            "data.seq_len=16",
            f"checkpoint.dir={tmp_path / 'ckpt'}",
        ],
        seed=3,
        step=5,
    )

    model, meta = restore_model(tmp_path / "ckpt")
    assert meta["step"] == 5 and meta["model"]["family"] == "llama"
    assert model.config == c.model
    saved = jax.tree_util.tree_flatten_with_path(state["params"])[0]
    got = jax.tree_util.tree_flatten_with_path(model)[0]
    assert [jax.tree_util.keystr(p) for p, _ in saved] == [jax.tree_util.keystr(p) for p, _ in got]
    for (path, a), (_, b) in zip(saved, got):
        assert len(b.sharding.device_set) == 1, jax.tree_util.keystr(path)  # whole, on the default device
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=jax.tree_util.keystr(path))
    with pytest.raises(ConfigError, match=r"no complete checkpoint of step 4; it holds steps 5"):
        restore_model(tmp_path / "ckpt", step=4)
    with pytest.raises(ConfigError, match=r"does not exist; give the checkpoint.dir of a train.py run"):
        restore_model(tmp_path / "elsewhere")


def test_restore_onto_8_devices_and_export_leaf_by_leaf(tmp_path):
    """restore_model(devices=...) reads every leaf straight into slices over the 8 simulated devices (no
    leaf whole on one when a dimension divides by 8); hf_export, which restores that way, writes the bytes
    the single-device export writes; and writing holds about one leaf on the host, not the model."""
    import tracemalloc

    from zoo.train.hf_export import hf_export
    from zoo.train.checkpoint import restore_model

    c, state = saved_checkpoint(
        [
            "model=dsv3_tiny_a",
            "mesh=fsdp",
            "mesh.devices=2",
            "data.batch_size=2",
            "data.seq_len=16",
            f"checkpoint.dir={tmp_path / 'ckpt'}",
        ],
        seed=4,
        step=2,
    )

    assert len(jax.devices()) == 8
    whole, _ = restore_model(tmp_path / "ckpt")
    spread, _ = restore_model(tmp_path / "ckpt", devices=jax.devices())
    saved = leaves_by_path(state["params"])
    split = 0
    for path, x in leaves_by_path(spread).items():
        np.testing.assert_array_equal(np.asarray(x), np.asarray(saved[path]), err_msg=path)
        assert len(x.sharding.device_set) == 8, path
        if any(n % 8 == 0 for n in x.shape):
            assert {s.data.nbytes for s in x.addressable_shards} == {x.nbytes // 8}, path  # an eighth on each device
            split += 1
    assert split >= len(saved) - 4, f"only {split} of {len(saved)} leaves are split"  # all but a few tiny vectors

    hf_export(tmp_path / "ckpt", tmp_path / "spread", dtype="bfloat16", max_shard_bytes=96 * 1024)
    hf.save_pretrained(whole, tmp_path / "whole", dtype="bfloat16", max_shard_bytes=96 * 1024)
    files = sorted(p.name for p in (tmp_path / "whole").iterdir())
    assert sorted(p.name for p in (tmp_path / "spread").iterdir()) == files and len(files) > 3
    for name in files:
        assert (tmp_path / "spread" / name).read_bytes() == (tmp_path / "whole" / name).read_bytes(), name

    # Host memory while writing: about the largest leaf (and its converted copy), far from the model.
    leaf_bytes = [x.nbytes for x in jax.tree.leaves(spread)]
    tracemalloc.start()
    hf.save_pretrained(spread, tmp_path / "traced")
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 3 * max(leaf_bytes) < sum(leaf_bytes), (peak, max(leaf_bytes), sum(leaf_bytes))


# --- docs/models.md's walk-through, as written ------------------------------------------------------------------


def readme_section(title: str) -> str:
    text = (ROOT / "docs" / "models.md").read_text()
    start = text.index(f"## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end != -1 else None]


def clean_env():
    env = dict(os.environ)  # conftest.py's XLA_FLAGS: 8 simulated CPU devices
    env.pop("ZOO_TRACEBACK", None)
    return env


def workdir(tmp_path: pathlib.Path) -> pathlib.Path:
    """A directory that looks like the repository's root to the README's commands."""
    d = tmp_path / "repo"
    d.mkdir()
    for name in ("train.py", "conf", "zoo", "tests"):
        (d / name).symlink_to(ROOT / name)
    return d


@pytest.fixture(scope="module")
def walkthrough(tmp_path_factory):
    """Runs the bash block of docs/models.md's "Fine-tuning a Hugging Face model" section as written."""
    section = readme_section("Fine-tuning a Hugging Face model")
    blocks = re.findall(r"```bash\n(.*?)```", section, re.S)
    assert blocks, "the docs/models.md section has no bash block"
    d = workdir(tmp_path_factory.mktemp("walkthrough"))
    env = {k: v for k, v in clean_env().items() if k != "XLA_FLAGS"}  # a default CPU (one device), as the README says
    env["PYTHONUNBUFFERED"] = "1"  # stdout and stderr in the order a terminal shows them
    env = this_python.on_path(env, d / ".bin")  # the block's `python`: this interpreter, venv and all
    t0 = time.perf_counter()
    p = subprocess.run(
        ["bash", "-e", "-c", blocks[0]],
        cwd=d,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        errors="replace",
        timeout=900,
    )
    assert p.returncode == 0, p.stdout[-5000:]
    return d, p, time.perf_counter() - t0


def test_readme_walkthrough_fine_tunes_from_the_step_0_loss_from_pretrained_gives_and_exports(walkthrough, monkeypatch):
    from zoo.train.checkpoint import Checkpoints, restore_model
    from zoo.train.run_config import load, validate
    from zoo.train.batches import make_data
    from zoo.train.step import Trainer

    d, p, _ = walkthrough
    monkeypatch.chdir(d)  # the README's relative paths
    run = d / "outputs" / "finetune"
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads((run / "summary.json").read_text())
    assert len(records) == summary["steps"] == 20
    assert "weights: " in p.stdout and "tests/data/llama_tiny_a (llama, 1 safetensors file) as float32" in p.stdout
    # What it printed is what the README shows under the block (timings aside; test_readme.py's rules).
    from test_readme import match_block

    section = readme_section("Fine-tuning a Hugging Face model")
    output_block = next(text for lang, text in re.findall(r"```(\w*)\n(.*?)```", section, re.S) if lang == "")
    shown = [ln for ln in output_block.splitlines() if ln.strip()]
    missing = match_block(shown, [ln for ln in p.stdout.splitlines() if ln.strip()])
    assert missing is None, f"README line not printed: {missing}\n{p.stdout[-3000:]}"

    # The held-out loss is watched: evaluated at step 10 and at the end, in metrics.jsonl and summary.json.
    evals = {r["step"] + 1: r["eval_loss"] for r in records if r.get("eval_loss") is not None}  # "step" counts from 0
    assert sorted(evals) == [10, 20], evals
    assert evals[20] < evals[10] and summary["eval"]["eval_loss"] == evals[20]

    # Step 0 is exactly the loss of from_pretrained on the batch train.py drew; 20 steps lower it.
    overrides = [o for o in summary["overrides"] if not o.startswith("hydra.")]
    c = load(compose(overrides))
    batch = make_data(c).batch(0)
    reference = hf.from_pretrained(DATA / "llama_tiny_a")
    # (the chunked head in train.py against whole logits here: equal up to float32 summation order)
    assert abs(records[0]["loss"] - float(_loss(reference, batch))) <= 1e-6 * abs(records[0]["loss"])
    assert records[-1]["loss"] < records[0]["loss"] - 0.2

    # The run records its source, in summary.json and in the checkpoint's metadata.
    assert summary["config"]["pretrained"]["path"] == str(d / "tests" / "data" / "llama_tiny_a")
    model, meta = restore_model(d / "outputs" / "finetune" / "checkpoints")
    assert meta["step"] == 20 and meta["pretrained"] == summary["config"]["pretrained"]

    # Sampling from the checkpoint printed the greedy continuation of the trained model, in UTF-8 bytes.
    from zoo.data.tokenizer import ByteTokenizer
    from zoo.sampling import generate

    command = next(
        ln
        for ln in section.splitlines()
        if ln.startswith("python -m zoo.tools.generate checkpoint.dir=outputs/finetune/checkpoints")
    )
    prompt = re.search(r'prompt="([^"]*)"', command).group(1)
    n = int(re.search(r"max_new_tokens=(\d+)", command).group(1))
    expected = generate(model, [prompt], n, tokenizer=ByteTokenizer())[0]
    assert prompt + expected.text in p.stdout.splitlines()

    # The export loads back with the trained weights: logits equal; its files are the hub's layout.
    exported = d / "outputs" / "finetune" / "exported"
    back = hf.from_pretrained(exported)
    tokens = jnp.asarray((batch["tokens"] if isinstance(batch, dict) else batch)[:2])
    np.testing.assert_array_equal(np.asarray(_logits(back, tokens)), np.asarray(_logits(model, tokens)))
    assert not np.array_equal(np.asarray(back.embed), np.asarray(reference.embed))  # trained, not the source
    source = DATA / "llama_tiny_a"
    assert sorted(p.name for p in exported.iterdir()) == ["config.json", "model.safetensors"]
    config, original = (
        json.loads((exported / "config.json").read_text()),
        json.loads((source / "config.json").read_text()),
    )
    for key in (
        "architectures",
        "model_type",
        "hidden_size",
        "num_hidden_layers",
        "vocab_size",
        "bos_token_id",
        "eos_token_id",
    ):
        assert config[key] == original[key], key
    header, source_header = (
        hf.SafetensorsFile(exported / "model.safetensors").header,
        hf.SafetensorsFile(source / "model.safetensors").header,
    )
    assert {k: (v["dtype"], v["shape"]) for k, v in header.items()} == {
        k: (v["dtype"], v["shape"]) for k, v in source_header.items()
    }

    # Resuming goes on from the orbax checkpoint, not from the Hugging Face weights again.
    c = load(compose([*overrides, "trainer.steps=30"]))
    plan = validate(c, len(jax.devices()), zoo.model.abstract(c.model))
    trainer = Trainer(c, plan)
    ckpt = Checkpoints(c, plan, trainer)
    assert ckpt.check() == 20
    resumed = leaves_by_path(ckpt.restore(20)["params"])
    ckpt.close()
    for path, x in leaves_by_path(model).items():
        np.testing.assert_array_equal(np.asarray(resumed[path]), np.asarray(x), err_msg=path)


# --- bad input through train.py's command line --------------------------------------------------------------


def _hf_copy(tmp_path, edit=None, tensors=None) -> pathlib.Path:
    from safetensors.numpy import load_file

    d = tmp_path / "hf"
    d.mkdir()
    cfg = json.loads((DATA / "llama_tiny_a" / "config.json").read_text())
    state = load_file(DATA / "llama_tiny_a" / "model.safetensors")
    if edit:
        edit(cfg)
    if tensors:
        tensors(state)
    (d / "config.json").write_text(json.dumps(cfg))
    hf.write_safetensors(d / "model.safetensors", state)
    return d


def _set(key, value):
    return lambda cfg: cfg.__setitem__(key, value)


BAD = {
    "no_config": (
        lambda t: (t / "hf").mkdir() or t / "hf",
        [],
        r"^error: model.path: .*/hf/config.json: missing; a Hugging Face checkpoint directory needs its config.json$",
    ),
    "no_weights": (
        lambda t: (_hf_copy(t) / "model.safetensors").unlink() or t / "hf",
        [],
        r"^error: model.path: .*/hf: no \*.safetensors files; a Hugging Face checkpoint directory \(config.json \+ "
        r"\*.safetensors\) is needed$",
    ),
    "architecture": (
        lambda t: _hf_copy(t, _set("model_type", "gpt2")),
        [],
        r"^error: model.path: .*/hf/config.json: model_type 'gpt2' is not supported; supported: llama, deepseek_v3, ",
    ),
    "shapes": (
        lambda t: _hf_copy(t, _set("intermediate_size", 96)),
        [],
        r"^error: model.path: .*/hf/model.safetensors: tensor 'model.layers.0.mlp.gate_proj.weight' has shape \[128, "
        r"64\], "
        r"the config implies \[96, 64\]; config.json and the weights disagree",
    ),
    "int_tensor": (
        lambda t: _hf_copy(t, tensors=lambda s: s.__setitem__("model.norm.weight", np.ones(64, np.int32))),
        [],
        r"^error: model.path: .*/hf/model.safetensors: tensor 'model.norm.weight' has dtype I32; a floating-point "
        r"tensor \(F32, BF16, F16, F64\) is expected$",
    ),
    "tokenizer": (
        lambda t: _hf_copy(t),
        ["data=text", "data.tokenizer={tmp}/big.json"],
        r"^error: data.tokenizer: .*/big.json has 300 token ids but .*/hf/config.json has vocab_size=256, so its ids "
        r"would index "
        r"past the embedding; give the tokenizer the checkpoint was trained with$",
    ),
    "shape_override": (
        lambda t: _hf_copy(t),
        ["model.hidden_size=128"],
        r"^error: model.hidden_size: 128 contradicts .*/hf/config.json \(which gives 64\)",
    ),
    "eval_split": (
        lambda t: _hf_copy(t),
        ["data=text", "data.eval_fraction=0.001"],
        r"^error: data.eval_fraction: 0.001 of .* gives 6 windows of data.seq_len=64 tokens, fewer than one batch of "
        r"data.batch_size=16; raise data.eval_fraction to at least 0.003, lower data.batch_size, or give "
        r"data.eval_path$",
    ),
}


@in_process.MARK  # the commands run in one pytest process (tests/in_process.py)
@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_pretrained_input_one_line_exit_2_before_compile_nothing_touched(
    case, tmp_path, request, capfd, monkeypatch
):
    if not in_process.INNER:
        return in_process.outcome(request)  # conftest.py's 8 devices, as the command starts JAX
    make, extra, expected = BAD[case]
    d = make(tmp_path)
    if case == "tokenizer":
        write_tokenizer(tmp_path / "big.json", 300)
    before = fingerprint(tmp_path)
    args = [
        "model=hf",
        f"model.path={d}",
        f"checkpoint.dir={tmp_path / 'ckpt'}",
        *(a.format(tmp=tmp_path) for a in extra),
    ]
    cmd = [sys.executable, str(ROOT / "train.py"), *args, f"hydra.run.dir={tmp_path / 'run'}"]
    p = in_process.run(cmd, tmp_path, capfd, monkeypatch)
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert p.returncode == 2, p.stderr[-3000:]
    assert len(lines) == 1 and re.match(expected, lines[0]), lines
    assert "s, compile " not in p.stdout
    assert not (tmp_path / "ckpt").exists()
    after = {k: v for k, v in fingerprint(tmp_path).items() if not k.startswith("run/")}
    assert after == before  # the checkpoint directory and everything else as they were
