"""The published sizes train with their recipe's peak learning rate and warmup (zoo/families/), unless
the command line gives its own; docs/training.md's table is the recipes, not a copy that can drift."""

import pathlib
import re

import pytest

from zoo import families
from zoo.families._family import SCALED, scaled

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _optimizer(*overrides):
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        return compose("config", overrides=list(overrides))["optimizer"]


def test_every_published_size_and_llama_1b_has_a_recipe():
    for family in families.registered():
        wanted = set(family.published) | ({"llama_1b"} if family.name == "llama" else set())
        assert set(family.recipes) == wanted, family.name


@pytest.mark.parametrize(
    "overrides,lr,warmup",
    [
        (["model=llama3.1_8b"], 3e-4, 2000),
        (["model=llama3.1_405b"], 8e-5, 8000),
        (["model=deepseek_v3_671b"], 2.2e-4, 2000),
        (["model=llama_1b"], 3e-4, 10),
        (["model=gemma3_27b"], 1.5e-4, 2000),  # scaled from its published 27B
        (["model=llama3.1_8b", "optimizer.lr=1e-3"], 1e-3, 2000),  # the command line wins
        (["model=llama3.1_8b", "optimizer.warmup_steps=5"], 3e-4, 5),
        (["model=llama_tiny_a"], 3e-3, 10),  # no recipe: conf/optimizer/adamw.yaml's
    ],
)
def test_the_composed_config_holds_the_recipe_used(overrides, lr, warmup):
    opt = _optimizer(*overrides)
    assert (opt.lr, opt.warmup_steps) == (pytest.approx(lr), warmup)


def test_a_scaled_recipe_is_llamas_peak_for_the_size_class():
    assert [scaled(n).lr for n in (7e9, 30e9, 141e9, 235e9)] == [3e-4, 1.5e-4, 1.5e-4, 8e-5]
    mixtral = families.get("mixtral")
    assert mixtral.recipes["mixtral_8x22b"] == SCALED and mixtral.recipe("mixtral_8x22b").lr == 1.5e-4


def test_the_docs_table_lists_every_recipe():
    text = (ROOT / "docs" / "training.md").read_text()
    rows = dict(re.findall(r"^\| `(\S+)` \| ([\d.e-]+) \| [\d,]+ \|", text, re.M))
    every = {name: fam.recipe(name) for fam in families.registered() for name in fam.recipes}
    assert {name: float(lr) for name, lr in rows.items()} == {name: r.lr for name, r in every.items()}
    warmups = dict(re.findall(r"^\| `(\S+)` \| [\d.e-]+ \| ([\d,]+) \|", text, re.M))
    assert {n: int(w.replace(",", "")) for n, w in warmups.items()} == {n: r.warmup_steps for n, r in every.items()}
