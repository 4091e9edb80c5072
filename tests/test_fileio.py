"""quasar.fileio: atomic writes land whole, with the permissions a plain write would give,
and a failure leaves the target as it was and no temporary behind."""

from __future__ import annotations

import os
import stat

import pytest

from quasar.errors import QuasarError
from quasar.fileio import atomic_dir, write_atomic


@pytest.fixture
def umask_027():
    old = os.umask(0o027)
    yield
    os.umask(old)


def _mode(path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_write_atomic_respects_the_umask(tmp_path, umask_027):
    p = write_atomic(tmp_path / "report.md", "hello\n")
    assert p.read_text() == "hello\n"
    assert _mode(p) == 0o640  # not mkstemp's private 0o600
    write_atomic(p, b"again")
    assert p.read_bytes() == b"again"
    assert [q.name for q in tmp_path.iterdir()] == ["report.md"]


def test_atomic_dir_respects_the_umask_and_cleans_up(tmp_path, umask_027):
    out = atomic_dir(tmp_path / "ckpt", lambda d: (d / "a.bin").write_bytes(b"x"))
    assert (out / "a.bin").read_bytes() == b"x"
    assert _mode(out) == 0o750  # not mkdtemp's private 0o700

    def fail(d):
        (d / "half.bin").write_bytes(b"x")
        raise RuntimeError("interrupted")

    with pytest.raises(RuntimeError):
        atomic_dir(tmp_path / "other", fail)
    with pytest.raises(QuasarError, match="already exists"):
        atomic_dir(out, lambda d: None)
    assert sorted(q.name for q in tmp_path.iterdir()) == ["ckpt"]
