"""Why a checkpoint step cannot be read or saved, in one clause, and quiet after a failed restore.

TensorStore's errors are kilobytes of spec around one status line; `unreadable_reason` keeps the status in plain
words and the file, `why_save_failed` the operating system's reason (`No space left on device`). A restore that
failed leaves reads behind that report into a closed event loop; `quiet_closed_loop_callbacks` drops those, and
only those.
"""

import logging
import pathlib
import re
import sys
import warnings
from typing import Optional


class Unreadable(Exception):
    """A step directory that cannot be restored; the message is one short clause saying why."""


# The status codes TensorStore puts in front of what it could not read, in plain words.
_READ_ERRORS = {
    "OUT_OF_RANGE": "an array file is truncated",
    "DATA_LOSS": "an array file is damaged",
    "NOT_FOUND": "a file is missing",
    "PERMISSION_DENIED": "a file cannot be read",
}
_STATUS = re.compile(
    r"\b(OUT_OF_RANGE|DATA_LOSS|NOT_FOUND|PERMISSION_DENIED|INVALID_ARGUMENT|FAILED_PRECONDITION|UNKNOWN|INTERNAL): "
)
# Files orbax writes into every step; named when a restore fails without them.
_ORBAX_FILES = ("state/_METADATA", "state/manifest.ocdbt")


def _abandoned_read(unraisable) -> bool:
    """An unraisable exception from a read of a restore that already failed (see below)."""
    e, obj = unraisable.exc_value, unraisable.object
    if isinstance(e, RuntimeError) and str(e) == "Event loop is closed":
        return True
    # The other reads of the failed restore: orbax's per-array coroutine, closed unfinished when its
    # loop goes away, raises its own read error again (orbax-checkpoint 0.12.8 on the 2-core machine).
    return getattr(obj, "__qualname__", "").endswith("_read_array_index_and_device_put") and str(e).startswith(
        "Encountered error while reading array index"
    )


def quiet_closed_loop_callbacks() -> None:
    """After a failed restore, TensorStore still completes the reads orbax gave up on, and their
    callbacks find orbax's event loop closed: a `RuntimeError('Event loop is closed')` traceback
    each, or the read's own error raised again as its coroutine is closed (via sys.unraisablehook),
    even after the one line that said why the step was skipped; and a coroutine orbax created for
    the failed restore but never awaited warns as the interpreter exits ("coroutine
    'Store._get_array_metadatas' was never awaited", orbax-checkpoint 0.12.8 on CI's 2-core machine).
    Those, and only those, are dropped from the first restore of a resume on (zoo has no coroutines)."""
    previous = sys.unraisablehook
    if getattr(previous, "_zoo_quiet", False):
        return
    warnings.filterwarnings("ignore", message=r"coroutine '[\w.<>]+' was never awaited", category=RuntimeWarning)

    def hook(unraisable):
        if _abandoned_read(unraisable):
            return
        previous(unraisable)

    hook._zoo_quiet = True
    sys.unraisablehook = hook
    # Or an abandoned read's task is collected with its error unretrieved, which asyncio logs
    # ("Task exception was never retrieved", seen once in a few hundred damaged-step restores).
    logging.getLogger("asyncio").addFilter(_not_an_abandoned_read_task)


def _not_an_abandoned_read_task(record) -> bool:
    e = record.exc_info[1] if record.exc_info else None
    text = record.getMessage() + (str(e) if e is not None else "")
    if "Encountered error while reading array index" in text:
        return False
    # A TensorStore read error (it carries a status code) in a task nobody awaited: an abandoned read.
    return not (text.startswith("Task exception was never retrieved") and _STATUS.search(text))


def missing_orbax_files(step_dir: pathlib.Path) -> Optional[str]:
    """ "state/manifest.ocdbt is missing" (or both files), None when orbax's files are all there."""
    missing = [f for f in _ORBAX_FILES if not (step_dir / f).exists()]
    return f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} missing" if missing else None


def require_orbax_files(step_dir: pathlib.Path) -> None:
    """Unreadable when a file orbax writes into every step is gone: said before any read starts, so
    no half-started restore leaves reads behind to report after the one line."""
    missing = missing_orbax_files(step_dir)
    if missing:
        raise Unreadable(missing)


def why_save_failed(e: BaseException) -> str:
    """The operating system's reason when an OSError is in the chain (`No space left on device`), else
    the error's first line."""
    seen = []
    while e is not None and e not in seen:
        seen.append(e)
        if isinstance(e, OSError) and e.strerror:
            return e.strerror
        e = e.__cause__ or e.__context__
    first = str(seen[0]).strip().splitlines()
    return f"{type(seen[0]).__name__}: {first[0][:200] if first else ''}"


def unreadable_reason(e: BaseException, step_dir: pathlib.Path) -> str:
    """One short clause for why restoring `step_dir` failed: TensorStore's innermost status message
    without its multi-kilobyte spec, paths relative to the step directory."""
    missing = missing_orbax_files(step_dir)
    if missing:
        return missing
    chain: list[BaseException] = []
    while e is not None and e not in chain:
        chain.append(e)
        e = e.__cause__ or e.__context__
    for x in reversed(chain):  # the innermost error names the array and the file
        m = _STATUS.search(str(x))
        if m:
            text, code = str(x)[m.start() :], m.group(1)
            break
    else:
        first = str(chain[0]).strip().splitlines()
        text, code = f"{type(chain[0]).__name__}: {first[0] if first else ''}", None
    text = re.split(r" \[tensorstore_spec|\. See full TensorStore details", text, maxsplit=1)[0]
    text = re.sub(r'Error opening "\w+" driver: ', "", text)
    text = re.sub(r' in OCDBT database at local file "[^"]*"', "", text)
    text = text.replace(f'local file "{step_dir}/', '"')
    if len(text) > 240:
        text = text[:237] + "..."
    return f"{_READ_ERRORS[code]}: {text}" if code in _READ_ERRORS else text
