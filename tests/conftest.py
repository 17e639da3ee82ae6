import os

# Eight simulated CPU devices for the sharding tests; must be set before jax is imported.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import pathlib  # noqa: E402

import pytest  # noqa: E402

DATA = pathlib.Path(__file__).parent / "data"


@pytest.fixture
def ref_dir():
    def get(name: str) -> pathlib.Path:
        return DATA / name

    return get
