"""Fault drills (issue 16): each injects one fault and checks what is lost (nothing): the checkpoints
on disk stay intact and resumable, resume is exact where it says so, and the command exits with an
`error:` line and status 3 for a failed run, or 0 after a SIGTERM that saved."""

import errno
import os
import re
import shutil
import signal
import time

import chex
import numpy as np
import orbax.checkpoint as ocp
import pytest
import test_multihost
from test_checkpoint import cfg_for, cli, losses, read_ckpt

from jax3d.trainer import checkpoint as ckpt_lib, lock as lock_lib
from jax3d.trainer.trainer import Trainer


def steps_on_disk(workdir):
  d = os.path.join(workdir, 'checkpoints')
  return sorted(int(s) for s in os.listdir(d) if s.isdigit()) if os.path.isdir(d) else []


# ---------------------------------------------------------------------------------------- 1. two runs
@pytest.mark.slow
def test_second_run_on_the_same_workdir_is_refused(tmp_path):
  """A run holds WORKDIR/.lock; a second `python -m jax3d.train` there exits 3 naming the workdir
  and the holder, before compiling; the first trains and saves as if alone, then frees the lock."""
  w = str(tmp_path)
  first = Trainer(cfg_for(2, 2, 2, m=2, checkpoint__every=1), workdir=w, console=False)
  p = cli(w)
  out = p.communicate(timeout=300)[0]
  assert p.returncode == 3, out[-2000:]
  assert f'error: workdir {w} is in use by another run' in out
  assert f'pid {os.getpid()}' in out and 'compiled' not in out
  first.train(steps=2)
  first.close()
  assert steps_on_disk(w) == [1, 2] and sorted(losses(w)) == [1, 2]
  lock_lib.WorkdirLock(w).release()  # free again once the first run closed


# ---------------------------------------------------------------------------------------- 2. damaged newest
@pytest.mark.slow
def test_newest_checkpoint_without_metadata_falls_back(tmp_path, capsys):
  """The newest step lost its metadata (`meta`): resume uses the previous step and says which one
  was skipped and why. (A truncated data file and a step with no state files are drilled in
  tests/test_checkpoint.py::test_damaged_latest_checkpoint_falls_back.)"""
  w = str(tmp_path)
  t = Trainer(cfg_for(2, 2, 2, m=2, checkpoint__every=2), workdir=w, console=False)
  t.train(steps=4)
  t.close()
  assert steps_on_disk(w) == [2, 4]
  shutil.rmtree(os.path.join(w, 'checkpoints', '4', 'meta'))
  t = Trainer(cfg_for(2, 2, 2, m=2), workdir=w, console=False)
  assert 'resumed from ' + os.path.join(w, 'checkpoints', '2') in t.init_state()
  err = capsys.readouterr().err
  assert f'checkpoint {w}/checkpoints/4 is damaged or incomplete' in err and 'trying the previous one' in err
  t.close()


# ---------------------------------------------------------------------------------------- 3. disk full
@pytest.mark.slow
def test_disk_full_during_a_save_loses_nothing(tmp_path, monkeypatch):
  """ENOSPC while Orbax writes step 4's arrays: CheckpointError (exit 3 through the CLI) naming the
  step, the folder and the cause; step 2 stays intact, and a rerun resumes from it and finishes with
  the losses of an uninterrupted run."""
  ref = str(tmp_path / 'ref')
  t = Trainer(cfg_for(2, 2, 2, m=2), workdir=ref, console=False)
  t.train(steps=6)
  t.close()
  w = str(tmp_path / 'w')
  t = Trainer(cfg_for(2, 2, 2, m=2, checkpoint__every=2), workdir=w, console=False)
  t.train(steps=2)
  t.checkpointer.wait()
  saved2 = read_ckpt(w, 2)[0]

  def full(*a, **k):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

  monkeypatch.setattr(ocp.StandardCheckpointHandler, 'async_save', full)
  with pytest.raises(ckpt_lib.CheckpointError) as e:
    t.train(steps=4)
  msg = str(e.value)
  assert f'could not write checkpoint step 4 to {w}/checkpoints: the disk is full' in msg
  assert 'No space left on device' in msg and 'previous checkpoints are untouched' in msg
  t.close()
  monkeypatch.undo()
  assert steps_on_disk(w) == [2]
  chex.assert_trees_all_equal(read_ckpt(w, 2)[0], saved2)
  t = Trainer(cfg_for(2, 2, 2, m=2, checkpoint__every=2), workdir=w, console=False)
  assert 'next step 2' in t.init_state()
  t.train(steps=4)
  t.close()
  assert {s: l for s, l in losses(w).items() if s > 2} == {s: l for s, l in losses(ref).items() if s > 2}
  chex.assert_trees_all_equal(read_ckpt(w, 6)[0], read_ckpt(ref, 6)[0])


# ---------------------------------------------------------------------------------------- 4. SIGTERM
@pytest.mark.slow
@pytest.mark.parametrize(
  'phase, args, trigger, first_step',
  [
    # the line printed just before the train step compiles
    ('compilation', [], 'initialised from seed', 0),
    # the step-2 line comes just before the step-2 evaluation (16 held-out batches)
    ('evaluation', ['--config.eval.every=2', '--config.eval.batches=16'], 'step      2/', 2),
    # with a checkpoint every step, the step-3 line comes just before step 3's save
    ('save', ['--config.checkpoint.every=1'], 'step      3/', 3),
  ],
)
def test_sigterm_in_each_phase_exits_0_resumable(tmp_path, phase, args, trigger, first_step):
  """SIGTERM while XLA compiles, while the held-out loss is computed, or while a checkpoint is
  written: exit 0, the state after the last completed step saved, every step on disk readable,
  and a new Trainer resumes from the saved step."""
  w = str(tmp_path)
  p = cli(w, *args)
  lines = []
  for line in p.stdout:
    lines.append(line)
    if trigger in line:
      p.send_signal(signal.SIGTERM)
      break
  out = ''.join(lines) + p.communicate(timeout=300)[0]
  assert p.returncode == 0, f'{phase}: {out[-2000:]}'
  assert 'SIGTERM: saved step' in out, out[-2000:]
  saved = int(out.split('SIGTERM: saved step ')[1].split()[0])
  assert first_step <= saved <= first_step + 1, out[-2000:]  # the signal may land a moment late
  assert steps_on_disk(w)[-1] == saved
  for s in steps_on_disk(w):
    read_ckpt(w, s)
  t = Trainer(cfg_for(2, 2, 2, m=2), workdir=w, console=False)
  assert f'next step {saved}' in t.init_state()
  t.close()


# ---------------------------------------------------------------------------------------- 5. data file
def token_file(path, n=1 << 18):
  np.random.default_rng(0).integers(0, 256, size=n, dtype=np.uint16).tofile(path)
  return str(path)


@pytest.mark.slow
def test_data_file_truncated_mid_run_exits_3(tmp_path):
  """The memory-mapped `.bin` token file is truncated after step 2: the prefetch thread sees it
  before reading past the end (which would be a SIGBUS), the run exits 3 with an `error:` line
  naming the file, and the checkpoints written so far are intact and resumable."""
  data, w = token_file(tmp_path / 'tokens.bin'), str(tmp_path / 'w')
  original = open(data, 'rb').read()
  p = cli(w, f'--config.data.path={data}', '--config.checkpoint.every=2', '--config.train.steps=40')
  lines = []
  for line in p.stdout:
    lines.append(line)
    if line.startswith('step      2/'):
      os.truncate(data, 4096)
      break
  out = ''.join(lines) + p.communicate(timeout=300)[0]
  assert p.returncode == 3, out[-2000:]
  assert f'error: data file {data} was truncated while the run reads it' in out
  assert 'Traceback' not in out
  saved = steps_on_disk(w)
  assert saved and saved[-1] < 40
  for s in saved:
    read_ckpt(w, s)
  open(data, 'wb').write(original)
  t = Trainer(cfg_for(2, 2, 2, m=2, data__path=data), workdir=w, console=False)
  assert f'next step {saved[-1]}' in t.init_state()
  t.close()


@pytest.mark.slow
def test_data_file_deleted_mid_run_is_not_an_error(tmp_path):
  """A deleted token file stays readable through its memory map: the run goes on, with the
  batches (and so the losses) it would have had."""
  data = token_file(tmp_path / 'tokens.bin')
  ref = Trainer(cfg_for(2, 2, 2, m=2, data__path=data), workdir=str(tmp_path / 'ref'), console=False)
  ref.train(steps=3)
  ref.close()
  t = Trainer(cfg_for(2, 2, 2, m=2, data__path=data), workdir=str(tmp_path / 'w'), console=False)
  t.train(steps=1)
  os.remove(data)
  t.train(steps=2)
  t.close()
  assert losses(str(tmp_path / 'w')) == losses(str(tmp_path / 'ref'))


# ---------------------------------------------------------------------------------------- 6. kill -9
@pytest.mark.slow
def test_sigkill_at_random_moments_then_resume_is_bit_identical(tmp_path):
  """Ten SIGKILLs at seeded random moments (start-up and compilation, a step, an asynchronous
  save, the deletion of an old step: a checkpoint every step, two kept), each followed by a rerun
  of the same command: every step on disk stays readable, and the final losses and train state
  equal an uninterrupted run's bit for bit. (A kill inside Orbax's removal of an old step once
  left a torn step folder, `state` without `meta`: old steps are now renamed away first.)"""
  n, args = 20, ('--config.train.steps=20', '--config.checkpoint.keep=2')
  ref = str(tmp_path / 'ref')
  assert cli(ref, *args).wait(timeout=300) == 0
  w, rng, kills = str(tmp_path / 'w'), np.random.default_rng(16), 0
  while kills < 10:
    left = n - (steps_on_disk(w) or [0])[-1]
    if left < 2:
      break
    after, delay = int(rng.integers(0, min(left - 1, 4))), float(rng.uniform(0, 0.5))
    p = cli(w, '--config.checkpoint.every=1', *args)
    seen, lines = 0, []
    for line in p.stdout:
      lines.append(line)
      if line.startswith(('initialised', 'resumed')) and after == 0 or line.startswith('step '):
        seen += line.startswith('step ')
        if seen >= after:
          time.sleep(delay)
          p.send_signal(signal.SIGKILL)
          break
    out = ''.join(lines) + p.communicate(timeout=60)[0]
    assert p.returncode == -signal.SIGKILL, (after, delay, p.returncode, out[-3000:])
    kills += 1
    for s in steps_on_disk(w):
      read_ckpt(w, s)  # every step on disk is complete
  assert kills == 10
  p = cli(w, '--config.checkpoint.every=1', *args)
  out = p.communicate(timeout=300)[0]
  assert p.returncode == 0, out[-2000:]
  assert losses(w) == losses(ref)
  chex.assert_trees_all_equal(read_ckpt(w, n)[0], read_ckpt(ref, n)[0])


# ---------------------------------------------------------------------------------------- 7. coordinator
@pytest.mark.slow
@pytest.mark.multiprocess
@test_multihost.hard_timeout(300)
def test_coordinator_death_stops_the_others(tmp_path):
  """Process 0 (which hosts JAX's coordination service) is killed with SIGKILL mid-run: process 1
  exits non-zero by itself within a bound (heartbeat 10 s), never hangs and is not killed by the
  launcher. (A peer's death: tests/test_multihost.py::test_sigkill_of_one_process_stops_the_others.)"""
  run = test_multihost.launch(2, test_multihost.train_cmd(str(tmp_path / 'w'), steps=10_000), grace=60)
  try:
    run.wait_for(r'^\[p1\] .*step +2/|^\[p0\] step +2/', 240)
    t_kill = time.time()
    os.kill(run.child_pid(0), signal.SIGKILL)
    t_end = run.wait_for(r'process 1 \(pid \d+\) (exited with status [1-9]|killed by)', 90)
    rc = run.wait(90)
  finally:
    run.kill()
  out = run.text
  assert rc != 0
  assert re.search(r'launch_local: process 0 \(pid \d+\) killed by SIGKILL', out), out[-4000:]
  assert t_end - t_kill < 45, (t_end - t_kill, out[-4000:])
  assert 'killing process 1' not in out, out[-4000:]
