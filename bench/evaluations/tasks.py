"""Task accuracy through lm-eval, offline: task definitions generated from the data folder.

The task YAMLs mirror lm-eval's stock definitions (prompts, choices, metrics) but read the files in the
data folder in place (`dataset_path: json`), with document mapping in bench/evaluations/task_docs.py. The quantized
model object itself is handed to lm-eval (HFLM(pretrained=<model>)), so what is scored is exactly what
was quantized. Fixed and recorded: no BOS token is added (lm-eval's default for these models), batch
size 1 (scores move with padding), max length 2048.

Tasks: the paper's seven zero-shot tasks (piqa, arc_easy, arc_challenge, hellaswag, winogrande, boolq,
openbookqa; their average, acc_norm where lm-eval reports it for the task as the LRQ paper does, else acc),
lambada_openai, and MMLU 5-shot (dev rows as shots, "The following are multiple choice questions (with
answers) about {subject}." header, the letter with the highest log-likelihood, accuracy over all test
questions; shots dropped, last first, while the prompt exceeds 2048 tokens). MMLU prompts are built
here with the model's tokenizer (bench/task_docs.mmlu_prompt, the same text lm-eval's few-shot sampler
writes) into one JSONL file, scored by lm-eval as one zero-shot multiple-choice task, so accuracy is over
all test questions; `--task-limit N` takes the first N questions of every subject.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import yaml

from lrq import precision as P
from lrq import progress
from lrq.errors import UserError

from bench.evaluations.evals import ALL_TASKS, TASKS, ZERO_SHOT, ZEROSHOT_AVG  # noqa: F401 (the catalogue's task names)

# the metric the LRQ paper reports per task (acc_norm where lm-eval has it, as its tables do)
MAIN_METRIC = {name: t.main_metric for name, t in TASKS.items()}
PREFIX = "lrqb_"
MAX_LENGTH = 2048
#: The version of how tasks are scored here (prompts, the lm-eval adapter, per-example scores): bump it with any
#: change that changes an accuracy (a key of its own from 2 on, as bench.evaluations.perplexity.VERSION).
VERSION = 1
BATCH_SIZE = 1
ADD_BOS = False

_ACC = [{"metric": "acc", "aggregation": "mean", "higher_is_better": True}]
FILES = {name: t.file for name, t in TASKS.items() if t.file}


def _json_task(name: str, path: Path, **spec) -> dict:
    return {"task": PREFIX + name, "dataset_path": "json", "dataset_kwargs": {"data_files": {"test": str(path)}},
            "test_split": "test", **spec, "metadata": {"version": 1.0}}


def task_specs(data_dir: Path) -> dict[str, dict]:
    """lm-eval task definitions of the catalogue's tasks (bench.evaluations.evals.TASKS) reading the data folder in place."""
    import copy

    from bench.evaluations import evals
    return {name: _json_task(name, data_dir / t.file, **copy.deepcopy(t.lm_eval)) for name, t in evals.TASKS.items()
            if t.file}


def write_mmlu(folder: Path, data_dir: Path, tokenizer, limit: int | None) -> tuple[dict, dict]:
    """Build every MMLU test prompt (5 shots from the subject's dev rows, dropped while too long) into
    folder/mmlu.jsonl; returns (the lm-eval task spec, shot statistics)."""
    import csv
    import json

    from bench.evaluations.task_docs import mmlu_prompt
    tests = sorted((data_dir / "mmlu" / "test").glob("*_test.csv"))
    shots_used = []
    with open(folder / "mmlu.jsonl", "w") as out:
        for test in tests:
            subject = test.name[:-len("_test.csv")]
            dev = data_dir / "mmlu" / "dev" / f"{subject}_dev.csv"
            if not dev.is_file():
                raise UserError(f"MMLU shots missing: {dev} (the dev split gives the 5 shots; pass --data-dir with "
                                f"the evaluation data folder).")
            with open(dev, newline="") as f:
                shots = list(csv.DictReader(f))[:MMLU_SHOTS]
            with open(test, newline="") as f:
                rows = list(csv.DictReader(f))[:limit]
            for row in rows:
                prompt, k = mmlu_prompt(row, shots, subject, MAX_LENGTH, tokenizer)
                shots_used.append(k)
                out.write(json.dumps({"subject": subject, "prompt": prompt, "answer": int(row["answer"])}) + "\n")
    spec = _json_task("mmlu", folder / "mmlu.jsonl", output_type="multiple_choice", num_fewshot=0,
                      doc_to_text="{{prompt}}", doc_to_choice=["A", "B", "C", "D"], doc_to_target="answer",
                      metric_list=_ACC)
    stats = {"mean_shots": sum(shots_used) / max(len(shots_used), 1),
             "questions_with_dropped_shots": sum(k < MMLU_SHOTS for k in shots_used)}
    return spec, stats


MMLU_SHOTS = 5
UTILS = '''from bench.evaluations.task_docs import arc, boolq, hellaswag, piqa  # noqa: F401
from lm_eval.tasks.winogrande.preprocess_winogrande import (doc_to_choice as wino_choice,  # noqa: F401
    doc_to_target as wino_target, doc_to_text as wino_text)
'''


class _Fn(str):
    pass


def _fn_representer(dumper, data):
    return dumper.represent_scalar("!function", str(data)[len("!function "):])


def check_task_data(names: list[str], data_dir: Path | None) -> None:
    """Every file the tasks read exists and matches the data folder's SHA256SUMS (hashed once per file
    version); bad input otherwise, before any model work."""
    from bench.evaluations.data import verify_file
    if data_dir is None:
        raise UserError("--tasks reads the evaluation data folder: pass --data-dir (or set LRQ_BENCH_DATA).")
    missing = [f for n in names if n in FILES for f in (FILES[n], *TASKS[n].also_reads) if not (data_dir / f).is_file()]
    if "mmlu" in names and not (data_dir / "mmlu" / "test").is_dir():
        missing.append("mmlu/test/*.csv")
    if missing:
        raise UserError(f"task data missing under {data_dir}: {', '.join(missing)} (pass --data-dir with the "
                        f"evaluation data folder).")
    for rel in task_files(names, data_dir):
        verify_file(data_dir, rel)


def task_files(names: list[str], data_dir: Path) -> list[str]:
    """Every file the tasks `names` read, relative to the data folder."""
    rels = [f for n in names if n in FILES for f in (FILES[n], *TASKS[n].also_reads)]
    if "mmlu" in names:
        rels += [p.relative_to(data_dir).as_posix() for split in ("test", "dev")
                 for p in sorted((data_dir / "mmlu" / split).glob("*.csv"))]
    return rels


def task_data_fingerprint(names: list[str], data_dir: Path | None) -> str:
    """One SHA-256 over the name and contents of every file the tasks read (each file hashed once per version,
    bench.common.hashing): a task file whose answers changed makes its results another result."""
    import hashlib

    from bench.common.hashing import file_sha256
    if data_dir is None:
        return "hub"
    h = hashlib.sha256()
    for rel in task_files(names, data_dir):
        path = data_dir / rel
        h.update(f"{rel}\0{file_sha256(path) if path.is_file() else 'missing'}\n".encode())
    return "sha256:" + h.hexdigest()


def write_tasks(folder: Path, data_dir: Path, names: list[str], tokenizer=None, limit: int | None = None
                ) -> tuple[list[str], dict]:
    """Write the YAMLs (+ utils.py, + mmlu.jsonl) for the requested tasks; returns the lm-eval task names to
    run and MMLU's shot statistics (empty without MMLU)."""
    check_task_data(names, data_dir)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "utils.py").write_text(UTILS)
    dumper = yaml.SafeDumper
    dumper.add_representer(_Fn, _fn_representer)
    specs = task_specs(data_dir)
    run, mmlu_stats = [], {}
    for name in names:
        if name == "mmlu":
            spec, mmlu_stats = write_mmlu(folder, data_dir, tokenizer, limit)
        else:
            spec = specs[name]
        spec = {k: (_Fn(v) if isinstance(v, str) and v.startswith("!function ") else v) for k, v in spec.items()}
        (folder / f"{name}.yaml").write_text(yaml.dump(spec, Dumper=dumper, sort_keys=False, allow_unicode=True))
        run.append(spec["task"])
    return run, mmlu_stats


def evaluate_tasks(model, tokenizer, names: list[str], data_dir: Path, limit: int | None = None,
                   precision="fp32", add_bos: bool = ADD_BOS) -> dict[str, Any]:
    """{task: {metric: value, "n": examples}} plus "zeroshot_avg" when all seven zero-shot tasks ran.
    `add_bos`: every request starts with the tokenizer's BOS (the model's protocol, where it needs one).
    `limit`: examples per task (MMLU: questions per subject). `precision` (lrq.precision: a `Precision`,
    'bf16', 'fp32', 'auto'): bf16 runs the model's forwards under bf16 autocast (lm-eval's own
    `mixed_precision_dtype` too), fp32 in float32."""
    import lm_eval
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    unknown = [n for n in names if n not in ALL_TASKS]
    if unknown:
        raise UserError(f"unknown task(s) {', '.join(unknown)}: choose from {', '.join(ALL_TASKS)}.")
    os.environ["LRQ_BENCH_TASK_DATA"] = str(data_dir)
    device = str(next(model.parameters()).device)
    raw: dict[str, Any] = {}
    n_samples: dict[str, Any] = {}
    samples: dict[str, list] = {}
    # under bf16 autocast the head would compute in bf16: choices a few hundredths of a nat apart would round to
    # ties. The head computes in float32 (lrq.precision.float32_head), as for perplexity and the KL divergence.
    from lrq.precision import float32_head
    # progress: lm-eval scores one request per forward at batch size 1; the catalogue knows about how many
    from bench.evaluations.evals import task_requests
    expected = sum(task_requests(t, limit)[0] for t in names)
    calls = [0]

    def count(_m, _a):
        calls[0] += 1
        progress.update(f"{calls[0]}/~{expected} forwards", min(calls[0] / max(expected, 1), 0.99))
    counter = model.register_forward_pre_hook(count)
    # lm-eval opens an autocast region per forward; one region around them all keeps autocast's cache of
    # bf16 weight copies alive between requests (else every short request casts the whole model again:
    # 0.26 s instead of 0.12 s per 60-token forward of the default model, one AMX core)
    prec = P.Precision.decide(precision, device)
    try:
        with tempfile.TemporaryDirectory() as tmp, P.use(prec), P.autocast(device), float32_head(model):
            run, mmlu_stats = write_tasks(Path(tmp), data_dir, names, tokenizer, limit)
            tm = TaskManager(include_path=tmp, include_defaults=False)
            lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=BATCH_SIZE, max_length=MAX_LENGTH,
                      device=device, add_bos_token=add_bos,
                      mixed_precision_dtype="bfloat16" if prec.bf16 else None)
            mmlu = PREFIX + "mmlu"
            # mmlu.jsonl already holds the first `limit` questions of every subject: no global limit on it
            for tasks, lim in (([t for t in run if t != mmlu], limit), ([t for t in run if t == mmlu], None)):
                if tasks:
                    res = lm_eval.simple_evaluate(model=lm, tasks=tasks, task_manager=tm, limit=lim, bootstrap_iters=0,
                                                  log_samples=True, num_fewshot=None)
                    raw.update(res["results"])
                    n_samples.update(res.get("n-samples", {}))
                    samples.update(res.get("samples", {}))
    finally:   # the model leaves as it came
        counter.remove()
    out: dict[str, Any] = {}
    for task, metrics in raw.items():
        name = task[len(PREFIX):]
        vals = {k.split(",")[0]: v for k, v in metrics.items() if "," in k and not k.split(",")[0].endswith("_stderr")}
        out[name] = vals | {"n": (n_samples.get(task) or {}).get("effective")}
        # every example's score (0/1) per metric, in document order: what intervals and paired tests use
        docs = sorted(samples.get(task, []), key=lambda s: s["doc_id"])
        out[name]["per_example"] = {m: [float(s[m]) for s in docs] for m in vals if docs and m in docs[0]}
        out[name]["doc_ids"] = [int(s["doc_id"]) for s in docs]
    if "mmlu" in out:
        out["mmlu"].update(mmlu_stats)
    if all(t in out for t in ZERO_SHOT):
        out[ZEROSHOT_AVG] = {"acc": sum(out[t].get(MAIN_METRIC[t], out[t].get("acc")) for t in ZERO_SHOT)
                               / len(ZERO_SHOT), "n": None, "per_example": {}, "doc_ids": []}
    return out
