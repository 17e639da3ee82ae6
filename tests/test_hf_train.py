"""Pretrained weights in train.py: Hugging Face checkpoints in, train.py checkpoints back out."""

import pathlib

import jax
import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def compose(overrides):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        return hydra_compose("config", overrides=overrides)


def test_restore_model_reads_the_parameters_train_py_saved(tmp_path):
    from zoo.train.checkpoint import Checkpoints, restore_model
    from zoo.train.config import ConfigError
    from zoo.train.run import prepare
    from zoo.train.step import Trainer

    overrides = ["model=llama_tiny_a", "mesh=fsdp_tp", "mesh.devices=4", "mesh.tensor=2", "data.batch_size=4", "data.seq_len=16",
                 f"checkpoint.dir={tmp_path / 'ckpt'}"]
    c, plan, devices, _ = prepare(compose(overrides))
    trainer = Trainer(c, plan, devices)
    state = trainer.init(seed=3)
    ckpt = Checkpoints(c, plan, trainer)
    ckpt.save(5, state)
    ckpt.close()

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
