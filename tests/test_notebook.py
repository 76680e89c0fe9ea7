"""notebooks/quickstart.ipynb runs top to bottom in a fresh kernel, and its checks hold.

The notebook asserts its own numbers (the losses of the layouts agree, the bubble of the run equals
the formula, remat shrinks the compiled temporaries, a resumed run continues at step 6), so a cell
error is a wrong number as much as a crash. The kernel starts with XLA_FLAGS unset, as on a fresh
laptop, so the notebook's own `jax3d.use_fake_cpu_devices(8)` is what makes the 8 devices.
"""

import os
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOK = os.path.join(ROOT, 'notebooks', 'quickstart.ipynb')


def _kernel_env() -> dict:
  # No MPLBACKEND: ipykernel's inline backend is what puts the figures into the outputs.
  env = {k: v for k, v in os.environ.items() if k not in ('XLA_FLAGS', 'MPLBACKEND')}
  env['JAX_PLATFORMS'] = 'cpu'  # the notebook is the CPU tutorial, also on a GPU test machine
  env['PYTHONPATH'] = os.pathsep.join([ROOT] + [p for p in env.get('PYTHONPATH', '').split(os.pathsep) if p])
  return env


def test_notebook_uses_only_the_public_api():
  """The tutorial teaches the public API: `import jax3d` and names it exports, no submodules."""
  import nbformat

  import jax3d

  nb = nbformat.read(NOTEBOOK, as_version=4)
  src = '\n'.join(c.source for c in nb.cells if c.cell_type == 'code')
  assert 'from jax3d' not in src and 'import jax3d.' not in src
  used = {w.split('(')[0] for w in src.replace('jax3d.', '\0').split('\0')[1:]}
  assert used <= set(jax3d.__all__), used - set(jax3d.__all__)


@pytest.mark.slow
def test_quickstart_notebook_runs():
  nbformat = pytest.importorskip('nbformat')
  nbclient = pytest.importorskip('nbclient')
  pytest.importorskip('ipykernel')
  nb = nbformat.read(NOTEBOOK, as_version=4)
  client = nbclient.NotebookClient(
    nb, timeout=600, kernel_name='python3', resources={'metadata': {'path': os.path.dirname(NOTEBOOK)}}
  )
  # 'python3' is ipykernel's own kernel: jupyter_client starts it with sys.executable, the
  # interpreter (venv) running the tests, so nothing has to be installed or registered.
  t0 = time.time()
  client.execute(env=_kernel_env())
  print(f'notebook ran in {time.time() - t0:.0f} s')
  if os.environ.get('JAX3D_NOTEBOOK_OUT'):  # keep the executed notebook, to read its outputs
    nbformat.write(nb, os.environ['JAX3D_NOTEBOOK_OUT'])
  errors = [
    o
    for c in nb.cells
    if c.cell_type == 'code'
    for o in c.get('outputs', [])
    if o.get('output_type') == 'error'
  ]
  assert not errors, errors
  text = '\n'.join(
    o.get('text', '')
    for c in nb.cells
    if c.cell_type == 'code'
    for o in c.get('outputs', [])
    if o.get('output_type') == 'stream'
  )
  assert 'largest difference between layouts' in text
  assert 'continued with steps [6, 7, 8, 9, 10]' in text
  images = [o for c in nb.cells for o in c.get('outputs', []) if 'image/png' in o.get('data', {})]
  assert len(images) >= 2  # the bubble plot and the remat bars
