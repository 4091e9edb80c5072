"""quasar.fileio: atomic writes land whole, with the permissions a plain write would give,
and a failure leaves the target as it was and no temporary behind."""

from __future__ import annotations

import os
import re
import shutil
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


# --------------------------------------------------------------------------- manifests, temporaries, locks, full disks

import json
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

from quasar.cache.keys import BLOCK, SAMPLES, sampled_digest
from quasar.cache.manifest import MANIFEST, verify
from quasar.fileio import NoSpaceError

REPO = Path(__file__).resolve().parents[2]


def _flip(path: Path, at: float = 0.5) -> None:
    data = bytearray(path.read_bytes())
    data[int(len(data) * at)] ^= 0xFF
    path.write_bytes(bytes(data))


def _fill_three(d: Path) -> None:
    (d / "a.bin").write_bytes(bytes(range(256)) * 4096)
    (d / "sub").mkdir()
    (d / "sub" / "b.txt").write_text("hello\n" * 100)
    (d / "empty").write_bytes(b"")


def test_a_flipped_byte_in_any_file_or_the_manifest_is_named(tmp_path):
    out = atomic_dir(tmp_path / "ckpt", _fill_three)
    assert json.loads((out / MANIFEST).read_text())["files"].keys() == {"a.bin", "sub/b.txt", "empty"}
    assert verify(out, required=True) == 256 * 4096 + 600
    for rel in ("a.bin", "sub/b.txt", MANIFEST):
        broken = tmp_path / f"broken-{rel.replace('/', '-')}"
        shutil.copytree(out, broken)
        _flip(broken / rel)
        with pytest.raises(QuasarError, match=re.escape(str(broken / rel))) as e:
            verify(broken, required=False)
        assert "\n" not in str(e.value)
    (out / "empty").unlink()
    with pytest.raises(QuasarError, match="empty: missing"):
        verify(out, required=False)
    plain = tmp_path / "plain"
    plain.mkdir()
    assert verify(plain, required=False) is None  # a user's directory from elsewhere: nothing to check
    with pytest.raises(QuasarError, match="no quasar-manifest.json"):
        verify(plain, required=True)  # a cache entry: it must have one


def test_content_key_ignores_path_and_times_but_not_content(tmp_path):
    a = tmp_path / "a.bin"
    a.write_bytes(os.urandom(3 << 20))
    b = tmp_path / "elsewhere" / "renamed.bin"
    b.parent.mkdir()
    shutil.copyfile(a, b)  # a copy with new times
    os.utime(b, (1, 1))
    assert sampled_digest(a) == sampled_digest(b)
    size = a.stat().st_size
    middle = (size - BLOCK) * 7 // (SAMPLES - 1)  # the start of the 8th sampled block
    for at in (0, middle + 100, size - 1):
        c = tmp_path / f"c{at}"
        shutil.copyfile(a, c)
        _flip(c, at / size)
        assert sampled_digest(c) != sampled_digest(a)
    small = tmp_path / "small.json"
    small.write_text('{"x": 1}')
    before = sampled_digest(small)
    _flip(small)
    assert sampled_digest(small) != before  # small files are hashed whole


_HOLD = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from quasar.fileio import atomic_dir

    def fill(d):
        (d / "part").write_bytes(b"x" * 1000)
        print("filling", flush=True)
        time.sleep(float(sys.argv[2]))
        (Path(sys.argv[1]).parent / "log").open("a").write("built\\n")

    atomic_dir(sys.argv[1], fill, exist_ok=True)
    print("done", flush=True)
""")


def _holder(out: Path, seconds: float) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, "-c", _HOLD, str(out), str(seconds)], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, cwd=REPO)
    assert p.stdout.readline().strip() == "filling"
    return p


def _temps(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.glob(".*.tmp-*"))


def test_temporaries_of_a_killed_writer_are_removed_by_the_next_run(tmp_path):
    killed = _holder(tmp_path / "a", 600)
    killed.send_signal(signal.SIGKILL)
    killed.wait()
    assert len(_temps(tmp_path)) == 1 and re.fullmatch(rf"\.a\.tmp-{killed.pid}-[0-9a-f]{{8}}", _temps(tmp_path)[0])
    live = _holder(tmp_path / "b", 600)  # the next writer in the folder removes the dead one's
    try:
        assert [n.split(".tmp-")[0] for n in _temps(tmp_path)] == [".b"]
        atomic_dir(tmp_path / "c", lambda d: None)  # and a writer that still runs keeps its own
        assert [n.split(".tmp-")[0] for n in _temps(tmp_path)] == [".b"]
    finally:
        live.kill()
        live.wait()
    atomic_dir(tmp_path / "a", lambda d: None, exist_ok=True)
    assert not list(tmp_path.glob(".*.tmp-*"))


def test_one_process_builds_an_entry_the_others_wait_and_use_it(tmp_path):
    out = tmp_path / "entry"
    first = _holder(out, 3)
    second = subprocess.Popen([sys.executable, "-c", _HOLD, str(out), "0"], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, cwd=REPO)
    outputs = [p.communicate(timeout=120) for p in (first, second)]
    assert [p.returncode for p in (first, second)] == [0, 0], outputs
    assert (tmp_path / "log").read_text() == "built\n"  # one build
    assert "waiting for another process to finish writing" in outputs[1][1]
    assert verify(out, required=True) == 1000
    assert sorted(p.name for p in tmp_path.iterdir()) == ["entry", "log"]  # no lock file, no temporary


@pytest.fixture
def small_disk(tmp_path):
    """A 1 MB tmpfs (we run as root in CI); skipped where mounting is not allowed."""
    mount = tmp_path / "disk"
    mount.mkdir()
    run = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)], capture_output=True)
    if run.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs: {run.stderr.decode().strip()}")
    yield mount
    subprocess.run(["umount", str(mount)], check=True)


def test_a_full_disk_is_one_line_naming_the_target_and_leaves_nothing(small_disk):
    import torch
    from safetensors.torch import save_file

    def big(d):
        save_file({"w": torch.zeros(1 << 19)}, str(d / "w.safetensors"))  # 2 MB: safetensors' own error type

    for fill, need, match in ((big, None, "more than the"), (big, 3 << 20, "about 3.1 MB"),
                              (lambda d: (d / "x").write_bytes(b"x" * (2 << 20)), None, "more than the")):
        with pytest.raises(NoSpaceError, match=f"no space left on the device for {small_disk / 'out'}: "
                                               f"it needs {match}") as e:
            atomic_dir(small_disk / "out", fill, need_bytes=need)
        assert isinstance(e.value, OSError) and "\n" not in str(e.value)
        assert list(small_disk.iterdir()) == []
    with pytest.raises(NoSpaceError, match="report.json: it needs about 2.1 MB"):
        write_atomic(small_disk / "report.json", b"x" * (2 << 20))
    assert list(small_disk.iterdir()) == []
