"""The package's shape, read from the source with `ast` (no jax, nothing imported).

  * the packages are ranked, bottom to top (RANK): a module imports only from its own package or
    from packages below it. Every import counts: module level, inside functions, and under
    `if TYPE_CHECKING:` (a type is a dependency a reader follows too);
  * no import cycles among jax3d modules (inside a package too, and through a package's __init__.py,
    which importing any of its modules runs);
  * library modules never import the command modules (`python -m jax3d.train` and friends);
  * only jax3d/parallel/ writes collectives (psum, all_gather, ppermute, shard_map, ...) and names
    mesh axes in a PartitionSpec;
  * no `jax._src` (jax's private internals) outside the functions allowed below, with the reason;
  * every module holds at most MAX_CODE_TOKENS tokens of code (docstrings, comments and layout not
    counted), unless allowed below with the reason; no statements joined onto one line, no
    docstring or comment line past the formatter's line length;
  * every public function of every module has annotations on all parameters and its return.

Each allow-list must stay exact: an entry that is no longer needed fails the test too, so the lists
only shrink.
"""

from __future__ import annotations

import ast
import io
import os
import tokenize
from collections.abc import Iterator

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = 'jax3d'

# The commands behind `python -m jax3d.NAME` (and their shared flag parsing): they sit on top of
# the library, which must not import them back.
COMMAND_MODULES = frozenset(
  f'jax3d.{n}'
  for n in ('train', 'plan', 'inspect', 'report', 'sample', 'prepare', 'export', 'batch', 'eval', 'cli')
)

# The packages (and top-level modules) from the bottom up. A unit imports only units before it.
RANK = (
  'jax3d.errors',  # error types and exit statuses
  'jax3d.config',  # keys, loading, validation into the run plan
  'jax3d.devices',  # device descriptions: GPU flags, compile-only GPU targets, the CPU heap
  'jax3d.configs',  # the shipped configs (configs/*.py)
  'jax3d.setup',  # the built run (Setup)
  'jax3d.parallel',  # mesh, shardings, collectives, pipeline, remat
  'jax3d.model',  # the decoder, its formulas, KV-cache decoding
  'jax3d.data',  # corpora, tokenizers, shards, batches
  'jax3d.hf',  # Hugging Face in and out
  'jax3d.optim',  # the optimizer
  'jax3d.loss',  # the loss and its gradients over the run's layout
  'jax3d.step',  # the train step
  'jax3d.scoring',  # per-token scores of packed requests: the eval step's program (lm-eval)
  'jax3d.analysis',  # compiled memory, FLOPs, collectives; memory curves; plots
  'jax3d.assemble',  # the one build path
  'jax3d.planning',  # cost model, planner, OOM ladder
  'jax3d.harness',  # lm-evaluation-harness: jax3d as its model, requests in rows, local tasks
  'jax3d.trainer',  # the Trainer, its loop, checkpoints, metrics, multi-host, a run's workdir
  'jax3d.api',  # the Python API
  'jax3d.cli',  # the commands' flag parsing
  'jax3d.train',  # the commands
  'jax3d.plan',
  'jax3d.inspect',
  'jax3d.report',
  'jax3d.sample',
  'jax3d.prepare',
  'jax3d.export',
  'jax3d.batch',
  'jax3d.eval',
  'jax3d',  # the package: lazy access to the API and the submodules
)

# Import edges (importer, imported) that close a known cycle, with the cycle; they are left out
# when looking for cycles. Temporary: each one goes once its cycle is broken (the test below then
# asks for its removal). None at present.
KNOWN_CYCLES: dict[tuple[str, str], str] = {}

# Functions (module.qualified_name) allowed to use jax._src, and why no public API does the job.
JAX_SRC_ALLOWED = {
  'jax3d.api._backend_started': (
    'whether jax has started its backends (fake CPU devices can only be set before); jax has no '
    'public query that does not itself start them'
  ),
  'jax3d.planning.residuals._saved_residuals': (
    'the residuals a rematerialisation policy keeps, as data; jax.ad_checkpoint only prints them'
  ),
  'jax3d.trainer.distributed._jax_coordinator_address': (
    'the coordinator address jax.distributed.initialize settled on (it may have auto-detected it); '
    'jax.distributed has no public accessor'
  ),
}

# How much code one module may hold, in tokens of code: names, operators, literals (docstrings,
# comments, blank lines and line breaks not counted). Not a line cap: a line cap rewards joining
# statements, reflowing docstrings past the line length and turning an `if` into a conditional
# expression to get under it, which makes a module harder to read, not shorter. A token count does
# not move when code is laid out differently, so the only way under it is to move code out: split
# by concern. 3000 tokens is about 300 lines of plain code, a module read in one sitting (the
# largest today: model/blockwise.py, about 2990). The layout rules below keep what the formatter
# cannot: one statement per line, and docstrings and comments within its line length.
MAX_CODE_TOKENS = 3000
LINE_LENGTH = 110  # pyproject.toml's [tool.ruff] line-length
# Modules allowed over MAX_CODE_TOKENS, and why they are one module.
LONG_MODULES: dict[str, str] = {}
# Modules whose docstring or comment lines may pass LINE_LENGTH, and why.
LONG_TEXT_LINES: dict[str, str] = {
  'jax3d/config/keys.py': 'its key comments are rewritten with the typed config (issue 54 item 8)',
}


def _module_files() -> dict[str, str]:
  """{module name: path relative to the repository} of every module under jax3d/."""
  out = {}
  for dirpath, dirnames, filenames in os.walk(os.path.join(REPO, PACKAGE)):
    dirnames[:] = sorted(d for d in dirnames if not d.startswith(('.', '__')))
    for name in sorted(filenames):
      if name.endswith('.py'):
        rel = os.path.relpath(os.path.join(dirpath, name), REPO)
        parts = rel[:-3].split(os.sep)
        if parts[-1] == '__init__':
          parts.pop()
        out['.'.join(parts)] = rel.replace(os.sep, '/')
  return out


MODULES = _module_files()


def _parse(rel: str) -> ast.Module:
  with open(os.path.join(REPO, rel)) as f:
    return ast.parse(f.read(), filename=rel)


def _imports(module: str, tree: ast.Module, is_package: bool) -> set[str]:
  """The jax3d modules `module` (its source parsed as `tree`) imports anywhere: at module level,
  inside functions, under `if TYPE_CHECKING:`."""
  package = module if is_package else module.rpartition('.')[0]
  found = set()
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      names = [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ''
      if node.level:
        anchor = package.split('.')[: len(package.split('.')) - node.level + 1]
        base = '.'.join(anchor + ([base] if base else []))
      # `from pkg import x` imports the submodule pkg.x when there is one, else pkg itself.
      names = [f'{base}.{a.name}' if f'{base}.{a.name}' in MODULES else base for a in node.names]
    else:
      continue
    for name in names:
      while name and name not in MODULES:  # `import jax3d.a.b` without a module a.b: the nearest one
        name = name.rpartition('.')[0]
      if name.startswith(PACKAGE) and name != module:
        found.add(name)
  return found


GRAPH = {m: _imports(m, _parse(rel), rel.endswith('__init__.py')) for m, rel in MODULES.items()}


def _with_package_inits(graph: dict[str, set[str]], modules: dict[str, str]) -> dict[str, set[str]]:
  """`graph` plus the edges Python adds: importing `a.b.c` first runs `a/__init__.py` and
  `a/b/__init__.py`, so a module importing a.b.c also depends on the packages a.b and a (the ones
  in `modules`). A module inside a package does not: its package ran before it. The root package
  is left out: jax3d/__init__.py imports nothing (its API loads on first use, with importlib), as
  `test_the_root_package_imports_nothing` checks."""
  out = {m: set(deps) for m, deps in graph.items()}
  for m, deps in graph.items():
    for n in deps:
      parts = n.split('.')
      for i in range(2, len(parts)):
        pkg = '.'.join(parts[:i])
        if (
          pkg in modules and modules[pkg].endswith('__init__.py') and pkg != m and not m.startswith(pkg + '.')
        ):
          out[m].add(pkg)
  return out


RUN_GRAPH = _with_package_inits(GRAPH, MODULES)  # what runs when each module is imported


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
  """One cycle as [a, b, ..., a], or None when the graph has none."""
  state: dict[str, int] = {}  # 1: on the current path, 2: done
  path: list[str] = []

  def visit(node: str) -> list[str] | None:
    state[node] = 1
    path.append(node)
    for nxt in sorted(graph.get(node, ())):
      if state.get(nxt) == 1:
        return path[path.index(nxt) :] + [nxt]
      if nxt not in state and (cycle := visit(nxt)):
        return cycle
    path.pop()
    state[node] = 2
    return None

  for start in sorted(graph):
    if start not in state and (cycle := visit(start)):
      return cycle
  return None


def test_no_import_cycles():
  """No cycle among the modules, inside a package too, nor through a package's __init__.py."""
  graph = {m: {n for n in deps if (m, n) not in KNOWN_CYCLES} for m, deps in RUN_GRAPH.items()}
  cycle = _find_cycle(graph)
  assert cycle is None, 'import cycle: ' + ' -> '.join(cycle)


def test_known_cycles_are_still_cycles():
  for (a, b), why in KNOWN_CYCLES.items():
    assert b in RUN_GRAPH.get(a, ()), f'KNOWN_CYCLES lists {a} -> {b} ({why}), which is gone: remove it'
    assert _find_cycle({**RUN_GRAPH, a: {b}}) is not None, (
      f'KNOWN_CYCLES lists {a} -> {b} ({why}), which no longer closes a cycle: remove it'
    )


def test_the_cycle_finder_finds_cycles():
  assert _find_cycle({'a': {'b'}, 'b': {'c'}, 'c': {'a'}}) == ['a', 'b', 'c', 'a']
  assert _find_cycle({'a': {'b', 'c'}, 'b': {'c'}, 'c': set()}) is None


def test_the_cycle_check_sees_cycles_inside_a_package_and_through_its_init():
  modules = {
    'jax3d.p': 'jax3d/p/__init__.py',
    'jax3d.p.zero3': 'jax3d/p/zero3.py',
    'jax3d.p.pipe': 'jax3d/p/pipe/__init__.py',
    'jax3d.p.pipe.chunk': 'jax3d/p/pipe/chunk.py',
    'jax3d.p.pipe.loop': 'jax3d/p/pipe/loop.py',
  }
  # issue 54's cycle: zero3 imports pipe.chunk, which runs pipe/__init__.py, which imports zero3
  graph = {'jax3d.p.zero3': {'jax3d.p.pipe.chunk'}, 'jax3d.p.pipe': {'jax3d.p.zero3'}}
  assert _find_cycle(graph) is None  # the import statements alone hide it
  assert _find_cycle(_with_package_inits(graph, modules)) == ['jax3d.p.pipe', 'jax3d.p.zero3', 'jax3d.p.pipe']
  # a module inside the package importing a sibling does not run the package's __init__ again
  inside = {'jax3d.p.pipe': {'jax3d.p.pipe.loop'}, 'jax3d.p.pipe.loop': {'jax3d.p.pipe.chunk'}}
  assert _find_cycle(_with_package_inits(inside, modules)) is None
  # between two modules of one package
  assert _find_cycle(
    {'jax3d.p.pipe.loop': {'jax3d.p.pipe.chunk'}, 'jax3d.p.pipe.chunk': {'jax3d.p.pipe.loop'}}
  )


def test_the_root_package_imports_nothing():
  assert not GRAPH[PACKAGE], f'jax3d/__init__.py imports {sorted(GRAPH[PACKAGE])}: load them on first use'


def _lazy_exports(tree: ast.Module) -> tuple[dict[str, str], dict[str, str]]:
  """A package's lazy re-exports: ({name: module} of its `_EXPORTS` table, {name: module} of its
  imports under `if TYPE_CHECKING:`)."""
  table: dict[str, str] = {}
  typed: dict[str, str] = {}
  for node in tree.body:
    if isinstance(node, ast.Assign) and any(
      isinstance(t, ast.Name) and t.id == '_EXPORTS' for t in node.targets
    ):
      table = ast.literal_eval(node.value)
    elif isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == 'TYPE_CHECKING':
      for imp in node.body:
        if isinstance(imp, ast.ImportFrom):
          typed |= {a.name: imp.module.rpartition('.')[2] for a in imp.names}
  return table, typed


def test_lazy_re_exports_are_listed_for_readers():
  """A package that loads its re-exports on first use (`_EXPORTS`, `__getattr__`) imports the same
  names under `if TYPE_CHECKING:`, so readers, type checkers and this test's graph see them."""
  found = 0
  for module, rel in MODULES.items():
    table, typed = _lazy_exports(_parse(rel))
    if table:
      found += 1
      package = module.rpartition('.')[2]
      assert table == typed, f'{rel}: _EXPORTS {table} but TYPE_CHECKING imports {typed} ({package})'
  assert found, 'no package with lazy re-exports: drop this test'


def test_the_import_graph_sees_every_import():
  src = (
    'from typing import TYPE_CHECKING\n'
    'import jax3d.data.corpus\n'
    'from jax3d import config, no_such_module\n'
    'from jax3d.parallel import mesh as mesh_lib\n'
    'from . import checkpoint\n'
    'from ..analysis.hlo import parse_hlo\n'
    'if TYPE_CHECKING:\n  from jax3d import step\n'
    'def f():\n  from jax3d.model import llama\n'
  )
  found = _imports('jax3d.trainer.trainer', ast.parse(src), is_package=False)
  assert found == {
    'jax3d',
    'jax3d.config',
    'jax3d.model.llama',
    'jax3d.parallel.mesh',
    'jax3d.analysis.hlo',
    'jax3d.trainer.checkpoint',
    'jax3d.data.corpus',
    'jax3d.step',
  }


def _unit(module: str) -> str:
  """The RANK entry a module belongs to: its package below jax3d, or the top-level module."""
  parts = module.split('.')
  return '.'.join(parts[:2])


def _rank_violations(graph: dict[str, set[str]]) -> list[str]:
  rank = {u: i for i, u in enumerate(RANK)}
  bad = []
  for m, deps in sorted(graph.items()):
    for n in sorted(deps):
      a, b = _unit(m), _unit(n)
      if a != b and rank[b] > rank[a]:
        bad.append(f'{m} ({a}, rank {rank[a]}) imports {n} ({b}, rank {rank[b]})')
  return bad


def test_every_module_has_a_rank():
  missing = sorted({_unit(m) for m in MODULES} - set(RANK))
  assert not missing, f'packages or top-level modules not in RANK (place them in the house): {missing}'
  stale = sorted(set(RANK) - {_unit(m) for m in MODULES})
  assert not stale, f'RANK names units that no longer exist: {stale}'


def test_imports_go_down_the_rank():
  bad = _rank_violations(GRAPH)
  assert not bad, 'imports that go up the package rank (move the code down, or pass it in): ' + '; '.join(bad)


def test_the_rank_check_sees_an_import_going_up():
  assert _rank_violations({'jax3d.model.llama': {'jax3d.trainer.trainer'}})
  assert not _rank_violations({'jax3d.trainer.trainer': {'jax3d.model.llama', 'jax3d.trainer.checkpoint'}})


def test_the_house_reads_bottom_up():
  """The package graph drawn from the imports: every arrow points to a unit lower in RANK (the
  drawing a reader can make of `python -c` over this test's GRAPH)."""
  edges = {(_unit(m), _unit(n)) for m, deps in GRAPH.items() for n in deps if _unit(m) != _unit(n)}
  rank = {u: i for i, u in enumerate(RANK)}
  assert edges, 'no edges: the import scan found nothing'
  assert all(rank[a] > rank[b] for a, b in edges), sorted(e for e in edges if rank[e[0]] <= rank[e[1]])


def test_library_never_imports_a_command():
  assert COMMAND_MODULES <= set(MODULES), sorted(COMMAND_MODULES - set(MODULES))
  bad = [
    f'{m} imports {n}'
    for m, deps in sorted(GRAPH.items())
    if m not in COMMAND_MODULES
    for n in sorted(deps & COMMAND_MODULES)
  ]
  assert not bad, 'library modules import command modules: ' + '; '.join(bad)


# Collectives and shard_map: written only in jax3d/parallel/ (the model and the train step speak
# logical axes; the parallel package maps them to the mesh and moves the bytes).
COLLECTIVES = frozenset(
  (
    'psum',
    'pmean',
    'pmax',
    'pmin',
    'psum_scatter',
    'all_gather',
    'all_to_all',
    'ppermute',
    'axis_index',
    'shard_map',
  )
)
MESH_AXES = frozenset(('dp', 'pp', 'tp'))
MESH_AXIS_CONSTANTS = frozenset(('DP', 'PP', 'TP'))


def _mesh_uses(tree: ast.AST) -> list[tuple[int, str]]:
  """(line, what) of every collective call, every mesh-axis constant (`sharding.TP`) and every
  PartitionSpec naming a mesh axis by its string."""
  found = []
  for node in ast.walk(tree):
    if isinstance(node, ast.Call):
      f = node.func
      name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None
      if name in COLLECTIVES:
        found.append((node.lineno, f'calls {name}'))
      if name in ('P', 'PartitionSpec'):
        for arg in ast.walk(node):
          if isinstance(arg, ast.Constant) and arg.value in MESH_AXES:
            found.append((node.lineno, f'PartitionSpec names mesh axis {arg.value!r}'))
    elif isinstance(node, ast.Attribute) and node.attr in MESH_AXIS_CONSTANTS:
      found.append((node.lineno, f'names mesh axis constant {node.attr}'))
    elif isinstance(node, ast.ImportFrom) and any(
      a.name in MESH_AXIS_CONSTANTS | COLLECTIVES for a in node.names
    ):
      found.append((node.lineno, f'imports {", ".join(a.name for a in node.names)}'))
  return found


def test_mesh_check_sees_every_form():
  src = (
    'x = jax.lax.psum(y, tp)\nz = all_gather(y, "tp")\ns = P("dp", None)\nt = sharding.TP\n'
    'from jax3d.parallel.sharding import DP\nu = jax.shard_map(f, mesh=m)\n'
  )
  assert sorted(line for line, _ in _mesh_uses(ast.parse(src))) == [1, 2, 3, 4, 5, 6]
  assert not _mesh_uses(ast.parse('s = P("heads", None)\nwith_sharding_constraint(x, s)\nplan.tp'))


def test_only_the_parallel_package_writes_collectives_and_names_mesh_axes():
  bad = [
    f'{rel}:{line} {what}'
    for module, rel in sorted(MODULES.items())
    if not module.startswith('jax3d.parallel')
    for line, what in _mesh_uses(_parse(rel))
  ]
  assert not bad, 'collectives or mesh axes outside jax3d/parallel/: ' + '; '.join(bad)


def _uses_jax_src(node: ast.AST) -> bool:
  if isinstance(node, ast.Import):
    return any(a.name == 'jax._src' or a.name.startswith('jax._src.') for a in node.names)
  if isinstance(node, ast.ImportFrom):
    mod = node.module or ''
    return node.level == 0 and (
      mod == 'jax._src'
      or mod.startswith('jax._src.')
      or (mod == 'jax' and any(a.name == '_src' for a in node.names))
    )
  return (
    isinstance(node, ast.Attribute)
    and node.attr == '_src'
    and (isinstance(node.value, ast.Name) and node.value.id == 'jax')
  )


def test_private_jax_check_sees_every_form():
  for src in (
    'import jax._src.xla_bridge',
    'from jax._src import xla_bridge',
    'from jax import _src',
    'x = jax._src.distributed.global_state',
  ):
    assert any(_uses_jax_src(n) for n in ast.walk(ast.parse(src))), src
  public = ast.parse('import jax\nfrom jax import numpy\nx = y._src')
  assert not any(_uses_jax_src(n) for n in ast.walk(public))


def _jax_src_users() -> dict[str, int]:
  """{module.function (or module.<module> at module level): first line} of every jax._src use."""
  users: dict[str, int] = {}

  def visit(node: ast.AST, module: str, scope: str) -> None:
    for child in ast.iter_child_nodes(node):
      if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        visit(child, module, f'{scope}.{child.name}' if scope else child.name)
        continue
      if _uses_jax_src(child):
        users.setdefault(f'{module}.{scope or "<module>"}', child.lineno)
      visit(child, module, scope)

  for module, rel in MODULES.items():
    visit(_parse(rel), module, '')
  return users


def test_no_private_jax_outside_the_allow_list():
  users = _jax_src_users()
  bad = [
    f'{MODULES[name.rsplit(".", 1)[0]] if name.rsplit(".", 1)[0] in MODULES else name}:{line} ({name})'
    for name, line in sorted(users.items())
    if name not in JAX_SRC_ALLOWED
  ]
  assert not bad, (
    "jax._src is jax's private code (it changes without notice); use the public API, "
    'or isolate the access in one small function and list it in JAX_SRC_ALLOWED: ' + '; '.join(bad)
  )
  stale = sorted(set(JAX_SRC_ALLOWED) - set(users))
  assert not stale, f'JAX_SRC_ALLOWED lists functions that no longer use jax._src: {stale}'


_LAYOUT = frozenset((tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT))
_LAYOUT |= {tokenize.ENCODING, tokenize.ENDMARKER}


def _docstrings(tree: ast.Module) -> set[tuple[int, int]]:
  """(line, column) where each docstring (module, class, function) starts."""
  found = set()
  for node in ast.walk(tree):
    if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
      first = node.body[0]
      if (
        isinstance(first, ast.Expr)
        and isinstance(first.value, ast.Constant)
        and isinstance(first.value.value, str)
      ):
        found.add((first.lineno, first.col_offset))
  return found


def _tokens(src: str) -> list[tokenize.TokenInfo]:
  return list(tokenize.generate_tokens(io.StringIO(src).readline))


def _code_tokens(src: str) -> int:
  """The tokens of code in `src`: not its docstrings, comments, blank lines or line breaks."""
  docs = _docstrings(ast.parse(src))
  return sum(
    1 for t in _tokens(src) if t.type not in _LAYOUT and not (t.type == tokenize.STRING and t.start in docs)
  )


def _is_ellipsis(body: list[ast.stmt]) -> bool:
  """Whether a body is `...` alone: a Protocol's method or a stub, which the formatter keeps on its line."""
  return (
    len(body) == 1 and isinstance(body[0], ast.Expr) and getattr(body[0].value, 'value', None) is Ellipsis
  )


def _joined(src: str) -> list[tuple[int, str]]:
  """(line, what) of every statement that shares its line with another (`a = 1; b = 2`, `if x: y`)
  and every docstring or comment line past LINE_LENGTH."""
  tree = ast.parse(src)
  found = []
  lines: dict[int, list[ast.stmt]] = {}
  for node in ast.walk(tree):
    if isinstance(node, ast.stmt):
      lines.setdefault(node.lineno, []).append(node)
      body = getattr(node, 'body', None)
      stub = isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and _is_ellipsis(body)
      if isinstance(body, list) and body and body[0].lineno == node.lineno and not stub:
        found.append((node.lineno, 'a compound statement with its body on its line'))
  for line, nodes in lines.items():
    if sum(not any(n is not m and n in ast.walk(m) for m in nodes) for n in nodes) > 1:
      found.append((line, 'statements joined with ;'))
  text = src.split('\n')
  docs = _docstrings(tree)
  for t in _tokens(src):
    if t.type == tokenize.COMMENT or (t.type == tokenize.STRING and t.start in docs):
      for line in range(t.start[0], t.end[0] + 1):
        if len(text[line - 1]) > LINE_LENGTH:
          found.append((line, f'a docstring or comment line of {len(text[line - 1])} characters'))
  return sorted(set(found))


def test_the_size_and_layout_checks_see_what_they_should():
  plain = 'def f(a, b):\n  """Doc."""\n  # a comment\n  if a:\n    return b\n  return a\n'
  joined = 'def f(a, b):\n  """Doc."""\n  # a comment\n  if a: return b\n  return a\n'
  assert _code_tokens(plain) == _code_tokens(joined) == 15  # the layout moves no token
  assert _code_tokens(plain.replace('"""Doc."""', '"""' + 'Doc. ' * 50 + '"""')) == 15
  assert not _joined(plain)
  assert not _joined(
    'class P:\n  def m(self) -> int: ...\n'
  )  # a Protocol's method, as the formatter writes it
  assert [w for _, w in _joined(joined)] == ['a compound statement with its body on its line']
  assert [w for _, w in _joined('a = 1; b = 2\nc = 3\n')] == ['statements joined with ;']
  assert [w for _, w in _joined('"""' + 'x' * 120 + '"""\n')] == [
    'a docstring or comment line of 126 characters'
  ]
  assert not _joined('s = "' + 'x' * 120 + '"\n')  # a long string in code is the formatter's to keep whole


def test_modules_hold_a_readable_amount_of_code():
  sizes = {rel: _code_tokens(open(os.path.join(REPO, rel)).read()) for rel in MODULES.values()}
  bad = [f'{rel}: {n}' for rel, n in sorted(sizes.items()) if n > MAX_CODE_TOKENS and rel not in LONG_MODULES]
  assert not bad, (
    f'modules over {MAX_CODE_TOKENS} tokens of code (split them by concern, or list them in LONG_MODULES): {bad}'
  )
  stale = sorted(rel for rel in LONG_MODULES if sizes.get(rel, 0) <= MAX_CODE_TOKENS)
  assert not stale, f'LONG_MODULES lists modules no longer over {MAX_CODE_TOKENS} tokens: {stale}'


def test_one_statement_per_line_and_text_within_the_line_length():
  found = {rel: _joined(open(os.path.join(REPO, rel)).read()) for rel in MODULES.values()}
  bad = [
    f'{rel}:{line} {what}'
    for rel, hits in sorted(found.items())
    if rel not in LONG_TEXT_LINES
    for line, what in hits
  ]
  assert not bad, 'write one statement per line, and wrap docstrings and comments: ' + '; '.join(bad)
  stale = sorted(rel for rel in LONG_TEXT_LINES if not found.get(rel))
  assert not stale, f'LONG_TEXT_LINES lists modules whose lines all fit now: {stale}'


def _public_functions(tree: ast.Module) -> Iterator[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef, bool]]:
  """(qualified name, node, is_method) of the module-level functions and the methods of
  module-level classes whose names (and class names) do not start with '_'."""
  for node in tree.body:
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not node.name.startswith('_'):
      yield node.name, node, False
    elif isinstance(node, ast.ClassDef) and not node.name.startswith('_'):
      for item in node.body:
        if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and not item.name.startswith('_'):
          yield f'{node.name}.{item.name}', item, True


def _missing_annotations(fn: ast.FunctionDef | ast.AsyncFunctionDef, is_method: bool) -> list[str]:
  args = fn.args
  positional = args.posonlyargs + args.args
  is_static = any(isinstance(d, ast.Name) and d.id == 'staticmethod' for d in fn.decorator_list)
  if is_method and not is_static and positional:
    positional = positional[1:]  # self / cls
  params = positional + [args.vararg] + args.kwonlyargs + [args.kwarg]
  missing = [a.arg for a in params if a is not None and a.annotation is None]
  if fn.returns is None:
    missing.append('return')
  return missing


def test_annotation_check_sees_what_is_missing():
  tree = ast.parse(
    'def f(a, b: int, *c, d=1, **e): pass\n'
    'class C:\n  def m(self, x: int) -> None: ...\n  def _p(self, y): ...\n'
    '  @staticmethod\n  def s(z) -> int: ...\n'
  )
  found = {name: _missing_annotations(fn, method) for name, fn, method in _public_functions(tree)}
  assert found == {'f': ['a', 'c', 'd', 'e', 'return'], 'C.m': [], 'C.s': ['z']}


def test_public_functions_are_annotated():
  bad = []
  for rel in MODULES.values():
    for name, fn, is_method in _public_functions(_parse(rel)):
      missing = _missing_annotations(fn, is_method)
      if missing:
        bad.append(f'{rel}:{fn.lineno} {name} ({", ".join(missing)})')
  assert not bad, 'public functions without annotations: ' + '; '.join(bad)
