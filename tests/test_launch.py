"""The launch recipes as a cluster meets them: the processes' first meeting (jax3d/trainer/join.py),
SLURM's layout, every start failure exiting 3 with one line, the SLURM script requeueing after a
SIGTERM, the Kubernetes Job waiting for a coordinator name that appears late.

How a cluster is stood in for, on 127.0.0.1:
  * hosts: each "node" or "pod" is a process in its own UTS and mount namespace (`unshare`, which
    needs root or user namespaces: the tests that need it are skipped without), with its own host
    name and its own /etc/hosts, a file the test writes, bind-mounted. The resolver is the real one
    (glibc in Python, the same file for gRPC and gloo); a DNS record that "appears" is a line the
    test appends to that file. Nothing in the children is patched.
  * SLURM: the script itself (scripts/slurm/train.sbatch), run by bash with the variables sbatch
    sets, and on PATH a stand-in `srun` (starts one task per node with the variables srun gives
    each task, labels output, forwards SIGTERM, kills the rest when one fails) and a stand-in
    `scontrol` that records its arguments. SLURM's --signal is a SIGTERM the test sends to the tasks.
  * Kubernetes: the Job's container command, args and env read from scripts/k8s/jax3d-job.yaml
    (config, workdir and port swapped for test ones), the index as JAX_PROCESS_ID and
    JOB_COMPLETION_INDEX, KUBERNETES_SERVICE_HOST set as in every pod.

In-process tests drive join.Join with threads and a resolver stand-in (fast); the multi-process
ones are few, small, and bounded by hard timeouts.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import threading
import time

import pytest
import yaml
from test_multihost import SMALL, Run, _env, _free_port, hard_timeout, losses, train_cmd

from jax3d.errors import DistributedError
from jax3d.trainer import cluster, distributed, join, metrics as metrics_lib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SBATCH = os.path.join(ROOT, 'scripts', 'slurm', 'train.sbatch')
K8S_JOB = os.path.join(ROOT, 'scripts', 'k8s', 'jax3d-job.yaml')
# test_multihost's small model, with no periodic checkpoint (a run saves at its end or on SIGTERM).
TINY = [a for a in SMALL if not a.startswith('--config.checkpoint.every=')] + [
  '--config.checkpoint.every=1000'
]


def _lines(run: Run, prefix: str = '') -> list[str]:
  return [l for l in run.text.splitlines() if l.startswith(f'{prefix}error:')]


# ---- the meeting, in process


class Resolver:
  """getaddrinfo for the name `name`, which does not resolve until `appear()`; other names as usual."""

  def __init__(self, name: str):
    self.name, self.there, self.asked = name, threading.Event(), 0

  def appear(self):
    self.there.set()

  def __call__(self, host, port, *a, **kw):
    if host == self.name:
      self.asked += 1
      if not self.there.is_set():
        raise socket.gaierror(socket.EAI_NONAME, 'Name or service not known')
      host = '127.0.0.1'
    return socket.getaddrinfo(host, port, *a, **kw)


def meet(n, port, timeout=5.0, ids=None, problems=None, host='127.0.0.1', resolver=None, nprocs=None):
  """Runs join.Join for processes `ids` (default 0..n-1) in threads; returns {index: (seconds, error
  or None)} and the progress lines."""
  said, out = [], {}
  ids = list(range(n)) if ids is None else ids

  def one(k, pid):
    j = join.Join(f'{host}:{port}', (nprocs or {}).get(k, n), pid, timeout, bind=f'127.0.0.1:{port}')
    j.problem, j.say, j.progress_every = (problems or {}).get(k), said.append, 0.5
    j.getaddrinfo = resolver or socket.getaddrinfo
    t0 = time.monotonic()
    try:
      j.run()
      out[k] = (time.monotonic() - t0, None)
    except DistributedError as e:
      out[k] = (time.monotonic() - t0, str(e))

  threads = [threading.Thread(target=one, args=(k, pid), daemon=True) for k, pid in enumerate(ids)]
  for t in threads:
    t.start()
  return threads, out, said


def finish(threads, limit=30):
  for t in threads:
    t.join(limit)
    assert not t.is_alive(), 'a Join did not return'


@hard_timeout(60)
def test_meeting_waits_for_a_coordinator_name_that_resolves_late():
  res = Resolver('coordinator.test')
  threads, out, said = meet(3, _free_port(), timeout=20, host='coordinator.test', resolver=res)
  time.sleep(2.0)
  assert not out and res.asked > 2  # still asking, inside the loop
  res.appear()
  finish(threads)
  assert all(err is None for _, err in out.values()), out
  assert all(2.0 <= t < 6 for t, _ in out.values()), out
  assert any('process 1: waiting' in l and "'coordinator.test' does not resolve yet" in l for l in said), said
  assert any('process 0: waiting' in l and 'does not resolve on process 0 yet' in l for l in said), said


@hard_timeout(60)
def test_meeting_retries_a_coordinator_that_is_not_listening_yet():
  port = _free_port()
  late = meet(2, port, timeout=20, ids=[1])
  time.sleep(1.5)
  early = meet(2, port, timeout=20, ids=[0])
  finish(late[0] + early[0])
  assert late[1][0][1] is None and early[1][0][1] is None, (late[1], early[1])
  assert any('nothing accepts connections at 127.0.0.1' in l for l in late[2]), late[2]


@hard_timeout(60)
def test_a_peer_that_never_comes_fails_every_process_at_the_timeout():
  threads, out, said = meet(3, _free_port(), timeout=2, ids=[0, 1])
  finish(threads)
  for k in (0, 1):
    t, err = out[k]
    assert err and err.startswith(f'process {k}: the run did not start within --init_timeout=2 s'), out
    assert 'process(es) 2 never joined' in err and '--num_processes=3' in err, err
    assert t < 5, out


@hard_timeout(60)
def test_a_problem_on_one_process_stops_every_process_at_once():
  threads, out, _ = meet(3, _free_port(), timeout=20, problems={2: "this host's name 'x' does not resolve"})
  finish(threads)
  assert out[2][1] == "process 2: this host's name 'x' does not resolve", out
  for k in (0, 1):
    assert (
      out[k][1]
      == f"process {k}: the run cannot start: process 2 (host {socket.gethostname()}): this host's name 'x' does not resolve"
    ), out
  assert all(t < 3 for t, _ in out.values()), out


@hard_timeout(60)
def test_mismatched_process_count_and_duplicate_ids_are_named():
  threads, out, _ = meet(2, _free_port(), timeout=10, nprocs={1: 3})
  finish(threads)
  assert all(
    'process 1 (host' in err and '--num_processes=3, process 0 with 2' in err for _, err in out.values()
  ), out
  threads, out, _ = meet(3, _free_port(), timeout=3, ids=[0, 1, 1])
  finish(threads)
  assert sum('claims --process_id=1, which is taken' in (err or '') for _, err in out.values()) == 3, out


@hard_timeout(60)
def test_port_in_use_fails_process_0_at_once_and_the_others_name_the_stranger():
  with socket.create_server(('127.0.0.1', 0)) as stranger:  # listens, never answers
    port = stranger.getsockname()[1]
    threads, out, _ = meet(2, port, timeout=3)
    finish(threads)
  t0, err0 = out[0]
  assert err0.startswith(f'process 0: the coordinator port {port} is already in use') and t0 < 1, out
  assert 'choose another port (from --coordinator / JAX_COORDINATOR_ADDRESS)' in err0, err0
  t1, err1 = out[1]
  assert 'does not answer like jax3d process 0' in err1 and f'another program holds port {port}' in err1, err1
  assert 3 <= t1 < 7, out


def test_own_host_problem_names_the_host_and_the_fix():
  name = socket.gethostname()

  def fails(*a, **kw):
    raise socket.gaierror(socket.EAI_NONAME, 'Name or service not known')

  def elsewhere(*a, **kw):  # TEST-NET-1: an address no host here has
    return [(socket.AF_INET, socket.SOCK_STREAM, 6, '', ('192.0.2.1', 0))]

  def here(*a, **kw):
    return [(socket.AF_INET, socket.SOCK_STREAM, 6, '', ('127.0.0.1', 0))]

  msg = cluster.own_host_problem(fails)
  assert f"this host's name {name!r} does not resolve (Name or service not known)" in msg
  assert '/etc/hosts' in msg and 'gloo' in msg
  assert '192.0.2.1, no address of this host' in cluster.own_host_problem(elsewhere)
  assert cluster.own_host_problem(here) is None


def test_slurm_layout_reads_the_task_variables():
  base = {
    'SLURM_JOB_ID': '4242',
    'SLURM_NTASKS': '16',
    'SLURM_PROCID': '9',
    'SLURM_LOCALID': '1',
    'SLURM_NODEID': '1',
    'SLURM_STEP_NODELIST': 'gpu-a[007-008],gpu-b1',
    'SLURM_STEP_TASKS_PER_NODE': '1(x2)',
  }
  lay = cluster.slurm_layout(base)
  assert lay.coordinator == f'gpu-a007:{4242 % 4096 + 61440}' and (lay.num_processes, lay.process_id) == (
    16,
    9,
  )
  assert lay.local_device_ids is None  # one task on its node: every GPU
  assert cluster.slurm_layout(dict(base, JAX_COORDINATOR_PORT='1234')).coordinator == 'gpu-a007:1234'
  assert cluster.slurm_layout(dict(base, SLURM_STEP_NODELIST='n1,n2')).coordinator.startswith('n1:')
  assert cluster.slurm_layout({k: v for k, v in base.items() if 'NODELIST' not in k}).coordinator is None

  def devices(**kw):
    return cluster.slurm_layout(dict(base, **kw)).local_device_ids

  eight = dict(SLURM_GPUS_ON_NODE='8', CUDA_VISIBLE_DEVICES='0,1,2,3,4,5,6,7')
  assert devices(SLURM_STEP_TASKS_PER_NODE='8(x2)', **eight) == [1]  # one task per GPU
  assert devices(SLURM_STEP_TASKS_PER_NODE='2(x8)', **eight) == [4, 5, 6, 7]  # two tasks x 4 GPUs
  assert devices(SLURM_STEP_TASKS_PER_NODE='1,8', SLURM_GPUS_ON_NODE='8') == [1]  # this is node 1
  assert devices(SLURM_STEP_TASKS_PER_NODE='8(x2)', SLURM_GPUS_ON_NODE='8', CUDA_VISIBLE_DEVICES='5') is None
  assert devices(SLURM_STEP_TASKS_PER_NODE='8(x2)') == [1]  # GPUs unknown: JAX's rule
  assert devices(SLURM_STEP_TASKS_PER_NODE='8(x2)', JAX_LOCAL_DEVICE_IDS='0,1', **eight) is None
  with pytest.raises(ValueError, match='3 tasks on a node with 8 GPUs'):
    devices(SLURM_STEP_TASKS_PER_NODE='3(x2)', **eight)


def test_resolve_under_slurm_gives_the_whole_layout(monkeypatch):
  for k in list(os.environ):
    if k.startswith(('JAX_COORDINATOR', 'JAX_NUM_PROCESSES', 'JAX_PROCESS_ID', 'SLURM_', 'OMPI_', 'JAX3D_')):
      monkeypatch.delenv(k)
  for k, v in dict(
    SLURM_JOB_ID='7', SLURM_NTASKS='2', SLURM_PROCID='1', SLURM_LOCALID='0', SLURM_STEP_NODELIST='node[1-2]'
  ).items():
    monkeypatch.setenv(k, v)
  inf = distributed.resolve(dict(distributed.FLAGS))
  assert (inf.multi, inf.how, inf.coordinator, inf.num_processes, inf.process_id) == (
    True,
    'SLURM',
    f'node1:{7 + 61440}',
    2,
    1,
  )
  assert 'SLURM_STEP_NODELIST' in distributed.how_hint(inf)
  inf = distributed.resolve(dict(distributed.FLAGS, coordinator='head:99'))  # a flag wins
  assert (inf.coordinator, inf.process_id, inf.how) == ('head:99', 1, 'explicit')


def test_the_recipes_as_written():
  docs = list(yaml.safe_load_all(open(K8S_JOB)))
  svc = next(d for d in docs if d['kind'] == 'Service')
  assert svc['spec']['publishNotReadyAddresses'] is True  # pod 0's DNS record before it is ready
  text = open(SBATCH).read()
  assert 'export JAX_LOCAL_DEVICE_IDS' not in text  # derived per task from the allocation
  assert 'scontrol requeue "$SLURM_JOB_ID"' in text


# ---- namespaces: each host its own name and /etc/hosts


def _namespaces_work() -> bool:
  if not hasattr(_namespaces_work, 'ok'):
    try:
      r = subprocess.run(
        ['unshare', '--mount', '--uts', 'sh', '-c', 'mount --bind /etc/hosts /etc/hosts && hostname ns-test'],
        capture_output=True,
        timeout=20,
      )
      _namespaces_work.ok = r.returncode == 0
    except (OSError, subprocess.TimeoutExpired):
      _namespaces_work.ok = False
  return _namespaces_work.ok


@pytest.fixture
def namespaces():
  """Skips the test where a process cannot get its own host name and /etc/hosts."""
  if not _namespaces_work():
    pytest.skip('needs unshare --mount --uts (root or user namespaces)')


def as_host(name: str, hosts_file: str, cmd: list[str]) -> list[str]:
  """`cmd` on a host called `name` whose /etc/hosts is `hosts_file` (edited in place, it stays seen)."""
  script = 'mount --bind "$1" /etc/hosts && hostname "$2" && shift 2 && exec "$@"'
  return ['unshare', '--mount', '--uts', 'sh', '-c', script, 'sh', hosts_file, name, *cmd]


def train(workdir, *args, steps=6):
  """test_multihost's command, with no periodic checkpoint."""
  return train_cmd(workdir, '--config.checkpoint.every=1000', *args, steps=steps)


def four_devices(**extra):
  return _env(XLA_FLAGS='--xla_force_host_platform_device_count=4', **extra)


def stopped(run: Run, timeout: float) -> tuple[int, float]:
  try:
    rc = run.wait(timeout)
  finally:
    run.kill()
  return rc, time.time() - run.t0


# ---- each start failure: exit 3, one line, in bounded time


@pytest.mark.multiprocess
@hard_timeout(120)
def test_a_host_whose_own_name_does_not_resolve_stops_every_process_with_exit_3(tmp_path, namespaces):
  port = _free_port()
  hosts = tmp_path / 'hosts'
  hosts.write_text('127.0.0.1 localhost\n')  # no line for the hosts' own names
  runs = []
  for i in range(2):
    env = four_devices(
      JAX_COORDINATOR_ADDRESS=f'localhost:{port}', JAX_NUM_PROCESSES='2', JAX_PROCESS_ID=str(i)
    )
    cmd = train(tmp_path / 'w', '--init_timeout=60')
    runs.append(Run(as_host(f'nameless-{i}', str(hosts), cmd) if i == 1 else cmd, env))
  for i, run in enumerate(runs):
    rc, took = stopped(run, 90)
    err = _lines(run)
    assert rc == 3 and len(err) == 1 and took < 40, (rc, took, run.text[-3000:])
    assert "this host's name 'nameless-1' does not resolve" in err[0] and '/etc/hosts' in err[0], err
    assert err[0].startswith(
      f'error: process {i}: ' + ('the run cannot start: process 1' if i == 0 else 'this')
    ), err
    assert 'Traceback' not in run.text, run.text[-3000:]


@pytest.mark.multiprocess
@hard_timeout(120)
def test_a_peer_that_never_comes_exits_3_within_the_timeout(tmp_path):
  env = four_devices(
    JAX_COORDINATOR_ADDRESS=f'127.0.0.1:{_free_port()}', JAX_NUM_PROCESSES='2', JAX_PROCESS_ID='0'
  )
  run = Run(train(tmp_path / 'w', '--init_timeout=4'), env)
  rc, took = stopped(run, 90)
  err = _lines(run)
  assert rc == 3 and len(err) == 1 and took < 30, (rc, took, run.text[-3000:])
  assert 'process 0: the run did not start within --init_timeout=4 s: process(es) 1 never joined' in err[0], (
    err
  )
  assert '--num_processes=2' in err[0], err


@pytest.mark.multiprocess
@hard_timeout(120)
def test_port_in_use_and_a_name_that_never_resolves_exit_3(tmp_path):
  with socket.create_server(('127.0.0.1', 0)) as stranger:
    port = stranger.getsockname()[1]
    addr = dict(JAX_NUM_PROCESSES='2', JAX_COORDINATOR_BIND_ADDRESS=f'127.0.0.1:{port}')
    lead = Run(
      train(tmp_path / 'a', '--init_timeout=4'),
      four_devices(JAX_COORDINATOR_ADDRESS=f'127.0.0.1:{port}', JAX_PROCESS_ID='0', **addr),
    )
    peer = Run(
      train(tmp_path / 'b', '--init_timeout=4'),
      four_devices(JAX_COORDINATOR_ADDRESS=f'127.0.0.1:{port}', JAX_PROCESS_ID='1', **addr),
    )
    nodns = Run(
      train(tmp_path / 'c', '--init_timeout=4'),
      four_devices(JAX_COORDINATOR_ADDRESS='no-such-host.invalid:1234', JAX_PROCESS_ID='1', **addr),
    )
    results = [(run, *stopped(run, 90)) for run in (lead, peer, nodns)]
  for run, rc, took in results:
    assert rc == 3 and len(_lines(run)) == 1 and took < 30, (rc, took, run.text[-3000:])
  assert f'process 0: the coordinator port {port} is already in use' in _lines(lead)[0], lead.text[-2000:]
  assert f'another program holds port {port} there: choose another port' in _lines(peer)[0], peer.text[-2000:]
  err = _lines(nodns)[0]
  assert (
    "the coordinator name 'no-such-host.invalid' does not resolve yet" in err and '--init_timeout=4 s' in err
  ), err


# ---- SLURM: the script, a SIGTERM, the requeue, the exact resume

SRUN = '''#!{python}
"""Stand-in for srun (tests/test_launch.py): one task per node of COMMAND, with srun's variables."""
import os, signal, subprocess, sys, threading
args = sys.argv[1:]
label = '--label' in args
while args and args[0].startswith('-'):
  args.pop(0)  # --kill-on-bad-exit=1 (done below), --label
env, d = os.environ, os.environ['FAKE_SLURM_DIR']
n, nodes = int(env['SLURM_NTASKS']), env['FAKE_SLURM_NODES'].split(',')
procs = []
for i in range(n):
  task = dict(env, SLURM_PROCID=str(i), SLURM_LOCALID='0', SLURM_NODEID=str(i), SLURM_STEP_ID='0',
              SLURM_STEP_NODELIST=env['SLURM_JOB_NODELIST'], SLURM_STEP_NUM_NODES=str(n),
              SLURM_STEP_NUM_TASKS=str(n), SLURM_STEP_TASKS_PER_NODE=env['SLURM_TASKS_PER_NODE'],
              SLURMD_NODENAME=nodes[i])
  wrap = []
  if env.get('FAKE_SLURM_NS') == '1':
    wrap = ['unshare', '--mount', '--uts', 'sh', '-c',
            'mount --bind "$1" /etc/hosts && hostname "$2" && shift 2 && exec "$@"', 'sh',
            os.path.join(d, 'hosts'), nodes[i]]
  procs.append(subprocess.Popen(wrap + args, env=task, stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
with open(os.path.join(d, 'tasks'), 'a') as f:
  f.write(' '.join(str(p.pid) for p in procs) + '\\n')
lock = threading.Lock()
def forward(i, p):
  for raw in iter(p.stdout.readline, b''):
    with lock:
      sys.stdout.write((f'{{i}}: ' if label else '') + raw.decode(errors='replace'))
      sys.stdout.flush()
threads = [threading.Thread(target=forward, args=(i, p)) for i, p in enumerate(procs)]
for t in threads:
  t.start()
def pass_on(signum, frame):
  for p in procs:
    if p.poll() is None:
      p.send_signal(signum)
signal.signal(signal.SIGTERM, pass_on)
signal.signal(signal.SIGINT, pass_on)
status = 0
while any(p.poll() is None for p in procs):
  for p in procs:
    if p.poll() not in (None, 0) and not status:
      status = p.returncode if p.returncode > 0 else 128 - p.returncode
      for q in procs:  # --kill-on-bad-exit=1
        if q.poll() is None:
          q.kill()
  threading.Event().wait(0.1)
for t in threads:
  t.join()
status = status or next((p.returncode if p.returncode > 0 else 128 - p.returncode for p in procs if p.returncode), 0)
sys.exit(status)
'''

SCONTROL = """#!/bin/sh
# Stand-in for scontrol (tests/test_launch.py): records its arguments.
echo "$@" >> "$FAKE_SLURM_DIR/scontrol.log"
"""


# Stand-in for srun whose run is only its outcome: it appends $FAKE_RECORD (a metrics.jsonl line)
# to WORKDIR/metrics.jsonl, as the trainer would, and exits with $FAKE_STATUS.
SRUN_OUTCOME = """#!/bin/sh
mkdir -p "$WORKDIR"
[ -z "$FAKE_RECORD" ] || echo "$FAKE_RECORD" >> "$WORKDIR/metrics.jsonl"
exit "$FAKE_STATUS"
"""


class FakeSlurm:
  """A two-node SLURM allocation on this machine: what sbatch sets, srun and scontrol stand-ins
  (`srun`: the text of the srun stand-in; default SRUN, which runs the command)."""

  def __init__(self, tmp_path, job_id='4242', srun=None):
    self.dir = tmp_path / 'slurm'
    (self.dir / 'bin').mkdir(parents=True)
    srun = SRUN.format(python=sys.executable) if srun is None else srun
    for name, text in (('srun', srun), ('scontrol', SCONTROL)):
      (self.dir / 'bin' / name).write_text(text)
      (self.dir / 'bin' / name).chmod(0o755)
    ns = _namespaces_work()
    self.nodes = ['node1', 'node2'] if ns else ['localhost', 'localhost']
    (self.dir / 'hosts').write_text('127.0.0.1 localhost\n127.0.0.1 node1 node2\n')
    self.job_id, self.port = job_id, _free_port()
    self.env = four_devices(
      PATH=f'{self.dir / "bin"}:{os.environ["PATH"]}',
      FAKE_SLURM_DIR=str(self.dir),
      FAKE_SLURM_NODES=','.join(self.nodes),
      FAKE_SLURM_NS='1' if ns else '0',
      SLURM_JOB_ID=job_id,
      SLURM_JOB_NAME='jax3d',
      SLURM_NNODES='2',
      SLURM_JOB_NUM_NODES='2',
      SLURM_NTASKS='2',
      SLURM_NPROCS='2',
      SLURM_TASKS_PER_NODE='1(x2)',
      SLURM_JOB_NODELIST='node[1-2]' if ns else 'localhost,localhost',
      SLURM_SUBMIT_DIR=ROOT,
      JAX_COORDINATOR_PORT=str(self.port),  # JAX's default, from the job id, may be taken here
      CONFIG='configs/tiny.py',
    )

  def sbatch(self, workdir, *args, restart=0, **env) -> Run:
    env = dict(
      self.env, WORKDIR=str(workdir), **({'SLURM_RESTART_COUNT': str(restart)} if restart else {}), **env
    )
    return Run(['bash', SBATCH, *args], env)

  def tasks(self) -> list[int]:
    return [int(x) for x in (self.dir / 'tasks').read_text().splitlines()[-1].split()]

  def scontrol_calls(self) -> list[str]:
    log = self.dir / 'scontrol.log'
    return log.read_text().splitlines() if log.exists() else []


# Long enough that SIGTERM lands mid-run however late the reader sees step 2 on a loaded machine
# (the preemption sync point is a step or two after the signal; at 8 steps it once fell on the last).
STEPS = 30


def test_slurm_script_requeues_only_a_run_that_saved_on_sigterm(tmp_path):
  """The script after each outcome of the run (srun stood in for by the outcome alone: its exit
  status and the record it appended to metrics.jsonl): only exit 0 with a `preempted` record of
  this start calls `scontrol requeue`; a failed run ends the job with its status, not requeued,
  even when it had written a `preempted` record first."""
  slurm = FakeSlurm(tmp_path, srun=SRUN_OUTCOME)
  scratch = metrics_lib.MetricsWriter(str(tmp_path / 'records'))  # the trainer's own record lines
  scratch.write({'step': 3, 'event': 'preempted', 'checkpoint': 'w/checkpoints/3'})
  scratch.write({'step': 8, 'loss': 2.5})  # the last step's
  scratch.close()
  preempted, last = open(scratch.path).read().splitlines()
  assert '"preempted"' in preempted and 'preempted' not in last
  requeue = f'requeueing job {slurm.job_id} to resume'
  cases = [  # (exit status of the run, its record, REQUEUE, a preempted record of an earlier start)
    (3, preempted, '1', False),
    (2, '', '1', False),
    (0, last, '1', False),
    (0, last, '1', True),
    (0, preempted, '0', False),
    (0, preempted, '1', False),
  ]
  for i, (status, record, requeue_on, earlier) in enumerate(cases):
    wd = tmp_path / f'w{i}'
    if earlier:
      wd.mkdir()
      (wd / 'metrics.jsonl').write_text(preempted + '\n')
    before = len(slurm.scontrol_calls())
    run = slurm.sbatch(wd, FAKE_STATUS=str(status), FAKE_RECORD=record, REQUEUE=requeue_on)
    rc, _ = stopped(run, 30)
    calls, out = slurm.scontrol_calls()[before:], run.text
    assert rc == status, (i, out)
    if status:
      assert f'the run failed (exit status {status}); not requeued' in out and requeue not in out, (i, out)
    if status == 0 and record == preempted and requeue_on == '1':
      assert calls == [f'requeue {slurm.job_id}'] and requeue in out, (i, calls, out)
    else:
      assert calls == [] and requeue not in out, (i, calls, out)
    if status == 0 and record == preempted and requeue_on == '0':
      assert 'stopped on SIGTERM after saving a checkpoint: submit the same command again' in out, out


@pytest.mark.slow
@pytest.mark.multiprocess
@hard_timeout(600)
def test_slurm_script_requeues_a_job_stopped_by_sigterm_and_the_rerun_resumes_exactly(tmp_path):
  slurm = FakeSlurm(tmp_path)
  args = [*TINY, f'--config.train.steps={STEPS}']
  # Uninterrupted: trains to the end, nothing requeued.
  ref = slurm.sbatch(tmp_path / 'ref', *args)
  rc, _ = stopped(ref, 240)
  assert rc == 0, ref.text[-4000:]
  assert slurm.scontrol_calls() == []
  assert re.search(rf'^0: step +{STEPS}/{STEPS}', ref.text, re.M) and 'requeueing' not in ref.text, ref.text[
    -3000:
  ]
  # SIGTERM to every task (SLURM's --signal=TERM@120): all save the same step, exit 0, requeued.
  wd = tmp_path / 'w'
  run = slurm.sbatch(wd, *args)
  try:
    run.wait_for(r'^0: step +2/', 240)
    for pid in slurm.tasks():
      os.kill(pid, 15)
    rc, _ = stopped(run, 120)
  finally:
    run.kill()
  out = run.text
  assert rc == 0, out[-4000:]
  step = int(re.search(r'^0: SIGTERM: saved step (\d+)', out, re.M).group(1))
  assert re.search(rf'^1: process 1: preempted, saved step {step}$', out, re.M), out[-4000:]
  assert 2 <= step < STEPS, out[-3000:]
  assert slurm.scontrol_calls() == [f'requeue {slurm.job_id}'], out[-3000:]
  assert f'requeueing job {slurm.job_id} to resume' in out
  # SLURM starts the job again (same id, SLURM_RESTART_COUNT=1): it resumes and finishes.
  again = slurm.sbatch(wd, *args, restart=1)
  rc, _ = stopped(again, 240)
  assert rc == 0, again.text[-4000:]
  assert re.search(rf'^0: .*resumed from .*/{step}\b', again.text, re.M), again.text[-4000:]
  assert slurm.scontrol_calls() == [f'requeue {slurm.job_id}']  # the end is not requeued
  got, want = losses(wd), losses(tmp_path / 'ref')
  assert sorted(got) == sorted(want) == list(range(1, STEPS + 1)), (sorted(got), sorted(want))
  assert got == want  # bit for bit: the interrupted and requeued run is the uninterrupted one


# ---- Kubernetes: the Job's environment, a coordinator name that appears late


@pytest.mark.slow
@pytest.mark.multiprocess
@hard_timeout(400)
def test_kubernetes_job_waits_for_a_coordinator_name_that_appears_late(tmp_path, namespaces):
  docs = list(yaml.safe_load_all(open(K8S_JOB)))
  svc = next(d for d in docs if d['kind'] == 'Service')
  job = next(d for d in docs if d['kind'] == 'Job')
  assert svc['spec']['publishNotReadyAddresses'] is True
  spec, pod = job['spec'], job['spec']['template']['spec']
  box = pod['containers'][0]
  n = spec['completions']
  assert spec['parallelism'] == n == 2
  env = {e['name']: e['value'] for e in box['env'] if 'value' in e}
  assert [e['name'] for e in box['env'] if 'valueFrom' in e] == ['JAX_PROCESS_ID']
  host, _ = env['JAX_COORDINATOR_ADDRESS'].rsplit(':', 1)
  assert host == f'{job["metadata"]["name"]}-0.{pod["subdomain"]}' and int(env['JAX_NUM_PROCESSES']) == n
  env['JAX_COORDINATOR_ADDRESS'] = f'{host}:{_free_port()}'  # the Job's port may be taken here
  args = [a for a in box['args'] if not a.startswith(('--config=', '--workdir='))]
  cmd = [sys.executable if box['command'][0] == 'python' else box['command'][0], *box['command'][1:]]
  cmd += [*args, '--config=configs/tiny.py', f'--workdir={tmp_path / "w"}', *TINY, '--config.train.steps=6']
  pods, hosts = [], []
  for i in range(n):
    name = f'{job["metadata"]["name"]}-{i}'  # an Indexed Job's pod host name
    hosts.append(tmp_path / f'hosts-{i}')
    hosts[i].write_text(f'127.0.0.1 localhost\n127.0.0.1 {name}\n')  # kubelet writes the pod's own name
    pod_env = dict(four_devices(JOB_COMPLETION_INDEX=str(i), KUBERNETES_SERVICE_HOST='10.96.0.1'), **env)
    pod_env['JAX_PROCESS_ID'] = str(i)  # the Job's fieldRef: the pod's completion index
    pods.append(Run(as_host(name, str(hosts[i]), cmd), pod_env))
  try:
    # Both pods wait, and say so, while the name does not resolve; then its record appears.
    t_wait = pods[1].wait_for(
      rf"waiting for the run to start .*'{re.escape(host)}' does not resolve yet", 120
    )
    pods[0].wait_for(rf"'{re.escape(host)}' does not resolve on process 0 yet", 60)
    for h in hosts:
      with open(h, 'a') as f:
        f.write(f'127.0.0.1 {host}\n')
    t_dns = time.time()
    results = [stopped(p, 240) for p in pods]
  finally:
    for p in pods:
      p.kill()
  for p, (rc, _) in zip(pods, results, strict=True):
    assert rc == 0, p.text[-4000:]
    assert 'error:' not in p.text and 'Traceback' not in p.text, p.text[-4000:]
    assert 'kubernetes` package' not in p.text and 'jax[k8s]' not in p.text, p.text[-3000:]  # JAX's probe
  assert t_dns > t_wait
  assert re.search(r'^step +6/6', pods[0].text, re.M), pods[0].text[-3000:]
