"""The sandboxed executor runs generated code, stops runaway code and leaks nothing."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from quasar.data.datasets import load_humaneval
from quasar.eval.executor import check_humaneval, run_python


@pytest.fixture(scope="module")
def problem0() -> dict[str, str]:
    return load_humaneval(limit=1)[0]


def test_canonical_humaneval_solution_passes(problem0: dict[str, str]) -> None:
    res = check_humaneval(problem0, problem0["canonical_solution"], timeout_s=10.0)
    assert res.passed and res.status == "passed", res.stderr


def test_wrong_humaneval_solution_fails(problem0: dict[str, str]) -> None:
    res = check_humaneval(problem0, "    return False\n")
    assert not res.passed and res.status == "failed"
    assert "AssertionError" in res.detail


def test_syntax_error_fails() -> None:
    res = run_python("def f(:\n")
    assert res.status == "failed" and "SyntaxError" in res.detail


def test_infinite_loop_is_killed_within_limit() -> None:
    start = time.monotonic()
    res = run_python("while True: pass", timeout_s=1.0)
    elapsed = time.monotonic() - start
    assert res.status == "timeout" and not res.passed
    assert elapsed < 3.0


def test_sleeping_child_process_is_killed_with_group() -> None:
    code = "import subprocess, sys\nsubprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\nimport time; time.sleep(60)\n"
    start = time.monotonic()
    res = run_python(code, timeout_s=1.0)
    assert res.status == "timeout" and time.monotonic() - start < 3.0


@pytest.mark.parametrize(
    "code",
    [
        "x = bytearray(10**10)",
        "x = []\nwhile True:\n    x.append([0] * 100000)\n",
    ],
    ids=["bytearray", "growing-list"],
)
def test_memory_bomb_is_stopped(code: str) -> None:
    start = time.monotonic()
    res = run_python(code, timeout_s=10.0, memory_mb=256)
    assert res.status == "memory" and not res.passed, (res.status, res.stderr)
    assert time.monotonic() - start < 10.0


def test_parent_environment_not_visible(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("QUASAR_FAKE_SECRET", "hunter2")
    code = (
        "import os\n"
        "assert 'QUASAR_FAKE_SECRET' not in os.environ\n"
        "print(sorted(os.environ))\n"
    )
    res = run_python(code)
    assert res.passed, res.stderr
    assert "hunter2" not in res.stdout and "QUASAR_FAKE_SECRET" not in res.stdout
    assert set(eval(res.stdout)) <= {"PATH", "LANG", "HOME", "TMPDIR", "LC_CTYPE"}


def test_fresh_temp_dir_removed_afterwards() -> None:
    code = "import os\nopen('scratch.txt', 'w').write('x')\nprint(os.getcwd())\n"
    res = run_python(code)
    assert res.passed, res.stderr
    workdir = Path(res.stdout.strip())
    assert workdir.name == "work" and workdir != Path.cwd()
    assert not workdir.exists() and not workdir.parent.exists()
    # a second run does not see the first one's files
    res2 = run_python("import os\nassert not os.path.exists('scratch.txt')\n")
    assert res2.passed, res2.stderr


def test_output_is_captured_and_truncated() -> None:
    res = run_python("import sys\nprint('x' * 100000)\nsys.stderr.write('oops')\n", max_output_bytes=1000)
    assert res.passed
    assert res.stdout.startswith("x" * 1000) and res.stdout.endswith("[truncated]")
    assert res.stderr == "oops"


def test_isolated_mode() -> None:
    # -I: the script's directory is not on sys.path and PYTHON* variables are ignored
    res = run_python("import sys\nassert sys.flags.isolated == 1\nassert '' not in sys.path\n")
    assert res.passed, res.stderr


def test_nonzero_exit_is_failed() -> None:
    res = run_python("import sys; sys.exit(3)")
    assert res.status == "failed" and res.returncode == 3


def test_timeout_must_be_positive() -> None:
    with pytest.raises(ValueError):
        run_python("pass", timeout_s=0)


def test_parent_env_untouched() -> None:
    before = dict(os.environ)
    run_python("import os; os.environ['X'] = '1'")
    assert dict(os.environ) == before
