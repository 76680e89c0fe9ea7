"""What README.md names exists, and what it quotes equals its source.

  * every module it names: dotted (`jax3d.parallel.mesh`, `python -m jax3d.plan`, `jax3d.build`: a
    module, or a name bound in one), a path (`jax3d/parallel/context.py`), a bare file name beside
    a path in the same table cell (`gpipe.py` beside `jax3d/parallel/pipeline/`), and the package
    ranking line, which must be test_architecture's RANK itself;
  * every figure it quotes (a number with a unit: GB, GiB, MiB, %, x, /s; or a tolerance written
    1e-5): FIGURES says where each comes from, and how to read it there; the figure is recomputed
    from its source (a docs page, a bench table, a test's constant) and must be written the same.
    A figure in the README that FIGURES does not list fails, so a new number comes with its source.

Imports nothing of jax3d (the modules are found on disk, their names with `ast`); fast.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import re
from collections.abc import Callable

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, 'README.md')


def _read(rel: str) -> str:
  with open(os.path.join(ROOT, rel)) as f:
    return f.read()


def _prose(text: str) -> str:
  """The README without its fenced blocks (commands and sample output, not quoted figures)."""
  return re.sub(r'^```.*?^```', '', text, flags=re.S | re.M)


# ---------------------------------------------------------------------------------------------
# Modules
# ---------------------------------------------------------------------------------------------


def _module_path(dotted: str) -> str | None:
  """The file of module `dotted` (jax3d.a.b), or None when there is none."""
  base = os.path.join(ROOT, *dotted.split('.'))
  for path in (base + '.py', os.path.join(base, '__init__.py')):
    if os.path.exists(path):
      return path
  return None


def _top_level_names(path: str) -> set[str]:
  """Names a module binds at its top level (functions, classes, assignments, imports), and the
  names of jax3d's lazily loaded API (`_API` in jax3d/__init__.py)."""
  with open(path) as f:
    tree = ast.parse(f.read())
  names = set()
  for node in tree.body:
    if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
      names.add(node.name)
    elif isinstance(node, ast.Import | ast.ImportFrom):
      names |= {(a.asname or a.name).split('.')[0] for a in node.names}
    elif isinstance(node, ast.Assign | ast.AnnAssign):
      targets = node.targets if isinstance(node, ast.Assign) else [node.target]
      names |= {t.id for t in targets if isinstance(t, ast.Name)}
      if any(isinstance(t, ast.Name) and t.id == '_API' for t in targets):
        names |= set(ast.literal_eval(node.value))
  return names


def _dotted_exists(dotted: str) -> bool:
  """jax3d.a.b is a module, or a name bound at the top level of the longest module prefix."""
  parts = dotted.split('.')
  for n in range(len(parts), 0, -1):
    path = _module_path('.'.join(parts[:n]))
    if path:
      return n == len(parts) or parts[n] in _top_level_names(path)
  return False


def dotted_names(text: str) -> set[str]:
  """Every `jax3d.x.y` the text names (not inside a path or a URL; `jax3d.X`, the placeholder of
  "python -m jax3d.X", left out), calls' parentheses dropped."""
  return set(re.findall(r'(?<![\w/.-])jax3d(?:\.[A-Za-z_]\w*)+', text)) - {'jax3d.X'}


def commands(text: str) -> set[str]:
  """The modules of `python -m jax3d.X` commands (an `X` placeholder left out)."""
  return {m for m in re.findall(r'python -m (jax3d(?:\.\w+)+)', text) if m != 'jax3d.X'}


def cell_files(text: str) -> set[str]:
  """Bare file names in a table cell (`gpipe.py`), as paths under the cell's first folder."""
  out = set()
  for line in text.splitlines():
    if not line.startswith('|'):
      continue
    for cell in line.split('|'):
      names = re.findall(r'`([\w./-]+)`', cell)
      folder = next((os.path.dirname(n) for n in names if '/' in n), None)
      if folder:
        out |= {f'{folder}/{n}' for n in names if '/' not in n and re.fullmatch(r'\w+\.py', n)}
  return out


def ranking(text: str) -> list[str]:
  """The packages of the README's ranking line, bottom to top: `a` < `b` < ... < the commands."""
  flat = ' '.join(text.split())
  m = re.search(r'ranked bottom to top[^:]*: ((?:`[\w.]+` < )+)the commands', flat)
  assert m, 'README.md lost its line ranking the packages (`errors` < `config` < ... < the commands)'
  return re.findall(r'`([\w.]+)`', m[1])


def _architecture_rank() -> tuple[str, ...]:
  spec = importlib.util.spec_from_file_location(
    'test_architecture', os.path.join(ROOT, 'tests', 'test_architecture.py')
  )
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.RANK, module.COMMAND_MODULES


def test_every_module_the_readme_names_exists():
  text = _read('README.md')
  missing = [
    f'{n} (no module, nor a name in one)' for n in sorted(dotted_names(text)) if not _dotted_exists(n)
  ]
  for module in sorted(commands(text)):
    path = _module_path(module)
    if not path or "__name__ == '__main__'" not in open(path).read():
      missing.append(f'python -m {module} (no command module)')
  missing += [
    f'{p} (no such file)' for p in sorted(cell_files(text)) if not os.path.exists(os.path.join(ROOT, p))
  ]
  assert not missing, 'README.md names what does not exist:\n' + '\n'.join(missing)


def test_the_ranking_line_is_the_architecture_tests():
  """The README's ranking is RANK of tests/test_architecture.py, the library's units in order up to
  the commands."""
  rank, command_modules = _architecture_rank()
  library = [u.removeprefix('jax3d.') for u in rank if u not in command_modules and u != 'jax3d']
  library += ['cli'] if 'jax3d.cli' in rank and 'cli' not in library else []
  assert ranking(_read('README.md')) == library


def test_the_checks_see_a_wrong_name():
  assert _dotted_exists('jax3d.parallel.mesh') and _dotted_exists('jax3d.build')
  assert not _dotted_exists('jax3d.training') and not _dotted_exists('jax3d.parallel.ring')
  assert not _dotted_exists('jax3d.no_such_function')
  assert dotted_names('`python -m jax3d.plan`, jax3d/parallel/x.py, jax3d.build(cfg)') == {
    'jax3d.plan',
    'jax3d.build',
  }
  assert cell_files('| pp | `jax3d/parallel/pipeline/` (`chunk.py`, `gone.py`) | x |') == {
    'jax3d/parallel/pipeline/chunk.py',
    'jax3d/parallel/pipeline/gone.py',
  }
  assert ranking('ranked bottom to top (x): `errors` < `record` < the commands') == ['errors', 'record']


# ---------------------------------------------------------------------------------------------
# Figures
# ---------------------------------------------------------------------------------------------

# A quoted figure: a number with a unit, or a tolerance in e-notation.
FIGURE = re.compile(
  r'(?<![\w.=-])-?\d[\d,]*(?:\.\d+)?(?:-\d[\d,]*(?:\.\d+)?)?(?:\s?(?:GB|GiB|MiB)\b|%|x(?![\w])|(?:\s[a-z]+)?/s\b)'
  r'|(?<![\w.])\d(?:\.\d+)?e-\d+\b'
)


def _num(pattern: str, text: str, group: int = 1) -> float:
  m = re.search(pattern, text, re.S)
  assert m, f'the source no longer says {pattern!r}'
  return float(m[group].replace(',', ''))


def _table(text: str, header: str) -> list[list[str]]:
  """The body rows of the markdown table whose header row starts with `header`."""
  lines = text.splitlines()
  start = next(i for i, line in enumerate(lines) if line.startswith(header))
  rows = []
  for line in lines[start + 2 :]:
    if not line.startswith('|'):
      break
    rows.append([c.strip() for c in line.strip('|').split('|')])
  return rows


def _segment_cost(text: str) -> str:
  ratios = [float(r[3]) for r in _table(text, '| layout | without (ms)')]
  return f'{(min(ratios) - 1) * 100:.1f}-{(max(ratios) - 1) * 100:.1f}%'


def _zero3(dp: int, shard: str, column: str) -> Callable[[str], str]:
  """A cell of docs/performance.md's bytes-against-dp table, in MiB rounded as the README writes it:
  'state' = params + optimizer, 'temp' = XLA's temp."""

  def read(text: str) -> str:
    row = next(r for r in _table(text, '| dp | shard_params |') if r[0] == str(dp) and r[1] == shard)
    value = float(row[2].split()[0]) + float(row[3].split()[0]) if column == 'state' else float(row[6])
    return f'{value:.0f} MiB'

  return read


def _chat(variant: str, unit: str) -> Callable[[str], str]:
  def read(text: str) -> str:
    rows = json.loads(text)['rows']
    return f'{rows[variant]["conv_per_s"]:,.0f}{unit}'

  return read


def _quote(pattern: str, form: str = '{}', group: int = 1) -> Callable[[str], str]:
  """The number `pattern`'s group reads in the source, written as `form` writes it ('{:.0f} GB');
  '{:e}' writes a tolerance as 1e-5."""

  def read(text: str) -> str:
    value = _num(pattern, text, group)
    if form == '{:e}':
      digits = next(d for d in range(9) if float(f'{value:.{d}e}') == value)
      return re.sub(r'e-0*(\d)', r'e-\1', f'{value:.{digits}e}')
    return form.format(value)

  return read


def _speedup(text: str) -> str:
  fast, slow = _num(r'([\d.]+) ms a step against', text), _num(r'against ([\d.]+) \(median of 10\)', text)
  return f'{slow / fast:.2f}x'


VERIFIED_8B = r'ga 4 \(the command above[^|]*\| ([\d.]+) GB \| ([\d.]+) GB \(([-\d.]+)%'

# README figure -> (its source, relative to the repository; how to read the figure there).
FIGURES: dict[str, tuple[str, Callable[[str], str]]] = {
  '1e-5': ('tests/test_equivalence.py', _quote(r'RTOL, ATOL = ([\de.-]+),', '{:e}')),
  '5.5 GB': ('pyproject.toml', _quote(r'about ([\d.]+) GB', '{} GB')),
  '1e-4': ('jax3d/trainer/export_parity.py', _quote(r'TOLERANCE = ([\de.-]+)', '{:e}')),
  '1.4-2.4%': ('docs/performance.md', _segment_cost),
  '1,265 conversations/s': (
    'docs/bench/bench_prepare_chat.json',
    _chat('jax3d.prepare, 1 worker(s)', ' conversations/s'),
  ),
  '1,368/s': (
    'docs/bench/bench_prepare_chat.json',
    _chat('transformers apply_chat_template (+mask), 1 process', '/s'),
  ),
  '288 MiB': ('docs/performance.md', _zero3(2, 'off', 'state')),
  '144 MiB': ('docs/performance.md', _zero3(2, 'layer', 'state')),
  '36 MiB': ('docs/performance.md', _zero3(8, 'layer', 'state')),
  '256 MiB': ('docs/performance.md', _zero3(2, 'off', 'temp')),
  '169 MiB': ('docs/performance.md', _zero3(2, 'layer', 'temp')),
  '192 MiB': ('docs/performance.md', _zero3(8, 'off', 'temp')),
  '85 MiB': ('docs/performance.md', _zero3(8, 'layer', 'temp')),
  # the planner's figure (tests/test_zero3_plan.py checks it is what the code estimates)
  '56.6 GB': ('docs/plan.md', _quote(r'loss_chunks=8 +# ([\d.]+) GB estimated', '{} GB')),
  # plan --verify's row of the same layout: its estimate, XLA:GPU's bytes, the difference
  '56.2 GB': ('docs/plan.md', _quote(VERIFIED_8B, '{} GB')),
  '61.15 GB': ('docs/plan.md', _quote(VERIFIED_8B, '{} GB', group=2)),
  '-8.1%': ('docs/plan.md', _quote(VERIFIED_8B, '{}%', group=3)),
  '60.96 GB': ('docs/plan.md', _quote(r'documents. bias .{0,60}?to ([\d.]+) GB', '{} GB')),
  '130 GB': ('docs/plan.md', _quote(r'same 8B plan compiled to ([\d.]+) GB', '{:.0f} GB')),
  '6.7e-6': ('docs/plan.md', _quote(r"cuDNN's losses equal XLA's within\s+([\de.-]+)", '{:e}')),
  '1.67x': ('docs/plan.md', _speedup),
}


def quoted_figures(text: str) -> list[str]:
  return [' '.join(m.group().split()) for m in FIGURE.finditer(_prose(text))]  # a unit on the next line too


def test_every_figure_the_readme_quotes_has_a_source():
  unlisted = sorted(set(quoted_figures(_read('README.md'))) - set(FIGURES))
  assert not unlisted, f'README.md quotes figures FIGURES does not source: {unlisted}'


@pytest.mark.parametrize('figure', sorted(FIGURES))
def test_figure_equals_its_source(figure):
  source, read = FIGURES[figure]
  assert figure in quoted_figures(_read('README.md')), (
    f'README.md no longer quotes {figure}: drop it from FIGURES'
  )
  assert read(_read(source)) == figure, f'README.md quotes {figure}; {source} says {read(_read(source))}'


def test_the_figure_pattern():
  text = 'at 56.6 GB, -8.1%; 1.4-2.4% of it, 1.67x the speed, 1,186/s, 733 conversations/s, within 1e-5, dp=2 x pp=2'
  assert quoted_figures(text) == [
    '56.6 GB',
    '-8.1%',
    '1.4-2.4%',
    '1.67x',
    '1,186/s',
    '733 conversations/s',
    '1e-5',
  ]
  assert quoted_figures('```\n99 GB\n```\nLlama 3 8B, (1,2,4), x86-64') == []
  assert quoted_figures('it was 130\nGB') == ['130 GB']
