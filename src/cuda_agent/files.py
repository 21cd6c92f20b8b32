"""Files written whole (readers, such as other processes polling for a name or a cache
read concurrently, see the old file or the new one, never a part), and files read from
trees an untrusted process could write without following its links."""

from __future__ import annotations

import errno
import os
import shutil
import stat
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO


def atomic_write(path: Path, data: str | bytes | Callable[[BinaryIO], object], mode: int = 0o644) -> Path:
    """Write `data` (text, bytes, or a function writing to a binary file) to a new
    temporary file beside `path`, then rename it over `path`. Creates the folder."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            if callable(data):
                data(fh)
            else:
                fh.write(data.encode() if isinstance(data, str) else data)
        os.chmod(tmp, mode)  # mkstemp creates 0600 files
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def atomic_copy(src: Path, dst: Path) -> Path:
    """Copy `src` (contents and mode) to `dst` through a temporary file beside it."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{dst.name}.", suffix=".tmp", dir=dst.parent)
    os.close(fd)
    try:
        shutil.copy2(src, tmp)
        os.replace(tmp, dst)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return dst


class LinkOutside(OSError):
    """A path below an untrusted folder is a symbolic link (or not a plain file or folder)."""


_NOFOLLOW_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def _below(root: Path, path: Path) -> Path:
    """`path` relative to `root`; LinkOutside when it is not a file below it."""
    try:
        rel = Path(os.path.normpath(path)).relative_to(os.path.normpath(root))
    except ValueError:
        rel = Path()
    if not rel.parts:
        raise LinkOutside(f"{path} is not a file below {root}")
    return rel


def _open_at(fd: int, rel: Path, flags: int, mode: int = 0o644) -> int:
    try:
        # O_NONBLOCK: opening a FIFO must not wait for the other end
        return os.open(rel.parts[-1], flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, mode, dir_fd=fd)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise LinkOutside(f"{rel} is a symbolic link") from None
        raise
    finally:
        os.close(fd)


def open_inside(root: Path, path: Path) -> BinaryIO:
    """Open `path`, a file below `root`, for reading without following a symbolic link
    anywhere below `root`: each folder is opened relative to the last with O_NOFOLLOW,
    and the file must be a regular file (a FIFO or device could hang or leak). For files
    in trees an untrusted process could write (a run directory, a solution, a workspace),
    read by a process with more rights than the writer. `root` itself is trusted."""
    rel = _below(root, path)
    ffd = _open_at(_dir_inside(root, rel.parent, create=False), rel, os.O_RDONLY)
    if not stat.S_ISREG(os.fstat(ffd).st_mode):
        os.close(ffd)
        raise LinkOutside(f"{rel} is not a regular file")
    return os.fdopen(ffd, "rb")


def _dir_inside(root: Path, rel: Path, create: bool) -> int:
    """An fd of folder `rel` below `root`, each part opened with O_NOFOLLOW (made, with
    `create`, where missing)."""
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for part in rel.parts:
            try:
                sub = os.open(part, _NOFOLLOW_DIR, dir_fd=fd)
            except FileNotFoundError:
                if not create:
                    raise
                os.mkdir(part, 0o755, dir_fd=fd)
                sub = os.open(part, _NOFOLLOW_DIR, dir_fd=fd)
            except OSError as exc:
                if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                    raise LinkOutside(f"{part} in {rel} is a symbolic link or not a folder") from None
                raise
            os.close(fd)
            fd = sub
        return fd
    except BaseException:
        os.close(fd)
        raise


def write_inside(root: Path, path: Path, data: bytes, mode: int = 0o644) -> None:
    """Write `data` to `path` below `root` (folders made as needed) without following a
    symbolic link anywhere below `root`: for a process with more rights than the one that
    shapes the tree (the agent's tools, writing into the agent's workspace)."""
    rel = _below(root, path)
    ffd = _open_at(_dir_inside(root, rel.parent, create=True), rel, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(ffd, "wb") as fh:
        if not stat.S_ISREG(os.fstat(fh.fileno()).st_mode):
            raise LinkOutside(f"{rel} is not a regular file")
        fh.write(data)


def read_inside(root: Path, path: Path, max_bytes: int | None = None) -> bytes:
    """The bytes of `path` below `root`, read as `open_inside` opens it; with `max_bytes`,
    a larger file raises ValueError before it is read."""
    with open_inside(root, path) as fh:
        if max_bytes is not None and os.fstat(fh.fileno()).st_size > max_bytes:
            raise ValueError(f"{path.name} is larger than {max_bytes} bytes")
        return fh.read()
