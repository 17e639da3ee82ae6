"""`python -m zoo.write_conf [dir]`: write `conf/model/<size>.yaml` for every entry of zoo.config.SIZES
(the named sizes are defined once, in Python; the Hydra options are generated from them)."""

import pathlib
import sys

from zoo.config import SIZES, conf_yaml


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    out = pathlib.Path(argv[0]) if argv else pathlib.Path(__file__).resolve().parent.parent / "conf" / "model"
    for size in SIZES:
        (out / f"{size}.yaml").write_text(conf_yaml(size))
    print(f"wrote {len(SIZES)} files to {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
