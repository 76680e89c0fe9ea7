"""A run's report: figures and a short markdown page from WORKDIR/metrics.jsonl.

  python -m jax3d.report runs/tiny        # writes runs/tiny/report/{report.md, *.png}

metrics.jsonl holds one JSON object per line: training records (step, loss, lr, grad_norm,
tokens_per_sec, step_time_s, tokens, mfu, memory), eval records (step, eval_loss) and events
({'event': 'start' | 'memory_leak' | 'nonfinite', ...}). A resumed run appends to the same file
from its checkpoint's step on, so a record superseded by a later run of the same step is dropped:
at each 'start' event, what the earlier run logged after the resume point is forgotten, and for
any step the last record wins.
"""
from __future__ import annotations

import os
import sys

from jax3d.tools.report import write_report


def main(argv=None) -> int:
  argv = sys.argv[1:] if argv is None else argv
  if len(argv) != 1 or argv[0].startswith('-'):
    print('usage: python -m jax3d.report WORKDIR', file=sys.stderr)
    return 2
  if not os.path.exists(os.path.join(argv[0], 'metrics.jsonl')):
    print(f'error: {os.path.join(argv[0], "metrics.jsonl")}: no such file (is WORKDIR a run directory?)',
          file=sys.stderr)
    return 2
  print(write_report(argv[0]))
  return 0


if __name__ == '__main__':
  sys.exit(main())
