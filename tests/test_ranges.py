"""Every numeric key of train.py's config has a declared range (zoo.ranges), and NaN, an infinity or
a value outside it is refused in one line naming the key, whatever the field (the walk below finds
them all; a new numeric field without a range fails here). The command line end to end (exit code
2, one `error:` line) for a sample of them: tests/test_train_cli.py's table."""

import copy
import dataclasses
import math
import pathlib
import sys
import typing

import in_process
import pytest
from omegaconf import OmegaConf, open_dict

from zoo.errors import ConfigError
from zoo.ranges import FLOAT32_MAX, INT_MAX, Range, ranges_of
from zoo.train.run_config import GROUPS, HardwareConfig, load, load_group, load_model

ROOT = pathlib.Path(__file__).resolve().parents[1]
# The hardware profile's schema is the planner's (its own checks); rope_local is a second RopeConfig.
SKIPPED = {"hardware", "model.rope_local"}


def _numeric(t, kind=(int, float)) -> bool:
    args = [a for a in typing.get_args(t) if a is not type(None)] if typing.get_origin(t) is typing.Union else [t]
    return len(args) == 1 and args[0] in (kind if isinstance(kind, tuple) else (kind,))


def _dataclass_of(t):
    args = typing.get_args(t) if typing.get_origin(t) is typing.Union else (t,)
    return next((a for a in args if dataclasses.is_dataclass(a)), None)


def numeric_fields() -> list[tuple[str, type, str]]:
    """(key, its dataclass, field name) for every int / float field of every group, nested sections included."""
    out = []

    def walk(cls, prefix):
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            key = f"{prefix}.{f.name}"
            if key in SKIPPED or f.metadata.get("group") is False:
                continue
            if _numeric(hints[f.name]):
                out.append((key, cls, f.name))
            elif _dataclass_of(hints[f.name]) is not None:
                walk(_dataclass_of(hints[f.name]), key)

    for group, cls in GROUPS.items():
        if group not in SKIPPED and cls is not HardwareConfig:
            walk(cls, group)
    return out


FIELDS = numeric_fields()


def test_every_numeric_field_declares_its_range():
    missing = [key for key, cls, name in FIELDS if name not in ranges_of(cls)]
    assert len(FIELDS) > 60 and not missing, f"declare their ranges (zoo.ranges.ranged): {missing}"


@pytest.fixture(scope="module")
def composed():
    """train.py's config with every section present: DeepSeek-V3 (latent attention, experts), LoRA on."""
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        cfg = compose("config", overrides=["model=dsv3_tiny_a", "lora=default", "hardware=cpu"])
    load(cfg)  # the base itself is valid
    return cfg


def _outside(cls, name):
    return ranges_of(cls)[name].outside() if name in ranges_of(cls) else -1


@pytest.mark.parametrize("key,cls,name", FIELDS, ids=[key for key, _, _ in FIELDS])
def test_nan_inf_and_out_of_range_values_are_one_line_naming_the_key(key, cls, name):
    """The dataclass alone: whoever builds it (YAML, the command line, Python) gets the line."""
    floating = _numeric(typing.get_type_hints(cls)[name], float)
    values = (math.nan, math.inf, -math.inf, float(_outside(cls, name))) if floating else (_outside(cls, name),)
    for value in values:
        with pytest.raises(ConfigError) as e:
            cls(**{name: value})
        assert str(e.value).startswith(f"{key}: must be ") and f", got {value!r}; e.g. {key}=" in str(e.value)


@pytest.mark.parametrize("key,cls,name", FIELDS, ids=[key for key, _, _ in FIELDS])
def test_the_loader_names_the_key_of_a_nan_or_out_of_range_value(composed, key, cls, name):
    """Through the group's loader (OmegaConf's merge, then the dataclass), as `load` runs each group of
    the composed config: NaN into an int field is OmegaConf's type error, named by the key too. The
    command line end to end: tests/test_train_cli.py."""
    group, rest = key.split(".", 1)
    for value in (math.nan, _outside(cls, name)):
        node = copy.deepcopy(composed[group])
        with open_dict(node):
            OmegaConf.update(node, rest, value, force_add=True)
        with pytest.raises(ConfigError) as e:
            load_model(node) if group == "model" else load_group(group, node)
        message = str(e.value)
        assert message.startswith(f"{key}: ") and "\n" not in message and ";" in message, message


# The fields whose range has no finite top: an int is held to a 32-bit integer (an optimizer.warmup_steps of 1e20
# overflowed inside the jitted step, a trainer.steps of 1e20 trained on for ever), a float to float32's largest
# (an optimizer.eps of 1e300 was inf in the step, and froze every weight).
CAPPED = [f for f in FIELDS if not ranges_of(f[1])[f[2]].bounded()]


@pytest.mark.parametrize("key,cls,name", CAPPED, ids=[key for key, _, _ in CAPPED])
def test_a_number_past_what_the_step_holds_is_one_line_naming_the_key(key, cls, name):
    integer = _numeric(typing.get_type_hints(cls)[name], int)
    for value in (INT_MAX + 1, 10**20) if integer else (FLOAT32_MAX * 2, 1e300):
        with pytest.raises(ConfigError) as e:
            cls(**{name: value})
        top = f"{INT_MAX} (what a 32-bit integer holds)" if integer else "3.4e38 (float32's largest)"
        assert str(e.value).startswith(f"{key}: must be ") and f" and at most {top}, got {value!r}; e.g. {key}=" in str(
            e.value
        )


@pytest.mark.parametrize(
    "spec,inside,outside",
    [
        ("[0, 1)", [0, 0.5], [1, -0.1, math.nan, math.inf]),
        ("(0, inf)", [1e-9, 1e300], [0, math.inf, math.nan]),
        ("-1 or [1, inf): -1 fills", [-1, 1, 7], [0, -2, math.inf]),
        ("0 or (1, inf)", [0, 1.5], [1, 0.5, -1]),
        ("[0, 2**32)", [0, 2**32 - 1], [2**32, -1]),
    ],
)
def test_a_range_holds_what_its_notation_says(spec, inside, outside):
    rng = Range.parse(spec)
    assert all(v in rng for v in inside) and not any(v in rng for v in outside)
    assert rng.outside() not in rng and rng.example() in rng


def test_the_line_says_the_range_and_a_valid_value():
    from zoo.train.run_config import OptimizerConfig

    with pytest.raises(ConfigError, match=r"^optimizer\.b1: must be in \[0, 1\), got 1\.5; e\.g\. optimizer\.b1=0\.9$"):
        OptimizerConfig(b1=1.5)


# Through train.py itself (in one pytest process: tests/in_process.py): every numeric key, NaN and a value
# outside its range, is one `error:` line naming the key and exit code 2. Every twelfth key's value outside
# its range in the default tier (the loader test above holds every key), all of them in the slow tier.
def _command_cases():
    for n, (key, cls, name) in enumerate(FIELDS):
        for value in (str(_outside(cls, name)), "nan"):
            sampled = n % 12 == 0 and value != "nan"
            marks = [in_process.MARK] + ([] if sampled else [pytest.mark.slow])
            yield pytest.param(key, value, marks=marks, id=f"{key}={value}")


@pytest.mark.parametrize("key,value", list(_command_cases()))
def test_train_py_refuses_every_numeric_key_out_of_range_in_one_line(key, value, request, tmp_path, capfd, monkeypatch):
    if not in_process.INNER:
        return in_process.outcome(request)
    extra = ["lora=default"] if key.startswith("lora.") else []
    cmd = [sys.executable, str(ROOT / "train.py"), "model=dsv3_tiny_a", *extra, f"{key}={value}"]
    p = in_process.run(cmd, tmp_path, capfd, monkeypatch)
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert p.returncode == 2 and len(lines) == 1 and lines[0].startswith(f"error: {key}: "), p.stderr[-2000:]
