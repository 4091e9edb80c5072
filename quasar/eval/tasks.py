"""Evaluation tasks: each turns a data set into items, scores one item with one verifier,
and summarizes the per-item records into metrics.

Two kinds of tasks:
- log-likelihood (perplexity, mmlu, boolq): one forward pass of the verifier model over
  the text, log-probabilities read from its logits (`score_options`, `sequence_logprob`);
- generation (humaneval, asdiv): greedy decoding in Quasar mode (n-gram drafter + the
  verifier under test), optionally checked against autoregressive decoding with the same
  verifier (`EvalConfig.check_spec`): greedy speculative decoding must give the same tokens.

A record is a small JSON-able dict; `pred` (when present) is what the runner compares
between the two verifiers ("agreement": same choice / same completion).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from quasar.data import datasets
from quasar.data.calibration import calibration_texts
from quasar.data.user_files import read_text_records
from quasar.errors import QuasarError
from quasar.eval.executor import check_humaneval
from quasar.eval.windows import default_stride, sliding_windows

# --------------------------------------------------------------------------- settings

TASK_NAMES: tuple[str, ...] = ("fidelity", "perplexity", "humaneval", "mmlu", "boolq", "asdiv")

# items per task when --limit is not given (the "full table"); None = all
DEFAULT_LIMITS: dict[str, int | None] = {"perplexity": None, "humaneval": None, "mmlu": 500,
                                         "boolq": 500, "asdiv": 300}
DEFAULT_MAX_NEW_TOKENS = {"humaneval": 384, "asdiv": 256}
HUMANEVAL_STOPS = ["\ndef ", "\nclass ", "\nif __name__", "\nprint(", "\n#"]
SHOT_POOL = 16  # the last items of mmlu/boolq: few-shot examples, never evaluated
SCORE_CHUNK = 512  # tokens per forward when scoring long text (bounds the logits' memory)
PPL_WINDOW = 2048  # default perplexity window (capped by the model's context)
NGRAM = {"num_draft": 5, "ngram_min": 1, "ngram_max": 3}  # the paper's proposer settings


@dataclass
class EvalConfig:
    limit: int | None = None  # None: DEFAULT_LIMITS; -1: everything
    shots: int = 0
    check_spec: bool = False
    max_new_tokens: int | None = None  # None: DEFAULT_MAX_NEW_TOKENS per task
    text_file: str | None = None
    window: int | None = None  # perplexity window (tokens); None: min(context, PPL_WINDOW)
    stride: int | None = None  # perplexity stride; None: window // 2
    timeout_s: float = 10.0  # humaneval per-problem time limit
    memory_mb: int = 1024  # humaneval per-problem memory limit

    def limit_for(self, task: str) -> int | None:
        if self.limit is None:
            return DEFAULT_LIMITS.get(task)
        return None if self.limit < 0 else self.limit

    def max_tokens_for(self, task: str) -> int:
        return self.max_new_tokens or DEFAULT_MAX_NEW_TOKENS[task]


@dataclass
class Task:
    """One evaluation task; `metric` is the headline number compared across verifiers."""

    name: str
    metric: str
    higher_is_better: bool
    load: Callable[[Any, EvalConfig], list]  # (llm, cfg) -> items
    run: Callable[[Any, str, Any, EvalConfig], dict]  # (llm, verifier, item, cfg) -> record
    summarize: Callable[[list[dict]], dict]  # records -> metrics (incl. `metric`)
    describe: str = ""


# --------------------------------------------------------------------------- scoring helpers


def _device(model) -> torch.device:
    return model.model.norm.weight.device


def _fit(context: list[int], longest: int, max_len: int) -> list[int]:
    """Drop context tokens from the left so context + continuation fit the cache."""
    room = max_len - longest
    if room < 1:
        raise QuasarError(f"a continuation of {longest} tokens does not fit the {max_len}-token context")
    return context[-room:] if len(context) > room else context


def _prefill(model, ids: list[int], chunk: int = SCORE_CHUNK) -> None:
    """Fill the KV cache with `ids` from position 0, no logits (chunked like any forward)."""
    model.cache.length = 0
    dev = _device(model)
    for i in range(0, len(ids), chunk):
        model(torch.tensor([ids[i:i + chunk]], device=dev), logits="none")


def _gather_logprobs(logits: torch.Tensor, targets: list[int]) -> torch.Tensor:
    """log p(target_i) from float32 logits [T, vocab], as float64 (summed over many tokens)."""
    idx = torch.tensor(targets, device=logits.device)
    picked = logits.gather(-1, idx[:, None])[:, 0]
    return (picked - torch.logsumexp(logits, dim=-1)).double()


def score_options(model, context: list[int], options: Sequence[list[int]]) -> list[float]:
    """Sum of log-probabilities of each option's tokens after `context`.

    The context is run once; each option then reuses its KV cache (rolling back is setting
    the cache length). Option i's score is sum_j log p(opt_j | context, opt_<j).
    """
    if not context or any(not o for o in options):
        raise QuasarError("score_options needs a non-empty context and non-empty options")
    context = _fit(context, max(len(o) for o in options), model.cache.max_seq_len)
    _prefill(model, context[:-1])
    base, dev, out = model.cache.length, _device(model), []
    for opt in options:
        model.cache.length = base
        logits = model(torch.tensor([[context[-1], *opt[:-1]]], device=dev))[0]
        out.append(float(_gather_logprobs(logits, opt).sum()))
    return out


def sequence_logprob(model, ids: list[int], score_from: int, chunk: int = SCORE_CHUNK) -> tuple[float, int]:
    """(sum of log p(ids[i] | ids[:i]) for i >= score_from, number of such tokens).

    Runs `ids` from an empty cache in chunks, so the logits never exceed `chunk` rows.
    """
    score_from = max(1, score_from)
    if len(ids) > model.cache.max_seq_len:
        raise QuasarError(f"{len(ids)} tokens do not fit the {model.cache.max_seq_len}-token context")
    model.cache.length = 0
    dev, total, count = _device(model), 0.0, 0
    inputs = ids[:-1]  # input position i predicts ids[i + 1]
    for i in range(0, len(inputs), chunk):
        piece = inputs[i:i + chunk]
        first_target = i + 1
        last_target = i + len(piece)  # inclusive
        if last_target < score_from:
            model(torch.tensor([piece], device=dev), logits="none")
            continue
        logits = model(torch.tensor([piece], device=dev))[0]
        skip = max(0, score_from - first_target)
        targets = ids[first_target + skip:last_target + 1]
        total += float(_gather_logprobs(logits[skip:], targets).sum())
        count += len(targets)
    return total, count


def _model(llm, verifier: str):
    return llm.verifier_model(verifier)


def _spread(items: Sequence[Any], n: int | None) -> list[Any]:
    """n evenly spaced items (all when n is None): covers sorted sets (MMLU by subject)."""
    if n is None or n >= len(items):
        return list(items)
    return [items[i * len(items) // n] for i in range(n)]


def _split_pool(items: list, cfg: EvalConfig, task: str) -> tuple[list, list]:
    """(few-shot pool, evaluated items): the last SHOT_POOL items are never evaluated."""
    if cfg.shots < 0 or cfg.shots > SHOT_POOL:
        raise QuasarError(f"--shots must be between 0 and {SHOT_POOL}, got {cfg.shots}")
    pool, rest = items[-SHOT_POOL:], items[:-SHOT_POOL]
    return pool, _spread(rest, cfg.limit_for(task))


def _mean(xs: Sequence[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


# --------------------------------------------------------------------------- perplexity


@dataclass(frozen=True)
class Window:
    source: str
    ids: list[int]
    score_from: int  # tokens before this index are context only


def _ppl_sources(cfg: EvalConfig) -> dict[str, list[str]]:
    if cfg.text_file:
        return {Path(cfg.text_file).name: read_text_records(cfg.text_file)}
    return {name: [text] for name, text in calibration_texts(part="heldout").items() if text.strip()}


def ppl_window(llm, cfg: EvalConfig) -> tuple[int, int]:
    window = min(cfg.window or PPL_WINDOW, llm.max_context)
    stride = cfg.stride or default_stride(window)
    if window < 2 or not 1 <= stride <= window:
        raise QuasarError(f"perplexity needs window >= 2 and 1 <= stride <= window (got {window}, {stride})")
    return window, stride


def load_perplexity(llm, cfg: EvalConfig) -> list[Window]:
    window, stride = ppl_window(llm, cfg)
    limit = cfg.limit_for("perplexity")
    items: list[Window] = []
    for source, docs in _ppl_sources(cfg).items():
        taken = 0
        for doc in docs:
            ids = llm.tokenizer.encode(doc)
            for begin, end, first in sliding_windows(len(ids), window, stride):
                if limit is not None and taken >= limit:
                    break
                items.append(Window(source, ids[begin:end], first - begin))
                taken += 1
    if not items:
        raise QuasarError("perplexity: no text to score (need at least 2 tokens)")
    return items


def run_perplexity(llm, verifier: str, item: Window, cfg: EvalConfig) -> dict:
    nll, n = sequence_logprob(_model(llm, verifier), item.ids, item.score_from)
    return {"source": item.source, "logprob": nll, "tokens": n}


def summarize_perplexity(records: list[dict]) -> dict:
    def ppl(rs: list[dict]) -> float:
        n = sum(r["tokens"] for r in rs)
        return math.exp(-sum(r["logprob"] for r in rs) / n) if n else float("nan")

    sources = sorted({r["source"] for r in records})
    return {"perplexity": ppl(records), "tokens": sum(r["tokens"] for r in records),
            "by_source": {s: ppl([r for r in records if r["source"] == s]) for s in sources}}


# --------------------------------------------------------------------------- mmlu

_LETTERS = "ABCDEFGHIJ"
MMLU_HEADER = "The following are multiple choice questions. Answer with the letter of the correct option.\n\n"


def _mmlu_block(item, with_answer: bool) -> str:
    lines = [f"Question: {item.question.strip()}"]
    lines += [f"{_LETTERS[i]}. {opt}" for i, opt in enumerate(item.options)]
    lines.append("Answer:" + (f" {_LETTERS[item.answer_index]}" if with_answer else ""))
    return "\n".join(lines)


@dataclass(frozen=True)
class ChoiceItem:
    prompt: str
    choices: list[str]  # continuations, each starting with a space
    answer: int
    alt_choices: list[str] | None = None  # a second scoring of the same prompt (mmlu: option text)


def load_mmlu(llm, cfg: EvalConfig) -> list[ChoiceItem]:
    pool, items = _split_pool(datasets.load_mmlu(), cfg, "mmlu")
    shots = "".join(_mmlu_block(s, True) + "\n\n" for s in pool[:cfg.shots])
    return [ChoiceItem(MMLU_HEADER + shots + _mmlu_block(it, False),
                       [f" {_LETTERS[i]}" for i in range(len(it.options))], it.answer_index,
                       [" " + opt for opt in it.options])
            for it in items]


def _boolq_block(item, with_answer: bool) -> str:
    question = item.question.strip().rstrip("?")
    question = question[:1].upper() + question[1:]
    answer = (" yes" if item.answer else " no") if with_answer else ""
    return f"{item.passage.strip()}\nQuestion: {question}?\nAnswer:{answer}"


def load_boolq(llm, cfg: EvalConfig) -> list[ChoiceItem]:
    pool, items = _split_pool(datasets.load_boolq(), cfg, "boolq")
    shots = "".join(_boolq_block(s, True) + "\n\n" for s in pool[:cfg.shots])
    return [ChoiceItem(shots + _boolq_block(it, False), [" yes", " no"], 0 if it.answer else 1) for it in items]


def _argmax(xs: list[float]) -> int:
    return max(range(len(xs)), key=lambda i: xs[i])


def run_choice(llm, verifier: str, item: ChoiceItem, cfg: EvalConfig) -> dict:
    tok, model = llm.tokenizer, _model(llm, verifier)
    continuations = item.choices + (item.alt_choices or [])  # one prefill of the context for all
    both = score_options(model, tok.encode(item.prompt), [tok.encode(c, add_special_tokens=False)
                                                          for c in continuations])
    scores, alt = both[:len(item.choices)], both[len(item.choices):]
    rec = {"pred": _argmax(scores), "answer": item.answer, "scores": [round(s, 4) for s in scores]}
    rec["correct"] = rec["pred"] == item.answer
    if alt:
        rec["pred_text"] = _argmax(alt)
        rec["correct_text"] = rec["pred_text"] == item.answer
    return rec


def summarize_choice(records: list[dict]) -> dict:
    out = {"accuracy": _mean([float(r["correct"]) for r in records]), "n": len(records)}
    if records and "correct_text" in records[0]:
        out["accuracy_text"] = _mean([float(r["correct_text"]) for r in records])
    return out


# --------------------------------------------------------------------------- generation


def _generate(llm, verifier: str, prompt, cfg: EvalConfig, task: str, raw: bool, stop: list[str]) -> dict:
    """Greedy Quasar-mode generation; with check_spec also autoregressive, compared."""
    opts = dict(raw=raw, max_new_tokens=cfg.max_tokens_for(task), temperature=0.0, stop=stop, verifier=verifier)
    res = llm.generate(prompt, drafter="ngram", **NGRAM, **opts)
    rec = {"completion": res.text, "finish_reason": res.finish_reason, "new_tokens": res.stats["new_tokens"],
           "steps": res.stats["steps"], "wall_s": res.stats["wall_s"]}
    if cfg.check_spec:
        ar = llm.generate(prompt, drafter="none", **opts)
        rec["spec_identical"] = ar.token_ids == res.token_ids and ar.text == res.text
        rec["ar_wall_s"] = ar.stats["wall_s"]
        rec["ar_new_tokens"] = ar.stats["new_tokens"]
    return rec


def _generation_stats(records: list[dict]) -> dict:
    new = sum(r["new_tokens"] for r in records)
    steps = sum(r["steps"] for r in records)
    wall = sum(r["wall_s"] for r in records)
    out = {"new_tokens": new, "mean_accepted": new / steps if steps else None,
           "tokens_per_s": new / wall if wall > 0 else None}
    checked = [r for r in records if "spec_identical" in r]
    if checked:
        out["spec_identical"] = _mean([float(r["spec_identical"]) for r in checked])
        out["spec_checked"] = len(checked)
        ar_wall = sum(r["ar_wall_s"] for r in checked)
        ar_new = sum(r["ar_new_tokens"] for r in checked)
        if ar_wall > 0 and wall > 0:
            out["ar_tokens_per_s"] = ar_new / ar_wall
    return out


def load_humaneval(llm, cfg: EvalConfig) -> list[dict]:
    return datasets.load_humaneval(cfg.limit_for("humaneval"))


def run_humaneval(llm, verifier: str, problem: dict, cfg: EvalConfig) -> dict:
    # The prompts end in "\n", but BPE tokenizers merge a newline with the next line's
    # indentation ("\n    " is one token): a prompt ending in a bare "\n" token is
    # off-distribution (SmolLM2 then closes the code block). Feed it without trailing
    # newlines; the program run is exactly what the model saw plus what it wrote.
    prompt = problem["prompt"].rstrip("\n")
    rec = _generate(llm, verifier, prompt, cfg, "humaneval", raw=True, stop=HUMANEVAL_STOPS)
    result = check_humaneval({**problem, "prompt": prompt}, rec["completion"], timeout_s=cfg.timeout_s,
                             memory_mb=cfg.memory_mb)
    rec.update(task_id=problem["task_id"], passed=result.passed, status=result.status, detail=result.detail)
    rec["pred"] = rec["completion"]
    return rec


def summarize_humaneval(records: list[dict]) -> dict:
    statuses: dict[str, int] = {}
    for r in records:
        statuses[r["status"]] = statuses.get(r["status"], 0) + 1
    return {"pass@1": _mean([float(r["passed"]) for r in records]), "n": len(records), "status": statuses,
            **_generation_stats(records)}


ASDIV_INSTRUCTION = "Solve the problem and end your answer with the final number."
_NUM = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:/\d+)?|-?\.\d+")


def parse_last_number(text: str) -> float | None:
    """The last number in `text` ("1,200" -> 1200, "5/2" -> 2.5, "$3.50." -> 3.5)."""
    for raw in reversed(_NUM.findall(text)):
        raw = raw.replace(",", "")
        try:
            if "/" in raw:
                num, den = raw.split("/")
                return float(num) / float(den)
            return float(raw)
        except (ValueError, ZeroDivisionError):
            continue
    return None


def load_asdiv(llm, cfg: EvalConfig) -> list:
    return _spread(datasets.load_asdiv(), cfg.limit_for("asdiv"))


def run_asdiv(llm, verifier: str, item, cfg: EvalConfig) -> dict:
    messages = [{"role": "user", "content": f"{item.full_question}\n{ASDIV_INSTRUCTION}"}]
    rec = _generate(llm, verifier, messages, cfg, "asdiv", raw=False, stop=[])
    value = parse_last_number(rec["completion"])
    rec.update(answer=item.answer, parsed=value,
               correct=value is not None and math.isclose(value, item.answer, rel_tol=1e-6, abs_tol=1e-9))
    rec["pred"] = rec["completion"]
    return rec


def summarize_asdiv(records: list[dict]) -> dict:
    return {"exact_match": _mean([float(r["correct"]) for r in records]), "n": len(records),
            "unparsed": sum(r["parsed"] is None for r in records), **_generation_stats(records)}


# --------------------------------------------------------------------------- registry

TASKS: dict[str, Task] = {
    "perplexity": Task("perplexity", "perplexity", False, load_perplexity, run_perplexity, summarize_perplexity,
                       "perplexity on held-out calibration text (sliding windows)"),
    "humaneval": Task("humaneval", "pass@1", True, load_humaneval, run_humaneval, summarize_humaneval,
                      "pass@1 of greedy Quasar completions, executed in a sandbox"),
    "mmlu": Task("mmlu", "accuracy", True, load_mmlu, run_choice, summarize_choice,
                 "accuracy, option letter with the highest log-likelihood"),
    "boolq": Task("boolq", "accuracy", True, load_boolq, run_choice, summarize_choice,
                  "accuracy, ' yes' vs ' no' by log-likelihood"),
    "asdiv": Task("asdiv", "exact_match", True, load_asdiv, run_asdiv, summarize_asdiv,
                  "exact match of the last number in a greedy chat answer"),
}
FIDELITY = Task("fidelity", "perplexity", False, None, None, None,  # type: ignore[arg-type]
                "float vs w8a8 on held-out text: top-1 agreement, KL, perplexity (quasar.eval.fidelity)")


def parse_tasks(spec: str) -> list[str]:
    """'mmlu,boolq' -> ['mmlu', 'boolq'] in the order given; unknown names are an error."""
    names = [s.strip() for s in spec.split(",") if s.strip()]
    if not names:
        raise QuasarError(f"--tasks is empty: choose from {', '.join(TASK_NAMES)}")
    for name in names:
        if name not in TASK_NAMES:
            raise QuasarError(f"unknown task {name!r}: choose from {', '.join(TASK_NAMES)}")
    return list(dict.fromkeys(names))
