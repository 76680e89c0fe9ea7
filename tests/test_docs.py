"""The documentation states each fact once, inside the repository, and the config reference is the
code's: README.md is short, docs/ is the reference, and docs/configuration.md's key table is what
scripts/config_docs.py generates from `jax3d.config.base_config()` and the comments in the keys'
declaration (the source of `jax3d.config.Config`).

Imports jax3d.config only (no jax); fast.
"""

import copy
import glob
import importlib.util
import inspect
import os
import re

import pytest

import jax3d.config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, 'README.md')
BUILD_NOTES = os.path.join(ROOT, 'BUILD_NOTES.md')
DOCS = sorted(glob.glob(os.path.join(ROOT, 'docs', '*.md')))
MAX_README_LINES = 250
LONG = 80  # a line this long is a paragraph's worth of text: it may stand in one page only


def _generator():
  spec = importlib.util.spec_from_file_location(
    'config_docs', os.path.join(ROOT, 'scripts', 'config_docs.py')
  )
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def _read(path: str) -> str:
  with open(path) as f:
    return f.read()


def _rel(path: str) -> str:
  return os.path.relpath(path, ROOT)


def _long_lines(path: str) -> set[str]:
  return {l.strip() for l in _read(path).splitlines() if len(l.strip()) >= LONG}


@pytest.fixture(scope='module')
def gen():
  return _generator()


@pytest.fixture(scope='module')
def doc_block(gen):
  return gen.split(_read(gen.DOC))[1]


def test_config_table_is_generated_from_base_config(gen, doc_block):
  """(a) A key added, removed or re-commented without `python scripts/config_docs.py` fails here."""
  assert doc_block == gen.generated(), (
    'docs/configuration.md is stale: run `python scripts/config_docs.py` '
    '(`python scripts/config_docs.py --check` shows the difference)'
  )
  assert gen.main(['--check']) == 0


def test_every_key_is_in_the_table(doc_block):
  """(b) Every key of base_config(), with its default."""
  keys = _generator().flatten(jax3d.config.base_config())
  rows = {l.split('|')[1].strip().strip('`'): l for l in doc_block.splitlines() if l.startswith('| `')}
  assert set(rows) == set(keys), sorted(set(rows) ^ set(keys))
  for key, default in keys.items():
    assert f'`{default!r}`' in rows[key], (key, rows[key])


def test_the_check_sees_a_changed_comment_or_a_new_key(gen, doc_block):
  """The generator reads what the test compares: a comment changed in the source of base_config(),
  or a key added to it, gives another table than the one in docs/configuration.md."""
  with open(inspect.getsourcefile(jax3d.config.Config)) as f:  # the keys' declaration
    source = f.read()
  cfg = jax3d.config.base_config()
  assert gen.render(cfg, source) == doc_block
  key = next(iter(gen.flatten(cfg)))  # the first key, e.g. mesh.dp
  line_no = gen.key_comments(source, [key])[key][0]
  lines = source.splitlines()
  line = lines[line_no - 1]
  # One more word in the key's comment (or a comment where its meaning sat on the lines above).
  changed = lines[: line_no - 1] + [line + (' (changed)' if '#' in line else '  # (changed)')]
  assert gen.render(cfg, '\n'.join(changed + lines[line_no:]) + '\n') != doc_block
  # A new key beside it, written the way the source writes the first one (a field of its section).
  section, name = key.rsplit('.', 1)
  assert line.lstrip().startswith(f'{name}:'), f'{key} is not declared on line {line_no}: {line!r}'
  new_line = line[: line.index(name)] + 'zz_new_key: int = key(3)  # a key nobody documented'
  added = '\n'.join(lines[: line_no - 1] + [new_line] + lines[line_no - 1 :]) + '\n'
  more = copy.deepcopy(cfg)
  with more.unlocked():
    more[section].zz_new_key = 3
  assert f'`{section}.zz_new_key` | int | `3` |  | a key nobody documented |' in gen.render(more, added)
  with pytest.raises(SystemExit, match=f'no comment for {section}.zz_new_key'):
    gen.render(more, source)  # a key without a comment is refused, not rendered blank


def test_comments_above_a_key_and_on_its_continuation_lines_count(gen):
  source = (
    'def base_config():\n'
    '  c = ConfigDict()\n'
    '  # first line of a long meaning,\n'
    '  # its second line\n'
    '  c.a.long = 1\n'
    '  c.a.wrapped = (\n'
    "    ''  # the comment of a wrapped value\n"
    '  )\n'
    '  c.a.piped = 2  # x | y\n'
  )
  meaning = {k: m for k, (_, m) in gen.key_comments(source, ['a.long', 'a.wrapped', 'a.piped']).items()}
  assert meaning == {
    'a.long': 'first line of a long meaning, its second line',
    'a.wrapped': 'the comment of a wrapped value',
    'a.piped': 'x | y',
  }
  assert gen._cell('x | y') == 'x \\| y'  # a pipe does not split the markdown table's cell


def test_no_path_out_of_the_repository():
  """(c) A user's clone has no ../shared: nothing may link or point there."""
  offenders = [
    f'{_rel(p)}:{i}: {line.strip()}'
    for p in [README, BUILD_NOTES] + DOCS
    for i, line in enumerate(_read(p).splitlines(), 1)
    if '../shared' in line
  ]
  assert not offenders, '\n'.join(offenders)


def test_readme_is_short():
  """(d) The README is the entry: what, the two commands, what you see, where each concept lives."""
  n = len(_read(README).splitlines())
  assert n < MAX_README_LINES, f'README.md has {n} lines; the reference belongs in docs/'


def test_no_paragraph_stands_in_two_places():
  """(e) A long line of README.md is in no docs page, and one of a docs page in no other page: each
  fact has one home and the others link to it."""
  assert DOCS, 'docs/*.md is missing'
  readme = _long_lines(README)
  dupes = [f'README.md and {_rel(p)}: {l}' for p in DOCS for l in sorted(readme & _long_lines(p))]
  for i, p in enumerate(DOCS):
    for q in DOCS[i + 1 :]:
      dupes += [f'{_rel(p)} and {_rel(q)}: {l}' for l in sorted(_long_lines(p) & _long_lines(q))]
  assert not dupes, '\n'.join(dupes)


def test_docs_links_resolve():
  """Relative links between README, BUILD_NOTES and docs/ point at files that exist."""
  broken = []
  for p in [README, BUILD_NOTES] + DOCS:
    for target in re.findall(r'\]\(([^)#\s]+)(?:#[^)]*)?\)', _read(p)):
      if '://' in target:
        continue
      if not os.path.exists(os.path.normpath(os.path.join(os.path.dirname(p), target))):
        broken.append(f'{_rel(p)}: {target}')
  assert not broken, '\n'.join(broken)


def test_files_the_docs_name_exist():
  """A file or folder of the repository named in README.md, docs/ or BUILD_NOTES.md exists, all of
  each file (BUILD_NOTES keeps the current decisions only; what is gone is in git): a moved module
  is renamed in the documentation too."""
  pattern = re.compile(r'\b(?:jax3d|scripts|tests|notebooks|configs|docs|\.ci)/[\w./-]*\w')
  missing = []
  for p in [README, BUILD_NOTES] + DOCS:
    text = _read(p)
    missing += [
      f'{_rel(p)}: {m}'
      for m in sorted(set(pattern.findall(text)))
      if not os.path.exists(os.path.join(ROOT, m))
    ]
  assert not missing, '\n'.join(missing)


def test_bare_module_names_the_docs_use_exist():
  """A module named without its folder (`gpipe.py`, `ring.py`) in README.md, docs/ or BUILD_NOTES.md
  is the name of a file of the repository: a removed module's name goes from the documentation too."""
  names = set()
  for _dirpath, dirnames, filenames in os.walk(ROOT):
    dirnames[:] = [d for d in dirnames if not d.startswith('.') and d not in ('__pycache__', 'runs', 'build')]
    names |= set(filenames)
  missing = [
    f'{_rel(p)}: {m}'
    for p in [README, BUILD_NOTES] + DOCS
    for m in sorted(set(re.findall(r'(?<![\w/.-])(\w+\.py)\b', _read(p))))
    if m not in names
  ]
  assert not missing, '\n'.join(missing)
