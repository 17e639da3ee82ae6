"""What `zoo.tools.export` writes, loaded by Hugging Face transformers: every family's export must load with
`AutoModelForCausalLM.from_pretrained` (whose config classes validate each field's type strictly) and
compute Zoo's logits.

transformers and torch are an optional extra (`pip install -e '.[hf]'`): without them the tests that
load an export skip, saying so. Only those tests import them (the `transformers` fixture), so no other
test, nor collecting this module, pays their import time.
The families come from `zoo.hf.families()`, each with the fixture under tests/data whose config.json
names its model_type (tests/data/families/README.md).
"""

import dataclasses
import json
import os
import pathlib
import shutil
import subprocess
import sys
import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import zoo
from zoo import hf
from zoo.config import RopeConfig
from zoo.families import SIZES
from zoo.hf.convert import _architecture_only

from tiers import by_family

ROOT = pathlib.Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data"
MODEL_TYPES = {f.name: f.model_type for f in hf.families()}  # the registry: every family zoo converts
FAMILIES = list(MODEL_TYPES)
ATOL = 1e-4  # float32, what the fixtures' README gives a reimplementation
CLI_FAMILY = "gemma3"  # the family exported by `python -m zoo.tools.export` (the others call hf_export, its code path)

_logits = eqx.filter_jit(lambda model, tokens: model(tokens))


@pytest.fixture(scope="module")
def transformers():
    """Imported by the tests that use it, not when the module is collected: every test worker collects
    every module, and torch with transformers take seconds to import."""
    pytest.importorskip("torch", reason="torch is not installed (pip install -e '.[hf]'); transformers runs on it")
    return pytest.importorskip(
        "transformers", reason="transformers is not installed (pip install -e '.[hf]'); loading exports in it needs it"
    )


def fixture(family: str) -> pathlib.Path:
    """The fixture directory of `family`: the one whose config.json has the family's model_type (the
    *_tiny_hard fixtures, made to stress the parity tests, are left out: one export per family)."""
    model_type = MODEL_TYPES[family]
    typed = [
        p.parent
        for p in sorted(DATA.glob("**/config.json"))
        if json.loads(p.read_text()).get("model_type") == model_type
    ]
    # a family added since tests/make_fixtures.py has only the fixtures it writes: the first of them
    found = [d for d in typed if not d.name.endswith("_tiny_hard")] or typed[:1]
    assert len(found) == 1, f"family {family} ({model_type}) has {len(found)} fixtures under tests/data: {found}"
    return found[0]


def tiny_preset(family: str) -> str:
    """The `model=<name>_tiny_a` option of `family` (DeepSeek-V3's is dsv3_tiny_a)."""
    found = [name for name, c in SIZES.items() if name.endswith("_tiny_a") and c.family == family]
    assert len(found) == 1, f"family {family} has {len(found)} tiny presets: {found}"
    return found[0]


def compose(overrides):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        return hydra_compose("config", overrides=overrides)


def train_py_checkpoint(overrides: list, seed: int = 0, step: int = 1):
    """The TrainConfig of a train.py run of `overrides`, its initial state saved as `step` in its checkpoint.dir."""
    from zoo.train.checkpoint import Checkpoints
    from zoo.train.run import prepare
    from zoo.train.step import Trainer

    c, plan, devices, _ = prepare(compose(["mesh=single", "data.batch_size=1", "data.seq_len=16", *overrides]))
    trainer = Trainer(c, plan, devices)
    state = trainer.init(seed=seed)
    ckpt = Checkpoints(c, plan, trainer)
    ckpt.save(step, state)
    ckpt.close()
    return c


def transformers_logits(transformers, directory: pathlib.Path, tokens: np.ndarray) -> np.ndarray:
    """float32 logits of the directory as transformers loads it (eager attention, as the fixtures were made)."""
    import torch

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = transformers.AutoModelForCausalLM.from_pretrained(
            directory, dtype=torch.float32, attn_implementation="eager"
        )
    model.eval()
    with torch.no_grad():
        return model(torch.as_tensor(np.asarray(tokens), dtype=torch.long)).logits.numpy()


def zoo_logits(checkpoint_dir: pathlib.Path, tokens: np.ndarray) -> np.ndarray:
    from zoo.train.checkpoint import restore_model

    model, _ = restore_model(checkpoint_dir)
    return np.asarray(_logits(model, jnp.asarray(tokens)))


@pytest.mark.parametrize("family", by_family(FAMILIES))  # repeat families: slow tier
def test_export_of_a_hugging_face_checkpoint_loads_in_transformers(family, transformers, tmp_path):
    """The family's fixture trained on with `model=hf` (its initial state saved), exported by hf_export:
    transformers loads the directory strictly and computes Zoo's logits on the fixture's tokens; the
    source's bos/eos ids and generation_config.json come through."""
    from zoo.train.hf_export import hf_export

    src = tmp_path / "source"
    shutil.copytree(fixture(family), src)
    source_config = json.loads((src / "config.json").read_text())
    generation = {
        "bos_token_id": source_config["bos_token_id"],
        "eos_token_id": [source_config["eos_token_id"], 3],
        "max_new_tokens": 7,
    }
    (src / "generation_config.json").write_text(json.dumps(generation))
    train_py_checkpoint(["model=hf", f"model.path={src}", f"checkpoint.dir={tmp_path / 'ckpt'}"])
    if family == CLI_FAMILY:  # once through the command, as a user runs it
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
        p = subprocess.run(
            [sys.executable, "-m", "zoo.tools.export", str(tmp_path / "ckpt"), str(tmp_path / "out")],
            capture_output=True,
            text=True,
            env=env,
            timeout=300,
        )
        assert p.returncode == 0 and "exported step 1" in p.stdout, p.stderr
    else:
        hf_export(tmp_path / "ckpt", tmp_path / "out")

    tokens = np.load(src / "inputs.npy")
    theirs = transformers_logits(transformers, tmp_path / "out", tokens)
    ours = zoo_logits(tmp_path / "ckpt", tokens)
    np.testing.assert_allclose(theirs, ours, atol=ATOL, rtol=0)
    np.testing.assert_allclose(theirs, np.load(src / "logits.npy"), atol=ATOL, rtol=0)  # and the source's own logits

    config = json.loads((tmp_path / "out" / "config.json").read_text())
    for key in ("bos_token_id", "eos_token_id", "pad_token_id", "tie_word_embeddings"):
        assert config[key] == source_config[key], key
    assert json.loads((tmp_path / "out" / "generation_config.json").read_text()) == generation
    loaded = transformers.GenerationConfig.from_pretrained(tmp_path / "out")
    assert (loaded.bos_token_id, loaded.eos_token_id, loaded.max_new_tokens) == (
        generation["bos_token_id"],
        generation["eos_token_id"],
        7,
    )


# Options the fixtures leave out, on each family's tiny preset (a family without an entry: the preset as it is).
VARIANTS = {
    "llama": lambda c: c.replace(
        tie_word_embeddings=True,
        attention_bias=True,
        attention_out_bias=True,
        rope=RopeConfig(type="llama3", theta=5e5, factor=8.0, original_max_position_embeddings=32),
    ),
    "deepseek_v3": lambda c: c.replace(
        rope=dataclasses.replace(
            c.rope, type="yarn", factor=4.0, original_max_position_embeddings=32, mscale=1.0, mscale_all_dim=1.0
        )
    ),
    "qwen2": lambda c: c.replace(
        tie_word_embeddings=False, sliding_window=8, layer_types=["full_attention", "sliding_attention"]
    ),
    "qwen3": lambda c: c.replace(
        attention_bias=True, attention_out_bias=True, rope=RopeConfig(type="linear", theta=1e6, factor=4.0)
    ),
    "qwen3_moe": lambda c: c.replace(
        mlp_only_layers=[0], sliding_window=8, moe=dataclasses.replace(c.moe, norm_topk_prob=False)
    ),
    "mixtral": lambda c: c.replace(sliding_window=8, tie_word_embeddings=True),
    "gemma3": lambda c: c.replace(
        tie_word_embeddings=False,
        attention_bias=True,
        attention_out_bias=True,
        query_pre_attn_scalar=40.0,
        final_logit_softcap=3.0,
        rope=RopeConfig(type="yarn", theta=1e6, factor=4.0, original_max_position_embeddings=32),
    ),
    "gpt_oss": lambda c: c.replace(sliding_window=4, moe=dataclasses.replace(c.moe, swiglu_limit=0.5)),
}


def with_options(family: str):
    c = SIZES[tiny_preset(family)]
    return VARIANTS.get(family, lambda c: c)(c)


@pytest.mark.parametrize("family", by_family(FAMILIES))  # repeat families: slow tier
def test_export_of_a_zoo_model_with_other_options_loads_in_transformers(family, transformers, tmp_path):
    """A zoo model (its tiny preset with options the fixtures leave out; random weights, biases, norms
    and sinks, not an initialiser's zeros and ones), read by from_pretrained and written by
    save_pretrained as hf_export writes it: transformers loads it and computes Zoo's logits."""
    c = with_options(family)
    rng = np.random.default_rng(1)

    def draw(path, leaf):  # norm scales about 1 (Gemma's stored w about 0 + 1), the rest about 0
        x = rng.normal(0, 0.1, leaf.shape).astype(leaf.dtype)
        return x + 1 if "norm" in jax.tree_util.keystr(path) and c.norm_weight_offset == 0 else x

    model = jax.tree_util.tree_map_with_path(draw, zoo.abstract(c))  # the shapes only: no initialiser to compile
    state = hf.to_hf_state_dict(model)
    src = tmp_path / "src"
    src.mkdir()
    hf.write_safetensors(src / "model.safetensors", state)
    (src / "config.json").write_text(json.dumps(hf.config_to_hf(c)))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = hf.from_pretrained(src)
    hf.save_pretrained(model, tmp_path / "out")

    tokens = np.random.default_rng(2).integers(0, c.vocab_size, (2, 24))
    ours = np.asarray(_logits(model, jnp.asarray(tokens)))
    np.testing.assert_allclose(transformers_logits(transformers, tmp_path / "out", tokens), ours, atol=ATOL, rtol=0)
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["bos_token_id"] is None and config["eos_token_id"] is None  # not transformers' class defaults


def test_every_preset_config_loads_strictly_and_reads_back_alike(transformers, tmp_path):
    """config_to_hf of every model preset (the real sizes too) and of each family's options above: the
    family's transformers config class loads it (its fields are type-checked strictly: an int field
    refuses 24.0), and what that class writes back reads as the same model in zoo."""
    configs = {name: c for name, c in SIZES.items()} | {f"{f}+options": with_options(f) for f in FAMILIES}
    assert {c.family for c in configs.values()} == set(FAMILIES)
    for name, c in configs.items():
        d = tmp_path / name
        d.mkdir()
        (d / "config.json").write_text(json.dumps(hf.config_to_hf(c)))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            theirs = transformers.AutoConfig.from_pretrained(d)
        assert type(theirs).model_type == MODEL_TYPES[c.family], name
        back = hf.config_from_hf(theirs.to_dict(), source=name)
        assert _architecture_only(back) == _architecture_only(c), name


def test_query_pre_attn_scalar_is_an_int_or_refused():
    c = SIZES["gemma3_tiny_a"]
    assert type(hf.config_to_hf(c)["query_pre_attn_scalar"]) is int
    with pytest.raises(hf.CheckpointError, match=r"query_pre_attn_scalar=24.5.*an integer"):
        hf.config_to_hf(c.replace(query_pre_attn_scalar=24.5))


def test_token_ids_of_a_model_trained_from_scratch(tmp_path):
    """bos/eos of the tokenizer the model was trained with (bytes: eos is the NUL document separator, no
    bos; a tokenizer.json: its own, `--tokenizer` first); none for synthetic tokens or a tokenizer gone."""
    from tokenizers import Tokenizer, models

    from zoo.hf.pretrained import tokenizer_token_ids

    assert tokenizer_token_ids({"name": "markov", "tokenizer": None}) == {}
    assert tokenizer_token_ids({"name": "text", "tokenizer": None}) == {"eos_token_id": 0}
    Tokenizer(models.WordLevel({"<unk>": 0, "<s>": 1, "</s>": 2, "a": 3}, unk_token="<unk>")).save(
        str(tmp_path / "tokenizer.json")
    )
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"add_bos_token": True, "bos_token": "<s>"}))
    assert tokenizer_token_ids({"name": "text", "tokenizer": str(tmp_path)}) == {"bos_token_id": 1, "eos_token_id": 2}
    assert tokenizer_token_ids({"name": "markov", "tokenizer": None}, str(tmp_path)) == {
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    assert tokenizer_token_ids({"name": "text", "tokenizer": str(tmp_path / "gone")}) == {}
