"""zoo._compat holds every private JAX / orbax API Zoo uses; each must still be where it looks.

A release that moves one makes Zoo fall back (or fail) quietly at run time; this test fails instead,
naming the symbol, so the move is handled when the dependency is upgraded.

Raising pyproject.toml's upper bound on jax and jaxlib (`<0.11` today: the 0.10.x releases are the
ones tested) is done together with, on the new release: this file passing; tests/test_train_cli.py and
tests/test_checkpoint.py passing (they reach orbax through `orbax_array_metadata_store`);
`xla.cpu_ynn_fusions`' flag still known to the new jaxlib (zoo/train/run.py, YNN_FLAG_JAXLIBS: XLA
refuses to start on an unknown flag); and the residual names `saved_residuals` reports still matched
by the offload policies (tests/test_offload.py).
"""

import os
import pathlib
import re
import subprocess
import sys

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
    assert _compat.linear_call_vmappable(), (
        "jax._src.custom_derivatives.linear_call_p or jax._src.interpreters.batching moved"
    )
    assert _compat.cudnn_version() is None or _compat.cudnn_version() > 0
    with _compat.persistent_cache_bypassed() as bypassed:
        assert bypassed, "jax._src.compilation_cache's _cache_checked / _cache_used / _cache_initialized_mutex moved"
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    seen = []

    def body(a, b):
        seen.append((_compat.varying_axes(a), _compat.varying_axes(b), _compat.varying_axes(a * b)))
        return a * b

    mesh = jax.make_mesh((2, len(jax.devices()) // 2), ("x", "y"))
    specs = (P("x", "y"), P(None, "y"))
    a, b = (
        jax.device_put(jnp.ones(shape), jax.sharding.NamedSharding(mesh, s))
        for shape, s in zip(((4, 8), (1, 8)), specs)
    )
    jax.jit(jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=P("x", "y")))(a, b)
    assert seen == [({"x", "y"}, {"y"}, {"x", "y"})], "zoo._compat.varying_axes: jax moved the shard_map varying axes"
    assert _compat.varying_axes(jnp.ones(3)) == frozenset()


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


def test_linear_call_batching_rule_maps_the_callee_and_its_own_transpose():
    """zoo._compat.linear_call_vmappable: vmap of a linear_call runs the callee per example and, in
    reverse mode, the transpose it was given (here deliberately twice the true one, so that a rule
    that differentiated the callee instead would be caught), for mapped and unmapped operands alike."""
    import jax.numpy as jnp
    import numpy as np
    from jax.custom_derivatives import linear_call

    assert _compat.linear_call_vmappable() is True

    def scale(r, x):  # linear in x, r a residual
        return r * x

    def twice_the_transpose(r, ct):
        return 2 * r * ct

    def f(r, x):
        return linear_call(scale, twice_the_transpose, r, x)

    r = jnp.arange(1.0, 4.0)[:, None] * jnp.ones((3, 5))  # per example
    x = jnp.linspace(-1.0, 1.0, 15).reshape(3, 5)
    np.testing.assert_allclose(jax.vmap(f)(r, x), r * x)
    # per-example gradient through the given transpose
    g = jax.vmap(jax.grad(lambda r, x: f(r, x).sum(), argnums=1))(r, x)
    np.testing.assert_allclose(g, 2 * r)
    # the linear operand shared by every example (unmapped): still one cotangent per example
    g_shared = jax.vmap(jax.grad(lambda r, x: f(r, x).sum(), argnums=1), in_axes=(0, None))(r, x[0])
    np.testing.assert_allclose(g_shared, 2 * r)
    # the residual shared, the linear operand mapped; and vmap inside grad
    g_res_shared = jax.vmap(jax.grad(lambda r, x: (f(r, x) * x).sum(), argnums=1), in_axes=(None, 0))(r[0], x)
    np.testing.assert_allclose(g_res_shared, 2 * r[0] * x + r[0] * x)
    g_outer = jax.grad(lambda x: jax.vmap(f)(r, x).sum())(x)
    np.testing.assert_allclose(g_outer, 2 * r)
    # the transpose's own transpose is the callee again, mapped
    t = jax.vmap(lambda r, x: jax.linear_transpose(lambda x: f(r, x), x)(x)[0])(r, x)
    np.testing.assert_allclose(t, 2 * r * x)


def test_importing_zoo_patches_nothing_in_jax():
    """linear_call's batching rule is registered when a kernel that needs it is first differentiated, not
    when zoo is imported: in a process that imports every zoo module, vmap of a linear_call behaves as
    before the imports (it fails on a jax without a rule of its own)."""
    script = (
        "import importlib, pkgutil\n"
        "import jax, jax.numpy as jnp\n"
        "from jax.custom_derivatives import linear_call\n"
        "def vmappable():\n"
        "    try:\n"
        "        jax.vmap(lambda x: linear_call(lambda r, t: t, lambda r, ct: ct, (), x))(jnp.ones(3))\n"
        "        return 'yes'\n"
        "    except NotImplementedError:\n"
        "        return 'no'\n"
        "before = vmappable()\n"
        "import zoo\n"
        "for m in pkgutil.walk_packages(zoo.__path__, 'zoo.'):\n"
        "    importlib.import_module(m.name)\n"
        "print(before, vmappable())\n"
    )
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    p = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    before, after = p.stdout.split()
    assert after == before, f"importing zoo changed whether linear_call can be vmapped ({before} -> {after})"


def test_pyproject_bounds_jax_to_the_tested_releases():
    """An unbounded jax would let pip install a release whose private APIs moved: the bound must be
    there, and the installed jax must be inside it (else this machine tests a release pyproject refuses)."""
    import importlib.metadata

    text = (ROOT / "pyproject.toml").read_text()
    for name in ("jax", "jaxlib"):
        m = re.search(rf'"{name}>=([\d.]+),<([\d.]+)"', text)
        assert m, (
            f"pyproject.toml: {name} has no upper bound; bound it to the releases tested (see this file's docstring)"
        )
        installed = tuple(int(x) for x in importlib.metadata.version(name).split(".")[:2])
        upper = tuple(int(x) for x in m.group(2).split(".")[:2])
        assert installed < upper, (
            f"{name} {importlib.metadata.version(name)} is installed, pyproject.toml allows <{m.group(2)}: run this "
            "file "
            "and the checks its docstring lists on it, then raise the bound"
        )


def test_scan_counts_reads_both_scan_layouts():
    """A scan's (constants, carries): from this JAX's params, and from the flat tree (`ft_in`) that
    jax 0.11 records instead (zoo.placement reads it to find what a layer stack keeps)."""
    import types

    import jax.numpy as jnp

    def f(w, c0, xs):
        return jax.lax.scan(lambda c, x: (c * w + x, c), c0, xs)

    jaxpr = jax.make_jaxpr(f)(jnp.ones(()), jnp.ones(3), jnp.ones((4, 3)))
    (eqn,) = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "scan"]
    assert _compat.scan_counts(eqn.params) == (1, 1)
    flat = types.SimpleNamespace(unpack=lambda: ([0, 1], [2, 3, 4], [5]))
    assert _compat.scan_counts({"ft_in": flat, "jaxpr": None}) == (2, 3)
