"""`lrq-bench compare`, `report` and `results`: read the results store."""

from __future__ import annotations

import sys
from dataclasses import asdict
from pathlib import Path

from bench.cli.args import _csv, _existing_store, _warn_unreadable
from lrq.io import dumps_json, plain_text


def cmd_compare(args) -> int:
    from bench.reports.compare import gate
    code, md = gate(args.baseline, args.current, args.tolerances, args.allow_missing, args.all,
                    args.allow_settings_change)
    print(md)
    return code


def cmd_report(args) -> int:
    from bench.reports.html_report import write_report
    store = _existing_store(args.results)
    out = write_report(store, Path(args.out))
    _warn_unreadable(store)
    print(out)
    print(out.with_name("leaderboard.html"))
    return 0


RESULT_COLUMNS = ("model", "method", "scheme", "precision", "dataset", "metric", "value", "seed", "git_rev", "created_at")


def _result_cell(row, column: str):
    """A row's field as `results` shows it in a table: stored strings as plain text, the revision short."""
    value = getattr(row, column)
    if not isinstance(value, str):
        return value
    return plain_text(value)[:12] if column == "git_rev" else plain_text(value)


def cmd_results(args) -> int:
    store = _existing_store(args.results)
    rows = store.rows(as_stored=args.save or args.json or args.format == "json")   # files carry what was stored
    _warn_unreadable(store)
    if args.save:
        from bench.run import ledger
        methods = set(_csv(args.only_methods)) if args.only_methods else None
        keys = {r.unit_key for r in rows if (args.only_model is None or r.model == args.only_model)
                and (methods is None or r.method in methods)}
        path, n = ledger.save(store, args.save, keys)
        print(f"{path}: {n} unit(s) ({len(keys)} from {store.path})")
        return 0
    fmt = "json" if args.json else args.format
    if fmt == "json":
        sys.stdout.write(dumps_json([asdict(r) | {"precision": r.precision} for r in rows], indent=1, default=str))
        print()
        return 0
    table = [[_result_cell(r, c) for c in RESULT_COLUMNS] for r in rows]
    if fmt == "csv":
        import csv
        w = csv.writer(sys.stdout)
        w.writerow(RESULT_COLUMNS)
        w.writerows(table)
    else:
        from tabulate import tabulate
        print(tabulate(table, headers=RESULT_COLUMNS, tablefmt="simple", disable_numparse=True))
    return 0
