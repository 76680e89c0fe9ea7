"""Multi-process start-up: `jax.distributed.initialize()` before anything touches a device.

When is a run multi-process?
  * explicit: `--coordinator=HOST:PORT --num_processes=N --process_id=I` on the command line, or the
    environment variables JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID (what
    `scripts/launch_local.py` and the Kubernetes example set);
  * automatic: under SLURM (SLURM_NTASKS > 1; cluster.slurm_layout reads the layout), Open MPI
    (OMPI_COMM_WORLD_SIZE > 1) or a Kubernetes job JAX can introspect (JAX detects the rest);
  * `--distributed=off` (or JAX3D_DISTRIBUTED=off) forces one process, `--distributed=on` forces
    the call (JAX's cluster detection then has to find everything).

With the layout known (explicit, SLURM) the processes first meet in join.py: every failure to start
(a coordinator name that never resolves, a peer that never comes, a port in use, a host whose own
name does not resolve) is a DistributedError on every process within `--init_timeout` seconds
(JAX3D_INIT_TIMEOUT, default 300). A peer silent for `--heartbeat_timeout` seconds (default 100)
makes the others stop with an error. On CPU, cross-process collectives use gloo.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import sys
from collections.abc import Mapping
from typing import Any

from jax3d.errors import DistributedError
from jax3d.trainer import cluster, join

# The command-line flags of multi-process runs (python -m jax3d.train), with their defaults.
FLAGS: dict[str, Any] = {
  'coordinator': None,
  'num_processes': None,
  'process_id': None,
  'distributed': 'auto',
  'init_timeout': None,
  'heartbeat_timeout': None,
  'devices_per_process': None,
}

DEFAULT_INIT_TIMEOUT = 300
DEFAULT_HEARTBEAT_TIMEOUT = 100
DEFAULT_SHUTDOWN_TIMEOUT = 60
EXPLICIT = 'from --coordinator / JAX_COORDINATOR_ADDRESS'
HOSTNAME_BYTES = 256  # host names are exchanged as fixed-size byte arrays (a DNS name has <= 253)


@dataclasses.dataclass
class Info:
  """How this run is started: one process, or several joined through a coordinator."""

  multi: bool  # jax.distributed.initialize was called
  process_id: int = 0
  num_processes: int = 1
  coordinator: str | None = None
  how: str = 'single process'
  init_timeout: int = DEFAULT_INIT_TIMEOUT
  heartbeat_timeout: int = DEFAULT_HEARTBEAT_TIMEOUT
  source: str = ''  # where the coordinator address came from (for messages)
  local_device_ids: list[int] | None = None  # None: every device (or JAX_LOCAL_DEVICE_IDS)


_INFO = Info(multi=False)


def info() -> Info:
  """What `initialize` decided (single process until it is called)."""
  return _INFO


def _int(value: Any, name: str) -> int | None:
  if value in (None, ''):
    return None
  try:
    return int(value)
  except (TypeError, ValueError):
    raise ValueError(f'{name}={value!r} is invalid: an integer') from None


def _detected_cluster() -> str | None:
  """The name of a multi-process launcher JAX can read the layout from, or None."""
  env = os.environ
  if int(env.get('SLURM_NTASKS', env.get('SLURM_NPROCS', '1')) or 1) > 1 and 'SLURM_PROCID' in env:
    return 'SLURM'
  if int(env.get('OMPI_COMM_WORLD_SIZE', '1') or 1) > 1:
    return 'Open MPI'
  if 'KUBERNETES_SERVICE_HOST' in env and 'JOB_COMPLETION_INDEX' in env:
    import importlib.util

    if importlib.util.find_spec('kubernetes') is not None:  # JAX's detector needs `pip install jax[k8s]`
      return 'Kubernetes'
  return None


def resolve(flags: Mapping[str, Any]) -> Info:
  """What to do, from flags and environment, without touching jax. Raises ValueError on bad input."""
  env = os.environ
  mode = str(flags.get('distributed') or env.get('JAX3D_DISTRIBUTED') or 'auto').lower()
  if mode not in ('auto', 'on', 'off'):
    raise ValueError(f'--distributed={mode!r} is invalid: auto, on or off')
  coord = flags.get('coordinator') or env.get('JAX_COORDINATOR_ADDRESS') or None
  n = _int(flags.get('num_processes') or env.get('JAX_NUM_PROCESSES'), '--num_processes')
  pid_flag = flags.get('process_id')
  pid = _int(pid_flag if pid_flag not in (None, '') else env.get('JAX_PROCESS_ID'), '--process_id')
  init_t = (
    _int(flags.get('init_timeout') or env.get('JAX3D_INIT_TIMEOUT'), '--init_timeout') or DEFAULT_INIT_TIMEOUT
  )
  hb_t = (
    _int(flags.get('heartbeat_timeout') or env.get('JAX3D_HEARTBEAT_TIMEOUT'), '--heartbeat_timeout')
    or DEFAULT_HEARTBEAT_TIMEOUT
  )
  if init_t < 1 or hb_t < 1:
    raise ValueError('--init_timeout and --heartbeat_timeout must be positive (seconds)')
  base = dict(init_timeout=init_t, heartbeat_timeout=hb_t)
  if mode == 'off':
    return Info(multi=False, **base)
  explicit = [
    k for k, v in (('--coordinator', coord), ('--num_processes', n), ('--process_id', pid)) if v is not None
  ]
  if n is not None and n < 1:
    raise ValueError(f'--num_processes={n} is invalid: a positive integer')
  if n == 1 and mode == 'auto':
    return Info(multi=False, **base)
  launcher = _detected_cluster()
  slurm = cluster.slurm_layout(env) if launcher == 'SLURM' else None
  if explicit or slurm:
    if coord is not None and (':' not in coord or not coord.rsplit(':', 1)[1].isdigit()):
      raise ValueError(f'--coordinator={coord!r} is invalid: HOST:PORT of process 0')
    base['source'] = EXPLICIT if coord else ''
    if slurm:  # SLURM's variables fill in what is not given
      base.update(source=base['source'] or slurm.source, local_device_ids=slurm.local_device_ids)
      coord, n = coord or slurm.coordinator, n or slurm.num_processes
      pid = slurm.process_id if pid is None else pid
    elif len(explicit) < 3 and launcher is None:
      missing = [k for k in ('--coordinator', '--num_processes', '--process_id') if k not in explicit]
      raise ValueError(
        f'{", ".join(explicit)} given without {", ".join(missing)} (or the matching '
        'JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID)'
      )
    if pid is not None and n is not None and not 0 <= pid < n:
      raise ValueError(f'--process_id={pid} is invalid: 0 <= process_id < num_processes={n}')
    how = 'explicit' if explicit else 'SLURM'  # -1 and 0 below: JAX's cluster detection finds them
    return Info(
      multi=True,
      process_id=-1 if pid is None else pid,
      num_processes=n or 0,
      coordinator=coord,
      how=how,
      **base,
    )
  if mode == 'on' or launcher:
    return Info(multi=True, coordinator=coord, how=launcher or 'cluster auto-detection', **base)
  return Info(multi=False, **base)


def initialize(flags: Mapping[str, Any]) -> Info:
  """Joins the other processes when the run is multi-process. Call before jax touches a device.

  Raises ValueError (bad flags, exit status 2) or DistributedError (coordinator unreachable)."""
  global _INFO
  inf = resolve(flags)
  _INFO = inf
  if not inf.multi:
    return inf
  import jax

  # Only the host (CPU) client reads this: cross-process collectives on fake CPU devices use gloo.
  jax.config.update('jax_cpu_collectives_implementation', 'gloo')
  kwargs: dict[str, Any] = dict(
    initialization_timeout=inf.init_timeout,
    heartbeat_timeout_seconds=inf.heartbeat_timeout,
    shutdown_timeout_seconds=min(DEFAULT_SHUTDOWN_TIMEOUT, max(inf.heartbeat_timeout, 10)),
  )
  who = inf.process_id if inf.process_id >= 0 and inf.num_processes else '?'
  problem = cluster.own_host_problem()
  if inf.coordinator and inf.num_processes and inf.process_id >= 0:
    # The whole layout is known: meet the others first (join.py says why), then hand JAX all of it,
    # so that it does not probe for clusters (its Kubernetes probe warns without `kubernetes`).
    meet = join.Join(inf.coordinator, inf.num_processes, inf.process_id, inf.init_timeout, how_hint(inf))
    meet.bind, meet.problem = os.environ.get('JAX_COORDINATOR_BIND_ADDRESS') or None, problem
    left = meet.run()
    kwargs.update(
      coordinator_address=inf.coordinator,
      num_processes=inf.num_processes,
      process_id=inf.process_id,
      local_device_ids=inf.local_device_ids,
      cluster_detection_method='deactivate',
      initialization_timeout=max(int(left), 10),
    )
  elif problem:
    raise DistributedError(f'process {who}: {problem}')
  elif inf.how == 'explicit':  # a partial layout in a cluster JAX detects (Open MPI): it fills in the rest
    kwargs.update(
      coordinator_address=inf.coordinator,
      num_processes=inf.num_processes or None,
      process_id=None if inf.process_id < 0 else inf.process_id,
    )
  where = inf.coordinator or os.environ.get('JAX_COORDINATOR_ADDRESS') or '(auto-detected address)'
  try:
    jax.distributed.initialize(**kwargs)
  except Exception as e:  # noqa: BLE001 - jaxlib raises its own runtime error types
    raise DistributedError(
      f'process {who} could not join the run: the coordinator at {where} did not answer within '
      f'--init_timeout={inf.init_timeout} s ({how_hint(inf)}); check that process 0 is running and '
      f'HOST:PORT is reachable from this host [{_first_line(e)}]'
    ) from None
  try:  # starts JAX's backends (gloo's on CPU)
    inf.process_id, inf.num_processes = jax.process_index(), jax.process_count()
  except Exception as e:  # noqa: BLE001
    raise DistributedError(
      f'process {who} joined the run, then JAX failed to start: {_first_line(e)}'
    ) from None
  inf.coordinator = _jax_coordinator_address() or where
  return inf


def _first_line(e: BaseException) -> str:
  return f'{type(e).__name__}: ' + (str(e).strip().splitlines() or [''])[0][:300]


def _jax_coordinator_address() -> str | None:
  """The coordinator address jax.distributed.initialize settled on (it detects it itself under
  SLURM, Open MPI or Kubernetes), or None when it cannot be read.

  This reads jax's private state, and is the only place that does: the public jax.distributed has
  only initialize, is_initialized and shutdown, and nothing else knows a detected address. The
  address is only reported (`describe`), so a jax that changes its internals leaves it unknown.
  """
  try:
    from jax._src import distributed as jax_distributed

    return getattr(jax_distributed.global_state, 'coordinator_address', None)
  except Exception:  # any jax whose internals differ: the address is just not known
    return None


def how_hint(inf: Info) -> str:
  """Where the coordinator address came from, for error messages."""
  return inf.source or (EXPLICIT if inf.how == 'explicit' else f'detected by {inf.how}')


def hostnames() -> list[str]:
  """The host name of every process, by process index. Several processes: every one must call
  this (one all-gather of a fixed-size byte array per process; names longer than HOSTNAME_BYTES
  bytes are cut)."""
  import jax

  if not _INFO.multi or jax.process_count() == 1:
    return [socket.gethostname()]
  import numpy as np
  from jax.experimental import multihost_utils

  raw = socket.gethostname().encode()[:HOSTNAME_BYTES]
  mine = np.zeros(HOSTNAME_BYTES, np.uint8)
  mine[: len(raw)] = np.frombuffer(raw, np.uint8)
  every = np.asarray(multihost_utils.process_allgather(mine))  # [processes, HOSTNAME_BYTES]
  return [bytes(row).rstrip(b'\0').decode(errors='replace') for row in every]


def preemption_sync(step: int) -> bool:
  """True on every process at the same step once any of them got SIGTERM (JAX's preemption
  service). Only meaningful when multi-process; False otherwise."""
  import jax

  if jax.process_count() == 1:  # also covers a caller that ran jax.distributed.initialize itself
    return False
  from jax.experimental import multihost_utils

  try:
    return bool(multihost_utils.reached_preemption_sync_point(step))
  except RuntimeError:  # preemption service disabled
    return False


def describe() -> str:
  """One line: the processes, how they were started, the coordinator and devices per process."""
  import jax

  inf = _INFO
  if not inf.multi:
    return 'single process'
  return (
    f'{jax.process_count()} processes ({inf.how}), coordinator {inf.coordinator}, '
    f'{jax.local_device_count()} devices per process, heartbeat timeout {inf.heartbeat_timeout} s'
  )


def hard_exit(code: int) -> None:
  """Leaves now, without the shutdown barrier (which would wait for a lost peer)."""
  sys.stdout.flush()
  sys.stderr.flush()
  os._exit(code)
