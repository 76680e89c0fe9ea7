"""The config's one declaration and its two forms (jax3d/config/keys.py, forms.py, values.py): the
ConfigDict that config files and --config overrides edit, and the typed, frozen `Config` the code
reads after validation. Imports jax3d.config only (no jax); fast."""

import ast
import dataclasses
import glob
import os
import typing

import pytest

from jax3d import config
from jax3d.config import forms, values

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENUMERATIONS = {
  name: values.names(alias)
  for name, alias in vars(values).items()
  if typing.get_origin(alias) is typing.Literal
}


def test_the_two_forms_hold_the_same_keys_and_defaults():
  cfg = config.base_config()
  typed = config.typed(cfg)
  assert typed == config.Config()
  assert typed.to_dict() == cfg.to_dict()
  assert config.editable(typed).to_dict() == cfg.to_dict()
  assert set(forms.ranges()) == {f'{s}.{k}' for s, sec in cfg.items() for k in sec}


def test_the_typed_form_is_typed_and_frozen():
  cfg = config.load_config('tiny', {'train.sequence_parallel': 'TRUE', 'pipeline.skip_bubbles': False})
  c, plan = config.validated(cfg, 8)
  assert c.train.sequence_parallel is config.Switch.TRUE and plan.sequence_parallel
  assert c.pipeline.skip_bubbles is config.Switch.FALSE and plan.skip_bubbles is False
  assert c.train.sequence_parallel == 'true'  # a StrEnum: equal to its word, as the ConfigDict's
  assert isinstance(c.train.lr, float) and c.train.lr == cfg.train.lr
  with pytest.raises(dataclasses.FrozenInstanceError):
    c.train.lr = 1.0
  # every key's declared type agrees with what the ConfigDict holds
  for key, kind in forms.kinds().items():
    declared = forms._types()[key]
    assert (
      str if declared is config.Switch or typing.get_origin(declared) is typing.Literal else declared
    ) is kind, key


def test_an_enumeration_keys_range_is_its_literal():
  for key, declared in forms._types().items():
    if typing.get_origin(declared) is typing.Literal:
      rng, words = forms.ranges()[key], values.names(declared)
      assert all(rng.ok(w) for w in words) and not rng.ok('not-a-' + words[-1]), key


def test_each_enumeration_is_written_once():
  """No module outside jax3d/config/ spells an enumeration's words as a tuple, list or set of its
  own: it imports them (config.REMAT_POLICIES, config.values.PACKINGS, ...)."""
  copies = []
  for path in glob.glob(os.path.join(ROOT, 'jax3d', '**', '*.py'), recursive=True):
    if os.sep + 'config' + os.sep in path:
      continue
    with open(path) as f:
      tree = ast.parse(f.read())
    for node in ast.walk(tree):
      if isinstance(node, ast.Tuple | ast.List | ast.Set) and len(node.elts) > 1:
        words = [e.value for e in node.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)]
        if len(words) == len(node.elts):
          copies += [
            f'{os.path.relpath(path, ROOT)}:{node.lineno} copies {name}'
            for name, enum_words in ENUMERATIONS.items()
            if set(words) == set(enum_words)
          ]
  assert not copies, '\n'.join(copies)
