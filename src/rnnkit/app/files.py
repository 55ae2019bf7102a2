"""Files the command writes: atomically (a temporary name beside the file, flushed to disk, moved
into place with ``os.replace``), so a reader, or a run stopped mid-write, finds the old file or
the new one, never half of one."""
from __future__ import annotations

import os
from pathlib import Path


def temporary_name(path: Path) -> Path:
    """Where `atomic_write` puts ``path``'s bytes before the rename."""
    return path.with_name(f".{path.name}.tmp-{os.getpid()}")


def atomic_write(path: Path, data: bytes) -> None:
    """Write to a temporary name beside ``path``, fsync, os.replace, fsync the directory: never a half file."""
    path = Path(path)
    temporary = temporary_name(path)
    try:
        with open(temporary, "wb") as file:
            file.write(data)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
    finally:
        if temporary.exists():
            temporary.unlink()
    _fsync_directory(path.parent)


def _fsync_directory(directory: Path) -> None:
    """Make the rename itself durable (POSIX); a no-op where directories cannot be opened."""
    try:
        descriptor = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(descriptor)
    except OSError:
        pass
    finally:
        os.close(descriptor)
