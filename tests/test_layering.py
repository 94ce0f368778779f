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

"""The package's layers, read from its source (AST), without importing it.

* No import cycle between the package's modules.
* ``jax._src`` is imported only by ``_jax.py`` (aliases) and
  ``_jax_patches.py`` (the patch inventory).
* Only ``_jax_patches.py`` replaces JAX objects: no other file assigns to an
  attribute of something it imported from JAX or from ``_jax`` (``setattr``
  included).
* The NNX layer (the subpackage ``nnx/``) is the only part that imports
  ``flax.nnx``, and no file outside it imports it (the package's
  ``__init__`` installs it).
* Only ``nnx/flax_hooks.py`` replaces Flax objects: no other file assigns
  to (or ``setattr``s, ``delattr``s) an attribute of something it imported
  from Flax, or of a name bound to one; elsewhere in the NNX layer
  ``setattr`` is used only on ``self`` (the legacy ``Module.sow``
  attribute of a module instance, Flax's own behaviour).
"""

import ast
import pathlib
import tomllib

from absl.testing import absltest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / 'flax/nnx/sow'
PREFIX = 'flax.nnx.sow'

NNX_LAYER = 'nnx'
FLAX_HOOKS = 'nnx.flax_hooks'


def _in_nnx_layer(module: str) -> bool:
  return module == NNX_LAYER or module.startswith(NNX_LAYER + '.')


def _modules():
  """Every file of the package by dotted name (``nnx.scope``; a package's
  ``__init__.py`` by the package's name, the top one as ``__init__``)."""
  modules = {}
  for p in PACKAGE.rglob('*.py'):
    parts = p.relative_to(PACKAGE).with_suffix('').parts
    if parts[-1] == '__init__' and len(parts) > 1:
      parts = parts[:-1]
    modules['.'.join(parts)] = ast.parse(p.read_text())
  return modules


def _imported(tree) -> list[str]:
  """Every module name a file imports (``from a import b`` gives ``a.b``
  and ``a``)."""
  names = []
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      names.extend(a.name for a in node.names)
    elif isinstance(node, ast.ImportFrom) and node.module:
      names.append(node.module)
      names.extend(f'{node.module}.{a.name}' for a in node.names)
  return names


def _package_imports(tree, modules) -> set[str]:
  """The package's modules a file imports (``from flax.nnx.sow.nnx import
  scope`` gives ``nnx.scope``; a function imported from a module gives the
  module)."""
  own = set()
  for name in _imported(tree):
    if name.startswith(PREFIX + '.'):
      rest = name[len(PREFIX) + 1 :]
      while rest and rest not in modules:
        rest = rest.rpartition('.')[0]
      if rest:
        own.add(rest)
  return own


def _base_name(node) -> str | None:
  """``a`` for ``a``, ``a.b.c``, ``a[0].b`` or ``a().b``."""
  while isinstance(node, (ast.Attribute, ast.Subscript, ast.Call)):
    node = node.func if isinstance(node, ast.Call) else node.value
  return node.id if isinstance(node, ast.Name) else None


def _names_bound_to_flax(tree) -> set[str]:
  """Names a file binds to Flax (not ``flax.nnx.sow``) modules or objects:
  imports, and module-level names assigned from them (``M = nnx.Module``)."""
  names = set()
  is_flax = lambda m: (m == 'flax' or m.startswith('flax.')) and not (
      m == PREFIX or m.startswith(PREFIX + '.')
  )
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      for a in node.names:
        if is_flax(a.name):
          names.add(a.asname or a.name.split('.')[0])
    elif isinstance(node, ast.ImportFrom) and node.module:
      for a in node.names:
        if is_flax(f'{node.module}.{a.name}') and is_flax(node.module):
          names.add(a.asname or a.name)
  changed = True
  while changed:
    changed = False
    for node in tree.body:
      if isinstance(node, ast.Assign) and _base_name(node.value) in names:
        for target in node.targets:
          if isinstance(target, ast.Name) and target.id not in names:
            names.add(target.id)
            changed = True
  return names


class LayeringTest(absltest.TestCase):

  def test_no_import_cycles(self):
    modules = _modules()
    graph = {m: _package_imports(t, modules) - {m} for m, t in modules.items()}
    graph.pop('__init__', None)
    for deps in graph.values():
      deps.discard('__init__')

    def cycle_from(start):
      stack, seen = [(start, [start])], set()
      while stack:
        node, path = stack.pop()
        for nxt in graph.get(node, ()):
          if nxt == start:
            return path + [start]
          if nxt not in seen:
            seen.add(nxt)
            stack.append((nxt, path + [nxt]))
      return None

    for m in sorted(graph):
      cycle = cycle_from(m)
      self.assertIsNone(cycle, f'import cycle: {" -> ".join(cycle or ())}')

  def test_jax_internals_only_in_the_two_jax_files(self):
    for name, tree in _modules().items():
      if name in ('_jax', '_jax_patches'):
        continue
      bad = [n for n in _imported(tree) if n.startswith('jax._src')]
      self.assertEmpty(bad, f'{name}.py imports {bad}; alias it in _jax.py')

  def test_only_the_inventory_replaces_jax_objects(self):
    for name, tree in _modules().items():
      if name == '_jax_patches':
        continue
      jax_names = {'jax', '_jax'}
      for node in ast.walk(tree):
        if (
            isinstance(node, ast.ImportFrom)
            and node.module
            and (node.module == 'jax' or node.module.startswith('jax.'))
        ):
          jax_names.update(a.asname or a.name for a in node.names)
        elif isinstance(node, ast.Import):
          for a in node.names:
            if a.name == 'jax' or a.name.startswith('jax.'):
              jax_names.add((a.asname or a.name).split('.')[0])
      for node in ast.walk(tree):
        targets = []
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
          targets = (
              node.targets if isinstance(node, ast.Assign) else [node.target]
          )
        for target in targets:
          if isinstance(target, ast.Attribute):
            base = target.value
            while isinstance(base, ast.Attribute):
              base = base.value
            if isinstance(base, ast.Name) and base.id in jax_names:
              self.fail(
                  f'{name}.py:{node.lineno} assigns {ast.unparse(target)};'
                  ' replacements of JAX objects go in _jax_patches.py'
              )
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id == 'setattr'
            and node.args
            and isinstance(node.args[0], ast.Name)
            and node.args[0].id in jax_names
        ):
          self.fail(f'{name}.py:{node.lineno} calls setattr on a JAX object')

  def test_only_flax_hooks_replaces_flax_objects(self):
    modules = _modules()
    self.assertIn(FLAX_HOOKS, modules)
    for name, tree in modules.items():
      if name == FLAX_HOOKS:
        continue
      flax_names = _names_bound_to_flax(tree)
      for node in ast.walk(tree):
        targets = []
        if isinstance(node, ast.Assign):
          targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
          targets = [node.target]
        elif isinstance(node, ast.Delete):
          targets = node.targets
        for target in targets:
          for part in ast.walk(target):
            if isinstance(part, ast.Attribute) and isinstance(
                part.ctx, (ast.Store, ast.Del)
            ):
              base = _base_name(part)
              self.assertNotIn(
                  base,
                  flax_names,
                  f'{name}.py:{node.lineno} assigns {ast.unparse(part)};'
                  ' replacements of Flax objects go in nnx/flax_hooks.py',
              )
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ('setattr', 'delattr')
            and node.args
        ):
          base = _base_name(node.args[0])
          self.assertNotIn(
              base,
              flax_names,
              f'{name}.py:{node.lineno} calls {node.func.id} on a Flax'
              ' object; replacements go in nnx/flax_hooks.py',
          )
          if _in_nnx_layer(name):
            self.assertEqual(
                base,
                'self',
                f'{name}.py:{node.lineno}: {ast.unparse(node)} outside'
                ' nnx/flax_hooks.py (only the legacy attribute of a module'
                ' instance, on self)',
            )

  def test_names_bound_to_flax_are_found(self):
    # The check above is only as good as this: aliases and re-bindings.
    tree = ast.parse(
        'from flax import nnx\n'
        'from flax.nnx import graphlib as g\n'
        'import flax.linen\n'
        'M = nnx.Module\n'
        'from flax.nnx.sow import capture\n'
    )
    self.assertEqual(_names_bound_to_flax(tree), {'nnx', 'g', 'flax', 'M'})

  def test_flax_nnx_only_in_the_nnx_layer(self):
    modules = _modules()
    for name, tree in modules.items():
      if _in_nnx_layer(name):
        continue
      bad = [
          n
          for n in _imported(tree)
          if (n == 'flax.nnx' or n.startswith('flax.nnx.'))
          and not n.startswith(PREFIX)
      ]
      self.assertEmpty(bad, f'{name}.py imports {bad} (NNX layer only)')
      if name == '__init__':
        continue
      nnx = sorted(
          m for m in _package_imports(tree, modules) if _in_nnx_layer(m)
      )
      self.assertEmpty(nnx, f'core file {name}.py imports NNX layer {nnx}')

  def test_the_nnx_layer_is_a_subpackage(self):
    modules = _modules()
    self.assertIn(NNX_LAYER, modules)
    nnx_files = sorted(m for m in modules if _in_nnx_layer(m))
    self.assertContainsSubset(
        ['nnx.calls', 'nnx.scope', 'nnx.shims', 'nnx.state'], nnx_files
    )
    # Every file that imports flax.nnx lives in it.
    for name, tree in modules.items():
      if any(
          n == 'flax.nnx'
          or (n.startswith('flax.nnx.') and not n.startswith(PREFIX))
          for n in _imported(tree)
      ):
        self.assertTrue(_in_nnx_layer(name), name)

  def test_re_traces_keep_the_types_of_mutable_binders(self):
    # A sub-jaxpr traced again at bare avals loses the quasi-dynamic data of
    # its mutable (Hijax) binders, and JAX then fails to lower the construct
    # that reads them: trace at ``_jax.binder_types`` / ``_jax.arg_type``.
    bare = []
    called = lambda node: getattr(node.func, 'attr', None) or getattr(
        node.func, 'id', None
    )
    for name, tree in _modules().items():
      for node in ast.walk(tree):
        if not (
            isinstance(node, ast.Call)
            and called(node) == 'trace_to_closed_jaxpr'
            and len(node.args) > 1
        ):
          continue
        for sub in ast.walk(node.args[1]):
          if (isinstance(sub, ast.Attribute) and sub.attr == 'in_avals') or (
              isinstance(sub, ast.Call) and called(sub) == 'typeof'
          ):
            bare.append(f'{name}:{node.lineno}')
    self.assertEqual(bare, [])

  def test_pyproject_lists_every_subpackage(self):
    # A package missing from ``packages`` is left out of ``pip install .``.
    pyproject = tomllib.loads(
        (PACKAGE.parents[2] / 'pyproject.toml').read_text()
    )
    listed = set(pyproject['tool']['setuptools']['packages'])
    on_disk = {
        '.'.join(('flax', 'nnx', 'sow', *p.parent.relative_to(PACKAGE).parts))
        for p in PACKAGE.rglob('__init__.py')
    }
    self.assertEqual(listed, on_disk)


class ComplexityTest(absltest.TestCase):

  def test_no_function_above_cyclomatic_complexity_15(self):
    """McCabe complexity as radon counts it, for every function, method
    and nested function of the package."""
    from radon.complexity import cc_visit  # pylint: disable=g-import-not-at-top

    def functions(blocks):
      for b in blocks:
        if hasattr(b, 'methods'):  # a class
          yield from functions(b.methods)
          yield from functions(getattr(b, 'inner_classes', ()))
        else:
          yield b
          yield from functions(b.closures)

    too_complex = [
        f'{p.relative_to(PACKAGE)}:{f.lineno} {f.name} ({f.complexity})'
        for p in sorted(PACKAGE.rglob('*.py'))
        for f in functions(cc_visit(p.read_text()))
        if f.complexity > 15
    ]
    self.assertEqual(too_complex, [])


class JaxVersionGateTest(absltest.TestCase):
  """``_jax.py`` refuses an untested JAX at import, with the range it wants."""

  def test_outside_the_range_raises_naming_it(self):
    from flax.nnx.sow import _jax  # pylint: disable=g-import-not-at-top

    for version in ('0.10.1', '0.11.0', '0.9.9', '1.0.0'):
      with self.assertRaisesRegex(ImportError, r'jax>=0\.10\.2,<0\.11\.0'):
        _jax.check_jax_version(version)
    for version in ('0.10.2', '0.10.9', '0.10.3.dev20261201', '0.10.4rc1'):
      _jax.check_jax_version(version)  # no error

  def test_range_is_the_one_pyproject_declares(self):
    from flax.nnx.sow import _jax  # pylint: disable=g-import-not-at-top

    pyproject = tomllib.loads(
        (PACKAGE.parents[2] / 'pyproject.toml').read_text()
    )
    jax_req = next(
        r for r in pyproject['project']['dependencies'] if r.startswith('jax>')
    )
    low, high = _jax.TESTED_JAX
    low_s = '.'.join(map(str, low))
    high_s = '.'.join(str(x) for x in high[:2])
    self.assertEqual(jax_req, f'jax>={low_s},<{high_s}')


if __name__ == '__main__':
  absltest.main()
