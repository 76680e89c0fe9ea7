"""What the machine says about a multi-process run, in plain Python (distributed.py and join.py use
it before JAX starts): the layout SLURM gives each task, whether this host can run gloo (JAX's CPU
collectives), and the sockets of the processes' first meeting."""

from __future__ import annotations

import errno
import json
import os
import re
import selectors
import socket
from collections.abc import Callable, Mapping
from typing import NamedTuple

from jax3d.errors import DistributedError


def why(e: BaseException) -> str:
  """An OS error's reason, one line."""
  text = str(getattr(e, 'strerror', None) or e).strip()
  return text.splitlines()[0] if text else type(e).__name__


def connect(infos: list, timeout: float) -> socket.socket:
  """A TCP connection to the first address of `infos` (getaddrinfo's) that accepts one."""
  last = OSError('no address')
  for family, kind, proto, _, addr in infos:
    s = socket.socket(family, kind, proto)
    try:
      s.settimeout(max(timeout, 0.05))
      s.connect(addr)
      return s
    except OSError as e:
      s.close()
      last = e
  raise last


def listen(bind: str, source: str, from_env: bool) -> socket.socket:
  """A listening socket on HOST:PORT `bind` ('[::]:PORT': every address, IPv4 too). Raises
  DistributedError naming the port and the fix (`source`: where the address came from)."""
  host, _, port = bind.rpartition(':')
  host, where = host.strip('[]') or '::', f'JAX_COORDINATOR_BIND_ADDRESS={bind}' if from_env else bind
  family, dual = (socket.AF_INET6, socket.has_dualstack_ipv6()) if ':' in host else (socket.AF_INET, False)
  try:
    try:
      return socket.create_server((host, int(port)), family=family, dualstack_ipv6=dual)
    except OSError as e:
      if host != '::' or e.errno not in (errno.EAFNOSUPPORT, errno.EADDRNOTAVAIL):
        raise
      return socket.create_server(('0.0.0.0', int(port)))  # no IPv6 here
  except OSError as e:
    used = e.errno == errno.EADDRINUSE
    holder = 'another program (an earlier run still stopping?) holds it: stop it or ' if used else ''
    raise DistributedError(
      f'process 0: the coordinator port {port} {"is already in use" if used else "cannot be bound"} on '
      f'this host (binding {where}: {why(e)}); {holder}choose another port ({source})'
    ) from None


def own_host_problem(getaddrinfo: Callable[..., list] = socket.getaddrinfo) -> str | None:
  """Why gloo (JAX's CPU collectives) could not start on this host, or None. Gloo binds to an
  address of this host's own name (gethostname): the name must resolve to an address of this host."""
  platforms = os.environ.get('JAX_PLATFORMS', '')
  if platforms and 'cpu' not in platforms.split(','):
    return None  # no CPU backend: no gloo
  name = socket.gethostname()
  fix = (
    f"gloo (JAX's CPU collectives) binds to that name's address: map {name!r} to this host's IP "
    f'address in /etc/hosts or DNS'
  )
  try:
    infos = getaddrinfo(name, None, socket.AF_UNSPEC, socket.SOCK_STREAM)
  except OSError as e:
    return f"this host's name {name!r} does not resolve ({why(e)}); {fix}"
  last: OSError | None = None
  for family, kind, proto, _, addr in infos:
    try:
      with socket.socket(family, kind, proto) as s:
        s.bind((addr[0], 0, *addr[2:]))
      return None
    except OSError as e:
      last = e
  found = ', '.join(sorted({i[4][0] for i in infos}))
  return f"this host's name {name!r} resolves to {found}, no address of this host ({why(last)}); {fix}"


class SlurmLayout(NamedTuple):
  coordinator: str | None  # None: SLURM's step variables are missing (JAX then detects what it can)
  num_processes: int
  process_id: int
  local_device_ids: list[int] | None
  source: str


def slurm_layout(env: Mapping[str, str]) -> SlurmLayout:
  """The run's layout from the variables srun gives each task. The coordinator is the first node of
  the step at port JAX_COORDINATOR_PORT (default, as JAX picks it: from SLURM_JOB_ID). Each task's
  GPUs (`local_device_ids`): all it sees when it is alone on its node (or when srun bound GPUs to
  it: --gpus-per-task), else its share of the node's GPUs; JAX_LOCAL_DEVICE_IDS, when set, wins."""
  n, pid = int(env.get('SLURM_NTASKS') or env.get('SLURM_NPROCS') or 1), int(env.get('SLURM_PROCID') or 0)
  nodes, job = env.get('SLURM_STEP_NODELIST') or env.get('SLURM_JOB_NODELIST'), env.get('SLURM_JOB_ID')
  port = env.get('JAX_COORDINATOR_PORT') or (str(int(job) % 4096 + 61440) if job and job.isdigit() else None)
  source = 'the first node of SLURM_STEP_NODELIST, port JAX_COORDINATOR_PORT or from SLURM_JOB_ID'
  coordinator = None
  if nodes and port:
    m = re.match(r'([^,\[]*)(?:\[([^,\-\]]*))?', nodes)
    coordinator = f'{m.group(1)}{m.group(2) or ""}:{port}'
  return SlurmLayout(coordinator, n, pid, _slurm_devices(env), source)


def _slurm_devices(env: Mapping[str, str]) -> list[int] | None:
  if env.get('JAX_LOCAL_DEVICE_IDS'):
    return None  # jax.distributed.initialize reads it
  counts = []  # tasks on each node of the step: SLURM writes '2(x3),1'
  for part in (env.get('SLURM_STEP_TASKS_PER_NODE') or env.get('SLURM_TASKS_PER_NODE') or '1').split(','):
    m = re.fullmatch(r'(\d+)(?:\(x(\d+)\))?', part.strip())
    counts += [int(m.group(1))] * int(m.group(2) or 1) if m else [1]
  node, local = int(env.get('SLURM_NODEID') or 0), int(env.get('SLURM_LOCALID') or 0)
  tasks = counts[node] if node < len(counts) else 1
  seen = [d for d in env.get('CUDA_VISIBLE_DEVICES', '').split(',') if d.strip()] or None
  on_node = int(env['SLURM_GPUS_ON_NODE']) if env.get('SLURM_GPUS_ON_NODE', '').isdigit() else None
  if tasks <= 1 or (seen and on_node and len(seen) < on_node):
    return None  # alone on the node, or srun gave this task its own GPUs: every GPU it sees
  total = len(seen) if seen else on_node
  if not total:
    return [local]  # GPUs unknown: JAX's own SLURM rule, one per task
  if total % tasks:
    raise ValueError(
      f'SLURM runs {tasks} tasks on a node with {total} GPUs, which do not divide evenly: use one task '
      'per node or per GPU (srun --gpus-per-task), or set JAX_LOCAL_DEVICE_IDS for each task'
    )
  k = total // tasks
  return list(range(local * k, (local + 1) * k))


def send(sock: socket.socket, msg: dict) -> None:
  """Sends `msg` as a JSON line (a peer that is gone shows as end of file when read)."""
  try:
    sock.sendall((json.dumps(msg) + '\n').encode())
  except OSError:
    pass  # the peer is gone: its end of file comes next


class Conn:
  """One connection: its socket, the bytes of a line not complete yet, who checked in on it."""

  def __init__(self, sock: socket.socket) -> None:
    self.sock, self.buf, self.id, self.host, self.told = sock, b'', None, '?', False

  def messages(self) -> list[dict] | None:
    """The complete messages now readable (call when the socket is), or None at EOF or garbage."""
    try:
      data = self.sock.recv(65536)
      *lines, self.buf = (self.buf + data).split(b'\n')
      out = [json.loads(line) for line in lines if line.strip()]
    except (OSError, ValueError):
      return None
    return out if data and len(self.buf) < 65536 and all(isinstance(m, dict) for m in out) else None

  def alive(self) -> bool:
    """Still open (a process that checks in again after a lost connection is no duplicate)."""
    with selectors.DefaultSelector() as sel:
      sel.register(self.sock, selectors.EVENT_READ)
      try:
        return not sel.select(0) or self.sock.recv(1, socket.MSG_PEEK) != b''
      except OSError:
        return False
