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

"""One fresh interpreter of ``test_import_invariance.LazyInstallTest``.

Run as ``python lazy_install_worker.py SCENARIO``; it prints one line
``RESULT {json}`` and exits 0, or raises. ``flax.nnx.sow`` is imported only
where the scenario says, so the interpreter starts with JAX as JAX made it:

* ``import``: records every object of the JAX modules the patch inventory
  touches (module attributes, entries of their registries, attributes of
  their classes and primitives), imports ``flax.nnx.sow``, every submodule
  and the NNX shims, and reports which of those objects changed; then runs
  one capture and reports the same again, with the inventory's targets.
* ``first:HOW``: imports the package and calls ``capture``/``intervene``
  for the first time in the way ``HOW`` names (eagerly, inside a
  ``jax.jit`` trace, through ``nnx.capture``, under ``jax.eval_shape``,
  ``intervene``), reporting whether the inventory was installed before and
  after, and the values computed.
* ``threads``: several threads make the first capture at once (a barrier);
  counts how often each patch is applied.
* ``before``: runs sows and a jitted function with sows before any capture,
  then again after one.
"""

from __future__ import annotations

import json
import sys
import threading
import typing as tp

import jax
import jax.numpy as jnp
import numpy as np

_MISSING = object()


def _jax_modules():
  # pylint: disable=g-import-not-at-top
  import jax.sharding
  from jax._src import core
  from jax._src import custom_derivatives
  from jax._src import sharding_impls
  from jax._src import stages
  from jax._src.interpreters import ad
  from jax._src.interpreters import batching
  from jax._src.interpreters import partial_eval as pe
  from jax._src.lax.control_flow import loops
  from jax._src.lax.control_flow import solves

  return core, (
      jax,
      jax.sharding,
      core,
      custom_derivatives,
      sharding_impls,
      stages,
      ad,
      batching,
      pe,
      loops,
      solves,
  )


def jax_objects() -> dict[str, tp.Any]:
  """Every object the inventory could replace, by a label."""
  core, modules = _jax_modules()
  found = {}
  for m in modules:
    for k, v in list(vars(m).items()):
      label = f'{m.__name__}.{k}'
      found[label] = v
      if isinstance(v, dict):
        for key, entry in list(v.items()):
          found[f'{label}[{key!r}]'] = entry
      elif isinstance(v, (type, core.Primitive)):
        for attr, entry in list(vars(v).items()):
          found[f'{label}.{attr}'] = entry
  return found


def changed(
    before: dict, after: dict, own=frozenset(), adds: bool = True
) -> list[str]:
  """Labels whose object ``before`` is not the one ``after`` (or is gone),
  and labels ``after`` adds (an attribute set on a JAX class or primitive, a
  rule registered for a JAX primitive), but for rules keyed by one of the
  package's own primitives (``own``: their names), which are additions JAX
  lets a primitive make."""
  replaced = [
      label
      for label, v in before.items()
      if after.get(label, _MISSING) is not v
  ]
  added = [
      label
      for label in after
      if adds
      and label not in before
      and not any(label.endswith(f'[{name!r}]') for name in own)
  ]
  return sorted(replaced + added)


def _own_primitives() -> frozenset:
  """The names of the package's own primitives, as rule tables show them."""
  from flax.nnx.sow import primitive  # pylint: disable=g-import-not-at-top

  return frozenset(
      f'{v}' for v in vars(primitive).values()
      if isinstance(v, jax.extend.core.Primitive)
  )


def _import_everything():
  # pylint: disable=g-import-not-at-top
  import importlib
  import pkgutil

  import flax.nnx.sow
  from flax.nnx.sow.nnx import shims

  for info in pkgutil.walk_packages(flax.nnx.sow.__path__, 'flax.nnx.sow.'):
    importlib.import_module(info.name)
  shims.install()  # idempotent: the import installed them already


def scenario_import() -> dict:
  before = jax_objects()
  _import_everything()
  from flax.nnx.sow import _jax_patches  # pylint: disable=g-import-not-at-top
  from flax.nnx.sow import capture, sow  # pylint: disable=g-import-not-at-top

  after_import = jax_objects()
  targets_before = {p.name: p.apply.current() for p in _jax_patches.INVENTORY}
  installed_at_import = _jax_patches.installed()
  _, collected = capture(lambda x: sow(x * 2.0, name='y'))(jnp.ones(2))
  after_capture = jax_objects()
  targets_after = {p.name: p.apply.current() for p in _jax_patches.INVENTORY}
  new_objects = {
      id(x) for objects in targets_after.values() for x in objects
  }
  own = _own_primitives()
  replaced = changed(after_import, after_capture, own)
  return {
      # (Importing also imports Flax, whose own primitives register rules:
      # what the import adds is not compared.)
      'changed_by_import': changed(before, after_import, adds=False),
      'installed_at_import': installed_at_import,
      'installed_after_capture': _jax_patches.installed(),
      'collected': np.asarray(collected['y'][0]).tolist(),
      'inventory': len(_jax_patches.INVENTORY),
      # Entries whose target still holds the objects it held at import.
      'targets_not_installed': [
          name
          for name, objects in targets_after.items()
          if all(a is b for a, b in zip(objects, targets_before[name]))
      ],
      # Objects the capture replaced that no inventory entry names.
      'replaced_outside_inventory': [
          label
          for label in replaced
          if id(after_capture.get(label)) not in new_objects
      ],
      'replaced_by_capture': len(replaced),
      'replaced': replaced,
  }


def _first_eager():
  from flax.nnx.sow import capture, sow  # pylint: disable=g-import-not-at-top

  out, c = capture(lambda x: sow(x * 2.0, name='y') + 1.0)(jnp.ones(2))
  return [np.asarray(out).tolist(), np.asarray(c['y'][0]).tolist()]


def _first_in_jit():
  from flax.nnx.sow import capture, sow  # pylint: disable=g-import-not-at-top

  out, c = jax.jit(capture(lambda x: sow(x * 2.0, name='y') + 1.0))(
      jnp.ones(2)
  )
  return [np.asarray(out).tolist(), np.asarray(c['y'][0]).tolist()]


def _first_eval_shape():
  from flax.nnx.sow import capture, sow  # pylint: disable=g-import-not-at-top

  out, c = jax.eval_shape(
      capture(lambda x: sow(x * 2.0, name='y') + 1.0), jnp.ones(2)
  )
  return [list(out.shape), list(c['y'][0].shape)]


def _first_nnx():
  from flax import nnx  # pylint: disable=g-import-not-at-top
  # pylint: disable-next=g-import-not-at-top,unused-import
  import flax.nnx.sow  # noqa: F401

  class Double(nnx.Module):

    def __call__(self, x):
      y = x * 2.0
      self.sow(nnx.Intermediate, 'y', y)
      return y + 1.0

  out, state = nnx.capture(Double(), nnx.Intermediate)(jnp.ones(2))
  return [np.asarray(out).tolist(), np.asarray(state['y'][0]).tolist()]


def _first_intervene():
  from flax.nnx.sow import intervene, sow  # pylint: disable=g-import-not-at-top

  out = intervene(
      lambda x: sow(x * 2.0, name='y') + 1.0, {'y': lambda y: -y}
  )(jnp.ones(2))
  return [np.asarray(out).tolist()]


FIRST_CALLS = {
    'eager': _first_eager,
    'jit': _first_in_jit,
    'eval_shape': _first_eval_shape,
    'nnx': _first_nnx,
    'intervene': _first_intervene,
}


def scenario_first(how: str) -> dict:
  # pylint: disable-next=g-import-not-at-top,unused-import
  import flax.nnx.sow  # noqa: F401
  from flax.nnx.sow import _jax_patches  # pylint: disable=g-import-not-at-top

  installed_before = _jax_patches.installed()
  values = FIRST_CALLS[how]()
  return {
      'installed_before': installed_before,
      'installed_after': _jax_patches.installed(),
      'targets_installed': [
          name
          for name, objects in _marks(_jax_patches).items()
          if any(objects)
      ],
      'values': values,
  }


def _marks(jax_patches) -> dict[str, list[bool]]:
  return {
      p.name: [getattr(x, '_sow_wrapped', False) for x in p.apply.current()]
      for p in jax_patches.INVENTORY
  }


class _Counted:
  """An inventory target that counts (and slows down) its installs."""

  def __init__(self, target, counts, name):
    self.target, self.counts, self.name = target, counts, name
    self.current = target.current

  def __call__(self, wrapper):
    self.counts[self.name] = self.counts.get(self.name, 0) + 1
    threading.Event().wait(0.005)  # widens the window for a second caller
    return self.target(wrapper)


def scenario_threads(n: int = 8) -> dict:
  # pylint: disable=g-import-not-at-top
  import dataclasses

  from flax.nnx.sow import _jax_patches
  from flax.nnx.sow import capture, sow

  counts: dict[str, int] = {}
  _jax_patches.INVENTORY = tuple(
      dataclasses.replace(p, apply=_Counted(p.apply, counts, p.name))
      for p in _jax_patches.INVENTORY
  )
  barrier = threading.Barrier(n)
  results, seen_installed, errors = [None] * n, [None] * n, []

  def work(i):
    def f(x):
      # f runs once the capture stages it: every patch is in place.
      seen_installed[i] = all(
          any(m) for m in _marks(_jax_patches).values()
      )
      return sow(x * i, name='y')

    try:
      barrier.wait()
      _, c = capture(f)(jnp.full((2,), 1.0))
      results[i] = np.asarray(c['y'][0]).tolist()
    except Exception as e:  # pylint: disable=broad-except
      errors.append(f'{type(e).__name__}: {e}')

  threads = [threading.Thread(target=work, args=(i,)) for i in range(n)]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  return {
      'counts': counts,
      'inventory': [p.name for p in _jax_patches.INVENTORY],
      'results': results,
      'seen_installed': seen_installed,
      'errors': errors,
  }


def _scan_program(with_sow: bool):
  from flax.nnx.sow import sow  # pylint: disable=g-import-not-at-top

  def f(x):
    def body(c, y):
      h = jnp.sin(c * y)
      if with_sow:
        h = sow(h, name='h')
      return c + h, 2.0 * h

    return jax.lax.scan(body, x, jnp.arange(3.0))

  return jax.vmap(f)


def _cond_program(with_sow: bool):
  from flax.nnx.sow import sow  # pylint: disable=g-import-not-at-top

  def f(x):
    mark = (lambda h: sow(h, name='h')) if with_sow else (lambda h: h)
    return jax.lax.cond(
        x.sum() > 0, lambda x: mark(jnp.sin(x)), lambda x: mark(jnp.cos(x)), x
    )

  return jax.vmap(f)


def _transforms(with_sow: bool, x) -> list:
  """Values of sows outside any capture under vmap(scan), vmap(cond),
  grad, jit and jet."""
  from jax.experimental import jet  # pylint: disable=g-import-not-at-top
  from flax.nnx.sow import sow  # pylint: disable=g-import-not-at-top

  mark = (lambda v: sow(v, name='v')) if with_sow else (lambda v: v)
  loss = lambda x: jnp.sum(mark(jnp.sin(x)) ** 2)
  primal, series = jet.jet(
      lambda x: mark(jnp.sin(x)), (x[0],), ((jnp.ones(3), jnp.zeros(3)),)
  )
  return [
      *jax.tree.leaves(_scan_program(with_sow)(x)),
      _cond_program(with_sow)(x),
      jax.grad(loss)(x),
      jax.jit(jax.grad(loss))(x),
      primal,
      *series,
  ]


def scenario_before() -> dict:
  # pylint: disable-next=g-import-not-at-top,unused-import
  import flax.nnx.sow  # noqa: F401
  from flax.nnx.sow import _jax_patches  # pylint: disable=g-import-not-at-top
  from flax.nnx.sow import capture, sow  # pylint: disable=g-import-not-at-top

  x = jnp.array([[0.5, -1.0, 2.0], [-0.5, -0.25, -3.0]])
  plain = [np.asarray(v) for v in _transforms(False, x)]
  before = [np.asarray(v) for v in _transforms(True, x)]
  jitted = jax.jit(_scan_program(True))
  jitted_before = jax.tree.leaves(jitted(x))
  jaxpr_before = str(jax.make_jaxpr(jitted)(x))
  installed_before = _jax_patches.installed()
  capture(lambda v: sow(v * 2.0, name='y'))(jnp.ones(2))  # installs
  after = [np.asarray(v) for v in _transforms(True, x)]
  jitted_after = jax.tree.leaves(jitted(x))
  _, collected = capture(jitted)(x)
  same = lambda a, b: all(
      np.array_equal(np.asarray(u), np.asarray(v)) for u, v in zip(a, b)
  ) and len(a) == len(b)
  _, ys = jax.tree.leaves(_scan_program(False)(x))
  return {
      'installed_before': installed_before,
      'installed_after': _jax_patches.installed(),
      'identity_before_capture': same(before, plain),
      'identity_after_capture': same(after, plain),
      'jitted_same_after': same(jitted_before, jitted_after),
      'jitted_plain': same(jitted_before, jax.tree.leaves(_scan_program(
          False)(x))),
      'jaxpr_same_after': jaxpr_before == str(jax.make_jaxpr(jitted)(x)),
      # The scan's ys are 2 * h: what a capture of the jitted function
      # collects is h, the mapped axis first.
      'collected_h': np.allclose(collected['h'][0], np.asarray(ys) / 2.0),
      'collected_shape': list(collected['h'][0].shape),
  }


def main(argv) -> None:
  scenario = argv[1]
  if scenario == 'import':
    report = scenario_import()
  elif scenario.startswith('first:'):
    report = scenario_first(scenario[len('first:') :])
  elif scenario == 'threads':
    report = scenario_threads()
  elif scenario == 'before':
    report = scenario_before()
  else:
    raise ValueError(f'unknown scenario {scenario!r}')
  print('RESULT ' + json.dumps(report))


if __name__ == '__main__':
  main(sys.argv)
