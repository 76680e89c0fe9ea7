"""`python -m jax3d.train [--config=configs/tiny.py] [--workdir=runs/tiny] [--config.KEY=VALUE ...]`

Several processes (one per host, or per GPU group; see docs/multihost.md):
  --coordinator=HOST:PORT --num_processes=N --process_id=I   (or JAX_COORDINATOR_ADDRESS,
      JAX_NUM_PROCESSES, JAX_PROCESS_ID); detected automatically under SLURM, Open MPI, Kubernetes
  --distributed=auto|on|off      force or forbid jax.distributed.initialize (default auto)
  --init_timeout=S               give up joining the coordinator after S seconds (default 300)
  --heartbeat_timeout=S          a peer silent for S seconds counts as lost (default 100)
  --devices_per_process=N        fake CPU devices per process when XLA_FLAGS is unset (default 8)

Exit status: 0 done (also after a SIGTERM that saved a checkpoint, on every process); 2 invalid
configuration or input (one line on stderr, before anything compiles); 3 the run failed (non-finite
steps, a checkpoint that does not match, a distributed start that fails: a coordinator that cannot
be reached, a peer that never joins, a coordinator port in use, a host whose own name does not
resolve; a lost peer process, the workdir in use by another run, a checkpoint write that failed
(disk full), a truncated data file).
"""

from __future__ import annotations

import os
import sys

from jax3d import cli, errors
from jax3d.trainer import distributed, rundir

# The distributed flags are distributed.FLAGS, typed (an unset one falls back to its environment
# variable: JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID, JAX3D_DISTRIBUTED, ...).
FLAGS = {
  'workdir': cli.Flag(
    str, None, 'checkpoints and metrics.jsonl go here (default: runs/CONFIG_NAME)', cli.ranges.NEW_OR_FOLDER
  ),
  'coordinator': cli.Flag(str, None, 'HOST:PORT of process 0'),
  'num_processes': cli.Flag(int, None, 'processes in the run', cli.POSITIVE),
  'process_id': cli.Flag(int, None, 'this process, 0 .. num_processes-1', cli.NON_NEGATIVE),
  'distributed': cli.Flag(
    str,
    None,
    'auto, on or off: call jax.distributed.initialize (default auto)',
    cli.one_of('auto', 'on', 'off'),
  ),
  'init_timeout': cli.Flag(int, None, 'seconds to join the coordinator (default 300)', cli.POSITIVE),
  'heartbeat_timeout': cli.Flag(
    int, None, 'seconds before a silent peer counts as lost (default 100)', cli.POSITIVE
  ),
  'devices_per_process': cli.Flag(
    int, 8, 'fake CPU devices per process when XLA_FLAGS is unset', cli.POSITIVE
  ),
}


def main(argv: list[str] | None = None) -> int:
  """Runs `python -m jax3d.train` with argv (default sys.argv[1:]); returns the exit status."""
  args = cli.parse(sys.argv[1:] if argv is None else argv, __doc__, FLAGS)
  if isinstance(args, int):
    return args
  cli.prepare_devices(args.flags['devices_per_process'])
  try:
    inf = distributed.initialize(args.flags)  # before anything touches a device
  except (errors.Jax3dError, ValueError) as e:  # a bad flag (2), an unreachable coordinator (3)
    return cli.fail(e)
  if not inf.multi:
    return _run(args)
  try:
    return _run(args)
  except BaseException as e:  # a failure on one process must not hang the others
    if isinstance(e, SystemExit):
      raise
    import jax

    first = (str(e).strip().splitlines() or [''])[0][:400]
    print(
      f'error: process {jax.process_index()}/{jax.process_count()}: the run failed '
      f'({type(e).__name__}: {first}); a peer process may have died or lost contact (heartbeat '
      f'timeout {inf.heartbeat_timeout} s), see its output',
      file=sys.stderr,
      flush=True,
    )
    distributed.hard_exit(3)
    return 3


def _run(args: cli.Args) -> int:
  from jax3d.parallel import mesh as mesh_lib
  from jax3d.trainer.trainer import Trainer

  multi = distributed.info().multi
  workdir = args.flags['workdir'] or os.path.join('runs', args.config_name)
  made, status = not os.path.exists(workdir), 0
  trainer = None
  try:
    # A ConfigError here is bad input (exit 2), found before anything compiles; a CheckpointError
    # is another run holding the workdir (exit 3).
    trainer = Trainer(args.cfg, workdir=workdir)
    for line in trainer.summary():
      trainer.log(line)
    if multi:
      hosts = distributed.hostnames()
      trainer.log(f'  processes: {distributed.describe()}')
      trainer.log('  placement (dp, pp, tp) -> host, process, device:')
      for line in mesh_lib.describe_placement(trainer.mesh, hosts):
        trainer.log(line)
    trainer.log(f'  workdir: {os.path.abspath(workdir)}')
    # train() sets its SIGTERM handler, then initialises (or restores) the state and logs it, then
    # compiles: a SIGTERM from the moment that line shows saves and exits 0. A ConfigError there
    # is the memory check, with the OOM ladder.
    trainer.train()
    if not trainer.preempted and not multi:
      trainer.log('sample: ' + repr(trainer.sample()))
  except errors.Jax3dError as e:
    status = _fail(e, multi)
  finally:
    if trainer is not None:
      try:
        trainer.close()  # waits for an async checkpoint write, whose failure surfaces here
      except errors.Jax3dError as e:
        status = status or _fail(e, multi)
  if made and status == errors.BAD_INPUT and not multi:  # a refusal leaves no workdir behind
    rundir.discard_unused(workdir)
  return status


def _fail(e: errors.Jax3dError, multi: bool) -> int:
  """`cli.fail`, except that with several processes bad input (the same on every one) is printed by
  process 0 only; a failed run (TrainingError, CheckpointError, DataError) by every process."""
  import jax

  if multi and errors.exit_status(e) == errors.BAD_INPUT and jax.process_index() != 0:
    return errors.exit_status(e)
  return cli.fail(e)


if __name__ == '__main__':
  sys.exit(main())
