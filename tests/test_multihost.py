"""Several JAX processes on 127.0.0.1 (gloo CPU collectives), started by scripts/launch_local.py:
the same losses as one process, checkpoints that move between 1 and 2 processes, SIGTERM on one
process (all save the same step, exit 0, exact resume), a lost peer (SIGKILL: the others stop,
non-zero, in bounded time), an unreachable coordinator, tp across hosts refused.

Every test has a hard timeout (SIGALRM, and a timeout on every child process), so nothing hangs.
"""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAUNCH = os.path.join(ROOT, 'scripts', 'launch_local.py')
N_STEPS = 12  # long enough that a SIGTERM's sync point lands before the last step on a loaded machine
HALF = N_STEPS // 2
SMALL = [
  '--config.model.d_model=64',
  '--config.model.d_ff=128',
  '--config.train.seq_len=32',
  '--config.train.global_batch_size=16',
  '--config.eval.batches=1',
  '--config.eval.every=0',
  '--config.log.every=1',
  '--config.log.progress=False',
  '--config.sample.tokens=1',
  f'--config.checkpoint.every={HALF}',
  '--config.checkpoint.async_save=False',
]
MP = ['--init_timeout=60', '--heartbeat_timeout=10']

pytestmark = pytest.mark.multiprocess


def hard_timeout(seconds: int):
  """Fails the test (instead of hanging) after `seconds`."""

  def deco(fn):
    @functools.wraps(fn)
    def wrapper(*a, **kw):
      def boom(signum, frame):
        raise TimeoutError(f'{fn.__name__} exceeded its hard timeout of {seconds} s')

      old = signal.signal(signal.SIGALRM, boom)
      signal.alarm(seconds)
      try:
        return fn(*a, **kw)
      finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)

    return wrapper

  return deco


def _env(**extra):
  env = {
    k: v
    for k, v in os.environ.items()
    if not k.startswith(('JAX_COORDINATOR', 'JAX_NUM_PROCESSES', 'JAX_PROCESS_ID', 'SLURM_', 'OMPI_'))
  }
  env.update(JAX_PLATFORMS='cpu', PYTHONUNBUFFERED='1', **extra)
  return env


def train_cmd(workdir, *args, steps=N_STEPS):
  return [
    sys.executable,
    '-m',
    'jax3d.train',
    f'--workdir={workdir}',
    *SMALL,
    f'--config.train.steps={steps}',
    *args,
  ]


class Run:
  """A child process whose merged output is collected, line by line with arrival times, by a thread."""

  def __init__(self, cmd, env):
    self.t0 = time.time()
    self.p = subprocess.Popen(
      cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
    )
    self.lines: list[tuple[float, str]] = []
    self.thread = threading.Thread(target=self._read, daemon=True)
    self.thread.start()

  def _read(self):
    for raw in iter(self.p.stdout.readline, b''):
      self.lines.append((time.time(), raw.decode(errors='replace').rstrip('\n')))

  @property
  def text(self) -> str:
    return '\n'.join(l for _, l in self.lines)

  def wait_for(self, pattern: str, timeout: float) -> float:
    deadline = time.time() + timeout
    while time.time() < deadline:
      for t, l in list(self.lines):
        if re.search(pattern, l):
          return t
      if self.p.poll() is not None:
        self.thread.join(timeout=5)
        if any(re.search(pattern, l) for _, l in self.lines):
          return time.time()
        raise AssertionError(f'exited ({self.p.returncode}) before {pattern!r}:\n{self.text[-4000:]}')
      time.sleep(0.1)
    raise AssertionError(f'no {pattern!r} within {timeout} s:\n{self.text[-4000:]}')

  def wait(self, timeout: float) -> int:
    try:
      rc = self.p.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
      self.kill()
      raise AssertionError(f'still running after {timeout} s:\n{self.text[-4000:]}') from None
    self.thread.join(timeout=10)
    return rc

  def kill(self):
    if self.p.poll() is None:
      try:
        os.killpg(self.p.pid, signal.SIGKILL)
      except ProcessLookupError:
        pass
    self.p.wait(timeout=10)

  def child_pid(self, i: int) -> int:
    for _, l in self.lines:
      m = re.search(rf'started process {i} \(pid (\d+)\)', l)
      if m:
        return int(m.group(1))
    raise AssertionError(f'no pid for process {i}:\n{self.text}')


def launch(n, cmd, grace=30):
  return Run(
    [
      sys.executable,
      LAUNCH,
      '-n',
      str(n),
      '--devices-per-process',
      str(8 // n),
      f'--grace={grace}',
      '--',
      *cmd,
      *MP,
    ],
    _env(),
  )


def single(cmd):
  return Run(cmd, _env(XLA_FLAGS='--xla_force_host_platform_device_count=8'))


def finish(run: Run, timeout=240) -> str:
  try:
    rc = run.wait(timeout)
  finally:
    run.kill()
  assert rc == 0, f'exit status {rc}:\n{run.text[-6000:]}'
  return run.text


def losses(workdir) -> dict[int, float]:
  out = {}
  with open(os.path.join(workdir, 'metrics.jsonl')) as f:
    for line in f:
      r = json.loads(line)
      if 'loss' in r and 'event' not in r:
        out[r['step']] = r['loss']
  return out


def ckpt_steps(workdir) -> list[int]:
  d = os.path.join(workdir, 'checkpoints')
  return sorted(int(x) for x in os.listdir(d) if x.isdigit()) if os.path.isdir(d) else []


def assert_close(got: dict, want: dict, steps):
  for s in steps:
    assert s in got and s in want, (s, sorted(got), sorted(want))
    np.testing.assert_allclose(got[s], want[s], rtol=1e-5, err_msg=f'step {s}')


@pytest.fixture(scope='module')
def reference(tmp_path_factory):
  """1 process x 8 devices, layout (2,2,2), N_STEPS steps, checkpoints at HALF and N_STEPS."""
  wd = str(tmp_path_factory.mktemp('ref') / 'w')
  finish(single(train_cmd(wd)))
  assert ckpt_steps(wd) == [HALF, N_STEPS]
  return wd


@pytest.fixture(scope='module')
def two_proc(tmp_path_factory):
  """The same run as 2 processes x 4 devices."""
  wd = str(tmp_path_factory.mktemp('two') / 'w')
  out = finish(launch(2, train_cmd(wd)))
  return wd, out


@pytest.mark.slow
@hard_timeout(420)
def test_two_processes_match_one_process(reference, two_proc):
  wd, out = two_proc
  assert_close(losses(wd), losses(reference), range(1, N_STEPS + 1))
  assert ckpt_steps(wd) == [HALF, N_STEPS]
  # Process 0 alone prints the summary and the placement: tp inside a host, dp across hosts.
  assert '[p0] jax3d: 8 cpu devices' in out and '[p1] jax3d:' not in out
  assert not re.search(r'^\[p1\] step ', out, re.M)
  place = re.findall(r'^\[p0\]\s+\(dp=(\d), pp=(\d), tp=(\d)\) -> host \S+ process (\d)', out, re.M)
  assert len(place) == 8, out
  for dp, _pp, _tp, proc in place:
    assert int(proc) == int(dp), place  # dp outermost = one host per dp index here
  # The launcher reports every process.
  assert 'process 0 (pid' in out and 'process 1 (pid' in out


@pytest.mark.slow
@hard_timeout(300)
def test_checkpoint_from_two_processes_resumes_in_one(reference, two_proc, tmp_path):
  wd = str(tmp_path / 'w')
  shutil.copytree(two_proc[0], wd)
  shutil.rmtree(os.path.join(wd, 'checkpoints', str(N_STEPS)))  # resume from the step-HALF checkpoint
  out = finish(single(train_cmd(wd)))
  assert 'resumed from' in out and f'/{HALF} ' in out, out
  assert_close(losses(wd), losses(reference), range(HALF + 1, N_STEPS + 1))


@pytest.mark.slow
@hard_timeout(300)
def test_checkpoint_from_one_process_resumes_in_two(reference, tmp_path):
  wd = str(tmp_path / 'w')
  shutil.copytree(reference, wd)
  shutil.rmtree(os.path.join(wd, 'checkpoints', str(N_STEPS)))
  out = finish(launch(2, train_cmd(wd)))
  assert 'resumed from' in out, out
  assert_close(losses(wd), losses(reference), range(HALF + 1, N_STEPS + 1))


@pytest.mark.slow
@hard_timeout(400)
def test_sigterm_on_one_process_saves_the_same_step_everywhere_and_resumes_exactly(reference, tmp_path):
  wd = str(tmp_path / 'w')
  run = launch(2, train_cmd(wd, '--config.checkpoint.every=1000'))
  try:
    run.wait_for(r'^\[p0\] step +2/', 240)
    os.kill(run.child_pid(1), signal.SIGTERM)
    rc = run.wait(120)
  finally:
    run.kill()
  out = run.text
  assert rc == 0, out[-6000:]
  m0 = re.search(r'^\[p0\] SIGTERM: saved step (\d+)', out, re.M)
  m1 = re.search(r'^\[p1\] process 1: preempted, saved step (\d+)', out, re.M)
  assert m0 and m1, out[-6000:]
  step = int(m0.group(1))
  assert int(m1.group(1)) == step and 2 <= step < N_STEPS, out[-6000:]
  assert re.search(r'process 0 \(pid \d+\) finished \(status 0\)', out)
  assert re.search(r'process 1 \(pid \d+\) finished \(status 0\)', out)
  assert ckpt_steps(wd) == [step]
  ref = losses(reference)
  assert_close(losses(wd), ref, range(1, step + 1))  # and the first losses equal 1 process x 8 devices
  # Resume (in one process, with the same command otherwise): exactly the uninterrupted run.
  out = finish(single(train_cmd(wd)))
  assert f'/{step} ' in out and 'resumed from' in out, out
  assert_close(losses(wd), ref, range(step + 1, N_STEPS + 1))


@pytest.mark.slow
@hard_timeout(300)
def test_sigkill_of_one_process_stops_the_others(tmp_path):
  wd = str(tmp_path / 'w')
  run = launch(2, train_cmd(wd, steps=10_000), grace=40)
  try:
    run.wait_for(r'^\[p0\] step +2/', 240)
    victim = run.child_pid(1)
    t_kill = time.time()
    os.kill(victim, signal.SIGKILL)
    t_end = run.wait_for(r'process 0 \(pid \d+\) (exited with status [1-9]|killed by)', 60)
    rc = run.wait(60)
  finally:
    run.kill()
  out = run.text
  assert rc != 0
  assert re.search(r'launch_local: process 1 \(pid \d+\) killed by SIGKILL', out), out[-4000:]
  assert 'launch_local: failed: process 1 killed by SIGKILL' in out, out[-4000:]
  assert t_end - t_kill < 30, (t_end - t_kill, out[-4000:])  # the peer noticed by itself (heartbeat 10 s)
  assert 'killing process 0' not in out, out[-4000:]


def _free_port():
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    return s.getsockname()[1]


@hard_timeout(120)
def test_unreachable_coordinator_fails_within_the_bound(tmp_path):
  port = _free_port()
  t0 = time.time()
  run = single(
    [
      sys.executable,
      '-m',
      'jax3d.train',
      f'--workdir={tmp_path}/w',
      *SMALL,
      f'--coordinator=127.0.0.1:{port}',
      '--num_processes=2',
      '--process_id=1',
      '--init_timeout=5',
    ]
  )
  rc = run.wait(90)
  took = time.time() - t0
  err = [l for l in run.text.splitlines() if l.startswith('error:')]
  assert rc == 3, run.text[-3000:]
  assert len(err) == 1 and f'127.0.0.1:{port}' in err[0] and '5 s' in err[0], run.text[-3000:]
  assert took < 60, took


@hard_timeout(120)
def test_bad_distributed_flags_exit_2(tmp_path):
  run = single(
    [
      sys.executable,
      '-m',
      'jax3d.train',
      f'--workdir={tmp_path}/w',
      '--num_processes=2',
      '--process_id=5',
      '--coordinator=127.0.0.1:1234',
    ]
  )
  assert run.wait(90) == 2
  assert 'process_id=5' in run.text, run.text


@hard_timeout(180)
def test_tp_across_hosts_is_refused(tmp_path):
  cmd = train_cmd(
    str(tmp_path / 'w'),
    '--config.mesh.dp=1',
    '--config.mesh.pp=1',
    '--config.mesh.tp=8',
    '--config.model.n_heads=8',
    '--config.model.n_kv_heads=8',
  )
  run = launch(2, cmd)
  rc = run.wait(150)
  out = run.text
  assert rc == 2, out[-4000:]
  err = [l for l in out.splitlines() if l.startswith('[p0] error:')]
  assert len(err) == 1 and 'mesh.tp=8 would span hosts' in err[0] and 'allow_tp_across_hosts' in err[0], out


def test_resolve_reads_flags_environment_and_launchers(monkeypatch):
  from jax3d.trainer import distributed

  for k in list(os.environ):
    if k.startswith(('JAX_COORDINATOR', 'JAX_NUM_PROCESSES', 'JAX_PROCESS_ID', 'SLURM_', 'OMPI_', 'JAX3D_')):
      monkeypatch.delenv(k)
  flags = dict(distributed.FLAGS)
  assert not distributed.resolve(flags).multi
  inf = distributed.resolve(
    dict(flags, coordinator='h:1', num_processes='2', process_id='1', init_timeout='7')
  )
  assert (inf.multi, inf.how, inf.num_processes, inf.process_id, inf.init_timeout) == (
    True,
    'explicit',
    2,
    1,
    7,
  )
  monkeypatch.setenv('JAX_COORDINATOR_ADDRESS', 'h:2')
  monkeypatch.setenv('JAX_NUM_PROCESSES', '4')
  monkeypatch.setenv('JAX_PROCESS_ID', '0')
  inf = distributed.resolve(flags)
  assert (inf.coordinator, inf.num_processes, inf.process_id) == ('h:2', 4, 0)
  assert not distributed.resolve(dict(flags, distributed='off')).multi
  assert not distributed.resolve(dict(flags, num_processes='1')).multi
  for k in ('JAX_COORDINATOR_ADDRESS', 'JAX_NUM_PROCESSES', 'JAX_PROCESS_ID'):
    monkeypatch.delenv(k)
  with pytest.raises(ValueError, match='--num_processes'):
    distributed.resolve(dict(flags, coordinator='h:1'))
  with pytest.raises(ValueError, match='HOST:PORT'):
    distributed.resolve(dict(flags, coordinator='h', num_processes='2', process_id='0'))
  monkeypatch.setenv('SLURM_NTASKS', '2')
  monkeypatch.setenv('SLURM_PROCID', '1')
  inf = distributed.resolve(flags)
  assert inf.multi and inf.how == 'SLURM'
  monkeypatch.setenv('SLURM_NTASKS', '1')
  assert not distributed.resolve(flags).multi
