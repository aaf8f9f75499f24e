"""`hybrid.atomic`: a failed write leaves the old file, a finished one has the umask's mode, no temporary file
is left behind."""

import os

import pytest

from hybrid.atomic import atomic_path, atomic_write_text


def test_failed_write_leaves_the_old_file_and_no_partial(tmp_path):
    target = tmp_path / "out.txt"
    target.write_text("old")
    with pytest.raises(RuntimeError):
        with atomic_path(target) as tmp:
            tmp.write_text("half")
            raise RuntimeError("interrupted")
    assert target.read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.txt"]


def test_finished_write_replaces_with_umask_mode(tmp_path):
    old = os.umask(0o027)
    try:
        atomic_write_text(tmp_path / "sub" / "out.txt", "new")
    finally:
        os.umask(old)
    target = tmp_path / "sub" / "out.txt"
    assert target.read_text() == "new"
    assert target.stat().st_mode & 0o777 == 0o640
    assert sorted(p.name for p in target.parent.iterdir()) == ["out.txt"]


def test_directory_target_refused(tmp_path):
    with pytest.raises(IsADirectoryError, match=str(tmp_path)):
        atomic_write_text(tmp_path, "x")


def test_a_rewritten_file_keeps_its_mode(tmp_path):
    """A 0600 file stays 0600 when rewritten (a new file gets the umask's mode, above)."""
    target = tmp_path / "secret.txt"
    target.write_text("old")
    target.chmod(0o600)
    atomic_write_text(target, "new")
    assert target.read_text() == "new"
    assert target.stat().st_mode & 0o777 == 0o600


def test_a_symlink_is_kept_and_its_target_rewritten(tmp_path):
    """Writing through a symlink replaces its target (written beside the target, not the link): the link
    stays a link and reads the new data; the target keeps its mode; no temporary file is left."""
    (tmp_path / "real").mkdir()
    (tmp_path / "links").mkdir()
    target = tmp_path / "real" / "cache.st"
    target.write_text("old")
    target.chmod(0o640)
    link = tmp_path / "links" / "cache.st"
    link.symlink_to(target)
    atomic_write_text(link, "new")
    assert link.is_symlink() and os.readlink(link) == str(target)
    assert target.read_text() == "new" and link.read_text() == "new"
    assert target.stat().st_mode & 0o777 == 0o640
    assert sorted(p.name for p in (tmp_path / "real").iterdir()) == ["cache.st"]
    assert sorted(p.name for p in (tmp_path / "links").iterdir()) == ["cache.st"]


def test_a_dangling_symlink_gets_its_target_created(tmp_path):
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "target.txt")
    atomic_write_text(link, "new")
    assert link.is_symlink() and (tmp_path / "target.txt").read_text() == "new"
