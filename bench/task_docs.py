"""Document preprocessing for the offline lm-eval tasks (bench/tasks.py writes YAMLs that call these).

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


def mmlu(dataset):
    return dataset.map(lambda d: {"choices": [d["choice0"], d["choice1"], d["choice2"], d["choice3"]],
                                  "answer": int(d["answer"])})
