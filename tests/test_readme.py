"""The README's commands work: every ```bash block right after a `<!-- runnable -->` line runs.

A README whose commands rot is worse than none, so the blocks a reader is told to paste are run
as they are (bash -e, from the repository root, 600 s each), except that their /tmp/NAME paths
move under a fresh pytest folder: a rerun must train again, not resume a finished run. Blocks without the marker (GPU runs,
multi-host launches, planner output shown for reading) are documentation only. A README without
any runnable block fails: the quickstart must be executable.
"""

import json
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, 'README.md')
MARKER = '<!-- runnable -->'


def runnable_blocks(text: str) -> list[tuple[int, str]]:
  """(line number, script) of each ```bash fence whose previous non-blank line is the marker."""
  lines, out, i = text.splitlines(), [], 0
  while i < len(lines):
    if re.fullmatch(r'\s*```bash\s*', lines[i]):
      prev = next((l for l in reversed(lines[:i]) if l.strip()), '')
      end = next((j for j in range(i + 1, len(lines)) if lines[j].strip() == '```'), None)
      if end is None:
        raise ValueError(f'README.md:{i + 1}: ```bash block is not closed')
      if prev.strip() == MARKER:
        out.append((i + 1, '\n'.join(lines[i + 1 : end]) + '\n'))
      i = end
    i += 1
  return out


def localize(script: str, tmp_dir: str) -> tuple[str, list[str]]:
  """The script with every /tmp/NAME path moved to tmp_dir/NAME, and the workdirs of its
  `jax3d.train` commands (after the move)."""
  script = re.sub(r'/tmp/([\w.-]+)', lambda m: os.path.join(tmp_dir, m.group(1)), script)
  one_line = re.sub(r'\\\n', ' ', script)  # a command continued over lines with a backslash
  return script, re.findall(r'jax3d\.train\b[^\n]*?--workdir=(\S+)', one_line)


def _blocks():
  if not os.path.exists(README):
    return []
  with open(README) as f:
    return runnable_blocks(f.read())


def test_parser():
  text = (
    'intro\n<!-- runnable -->\n\n```bash\necho a\necho b\n```\n'
    '```bash\necho not marked\n```\n<!-- runnable -->\n```python\nprint(1)\n```\n'
    '<!-- runnable -->\n```bash\nexit 0\n```\n'
  )
  assert runnable_blocks(text) == [(4, 'echo a\necho b\n'), (16, 'exit 0\n')]


def test_localize_moves_tmp_paths(tmp_path):
  script, workdirs = localize('python -m jax3d.train --workdir=/tmp/a_b --x=1\nls /tmp/a_b/report\n', '/T')
  assert script == 'python -m jax3d.train --workdir=/T/a_b --x=1\nls /T/a_b/report\n'
  assert workdirs == ['/T/a_b']
  continued = 'python -m jax3d.train --config=finetune \\\n  --x=1 --workdir=/tmp/ft \\\n  --y=2\nls\n'
  assert localize(continued, '/T')[1] == ['/T/ft']
  for _, block in _blocks():  # the README's own blocks write nothing outside the fresh folder
    moved, _ = localize(block, str(tmp_path))
    assert '/tmp/' not in moved.replace(str(tmp_path), '')


def test_readme_has_runnable_blocks():
  assert os.path.exists(README), 'README.md is missing'
  assert _blocks(), f'README.md has no ```bash block preceded by {MARKER}'


def test_every_training_block_has_its_workdir_checked():
  """Each runnable block's `jax3d.train` commands (continued lines included) name a --workdir that
  test_readme_block_runs then checks for training steps."""
  for line, block in _blocks():
    n_train = len(re.findall(r'jax3d\.train\b', block))
    assert len(localize(block, '/T')[1]) == n_train, f'README.md:{line}: a jax3d.train without --workdir'


@pytest.mark.slow
@pytest.mark.parametrize(
  'line,script',
  _blocks()
  or [
    pytest.param(
      0,
      '',
      marks=pytest.mark.skip(reason='no runnable block in README.md (test_readme_has_runnable_blocks fails)'),
    )
  ],
)
def test_readme_block_runs(line, script, tmp_path):
  # as a reader's shell
  env = {k: v for k, v in os.environ.items() if k not in ('XLA_FLAGS', 'JAX_PLATFORMS')}
  env['PYTHONPATH'] = os.pathsep.join([ROOT, env.get('PYTHONPATH', '')])
  # `python` and `pytest` in a block are the interpreter running the tests (its venv).
  env['PATH'] = os.pathsep.join([os.path.dirname(sys.executable), env.get('PATH', '')])
  script, workdirs = localize(script, str(tmp_path))
  try:
    r = subprocess.run(
      ['bash', '-e', '-c', script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )
  except subprocess.TimeoutExpired:
    pytest.fail(f'README.md:{line}: block ran over 600 s:\n{script}')
  assert r.returncode == 0, (
    f'README.md:{line}: exit status {r.returncode}\n{script}\n--- stdout\n'
    f'{r.stdout[-3000:]}\n--- stderr\n{r.stderr[-3000:]}'
  )
  for workdir in workdirs:  # it trained (a fresh workdir: nothing to resume)
    with open(os.path.join(workdir, 'metrics.jsonl')) as f:
      losses = [r for r in map(json.loads, f) if 'loss' in r and r.get('step')]
    assert losses, f'README.md:{line}: {workdir} has no training steps in metrics.jsonl'


# Tests in tests/test_bad_input.py that check something else than a bad input being refused.
NOT_BAD_INPUTS = (
  'test_compile_log_shows_a_compile',  # the sentinel the bad-input tests rely on
  'test_every_command_prints_its_docstring_for_help',
  'test_flag_spellings_and_types',
  'test_train_declares_every_distributed_flag',
  'test_sequence_parallel_setting_resolves',
  'test_the_table_changed_no_input_file',  # the table's cases changed no file (counted by case)
  'test_the_table_left_no_folder_behind',  # nor left a folder behind (counted by case)
  # input that is right to accept, read as the plain input is
  'test_a_compressed_jsonl_prepares_to_the_plain_one_shards',
  'test_a_folder_of_compressed_files_prepares_as_the_plain_folder',
  'test_train_reads_a_compressed_text_file_as_the_plain_one',
  'test_undecodable_bytes_are_counted_below_the_threshold',
  'test_chat_content_parts_are_joined_as_a_string',
)


def test_reliability_counts_are_the_suites():
  """The README's "N bad inputs, M fault drills, nothing lost" are the test suite's own counts
  (collected, slow tests and parametrizations included; in tests/test_bad_input.py the tests named
  in NOT_BAD_INPUTS are not bad inputs), not figures written from memory."""
  out = subprocess.run(
    [sys.executable, '-m', 'pytest', '-o', 'addopts=', '--collect-only', '-q', '-m', 'slow or not slow']
    + ['tests/test_bad_input.py', 'tests/test_faults.py'],
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=300,
  ).stdout
  ids = re.findall(r'^tests/(test_\w+)\.py::(\w+)', out, re.M)
  names = {name for _, name in ids}
  assert set(NOT_BAD_INPUTS) <= names, set(NOT_BAD_INPUTS) - names  # renamed: update the list
  bad_inputs = sum(f == 'test_bad_input' and name not in NOT_BAD_INPUTS for f, name in ids)
  drills = sum(f == 'test_faults' for f, _ in ids)
  m = re.search(r'(\d+) bad inputs, (\d+) fault drills, nothing lost', open(README).read())
  assert m, 'README.md lost its "N bad inputs, M fault drills, nothing lost" line'
  assert (int(m[1]), int(m[2])) == (bad_inputs, drills), out
