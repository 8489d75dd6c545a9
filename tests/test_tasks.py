"""Task definitions: the MMLU 5-shot prompt is lm-eval's few-shot text and drops shots, last first, while
the prompt does not fit the window; MMLU runs end to end through lm-eval on the offline files."""

from __future__ import annotations

import csv

from bench.evaluations.task_docs import mmlu_prompt
from bench.evaluations.tasks import evaluate_tasks


def _rows(data_dir, subject="abstract_algebra"):
    with open(data_dir / "mmlu" / "dev" / f"{subject}_dev.csv", newline="") as f:
        shots = list(csv.DictReader(f))
    with open(data_dir / "mmlu" / "test" / f"{subject}_test.csv", newline="") as f:
        test = next(csv.DictReader(f))
    return shots, test


class _Words:
    """A stand-in tokenizer: one token per whitespace-separated word."""

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": text.split()}


def test_mmlu_prompt_is_lm_eval_few_shot_text(data_dir):
    shots, test = _rows(data_dir)
    prompt, k = mmlu_prompt(test, shots, "abstract_algebra", 2048, _Words())
    assert k == 5
    parts = prompt.split("\n\n")
    assert parts[0] == "The following are multiple choice questions (with answers) about abstract algebra."
    assert len(parts) == 7
    first = shots[0]
    assert parts[1] == (f"{first['question'].strip()}\nA. {first['choice0']}\nB. {first['choice1']}\nC. "
                        f"{first['choice2']}\nD. {first['choice3']}\nAnswer: {'ABCD'[int(first['answer'])]}")
    assert all(p[-2:] in (" A", " B", " C", " D") for p in parts[1:6])
    assert parts[6].startswith(test["question"].strip()) and parts[6].endswith("\nAnswer:")


def test_mmlu_drops_shots_last_first_until_the_prompt_fits(data_dir):
    shots, test = _rows(data_dir)
    words = _Words()
    full, _ = mmlu_prompt(test, shots, "abstract_algebra", 10**6, words)
    n_full = len(words(full + " A")["input_ids"])
    prompt, k = mmlu_prompt(test, shots, "abstract_algebra", n_full - 1, words)
    assert k == 4 and len(words(prompt + " A")["input_ids"]) <= n_full - 1
    assert prompt == mmlu_prompt(test, shots[:4], "abstract_algebra", 10**6, words)[0]  # the fifth shot dropped
    assert mmlu_prompt(test, shots, "abstract_algebra", 5, words)[1] == 0                # nothing fits: bare question


def test_mmlu_through_lm_eval_on_the_tiny_model(tiny_model_dir, data_dir):
    from bench.common.models import load_model
    loaded = load_model(str(tiny_model_dir))
    res = evaluate_tasks(loaded.model, loaded.tokenizer, ["mmlu", "boolq"], data_dir, limit=2)
    m = res["mmlu"]
    assert m["n"] == 2 * 57                      # the first two questions of each subject, one task
    assert 0.0 <= m["acc"] <= 1.0
    # the tiny model's byte-level tokenizer makes long prompts: some must have lost shots, none all of them
    assert 0 < m["questions_with_dropped_shots"] < m["n"] and 0 < m["mean_shots"] < 5
    assert res["boolq"]["n"] == 2                 # the other tasks keep the per-task limit
