"""RoPE: frequency rules and both layouts against plain-numpy references.

The references below are written from the formulas of Hugging Face transformers 5
(`modeling_rope_utils._compute_default_rope_parameters`, `_compute_llama3_parameters`,
`_compute_yarn_parameters`) and of `apply_rotary_pos_emb` / `apply_rotary_pos_emb_interleave`,
in float64 with explicit loops where transformers vectorises, so they share no code with zoo.

Note on `factor` under yarn: transformers 4.4x-4.5x overwrote `factor` with
max_position_embeddings / original_max_position_embeddings whenever the latter was given; transformers 5
(which produced tests/data) uses the explicit `factor` and derives it from that ratio only when `factor`
is missing. zoo follows transformers 5 (test_yarn_uses_explicit_factor).
"""

import math

import jax.numpy as jnp
import numpy as np
import pytest

from zoo.config import RopeConfig
from zoo.families import SIZES
from zoo.model import abstract
from zoo.nn.rope import Rope, rope_frequencies, softmax_scale_multiplier

RTOL = 1e-6


# --- references ----------------------------------------------------------------------------


def ref_default(dim, theta):
    return np.array([1.0 / theta ** (2 * i / dim) for i in range(dim // 2)])


def ref_llama3(dim, theta, factor, low_freq_factor, high_freq_factor, original):
    low_freq_wavelen = original / low_freq_factor
    high_freq_wavelen = original / high_freq_factor
    out = []
    for f in ref_default(dim, theta):
        wavelen = 2 * math.pi / f
        if wavelen < high_freq_wavelen:
            out.append(f)
        elif wavelen > low_freq_wavelen:
            out.append(f / factor)
        else:
            smooth = (original / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
            out.append((1 - smooth) * f / factor + smooth * f)
    return np.array(out)


def ref_get_mscale(scale, mscale=1.0):
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def ref_yarn(
    dim,
    theta,
    factor,
    original,
    beta_fast=32.0,
    beta_slow=1.0,
    mscale=None,
    mscale_all_dim=None,
    attention_factor=None,
    truncate=True,
):
    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = ref_get_mscale(factor, mscale) / ref_get_mscale(factor, mscale_all_dim)
        else:
            attention_factor = ref_get_mscale(factor)

    def correction_dim(rotations):
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    out = []
    for i in range(dim // 2):
        pos_freq = theta ** (2 * i / dim)
        ramp = min(max((i - low) / (high - low), 0.0), 1.0)
        extrapolation = 1 - ramp
        out.append((1 / (factor * pos_freq)) * (1 - extrapolation) + (1 / pos_freq) * extrapolation)
    return np.array(out), attention_factor


def ref_rotate_half(x):
    half = x.shape[-1] // 2
    return np.concatenate([-x[..., half:], x[..., :half]], axis=-1)


def ref_apply(x, positions, inv_freq, attention_factor, interleaved):
    """x [B T H D] float64; transformers' apply_rotary_pos_emb(_interleave) for one tensor."""
    freqs = np.outer(positions.astype(np.float64), inv_freq)  # [T, D/2]
    emb = np.concatenate([freqs, freqs], axis=-1)
    cos = (np.cos(emb) * attention_factor)[None, :, None, :]
    sin = (np.sin(emb) * attention_factor)[None, :, None, :]
    if interleaved:
        b, t, h, d = x.shape
        x = x.reshape(b, t, h, d // 2, 2).swapaxes(-1, -2).reshape(b, t, h, d)
    return x * cos + ref_rotate_half(x) * sin


# --- frequencies ---------------------------------------------------------------------------


@pytest.mark.parametrize("dim,theta", [(128, 500000.0), (16, 10000.0), (64, 10000.0)])
def test_default_frequencies(dim, theta):
    inv_freq, attention_factor = rope_frequencies(dim, RopeConfig(theta=theta), 2048)
    np.testing.assert_allclose(inv_freq, ref_default(dim, theta), rtol=RTOL)
    assert attention_factor == 1.0


def test_llama3_frequencies_llama31_8b():
    c = RopeConfig(
        type="llama3",
        theta=500000.0,
        factor=8.0,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=8192,
    )
    inv_freq, attention_factor = rope_frequencies(128, c, 131072)
    expected = ref_llama3(128, 500000.0, 8.0, 1.0, 4.0, 8192)
    np.testing.assert_allclose(inv_freq, expected, rtol=RTOL)
    assert attention_factor == 1.0
    # All three bands are exercised: kept, divided by factor, and blended.
    default = ref_default(128, 500000.0)
    ratio = expected / default
    assert np.any(np.isclose(ratio, 1.0)) and np.any(np.isclose(ratio, 1 / 8.0))
    assert np.any((ratio < 0.99) & (ratio > 1 / 8.0 + 0.01))


def test_llama3_frequencies_match_the_sizes_config():
    c = SIZES["llama3.1_8b"]
    inv_freq, _ = rope_frequencies(c.rope_dim, c.rope, c.max_position_embeddings)
    np.testing.assert_allclose(inv_freq, ref_llama3(128, 500000.0, 8.0, 1.0, 4.0, 8192), rtol=RTOL)


YARN_CASES = {
    # DeepSeek-V3's rope_scaling: mscale == mscale_all_dim, so cos/sin are not scaled.
    "dsv3": dict(mscale=1.0, mscale_all_dim=1.0),
    "mscale_all_dim_0.707": dict(mscale=1.0, mscale_all_dim=0.707),
    "no_mscale": dict(),
    "no_truncate": dict(mscale=1.0, mscale_all_dim=0.707, truncate=False),
    "explicit_attention_factor": dict(attention_factor=0.8),
    "other_betas": dict(beta_fast=16.0, beta_slow=2.0),
}


@pytest.mark.parametrize("case", sorted(YARN_CASES))
def test_yarn_frequencies(case):
    kw = YARN_CASES[case]
    c = RopeConfig(
        type="yarn", theta=10000.0, interleaved=True, factor=40.0, original_max_position_embeddings=4096, **kw
    )
    inv_freq, attention_factor = rope_frequencies(64, c, 163840)
    expected, expected_factor = ref_yarn(64, 10000.0, 40.0, 4096, **kw)
    np.testing.assert_allclose(inv_freq, expected, rtol=RTOL)
    assert attention_factor == pytest.approx(expected_factor, rel=RTOL)


def test_yarn_attention_factors_differ_between_cases():
    # Guards the case table itself: the three mscale settings give three different factors.
    factors = {
        case: rope_frequencies(
            64, RopeConfig(type="yarn", factor=40.0, original_max_position_embeddings=4096, **YARN_CASES[case]), 163840
        )[1]
        for case in ("dsv3", "mscale_all_dim_0.707", "no_mscale")
    }
    assert factors["dsv3"] == pytest.approx(1.0)
    assert factors["no_mscale"] == pytest.approx(0.1 * math.log(40.0) + 1.0)
    assert len({round(f, 9) for f in factors.values()}) == 3


def test_yarn_truncate_changes_the_ramp():
    kw = dict(type="yarn", factor=40.0, original_max_position_embeddings=4096)
    a, _ = rope_frequencies(64, RopeConfig(truncate=True, **kw), 163840)
    b, _ = rope_frequencies(64, RopeConfig(truncate=False, **kw), 163840)
    assert not np.allclose(a, b, rtol=1e-9)


def test_yarn_uses_explicit_factor():
    # max_position_embeddings / original = 2, factor = 40: transformers 5 uses 40.
    c = RopeConfig(type="yarn", factor=40.0, original_max_position_embeddings=4096, mscale=1.0, mscale_all_dim=0.707)
    inv_freq, attention_factor = rope_frequencies(64, c, 8192)
    expected, expected_factor = ref_yarn(64, 10000.0, 40.0, 4096, mscale=1.0, mscale_all_dim=0.707)
    np.testing.assert_allclose(inv_freq, expected, rtol=RTOL)
    assert attention_factor == pytest.approx(expected_factor, rel=RTOL)


def test_yarn_without_original_uses_max_position_embeddings():
    # transformers' standardize_rope_params fills original_max_position_embeddings from max_position_embeddings.
    c = RopeConfig(type="yarn", factor=4.0)
    inv_freq, attention_factor = rope_frequencies(64, c, 2048)
    expected, expected_factor = ref_yarn(64, 10000.0, 4.0, 2048)
    np.testing.assert_allclose(inv_freq, expected, rtol=RTOL)
    assert attention_factor == pytest.approx(expected_factor, rel=RTOL)


def test_deepseek_v3_671b_frequencies():
    c = SIZES["deepseek_v3_671b"]
    inv_freq, attention_factor = rope_frequencies(c.rope_dim, c.rope, c.max_position_embeddings)
    expected, expected_factor = ref_yarn(64, 10000.0, 40.0, 4096, mscale=1.0, mscale_all_dim=1.0)
    np.testing.assert_allclose(inv_freq, expected, rtol=RTOL)
    assert attention_factor == pytest.approx(expected_factor, rel=RTOL)


# --- softmax scale -------------------------------------------------------------------------


def deepseek_yarn_get_mscale(scale=1.0, mscale=1.0):
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


@pytest.mark.parametrize(
    "kw,expected",
    [
        (dict(type="yarn", factor=40.0, mscale=1.0, mscale_all_dim=1.0), deepseek_yarn_get_mscale(40.0, 1.0) ** 2),
        (dict(type="yarn", factor=40.0, mscale=1.0, mscale_all_dim=0.707), deepseek_yarn_get_mscale(40.0, 0.707) ** 2),
        (dict(type="yarn", factor=8.0, mscale_all_dim=0.5), deepseek_yarn_get_mscale(8.0, 0.5) ** 2),
        (dict(type="yarn", factor=1.0, mscale_all_dim=1.0), 1.0),
        (dict(type="yarn", factor=40.0), 1.0),  # no mscale_all_dim: DeepSeek leaves the scale alone
        (dict(type="default"), 1.0),
    ],
)
def test_softmax_scale_multiplier(kw, expected):
    assert softmax_scale_multiplier(RopeConfig(**kw)) == pytest.approx(expected, rel=1e-12)


def test_mla_softmax_scale_of_deepseek_v3_671b():
    c = SIZES["deepseek_v3_671b"]
    attn = abstract(c).stack("moe_layers").layers[0].attn
    expected = (128 + 64) ** -0.5 * deepseek_yarn_get_mscale(40.0, 1.0) ** 2
    assert attn.softmax_scale == pytest.approx(expected, rel=1e-12)
    assert expected != pytest.approx((128 + 64) ** -0.5)


# --- applying the rotation -----------------------------------------------------------------

POSITIONS = np.array([0, 1, 2, 5, 17, 63, 100, 127], dtype=np.int32)

LAYOUT_CASES = {
    "half_default": (16, RopeConfig(theta=10000.0)),
    "interleaved_default": (8, RopeConfig(theta=10000.0, interleaved=True)),
    "half_llama3": (32, RopeConfig(type="llama3", theta=500000.0, factor=8.0, original_max_position_embeddings=64)),
    "interleaved_yarn": (
        16,
        RopeConfig(type="yarn", interleaved=True, factor=40.0, original_max_position_embeddings=64),
    ),
}


def _rope_and_input(case, seed=0):
    dim, c = LAYOUT_CASES[case]
    rope = Rope(dim, c, 128)
    x = np.random.default_rng(seed).normal(size=(2, len(POSITIONS), 3, dim))
    return rope, x


@pytest.mark.parametrize("case", sorted(LAYOUT_CASES))
def test_rope_call_matches_reference(case):
    rope, x = _rope_and_input(case)
    inv_freq, attention_factor = rope_frequencies(rope.dim, rope.config, 128)
    expected = ref_apply(x, POSITIONS, inv_freq, attention_factor, rope.config.interleaved)
    got = np.asarray(rope(jnp.asarray(x, jnp.float32), jnp.asarray(POSITIONS)))
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4)


def test_layouts_differ():
    # The two layouts are different functions (so the reference comparison above can tell them apart).
    x = np.random.default_rng(1).normal(size=(1, len(POSITIONS), 1, 8)).astype(np.float32)
    half = Rope(8, RopeConfig(), 128)(jnp.asarray(x), jnp.asarray(POSITIONS))
    inter = Rope(8, RopeConfig(interleaved=True), 128)(jnp.asarray(x), jnp.asarray(POSITIONS))
    assert not np.allclose(np.asarray(half), np.asarray(inter), atol=1e-3)


@pytest.mark.parametrize("case", sorted(LAYOUT_CASES))
def test_rotation_preserves_norm_up_to_attention_factor(case):
    rope, x = _rope_and_input(case, seed=2)
    _, attention_factor = rope_frequencies(rope.dim, rope.config, 128)
    got = np.asarray(rope(jnp.asarray(x, jnp.float32), jnp.asarray(POSITIONS)))
    np.testing.assert_allclose(np.linalg.norm(got, axis=-1), attention_factor * np.linalg.norm(x, axis=-1), rtol=1e-5)


@pytest.mark.parametrize("case", sorted(LAYOUT_CASES))
def test_scores_depend_only_on_relative_position(case):
    dim, c = LAYOUT_CASES[case]
    rope = Rope(dim, c, 128)
    rng = np.random.default_rng(3)
    seq = 24
    q, k = rng.normal(size=(2, dim)).astype(np.float32)
    positions = jnp.arange(seq, dtype=jnp.int32)
    q_rot = np.asarray(rope(jnp.broadcast_to(jnp.asarray(q), (1, seq, 1, dim)), positions))[0, :, 0]
    k_rot = np.asarray(rope(jnp.broadcast_to(jnp.asarray(k), (1, seq, 1, dim)), positions))[0, :, 0]
    scores = q_rot.astype(np.float64) @ k_rot.T.astype(np.float64)  # [m, n] = q at m . k at n
    for offset in (-7, -1, 0, 3, 11):
        diagonal = np.diagonal(scores, offset=offset)
        np.testing.assert_allclose(diagonal, np.full_like(diagonal, diagonal[0]), rtol=1e-4, atol=1e-4)
    # and it does depend on the relative position
    assert abs(scores[0, 0] - scores[5, 0]) > 1e-3


# --- the reference data of tests/data --------------------------------------------------------


@pytest.mark.parametrize("name", ["llama_tiny_a", "dsv3_tiny_a"])
def test_matches_transformers_reference(name, ref_dir):
    extras = np.load(ref_dir(name) / "extras.npz")
    c = SIZES[name]
    inv_freq, _ = rope_frequencies(c.rope_dim, c.rope, c.max_position_embeddings)
    np.testing.assert_allclose(inv_freq, extras["rope_inv_freq"], rtol=1e-6)
    seq = extras["rope_cos"].shape[0]
    cos, sin = Rope(c.rope_dim, c.rope, c.max_position_embeddings).cos_sin(jnp.arange(seq, dtype=jnp.int32))
    # transformers lays cos/sin out as [freqs | freqs]
    np.testing.assert_allclose(np.tile(np.asarray(cos), 2), extras["rope_cos"], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.tile(np.asarray(sin), 2), extras["rope_sin"], rtol=1e-5, atol=1e-6)
