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
