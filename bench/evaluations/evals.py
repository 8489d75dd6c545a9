"""The catalogue of evaluations: every text, comparison and task the suite measures, and every metric it stores,
declared once.

Everything that needs to know what an evaluation is reads it here: the command line's choices and help, the
planner's costs, the cell's units and store keys, the Markdown and HTML reports (labels, formats, which way is
better, the summary's columns), the intervals (bench.evaluations.stats), the regression gate's directions and the CI
sweep. A new lm-eval task is one `Task` below; a new metric is one `Metric` plus the code that computes it.

Three kinds of evaluation:
- `Perplexity`: a text cut into windows, perplexity = exp(mean window NLL) (bench.evaluations.perplexity), read by its
  `TextReader` (bench.evaluations.data) from the data folder or the hub;
- KL divergence from the FP model on the same windows (bench.evaluations.kl): every perplexity text carries it
  (`KL_METRICS`, stored as their own unit so earlier perplexities stay valid);
- `Task`: an lm-eval task scored per example (bench.evaluations.tasks), with its planner cost.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


def torch_quantile(x, q: float):
    import torch   # the catalogue is read by processes that never compute a metric: torch only where one is
    return torch.quantile(x, q)


@dataclass(frozen=True)
class Metric:
    """A stored metric, declared whole: its name, how a report labels and formats it, which way is better
    ("lower", "higher"; None: shown, never ranked, and the gate holds it where it was), and its estimator:

    - `samples`: where a row of it keeps the per-unit values it aggregates (a path into the row's config:
      ("eval", "window_nll") is config["eval"]["window_nll"]); empty: none are kept;
    - `interval`: how those values make its 95 % interval and how two cells compare paired on them
      (bench.evaluations.stats.ESTIMATORS: "ppl" exp(mean window NLL), ratio; "mean" a mean over windows, difference;
      "acc" a share of examples, Wilson interval, difference in points); None: a number without interval;
    - `scope`: the rows it is estimated for ("text": perplexity texts, "task": lm-eval tasks, None: any);
    - `evaluation`: the evaluation whose code computes it (its version marks older results: "perplexity",
      "kl", "tasks"; None: the method's own statistics).

    The reports, the HTML page and `lrq-bench compare` read all of this from here and name no metric."""
    name: str
    label: str
    better: str | None = None
    fmt: str = "{:.4g}"
    unit: str = ""
    percent: bool = False       # a fraction shown in %
    interval: str | None = None  # how its 95 % interval is formed (bench.evaluations.stats.ESTIMATORS): ppl, mean, acc
    samples: tuple[str, ...] = ()
    scope: str | None = None
    evaluation: str | None = None
    summary: bool = False       # a column of the leaderboard's summary (per text where its scope is "text")
    bounds: tuple[float | None, float | None] = (None, None)   # the values it can take (None: no bound)
    # a KL metric (evaluation "kl"): how it is computed from the per-position KL divergences and top-1 matches of
    # a text (float64 and bool tensors), and its column's heading in the leaderboard's KL table ("" : none)
    from_positions: Any = field(default=None, compare=False, repr=False)
    column: str = ""
    # the leaderboard table that lists it, in the catalogue's order (bench.reports.report): "cost" the
    # quantization's cost per cell, "recon" the block-wise methods' reconstruction statistics; "": none of them
    table: str = ""

    @property
    def gate_direction(self) -> str:
        return self.better or "both"

    @property
    def ranked(self) -> bool:
        """Ranked in the leaderboard's columns: it has an interval to separate a best and a direction."""
        return self.interval is not None and self.better is not None

    @property
    def comparison(self) -> str:
        """How a comparison of two cells on it reads: "ratio" (perplexities), "pt" (a share, in points) or
        "diff" (a difference)."""
        return "ratio" if self.interval == "ppl" else "pt" if self.percent else "diff"

    def applies_to(self, dataset: str) -> bool:
        return self.scope is None or (dataset in TASK_ROWS) == (self.scope == "task")

    def samples_of(self, config) -> list | None:
        """The per-unit values a row of this metric keeps (its windows' or examples' values), None if none."""
        v = config if self.samples else None
        for k in self.samples:
            v = v.get(k) if isinstance(v, dict) else None
        return v

    def estimate(self, samples, value=None):
        """Its value with the 95 % interval over `samples` (bench.evaluations.stats.Estimate), the interval cut at
        the metric's bounds (a t interval over windows can reach past them: top-1 agreement above 100 %)."""
        from dataclasses import replace

        from bench.evaluations import stats as S
        e = S.ESTIMATORS[self.interval].estimate(samples, value)
        return replace(e, lo=self.clip(e.lo), hi=self.clip(e.hi)) if e.known else e

    def unexplained(self, samples, value) -> str:
        """Why `value` cannot have come from the per-unit `samples` stored with it ("": it can, or nothing is
        known): outside both its 95 % interval over them and their own range (a token-weighted mean may leave
        the interval over window means, never their range)."""
        if self.interval is None or not samples or value is None:
            return ""
        e = self.estimate(samples)   # what the samples give, not centred on the value in question
        first, last = self.estimate([min(samples)]).value, self.estimate([max(samples)]).value   # monotone
        lo, hi = (min(first, e.lo), max(last, e.hi)) if e.known else (first, last)
        slack = 1e-9 * max(abs(lo), abs(hi), 1.0)
        if lo - slack <= value <= hi + slack:
            return ""
        f, unit = self.format, " %" if self.percent else ""
        ci = f", 95 % interval {f(e.lo)}-{f(e.hi)}{unit}" if e.known else ""
        return (f"its value {f(value)}{unit} lies outside what its {len(samples)} stored windows or examples give "
                f"({f(e.value)}{unit}{ci}; each of them between {f(first)} and {f(last)}{unit})")

    def clip(self, v: float) -> float:
        lo, hi = self.bounds
        v = v if lo is None else max(v, lo)
        return v if hi is None else min(v, hi)

    def outside_bounds(self, v: float) -> bool:
        lo, hi = self.bounds
        return (lo is not None and v < lo) or (hi is not None and v > hi)

    def bounds_text(self) -> str:
        """Its bounds in words ("0-100 %", ">= 1"), "" when it has none."""
        lo, hi = self.bounds
        f = (lambda v: f"{100 * v:g}") if self.percent else (lambda v: f"{v:g}")  # noqa: E731
        unit = " %" if self.percent else ""
        if lo is not None and hi is not None:
            return f"{f(lo)}-{f(hi)}{unit}"
        return f">= {f(lo)}{unit}" if lo is not None else f"<= {f(hi)}{unit}" if hi is not None else ""

    def paired(self, a, b):
        """a against b, paired over the same windows / examples (bench.evaluations.stats.Comparison), None if unknown."""
        from bench.evaluations import stats as S
        return S.ESTIMATORS[self.interval].paired(a, b)

    def format(self, v) -> str:
        if v is None or v != v:
            return "-"
        if self.fmt == "bytes":
            return f"{v / 2**20:.0f} MiB"
        return self.fmt.format(100 * v if self.percent else v)


_TEXT, _TASK = {"scope": "text"}, {"scope": "task", "evaluation": "tasks"}
_POSITIVE, _SHARE, _PPL = (0.0, None), (0.0, 1.0), (1.0, None)   # bounds: a perplexity is exp(NLL >= 0)
_METRICS = (
    Metric("ppl", "perplexity", "lower", "{:.2f}", interval="ppl", samples=("eval", "window_nll"),
           scope="text", evaluation="perplexity", bounds=_PPL),
    Metric("eval_tokens_per_s", "eval tokens/s", None, "{:.0f}", "tokens/s", evaluation="perplexity",
           bounds=_POSITIVE),
    Metric("kld", "KLD", "lower", "{:.4f}", "nats/token", interval="mean", samples=("kl", "window_kld"),
           **_TEXT, evaluation="kl", bounds=_POSITIVE, from_positions=lambda kl, top1: kl.mean(), column="KLD"),
    Metric("kld_median", "KLD median", "lower", "{:.4f}", "nats/token", evaluation="kl", bounds=_POSITIVE,
           from_positions=lambda kl, top1: kl.median(), column="median"),
    Metric("kld_p99", "KLD 99th pct", "lower", "{:.3f}", "nats/token", evaluation="kl", bounds=_POSITIVE,
           from_positions=lambda kl, top1: torch_quantile(kl, 0.99), column="p99"),
    Metric("top1_agree", "top-1 agreement", "higher", "{:.2f}", "%", percent=True, interval="mean",
           samples=("kl", "window_top1"), **_TEXT, evaluation="kl", bounds=_SHARE,
           from_positions=lambda kl, top1: top1.float().mean(), column="top-1 %"),
    Metric("top1_ties", "top-1 ties", None, "{:.0f}", "positions", evaluation="kl", bounds=_POSITIVE),
    Metric("acc", "accuracy", "higher", "{:.1f}", "%", percent=True, interval="acc", samples=("per_example",),
           **_TASK, bounds=_SHARE),
    Metric("acc_norm", "accuracy (length-normalized)", "higher", "{:.1f}", "%", percent=True, interval="acc",
           samples=("per_example",), **_TASK, bounds=_SHARE),
    Metric("perplexity", "perplexity (lm-eval)", "lower", "{:.2f}", evaluation="tasks", bounds=_PPL),
    # derived in the reports from the per-example scores of a cell and of the FP cell (bench.reports.report)
    Metric("flips", "flips vs FP", "lower", "{:.1f}", "%", percent=True, interval="acc", bounds=_SHARE),
    Metric("right_to_wrong", "right to wrong vs FP", "lower", "{:.1f}", "%", percent=True, interval="acc",
           bounds=_SHARE),
    Metric("wrong_to_right", "wrong to right vs FP", None, "{:.1f}", "%", percent=True, interval="acc",
           bounds=_SHARE),
    Metric("bits_per_weight", "bits/weight", None, "{:.3f}", bounds=_POSITIVE, table="cost"),
    Metric("n_learnable", "learnable parameters", None, "{:,.0f}", bounds=_POSITIVE, table="recon"),
    Metric("quant_time_s", "quant time (s)", "lower", "{:.1f}", "s", bounds=_POSITIVE, table="cost"),
    Metric("blocks_time_s", "blocks time (s)", None, "{:.1f}", "s", bounds=_POSITIVE, table="cost"),
    Metric("resumed_blocks", "resumed blocks", None, "{:.0f}", bounds=_POSITIVE, table="cost"),
    Metric("quant_peak_rss_bytes", "quant peak RSS", None, "bytes", bounds=_POSITIVE, table="cost"),
    Metric("quant_peak_cuda_bytes", "quant peak CUDA memory", None, "bytes", bounds=_POSITIVE),
    # the planner's price of the unit's stage, stored with it by the run that announced it (bench.run.sweep)
    Metric("planned_time_s", "planned time (s)", None, "{:.1f}", "s", bounds=_POSITIVE),
    Metric("compiled_blocks", "compiled blocks", None, "{:.0f}", bounds=_POSITIVE),
    Metric("mean_block_calib_before", "block error, calibration, before", "lower", bounds=_POSITIVE, table="recon"),
    Metric("mean_block_calib_after", "block error, calibration, after", "lower", bounds=_POSITIVE, table="recon"),
    Metric("mean_block_heldout_before", "block error, held-out, before", "lower", bounds=_POSITIVE,
           table="recon"),
    Metric("mean_block_heldout_after", "block error, held-out, after", "lower", bounds=_POSITIVE, table="recon"),
    Metric("prefill_tok_s", "prefill tokens/s", "higher", "{:.1f}", bounds=_POSITIVE),
    Metric("decode_tok_s", "decode tokens/s", "higher", "{:.2f}", bounds=_POSITIVE),
    Metric("model_bytes", "model size", None, "bytes", bounds=_POSITIVE),
    Metric("peak_rss_bytes", "peak RSS", None, "bytes", bounds=_POSITIVE),
)
METRICS: dict[str, Metric] = {m.name: m for m in _METRICS}


def declare_metric(m: Metric) -> Metric:
    """Add a metric to the catalogue (a plug-in's, or a test's): every report, the HTML page and `compare`
    show it, with its interval and paired comparisons where it declares an estimator."""
    if m.interval is not None:
        from bench.evaluations import stats as S
        if m.interval not in S.ESTIMATORS:
            raise ValueError(f"metric {m.name}: unknown interval {m.interval!r} (bench.evaluations.stats.ESTIMATORS: "
                             f"{', '.join(S.ESTIMATORS)})")
    METRICS[m.name] = m
    return m


def method_text() -> str:
    """How every interval of the reports is computed (bench.evaluations.stats.METHOD_TEXT), then how it meets its
    metric's bounds (`bounds_note`)."""
    from bench.evaluations.stats import METHOD_TEXT
    return f"{METHOD_TEXT} {bounds_note()}"


def bounds_note() -> str:
    """How the reports show an interval that its formula carries past its metric's bounds, and each bound (from
    the catalogue: a new metric's bounds are named here without more code)."""
    by_bound: dict[str, list[str]] = {}
    for m in METRICS.values():
        if m.interval is not None and m.bounds_text():
            by_bound.setdefault(m.bounds_text(), []).append(m.label)
    return ("An interval is cut at its metric's bounds where its formula reaches past them (a t interval over "
            "windows can pass 100 % top-1 agreement or fall below 0 KLD); the bounds: "
            + "; ".join(f"{', '.join(labels)} {bound}" for bound, labels in by_bound.items()) + ".")


# What the KL comparison with the FP model stores per perplexity text (bench.evaluations.kl), in its table's order
KL_METRICS = tuple(m.name for m in _METRICS if m.from_positions is not None)
# The metrics of an evaluation text (a perplexity, or a KL statistic of one): their rows say how it was evaluated
TEXT_METRICS = tuple(m.name for m in _METRICS if m.interval == "ppl" or m.evaluation == "kl")
# Flips against the FP model per task (Dutta et al. 2024), derived in the reports from per-example scores
FLIP_KINDS = ("right_to_wrong", "wrong_to_right")
FLIPS = "flips"                                 # ... and their sum, a cell's share of examples flipped
FLIP_METRICS = (FLIPS,) + FLIP_KINDS


def table_metrics(table: str) -> list[str]:
    """The metrics the leaderboard's `table` lists (Metric.table), in the catalogue's order: a metric declared
    with that table (declare_metric) is a row of it without more code."""
    return [m.name for m in METRICS.values() if m.table == table]


def metric(name: str) -> Metric:
    """The catalogue's metric, or a plain one for a metric only some method reports (its statistics; a name
    ending in _bytes is a size)."""
    return METRICS.get(name) or Metric(name, name, fmt="bytes" if name.endswith("_bytes") else "{:.4g}")


@dataclass(frozen=True)
class Perplexity:
    """A perplexity text: `file` in the data folder (bench.evaluations.data reads it with its reader), the tokens its
    protocol keeps (`token_cap`, None: all), and about how many tokens the whole text has (the planner)."""
    name: str
    label: str
    file: str
    reader: str                 # bench.evaluations.data.READERS key
    token_cap: int | None = None
    full_tokens: int = 300_000
    metrics: tuple[str, ...] = ("ppl", "eval_tokens_per_s")


@dataclass(frozen=True)
class Task:
    """An lm-eval task reading the data folder in place: its file and the lm-eval task fields (prompt, choices,
    metrics) besides the dataset path; the metric the LRQ paper reports for it; for the planner, lm-eval's
    requests per example and tokens per request, and the number of examples."""
    name: str
    label: str
    file: str | None
    lm_eval: dict[str, Any] = field(default_factory=dict, hash=False, compare=False)
    main_metric: str = "acc"
    requests: int = 2
    tokens: int = 60
    size: int = 1000
    zero_shot: bool = True
    also_reads: tuple[str, ...] = ()   # other files its documents are built from (PIQA's labels): checked and keyed too


_ACC = ({"metric": "acc", "aggregation": "mean", "higher_is_better": True},)
_ACC_NORM = _ACC + ({"metric": "acc_norm", "aggregation": "mean", "higher_is_better": True},)
_ARC = {"output_type": "multiple_choice", "process_docs": "!function utils.arc",
        "doc_to_text": "Question: {{question}}\nAnswer:", "doc_to_target": "{{choices.label.index(answerKey)}}",
        "doc_to_choice": "{{choices.text}}", "metric_list": list(_ACC_NORM)}

PERPLEXITY: dict[str, Perplexity] = {p.name: p for p in (
    Perplexity("wikitext2", "WikiText-2", "wikitext2/wiki.test.raw", "wikitext2", None, 300_000),
    Perplexity("c4", "C4", "c4/c4_en_validation_sample2000.jsonl.gz", "c4", 256 * 2048, 256 * 2048),
)}

TASKS: dict[str, Task] = {t.name: t for t in (
    Task("piqa", "PIQA", "piqa/valid.jsonl", {
        "output_type": "multiple_choice", "process_docs": "!function utils.piqa",
        "doc_to_text": "Question: {{goal}}\nAnswer:", "doc_to_target": "label", "doc_to_choice": "{{[sol1, sol2]}}",
        "metric_list": list(_ACC_NORM)}, "acc_norm", 2, 60, 1838, also_reads=("piqa/valid-labels.lst",)),
    Task("arc_easy", "ARC-e", "arc_easy/ARC-Easy-Test.jsonl", _ARC, "acc_norm", 4, 50, 2376),
    Task("arc_challenge", "ARC-c", "arc_challenge/ARC-Challenge-Test.jsonl", _ARC, "acc_norm", 4, 55, 1172),
    Task("hellaswag", "HellaSwag", "hellaswag/hellaswag_validation.jsonl.gz", {
        "output_type": "multiple_choice", "process_docs": "!function utils.hellaswag", "doc_to_text": "{{query}}",
        "doc_to_target": "{{label}}", "doc_to_choice": "choices", "metric_list": list(_ACC_NORM)},
        "acc_norm", 4, 120, 10042),
    Task("winogrande", "WinoGrande", "winogrande/winogrande_xl_validation.jsonl", {
        "output_type": "multiple_choice", "doc_to_text": "!function utils.wino_text",
        "doc_to_target": "!function utils.wino_target", "doc_to_choice": "!function utils.wino_choice",
        "metric_list": list(_ACC)}, "acc", 2, 30, 1267),
    Task("boolq", "BoolQ", "boolq/val.jsonl", {
        "output_type": "multiple_choice", "process_docs": "!function utils.boolq",
        "doc_to_text": "{{passage}}\nQuestion: {{question}}?\nAnswer:", "doc_to_target": "label",
        "doc_to_choice": ["no", "yes"], "metric_list": list(_ACC)}, "acc", 2, 150, 3270),
    Task("openbookqa", "OpenBookQA", "openbookqa/test.jsonl", {
        "output_type": "multiple_choice", "doc_to_text": "question_stem",
        "doc_to_target": "{{choices.label.index(answerKey.lstrip())}}", "doc_to_choice": "{{choices.text}}",
        "metric_list": list(_ACC_NORM)}, "acc_norm", 4, 30, 500),
    Task("lambada_openai", "LAMBADA", "lambada_openai/lambada_test.jsonl", {
        "output_type": "loglikelihood", "doc_to_text": "{{text.split(' ')[:-1]|join(' ')}}",
        "doc_to_target": "{{' '+text.split(' ')[-1]}}",
        "metric_list": [{"metric": "perplexity", "aggregation": "perplexity", "higher_is_better": False},
                        *_ACC]}, "acc", 1, 90, 5153, zero_shot=False),
    # MMLU's prompts are built here (bench.evaluations.tasks.write_mmlu, 5 shots from the dev split): no file of its own
    Task("mmlu", "MMLU", None, {}, "acc", 4, 700, 14042, zero_shot=False),
)}
MMLU_SUBJECTS = 57

ZERO_SHOT = tuple(t for t, spec in TASKS.items() if spec.zero_shot)
ALL_TASKS = tuple(TASKS)
ZEROSHOT_AVG = "zeroshot_avg"       # the stored row of the seven zero-shot tasks' average
ZEROSHOT_AVG_METRIC = "acc"         # ... and its metric: the mean of their main metrics (an estimator "avg")
TASK_ROWS = ALL_TASKS + (ZEROSHOT_AVG,)


def task_requests(task: str, task_limit: int | None) -> tuple[int, int]:
    """(model forwards, tokens per forward) lm-eval runs for `task` at `task_limit` examples (MMLU: per
    subject), roughly: the planner's cost and the progress bar's denominator."""
    t = TASKS[task]
    cap = None if task_limit is None else task_limit * (MMLU_SUBJECTS if task == "mmlu" else 1)
    examples = t.size if cap is None else min(t.size, cap)
    return examples * t.requests, t.tokens


@dataclass(frozen=True)
class Column:
    """A column of the leaderboard's summary: (dataset, metric), its header, which way is better."""
    dataset: str
    metric: str
    header: str
    better: str | None


def summary_columns(present: set[tuple[str, str]]) -> list[Column]:
    """The summary's columns, led by what separates cells best (KLD and top-1 agreement with FP on every
    perplexity text), then perplexities, flips and accuracies, then the cost; only those with values."""
    texts = list(PERPLEXITY) + sorted({d for d, m in present if m == "ppl"} - set(PERPLEXITY))
    label = lambda d: PERPLEXITY[d].label if d in PERPLEXITY else d  # noqa: E731
    cols = [Column("quant", "bits_per_weight", "bits/weight", None)]
    cols += [Column(d, m, f"{label(d)} {METRICS[m].label}" + (" %" if METRICS[m].percent else ""),
                    METRICS[m].better) for d in texts for m in ("kld", "top1_agree")]
    cols += [Column(d, "ppl", f"{label(d)} ppl", "lower") for d in texts]
    # any other metric declared as a summary column: per text, or for the row it is stored in
    shown = {"kld", "top1_agree", "ppl"}
    for m in METRICS.values():
        if m.summary and m.name not in shown:
            unit = " %" if m.percent else ""
            if m.scope == "text":
                cols += [Column(d, m.name, f"{label(d)} {m.label}{unit}", m.better) for d in texts]
            else:
                cols += [Column(d, m.name, f"{m.label}{unit}", m.better)
                         for d in sorted({d for d, n in present if n == m.name})]
    cols += [Column("flips", "flips", "flips vs FP %", "lower"),
             Column(ZEROSHOT_AVG, "acc", "zero-shot avg %", "higher"), Column("mmlu", "acc", "MMLU %", "higher"),
             Column("lambada_openai", "acc", "LAMBADA %", "higher"),
             Column("quant", "quant_time_s", "quant time (s)", "lower"),
             Column("quant", "quant_peak_rss_bytes", "quant peak RSS", None)]
    return [c for c in cols if (c.dataset, c.metric) in present]
