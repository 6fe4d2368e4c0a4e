"""Writing a model file so that nothing is lost.

The output is written to a temporary file in the target's own directory and renamed over the
target only once it is complete and synced. A process that has the old file open or
memory-mapped (a running ntransformerd serving it) keeps the old inode, which the rename never
truncates; a failure, Ctrl-C or a full disk removes the temporary file and leaves the target as
it was. An output that is one of the inputs is refused before anything is written.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator

PARTIAL_SUFFIX = ".partial"


class OutputError(ValueError):
    """The output path cannot be written as asked; the message says why and what to do."""


def check_output(output: str, *inputs: str | None) -> None:
    """Refuse an output that is a directory, lies in a missing directory, or is one of `inputs`
    (the same file by any name: a symlink or a hard link counts)."""
    if os.path.isdir(output):
        raise OutputError(f"{output} is a directory: give the path of the .gguf file to write")
    parent = os.path.dirname(os.path.abspath(output))
    if not os.path.isdir(parent):
        raise OutputError(f"cannot write {output}: no directory {parent}")
    for src in inputs:
        if src and os.path.exists(output) and os.path.exists(src) and os.path.samefile(src, output):
            raise OutputError(f"{output} is the input file: write to another path (the input stays as it is)")


def _mode_for(target: str) -> int:
    """The existing target's permission bits, else what the umask gives a new file."""
    try:
        return os.stat(target).st_mode & 0o7777
    except FileNotFoundError:
        mask = os.umask(0)
        os.umask(mask)
        return 0o666 & ~mask


@contextlib.contextmanager
def atomic_output(output: str) -> Iterator[str]:
    """Yield a temporary path next to `output`; on a clean exit it becomes `output`.

    A symlink at `output` keeps pointing where it did: the file it names is the one replaced.
    """
    target = os.path.realpath(output)
    parent = os.path.dirname(target)
    fd, tmp = tempfile.mkstemp(dir=parent, prefix=f".{os.path.basename(target)}.", suffix=PARTIAL_SUFFIX)
    os.close(fd)
    try:
        yield tmp
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.chmod(tmp, _mode_for(target))
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    # the rename itself survives a crash only once the directory entry is on disk
    dfd = os.open(parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)
