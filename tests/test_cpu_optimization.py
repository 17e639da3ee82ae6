"""xla.cpu_fast_compile: true / false / auto (LLVM's optimisations on from `zoo.backend.CPU.step_llvm_from_run_flops` of
model FLOPs per run), the line train.py prints, and the error for anything else."""

import dataclasses
import pathlib

import pytest
from omegaconf import OmegaConf

from zoo.counts import count_params
from zoo.families import SIZES
from zoo.offload import load_preset
from zoo.train.run_config import ConfigError, DataConfig, HardwareConfig, MeshConfig, OptimizerConfig, TrainConfig
from zoo.train.run_config import TrainerConfig, XlaConfig
from zoo.backend import CPU
from zoo.train.step import cpu_optimization, run_model_flops

CONF = pathlib.Path(__file__).resolve().parent.parent / "conf"


def _config(model="dsv3_tiny_a", batch=16, seq=64, steps=100, **xla):
    # Built from the dataclasses (Hydra's compose would leave logging handlers on this test's
    # captured stderr); the defaults are train.py's: conf/data/markov.yaml's batch, 100 steps.
    return TrainConfig(
        model=SIZES[model],
        mesh=MeshConfig(),
        offload=load_preset("none"),
        optimizer=OptimizerConfig(),
        data=DataConfig(name="markov", batch_size=batch, seq_len=seq),
        xla=XlaConfig(**xla),
        trainer=TrainerConfig(steps=steps),
        hardware=HardwareConfig(),
    )


def test_the_conf_defaults():
    assert OmegaConf.load(CONF / "xla" / "default.yaml").cpu_fast_compile == "auto"
    markov = OmegaConf.load(CONF / "data" / "markov.yaml")
    assert (markov.batch_size, markov.seq_len) == (16, 64)
    assert "dsv3_tiny_a" in (CONF / "config.yaml").read_text()
    assert TrainerConfig().steps == 100


def test_default_run_is_optimised_and_a_short_run_is_not():
    c = _config()
    assert c.xla.cpu_fast_compile == "auto"
    # train.py's default run (dsv3_tiny_a, 16 x 64 tokens, 100 steps): 0.08 TFLOP, where the optimised
    # program paid for its longer compile after ~35 steps (bench/opt_level.py, in git at 6966f25)
    assert run_model_flops(c) == pytest.approx(0.0815e12, rel=0.01)
    on, why = cpu_optimization(c, "cpu")
    assert on is True and "auto" in why and ">=" in why
    on, why = cpu_optimization(_config(steps=10), "cpu")
    assert on is False and "<" in why


def test_auto_turns_optimisation_on_for_a_long_run_of_a_bigger_model():
    c = _config(batch=8, seq=256, steps=12)
    c = dataclasses.replace(c, model=SIZES["llama_tiny_a"].replace(vocab_size=32000, hidden_size=256))
    # the 20M Llama of bench/peer.py: 152 GFLOP a step
    assert run_model_flops(c) == pytest.approx(
        12 * run_model_flops(dataclasses.replace(c, trainer=dataclasses.replace(c.trainer, steps=1)))
    )
    on, why = cpu_optimization(c, "cpu")
    assert on is True and ">=" in why
    assert run_model_flops(c) > CPU.step_llvm_from_run_flops


@pytest.mark.parametrize("value, on", [(True, False), (False, True)])
def test_explicit_choice_wins(value, on):
    c = _config(cpu_fast_compile=value)
    assert cpu_optimization(c, "cpu") == (on, f"xla.cpu_fast_compile={str(value).lower()}")
    assert cpu_optimization(c, "gpu")[0] is None


def test_bad_value_is_one_line_naming_the_key():
    with pytest.raises(ConfigError, match=r"xla.cpu_fast_compile: got 'sometimes'; give true, false or auto"):
        XlaConfig(cpu_fast_compile="sometimes")


def test_the_initialiser_is_optimised_from_twenty_million_parameters_per_device():
    # Below `init_llvm_from_params` (zoo.backend) the initialiser's compile is its cost (LLVM off); above, its
    # random numbers are (level 1: qwen2_100m's init 10 s -> 4 s, bench/init_compile.py at 6966f25).
    from zoo.model import init_compile_options

    assert CPU.init_llvm_from_params == 20e6
    level = lambda n: init_compile_options("cpu", n)["xla_backend_optimization_level"]  # noqa: E731
    assert level(count_params(SIZES["dsv3_tiny_a"])) == 0 and level(19.9e6) == 0
    assert level(20e6) == 1 and level(count_params(SIZES["qwen2_100m"])) == 1
    assert level(count_params(SIZES["qwen2_100m"]) / 8) == 0  # the size per device decides
    assert init_compile_options("gpu", 1e9) is None


def test_backend_choices_live_in_one_record_that_train_py_prints():
    """zoo.backend holds every backend-specific choice: no block, loss, sampling or step module tests
    for the CPU itself, and the startup line names the record's CPU figures."""
    import ast
    import pathlib

    from zoo import backend

    root = pathlib.Path(__file__).resolve().parents[1] / "zoo"
    modules = [
        *root.glob("nn/*.py"),
        root / "model.py",
        root / "loss.py",
        root / "lora.py",
        root / "sampling.py",
        root / "train" / "step.py",
    ]
    found = [
        f"{m.relative_to(root.parent)}:{node.lineno}"
        for m in modules
        for node in ast.walk(ast.parse(m.read_text()))
        if isinstance(node, ast.Compare)
        and any(isinstance(x, ast.Constant) and x.value == "cpu" for x in [node.left, *node.comparators])
    ]
    assert not found, found
    assert backend.choices("cpu") is backend.CPU and backend.choices("gpu").step_llvm_from_run_flops is None
    line = backend.CPU.describe()
    assert (
        line.startswith("backend cpu (zoo.backend): ")
        and "from 0.05 TFLOP per run" in line
        and "from 256 positions" in line
    )
    assert backend.choices("gpu").describe().startswith("backend gpu (zoo.backend): XLA's default compile options")
