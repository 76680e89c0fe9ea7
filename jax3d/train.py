"""`python -m jax3d.train [--config=configs/tiny.py] [--workdir=runs/tiny] [--config.KEY=VALUE ...]`

Exit status: 0 done (also after a SIGTERM that saved a checkpoint); 2 invalid configuration or
input (one line on stderr, before anything compiles); 3 the run failed (non-finite steps, a
checkpoint that does not match).
"""
from __future__ import annotations

import os
import sys

from jax3d import cli


def main(argv=None) -> int:
  args = cli.parse(sys.argv[1:] if argv is None else argv, extra={'workdir': None})
  if isinstance(args, int):
    return args
  cli.prepare_devices()
  from jax3d import config as config_lib
  from jax3d import checkpoint as ckpt_lib
  from jax3d.trainer import Trainer, TrainingError
  workdir = args.flags['workdir'] or os.path.join('runs', os.path.splitext(os.path.basename(args.config_path))[0])
  try:
    trainer = Trainer(args.cfg, workdir=workdir)
  except config_lib.ConfigError as e:
    return cli.fail(e)
  try:
    for line in trainer.summary():
      trainer.log(line)
    trainer.log(f'  workdir: {os.path.abspath(workdir)}')
    trainer.log(trainer.init_state())
    trainer.train()
    if trainer._stop_signal is None:
      trainer.log('sample: ' + repr(trainer.sample()))
  except (TrainingError, ckpt_lib.CheckpointError) as e:
    print(f'error: {e}', file=sys.stderr)
    return 3
  finally:
    trainer.close()
  return 0


if __name__ == '__main__':
  sys.exit(main())
