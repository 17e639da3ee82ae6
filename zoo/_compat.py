"""Every private JAX / orbax API Zoo reaches into, in one place.

Private modules (`jax._src...`, `orbax.checkpoint._src...`) move between releases without notice.
Zoo uses a public API wherever one exists (`jax.extend.core` for jaxprs, `jax.ad_checkpoint`,
`jax.nn.dot_product_attention`); what is left has no public equivalent and lives here, each with
what it is for and what Zoo does when it is gone. `tests/test_compat.py` asks for every one of them
and fails, naming the symbol, when a release moves it, so a move is found by the test suite rather
than by a user whose fallback quietly took over.
"""

import contextlib
from collections.abc import Iterator
from typing import Any, Optional


def backends_are_initialized() -> bool:
    """Whether JAX has started its backends in this process (XLA flags and `jax.distributed` must be
    set before that). No public API tells without starting them; if the private one moves, assume
    started, which makes train.py refuse a second job with other XLA flags instead of ignoring them."""
    try:
        from jax._src import xla_bridge
    except ImportError:  # pragma: no cover - moved: see tests/test_compat.py
        return True
    return bool(xla_bridge.backends_are_initialized())


@contextlib.contextmanager
def persistent_cache_bypassed() -> Iterator[bool]:
    """Compiles inside the block skip JAX's persistent compilation cache (JAX_COMPILATION_CACHE_DIR),
    neither reading nor writing it: a program served from the cache is not compiled, so XLA writes
    none of the dumps `zoo.hlo.compile_with_partitioned_hlo` reads. JAX decides once per process
    whether the cache is used (`compilation_cache.is_cache_used`) and has no public switch for one
    compile. Yields False if the private state moved (the block then runs with the cache as it is)."""
    try:
        from jax._src import compilation_cache as cache
    except ImportError:  # pragma: no cover - moved: see tests/test_compat.py
        yield False
        return
    if not all(
        hasattr(cache, a) for a in ("_cache_checked", "_cache_used", "_cache_initialized_mutex")
    ):  # pragma: no cover
        yield False
        return
    with cache._cache_initialized_mutex:
        saved = cache._cache_checked, cache._cache_used
        cache._cache_checked, cache._cache_used = True, False
    try:
        yield True
    finally:
        with cache._cache_initialized_mutex:
            cache._cache_checked, cache._cache_used = saved


def cluster_env() -> Optional[Any]:
    """JAX's cluster detection (`ClusterEnv`: SLURM, Open MPI, ...), which `jax.distributed.initialize`
    runs on unset arguments; None if it moved (zoo.train.distributed then reads SLURM's variables)."""
    try:
        from jax._src.clusters import ClusterEnv
    except ImportError:  # pragma: no cover
        return None
    return ClusterEnv


def cudnn_version() -> Optional[int]:
    """The cuDNN version JAX's CUDA plugin loaded (e.g. 91000), None without one (or if it moved)."""
    try:
        from jax._src.lib import cuda_versions
    except ImportError:  # pragma: no cover
        return None
    try:
        return cuda_versions.cudnn_get_version() if cuda_versions is not None else None
    except Exception:  # noqa: BLE001 - a missing or broken plugin means "unknown", not an error here
        return None


def cudnn_fused_attention():
    """JAX's cuDNN attention module (`dot_product_attention`, `MaskType`). The public
    `jax.nn.dot_product_attention` refuses a value head dim unlike the query/key one (MLA) and
    segment ids with a static bound; this one takes both. Raises ImportError if it moved."""
    from jax._src.cudnn import fused_attention_stablehlo

    return fused_attention_stablehlo


def orbax_array_metadata_store() -> Optional[Any]:
    """The per-array metadata store orbax's default `ArrayHandler` uses (passed explicitly when Zoo
    builds its own handler registry); None if it moved (orbax then writes no such metadata)."""
    try:
        from orbax.checkpoint._src.metadata.array_metadata_store import Store
    except ImportError:  # pragma: no cover
        return None
    return Store()


def saved_residuals():
    """`saved_residuals(f, *args)`: what a function's backward pass keeps (JAX's own count; the public
    API only prints it, `jax.ad_checkpoint.print_saved_residuals`). Tests hold zoo.tools.inspect_step to it."""
    from jax._src.ad_checkpoint import saved_residuals as fn

    return fn


def linear_call_vmappable() -> bool:
    """Give `jax.custom_derivatives.linear_call` a batching rule, which jax (0.10) lacks, so that
    `jax.vmap` works through Zoo's kernels whose reverse mode is a `linear_call` (the blockwise
    attention's custom JVP): without it, `jax.vmap(jax.grad(loss))` (per-example gradients) fails with
    "Batching rule for 'linear_call' not implemented". Returns whether linear_call can be vmapped now
    (True too where jax has a rule of its own, which is then left in place; False if the private
    modules moved, and vmap fails as before: tests/test_compat.py names the move).

    The rule maps the callee and, lazily, the transpose with `batch_jaxpr`; the linear operands and all
    outputs are made mapped (a linear operand that was not is broadcast), so the mapped transpose,
    fed mapped cotangents, returns cotangents shaped as its operands. Constants the transpose closes
    over are taken as unmapped (Zoo's transposes close over static values only).

    Called by the JVP rules that emit a linear_call, when they are first traced, never at import:
    importing zoo leaves JAX's tables as they were."""
    try:
        from jax._src.custom_derivatives import linear_call_p
        from jax._src.interpreters import batching
    except ImportError:  # pragma: no cover - moved: see tests/test_compat.py
        return False
    if linear_call_p in batching.fancy_primitive_batchers:
        return True

    def rule(axis_data, args, dims, *, callee, transpose_thunk, num_callee_consts, num_res):
        fixed = num_callee_consts + num_res
        mapped = [d is not None for d in dims[:fixed]] + [True] * (len(args) - fixed)
        args = [
            batching.bdim_at_front(x, d, axis_data.size, axis_data.explicit_mesh_axis) if m else x
            for x, d, m in zip(args, dims, mapped)
        ]
        callee_mapped, _ = batching.batch_jaxpr(callee, axis_data, mapped, instantiate=True)
        res_mapped = mapped[num_callee_consts:fixed]
        memo = []

        def transpose_mapped():
            if not memo:
                transpose, t_consts = transpose_thunk()
                in_mapped = [False] * len(t_consts) + res_mapped + [True] * len(callee.out_avals)
                memo.append((batching.batch_jaxpr(transpose, axis_data, in_mapped, instantiate=True)[0], t_consts))
            return memo[0]

        outs = linear_call_p.bind(
            *args,
            callee=callee_mapped,
            transpose_thunk=transpose_mapped,
            num_callee_consts=num_callee_consts,
            num_res=num_res,
        )
        return outs, [0] * len(outs)

    batching.fancy_primitive_batchers[linear_call_p] = rule
    return True


def varying_axes(x) -> frozenset:
    """The shard_map mesh axes over which `x` varies (empty outside a shard_map): a custom transpose
    inside a shard_map must sum a gradient over the axes its operand does not vary over, as jax's
    own transposes do. jax 0.10 keeps them on the abstract value's manual axis type
    (`aval.mat.varying`, no public accessor); earlier releases called them `aval.vma`. If neither is
    there this raises rather than answer empty, which would silently drop that sum."""
    import jax

    aval = jax.typeof(x)
    mat = getattr(aval, "mat", None)
    if mat is not None:
        return frozenset(mat.varying)
    vma = getattr(aval, "vma", None)
    if vma is not None:  # pragma: no cover - older jax
        return frozenset(vma)
    raise RuntimeError(
        "zoo._compat.varying_axes: jax's abstract values carry neither .mat.varying nor .vma; see tests/test_compat.py"
    )


def scan_counts(params: dict) -> tuple[int, int]:
    """(constants, carries) of a `scan` equation's inputs. JAX 0.10 records them as `num_consts` and
    `num_carry`; later releases structure the inputs as a flat tree `ft_in` = (consts, carry, xs)
    (seen on the GPU image's jax 0.11.2)."""
    if "num_carry" in params:
        return int(params["num_consts"]), int(params["num_carry"])
    consts, carry, _ = params["ft_in"].unpack()
    return len(consts), len(carry)


def orbax_json_checkpoint_handler():
    """orbax's JSON item handler class (it writes a checkpoint's metadata file): the test that fills
    the disk during a save breaks its write."""
    from orbax.checkpoint._src.handlers.json_checkpoint_handler import JsonCheckpointHandler

    return JsonCheckpointHandler
