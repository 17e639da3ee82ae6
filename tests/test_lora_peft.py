"""LoRA adapters in the PEFT layout (zoo.hf.adapters, `zoo.tools.export --adapters-only`) and sampling with them
attached (`zoo.tools.generate checkpoint.lora=attached`).

The layout is held to the conversion it must agree with: for every adapted hub Linear, `scale * lora_B
@ lora_A` equals the merged model's hub weight minus the base's (`to_hf_state_dict` of both), exactly
where the rules only move elements; a lora_B with its rows in another order fails that. transformers
with `peft` then loads the base, applies the adapters and computes the merged export's logits.
transformers, torch and peft are the `test` extra; without them those tests skip.
"""

import json
import os
import pathlib
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from zoo import lora
from zoo.hf import from_pretrained, save_pretrained, to_hf_state_dict
from zoo.hf.adapters import ADAPTER_CONFIG, PEFT_PREFIX, peft_state, save_adapters

ROOT = pathlib.Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data"
TARGETS = {
    "llama_tiny_a": ["wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down"],
    # latent attention: kv_b_proj holds wk_b and wv_b (both adapted: one rank-2r adapter), q_a/q_b,
    # the shared experts' MLP
    "dsv3_tiny_a": ["wq_a", "wq_b", "wkv_a", "wk_b", "wv_b", "wo", "w_gate", "w_up", "w_down"],
}
RANK, ALPHA = 2, 6.0


def attached(name: str, targets=None):
    """The fixture model with random (non-zero) adapters on `targets` (default: every projection it can adapt)."""
    base = from_pretrained(DATA / name)
    cfg = lora.LoraConfig(rank=RANK, alpha=ALPHA, targets=targets or TARGETS[name])
    rng = np.random.default_rng(0)  # numpy: a jax.random call per adapter shape would compile each
    adapters = jax.tree.map(
        lambda x: jnp.asarray(0.1 * rng.standard_normal(x.shape), x.dtype), lora.init_shapes(base, cfg)
    )
    return base, lora.attach(base, adapters, cfg)


def delta_mismatches(tensors: dict, base_hf: dict, merged_hf: dict) -> list[str]:
    """Hub weights where `merged - base` is not `scale * B @ A` (or changed without an adapter)."""
    bad = []
    for name, w in merged_hf.items():
        key = PEFT_PREFIX + name.removesuffix(".weight") + ".lora_A.weight"
        delta = w - base_hf[name]
        if key in tensors:
            a, b = tensors[key], tensors[key.replace(".lora_A.", ".lora_B.")]
            scale = ALPHA / RANK
            if not np.allclose(delta, scale * b @ a, rtol=1e-5, atol=1e-6):
                bad.append(name)
        elif np.abs(delta).max() != 0:
            bad.append(name + " (changed, no adapter)")
    return bad


@pytest.mark.parametrize("name", list(TARGETS))
def test_peft_tensors_are_the_merged_weight_minus_the_base(name):
    base, model = attached(name)
    tensors, ranks = peft_state(model)
    base_hf, merged_hf = to_hf_state_dict(base), to_hf_state_dict(lora.merge(model))
    adapted = {
        n.removeprefix(PEFT_PREFIX).removesuffix(".lora_A.weight") for n in tensors if n.endswith(".lora_A.weight")
    }
    assert len(adapted) == len(ranks) and len(adapted) > 0
    assert delta_mismatches(tensors, base_hf, merged_hf) == []
    for path in adapted:
        w = merged_hf[path + ".weight"]
        assert tensors[PEFT_PREFIX + path + ".lora_A.weight"].shape == (ranks[path], w.shape[1])  # [r, in_features]
        assert tensors[PEFT_PREFIX + path + ".lora_B.weight"].shape == (w.shape[0], ranks[path])  # [out_features, r]
    if name == "dsv3_tiny_a":
        assert ranks["model.layers.0.self_attn.kv_b_proj"] == 2 * RANK  # wk_b's and wv_b's adapters side by side
    else:
        # q_proj's rows are heads x head_dim; a lora_B whose rows run head_dim x heads (or any other order)
        # is caught: the check above can fail.
        q = PEFT_PREFIX + "model.layers.1.self_attn.q_proj.lora_B.weight"
        heads, head_dim = model.config.num_heads, model.config.head_dim
        wrong = dict(tensors)
        wrong[q] = tensors[q].reshape(heads, head_dim, RANK).transpose(1, 0, 2).reshape(heads * head_dim, RANK)
        assert delta_mismatches(wrong, base_hf, merged_hf) == ["model.layers.1.self_attn.q_proj.weight"]


@pytest.fixture(scope="module")
def peft_lib():
    pytest.importorskip("torch", reason="torch is not installed (pip install -e '.[test]')")
    pytest.importorskip("transformers", reason="transformers is not installed (pip install -e '.[test]')")
    return pytest.importorskip("peft", reason="peft is not installed (pip install -e '.[test]')")


def peft_vs_merged(base_dir, adapters_dir, merged_dir) -> float:
    """In transformers: the logits of the base with the peft adapters equal the merged export's (float32
    rounding: the adapters run unmerged there); returns how far the adapters moved them from the base's."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    load = lambda d: AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()  # noqa: E731
    ids = torch.arange(24)[None] * 7 % 256
    with torch.no_grad():
        plain = load(base_dir)(ids).logits
        adapted = PeftModel.from_pretrained(load(base_dir), str(adapters_dir)).eval()(ids).logits
        merged = load(merged_dir)(ids).logits
    np.testing.assert_allclose(adapted.numpy(), merged.numpy(), rtol=1e-5, atol=1e-5)
    return float((adapted - plain).abs().max())


def test_peft_applies_latent_attention_adapters_as_the_merged_export(peft_lib, tmp_path):
    """DeepSeek: kv_b_proj's rank-2r adapter (rank_pattern/alpha_pattern) and the other attention
    projections, applied by peft over the base in transformers, compute the merged export's logits.
    Adapters on the dense MLP are refused: the routed experts have its projections' names."""
    from zoo.hf import CheckpointError

    with pytest.raises(
        CheckpointError,
        match=r"mlp\.experts\.0\.gate_proj shares the name gate_proj .* train without w_gate in lora\.targets",
    ):
        save_adapters(attached("dsv3_tiny_a")[1], tmp_path / "refused", rank=RANK, alpha=ALPHA)
    assert not (tmp_path / "refused").exists()
    _, model = attached("dsv3_tiny_a", [t for t in TARGETS["dsv3_tiny_a"] if not t.startswith("w_")])
    save_adapters(model, tmp_path / "adapters", rank=RANK, alpha=ALPHA, base_model=str(DATA / "dsv3_tiny_a"))
    save_pretrained(lora.merge(model), tmp_path / "merged")
    config = json.loads((tmp_path / "adapters" / ADAPTER_CONFIG).read_text())
    assert config["rank_pattern"] == {"kv_b_proj": 2 * RANK} and config["alpha_pattern"] == {"kv_b_proj": 2 * ALPHA}
    assert peft_vs_merged(DATA / "dsv3_tiny_a", tmp_path / "adapters", tmp_path / "merged") > 1e-2


def _run(cmd, **kw):
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, **kw)
    assert p.returncode == 0, p.stderr[-3000:]
    return p


@pytest.mark.slow  # a train.py run, two exports, transformers, and two decode compiles: ~60 s on the 2-core machine
def test_a_lora_run_exports_adapters_peft_loads_and_samples_attached(peft_lib, tmp_path, capsys):
    """train.py (model=hf, lora=default) -> `zoo.tools.export --adapters-only` and the merged export: peft over
    the run's model.path computes the merged logits; `zoo.tools.generate checkpoint.lora=attached` gives the
    merged model's greedy tokens."""
    from zoo.sampling import generate
    from zoo.train.checkpoint import restore_model

    base_dir = tmp_path / "base"
    shutil.copytree(DATA / "llama_tiny_a", base_dir)
    ck = tmp_path / "ck"
    _run(
        [
            sys.executable,
            str(ROOT / "train.py"),
            "model=hf",
            f"model.path={base_dir}",
            "data=text",
            f"data.path={ROOT / 'zoo/data/corpus/shakespeare'}",
            "lora=default",
            "lora.rank=4",
            "data.batch_size=4",
            "data.seq_len=32",
            "optimizer.lr=3e-2",
            "trainer.steps=4",
            f"checkpoint.dir={ck}",
            f"hydra.run.dir={tmp_path / 'run'}",
            "mesh=single",
            "xla.cpu_devices=1",
        ],
        env=dict(os.environ),
    )
    from zoo.tools.export import main as export_main

    assert export_main([str(ck), str(tmp_path / "adapters"), "--adapters-only"]) == 0  # in this process: shape-checked
    assert "exported the LoRA adapters (peft layout) of step 4" in capsys.readouterr().out
    _run([sys.executable, "-m", "zoo.tools.export", str(ck), str(tmp_path / "merged")])
    assert sorted(os.listdir(tmp_path / "adapters")) == ["adapter_config.json", "adapter_model.safetensors"]
    config = json.loads((tmp_path / "adapters" / ADAPTER_CONFIG).read_text())
    assert {
        k: config[k]
        for k in ("peft_type", "task_type", "r", "lora_alpha", "bias", "fan_in_fan_out", "base_model_name_or_path")
    } == {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": 4,
        "lora_alpha": 16.0,
        "bias": "none",
        "fan_in_fan_out": False,
        "base_model_name_or_path": str(base_dir),
    }
    assert config["target_modules"] == sorted(
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    )
    assert peft_vs_merged(base_dir, tmp_path / "adapters", tmp_path / "merged") > 1e-2

    merged, _ = restore_model(ck)
    on, _ = restore_model(ck, lora_form="attached")
    assert lora.has_adapters(on) and not lora.has_adapters(merged)
    prompts = [[10, 20, 30, 40], [5, 6]]
    a = generate(merged, prompts, 12, keep_logits=True)
    b = generate(on, prompts, 12, keep_logits=True)
    assert [r.tokens for r in a] == [r.tokens for r in b]
    for x, y in zip(a, b):
        np.testing.assert_allclose(x.logits, y.logits, rtol=1e-4, atol=1e-4)


def test_generate_refuses_a_bad_lora_form():
    from zoo.tools.generate import GenerationError, run

    with pytest.raises(GenerationError, match=r"^checkpoint\.lora: got 'both'; choose merged or attached$"):
        run(["checkpoint.dir=/nonexistent", "checkpoint.lora=both", "prompt=hi", "tokenizer=bytes"])
    with pytest.raises(
        GenerationError, match=r"^checkpoint\.lora: applies to a LoRA run's checkpoint\.dir, not to model\.path"
    ):
        run([f"model.path={DATA / 'llama_tiny_a'}", "checkpoint.lora=attached", "prompt=hi", "tokenizer=bytes"])


def test_dropless_keeps_the_adapters_attached():
    """zoo.tools.generate puts MoE layers on the ragged kernel (`dropless`); an attached model keeps its adapters.
    (Shapes only: dropless moves leaves, it computes nothing.)"""
    from zoo.families import SIZES
    from zoo.sampling import dropless
    from zoo.model import abstract

    base = abstract(SIZES["dsv3_tiny_a"])
    assert base.config.moe.impl != "ragged"
    cfg = lora.LoraConfig(rank=RANK, alpha=ALPHA, targets=["wk_b", "w_up"])
    on = lora.attach(base, jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), lora.init_shapes(base, cfg)), cfg)
    out = dropless(on)
    assert out.config.moe.impl == "ragged" and lora.has_adapters(out)
    plain, adapters, back = lora.detach(out)
    assert jax.tree.structure(plain) == jax.tree.structure(dropless(base))
    assert (back.rank, back.alpha, sorted(back.targets)) == (RANK, ALPHA, ["w_up", "wk_b"])
    assert jax.tree.map(lambda x: x.shape, adapters) == jax.tree.map(lambda x: x.shape, lora.init_shapes(base, cfg))
