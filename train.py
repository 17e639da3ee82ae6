"""Train any zoo model on any mesh with any offload policy: `python train.py [group=option ...] [key=value ...]`.

Hydra composes conf/ (see README.md); `-m` sweeps. Bad input exits 2 with one `error:` line.
"""

import pathlib
import sys

import hydra
from omegaconf import DictConfig

from zoo.train.cli import main as cli_main
from zoo.train.cli import run_job

CONF = pathlib.Path(__file__).resolve().parent / "conf"


# An absolute config path: the same config whether this file runs as a script or is imported (tests
# call `cli_main(main, CONF)` in-process with sys.argv set).
@hydra.main(config_path=str(CONF), config_name="config", version_base=None)
def main(cfg: DictConfig) -> None:
    run_job(cfg)


if __name__ == "__main__":
    sys.exit(cli_main(main, CONF))
