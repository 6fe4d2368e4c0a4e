"""Writing a model file so that nothing is lost.

The output is written to a temporary file in the target's own directory and renamed over the
target only once it is complete and synced. A process that has the old file open or
memory-mapped (a running ntransformerd serving it) keeps the old inode, which the rename never
truncates; a failure, Ctrl-C or a full disk removes the temporary file and leaves the target as
it was. An output that is one of the inputs is refused before anything is written.

Model files are regular files, in and out. An output path that names a device node, a FIFO, a
socket or a directory is refused before anything is written: the rename would put a regular
file in the node's place (as root, `... /dev/null` would replace /dev/null). An input that is not
a regular file is refused before it is opened: opening a FIFO waits for a writer forever, and a
device reads without end.
"""

from __future__ import annotations

import contextlib
import os
import stat
import tempfile
from collections.abc import Iterator

PARTIAL_SUFFIX = ".partial"


class OutputError(ValueError):
    """The output path cannot be written as asked; the message says why and what to do."""


class InputError(ValueError):
    """The input path cannot be read as a file; the message says why and what to do."""


def _not_regular(path: str) -> str | None:
    """What `path` (symlinks followed) is when it exists and is not a regular file, else None."""
    try:
        mode = os.stat(path).st_mode
    except (FileNotFoundError, NotADirectoryError):
        return None
    if stat.S_ISREG(mode):
        return None
    return ("a directory" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode)
            else "a socket" if stat.S_ISSOCK(mode) else "a character device" if stat.S_ISCHR(mode)
            else "a block device" if stat.S_ISBLK(mode) else "not a regular file")


def check_output(output: str, *inputs: str | None) -> None:
    """Refuse an output that exists and is not a regular file (a directory, device node, FIFO or
    socket), lies in a missing directory, or is one of `inputs` (the same file by any name: a
    symlink or a hard link counts)."""
    kind = _not_regular(output)
    if kind == "a directory":
        raise OutputError(f"{output} is a directory: give the path of the file to write")
    if kind:
        raise OutputError(f"{output} is {kind}, not a regular file: write to a file path "
                          "(nothing was written; the node is left as it is)")
    parent = os.path.dirname(os.path.abspath(output))
    if not os.path.isdir(parent):
        raise OutputError(f"cannot write {output}: no directory {parent}")
    for src in inputs:
        if src and os.path.exists(output) and os.path.exists(src) and os.path.samefile(src, output):
            raise OutputError(f"{output} is the input file: write to another path (the input stays as it is)")


def check_input(path: str, what: str = "a model file") -> None:
    """Refuse an input that exists and is not a regular file (a missing one is left to the
    reader, whose FileNotFoundError names it)."""
    kind = _not_regular(path)
    if kind:
        raise InputError(f"{path} is {kind}, not a regular file: give the path of {what}")


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
    check_output(target)
    parent = os.path.dirname(target)
    fd, tmp = tempfile.mkstemp(dir=parent, prefix=f".{os.path.basename(target)}.", suffix=PARTIAL_SUFFIX)
    os.close(fd)
    try:
        yield tmp
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.chmod(tmp, _mode_for(target))
        check_output(target)  # made a node while we wrote: still never replaced by the rename
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
