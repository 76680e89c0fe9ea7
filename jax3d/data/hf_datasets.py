"""Datasets `jax3d.prepare --input` names that are more than files: a folder written by
`datasets.Dataset.save_to_disk` (its state.json lists its Arrow files) or by
`DatasetDict.save_to_disk` (dataset_dict.json lists its splits, one folder each), and `hf:NAME`
(`hf:NAME:CONFIG`), a dataset in the Hugging Face cache, found by the `datasets` library with its
offline mode on: what is on disk is read, nothing is ever downloaded. Each gives the Arrow files
that jax3d/data/arrow_tables.py then reads itself (streamed, in parallel). A DatasetDict's split is
`split`, by default 'train' or the only one. Imports no jax; `datasets` only for hf:.
"""

from __future__ import annotations

import json
import os

from jax3d.errors import ConfigError

HF = 'hf:'


def choose(split: str, splits: list[str], where: str) -> str:
  """The split to read: `split` when given (ConfigError naming the splits when it is not one of
  them), else 'train', else the only one."""
  if split:
    if split not in splits:
      raise ConfigError(f'--split={split}: {where} has no such split (its splits: {", ".join(splits)})')
    return split
  if 'train' in splits or len(splits) == 1:
    return 'train' if 'train' in splits else splits[0]
  raise ConfigError(
    f'--input={where} has splits {", ".join(splits)} and none is train: choose one with --split'
  )


def _read(path: str) -> dict:
  try:
    with open(path, encoding='utf-8') as f:
      return json.load(f)
  except (OSError, ValueError) as e:
    raise ConfigError(f'{path} cannot be read ({e})') from None


def saved(folder: str, split: str = '') -> list[str] | None:
  """The Arrow files of a `save_to_disk` folder (a DatasetDict's `split`), in order; None when the
  folder is not one."""
  if os.path.exists(index := os.path.join(folder, 'dataset_dict.json')):
    splits = _read(index).get('splits')
    if not isinstance(splits, list) or not splits:
      raise ConfigError(f'{index} lists no splits')
    folder = os.path.join(folder, choose(split, [str(s) for s in splits], folder))
  if not os.path.exists(state := os.path.join(folder, 'state.json')):
    return None
  files = [os.path.join(folder, f.get('filename', '')) for f in _read(state).get('_data_files', [])]
  if missing := [f for f in files if not os.path.isfile(f)]:
    raise ConfigError(f'{state} lists {missing[0]}, which does not exist')
  return files


def cached(spec: str, split: str = '') -> list[str]:
  """The Arrow files of `hf:NAME[:CONFIG]`'s split in the Hugging Face cache, found offline;
  ConfigError when `datasets` is missing or the dataset is not in the cache."""
  name, _, config = spec.removeprefix(HF).partition(':')
  os.environ['HF_HUB_OFFLINE'] = os.environ['HF_DATASETS_OFFLINE'] = '1'  # read at import: before it
  try:
    import datasets
  except ImportError:
    raise ConfigError(
      f'--input={spec}: reading the Hugging Face cache needs the `datasets` library: pip install datasets'
    ) from None
  datasets.config.HF_HUB_OFFLINE = datasets.config.HF_DATASETS_OFFLINE = True  # never the network
  datasets.logging.set_verbosity_error()
  datasets.disable_progress_bars()
  try:
    found = datasets.load_dataset(name, config or None)
  except Exception as e:  # noqa: BLE001 - whatever datasets raises when it would need the network
    raise ConfigError(
      f'--input={spec}: not in the Hugging Face cache ({datasets.config.HF_DATASETS_CACHE}); jax3d reads '
      f"it offline and never downloads: load it once where there is network (datasets.load_dataset('{name}')), "
      f'or give --input its files ({type(e).__name__}: {str(e)[:120]})'
    ) from None
  if not isinstance(found, dict):
    found = {'train': found}
  return [f['filename'] for f in found[choose(split, list(found), spec)].cache_files]
