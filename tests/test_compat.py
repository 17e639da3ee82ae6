"""zoo._compat holds every private JAX / orbax API Zoo uses; each must still be where it looks.

A release that moves one makes Zoo fall back (or fail) quietly at run time; this test fails instead,
naming the symbol, so the move is handled when the dependency is upgraded.
"""

import pathlib
import re

import jax

from zoo import _compat

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_every_private_api_is_still_there():
    import importlib

    bridge = importlib.import_module("jax._src.xla_bridge")  # backends_are_initialized's fallback hides a move
    assert callable(bridge.backends_are_initialized), "jax._src.xla_bridge.backends_are_initialized moved"
    jax.devices()
    assert _compat.backends_are_initialized() is True
    env = _compat.cluster_env()
    assert env is not None and callable(env.auto_detect_unset_distributed_params), "jax._src.clusters.ClusterEnv moved"
    fa = _compat.cudnn_fused_attention()
    assert callable(fa.dot_product_attention) and hasattr(fa.MaskType, "CAUSAL"), "jax._src.cudnn moved"
    store = _compat.orbax_array_metadata_store()
    assert store is not None, "orbax.checkpoint._src.metadata.array_metadata_store.Store moved"
    assert callable(_compat.saved_residuals()), "jax._src.ad_checkpoint.saved_residuals moved"
    assert _compat.cudnn_version() is None or _compat.cudnn_version() > 0


def test_no_private_import_outside_compat():
    """`_src` modules are reached through zoo/_compat.py only (code, tests, benchmarks)."""
    private = re.compile(r"\b(jax|orbax\.checkpoint|jaxlib)\._src\b|\bxla_bridge\b")
    found = [
        f"{p.relative_to(ROOT)}:{i}"
        for folder in ("zoo", "tests", "bench")
        for p in sorted((ROOT / folder).rglob("*.py"))
        if p.name != "_compat.py" and p.name != "test_compat.py"
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if private.search(line)
    ]
    assert not found, f"private APIs outside zoo/_compat.py: {found}"
