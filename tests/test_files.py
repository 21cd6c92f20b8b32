"""Files written whole, and files read from untrusted trees without following their links."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from cuda_agent.files import LinkOutside, atomic_copy, atomic_write, open_inside, read_inside


def test_atomic_write_replaces_whole_and_leaves_no_temporary(tmp_path: Path) -> None:
    target = tmp_path / "sub" / "f.json"
    atomic_write(target, "one")
    atomic_write(target, b"two")
    atomic_write(target, lambda fh: fh.write(b"three"), mode=0o600)
    assert target.read_text() == "three" and target.stat().st_mode & 0o777 == 0o600
    atomic_copy(target, tmp_path / "copy")
    assert (tmp_path / "copy").read_text() == "three"
    assert sorted(p.name for p in (tmp_path / "sub").iterdir()) == ["f.json"]


def test_a_failed_write_keeps_the_old_file(tmp_path: Path) -> None:
    target = tmp_path / "f"
    atomic_write(target, "old")

    def broken(fh) -> None:  # type: ignore[no-untyped-def]
        fh.write(b"partial")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError):
        atomic_write(target, broken)
    assert target.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["f"]


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    secret = tmp_path / "secret"
    secret.mkdir()
    (secret / "key").write_text("SECRET")
    root = tmp_path / "root"
    (root / "a" / "b").mkdir(parents=True)
    (root / "a" / "b" / "plain").write_text("plain")
    (root / "a" / "link").symlink_to(secret / "key")
    (root / "a" / "relative").symlink_to("b/plain")  # a link that stays inside is still a link
    (root / "dirlink").symlink_to(secret)
    os.mkfifo(root / "a" / "fifo")
    return root


def test_plain_files_below_the_root_are_read(tree: Path) -> None:
    assert read_inside(tree, tree / "a" / "b" / "plain") == b"plain"
    with open_inside(tree, tree / "a" / "b" / "plain") as fh:
        assert fh.read() == b"plain"


@pytest.mark.parametrize("rel", ["a/link", "a/relative", "dirlink/key", "a/fifo", "a/b"])
def test_links_fifos_and_folders_are_refused(tree: Path, rel: str) -> None:
    """A FIFO would make the reader wait for a writer that never comes: refused at once."""
    result: list[BaseException | bytes] = []
    th = threading.Thread(target=lambda: result.append(_try(tree, tree / rel)), daemon=True)
    th.start()
    th.join(10)
    assert result and isinstance(result[0], (LinkOutside, IsADirectoryError)), result
    assert "SECRET" not in str(result[0])


def _try(root: Path, path: Path) -> BaseException | bytes:
    try:
        return read_inside(root, path)
    except BaseException as exc:  # returned for the assertion
        return exc


def test_paths_outside_the_root_are_refused(tree: Path) -> None:
    with pytest.raises(LinkOutside):
        read_inside(tree / "a", tree / "dirlink" / "key")
    with pytest.raises(LinkOutside):
        read_inside(tree, tree / "a" / ".." / ".." / "secret" / "key")


def test_a_size_bound_is_checked_before_reading(tree: Path) -> None:
    with pytest.raises(ValueError, match="larger"):
        read_inside(tree, tree / "a" / "b" / "plain", max_bytes=3)
