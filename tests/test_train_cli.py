"""train.py through the real command line: bad input fails fast with one line; a run and a sweep work."""

import json
import os
import pathlib
import re
import subprocess
import sys
import time

import in_process
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
FAST = ["trainer.steps=3", "data.batch_size=8", "data.seq_len=16", "trainer.log_every=1"]


def run(args, tmp_path, timeout=300):
    env = dict(os.environ)  # conftest.py's XLA_FLAGS: 8 simulated CPU devices
    env.pop("ZOO_TRACEBACK", None)
    t0 = time.perf_counter()
    p = subprocess.run(
        [
            sys.executable,
            str(ROOT / "train.py"),
            *args,
            f"hydra.run.dir={tmp_path / 'run'}",
            f"hydra.sweep.dir={tmp_path / 'sweep'}",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return p, time.perf_counter() - t0


# Through a real process: exit code, one line, and no compile (the in-process table below covers the rest).
BAD_INPUTS = {
    "unknown_group_option": (
        ["offload=no_such_policy"],
        "error: offload: unknown option 'no_such_policy'; choose one of ",
    ),
    "batch": (["data.batch_size=12"], "error: data.batch_size: 12 is not divisible by the data-parallel size 8"),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_input_one_line_nonzero_exit_before_compile(case, tmp_path):
    args, expected = BAD_INPUTS[case]
    p, seconds = run(args, tmp_path)
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert p.returncode == 2, p.stderr
    assert len(lines) == 1, p.stderr
    assert lines[0].startswith(expected), lines[0]
    assert ";" in lines[0]  # the fix follows the problem
    assert "s, compile " not in p.stdout  # it stopped before compiling anything
    assert seconds < 15, f"took {seconds:.1f}s"


# The fuzz list: (tool, arguments, what the one `error:` line starts with after `error: `). Every case
# runs in this process through the tool's own entry point (train.py's is zoo.tools.cli.main around its
# @hydra.main function), with conftest.py's 8 CPU devices. The first block is issue 13's list.
OUT = "/proc/no_such_dir/out"  # a path nobody can write
FUZZ = [
    (
        "train",
        ["offload=[full,qkv_proj_offloaded,nonexistent]"],
        "offload: unknown option 'nonexistent'; choose one of custom, ",
    ),
    ("train", ["foo=bar"], "foo: not a config group; the groups are model, mesh, "),
    (
        "train",
        ["offload=full", "offload.tags.query_proj=sideways"],
        "offload.tags.query_proj: 'sideways' is not an action; choose one of device, offload, remat",
    ),
    (
        "zoo.tools.inspect_step",
        [f"inspect.out={OUT}/inspect.json", "model=llama_tiny_a"],
        f"inspect.out: cannot write {OUT}/inspect.json",
    ),
    ("zoo.tools.inspect_step", ["bogus"], "bogus: no value; write bogus=<value>"),
    ("zoo.tools.plan", ["--bogus"], "--bogus: not a flag of python -m zoo.tools.plan nor an override"),
    ("train", ["mesh.tensor=3"], "mesh.tensor: 3 (mesh=fsdp) needs a multiple of 3 devices, and 8 are available"),
    (
        "train",
        ["offload.tags.query_proj=offload"],
        "offload.tags.query_proj: the chosen offload option does not list it; add it with "
        "+offload.tags.query_proj=offload",
    ),
    (
        "train",
        ["offload=custom", "offload.tags.query_projection=offload"],
        "offload.tags.query_projection: unknown tag (did you mean query_proj?); valid tags: ",
    ),
    ("train", ["+offload.tags.nosuchtag=offload"], "offload.tags.nosuchtag: unknown tag; valid tags: "),
    # the groups, their options and keys
    ("train", ["offload=fastest"], "offload: unknown option 'fastest'; choose one of "),
    ("train", ["model="], "model: no option given; choose one of "),
    ("train", ["hydra/launcher=nosuch"], "hydra/launcher: unknown option 'nosuch'; choose one of basic, slurm"),
    ("train", ["modle=llama_tiny_a"], "modle: not a config group (did you mean model?)"),
    ("train", ["+foo=bar"], "foo: unknown top-level key; the groups are "),
    ("train", ["trainer.stepz=3"], "trainer.stepz: unknown key (did you mean steps?); known keys here: steps, "),
    ("train", ["model.rope.typ=yarn"], "model.rope.typ: unknown key (did you mean type?)"),
    ("train", ["mesh.rulez.vocab=[tensor]"], "mesh.rulez.vocab: unknown key"),
    ("train", ["mesh.rules.foo=[fsdp]"], "mesh.rules.foo: unknown logical axis; the logical axes are batch, "),
    (
        "train",
        ["model=llama_tiny_a", "model.moe.impl=capacity"],
        "model.moe.impl: model.moe is null in the chosen model option",
    ),
    (
        "train",
        ["offload=optimizer_host", "offload.params=pinned_host"],
        "offload.params: the chosen offload option does not list it; add it with +offload.params=pinned_host",
    ),
    (
        "train",
        ["offload=full", "+offload.block_tags.gpt.query_proj=offload"],
        "offload.block_tags.gpt: unknown block kind; choose one of mlp, mla, moe",
    ),
    (
        "train",
        ["offload=full", "+offload.block_tags.moe.query_proj=offload"],
        "offload.block_tags.moe.query_proj: query_proj belongs to the attention block",
    ),
    (
        "train",
        ["offload=minimal", "offload.block_tags.moe.moe_mlpwi_0=sideways"],
        "offload.block_tags.moe.moe_mlpwi_0: 'sideways' is not an action",
    ),
    (
        "train",
        ["offload=custom", "offload.tags.mlpwo=device"],
        "offload.tags.mlpwo=device: the backward pass never reads mlpwo",
    ),
    (
        "train",
        ["offload=custom", "offload.tags.mla_q=offload", "model=llama_tiny_a"],
        "offload.tags.mla_q: the llama model never emits this tag",
    ),
    (
        "train",
        ["offload=[none,params_host]", "offload.params=gpu"],
        "offload.params: 'gpu' is not a memory kind; choose one of device, pinned_host",
    ),
    # wrong types and bad values
    ("train", ["trainer.steps=many"], "trainer.steps: Value 'many' of type 'str' could not be converted to Integer"),
    ("train", ["trainer.steps=-1"], "trainer.steps: must be positive"),
    ("train", ["trainer.loss_chunk_size=-1"], "trainer.loss_chunk_size: must be >= 0 (sequence positions per chunk"),
    ("train", ["trainer.grad_accum=3"], "data.batch_size: 16 is not divisible by trainer.grad_accum=3"),
    ("train", ["data.batch_size=0"], "data.batch_size: must be positive"),
    ("train", ["data.batch_size=12"], "data.batch_size: 12 is not divisible by the data-parallel size 8"),
    ("train", ["data.seq_len=129"], "data.seq_len: 129 exceeds model.max_position_embeddings=128"),
    ("train", ["data.name=foo"], "data.name: unknown dataset 'foo'; choose one of markov, uniform, text"),
    ("train", ["model.vocab_size=2"], "data.branching: 4 exceeds model.vocab_size=2"),
    ("train", ["optimizer=sgd"], "optimizer: unknown option 'sgd'; choose one of adamw"),
    ("train", ["optimizer.lr=-1"], "optimizer.lr: must be positive"),
    ("train", ["xla.flags=[foo]"], "xla.flags: 'foo' is not an XLA flag"),
    ("train", ["xla.flags=notalist"], "xla.flags: not a list; give one in brackets"),
    ("train", ["xla.cpu_devices=0"], "xla.cpu_devices: must be in [1, 1024]"),
    ("train", ["xla.cpu_devices=100000"], "xla.cpu_devices: must be in [1, 1024] (simulated devices beyond that"),
    # every numeric key by its range (tests/test_ranges.py walks them all): NaN, inf, out of range
    ("train", ["optimizer.lr=nan"], "optimizer.lr: must be positive, got nan; e.g. optimizer.lr="),
    ("train", ["optimizer.lr=inf"], "optimizer.lr: must be positive, got inf"),
    ("train", ["optimizer.b1=1.0"], "optimizer.b1: must be in [0, 1), got 1.0; e.g. optimizer.b1=0.9"),
    ("train", ["optimizer.b2=-0.1"], "optimizer.b2: must be in [0, 1), got -0.1"),
    ("train", ["optimizer.eps=0"], "optimizer.eps: must be positive, got 0.0"),
    ("train", ["optimizer.decay_steps=-1"], "optimizer.decay_steps: must be positive (null decays over"),
    ("train", ["optimizer.weight_decay=-1"], "optimizer.weight_decay: must be >= 0, got -1.0"),
    ("train", ["optimizer.grad_clip=nan"], "optimizer.grad_clip: must be >= 0 (0 disables), got nan"),
    ("train", ["lora=default", "lora.alpha=nan"], "lora.alpha: must be positive, got nan"),
    ("train", ["model.moe.routed_scaling_factor=nan"], "model.moe.routed_scaling_factor: must be positive, got nan"),
    ("train", ["model.rope.theta=inf"], "model.rope.theta: must be positive, got inf"),
    ("train", ["model.rms_norm_eps=inf"], "model.rms_norm_eps: must be in (0, 1), got inf"),
    ("train", ["trainer.moe_bias_update_rate=nan"], "trainer.moe_bias_update_rate: must be >= 0 (0 disables), got"),
    ("train", ["trainer.seed=99999999999999999999"], "trainer.seed: must be in [0, 4294967296), got 9999999999"),
    ("train", ["data.seed=-1"], "data.seed: must be in [0, 4294967296), got -1"),
    ("train", ["model.num_layers=nan"], "model.num_layers: Value 'nan' of type 'float' could not be converted"),
    # an int beyond 32 bits: it overflowed inside the jitted step (warmup_steps) or trained for ever (steps)
    (
        "train",
        ["optimizer.warmup_steps=99999999999999999999"],
        "optimizer.warmup_steps: must be >= 0 and at most 2147483647 (what a 32-bit integer holds), got ",
    ),
    ("train", ["trainer.steps=2147483648"], "trainer.steps: must be positive and at most 2147483647"),
    ("train", ["distributed.timeout_s=99999999999999999999"], "distributed.timeout_s: must be positive and at most"),
    # a number other than 0 or 1 for a boolean: OmegaConf took it as true
    ("train", ["trainer.progress=2"], "trainer.progress: 2 is not a boolean; give true or false"),
    ("train", ["model=dsv3_tiny_a", "model.moe.norm_topk_prob=-1"], "model.moe.norm_topk_prob: -1 is not a boolean"),
    ("zoo.tools.inspect_step", ["inspect.strict=2"], "inspect.strict: 2 is not a boolean; give true or false"),
    ("zoo.tools.plan", ["plan.split=2"], "plan.split: 2 is not a boolean; give true or false"),
    ("zoo.tools.measure_hardware", ["op_rates=3"], "op_rates: 3 is not a boolean; give true or false"),
    # an empty value (an unset shell variable) for a tool's option: OmegaConf read it as null, the default
    ("zoo.tools.inspect_step", ["inspect.out="], "inspect.out: empty (an unset shell variable?); give a value, or "),
    ("zoo.tools.plan", ["plan.json="], "plan.json: empty (an unset shell variable?)"),
    ("zoo.tools.measure_hardware", ["out="], "out: empty (an unset shell variable?); give a value, or drop out= "),
    ("zoo.tools.generate", ["model.path=", "prompt=hi"], "model.path: empty (an unset shell variable?)"),
    # the command line before Hydra reads it (zoo.train.command_line)
    ("train", ["=3"], "command line: '=3' has no key before its '='; write <key>=3"),
    ("train", ["m\u00f6del.x=3"], "m\u00f6del.x: '\u00f6' cannot be in a key"),
    ("train", ["hydra.run.dir=$HOME/x"], "hydra.run.dir: '$HOME/x' holds $HOME, which the shell did not expand"),
    ("train", ["data.path=$DATA/books.txt"], "data.path: '$DATA/books.txt' holds $DATA, which the shell did not"),
    ("train", ["hydra/launcher=slurm"], "hydra/launcher: slurm launches the jobs of a sweep, and without -m"),
    ("train", ["~model"], "model: the group is missing (~model deletes it); choose an option"),
    ("train", ["distributed.local_device_ids=[7]"], "distributed.local_device_ids: [7] picks the devices of one"),
    (
        "train",
        ["data=text", "data.path={tmp}/latin1.txt", "data.format=chat"],
        "data.format: chat reads the fields of .jsonl lines, and {tmp}/latin1.txt holds no .jsonl file",
    ),
    # what cannot fit: refused before anything is initialised (zoo.train.machine_fit), or too deep to judge
    (
        "train",
        ["model=llama3.1_405b", "mesh=single", "data.batch_size=1", "data.seq_len=16"],
        "model: training 405.85B parameters needs at least 6493.7 GB (weights 1623.4 GB, gradients and AdamW",
    ),
    ("train", ["model.num_layers=1000000"], "model.num_layers: must be in [1, 10000] (beyond that, building"),
    # a block the model lacks, named before the tag's action
    (
        "train",
        ["model=llama_tiny_a", "+offload.block_tags.mla.mla_q=offload"],
        "offload.block_tags.mla: the llama model has no mla blocks (its optional blocks: mlp), so this would be",
    ),
    ("train", ["hardware=tpu"], "hardware: unknown option 'tpu'; choose one of auto, cpu, "),
    ("train", ["hardware=tpu_v5e"], "hardware: tpu_v5e is a profile of a tpu, and this run's devices are cpus; use"),
    (
        "train",
        ["model.attention_impl=splash"],
        "model.attention_impl: splash is a TPU kernel (Pallas), and the backend is cpu; use blockwise",
    ),
    ("train", ["hardware=cpu", "hardware.matmul_flops=fast"], "hardware.matmul_flops: Value 'fast'"),
    ("train", ["checkpoint.dir=''"], "checkpoint.dir: empty"),
    ("train", [f"checkpoint.dir={OUT}"], f"checkpoint.dir: cannot create {OUT}"),
    ("train", ["distributed.coordinator_address=nohost"], "distributed.coordinator_address: 'nohost' is not host:port"),
    ("train", ["distributed.num_processes=2"], "distributed.coordinator_address: not set"),
    ("train", ["distributed.local_device_ids=abc"], "distributed.local_device_ids: not a list"),
    ("train", ["mesh=dp", "mesh.data=3"], "mesh: data*fsdp*tensor*expert = 3*1*1*1 = 3 does not match the 8 devices"),
    ("train", ["mesh.data=-1"], "mesh.fsdp: only one axis may be -1 (also data)"),
    ("train", ["mesh.devices=99"], "mesh.devices: 99 requested, 8 available"),
    (
        "train",
        ["mesh.rules.batch=[nope]"],
        "mesh.rules.batch: unknown mesh axis 'nope'; use some of data, fsdp, tensor, expert",
    ),
    ("train", ["model=llama_tiny_a", "mesh=fsdp_tp", "mesh.tensor=4", "mesh.fsdp=2"], "mesh.tensor: dim 2 of "),
    (
        "train",
        ["model=llama_tiny_a", "mesh.sequence_parallel=true"],
        "mesh.sequence_parallel: splits the sequence over the tensor axis, but mesh.tensor is 1",
    ),
    (
        "train",
        ["model=llama_tiny_a", "mesh=fsdp_tp", "mesh.sequence_parallel=true", "data.seq_len=33"],
        "data.seq_len: 33 is not divisible by the sequence-parallel size 2",
    ),
    (
        "train",
        ["model=llama_tiny_a", "mesh.context_parallel=tensor"],
        "mesh.context_parallel: 'tensor' splits the heads inside attention",
    ),
    (
        "train",
        ["model=llama_tiny_a", "mesh.context_parallel=data"],
        "mesh.context_parallel: splits the sequence over the data axis, but mesh.data is 1",
    ),
    (
        "train",
        ["model=llama_tiny_a", "mesh.context_parallel=fsdp", "data.seq_len=33"],
        "data.seq_len: 33 is not divisible by the sequence-parallel size 8 (mesh.context_parallel",
    ),
    (
        "train",
        ["model=llama_tiny_a", "mesh.context_parallel=fsdp", "data.seq_len=40"],
        "data.seq_len: 40 does not cut into 2 x 8 equal chunks, which balanced context parallelism deals out",
    ),
    (
        "zoo.tools.plan",
        ["model=llama_tiny_a", "mesh=fsdp_tp", "mesh.rules.seq=[tensor]", "data.seq_len=33"],
        "data.seq_len: 33 is not divisible by the sequence-parallel size 2",
    ),
    (
        "train",
        ["model=llama_tiny_a", "mesh=fsdp_ep"],
        "mesh.expert: 4 devices on the expert axis, but the model has no MoE layers",
    ),
    ("train", ["model.moe.impl=dense"], "model.moe.impl: got 'dense'; choose one of auto, ragged, capacity"),
    ("train", ["model.moe.exchange_factor=0"], "model.moe.exchange_factor: must be positive, got 0"),
    ("train", ["model.attention_impl=cudnn"], "model.attention_impl: cudnn needs a GPU"),
    # missing and bad files
    ("train", ["data=text", "data.path=/no/such/corpus"], "data.path: /no/such/corpus does not exist"),
    (
        "train",
        ["data=text", "data.tokenizer=/no/such/tokenizer.json"],
        "data.tokenizer: /no/such/tokenizer.json does not exist",
    ),
    ("train", ["data=text", "data.path={tmp}/empty.txt"], "data.path: {tmp}/empty.txt is empty"),
    ("train", ["data=text", "data.path={tmp}/latin1.txt"], "data.path: {tmp}/latin1.txt is not UTF-8 text"),
    (
        "train",
        ["data=text", "data.path={tmp}/docs.jsonl", "data.text_field=body"],
        "data.text_field: {tmp}/docs.jsonl line 1 has no key 'body'",
    ),
    # a device for a file: the tokenizer's reader never ended
    ("train", ["data=text", "data.tokenizer=/dev/zero"], "data.tokenizer: /dev/zero is neither a file nor a folder"),
    (
        "zoo.tools.generate",
        [f"model.path={ROOT}/tests/data/llama_tiny_a", "tokenizer=/dev/zero", "prompt=hi"],
        "tokenizer: /dev/zero is neither a file nor a folder",
    ),
    # the command line itself
    ("train", ["--steps", "3"], "command line: unrecognized arguments: --steps"),
    ("train", ["--cfg", "bogus"], "command line: argument --cfg/-c: invalid choice: 'bogus'"),
    ("train", ["trainer.steps"], "trainer.steps: no value; write trainer.steps=<value>"),
    ("train", ["trainer.steps=[1,2"], "trainer.steps: cannot parse 'trainer.steps=[1,2'"),
    (
        "train",
        ["data=text", "data.path=~/notes/"],
        "data.path: '~/notes/' starts with ~, which neither bash (after key=) nor Hydra expands; write "
        "data.path=$HOME/notes/",
    ),
    # the tools
    ("zoo.tools.inspect_step", ["inspect.foo=1"], "inspect.foo: unknown key; the keys are out, measure, strict"),
    ("zoo.tools.inspect_step", ["inspect.strict"], "inspect.strict: give a value"),
    ("zoo.tools.inspect_step", ["inspect.out=/tmp"], "inspect.out: /tmp is a directory"),
    ("zoo.tools.inspect_step", ["offload=nope"], "offload: unknown option 'nope'"),
    (
        "zoo.tools.inspect_step",
        ["--help-me"],
        "--help-me: not a flag of python -m zoo.tools.inspect_step nor an override",
    ),
    ("zoo.tools.inspect_step", ["trainer.stepz=1"], "trainer.stepz: unknown key"),
    ("zoo.tools.plan", ["plan.hbm_budget_gb=-1", "plan.link=64"], "plan.hbm_budget_gb: must be positive"),
    ("zoo.tools.plan", ["plan.link=warp"], "plan.link: unknown link 'warp'"),
    ("zoo.tools.plan", ["plan.foo=1"], "plan.foo: unknown key"),
    ("zoo.tools.plan", ["foo=bar"], "foo: not a config group"),
    (
        "zoo.tools.plan",
        [f"plan.out={OUT}/planned.yaml", "model=llama_tiny_a", "plan.link=64"],
        f"plan.out: cannot write {OUT}/planned.yaml",
    ),
    ("zoo.tools.plan", [f"plan.json={OUT}/plan.json", "plan.link=64"], f"plan.json: cannot write {OUT}/plan.json"),
    ("zoo.tools.measure_hardware", ["n=abc"], "n: Value 'abc'"),
    ("zoo.tools.measure_hardware", ["foo=1"], "foo: unknown key; the keys are name, out, "),
    ("zoo.tools.measure_hardware", ["bare"], "bare: arguments are key=value"),
    ("zoo.tools.measure_hardware", ["dtype=int4"], "dtype: choose bfloat16, float16 or float32"),
    ("zoo.tools.measure_hardware", ["chain=0"], "chain: must be in [1, 256] (matmuls per timed call, unrolled in "),
    ("zoo.tools.measure_hardware", ["transfer_mb=nan"], "transfer_mb: must be positive, got nan"),
    # sizes and counts that would run out of memory (a traceback) or take hours: refused before measuring
    ("zoo.tools.measure_hardware", ["n=200000"], "n: a 200000x200000 float32 matmul chain holds 640.0 GB "),
    ("zoo.tools.measure_hardware", ["transfer_mb=1e12"], "transfer_mb: 1e+12 MB arrays take "),
    ("zoo.tools.measure_hardware", ["chain=1000000000"], "chain: must be in [1, 256] (matmuls per timed call, "),
    ("zoo.tools.measure_hardware", ["repeats=99999"], "repeats: must be in [1, 100] (timed runs of each figure"),
    ("zoo.tools.measure_hardware", ["copies=99999999999999999999"], "copies: must be in [2, 32] (the op once "),
    ("zoo.tools.export", ["{tmp}/ckpt", "{tmp}/out", "--max-shard-gb", "0"], "--max-shard-gb: must be a positive"),
    ("zoo.tools.export", ["{tmp}/ckpt", "{tmp}/out", "--max-shard-gb", "nan"], "--max-shard-gb: must be a positive"),
    ("zoo.tools.export", ["{tmp}/ckpt", "{tmp}/out", "--max-shard-gb", "1e300"], "--max-shard-gb: must be below "),
    ("zoo.tools.measure_hardware", [f"out={OUT}/m.yaml"], f"out: cannot write {OUT}/m.yaml"),
    ("zoo.tools.report", ["/no/such/multirun"], "dir: /no/such/multirun is not a directory"),
    ("zoo.tools.report", [], "command line: the following arguments are required: dir"),
    ("zoo.tools.report", ["{tmp}", "--bogus"], "command line: unrecognized arguments: --bogus"),
    ("zoo.tools.report", ["{tmp}", "--out", OUT], f"--out: cannot write {OUT}/report.md"),
    ("zoo.tools.report", ["{tmp}/empty_dir"], "dir: no summary.json under {tmp}/empty_dir"),
    ("zoo.tools.sizes", ["nosuch"], "nosuch: no such size; choose from llama_tiny_a, "),
    # zoo.tools.generate's numbers: a top_k or seed beyond what JAX takes was a traceback, a negative seed accepted
    (
        "zoo.tools.generate",
        [f"model.path={ROOT}/tests/data/llama_tiny_a", "tokenizer=bytes", "prompt=hi", "top_k=99999999999999999999"],
        "top_k: must be a whole number >= 0 and at most 2147483647 (0 keeps every token), got 9999",
    ),
    (
        "zoo.tools.generate",
        [f"model.path={ROOT}/tests/data/llama_tiny_a", "tokenizer=bytes", "prompt=hi", "seed=-1"],
        "seed: must be a whole number in [0, 4294967296), got -1; e.g. seed=0",
    ),
    # LoRA (issue 32 part 4): a target the family lacks, a rank larger than the projection, a bad key.
    (
        "train",
        ["model=llama_tiny_a", "lora=default", "lora.targets=[wq,wkv_a]"],
        "lora.targets: this model has no 'wkv_a' projection; its projections are ",
    ),
    ("train", ["lora=default", "lora.targets=[wk]"], "lora.targets: this model has no 'wk' projection"),
    ("train", ["model=llama_tiny_a", "lora=default", "lora.rank=100000"], "lora.rank: 100000 exceeds the "),
    ("train", ["lora=default", "lora.targets=[q_proj]"], "lora.targets: unknown projection 'q_proj'; choose from wq, "),
    ("train", ["lora=default", "lora.rank=-2"], "lora.rank: must be >= 0"),
]


def _cli(tool: str, argv: list[str], out_dir: pathlib.Path) -> int:
    """One command line, in this process, through the tool's own entry point."""
    import importlib

    if tool != "train":
        try:
            return importlib.import_module(tool).main(argv)
        except SystemExit as e:  # argparse-based tools exit through SystemExit
            return e.code
    sys.path.insert(0, str(ROOT))
    try:
        import train
    finally:
        sys.path.remove(str(ROOT))
    saved = sys.argv
    sys.argv = ["train.py", *argv, f"hydra.run.dir={out_dir / 'run'}", "hydra.job.chdir=false"]
    try:
        return train.entry()
    finally:
        sys.argv = saved


@pytest.mark.parametrize("every", [3, pytest.param(1, marks=pytest.mark.slow)])
def test_fuzz_every_bad_command_line_is_one_line_exit_2(every):
    """The table below, in a pytest process of its own: the entry points compose Hydra and start JAX
    in process, and what earlier tests of a shared worker leave behind (logging handlers bound to
    their captured streams, imported modules) made it fail by order, not by any command line. Every
    third line in the default tier (about a minute for all of them), every line in the slow tier."""
    p = subprocess.run(
        [sys.executable, "-m", "pytest", *in_process.INNER_OPTIONS, f"{__file__}::test_fuzz_in_process"],
        env={**os.environ, "ZOO_FUZZ_IN_PROCESS": "1", "ZOO_FUZZ_EVERY": str(every)},
        cwd=ROOT, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert p.returncode == 0 and re.search(r"^1 passed", p.stdout, re.M), p.stdout[-6000:] + p.stderr[-2000:]


@pytest.mark.skipif(
    os.environ.get("ZOO_FUZZ_IN_PROCESS") != "1", reason="run by test_fuzz_every_bad_command_line_is_one_line_exit_2"
)
def test_fuzz_in_process(tmp_path, capfd, monkeypatch):
    monkeypatch.delenv("ZOO_TRACEBACK", raising=False)
    monkeypatch.chdir(tmp_path)  # nothing a tool might write lands in the source tree
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "latin1.txt").write_bytes("caf\xe9\n".encode("latin-1"))
    (tmp_path / "docs.jsonl").write_text('{"text": "hello"}\n')
    (tmp_path / "empty_dir").mkdir()
    failures = []
    t0 = time.perf_counter()
    every = int(os.environ.get("ZOO_FUZZ_EVERY", "1"))
    for i, (tool, argv, expected) in enumerate(FUZZ):
        if i % every:
            continue
        argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
        expected = "error: " + expected.replace("{tmp}", str(tmp_path))
        code = _cli(tool, argv, tmp_path / f"case{i}")
        out, err = capfd.readouterr()
        lines = [ln for ln in err.splitlines() if ln.strip()]
        if code != 2 or len(lines) != 1 or not lines[0].startswith(expected) or "Traceback" in err + out:
            failures.append(f"{tool} {' '.join(argv)}: exit {code}, stderr {err[-600:]!r}")
    assert not failures, "\n".join(failures)
    assert len(FUZZ) >= 80
    print(f"{len(range(0, len(FUZZ), every))} of {len(FUZZ)} command lines in {time.perf_counter() - t0:.1f}s")


def test_train_cli_llama_tensor_parallel_bf16(tmp_path):
    p, _ = run(["model=llama_tiny_a", "mesh=fsdp_tp", "model.compute_dtype=bfloat16", *FAST], tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    out = tmp_path / "run"
    records = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1, 2]
    for key in (
        "loss",
        "grad_norm",
        "lr",
        "tokens_per_s",
        "tflops_per_device",
        "mfu",
        "device_bytes_in_use",
        "device_peak_bytes",
    ):
        assert key in records[0], key
    assert records[0]["device_peak_bytes"] is None  # the CPU backend reports no memory stats
    s = json.loads((out / "summary.json").read_text())
    assert s["status"] == "ok" and s["mesh"] == {"data": 1, "fsdp": 4, "tensor": 2, "expert": 1}
    assert s["compiled_memory"]["temp_size_in_bytes"] > 0 and s["peak_memory_source"] == "compiled.memory_analysis"
    assert s["config"]["model"]["compute_dtype"] == "bfloat16" and s["config"]["model"]["param_dtype"] == "float32"
    assert s["mfu"] > 0 and s["tokens_per_s"] > 0
    q = s["step_time_quantiles_s"]  # the report's spread: steps 2 and 3 (the first is not timed)
    assert s["timed_steps"] == 2 and q["min"] <= q["p25"] <= q["median"] == s["step_time_s"] <= q["p75"] <= q["max"]
    assert "loss" in p.stdout and "summary:" in p.stdout


def test_sweep_reports_failed_job_and_continues_then_report(tmp_path):
    args = [
        "-m",
        "offload=none,full",
        "data.seq_len=16,999",
        "model=llama_tiny_a",
        "mesh=single",
        "trainer.steps=2",
        "data.batch_size=8",
    ]
    p, _ = run([*args, "trainer.progress=false"], tmp_path)
    assert p.returncode == 1, p.stderr[-3000:]  # the sweep ran to the end, then reports its failures
    sweep = tmp_path / "sweep"
    summaries = {d.name: json.loads((d / "summary.json").read_text()) for d in sorted(sweep.iterdir()) if d.is_dir()}
    assert sorted(summaries) == ["0", "1", "2", "3"]
    assert [summaries[k]["status"] for k in "0123"] == ["ok", "failed", "ok", "failed"]
    assert "data.seq_len=999" in summaries["1"]["overrides"] and summaries["1"]["error"].startswith(
        "data.seq_len: 999 exceeds"
    )
    failed_lines = [ln for ln in p.stderr.splitlines() if ln.startswith("error: job")]
    assert len(failed_lines) == 2 and "data.seq_len=999" in failed_lines[0]

    r = subprocess.run(
        [sys.executable, "-m", "zoo.tools.report", str(sweep)], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, r.stderr
    table = (sweep / "report.md").read_text()
    rows = [ln for ln in table.splitlines() if ln.startswith("| offload=")]
    assert len(rows) == 4 and sum("| ok |" in ln for ln in rows) == 2
    assert sum(ln.rstrip().endswith("| yes |") for ln in rows) >= 1  # a Pareto front exists
    assert (sweep / "report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_xla_flags_merge_with_environment():
    from zoo.train.run_config import XlaConfig
    from zoo.train.run import merged_xla_flags

    c = XlaConfig(flags=["--xla_gpu_enable_latency_hiding_scheduler=true"], cpu_devices=4)
    env = "--xla_force_host_platform_device_count=8 --xla_dump_to=/tmp/d"
    assert merged_xla_flags(c, env).split() == [
        "--xla_dump_to=/tmp/d",
        "--xla_gpu_enable_latency_hiding_scheduler=true",
        "--xla_force_host_platform_device_count=4",
        "--xla_cpu_experimental_ynn_fusion_type=dot",
    ]
    # xla.cpu_ynn_fusions is a default: added when neither the environment nor xla.flags set the flag
    assert merged_xla_flags(XlaConfig(), None) == "--xla_cpu_experimental_ynn_fusion_type=dot"
    assert merged_xla_flags(XlaConfig(cpu_ynn_fusions=None), None) == ""
    mine = "--xla_cpu_experimental_ynn_fusion_type=dot,eltwise,reduce"
    assert merged_xla_flags(XlaConfig(), mine) == mine
    assert merged_xla_flags(XlaConfig(flags=[mine]), None) == mine


def test_ynn_default_only_on_the_jaxlibs_it_was_measured_with(monkeypatch):
    """XLA refuses to start on an unknown flag: the experimental YNN default is added only on a jaxlib
    release it was measured with (an explicit xla.flags entry is the user's choice and always passes)."""
    from zoo.train import run
    from zoo.train.run_config import XlaConfig

    assert run.merged_xla_flags(XlaConfig(), None) == "--xla_cpu_experimental_ynn_fusion_type=dot"  # this jaxlib
    monkeypatch.setattr(run, "YNN_FLAG_JAXLIBS", ("0.0.",))
    assert run.merged_xla_flags(XlaConfig(), None) == ""
    mine = "--xla_cpu_experimental_ynn_fusion_type=dot,eltwise"
    assert run.merged_xla_flags(XlaConfig(flags=[mine]), None) == mine


def test_a_ctrl_c_as_a_sweeps_job_starts_names_that_job_not_the_last_phase_of_the_one_before(tmp_path, monkeypatch):
    """A sweep's jobs share one process: the phase the previous job ended in (its last save) must not be
    what the Ctrl-C line says when the next job is interrupted while it starts."""
    from omegaconf import OmegaConf

    from zoo.tools import cli
    from zoo.train import stop

    monkeypatch.setattr(stop, "PHASE", "saving step 20, the last")  # where job 0 ended
    monkeypatch.setattr(stop, "PHASE_AFTER", "step 20 is saved")
    monkeypatch.setattr(cli, "_hydra_context", lambda: (tmp_path, ["optimizer.lr=1e-3"], True, 1))

    def ctrl_c(cfg):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "prepare", ctrl_c)
    with pytest.raises(KeyboardInterrupt):
        cli.run_job(OmegaConf.create({}))
    assert cli.interrupted_line() == (
        "error: interrupted (Ctrl-C) while starting job 1 [optimizer.lr=1e-3]; no step of this job ran (the jobs "
        "before it are done)"
    )
    assert not (tmp_path / "summary.json").exists()  # a Ctrl-C is not a failed job's record


def test_tools_started_in_the_same_second_each_get_their_own_output_folder(tmp_path, monkeypatch):
    """A tool's default output folder (outputs/<tool>/<date>_<time>) is claimed as train.py's run
    directory is: a second plan started in the same second writes beside the first, not over it."""
    import time

    from zoo.tools.kit import output_path

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(time, "strftime", lambda fmt, *a: "2026-12-06_16-01-07")
    first, second = (output_path(None, "plan.out", "plan", "offload/planned.yaml") for _ in range(2))
    assert first == pathlib.Path("outputs/plan/2026-12-06_16-01-07/offload/planned.yaml")
    assert second == pathlib.Path("outputs/plan/2026-12-06_16-01-07-1/offload/planned.yaml")
    assert output_path(str(tmp_path / "mine.yaml"), "plan.out", "plan", "x.yaml") == tmp_path / "mine.yaml"


def test_a_tool_replaces_its_own_output_and_no_other_file_without_overwrite(tmp_path, monkeypatch):
    """A tool's output path is checked before anything compiles: the file it wrote itself (the same command
    again) is replaced; a run's summary.json, a profile shipped in conf/ or any other file is one line naming the
    key and the overwrite option, unless that option is given; hydra.run.dir names the tool's output folder."""
    from zoo.offload import conf_dir
    from zoo.tools.kit import check_output, output_path
    from zoo.train.run_config import ConfigError

    monkeypatch.chdir(tmp_path)
    plan = tmp_path / "planned.yaml"
    plan.write_text("# Planned by: python -m zoo.tools.plan model=llama_tiny_a\nname: planned\n")
    assert output_path(str(plan), "plan.out", "plan", "x.yaml") == plan  # its own earlier plan
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "summary.json").write_text('{"status": "ok"}')
    (tmp_path / "notes.json").write_text('{"mine": 1}')
    cases = [
        ("plan.out", "plan", tmp_path / "run" / "summary.json", "is a file of the train.py run in "),
        (
            "inspect.out",
            "inspect",
            tmp_path / "notes.json",
            "exists and was not written by python -m zoo.tools.inspect",
        ),
        ("inspect.out", "inspect", plan, "exists and was not written by python -m zoo.tools.inspect"),  # not a plan's
        ("name", "measure_hardware", conf_dir() / "hardware" / "cpu.yaml", "is a file shipped with Zoo"),
    ]
    for key, tool, path, what in cases:
        before = path.read_bytes()
        with pytest.raises(ConfigError) as e:
            check_output(path, key, tool, f"{tool}.overwrite=true")
        assert str(e.value).startswith(f"{key}: {path} {what}") and str(e.value).endswith(
            f"give another {key}, or add {tool}.overwrite=true to replace it"
        ), str(e.value)
        assert path.read_bytes() == before
    notes = output_path(str(tmp_path / "notes.json"), "inspect.out", "inspect", "x", ["inspect.overwrite=true"])
    assert notes == tmp_path / "notes.json"  # asked for
    into = output_path(None, "plan.out", "plan", "offload/planned.yaml", [f"hydra.run.dir={tmp_path / 'mine'}"])
    assert into == tmp_path / "mine" / "offload" / "planned.yaml" and not (tmp_path / "outputs").exists()
    with pytest.raises(ConfigError, match=r"^hydra\.run\.dir: .*notes\.json is a file, not a directory"):
        output_path(None, "plan.out", "plan", "offload/planned.yaml", [f"hydra.run.dir={tmp_path / 'notes.json'}"])


@pytest.mark.parametrize(
    "tool, arg, line",
    [
        ("gpu_lowering", "hydra.run.dir=x", "error: hydra.run.dir: python -m zoo.tools.gpu_lowering does not write "),
        ("measure_hardware", "hydra.run.dir=x", "error: hydra.run.dir: python -m zoo.tools.measure_hardware does not "),
        ("plan", "hydra.sweep.dir=x", "error: hydra.sweep.dir: python -m zoo.tools.plan runs once, not a sweep"),
        ("gpu_lowering", "lower.overwrite=true", "error: lower.overwrite: unknown key"),  # it writes no file
    ],
)
def test_tools_refuse_hydra_output_dirs_they_would_ignore(tool, arg, line, tmp_path, monkeypatch, capsys):
    import importlib

    monkeypatch.chdir(tmp_path)
    assert importlib.import_module(f"zoo.tools.{tool}").main([arg]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(line) and len(err.splitlines()) == 1, err
    assert not any(tmp_path.iterdir())  # nothing written, nothing measured


def test_runs_started_in_the_same_second_each_get_their_own_run_directory(tmp_path, monkeypatch):
    """Hydra's default run directory is named by the second: a second run started in it would share the
    first's, and Hydra rewrote the first's `.hydra/` before the run-directory lock refused the second.
    Each run claims its own (`os.mkdir`, a suffix while taken), and a sweep its sweep directory; a
    command that names its directory, one that writes nothing and the processes of one multi-process
    run claim none; a command Hydra refuses leaves no empty directory behind."""
    import datetime

    from zoo.tools import cli

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("SLURM_NTASKS", raising=False)
    now = datetime.datetime(2026, 12, 6, 16, 1, 7)
    first, second = (cli._fresh_run_dir(["model=llama_tiny_a"], now) for _ in range(2))
    day = pathlib.Path("outputs/2026-12-06")
    assert first == [day.parent, day, day / "16-01-07"] and first[-1].is_dir()
    assert second == [day / "16-01-07-1"] and second[-1].is_dir()
    sweeps = [cli._fresh_run_dir(["-m", "trainer.steps=1,2"], now) for _ in range(2)]  # a sweep claims its own too
    assert [s[-1] for s in sweeps] == [
        pathlib.Path("multirun/2026-12-06/16-01-07"),
        pathlib.Path("multirun/2026-12-06/16-01-07-1"),
    ]
    for args in (
        ["hydra.run.dir=mine"],
        ["-m", "hydra.sweep.dir=mine"],
        ["--cfg", "job"],
        ["distributed.process_id=1"],
    ):
        assert cli._fresh_run_dir(args, now) == [], args
    p = subprocess.run(
        [sys.executable, str(ROOT / "train.py"), "trainer.no_such_key=1"],
        cwd=tmp_path / "outputs",
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 2 and p.stderr.startswith("error: "), p.stderr[-2000:]
    assert sorted(
        str(d.relative_to(tmp_path)) for d in tmp_path.rglob("*") if "multirun" not in d.relative_to(tmp_path).parts
    ) == [
        "outputs",
        "outputs/2026-12-06",
        "outputs/2026-12-06/16-01-07",
        "outputs/2026-12-06/16-01-07-1",
    ]
