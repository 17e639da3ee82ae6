"""zoo.hlo: collectives read from HLO text, on a hand-written module and on programs compiled on the
8 simulated CPU devices."""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from zoo.hlo import by_kind_and_dtype, collectives, parse_shapes, summarize

# A module in the compiled text form: a loop of known trip count holding an async all-gather, a
# tuple all-to-all, a collective-permute and an all-reduce over one-device groups; the entry holds
# a reduce-scatter and a loop of unknown trip count. A line ending in a backslash goes on in the next
# (Python drops the backslash and the newline).
MODULE = """HloModule jit_step, entry_computation_layout={(f32[8,16]{1,0})->f32[4,16]{1,0}}

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %sum = f32[] add(%a, %b)
}

%body (p: (s32[], bf16[4,16])) -> (s32[], bf16[4,16]) {
  %p = (s32[], bf16[4,16]{1,0}) parameter(0)
  %x = bf16[4,16]{1,0} get-tuple-element(%p), index=1
  %ag-start = (bf16[4,16]{1,0}, bf16[16,16]{1,0}) all-gather-start(%x), channel_id=1, replica_groups=[2,4]<=[8], \
dimensions={0}, use_global_device_ids=true
  %ag-done = bf16[16,16]{1,0} all-gather-done(%ag-start)
  %parts = (bf16[4,4]{1,0}, bf16[4,4]{1,0}, /*index=2*/bf16[4,4]{1,0}, bf16[4,4]{1,0}) all-to-all(%x, %x, %x, %x), \
channel_id=2, replica_groups={{0,1,2,3},{4,5,6,7}}
  %perm = bf16[4,16]{1,0} collective-permute(%x), channel_id=3, source_target_pairs={{0,1},{1,0}}
  %noop = f32[4,16]{1,0} all-reduce(%x), channel_id=4, replica_groups={{0},{1},{2},{3},{4},{5},{6},{7}}, to_apply=%add
  ROOT %t = (s32[], bf16[4,16]{1,0}) tuple(%i, %perm)
}

%cond (c: (s32[], bf16[4,16])) -> pred[] {
  %c = (s32[], bf16[4,16]{1,0}) parameter(0)
  ROOT %lt = pred[] constant(true)
}

%body2 (q: f32[8,16]) -> f32[8,16] {
  %q = f32[8,16]{1,0} parameter(0)
  ROOT %ar = f32[8,16]{1,0} all-reduce(%q), channel_id=6, replica_groups=mesh['data'=2,'fsdp'=4] {'fsdp'}, to_apply=%add
}

ENTRY %main (arg: f32[8,16]) -> f32[4,16] {
  %arg = f32[8,16]{1,0} parameter(0)
  %init = (s32[], bf16[4,16]{1,0}) tuple(%zero, %y)
  %loop = (s32[], bf16[4,16]{1,0}) while(%init), condition=%cond, body=%body, \
backend_config={"known_trip_count":{"n":"5"}}
  %loop2 = f32[8,16]{1,0} while(%arg), condition=%cond, body=%body2
  ROOT %rs = f32[4,16]{1,0} reduce-scatter(%arg), channel_id=5, replica_groups={{0,1},{2,3},{4,5},{6,7}}, \
dimensions={0}, to_apply=%add, metadata={op_name="jit(step)/reduce_scatter"}
}
"""


def by_name(found):
    return {c.name: c for c in found}


def test_parse_shapes_ignores_layouts_and_comments():
    shapes = parse_shapes("(bf16[4,4]{1,0}, /*index=1*/f32[]{:S(5)}, s32[2,3,4]{2,1,0})")
    assert [str(a) for a in shapes] == ["bf16[4,4]", "f32[]", "s32[2,3,4]"]
    assert [a.bytes for a in shapes] == [4 * 4 * 2, 4, 2 * 3 * 4 * 4]


def test_collectives_of_a_hand_written_module():
    found = by_name(collectives(MODULE))
    assert set(found) == {"ag-start", "parts", "perm", "noop", "ar", "rs"}  # the -done half is not counted again

    ag = found["ag-start"]
    assert ag.kind == "all-gather" and ag.computation == "body"
    assert [str(a) for a in ag.operands] == ["bf16[4,16]"] and [str(a) for a in ag.results] == ["bf16[16,16]"]
    assert ag.group_size == 4 and ag.executions == 5 and ag.trip_count_known and not ag.trivial
    assert ag.bytes == 16 * 16 * 2 and ag.dtypes == {"bf16"}

    parts = found["parts"]
    assert parts.kind == "all-to-all" and len(parts.operands) == 4 and len(parts.results) == 4
    assert parts.result_bytes == 4 * (4 * 4 * 2) and parts.group_size == 4

    assert found["perm"].kind == "collective-permute" and not found["perm"].trivial
    assert found["noop"].trivial and found["noop"].group_size == 1

    ar = found["ar"]  # inside a loop whose trip count XLA does not know: counted once, and flagged
    assert ar.group_size == 4 and ar.executions == 1 and not ar.trip_count_known

    rs = found["rs"]
    assert rs.kind == "reduce-scatter" and rs.executions == 1 and rs.group_size == 2
    assert rs.operand_bytes == 8 * 16 * 4 and rs.result_bytes == 4 * 16 * 4 and rs.bytes == rs.operand_bytes
    assert rs.op_name == "jit(step)/reduce_scatter"

    table = summarize(collectives(MODULE))
    assert list(table) == ["all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute"]
    assert table["all-gather"] == {"count": 1, "executions": 5, "bytes": 5 * 16 * 16 * 2}
    assert table["all-reduce"] == {"count": 1, "executions": 1, "bytes": 8 * 16 * 4}  # the one-device one is left out
    assert summarize(collectives(MODULE), include_trivial=True)["all-reduce"]["count"] == 2

    split = by_kind_and_dtype(collectives(MODULE))
    assert split["all-gather"] == {"bf16": {"count": 1, "executions": 5, "bytes": 5 * 16 * 16 * 2}}
    assert split["all-reduce"] == {"f32": {"count": 1, "executions": 1, "bytes": 8 * 16 * 4}}
    assert split["collective-permute"] == {"bf16": table["collective-permute"]}  # one dtype: the kind's row
    assert "f32" in by_kind_and_dtype(collectives(MODULE), include_trivial=True)["all-reduce"]


def test_collectives_of_a_compiled_scan():
    """A weight gathered over 8 devices and a gradient all-reduced, once per layer of a 3-layer scan."""
    layers, width = 3, 32
    mesh = jax.make_mesh((8,), ("d",))
    x = jax.ShapeDtypeStruct((64, width), jnp.float32, sharding=NamedSharding(mesh, P("d")))
    ws = jax.ShapeDtypeStruct((layers, width, width), jnp.float32, sharding=NamedSharding(mesh, P(None, "d")))

    def loss(ws, x):
        def layer(h, w):
            return jnp.tanh(h @ w), None

        return jax.lax.scan(layer, x, ws)[0].sum()

    text = jax.jit(jax.grad(loss)).lower(ws, x).compile().as_text()
    found = [c for c in collectives(text) if not c.trivial]
    gathers = [c for c in found if c.kind == "all-gather"]
    assert gathers, text
    for c in gathers:  # each layer's weight, whole, on every device
        assert c.results[0].dims == (width, width) and c.group_size == 8
        assert c.executions == layers and c.trip_count_known
    table = summarize(found)
    assert table["all-gather"]["executions"] == layers * len(gathers)
    assert table["all-gather"]["bytes"] == layers * len(gathers) * width * width * 4
    assert sum(row["count"] for row in table.values()) == len(found)
    np.testing.assert_equal(sorted({c.kind for c in found}), sorted(table))


def test_partitioned_hlo_of_a_program_the_persistent_cache_already_holds(tmp_path):
    """`python -m zoo.tools.inspect_step` run twice with JAX_COMPILATION_CACHE_DIR set: the second compile of the
    same program came from the cache, so XLA dumped nothing and the scale report stopped with "XLA
    wrote no HLO after SPMD partitioning". The partitioned HLO is now read from a real compile."""
    import os
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent(
        """
        import jax, jax.numpy as jnp
        from jax.sharding import NamedSharding, PartitionSpec as P
        from zoo.hlo import compile_with_partitioned_hlo
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
        mesh = jax.make_mesh((2,), ("d",))
        x = jax.ShapeDtypeStruct((8, 4), jnp.float32, sharding=NamedSharding(mesh, P("d")))
        lowered = jax.jit(lambda x: x.sum(axis=0)).lower(x)
        lowered.compile()  # as an earlier run would have: the executable goes into the cache
        for _ in range(2):
            compiled, text = compile_with_partitioned_hlo(lowered)
            assert "all-reduce" in text, text
        print("ok")
        """
    )
    env = {
        **os.environ,
        "XLA_FLAGS": "--xla_force_host_platform_device_count=2",
        "JAX_COMPILATION_CACHE_DIR": str(tmp_path / "cache"),
    }
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join([root, env.get("PYTHONPATH", "")])
    p = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and p.stdout.strip() == "ok", p.stderr[-2000:]
    assert any((tmp_path / "cache").iterdir())  # the cache was in use


def test_rematerialized_lists_xla_clones_not_jax_checkpoints():
    """The clones XLA's rematerialization pass names `<value>.remat` (as a TPU v5e's compiled step of
    dsv3_100m at 68 x 4096 has them), with their shapes and op names; jax.checkpoint's own
    recomputation (`rematted_computation`, in the program before XLA) and other names are not."""
    from zoo.hlo import rematerialized

    module = """HloModule step

%rematted_computation.3 (a: bf16[4,8]) -> bf16[4,8] {
  %a = bf16[4,8]{1,0} parameter(0)
  ROOT %t = bf16[4,8]{1,0} tanh(%a)
}

ENTRY %main (x: bf16[4,8], y: f32[2,8,4]) -> bf16[4,8] {
  %x = bf16[4,8]{1,0} parameter(0)
  %y = f32[2,8,4]{2,1,0} parameter(1)
  %fusion.541.remat = bf16[68,4096,2048]{2,1,0:T(8,128)(2,1)} fusion(%x), kind=kOutput, \
calls=%rematted_computation.3, metadata={op_name="jit(train_step)/while/body/dot_general"}
  %broadcast.7.remat2 = f32[2,8,4]{2,1,0:T(8,128)} broadcast(%y), dimensions={0,1,2}
  %remat_not = bf16[4,8]{1,0} call(%x), to_apply=%rematted_computation.3
  ROOT %out = bf16[4,8]{1,0} add(%x, %remat_not)
}
"""
    found = rematerialized(module)
    assert [(r.name, str(r.result[0])) for r in found] == [
        ("fusion.541.remat", "bf16[68,4096,2048]"),
        ("broadcast.7.remat2", "f32[2,8,4]"),
    ]
    assert found[0].bytes == 68 * 4096 * 2048 * 2 and found[1].bytes == 2 * 8 * 4 * 4
    assert found[0].op_name == "jit(train_step)/while/body/dot_general" and found[1].op_name == ""
