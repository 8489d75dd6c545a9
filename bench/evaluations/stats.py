"""How sure each number is: intervals, paired comparisons, seeds, and when a best value may be called best.

Every perplexity unit keeps its windows' mean NLLs and every accuracy its examples' 0/1 scores (bench.run.cell),
so each number comes with an interval and any two cells evaluated on the same text compare *paired*:

- perplexity: exp(mean NLL) with the 95 % interval exp(mean +- t s / sqrt(n)) over its n windows
  (Student t, n - 1 degrees of freedom; windows weighted equally, as the perplexity itself);
- accuracy: the Wilson score interval over its examples; the zero-shot average of seven tasks: normal,
  from the tasks' binomial variances;
- two cells on the same windows: the ratio of perplexities exp(mean d) with exp(mean d +- t s_d / sqrt(n)),
  d the per-window NLL differences; on the same examples: the difference of accuracies with
  mean d +- t s_d / sqrt(n) over the examples' score differences (for the average: the tasks' paired
  differences combined with their variances);
- seeds: a cell run with several seeds shows the mean over seeds +- their standard deviation; two cells
  that both have at least two seeds compare by Welch's t interval on their seed means (the seed-to-seed
  spread, which one seed's interval does not contain).

A column's best value is *separated* when its comparison with the runner-up excludes no difference; the
others whose comparison with the best includes it are tied with it. Old results without the per-window
or per-example data show their values without intervals and are never called separated.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

METHOD_TEXT = ("95 % intervals: KL divergence from FP and top-1 agreement mean +- t s / sqrt(n) over the windows' "
               "means (tokens inside a window are correlated, windows are the independent units); flips against FP "
               "Wilson over the examples (averaged over tasks: normal, from their binomial variances); "
               "perplexity exp(mean +- t s / sqrt(n)) over its windows' mean NLLs (Student t); "
               "accuracy Wilson over its examples (the zero-shot average: normal, from the tasks' binomial "
               "variances); paired comparisons over the same windows (ratio of perplexities) or examples "
               "(difference of accuracies), mean difference +- t s / sqrt(n); with several seeds, mean +- standard "
               "deviation over seeds, and two multi-seed cells compare by Welch's t on their seed means. A best "
               "value is bold only when its comparison with the runner-up excludes no difference; tied leaders "
               "are marked ~.")


def t95(n: int) -> float:
    """The two-sided 95 % Student t quantile for a mean of n values (n - 1 degrees of freedom)."""
    from scipy.stats import t
    return float(t.ppf(0.975, max(n - 1, 1)))


def _mean_sd(v: list[float]) -> tuple[float, float]:
    n = len(v)
    m = sum(v) / n
    return m, (math.sqrt(sum((x - m) ** 2 for x in v) / (n - 1)) if n > 1 else 0.0)


def mean_interval(v: list[float]) -> tuple[float, float, float] | None:
    """Mean of v and its 95 % t-interval; None when fewer than 2 values."""
    if len(v) < 2:
        return None
    m, sd = _mean_sd(v)
    h = t95(len(v)) * sd / math.sqrt(len(v))
    return m, m - h, m + h


def ratio_interval(a: list[float], b: list[float]) -> tuple[float, float, float] | None:
    """Geometric mean of the paired ratios a_i / b_i (all positive) and its 95 % t-interval on the logs."""
    ci = mean_interval([math.log(x / y) for x, y in zip(a, b)])
    return tuple(math.exp(v) for v in ci) if ci else None


@dataclass
class Estimate:
    """One number with its 95 % interval (None: unknown), over n windows or examples."""
    value: float
    lo: float | None = None
    hi: float | None = None
    n: int | None = None

    @property
    def known(self) -> bool:
        return self.lo is not None and self.hi is not None


def ppl_estimate(window_nll: list[float] | None, value: float | None = None) -> Estimate:
    if not window_nll:
        return Estimate(value)
    m, sd = _mean_sd(window_nll)
    n = len(window_nll)
    if n < 2:
        return Estimate(math.exp(m), n=n)
    h = t95(n) * sd / math.sqrt(n)
    return Estimate(math.exp(m), math.exp(m - h), math.exp(m + h), n)


def mean_estimate(per_window: list[float] | None, value: float | None = None) -> Estimate:
    """A mean over windows (KL divergence, top-1 agreement) with its t interval over the windows' means."""
    if not per_window:
        return Estimate(value)
    ci = mean_interval(per_window)
    if ci is None:
        return Estimate(value if value is not None else per_window[0], n=len(per_window))
    m, lo, hi = ci
    return Estimate(value if value is not None else m, lo, hi, len(per_window))


def flips(fp: list[float], q: list[float]) -> tuple[list[float], list[float]]:
    """Per example (the same examples, in order): 1 where the answer went from right to wrong against the FP
    model, and 1 where it went from wrong to right (Dutta et al., "Accuracy is Not All You Need", 2024)."""
    return ([1.0 if a >= 0.5 > b else 0.0 for a, b in zip(fp, q)],
            [1.0 if b >= 0.5 > a else 0.0 for a, b in zip(fp, q)])


def wilson(k: float, n: int) -> tuple[float, float]:
    z = 1.959963984540054
    if n == 0:
        return 0.0, 1.0
    p = k / n
    den = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / den
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / den
    return max(0.0, centre - half), min(1.0, centre + half)


def acc_estimate(per_example: list[float] | None, value: float | None = None) -> Estimate:
    if not per_example:
        return Estimate(value)
    n = len(per_example)
    lo, hi = wilson(sum(per_example), n)
    return Estimate(sum(per_example) / n, lo, hi, n)


def avg_estimate(tasks: list[list[float]] | None, value: float | None = None) -> Estimate:
    """The mean of several tasks' accuracies, with a normal interval from their binomial variances."""
    if not tasks or any(not t for t in tasks):
        return Estimate(value)
    k = len(tasks)
    means = [sum(t) / len(t) for t in tasks]
    var = sum(p * (1 - p) / len(t) for p, t in zip(means, tasks)) / (k * k)
    m, h = sum(means) / k, 1.959963984540054 * math.sqrt(var)
    return Estimate(m, max(0.0, m - h), min(1.0, m + h), sum(len(t) for t in tasks))


@dataclass
class Comparison:
    """a against b: `effect` (a ratio of perplexities, or a difference of accuracies) with its interval;
    `null` is the value meaning no difference (1 for ratios, 0 for differences)."""
    effect: float
    lo: float | None
    hi: float | None
    null: float
    n: int | None = None
    how: str = ""

    @property
    def separated(self) -> bool:
        return self.lo is not None and self.hi is not None and not (self.lo <= self.null <= self.hi)


def _paired(a: list[float] | None, b: list[float] | None, ratio: bool, how: str) -> Comparison | None:
    """Mean of the paired differences a - b with a t interval (None when either side is missing or they
    differ in length); `ratio`: a and b are log values (NLLs), so the effect is exp(mean), null 1."""
    if not a or not b or len(a) != len(b):
        return None
    d = [x - y for x, y in zip(a, b)]
    m, sd = _mean_sd(d)
    n = len(d)
    f = math.exp if ratio else (lambda v: v)
    null = 1.0 if ratio else 0.0
    if n < 2:
        return Comparison(f(m), None, None, null, n, how)
    h = t95(n) * sd / math.sqrt(n)
    return Comparison(f(m), f(m - h), f(m + h), null, n, how)


def paired_ppl(a: list[float] | None, b: list[float] | None) -> Comparison | None:
    """ppl(a) / ppl(b) over the same windows (None when either lacks windows or they differ in number)."""
    return _paired(a, b, True, "paired windows")


def paired_acc(a: list[float] | None, b: list[float] | None) -> Comparison | None:
    """acc(a) - acc(b) over the same examples."""
    return _paired(a, b, False, "paired examples")


def paired_mean(a: list[float] | None, b: list[float] | None) -> Comparison | None:
    """mean(a) - mean(b) over the same windows (KL divergence, top-1 agreement)."""
    return _paired(a, b, False, "paired windows")


def paired_avg(a: list[list[float]] | None, b: list[list[float]] | None) -> Comparison | None:
    """The difference of two task averages, each task's examples paired (normal, tasks independent)."""
    if not a or not b or len(a) != len(b) or any(len(x) != len(y) or len(x) < 2 for x, y in zip(a, b)):
        return None
    k = len(a)
    diffs, var = [], 0.0
    for x, y in zip(a, b):
        d = [p - q for p, q in zip(x, y)]
        m, sd = _mean_sd(d)
        diffs.append(m)
        var += sd * sd / len(d)
    m, h = sum(diffs) / k, 1.959963984540054 * math.sqrt(var) / k
    return Comparison(m, m - h, m + h, 0.0, sum(len(x) for x in a), "paired examples per task")


def welch(a: list[float], b: list[float], ratio: bool) -> Comparison | None:
    """Seed means of a against b (Welch's t); `ratio`: compare log values and report a ratio."""
    if len(a) < 2 or len(b) < 2:
        return None
    if ratio:
        a, b = [math.log(x) for x in a], [math.log(x) for x in b]
    ma, sa = _mean_sd(a)
    mb, sb = _mean_sd(b)
    va, vb = sa * sa / len(a), sb * sb / len(b)
    se = math.sqrt(va + vb)
    if se == 0:
        d = ma - mb
        return Comparison(math.exp(d) if ratio else d, None, None, 1.0 if ratio else 0.0, len(a) + len(b), "seeds")
    df = (va + vb) ** 2 / ((va * va / (len(a) - 1)) + (vb * vb / (len(b) - 1))) if va + vb > 0 else 1
    from scipy.stats import t
    h = float(t.ppf(0.975, max(df, 1))) * se
    d = ma - mb
    if ratio:
        return Comparison(math.exp(d), math.exp(d - h), math.exp(d + h), 1.0, len(a) + len(b), "seeds (Welch)")
    return Comparison(d, d - h, d + h, 0.0, len(a) + len(b), "seeds (Welch)")


@dataclass(frozen=True)
class Estimator:
    """How a metric's per-unit values make its 95 % interval (`estimate(samples, value)`) and a paired
    comparison of two cells (`paired(a, b)`); `ratio`: a comparison is a ratio (else a difference). The
    catalogue's metrics name one by `Metric.interval` (bench.evaluations.evals)."""
    estimate: object
    paired: object
    ratio: bool


ESTIMATORS: dict[str, Estimator] = {
    "ppl": Estimator(ppl_estimate, paired_ppl, True),       # window NLLs; perplexity = exp(mean)
    "mean": Estimator(mean_estimate, paired_mean, False),   # a mean over windows (KLD, top-1 agreement)
    "acc": Estimator(acc_estimate, paired_acc, False),      # per-example 0/1 scores (accuracy, flips)
    "avg": Estimator(avg_estimate, paired_avg, False),      # several tasks' per-example scores (their average)
}


# ---- one leaderboard cell across seeds ---------------------------------------------------------------

@dataclass
class CellStat:
    """A (method, scheme) cell's value in one column: per seed the number and what it was measured on."""
    kind: str                                                 # its estimator: a key of ESTIMATORS
    seeds: dict[int, Estimate] = field(default_factory=dict)
    samples: dict[int, object] = field(default_factory=dict)  # per seed: window NLLs / example scores / task lists
    metric: str = ""                                          # what it measures (bench.evaluations.evals), for formatting

    @property
    def value(self) -> float:
        v = [e.value for e in self.seeds.values() if e.value is not None]
        return sum(v) / len(v) if v else float("nan")

    @property
    def seed_sd(self) -> float | None:
        v = [e.value for e in self.seeds.values() if e.value is not None]
        return _mean_sd(v)[1] if len(v) > 1 else None

    def first(self) -> Estimate:
        return self.seeds[min(self.seeds)]


def compare(a: CellStat, b: CellStat) -> Comparison | None:
    """a against b: by seeds when both have several, else paired on a seed they share (the lowest)."""
    ratio = ESTIMATORS[a.kind].ratio
    if len(a.seeds) > 1 and len(b.seeds) > 1:
        return welch([e.value for e in a.seeds.values()], [e.value for e in b.seeds.values()], ratio)
    common = sorted(set(a.samples) & set(b.samples))
    if not common:
        return None
    s = common[0]
    return ESTIMATORS[a.kind].paired(a.samples[s], b.samples[s])


@dataclass
class Ranking:
    """A column's verdict: `marks` {key: "best" | "tie"}; `status` "separated", "tied" or "unknown" (no
    per-window/per-example data to compare); the best, the runner-up and their comparison."""
    marks: dict
    status: str
    best: object = None
    runner_up: object = None
    comparison: Comparison | None = None


def rank(cells: dict, lower_is_better: bool) -> Ranking:
    """The best of a column of CellStats is "best" (bold) when separated from the runner-up; otherwise it
    and every cell whose comparison with it includes no difference are "tie"."""
    vals = {k: c for k, c in cells.items() if c is not None and not math.isnan(c.value)}
    if len(vals) < 2:
        return Ranking({}, "unknown")
    order = sorted(vals, key=lambda k: vals[k].value, reverse=not lower_is_better)
    best, runner = order[0], order[1]
    c = compare(vals[best], vals[runner])
    if c is None or c.lo is None:
        return Ranking({}, "unknown", best, runner, c)
    if c.separated:
        return Ranking({best: "best"}, "separated", best, runner, c)
    marks = {best: "tie"}
    for k in order[1:]:
        ck = compare(vals[best], vals[k])
        if ck is not None and ck.lo is not None and not ck.separated:
            marks[k] = "tie"
    return Ranking(marks, "tied", best, runner, c)
