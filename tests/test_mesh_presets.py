"""conf/mesh presets are deltas on MeshConfig's defaults: each composes to the full config, states nothing
the defaults already say, and a preset's rule change leaves the other rules at zoo.sharding.DEFAULT_RULES."""

import pathlib

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from zoo.sharding import DEFAULT_RULES
from zoo.train.run_config import MESH_DEFAULTS_NAME, MeshConfig, load_group

CONF = pathlib.Path(__file__).resolve().parents[1] / "conf"
PRESETS = sorted(p.stem for p in (CONF / "mesh").glob("*.yaml"))
DEFAULTS = MeshConfig()


def _mesh(preset: str, *overrides: str) -> MeshConfig:
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        cfg = compose(config_name="config", overrides=[f"mesh={preset}", *overrides])
    return load_group("mesh", cfg.mesh)


@pytest.mark.parametrize("preset", PRESETS)
def test_preset_states_only_what_differs(preset):
    own = OmegaConf.to_container(OmegaConf.load(CONF / "mesh" / f"{preset}.yaml"))
    assert own.pop("defaults") == [MESH_DEFAULTS_NAME, "_self_"]
    for key, value in own.items():
        if key == "rules":
            repeated = [k for k, v in value.items() if DEFAULT_RULES.get(k) == v]
            assert not repeated, f"conf/mesh/{preset}.yaml restates the default rules for {repeated}"
        elif key != "name":
            assert getattr(DEFAULTS, key) != value, f"conf/mesh/{preset}.yaml restates the default {key}: {value}"
    mesh = _mesh(preset)
    assert mesh.name == preset
    expected = {**DEFAULT_RULES, **own.get("rules", {})}
    if own.get("sequence_parallel"):  # the option adds tensor to the seq rule (MeshConfig.__post_init__)
        expected["seq"] = [*expected["seq"], "tensor"]
    assert mesh.rules == expected
    assert mesh.max_replicated_mb == DEFAULTS.max_replicated_mb


def test_a_rule_override_changes_that_rule_only():
    mesh = _mesh("deepseek_v3_128", "mesh.rules.seq=[tensor]")
    assert mesh.rules["seq"] == ["tensor"] and mesh.rules["embed"] == ["fsdp", "expert"]
    assert mesh.rules["vocab"] == ["expert"]  # the preset's own delta stays
    assert {k: v for k, v in mesh.rules.items() if k not in ("seq", "embed", "latent", "vocab")} == {
        k: v for k, v in DEFAULT_RULES.items() if k not in ("seq", "embed", "latent", "vocab")
    }
