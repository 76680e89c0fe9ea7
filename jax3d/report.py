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

from jax3d import cli
from jax3d.analysis.run_report import write_report


def main(argv: list[str] | None = None) -> int:
  """Runs `python -m jax3d.report WORKDIR` with argv (default sys.argv[1:]); returns the exit status."""
  args = cli.parse(
    sys.argv[1:] if argv is None else argv,
    __doc__,
    config=False,
    positional={'WORKDIR': "a training run's workdir, holding metrics.jsonl"},
  )
  return cli.run_command(_report, args)


def _report(args: cli.Args) -> int:
  workdir = args.positional[0]
  metrics = os.path.join(workdir, 'metrics.jsonl')
  if not os.path.exists(metrics):
    return cli.fail(f'WORKDIR={workdir}: {metrics}: no such file (is WORKDIR a run directory?)')
  print(write_report(workdir))
  return 0


if __name__ == '__main__':
  sys.exit(main())
