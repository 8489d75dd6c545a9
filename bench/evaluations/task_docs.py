"""Document preprocessing for the offline lm-eval tasks (bench/evaluations/tasks.py writes YAMLs that call these).

Each function maps the data folder's own format (../shared/data/SOURCES.md, "Field names") onto the
fields lm-eval's stock task definitions use, so prompts, choices and metrics are lm-eval's.
"""

from __future__ import annotations

import os
from pathlib import Path


def _labels(name: str) -> list[int]:
    path = Path(os.environ["LRQ_BENCH_TASK_DATA"]) / name
    return [int(line) for line in path.read_text().split()]


def piqa(dataset):
    labels = _labels("piqa/valid-labels.lst")
    if len(labels) != len(dataset):
        raise ValueError(f"piqa: {len(dataset)} questions but {len(labels)} labels")
    return dataset.add_column("label", labels)


def arc(dataset):
    def fix(doc):
        choices = doc["question"]["choices"]
        return {"question": doc["question"]["stem"], "choices": {"text": [c["text"] for c in choices],
                                                                  "label": [c["label"] for c in choices]}}
    return dataset.map(fix, remove_columns=["question"])


def boolq(dataset):
    return dataset.map(lambda d: {"label": 1 if str(d["label"]).lower() == "true" else 0})


def hellaswag(dataset):
    from lm_eval.tasks.hellaswag.utils import process_docs   # lm-eval's own preprocessing
    return process_docs(dataset)


def _mmlu_block(row: dict) -> str:
    return (f"{str(row['question']).strip()}\nA. {row['choice0']}\nB. {row['choice1']}\nC. {row['choice2']}\n"
            f"D. {row['choice3']}\nAnswer:")


def mmlu_prompt(row: dict, shots: list[dict], subject: str, max_length: int, tokenizer=None) -> tuple[str, int]:
    """MMLU k-shot prompt for `row`: the largest k <= len(shots) whose tokens, with the one-token answer,
    fit `max_length` (METHOD.md 5: shots are dropped, last first, as the original MMLU evaluation does;
    lm-eval's sampler would cut the prompt from the left instead, mid-shot). The text is what lm-eval's
    few-shot sampler writes: description, each shot as "<question block> <letter>" followed by a blank
    line, then the question block ending in "Answer:". Returns (prompt, k)."""
    header = f"The following are multiple choice questions (with answers) about {subject.replace('_', ' ')}.\n\n"
    blocks = [f"{_mmlu_block(s)} {'ABCD'[int(s['answer'])]}\n\n" for s in shots]
    end = _mmlu_block(row)
    for k in range(len(blocks), -1, -1):
        prompt = header + "".join(blocks[:k]) + end
        if tokenizer is None or len(tokenizer(prompt + " A", add_special_tokens=False)["input_ids"]) <= max_length:
            break
    return prompt, k
