"""Writing a user's file, never leaving it half-written or gone: a temporary file in the same folder, then
``os.replace`` (atomic on one file system). Used by the HTML reports and ``bench --csv``."""

from __future__ import annotations

import os
import tempfile


def new_file_mode() -> int:
    """A new file's mode here: 0o666 less the umask (mkstemp's 0600 would make a shared file private)."""
    umask = os.umask(0o022)
    os.umask(umask)
    return 0o666 & ~umask


def temp_beside(path: str) -> tuple[int, str]:
    """(fd, name) of a new temporary file in ``path``'s folder."""
    folder, name = os.path.split(os.path.abspath(path))
    return tempfile.mkstemp(dir=folder, prefix=f".{name}.", suffix=".tmp")


def install(tmp: str, path: str) -> None:
    """``tmp`` (written, closed) becomes ``path``; a failure removes ``tmp``, leaves ``path`` and raises."""
    try:
        os.chmod(tmp, new_file_mode())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.remove(tmp)
        except OSError:
            pass
        raise
