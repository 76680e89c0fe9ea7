"""lm-evaluation-harness tasks, offline: found by name (lm-eval's own and those of `include_path`,
a folder of task YAMLs), their data read from local files only, run on a model with
`lm_eval.simple_evaluate`, the results as lm-eval's table, JSON and flat metric records.

Nothing is downloaded: HF_DATASETS_OFFLINE and HF_HUB_OFFLINE are set before the datasets
library is used, and a task whose data is on the Hub (not in the local cache) is refused with a
UsageError (exit 2) naming the task and what to do: a task YAML over local files
(`dataset_path: json` + `dataset_kwargs: {data_files: {test: /abs/path.jsonl}}`).
"""

from __future__ import annotations

import json
import math
import os
import sys
from collections.abc import Sequence
from typing import Any

from jax3d.errors import UsageError

INSTALL = "pip install 'jax3d[eval]'"
LOCAL_TASK_HINT = (
  'use a task YAML over local files in --include_path (dataset_path: json, '
  'dataset_kwargs: {data_files: {test: /path/to/data.jsonl}}), or put the dataset in the '
  'Hugging Face cache on a machine with the network first'
)


def require_lm_eval() -> None:
  """UsageError (exit 2) naming the extra to install when lm-evaluation-harness is missing."""
  try:
    import lm_eval  # noqa: F401
  except ImportError as e:
    raise UsageError(f'task evaluation needs lm-evaluation-harness ({e}): {INSTALL}') from None


def go_offline() -> None:
  """No download from here on: the datasets library and the Hub client in offline mode (their
  environment variables, and their already-read settings when they are imported)."""
  os.environ['HF_DATASETS_OFFLINE'] = '1'
  os.environ['HF_HUB_OFFLINE'] = '1'
  if 'datasets' in sys.modules:
    import datasets

    datasets.config.HF_DATASETS_OFFLINE = True
  if 'huggingface_hub' in sys.modules:
    import huggingface_hub.constants

    huggingface_hub.constants.HF_HUB_OFFLINE = True


def split_names(tasks: str | Sequence[str]) -> list[str]:
  """Task names from a comma list (or a list), blanks dropped."""
  items = tasks.split(',') if isinstance(tasks, str) else list(tasks)
  return [t.strip() for t in items if t.strip()]


def load(names: Sequence[str], include_path: str | None = None) -> list[Any]:
  """The tasks (lm-eval Task or Group objects, their documents loaded) of `names`, offline.
  lm-eval's own ~15,000 task definitions are indexed only when a name is not in include_path."""
  require_lm_eval()
  go_offline()
  from lm_eval.tasks import TaskManager

  if include_path is not None and not os.path.isdir(include_path):
    raise UsageError(f'--include_path={include_path}: not a folder of task YAML files')
  local = TaskManager(include_path=include_path, include_defaults=False) if include_path else None
  manager = local
  if local is None or any(n not in local.all_tasks for n in names):
    manager = TaskManager(include_path=include_path)
  out = []
  for name in names:
    try:
      loaded = manager.load([name])
    except KeyError:
      broken = _broken_yaml(include_path) if include_path else None
      if broken:  # lm-eval skips a YAML it cannot read without a word: the likely cause, named
        raise UsageError(
          f'task {name!r}: not found, and {broken[0]} in --include_path={include_path} does not load: '
          f'{broken[1]}'
        ) from None
      where = f' nor in --include_path={include_path}' if include_path else ''
      raise UsageError(
        f'task {name!r}: no such task in lm-evaluation-harness{where} (a task YAML in a folder given '
        'as --include_path, or a name that `lm_eval ls tasks` lists)'
      ) from None
    except (ConnectionError, TimeoutError) as e:
      raise UsageError(
        f'task {name!r} needs the network to download its data ({e}); {LOCAL_TASK_HINT}'
      ) from None
    except FileNotFoundError as e:
      raise UsageError(f'task {name!r}: its data files are not there ({e}); {LOCAL_TASK_HINT}') from None
    objs = loaded['groups'].get(name) or loaded['tasks'].get(name)
    out += [objs] if objs is not None else list(loaded['tasks'].values())  # a tag: its tasks
  return out


def _broken_yaml(folder: str) -> tuple[str, str] | None:
  """(file, what is wrong, on one line) of the first task YAML under `folder` that is not a YAML
  mapping (lm-eval's `!function` tags and the like read as plain values); None when all load."""
  import yaml

  class Loader(yaml.SafeLoader):
    pass

  Loader.add_multi_constructor('!', lambda loader, suffix, node: None)
  for root, _, names in sorted(os.walk(folder)):
    for n in sorted(names):
      if not n.endswith(('.yaml', '.yml')):
        continue
      file = os.path.join(root, n)
      try:
        with open(file, 'rb') as f:
          doc = yaml.load(f, Loader=Loader)  # noqa: S506 - a SafeLoader, tags read as None
      except (OSError, yaml.YAMLError) as e:
        return file, ' '.join(str(e).split())
      if not isinstance(doc, dict):
        return file, f'a task YAML is a mapping (task: NAME, ...), not {type(doc).__name__}'
  return None


def evaluate(
  lm: Any,
  loaded: Sequence[Any],
  limit: int | float | None = None,
  num_fewshot: int | None = None,
  bootstrap_iters: int = 100000,
  log_samples: bool = False,
) -> dict:
  """lm-eval's results dict of the tasks `loaded` (as `load` returns them) on the model `lm` (an
  lm_eval LM); `bootstrap_iters` 0: no bootstrapped standard errors (lm-eval's default 100000)."""
  from unittest import mock

  from lm_eval import evaluator
  from lm_eval.tasks import TaskManager

  # lm-eval's environment report runs torch's collect_env (pip, nvcc and more in subprocesses:
  # seconds per call, at every evaluation of a training run); the versions are kept instead.
  with mock.patch.object(evaluator, 'add_env_info', _versions):
    return evaluator.simple_evaluate(
      model=lm,
      tasks=list(loaded),
      limit=limit,
      num_fewshot=num_fewshot,
      log_samples=log_samples,
      bootstrap_iters=bootstrap_iters,
      verbosity='ERROR',
      # the tasks are built: an empty index (simple_evaluate's default indexes all of lm-eval's)
      task_manager=TaskManager(include_defaults=False),
    )


def _versions(results: dict) -> None:
  """What lm-eval's environment report records that jax3d keeps: the libraries' versions."""
  from importlib.metadata import version

  import jax

  results['lm_eval_version'] = version('lm_eval')
  results['jax_version'] = jax.__version__


def table(results: dict) -> str:
  """The results table as `lm_eval` prints it (and the groups' table when there are groups)."""
  from lm_eval.utils import make_table

  text = make_table(results)
  if results.get('groups'):
    text += '\n' + make_table(results, 'groups')
  return text


def scores(results: dict) -> dict[str, float]:
  """Flat metric names and values: 'task/TASK/METRIC' (lm-eval's `acc,none` without the filter
  `none`), finite numbers only (stderr left out)."""
  out = {}
  for task, metrics in results.get('results', {}).items():
    for key, value in metrics.items():
      metric, _, filt = key.partition(',')
      if 'stderr' in metric or not isinstance(value, (int, float)) or isinstance(value, bool):
        continue
      if math.isfinite(value):
        out[f'task/{task}/{metric}' + (f'/{filt}' if filt and filt != 'none' else '')] = float(value)
  return out


def write_json(results: dict, path: str, extra: dict | None = None) -> str:
  """The results (lm-eval's `results`, `versions`, `n-shot`, `configs`, groups) and `extra` as
  JSON at `path` (its folder made); returns the path."""
  keep = (
    'results',
    'groups',
    'group_subtasks',
    'versions',
    'n-shot',
    'higher_is_better',
    'n-samples',
    'configs',
  )
  doc = {k: results[k] for k in keep if k in results} | dict(extra or {})
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  with open(path, 'w') as f:
    json.dump(doc, f, indent=2, default=str)
  return path
