"""What the command-line apps share, with the standard library only.

* ``format_table``: their one plain-text table format.
* ``InputError``: a value or file the user gave that a command cannot use.
* Output files, all or nothing: ``check_output_folder`` tries the output
  folder before any work, and ``write_files`` writes every file to a
  temporary name beside it and moves them all into place only once each has
  been written, so that a failure leaves no half-written file and no partial
  set. ``OutputError`` is what either raises when the system refuses.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A plain-text table: first column left-aligned, the others right-aligned.

    >>> print(format_table(["model", "ms"], [["mlp", 2.5], ["cnn", 11]]))
    model   ms
    -----  ---
    mlp    2.5
    cnn     11
    """
    cells = [list(map(str, headers))] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[j]) for row in cells) for j in range(len(headers))]

    def line(row):
        return "  ".join(c.ljust(w) if j == 0 else c.rjust(w) for j, (c, w) in enumerate(zip(row, widths)))

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([line(cells[0]), rule] + [line(row) for row in cells[1:]])


class InputError(ValueError):
    """A value or file given by the user that a command cannot use.

    Its message is one line; ``pegrad`` prints it as
    ``pegrad COMMAND: error: MESSAGE`` and exits 2.
    """


class OutputError(OSError):
    """The system refused an output file or folder (permission, read-only, disk full).

    Its message is one line naming the path and the system's reason; its
    ``errno`` is the refused call's. ``pegrad`` prints it as
    ``pegrad COMMAND: error: MESSAGE`` and exits 1.
    """

    def __init__(self, message: str, cause: OSError) -> None:
        super().__init__(message)
        self.errno = cause.errno


def first_line(error: BaseException) -> str:
    """The first non-blank line of ``str(error)``, or its type's name if there is none."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return lines[0] if lines else type(error).__name__


PROBE_TEXT = b"pegrad: checking that this folder takes files\n"


def check_output_folder(folder: str | Path) -> None:
    """Checks, before any work, that files can be written in ``folder``.

    Creates ``folder`` with its missing parents, writes and removes a small
    file in it, and then removes the folders it created, so that a run that
    fails later leaves no empty folder behind; ``write_files`` creates them
    again. The messages name the folder as the apps' ``--out``.

    Raises:
      InputError: ``folder`` is an existing file, or so is one of its
        parents: the path cannot name a folder.
      OutputError: the system refused to create the folder or the file
        (no permission, a read-only file system, a full disk).
    """
    folder = Path(folder)
    if folder.exists() and not folder.is_dir():
        raise InputError(f"--out {folder} exists and is not a folder")
    created = []  # deepest first
    ancestor = folder.absolute()
    while not ancestor.exists():
        created.append(ancestor)
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise InputError(f"--out {folder} cannot be created: {ancestor} is not a folder")
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = _new_temporary(folder / "probe")
        try:
            probe.write_bytes(PROBE_TEXT)
        finally:
            probe.unlink()
    except OSError as e:
        raise OutputError(f"--out {folder} cannot be written ({first_line(e)})", e) from e
    finally:
        for path in created:
            with contextlib.suppress(OSError):
                path.rmdir()


def write_files(writers: Mapping[str | Path, Callable[[Path], Any]]) -> list[Path]:
    """Writes every file or none: ``writers[target](temporary)`` for each, then moves all into place.

    Each target's folder is created if missing, and its writer is called
    with a new, empty file beside the target (hidden, named after it), where
    it must write the whole file. Once every writer has returned, each
    temporary is moved onto its target with ``os.replace``, which on one
    file system replaces the old file at once. If a writer or a move fails,
    or the run is interrupted, the temporaries not yet moved are removed and
    the error propagates: a failure while writing leaves every target as it
    was, none of the new files in place; a failed move (rare: the folder is
    already known to take files) leaves those moved before it.

    Returns:
      The targets, as paths, in the order given.

    Raises:
      OutputError: the system refused a folder, a temporary, a write (an
        ``OSError`` from a writer, such as a full disk) or a move; the
        message names the target. Other exceptions from a writer propagate
        as they are.
    """
    pending: dict[Path, Path] = {}  # target -> its temporary, until moved
    try:
        for target, write in writers.items():
            target = Path(target)
            try:
                target.parent.mkdir(parents=True, exist_ok=True)
                pending[target] = _new_temporary(target)
                write(pending[target])
            except OSError as e:
                raise OutputError(f"could not write {target} ({first_line(e)})", e) from e
        for target, temporary in list(pending.items()):
            try:
                os.replace(temporary, target)
            except OSError as e:
                raise OutputError(f"could not move {temporary} to {target} ({first_line(e)})", e) from e
            del pending[target]
    finally:
        for temporary in pending.values():
            with contextlib.suppress(OSError):
                temporary.unlink()
    return [Path(target) for target in writers]


def _new_temporary(target: Path) -> Path:
    """Creates a new empty file beside ``target`` (mode 0o666 less the umask) and returns its path."""
    while True:
        path = target.with_name(f".{target.name}.{secrets.token_hex(4)}.tmp")
        try:
            os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
        except FileExistsError:
            continue
        return path
