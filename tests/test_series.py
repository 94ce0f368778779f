# Copyright 2026 The Flax Authors.
#
# Licensed under the Apache License, Version 2.0 (the "License");
# you may not use this file except in compliance with the License.
# You may obtain a copy of the License at
#
#     http://www.apache.org/licenses/LICENSE-2.0
#
# Unless required by applicable law or agreed to in writing, software
# distributed under the License is distributed on an "AS IS" BASIS,
# WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND, either express or implied.
# See the License for the specific language governing permissions and
# limitations under the License.

"""Every prefix of the pull-request series is a working package.

``docs/upstream.md`` assigns each file of ``flax/nnx/sow`` to one pull
request (its ``SERIES``). For every ``k`` this test assembles, in a temporary
directory, the package from the files of pull requests ``1..k``, without the
lines that only a later one needs (those end in ``# PR: <name>``: the
imports that register a later construct, its public names), and runs there,
in a fresh interpreter that imports ``flax.nnx.sow`` from that directory
only, a representative test class or two of pull request ``k`` and checks
that each construct of a later pull request raises the core's "no rule"
``NotImplementedError`` naming the sow.
"""

from __future__ import annotations

import contextlib
import io
import pathlib
import shutil
import subprocess
import sys
import tempfile
import textwrap
import typing as tp

from absl.testing import absltest
from absl.testing import parameterized

import flax.nnx.sow

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = pathlib.Path(flax.nnx.sow.__file__).parent

# The tests each prefix runs: pull request k's own, which the earlier ones
# could not pass (the whole suite runs on the full package); for toplevel,
# which changes what a capture costs and not what it collects, classes that
# run through the top-level trace it adds.
REPRESENTATIVE = {
    'core': [
        'tests/test_core.py::JitTest',
        'tests/test_core.py::CheckpointTest',
        'tests/test_core.py::TagTest',
    ],
    'toplevel': [
        'tests/test_toplevel.py::UnderJitTest',
        'tests/test_core.py::ThreadTest',
    ],
    'name_keys': [
        'tests/test_core.py::NameKeysTest',
    ],
    'name_hints': [
        'tests/test_names.py::CaptureNamesReportTest',
    ],
    'reductions': [
        'tests/test_core.py::SeedExampleTest',
    ],
    'perturb': [
        'tests/test_core.py::OutsideCaptureTest',
        'tests/test_core.py::ErrorTest',
    ],
    'collected': [
        'tests/test_display.py::ReprTest',
        'tests/test_display.py::TreescopeTest',
    ],
    'eager': [
        'tests/test_core.py::EagerJittedTest',
        'tests/test_toplevel.py::EagerTest',
    ],
    'intervene': [
        'tests/test_intervene.py::TopLevelTest',
        'tests/test_intervene.py::RematTest',
        'tests/test_constructs_extra.py::JetTest',
    ],
    'loops': [
        'tests/test_loops.py::ScanTest',
        'tests/test_loops.py::CondTest',
    ],
    'partial_eval': [
        'tests/test_semantics.py::LoopInvariantCondTest',
        'tests/test_semantics.py::LinearizedFunctionTest',
    ],
    'custom': [
        'tests/test_core.py::CustomRuleTest',
        'tests/test_toplevel.py::EagerConstructsTest',
    ],
    'nnx': [
        'tests/test_nnx_shims.py::LegacyWarningTest',
        'tests/test_nnx_shims.py::GrowingReductionTest',
        'tests/test_toplevel.py::StateArgumentTest',
    ],
    'nnx_transforms': [
        'tests/test_nnx_paths.py::TransformCopiesTest',
        'tests/test_nnx_sliced.py::SameAsFlaxTest',
    ],
    'nnx_functional': [
        'tests/test_nnx_shims.py::ShimTest',
        'tests/test_module_hooks.py::ModuleOutputsTest',
        'tests/test_nnx_paths.py::ClosedOverTest',
    ],
    'shard_map': [
        'tests/test_sharding.py::DataParallelTest',
        'tests/test_sharding.py::PerDeviceControlFlowTest',
    ],
    'linear_solve': [
        'tests/test_linear_solve.py::CaptureTest',
    ],
}

# A program per pull request that adds a construct (or, for reductions, a
# kind of sow): without that pull request, capturing it under jit raises
# the core's "no rule" error naming the sow and the primitive (the
# construct's display name lands with it), or the core's error for a
# reduced sow.
CONSTRUCTS = {
    'reductions': (
        'reduce_fn/init_fn need flax.nnx.sow.reductions',
        'f = lambda x: sow(x, name="late", reduce_fn=lambda a, v: a + v,\n'
        '    init_fn=lambda: 0.0) * 2.0',
    ),
    'loops': (
        'primitive `scan` has no capture rule',
        'f = lambda x: jax.lax.scan(\n'
        '    lambda c, _: (sow(c, name="late") * 2.0, None), x, None, 2)[0]',
    ),
    'custom': (
        'primitive `custom_jvp_call` has no capture rule',
        'f = jax.custom_jvp(lambda x: sow(x, name="late") * 2.0)\n'
        'f.defjvp(lambda p, t: (f(*p), 2.0 * t[0]))',
    ),
    'linear_solve': (
        'primitive `custom_linear_solve` has no capture rule',
        'f = lambda x: jax.lax.custom_linear_solve(\n'
        '    lambda v: 2.0 * v, x, lambda mv, b: sow(b, name="late") / 2.0)',
    ),
    'shard_map': (
        'primitive `shard_map` has no capture rule',
        'f = jax.shard_map(lambda x: sow(x, name="late") * 2.0,\n'
        '    mesh=jax.make_mesh((1,), ("d",)), in_specs=jax.P(),'
        ' out_specs=jax.P())',
    ),
}

# Run in the fresh interpreter: imports of flax.nnx.sow come from PREFIX and
# nowhere else (a file of a later pull request is a ModuleNotFoundError).
_BOOTSTRAP = textwrap.dedent("""
    import importlib.abc
    import importlib.machinery
    import pathlib
    import sys

    PREFIX = pathlib.Path(sys.argv[1])


    class PrefixFinder(importlib.abc.MetaPathFinder):

      def find_spec(self, name, path=None, target=None):
        if name != 'flax.nnx.sow' and not name.startswith('flax.nnx.sow.'):
          return None
        where = PREFIX.joinpath('flax', 'nnx', *name.split('.')[2:-1])
        spec = importlib.machinery.PathFinder.find_spec(name, [str(where)])
        if spec is None:
          raise ModuleNotFoundError(f'{name} is not in this prefix', name=name)
        return spec


    sys.meta_path.insert(0, PrefixFinder())
    import flax.nnx.sow
    assert flax.nnx.sow.__file__.startswith(str(PREFIX)), flax.nnx.sow.__file__
    exec(sys.argv[2])
    import pytest
    sys.exit(pytest.main(sys.argv[3:]))
""")

_MISSING = textwrap.dedent("""
    import jax, jax.numpy as jnp
    from flax.nnx.sow import capture, sow
    for construct, program in {missing!r}:
      scope = dict(jax=jax, sow=sow)
      exec(program, scope)
      f = scope['f']
      try:
        capture(jax.jit(f))(jnp.ones(2))
      except NotImplementedError as e:
        message = str(e)
        assert "'late'" in message and construct in message, message
      else:
        raise AssertionError(f'{{construct}} did not raise')
    print('missing constructs raise:', [c for c, _ in {missing!r}])
""")


def _measuring_block() -> dict[str, tp.Any]:
  """What the measuring block of ``docs/upstream.md`` defines: ``SERIES``,
  ``NAMES``, ``files``, ``tagged``, ``lines_by_pr``."""
  text = (ROOT / 'docs' / 'upstream.md').read_text()
  block = text.split('```python\n', 1)[1].split('\n```', 1)[0]
  namespace = {}
  with contextlib.redirect_stdout(io.StringIO()):
    exec(block, namespace)  # pylint: disable=exec-used
  return namespace


BLOCK = _measuring_block()
NAMES = BLOCK['NAMES']
TAG = BLOCK['TAG']  # '# PR: <name>' at the end of a line


def prefix_files(k: int) -> dict[pathlib.Path, str]:
  """Each file of pull requests ``1..k`` with the text it has there."""
  later = NAMES[k:]
  out = {}
  for key, name in list(zip(BLOCK['SERIES'], NAMES))[:k]:
    for path in BLOCK['files'][key]:
      owners = BLOCK['lines_by_pr'](path, name)
      dropped = set().union(*(owners[n] for n in later))
      lines = path.read_text().splitlines(keepends=True)
      out[path.relative_to(PACKAGE)] = ''.join(
          line for n, line in enumerate(lines, 1) if n not in dropped
      )
  return out


class SeriesTest(parameterized.TestCase):

  def test_every_tag_gives_its_statement_to_a_later_pull_request(self):
    # A tag that is not on the first line of a statement or display element
    # would give nothing (the line would land with its file); one naming its
    # own file's pull request or an earlier one would be kept everywhere it
    # could run (lines_by_pr asserts that).
    for key, name in zip(BLOCK['SERIES'], NAMES):
      for path in BLOCK['files'][key]:
        text = path.read_text()
        owner = BLOCK['tagged'](text)
        BLOCK['lines_by_pr'](path, name)
        for n, line in enumerate(text.splitlines(), 1):
          tag = TAG.search(line)
          if tag:
            self.assertIn(tag[1], NAMES, f'{path}:{n}')
            self.assertEqual(owner.get(n), tag[1], f'{path}:{n}')

  def test_the_last_prefix_is_the_package(self):
    files = prefix_files(len(NAMES))
    self.assertCountEqual(
        files, [p.relative_to(PACKAGE) for p in PACKAGE.rglob('*.py')]
    )
    for rel, text in files.items():
      self.assertEqual(text, (PACKAGE / rel).read_text(), rel)

  def test_the_first_prefix_drops_what_later_ones_add(self):
    first = prefix_files(1)
    self.assertNotIn(pathlib.Path('inject.py'), first)
    init = first[pathlib.Path('__init__.py')]
    self.assertIn('from flax.nnx.sow.capturing import capture', init)
    self.assertNotIn('intervene', init.split('"""')[-1])
    self.assertNotIn('nnx_shims', init.split('"""')[-1])
    # Without the perturb pull request, sow has no grad= (a TypeError, not
    # an argument ignored) and there is no perturb.
    self.assertNotIn('perturb', init.split('"""')[-1])
    self.assertNotIn('grad: bool', first[pathlib.Path('api.py')])
    self.assertNotIn(pathlib.Path('cotangents.py'), first)

  @parameterized.named_parameters(
      (name, k) for k, name in enumerate(NAMES, 1)
  )
  def test_prefix_works(self, k):
    name = NAMES[k - 1]
    missing = [CONSTRUCTS[n] for n in NAMES[k:] if n in CONSTRUCTS]
    with tempfile.TemporaryDirectory() as tmp:
      prefix = pathlib.Path(tmp)
      for rel, text in prefix_files(k).items():
        target = prefix / 'flax' / 'nnx' / 'sow' / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text)
      shutil.copytree(ROOT / 'tests', prefix / 'tests')
      shutil.copy(ROOT / 'pyproject.toml', prefix / 'pyproject.toml')
      run = subprocess.run(
          [
              sys.executable, '-c', _BOOTSTRAP, str(prefix),
              _MISSING.format(missing=missing), '-q', '-p', 'no:xdist',
              '-p', 'no:cacheprovider', *REPRESENTATIVE[name],
          ],
          cwd=prefix, capture_output=True, text=True, timeout=900,
      )
    self.assertEqual(
        run.returncode, 0, f'{run.stdout[-6000:]}\n{run.stderr[-4000:]}'
    )
    self.assertRegex(run.stdout, r'\d+ passed')
    self.assertNotRegex(run.stdout, r'\d+ (failed|skipped|error)')
    if missing:
      self.assertIn('missing constructs raise', run.stdout)


if __name__ == '__main__':
  absltest.main()
