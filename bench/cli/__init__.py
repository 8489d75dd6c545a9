"""`lrq-bench`: run a sweep, write the leaderboard, dump stored results.

Exit codes: 0 success, 2 bad input (one paragraph on stderr, no traceback), 1 failure at run time.
"""

from __future__ import annotations

import logging
import os
import sys
import textwrap

from bench.cli.args import build_parser
from lrq.errors import UserError
from lrq.io import plain_text


class Terminated(BaseException):
    """SIGTERM reached the driver: unwinds like Ctrl-C (workers are terminated on the way out), never taken
    for a failing cell (it is not an Exception)."""


def _on_sigterm(signum, frame):
    raise Terminated()


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=os.environ.get("LRQ_BENCH_LOG", "WARNING"), format="%(levelname)s %(message)s")
    import signal
    import threading
    old_term = None
    if threading.current_thread() is threading.main_thread():
        old_term = signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        argv = sys.argv[1:] if argv is None else argv
        args = build_parser(with_lists=any(a in ("-h", "--help") for a in argv)).parse_args(argv)
        from bench.cli.export import cmd_export
        from bench.cli.results import cmd_compare, cmd_report, cmd_results
        from bench.cli.run import cmd_plan, cmd_run
        return {"run": cmd_run, "plan": cmd_plan, "export": cmd_export, "compare": cmd_compare, "report": cmd_report,
                "results": cmd_results}[args.command](args)
    except UserError as e:
        print(textwrap.fill(f"lrq-bench: error: {plain_text(e)}", width=100, break_long_words=False, break_on_hyphens=False),
              file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("lrq-bench: interrupted; completed cells are stored and will be reused.", file=sys.stderr)
        return 130
    except Terminated:
        print("lrq-bench: terminated (SIGTERM): the running cells were stopped with their workers; every unit "
              "measured so far is stored, and a rerun of the same command resumes (block-wise methods at their "
              "next block).", file=sys.stderr)
        return 143
    except BrokenPipeError:   # `lrq-bench results --json | head`: the reader left; nothing to say
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0
    finally:
        if old_term is not None:
            signal.signal(signal.SIGTERM, old_term)
