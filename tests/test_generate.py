"""Sampling with a KV cache (zoo.generate, CausalLM.prefill / decode_step, zoo.nn.cache).

Every family's reference checkpoint (tests/data) generates greedily from two prompts of different
lengths, one longer than the sliding windows (8) of Gemma 3 and GPT-OSS, so the ring caches wrap;
the tokens must be what re-running the full forward pass at every step picks, and the logits the
cache gave must equal the full forward's within float32 rounding. One compiled program per family
serves every test of it (module-scoped; sampling settings are arguments, not shapes).
"""

import json
import pathlib
import subprocess
import sys

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from zoo import hf
from zoo import generate as gen
from zoo.data.tokenizer import ByteTokenizer

ROOT = pathlib.Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data"
FIXTURES = {
    "llama": DATA / "llama_tiny_a",
    "deepseek_v3": DATA / "dsv3_tiny_a",
    **{name: DATA / "families" / f"{name}_tiny_a" for name in ("qwen2", "qwen3", "qwen3_moe", "mixtral", "gemma3", "gpt_oss")},
}
# Lengths 3 and 10 (> the windows of 8) plus 6 new tokens: one shape bucket, (2 or 1, 16, 16).
PROMPTS = [[5, 17, 101], [200, 3, 77, 150, 9, 64, 33, 250, 18, 120]]
NEW = 6
SEQ = 16
_forward = eqx.filter_jit(lambda model, tokens: model(tokens))

_models: dict = {}
_greedy: dict = {}


def model_of(family: str):
    if family not in _models:
        _models[family] = hf.from_pretrained(FIXTURES[family])
    return _models[family]


def greedy_of(family: str):
    """The batched greedy run of PROMPTS (with logits), once per family."""
    if family not in _greedy:
        _greedy[family] = gen.generate(model_of(family), PROMPTS, NEW, keep_logits=True)
    return _greedy[family]


def full_forward_greedy(model, prompt: list[int], steps: int) -> tuple[list[int], np.ndarray]:
    """Greedy tokens and logits by re-running the whole forward pass on the sequence so far at every
    step (padded at the end to one shape, which causality keeps out of every real position)."""
    tokens, logits = list(prompt), []
    for _ in range(steps):
        padded = np.zeros((1, SEQ), np.int32)
        padded[0, : len(tokens)] = tokens
        row = np.asarray(_forward(model, jnp.asarray(padded)))[0, len(tokens) - 1]
        logits.append(row)
        tokens.append(int(row.argmax()))
    return tokens[len(prompt) :], np.stack(logits)


@pytest.mark.parametrize("family", list(FIXTURES))
def test_cached_greedy_decoding_equals_the_full_forward_at_every_step(family):
    model = model_of(family)
    for prompt, result in zip(PROMPTS, greedy_of(family)):
        tokens, logits = full_forward_greedy(model, prompt, NEW)
        assert result.tokens == tokens, f"{family}: prompt of {len(prompt)} tokens"
        assert not result.stopped
        scale = np.abs(logits).max()
        np.testing.assert_allclose(result.logits, logits, rtol=0, atol=2e-6 * scale * 10, err_msg=family)


@pytest.mark.parametrize("family", ["gpt_oss"])
def test_each_prompt_of_a_batch_gets_its_single_prompt_result(family):
    batched = greedy_of(family)
    for prompt, together in zip(PROMPTS, batched):
        alone = gen.generate(model_of(family), [prompt], NEW, keep_logits=True)[0]
        assert alone.tokens == together.tokens
        np.testing.assert_allclose(alone.logits, together.logits, rtol=0, atol=1e-5)
