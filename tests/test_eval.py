"""lm-evaluation-harness on jax3d (jax3d/harness/, python -m jax3d.eval, eval.tasks): the numbers of
lm-eval's own `hf` model on the same transformers-written folder (fp32, CPU), offline tasks.

Per request: log-likelihoods within 1e-4, the same is-greedy flags and generations; per task the
same accuracy; packing several requests to a row changes no log-likelihood; a task that needs the
network exits 2 naming it."""

from __future__ import annotations

import json
import os

import jax
import numpy as np
import pytest

pytest.importorskip('lm_eval')

import eval_helpers as eh  # noqa: E402

from jax3d import assemble, config as config_lib  # noqa: E402
from jax3d.harness import model as harness_model, offline_tasks  # noqa: E402
from jax3d.hf import weights  # noqa: E402

TASKS = [eh.MC_TASK, eh.GEN_TASK, eh.ROLL_TASK]
LIMIT = 4


@pytest.fixture(scope='module')
def folders(tmp_path_factory):
  root = tmp_path_factory.mktemp('lm_eval')
  model = str(root / 'model')
  eh.make_model(model)
  return model, eh.write_tasks(str(root / 'tasks'))


def _samples(results: dict) -> dict:
  """task -> [(doc id, the model's responses)] of lm-eval's logged samples."""
  return {t: [(s['doc_id'], s['resps']) for s in v] for t, v in results['samples'].items()}


_REFERENCE = {}


def reference(folders, tasks: tuple[str, ...], limit: int) -> dict:
  """lm-eval's `hf` model on the folder: results with samples (batch 1: no padding in generation),
  computed once per task list."""
  from lm_eval.models.huggingface import HFLM

  if (tasks, limit) not in _REFERENCE:
    model, folder = folders
    lm = HFLM(pretrained=model, device='cpu', dtype='float32', batch_size=1, max_length=eh.MAX_LENGTH)
    loaded = offline_tasks.load(list(tasks), folder)
    _REFERENCE[tasks, limit] = offline_tasks.evaluate(lm, loaded, limit, bootstrap_iters=0, log_samples=True)
  return _REFERENCE[tasks, limit]


def _jax_lm(model: str, layout: tuple[int, int, int], rows: int = 4) -> harness_model.JaxLM:
  dp, pp, tp = layout
  cfg = config_lib.load_config(
    'tiny',
    {
      'checkpoint.init_from': f'hf:{model}',
      'mesh.dp': dp,
      'mesh.pp': pp,
      'mesh.tp': tp,
      'pipeline.microbatches': 2 if pp > 1 else 1,
      'train.global_batch_size': rows,
      'train.seq_len': eh.MAX_LENGTH,
    },
  )
  s = assemble.build(cfg, jax.devices()[: dp * pp * tp])
  return harness_model.JaxLM(s, weights.load_params(s))


def _check_equal(got: dict, ref: dict, tasks: tuple[str, ...]) -> None:
  want, have = _samples(ref), _samples(got)
  assert set(have) == set(tasks)
  for task in tasks:
    assert [d for d, _ in have[task]] == [d for d, _ in want[task]], task
    for (_, h), (_, w) in zip(have[task], want[task], strict=True):
      if task == eh.GEN_TASK:
        assert h == w, (task, h, w)  # the same greedy generation, cut at the same `until`
      elif task == eh.MC_TASK:
        np.testing.assert_allclose([r[0][0] for r in h], [r[0][0] for r in w], rtol=0, atol=1e-4)
        assert [r[0][1] for r in h] == [r[0][1] for r in w], task
      else:
        np.testing.assert_allclose([r[0] for r in h], [r[0] for r in w], rtol=0, atol=1e-4)
  for task in tasks:  # the same scores (accuracy, exact match, perplexities)
    for key, value in ref['results'][task].items():
      if isinstance(value, float) and 'stderr' not in key:
        np.testing.assert_allclose(got['results'][task][key], value, rtol=1e-5, err_msg=f'{task} {key}')


def _run(folders, layout, tasks, limit):
  model, folder = folders
  lm = _jax_lm(model, layout)
  loaded = offline_tasks.load(list(tasks), folder)
  return lm, offline_tasks.evaluate(lm, loaded, limit, bootstrap_iters=0, log_samples=True)


def test_multiple_choice_equals_lm_evals_hf_model_on_one_device(folders):
  """The default-suite case: 2 documents x 4 choices, packed into rows on 1-1-1."""
  tasks = (eh.MC_TASK,)
  lm, got = _run(folders, (1, 1, 1), tasks, 2)
  _check_equal(got, reference(folders, tasks, 2), tasks)
  assert lm.stats['rows'] < lm.stats['requests']  # several requests to a row


@pytest.mark.slow
@pytest.mark.parametrize('layout', [(1, 1, 1), (2, 2, 2)])
def test_all_request_kinds_equal_lm_evals_hf_model(folders, layout):
  """Multiple choice, greedy generation and rolling log-likelihoods (windows of 64 tokens)."""
  tasks = tuple(TASKS)
  _check_equal(_run(folders, layout, tasks, LIMIT)[1], reference(folders, tasks, LIMIT), tasks)


def test_is_greedy_needs_every_continuation_token_to_be_the_argmax(folders):
  """lm-eval's is_greedy, per request: true for the model's own greedy continuation (transformers'
  argmax at each position), false when exactly one of its tokens is not the argmax (the middle one
  replaced, the last recomputed as the argmax after it), and false for one wrong last token."""
  import torch
  from transformers import AutoModelForCausalLM

  model, _ = folders
  hf = AutoModelForCausalLM.from_pretrained(model, torch_dtype=torch.float32).eval()
  with torch.no_grad():
    ranked = lambda ids: hf(torch.tensor([ids])).logits[0, -1].argsort(descending=True).tolist()
  context = [0, 40, 71, 93, 12, 150]
  g1 = ranked(context)[0]
  g2, other = ranked(context + [g1])[:2]
  g3 = ranked(context + [g1, g2])[0]
  g3_after_other = ranked(context + [g1, other])[0]
  last_wrong = ranked(context + [g1, g2])[1]
  pairs = [(context, [g1, g2, g3]), (context, [g1, other, g3_after_other]), (context, [g1, g2, last_wrong])]
  _, greedy = _jax_lm(model, (1, 1, 1)).score_tokens(pairs)
  assert greedy.tolist() == [True, False, False]


def test_packing_changes_no_loglikelihood(folders):
  """All requests packed into rows (few rows, several steps of 2 rows) = one request per row."""
  model, _ = folders
  lm = _jax_lm(model, (2, 1, 1), rows=2)
  rng = np.random.default_rng(0)
  pairs = [
    (
      rng.integers(2, 300, int(rng.integers(1, 40))).tolist(),
      rng.integers(2, 300, int(rng.integers(1, 9))).tolist(),
    )
    for _ in range(12)
  ]
  pairs.append((list(range(2, 80)), [5, 6, 7]))  # longer than a row: left-truncated
  packed, greedy = lm.score_tokens(pairs)
  assert lm.stats['rows'] < len(pairs) and lm.stats['steps'] > 1
  alone = [lm.score_tokens([p]) for p in pairs]
  np.testing.assert_allclose(packed, [a[0][0] for a in alone], rtol=0, atol=1e-5)
  assert greedy.tolist() == [bool(a[1][0]) for a in alone]
  # and a request's value is the sum of its tokens' log-probabilities (a full forward, numpy)
  assert np.all(packed < 0)


def _network_task(folder) -> str:
  os.makedirs(folder, exist_ok=True)
  with open(os.path.join(folder, 'hub_task.yaml'), 'w') as f:
    f.write(
      'task: hub_task\ndataset_path: someone/not_on_this_machine\noutput_type: multiple_choice\n'
      'test_split: test\ndoc_to_text: "{{q}}"\ndoc_to_choice: "{{c}}"\ndoc_to_target: 0\n'
    )
  return str(folder)


def test_a_task_that_needs_the_network_exits_2(tmp_path, capsys):
  from jax3d import eval as eval_cmd

  folder = _network_task(tmp_path / 'tasks')  # the tasks are checked before the model is read
  os.makedirs(tmp_path / 'model')  # a folder (checkpoint.init_from's range) with no model in it
  base = [f'--config.checkpoint.init_from=hf:{tmp_path}/model', f'--include_path={folder}']
  assert eval_cmd.main(base + ['--tasks=hub_task']) == 2
  err = capsys.readouterr().err.strip().splitlines()[-1]
  assert err.startswith('error:') and "'hub_task'" in err and 'network' in err and 'dataset_path: json' in err


@pytest.mark.slow  # indexes lm-eval's ~15,000 own tasks first
def test_an_unknown_task_exits_2(tmp_path, capsys, folders):
  from jax3d import eval as eval_cmd

  argv = [
    f'--config.checkpoint.init_from=hf:{folders[0]}',
    f'--include_path={folders[1]}',
    '--tasks=no_such_task',
  ]
  assert eval_cmd.main(argv) == 2
  err = capsys.readouterr().err.strip().splitlines()[-1]
  assert "'no_such_task'" in err and 'no such task' in err


def test_missing_lm_eval_names_the_extra(monkeypatch):
  import sys

  monkeypatch.setitem(sys.modules, 'lm_eval', None)
  with pytest.raises(offline_tasks.UsageError, match=r"pip install 'jax3d\[eval\]'"):
    offline_tasks.require_lm_eval()


@pytest.mark.slow
def test_tasks_in_training_and_after_agree(folders, tmp_path):
  """eval.tasks: scores in metrics.jsonl and WORKDIR/eval/<step>.json at the end of a run; then
  `python -m jax3d.eval --workdir` on another layout gives the same scores from the checkpoint."""
  import jax3d
  from jax3d import eval as eval_cmd

  model, tasks = folders
  workdir, corpus = str(tmp_path / 'run'), tmp_path / 'corpus'
  corpus.mkdir()
  for i in range(20):  # a little corpus of text files, some held out
    (corpus / f'{i}.txt').write_text(' '.join(eh.WORDS[(i + j) % len(eh.WORDS)] for j in range(200)))
  over = {
    'checkpoint.init_from': f'hf:{model}',
    'data.path': str(corpus),
    'data.eval_fraction': 0.3,
    'train.steps': 2,
    'train.global_batch_size': 8,
    'train.seq_len': eh.MAX_LENGTH,
    'mesh.dp': 8,
    'mesh.pp': 1,
    'mesh.tp': 1,
    'pipeline.microbatches': 1,
    'eval.every': 0,
    'eval.tasks': f'{eh.MC_TASK},{eh.ROLL_TASK}',
    'eval.tasks_include_path': tasks,
    'eval.tasks_limit': LIMIT,
    'log.progress': False,
  }
  t = jax3d.build(jax3d.load_config('tiny', over), workdir=workdir)
  try:
    records = t.train()
  finally:
    t.close()
  scores = [r for r in records if f'task/{eh.MC_TASK}/acc' in r]
  assert [r['step'] for r in scores] == [2]
  with open(os.path.join(workdir, 'eval', '2.json')) as f:
    assert json.load(f)['results'][eh.MC_TASK]['acc,none'] == scores[0][f'task/{eh.MC_TASK}/acc']
  out = str(tmp_path / 'after.json')
  argv = [f'--workdir={workdir}', f'--tasks={eh.MC_TASK},{eh.ROLL_TASK}', f'--include_path={tasks}']
  argv += [f'--limit={LIMIT}']
  argv += ['--config.mesh.dp=4', '--config.mesh.tp=2', f'--out={out}']
  assert eval_cmd.main(argv) == 0
  with open(out) as f:
    after = json.load(f)
  assert after['step'] == 2
  for task, metric in ((eh.MC_TASK, 'acc'), (eh.MC_TASK, 'acc_norm'), (eh.ROLL_TASK, 'bits_per_byte')):
    np.testing.assert_allclose(
      after['results'][task][f'{metric},none'], scores[0][f'task/{task}/{metric}'], rtol=1e-6
    )


def test_the_report_plots_task_scores(tmp_path):
  """metrics.jsonl task records (as eval.tasks writes them) -> the report's task figure; a resumed
  run's later records replace the earlier ones of the same steps."""
  from jax3d.analysis import run_report

  recs = [
    {'event': 'start', 'step': 0},
    {'step': 1, 'loss': 3.0},
    {'step': 2, 'task/mc/acc': 0.25, 'task/mc/acc_norm': 0.5},
    {'step': 4, 'task/mc/acc': 0.5, 'task/mc/acc_norm': 0.5},
    {'event': 'start', 'step': 2},
    {'step': 4, 'task/mc/acc': 0.75, 'task/mc/acc_norm': 0.5},
  ]
  with open(tmp_path / 'metrics.jsonl', 'w') as f:
    f.writelines(json.dumps(r) + '\n' for r in recs)
  run = run_report.load(str(tmp_path / 'metrics.jsonl'))
  assert [(r['step'], r['task/mc/acc']) for r in run['tasks']] == [(2, 0.25), (4, 0.75)]
  page = open(run_report.write_report(str(tmp_path))).read()
  assert 'tasks.png' in page and (tmp_path / 'report' / 'tasks.png').exists()
