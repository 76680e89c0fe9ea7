"""The processes of a run meet before JAX joins them (distributed.initialize runs this first).

jax.distributed.initialize aborts the process (SIGABRT, no Python exception) when a peer never
registers, and gloo fails inside JAX's backend start when a host's own name does not resolve,
leaving the others hanging. So the processes first meet on the coordinator's port, in plain Python,
within --init_timeout:

  * process 0 listens on the port (where JAX's coordinator will), checks that the coordinator
    address resolves and leads back to it, and waits until the other N-1 processes have checked in;
  * every other process resolves the coordinator's name and connects, both retried in one loop (a
    DNS record that appears late, a pod still starting), and reports its own problem, if any;
  * process 0 answers `go` when all are there and none has a problem, else `fail` with one line
    naming the cause and the setting that fixes it, which every process raises (DistributedError).

Waiting processes print what they wait for every PROGRESS_EVERY seconds. After `go` process 0
frees the port for JAX's coordinator, and jax.distributed.initialize finds everyone there.
Messages are JSON lines.
"""

from __future__ import annotations

import dataclasses
import json
import secrets
import selectors
import socket
import sys
import time
from collections.abc import Callable

from jax3d.errors import DistributedError
from jax3d.trainer.cluster import Conn, connect, listen, send, why

PROGRESS_EVERY = 5.0  # seconds between "waiting for ..." lines
PROBLEM_GRACE = 10.0  # a run that cannot start tells the processes still coming for this long
ANSWER_WITHIN = 5.0  # a listener that does not answer like process 0 within this is another program
PROTOCOL = 'jax3d-join/1'


@dataclasses.dataclass
class Join:
  """The meeting of process `process_id` of `num_processes` at `address` (HOST:PORT of process 0),
  within `timeout` seconds. `run()` returns the seconds left, or raises DistributedError."""

  address: str
  num_processes: int
  process_id: int
  timeout: float
  source: str = 'from --coordinator / JAX_COORDINATOR_ADDRESS'  # where the address came from
  bind: str | None = None  # where process 0 listens (JAX_COORDINATOR_BIND_ADDRESS; default [::]:PORT)
  problem: str | None = None  # why this process cannot start (cluster.own_host_problem())
  say: Callable[[str], None] = lambda line: print(line, file=sys.stderr, flush=True)
  getaddrinfo: Callable[..., list] = socket.getaddrinfo
  progress_every: float = PROGRESS_EVERY

  def run(self) -> float:
    host, _, port = self.address.rpartition(':')
    self.host, self.port, self.t0 = host.strip('[]'), int(port), time.monotonic()
    self.deadline, self.next_say = self.t0 + self.timeout, self.t0 + self.progress_every
    (self._lead if self.process_id == 0 else self._follow)()
    return self.deadline - time.monotonic()

  def _progress(self, state: str) -> None:
    now = time.monotonic()
    if now >= self.next_say:
      self.next_say = now + self.progress_every
      self.say(
        f'process {self.process_id}: waiting for the run to start ({now - self.t0:.0f} s of '
        f'--init_timeout={self.timeout:g} s): {state}'
      )

  def _resolve(self) -> list:
    return self.getaddrinfo(self.host, self.port, type=socket.SOCK_STREAM)

  # ---- every process but 0

  def _follow(self) -> None:
    state, fix = 'nothing tried yet', ''
    limit = min(self.deadline, self.t0 + PROBLEM_GRACE) if self.problem else self.deadline
    while time.monotonic() < limit:
      self._progress(f'{state} ({self.source})')
      try:
        infos = self._resolve()
      except (OSError, UnicodeError) as e:
        state = f'the coordinator name {self.host!r} does not resolve yet ({why(e)})'
        fix = 'check the name (Kubernetes: a headless Service with publishNotReadyAddresses: true)'
        time.sleep(0.5)
        continue
      try:
        sock = connect(infos, min(2.0, limit - time.monotonic()))
      except OSError as e:
        state = f'nothing accepts connections at {self.address} ({why(e)})'
        fix = 'check that process 0 is running there and the port is open to this host'
        time.sleep(0.5)
        continue
      with sock:
        state, fix = self._talk(Conn(sock), limit)
      if not state:
        return
      time.sleep(0.5)
    raise DistributedError(
      f'process {self.process_id}: {self.problem}'
      if self.problem
      else f'process {self.process_id} could not join the run at {self.address} ({self.source}) '
      f'within --init_timeout={self.timeout:g} s: {state}; {fix}'
    )

  def _talk(self, conn: Conn, limit: float) -> tuple[str, str]:
    """Checks in with process 0: ('', '') on `go`, else (what went wrong, the fix)."""
    hello = {'join': PROTOCOL, 'id': self.process_id, 'n': self.num_processes, 'host': socket.gethostname()}
    send(conn.sock, dict(hello, problem=self.problem))
    state = f'{self.address} accepts connections but does not answer like jax3d process 0'
    fix = f'another program holds port {self.port} there: choose another port ({self.source})'
    t_conn, answered = time.monotonic(), False
    with selectors.DefaultSelector() as sel:
      sel.register(conn.sock, selectors.EVENT_READ)
      # Once process 0 answered, its verdict is awaited a little past the deadline (it has the same).
      while time.monotonic() < limit + 2.0 * answered and (
        answered or time.monotonic() - t_conn < ANSWER_WITHIN
      ):
        if answered:
          self._progress(state)
        if not sel.select(timeout=0.25):
          continue
        msgs = conn.messages()
        if msgs is None:
          return (
            (f'process 0 at {self.address} closed the connection', 'see its output')
            if answered
            else (state, fix)
          )
        for m in msgs:
          answered = answered or bool({'go', 'fail', 'wait'} & set(m))
          if 'go' in m:
            return '', ''
          if 'fail' in m:
            mine = f'process {self.process_id}: {self.problem}' if self.problem else None
            raise DistributedError(mine or _verdict(self.process_id, str(m['fail'])))
          if 'wait' in m:
            state = f'process 0 is waiting for process(es) {_ids(m["wait"])} to join at {self.address}'
            fix = f'start every process, with --num_processes={self.num_processes} and its own --process_id'
    return state, fix

  # ---- process 0

  def _lead(self) -> None:
    with listen(self.bind or f'[::]:{self.port}', self.source, self.bind is not None) as lsock:
      with selectors.DefaultSelector() as sel:
        lsock.setblocking(False)
        sel.register(lsock, selectors.EVENT_READ)
        self._gather(lsock, sel)

  def _gather(self, lsock: socket.socket, sel: selectors.BaseSelector) -> None:
    self.peers: dict[int, Conn] = {}
    self.nonce, self.self_ok, self.next_self = secrets.token_hex(8), False, 0.0
    self.self_state, self.failure, self.told = 'not checked yet', None, set()
    if self.problem:
      self.failure = f'process 0 (host {socket.gethostname()}): {self.problem}'
    give_up, everyone = min(self.deadline, self.t0 + PROBLEM_GRACE), set(range(1, self.num_processes))
    while True:
      now, missing = time.monotonic(), sorted(everyone - set(self.peers))
      if self.failure is None and now >= self.deadline:
        self.failure = self._timeout_message(missing)
      if self.failure is not None:
        for i, c in self.peers.items():
          self._tell(c, i)
        if now >= give_up or self.told >= everyone:
          raise DistributedError(f'process 0: {self.problem}' if self.problem else _verdict(0, self.failure))
      elif not missing and self.self_ok:
        return self._go(sel)
      else:
        give_up = min(self.deadline, now + PROBLEM_GRACE)  # a failure from now on: this long to tell
        if not self.self_ok and now >= self.next_self:
          self._check_self()
      if now >= self.next_say:
        for c in self.peers.values():
          send(c.sock, {'wait': missing})
        here = [f'process(es) {_ids(missing)} not here yet'] if missing else []
        self._progress('; '.join(here + ([] if self.self_ok else [self.self_state])))
      for key, _ in sel.select(timeout=0.25):
        if key.fileobj is not lsock:
          self._read(sel, key.data, missing)
          continue
        try:
          sock, _addr = lsock.accept()
        except OSError:
          continue
        sock.settimeout(2.0)
        sel.register(sock, selectors.EVENT_READ, Conn(sock))

  def _read(self, sel: selectors.BaseSelector, conn: Conn, missing: list) -> None:
    """Handles what `conn` sent: the self-check's nonce, or a process checking in (into self.peers,
    or self.failure when it cannot start or does not fit)."""
    msgs = conn.messages()
    if msgs is None:
      sel.unregister(conn.sock)
      conn.sock.close()
      if conn.id is not None and self.peers.get(conn.id) is conn:
        del self.peers[conn.id]
        self.say(f'process 0: process {conn.id} (host {conn.host}) left before the run started')
      return
    for m in msgs:
      if m.get('self') == self.nonce:
        self.self_ok = True
      elif m.get('join') == PROTOCOL and conn.id is None:
        self._check_in(conn, m.get('id'), m.get('n'), str(m.get('host'))[:256], m.get('problem'))

  def _check_in(self, conn: Conn, i: object, n: object, host: str, problem: str | None) -> None:
    i = i if isinstance(i, int) else repr(i)
    who, n0 = f'process {i} (host {host})', self.num_processes
    if problem:
      self.failure = self.failure or f'{who}: {problem}'
    elif n != n0:
      self.failure = self.failure or (
        f'{who} was started with --num_processes={n}, process 0 with {n0}: start every process with the same'
      )
    elif isinstance(i, str) or not 0 < i < n0 or (i in self.peers and self.peers[i].alive()):
      self.failure = self.failure or (
        f'{who} claims --process_id={i}, which is {"taken" if i in self.peers else "invalid"}: give '
        f'each process its own id in 1..{n0 - 1} (0 is the coordinator)'
      )
    else:
      conn.id, conn.host, self.peers[i] = i, host, conn
      send(conn.sock, {'wait': sorted(set(range(1, n0)) - set(self.peers))})
    if self.failure is not None:
      self._tell(conn, i)

  def _tell(self, conn: Conn, i: object) -> None:
    if not conn.told:
      conn.told = True
      self.told.add(i)
      send(conn.sock, {'fail': self.failure})

  def _check_self(self) -> None:
    """Whether the coordinator address leads back to this listener (JAX's client on process 0
    connects to it too): connects and sends the nonce, which _read then receives."""
    self.next_self, infos = time.monotonic() + 1.0, []
    try:
      infos = self._resolve()
      with connect(infos, 1.0) as s:
        s.sendall((json.dumps({'self': self.nonce}) + '\n').encode())
      self.self_state = f'{self.address} (at {infos[0][4][0]}) does not lead to process 0: name its host'
    except (OSError, UnicodeError) as e:
      self.self_state = (
        f'process 0 cannot reach its own address {self.address} ({why(e)})'
        if infos
        else f'the coordinator name {self.host!r} does not resolve on process 0 yet ({why(e)})'
      )

  def _timeout_message(self, missing: list[int]) -> str:
    if not missing:
      return (
        f'the run did not start within --init_timeout={self.timeout:g} s: {self.self_state} ({self.source})'
      )
    n = self.num_processes
    return (
      f'the run did not start within --init_timeout={self.timeout:g} s: process(es) '
      f'{_ids(missing)} never joined at {self.address} ({self.source}); start all {n} processes with '
      f'--num_processes={n} and ids 0..{n - 1}, or raise --init_timeout'
    )

  def _go(self, sel: selectors.BaseSelector) -> None:
    """Tells everyone to go, then waits (2 s at most) for them to close first, so that this side
    holds no connection on the port when JAX's coordinator binds it."""
    for c in self.peers.values():
      send(c.sock, {'go': True})
    left, t_end = {c.sock for c in self.peers.values()}, time.monotonic() + 2.0
    while left and time.monotonic() < t_end:
      for key, _ in sel.select(timeout=0.1):
        if key.fileobj in left and key.data.messages() is None:
          left.discard(key.fileobj)
    for key in list(sel.get_map().values()):
      if key.data is not None:
        key.fileobj.close()


def _verdict(pid: int, failure: str) -> str:
  return f'process {pid}: ' + (
    failure if failure.startswith('the run') else f'the run cannot start: {failure}'
  )


def _ids(ids: list) -> str:
  return ', '.join(str(i) for i in ids) if ids else '(none)'
