#!/usr/bin/env python3
"""Runs one command as N cooperating JAX processes on this machine (127.0.0.1), for trying and
testing multi-host code without a cluster:

  python scripts/launch_local.py -n 2 [--devices-per-process 4] -- python -m jax3d.train --config=tiny

Each process gets JAX_COORDINATOR_ADDRESS=127.0.0.1:<free port>, JAX_NUM_PROCESSES=N,
JAX_PROCESS_ID=i and XLA_FLAGS=--xla_force_host_platform_device_count=<devices-per-process>
(JAX_PLATFORMS=cpu unless set), so the command sees N*devices-per-process CPU devices joined by gloo.
Output lines are forwarded with a `[p<i>] ` prefix. When a process fails (non-zero status or a
signal), the launcher names it, gives the others --grace seconds to stop on their own (they notice
the lost peer through JAX's heartbeat), then kills them. SIGINT/SIGTERM to the launcher are passed on
to every process as SIGTERM (the trainer saves a checkpoint and exits 0).

Exit status: 0 when every process exited 0; else the status of the first process that failed
(128 + signal number when it was killed by a signal; of processes seen ending together, one killed
by a signal counts as first).
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time


def free_port() -> int:
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind(('127.0.0.1', 0))
    return s.getsockname()[1]


def describe_status(rc: int) -> str:
  if rc < 0:
    try:
      return f'killed by {signal.Signals(-rc).name}'
    except ValueError:
      return f'killed by signal {-rc}'
  return f'exited with status {rc}'


def main(argv=None) -> int:
  argv = sys.argv[1:] if argv is None else argv
  if '--' in argv:
    cut = argv.index('--')
    own, cmd = argv[:cut], argv[cut + 1 :]
  else:
    own, cmd = argv, []
  ap = argparse.ArgumentParser(
    description=__doc__.split('\n\n')[0],
    usage='launch_local.py -n N [--devices-per-process D] -- COMMAND ...',
  )
  ap.add_argument('-n', '--num-processes', type=int, default=2)
  ap.add_argument('--devices-per-process', type=int, default=4)
  ap.add_argument('--port', type=int, default=0, help='coordinator port (default: a free one)')
  ap.add_argument(
    '--show-gloo',
    action='store_true',
    help="keep gloo's '[Gloo] Rank i is connected to ...' lines (hidden by default)",
  )
  ap.add_argument(
    '--grace',
    type=float,
    default=20.0,
    help='seconds the others get to stop by themselves after one fails (default 20)',
  )
  a = ap.parse_args(own)
  if not cmd:
    ap.error('no command: put it after --, e.g. -- python -m jax3d.train')
  if a.num_processes < 1 or a.devices_per_process < 1:
    ap.error('-n and --devices-per-process must be positive')
  port = a.port or free_port()
  addr = f'127.0.0.1:{port}'
  base = dict(os.environ)
  xla = re.sub(r'--xla_force_host_platform_device_count=\S+', '', base.get('XLA_FLAGS', '')).strip()
  base['XLA_FLAGS'] = f'{xla} --xla_force_host_platform_device_count={a.devices_per_process}'.strip()
  base.setdefault('JAX_PLATFORMS', 'cpu')
  base['PYTHONUNBUFFERED'] = '1'
  base.update(
    JAX_COORDINATOR_ADDRESS=addr, JAX_COORDINATOR_BIND_ADDRESS=addr, JAX_NUM_PROCESSES=str(a.num_processes)
  )
  out_lock = threading.Lock()

  def say(msg: str) -> None:
    with out_lock:
      print(f'launch_local: {msg}', file=sys.stderr, flush=True)

  procs: list[subprocess.Popen] = []
  threads = []

  def forward(i, stream, sink):
    for raw in iter(stream.readline, b''):
      line = raw.decode(errors='replace').rstrip('\n')
      if not a.show_gloo and ('[Gloo]' in line or 'peer ranks' in line):
        continue
      with out_lock:
        sink.write(f'[p{i}] {line}\n')
        sink.flush()
    stream.close()

  say(f'{a.num_processes} processes x {a.devices_per_process} CPU devices, coordinator {addr}')
  for i in range(a.num_processes):
    env = dict(base, JAX_PROCESS_ID=str(i))
    # Own session: a kill reaches the process and anything it started.
    p = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    procs.append(p)
    say(f'started process {i} (pid {p.pid})')
    for stream, sink in ((p.stdout, sys.stdout), (p.stderr, sys.stderr)):
      t = threading.Thread(target=forward, args=(i, stream, sink), daemon=True)
      t.start()
      threads.append(t)

  def pass_on(signum, frame):
    say(f'got {signal.Signals(signum).name}: sending SIGTERM to every process')
    for p in procs:
      if p.poll() is None:
        try:
          os.killpg(p.pid, signal.SIGTERM)
        except ProcessLookupError:
          pass

  signal.signal(signal.SIGINT, pass_on)
  signal.signal(signal.SIGTERM, pass_on)

  first_fail, deadline, reported = None, None, set()
  while True:
    # Processes that ended since the last look; of several, one killed by a signal goes first: it is
    # the likelier cause (its peers then fail on the lost connection within the same 0.1 s).
    ended = [(i, p, p.poll()) for i, p in enumerate(procs) if i not in reported]
    ended = sorted([e for e in ended if e[2] is not None], key=lambda e: (e[2] >= 0, e[0]))
    for i, p, rc in ended:
      reported.add(i)
      if rc == 0:
        say(f'process {i} (pid {p.pid}) finished (status 0)')
      else:
        say(f'process {i} (pid {p.pid}) {describe_status(rc)}')
        if first_fail is None:
          first_fail = (i, rc)
          if len(reported) < len(procs):
            say(f'process {i} failed: giving the others {a.grace:g} s to stop, then killing them')
          deadline = time.time() + a.grace
    if len(reported) == len(procs):
      break
    if deadline is not None and time.time() > deadline:
      for i, p in enumerate(procs):
        if p.poll() is None:
          say(
            f'killing process {i} (pid {p.pid}): still running {a.grace:g} s after process {first_fail[0]} failed'
          )
          try:
            os.killpg(p.pid, signal.SIGKILL)
          except ProcessLookupError:
            pass
      deadline = None
    time.sleep(0.1)
  for t in threads:
    t.join(timeout=5)
  if first_fail is None:
    return 0
  i, rc = first_fail
  say(f'failed: process {i} {describe_status(rc)}')
  return 128 - rc if rc < 0 else rc


if __name__ == '__main__':
  sys.exit(main())
