"""Sampling with a KV cache (zoo.tools.generate, CausalLM.prefill / decode_step, zoo.nn.cache).

Every family's reference checkpoint (tests/data) generates greedily from two prompts of different
lengths, one longer than the sliding windows (8) of Gemma 3 and GPT-OSS, so the ring caches wrap;
the tokens must be what re-running the full forward pass at every step picks, and the logits the
cache gave must equal the full forward's within float32 rounding. One compiled program per family
serves every test of it (module-scoped; sampling settings are arguments, not shapes).
"""

import pathlib
import re
import subprocess
import sys

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from zoo import backend, families, hf
from zoo import sampling as gen
from zoo.data.tokenizer import ByteTokenizer
from zoo.tools import generate as gen_cli

from tiers import by_family

ROOT = pathlib.Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data"
FIXTURES = {
    "llama": DATA / "llama_tiny_a",
    "deepseek_v3": DATA / "dsv3_tiny_a",
    # every other family: its *_tiny_a fixture, or (a registered family) the first of its fixtures
    **{
        name: sorted((DATA / "families").glob(f"{name}_tiny_*"))[0]
        for name in families.names()
        if name not in ("llama", "deepseek_v3")
    },
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


def prompts_of(family: str) -> list[list[int]]:
    """PROMPTS within the family fixture's vocabulary (the same ids for the 256-token `*_tiny_a` ones; a
    registered family's fixture from tests/make_fixtures.py may have 128)."""
    vocab = model_of(family).config.vocab_size
    return [[t % vocab for t in p] for p in PROMPTS]


def greedy_of(family: str):
    """The batched greedy run of PROMPTS (with logits), once per family."""
    if family not in _greedy:
        _greedy[family] = gen.generate(model_of(family), prompts_of(family), NEW, keep_logits=True)
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


@pytest.mark.parametrize("family", by_family(FIXTURES))
def test_cached_greedy_decoding_equals_the_full_forward_at_every_step(family):
    model = model_of(family)
    for prompt, result in zip(prompts_of(family), greedy_of(family)):
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


def _instructions_making(hlo: str, shape: tuple[int, ...], dtype: str, ops: tuple[str, ...]) -> list[str]:
    """The HLO instructions (fused or not) whose result is a `dtype[shape]` array made by one of `ops`."""
    made = re.compile(rf"= {dtype}\[{','.join(map(str, shape))}\]\{{[^}}]*\}} ({'|'.join(ops)})\(")
    return [line.strip()[:160] for line in hlo.splitlines() if made.search(line)]


@pytest.mark.parametrize("unstacked", [False, True], ids=["scan", "unstacked"])
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_a_decode_step_updates_the_cache_in_place_without_copying_it_whole(family, unstacked):
    """The layer scan (or the unrolled layers) carries the cache and writes each layer's slice into
    it; as a scan output it made a fresh whole-cache buffer (a broadcast) and copied it out (copies)
    every token. Unrolled over weights sliced out beforehand (what generate's token loop runs on
    CPU), no layer's weights are sliced out of a stack in the step."""
    model = model_of(family)
    params, static = eqx.partition(model, eqx.is_array)
    _, cache = jax.jit(lambda p: eqx.combine(p, static).prefill(jnp.ones((1, SEQ), jnp.int32), jnp.array([3]), 64))(
        params
    )
    layers = [stack.unstack() for stack in model.stacks] if unstacked else None
    step = jax.jit(lambda p, t, c, layers: eqx.combine(p, static).decode_step(t, c, layers), donate_argnums=2)
    hlo = step.lower(params, jnp.zeros((1,), jnp.int32), cache, layers).compile().as_text()
    # [layers, batch, slots, ...]; a one-layer stack's whole cache has a layer's shape, which the scan reads
    leaves = [x for x in jax.tree_util.tree_leaves(cache.stacks) if x.shape[0] > 1]
    assert leaves
    whole = sorted({line for x in leaves for line in _instructions_making(hlo, x.shape, "f32", ("copy", "broadcast"))})
    if unstacked:  # XLA still copies one of the keys' / values' caches in and out (an open item), not more
        assert len(whole) <= 2 and not any("broadcast" in line for line in whole), f"{family}: {whole}"
    else:
        assert not whole, f"{family}: the decode step makes a whole cache: {whole}"
    assert _instructions_making(
        hlo, leaves[0].shape, "f32", ("dynamic-update-slice",)
    )  # the check sees the cache's ops
    up = model.stacks[0].layers[0].ffn.w_up  # [layers, embed, mlp]
    sliced = _instructions_making(hlo, up.shape[1:], "f32", ("dynamic-slice", "slice", "copy", "fusion"))
    assert bool(sliced) != unstacked, sliced  # the scan slices a layer's w_up out every step, the unrolled step never
    assert backend.choices("cpu").decode_unstacks_layers and not backend.choices("gpu").decode_unstacks_layers


def test_decode_compile_options_turn_llvm_optimisations_on_for_large_models_on_cpu():
    level0 = {"xla_backend_optimization_level": 0}
    assert gen.decode_compile_options("cpu", 494e6) is None  # Qwen2.5-0.5B: XLA's default level
    assert gen.decode_compile_options("cpu", 1e5) == level0  # the tiny models: the faster compile
    assert gen.decode_compile_options("cpu", 494e6, True) == level0
    assert gen.decode_compile_options("cpu", 1e5, False) is None
    assert gen.decode_compile_options("gpu", 1e5, True) is None
    with pytest.raises(gen.GenerationError, match=r"^cpu_fast_compile: got 'sometimes'; give true, false or auto$"):
        gen.decode_compile_options("cpu", 1e5, "sometimes")


# --- sampling rules, stop tokens, one compile per bucket (llama's program) ------------------------


def nucleus(logits: np.ndarray, temperature: float, top_p: float) -> set[int]:
    """The smallest most-likely set whose probability reaches top_p, in float64 (independent of zoo)."""
    z = logits.astype(np.float64) / temperature
    p = np.exp(z - z.max())
    p /= p.sum()
    order = np.argsort(-p, kind="stable")
    before = np.cumsum(p[order]) - p[order]
    return set(order[before < top_p].tolist())


def test_sampling_obeys_top_k_top_p_and_temperature_and_compiles_nothing_new():
    model = model_of("llama")
    greedy = greedy_of("llama")
    compiled = len(gen.compiled_buckets())
    top1 = gen.generate(model, PROMPTS, NEW, temperature=1.3, top_k=1, seed=4, keep_logits=True)
    assert [r.tokens for r in top1] == [r.tokens for r in greedy]
    draws = []
    for seed in range(3):
        for r in gen.generate(model, PROMPTS, NEW, temperature=1.5, top_k=3, seed=seed, keep_logits=True):
            for token, row in zip(r.tokens, r.logits):
                assert token in np.argsort(-row)[:3]
                draws.append(token)
        for r in gen.generate(model, PROMPTS, NEW, temperature=0.8, top_p=0.5, seed=seed, keep_logits=True):
            for token, row in zip(r.tokens, r.logits):
                assert token in nucleus(row, 0.8, 0.5)
    assert len(set(draws)) > 2 * NEW  # sampling happened: not one fixed continuation
    again = gen.generate(model, PROMPTS, NEW, temperature=1.5, top_k=3, seed=2)
    assert [r.tokens for r in again] == [
        r.tokens for r in gen.generate(model, PROMPTS, NEW, temperature=1.5, top_k=3, seed=2)
    ]
    # Other settings, prompts and max_new_tokens within the bucket: nothing new compiled
    # (keep_logits=False is its own program, compiled once for the two calls just above).
    gen.generate(model, [[1, 2], [3] * 9], 4, temperature=0.5, top_p=0.9, seed=9, keep_logits=True)
    assert len(gen.compiled_buckets()) == compiled + 1


def test_sample_tokens_draws_from_the_renormalised_distribution():
    probs = np.array([0.4, 0.25, 0.15, 0.1, 0.06, 0.04])
    rows = 4000
    logits = jnp.asarray(np.tile(np.log(probs), (rows, 1)), jnp.float32)
    keys = jax.random.split(jax.random.key(0), rows)
    draw = jax.jit(gen.sample_tokens)

    def freq(temperature, top_k, top_p):
        tokens = np.asarray(draw(logits, keys, jnp.float32(temperature), jnp.int32(top_k), jnp.float32(top_p)))
        return np.bincount(tokens, minlength=len(probs)) / rows

    def expect(p):
        return p / p.sum()

    np.testing.assert_allclose(freq(1.0, 0, 1.0), probs, atol=0.03)
    np.testing.assert_allclose(freq(0.5, 0, 1.0), expect(probs**2), atol=0.03)  # p^(1/T)
    np.testing.assert_allclose(freq(1.0, 2, 1.0), expect(probs * [1, 1, 0, 0, 0, 0]), atol=0.03)
    # 0.4 + 0.25 < 0.75 <= 0.4 + 0.25 + 0.15: the nucleus is the three most likely tokens.
    np.testing.assert_allclose(freq(1.0, 0, 0.75), expect(probs * [1, 1, 1, 0, 0, 0]), atol=0.03)
    assert (freq(0.0, 0, 1.0) == [1, 0, 0, 0, 0, 0]).all()  # temperature 0: greedy


def test_a_stop_token_ends_its_row_and_a_batch_whose_rows_all_stopped():
    model = model_of("llama")
    greedy = [r.tokens for r in greedy_of("llama")]
    stop = greedy[0][2]
    results = gen.generate(model, PROMPTS, NEW, stop_tokens=[stop], keep_logits=True)
    for tokens, r in zip(greedy, results):
        end = tokens.index(stop) + 1 if stop in tokens else len(tokens)
        assert r.tokens == tokens[:end] and r.stopped == (stop in tokens)
    assert results[0].stopped and len(results[0].tokens) <= 3
    # Every row's first token stops it: the loop ends at once.
    first = gen.generate(model, PROMPTS, NEW, stop_tokens=[greedy[0][0], greedy[1][0]], keep_logits=True)
    assert [r.tokens for r in first] == [t[:1] for t in greedy] and all(r.stopped for r in first)


def test_text_prompts_through_a_tokenizer():
    model = model_of("llama")
    tok = ByteTokenizer()
    prompt = bytes(PROMPTS[1]).decode("latin-1")
    assert tok.encode(prompt).tolist() != PROMPTS[1]  # latin-1 characters >= 128 are two UTF-8 bytes
    results = gen.generate(model, ["To be", "or not"], NEW, tokenizer=tok, stop_tokens=[], keep_logits=True)
    assert [r.prompt for r in results] == [list(b"To be"), list(b"or not")]
    assert all(r.text == tok.decode(r.tokens) and len(r.tokens) == NEW for r in results)


def test_moe_capacity_models_decode_dropless():
    model = model_of("mixtral")
    capacity = hf.from_pretrained(FIXTURES["mixtral"], moe_impl="capacity")
    assert capacity.config.moe.impl == "capacity"
    padded = jnp.asarray([PROMPTS[1] + [0] * (SEQ - len(PROMPTS[1]))] * 2)
    assert not np.allclose(_forward(capacity, padded), _forward(model, padded), atol=1e-3)  # its buffers drop tokens
    converted = gen.dropless(capacity)
    assert converted.config == model.config  # so it runs the program compiled for `model`
    for a, b in zip(jax.tree_util.tree_leaves(converted), jax.tree_util.tree_leaves(model)):
        np.testing.assert_array_equal(a, b)
    assert [r.tokens for r in gen.generate(capacity, PROMPTS, NEW, keep_logits=True)] == [
        r.tokens for r in greedy_of("mixtral")
    ]


# --- bad input ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (
            dict(prompts=[[1] * 128]),
            r"^prompt: the prompt has 128 tokens but the model's max_position_embeddings allows 128 "
            r"positions.*shorten it to at most 127",
        ),
        (
            dict(prompts=[[1] * 120], max_new_tokens=20),
            r"^max_new_tokens: 20 new tokens after the prompt's 120 tokens pass the 128 positions.*max_new_tokens<=8",
        ),
        (dict(prompts=[[1] * 20], max_len=16), r"^prompt: the prompt has 20 tokens but max_len allows 16 positions"),
        (dict(prompts=[[1, 2], []]), r"^prompt: prompt 1 is empty"),
        (dict(prompts=[]), r"^prompt: no prompt given"),
        (dict(prompts=[[1, 256]]), r"^prompt: the prompt has token id 256 outside the model's vocabulary 0..255"),
        (dict(prompts=["text"]), r"^prompt: text prompts need a tokenizer"),
        (dict(max_new_tokens=0), r"^max_new_tokens: must be a whole number >= 1, got 0"),
        (dict(temperature=-0.5), r"^temperature: must be a finite number >= 0"),
        (dict(temperature=float("nan")), r"^temperature: must be a finite number >= 0"),
        (dict(top_k=-1), r"^top_k: must be a whole number >= 0"),
        (dict(top_p=0.0), r"^top_p: must be in \(0, 1\]"),
        (dict(top_p=1.5), r"^top_p: must be in \(0, 1\]"),
        (dict(stop_tokens=[300]), r"^stop_tokens: id 300 is outside the model's vocabulary"),
    ],
)
def test_bad_requests_are_refused_in_one_line_before_compiling(kwargs, message):
    model = model_of("llama")
    compiled = len(gen.compiled_buckets())
    kwargs = {"prompts": [[1, 2, 3]], **kwargs}
    with pytest.raises(gen.GenerationError, match=message) as e:
        gen.generate(model, **kwargs)
    assert "\n" not in str(e.value) and ";" in str(e.value)
    assert len(gen.compiled_buckets()) == compiled


def _cli(*args, timeout=600):
    return subprocess.run(
        [sys.executable, "-m", "zoo.tools.generate", *args], capture_output=True, text=True, cwd=ROOT, timeout=timeout
    )


def test_cli_bad_input_exits_2_with_one_line_before_compiling():
    llama = "model.path=tests/data/llama_tiny_a"
    for args, message in [
        (
            (llama, "tokenizer=bytes", "prompt=" + "x" * 130),
            "error: prompt: the prompt has 130 tokens but the model's max_position_embeddings allows 128",
        ),
        (
            (llama, "prompt=hi"),
            "error: tokenizer: tests/data/llama_tiny_a has no tokenizer.json; give tokenizer=<a tokenizer.json>, or "
            "tokenizer=bytes",
        ),
        ((llama, "tokenizer=bytes", "prompt="), "error: prompt: the prompt is empty"),
        ((llama, "tokenizer=bytes", "prompt=hi", "top_p=2"), "error: top_p: must be in (0, 1]"),
        ((llama, "tokenizer=bytes", "prompt=hi", "temperature=hot"), "error: temperature: "),
        (
            (llama, "tokenizer=bytes", "prompt=hi", "topk=3"),
            "error: topk: unknown key; the keys are prompt, model.path",
        ),
        (
            (llama, "tokenizer=bytes", "prompt=hi", "model.dtype=bf16"),
            "error: model.dtype: got 'bf16'; choose one of float32, bfloat16, float16",
        ),
        (("prompt=hi",), "error: model.path: give exactly one of model.path="),
        (("model.path=tests/data/nowhere", "prompt=hi"), "error: tests/data/nowhere: not a directory"),
        (
            ("checkpoint.dir=tests/data/nowhere", "prompt=hi"),
            "does not exist; give the checkpoint.dir of a train.py run",
        ),
    ]:
        out = gen_cli.main(list(args)) if args[0] != llama or "x" * 130 not in args[-1] else None
        if out is None:  # one through a real process: the exit code and stderr as a shell sees them
            proc = _cli(*args)
            out, err = proc.returncode, proc.stderr
            assert proc.stdout == "" and err.count("\n") == 1, err
            assert (
                "\n  " + err.strip() + "\n" in (ROOT / "docs" / "sampling.md").read_text()
            )  # the line docs/sampling.md shows
        else:
            _, err = _captured.pop()
        assert out == 2 and message in err, (args, err)


def test_cli_refuses_a_tokenizer_larger_than_the_models_vocabulary(tmp_path):
    from test_hf_train import write_tokenizer

    big = write_tokenizer(tmp_path / "big.json", 300)
    code = gen_cli.main(["model.path=tests/data/llama_tiny_a", f"tokenizer={big}", "prompt=hi"])
    _, err = _captured.pop()
    assert code == 2 and err.count("\n") == 1, err
    assert (
        err.startswith("error: tokenizer: ")
        and "has 300 token ids but the model's vocabulary has 256; give the model's own tokenizer" in err
    )


_captured: list = []


@pytest.fixture(autouse=True)
def _capture(capsys):
    """gen_cli.main's (stdout, stderr), one entry per call, for the in-process CLI checks."""
    real = gen_cli.main

    def main(argv):
        code = real(argv)
        out = capsys.readouterr()
        _captured.append((out.out, out.err))
        return code

    gen_cli.main = main
    yield
    gen_cli.main = real


# --- the command line ---------------------------------------------------------------------------

README_COMMAND = ["model.path=tests/data/llama_tiny_a", "tokenizer=bytes", "prompt=To be, or not", "max_new_tokens=12"]


def test_cli_samples_from_a_hugging_face_directory_as_the_readme_shows(monkeypatch):
    monkeypatch.chdir(ROOT)
    assert gen_cli.main(README_COMMAND) == 0  # in process: the exit code and stderr through a shell are checked above
    out, err = _captured.pop()
    readme = (ROOT / "docs" / "sampling.md").read_text()
    command = "$ python -m zoo.tools.generate " + " ".join(
        a if " " not in a else a.replace("=", '="', 1) + '"' for a in README_COMMAND
    )
    assert command in readme
    shown = readme.split(command + "\n", 1)[1].split("```", 1)[0]
    # the completion as pasted there, before the last stderr line, as the tool prints them
    assert shown.splitlines()[-2:] == [out.rstrip("\n"), shown.splitlines()[-1]] and shown.splitlines()[-1].startswith(
        "12 new tokens in "
    )
    expected = gen.generate(model_of("llama"), ["To be, or not"], 12, tokenizer=ByteTokenizer(), stop_tokens=[1])[0]
    assert out == "To be, or not" + expected.text + "\n"
    assert "12 new tokens in" in err and "ended by a stop token [1]" in err  # config.json's eos_token_id


def test_cli_samples_from_a_train_py_checkpoint(tmp_path):
    from hydra import compose, initialize_config_dir

    from zoo.train.checkpoint import Checkpoints, restore_model
    from zoo.train.run import prepare
    from zoo.train.step import Trainer

    overrides = [
        "model=llama_tiny_a",
        "mesh=single",
        "data=text",
        "data.batch_size=2",
        "data.seq_len=16",
        f"checkpoint.dir={tmp_path / 'ckpt'}",
    ]
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        c, plan, devices, _ = prepare(compose("config", overrides=overrides))
    trainer = Trainer(c, plan, devices)
    ckpt = Checkpoints(c, plan, trainer)
    ckpt.save(3, trainer.init(seed=5))
    ckpt.close()
    model, _ = restore_model(tmp_path / "ckpt")
    expected = gen.generate(model, ["ROMEO:"], 5, tokenizer=ByteTokenizer())[0]  # text data: UTF-8 bytes, eos 0

    assert gen_cli.main([f"checkpoint.dir={tmp_path / 'ckpt'}", "prompt=ROMEO:", "max_new_tokens=5"]) == 0
    out, err = _captured.pop()
    assert out == "ROMEO:" + expected.text + "\n"
    assert f"model llama from {tmp_path / 'ckpt'}" in err and "ByteTokenizer" in err
    assert gen_cli.main([f"checkpoint.dir={tmp_path / 'ckpt'}", "checkpoint.step=2", "prompt=ROMEO:"]) == 2
    assert "no complete checkpoint of step 2; it holds steps 3" in _captured.pop()[1]


def test_the_readme_python_example_runs(capsys, monkeypatch):
    readme = (ROOT / "docs" / "sampling.md").read_text()
    code = readme.split("```python\n", 1)[1].split("```", 1)[0]
    monkeypatch.chdir(ROOT)
    exec(code, {})
    texts, tokens, stopped = zip(*eval(capsys.readouterr().out))
    assert len(texts) == 2 and all(len(t) <= 3 for t in tokens) and all(isinstance(s, bool) for s in stopped)
    assert list(texts) == [ByteTokenizer().decode(t[:-1] if s else t) for t, s in zip(tokens, stopped)]
