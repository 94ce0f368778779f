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

"""Importing ``flax.nnx.sow`` changes no program that holds no sow.

Importing the package replaces nothing in JAX; the first ``capture`` or
``intervene`` installs the patch inventory (``_jax_patches.py``:
partial-evaluation rules, batching wrappers, ...), each of which must take
JAX's own path for an equation with no sow a capture is staging. This test
stages the sow-free programs of ``import_invariance_programs.py`` in three
fresh interpreters, one that never imports ``flax.nnx.sow``, one that
imports it first, and one that also runs a capture first, and compares the
jaxprs as text. Other fresh interpreters check that the import leaves every
object of JAX's in place, that each way of calling a capture first installs
the inventory, once, also from several threads at a time, and that what JAX
traced before the first capture behaves the same after it.
"""

from __future__ import annotations

import difflib
import json
import os
import pathlib
import re
import subprocess
import sys

from absl.testing import absltest
from absl.testing import parameterized
import jax
import jax.extend.core as jex
import jax.numpy as jnp
import numpy as np

from flax.nnx.sow import sow

HERE = pathlib.Path(__file__).resolve().parent
PROGRAMS = HERE / 'import_invariance_programs.py'
WORKER = HERE / 'lazy_install_worker.py'
TIMEOUT_S = 300

sys.path.insert(0, str(HERE))
try:
  import import_invariance_programs as corpus  # noqa: E402
finally:
  sys.path.remove(str(HERE))


# What the patch inventory replaces once a capture ran (see
# ``_jax_patches.py``; the target is none).
REPLACED_BY_CAPTURE = [
    'jax._src.interpreters.ad.primitive_jvps[custom_vmap_call]',
    'jax._src.interpreters.batching.fancy_primitive_batchers[cond]',
    'jax._src.interpreters.batching.fancy_primitive_batchers[scan]',
    'jax._src.interpreters.partial_eval.custom_partial_eval_rules[remat_opt]',
    'jax._src.interpreters.partial_eval.custom_partial_eval_rules[while]',
    'jax._src.interpreters.partial_eval.new_eqn_recipe',
    'jax._src.interpreters.partial_eval.partial_eval_jaxpr_custom_rules[scan]',
    'jax._src.interpreters.partial_eval.partial_eval_jaxpr_custom_rules[while]',
    'jax._src.interpreters.partial_eval.partial_eval_jaxpr_nounits',
    'jax._src.lax.control_flow.loops._scan_known_hoisting',
    'jax._src.stages.Compiled.__call__',
]


def _stage_in_fresh_interpreters() -> tuple[dict, dict, dict]:
  """The reports of the corpus run without ``flax.nnx.sow``, with it
  imported, and with it imported and a capture run first."""
  flags = ((), ('--import-sow',), ('--after-capture',))
  return tuple(_run_fresh([[str(PROGRAMS), *f] for f in flags]))


def _run_fresh(commands: list[list[str]]) -> list[dict]:
  """The ``RESULT`` report of each command, each run by a fresh Python."""
  env = dict(os.environ)  # XLA_FLAGS asks for 8 devices (conftest.py)
  env['JAX_PLATFORMS'] = 'cpu'
  procs = [
      subprocess.Popen(
          [sys.executable, *command],
          env=env,
          stdout=subprocess.PIPE,
          stderr=subprocess.PIPE,
          text=True,
          cwd=str(HERE),
      )
      for command in commands
  ]
  try:
    outputs = [p.communicate(timeout=TIMEOUT_S) for p in procs]
  finally:
    for p in procs:  # never leave a process behind
      if p.poll() is None:
        p.kill()
        p.wait()
  reports = []
  for p, (out, err) in zip(procs, outputs):
    if p.returncode != 0:
      raise AssertionError(
          f'{" ".join(p.args)} exited with {p.returncode}:\n{out}\n{err}'
      )
    lines = [l for l in out.splitlines() if l.startswith('RESULT ')]
    if len(lines) != 1:
      raise AssertionError(f'no single RESULT line:\n{out}\n{err}')
    reports.append(json.loads(lines[0][len('RESULT ') :]))
  return reports


class ImportInvarianceTest(absltest.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.without, cls.with_sow, cls.after_capture = (
        _stage_in_fresh_interpreters()
    )

  def test_interpreters_differ_only_by_the_import(self):
    self.assertFalse(self.without['sow_imported'])
    self.assertIsNone(self.without['patches_installed'])
    self.assertTrue(self.with_sow['sow_imported'])
    self.assertFalse(self.with_sow['patches_installed'])
    self.assertTrue(self.after_capture['sow_imported'])
    self.assertTrue(self.after_capture['patches_installed'])
    for report in (self.without, self.with_sow, self.after_capture):
      self.assertEqual(report['device_count'], corpus.DEVICES)
      self.assertEqual(sorted(report['jaxprs']), sorted(corpus.programs()))

  def test_every_program_stages_without_the_import(self):
    errors = {
        name: text
        for name, text in self.without['jaxprs'].items()
        if text.startswith('ERROR')
    }
    self.assertEmpty(errors)

  def test_programs_exercise_their_construct(self):
    # Each program's jaxpr shows the primitives it is meant to stage (a
    # construct that JAX inlines or rewrites would test nothing).
    missing = [
        (name, primitive)
        for name, (_, _, needs) in corpus.programs().items()
        for primitive in needs
        if not re.search(rf'\b{primitive}\b', self.without['jaxprs'][name])
    ]
    self.assertEmpty(missing)

  def test_corpus_exercises_the_offload_branch(self):
    # Without the import, JAX's default partial evaluation offloads the
    # policy's values to host memory and back: the branch a rule copied
    # from JAX's default once dropped.
    for name, count in corpus.OFFLOADING.items():
      text = self.without['jaxprs'][name]
      self.assertEqual(text.count('device_put'), count, msg=name)
      self.assertIn('MemorySpace.Host', text, msg=name)

  def _assert_same_jaxprs(self, other: dict, label: str):
    changed = [
        name
        for name, text in self.without['jaxprs'].items()
        if other['jaxprs'].get(name) != text
    ]
    diffs = [
        f'--- {name}\n'
        + '\n'.join(
            difflib.unified_diff(
                self.without['jaxprs'][name].splitlines(),
                other['jaxprs'].get(name, '').splitlines(),
                'without flax.nnx.sow',
                label,
                lineterm='',
            )
        )
        for name in changed
    ]
    self.assertEmpty(changed, msg='\n'.join(diffs))

  def test_jaxprs_identical_with_and_without_the_import(self):
    self._assert_same_jaxprs(self.with_sow, 'with flax.nnx.sow')

  def test_jaxprs_identical_once_a_capture_installed_the_patches(self):
    self._assert_same_jaxprs(
        self.after_capture, 'with flax.nnx.sow, after a capture'
    )


_FIRST_CALLS = ('eager', 'jit', 'eval_shape', 'nnx', 'intervene')


class LazyInstallTest(absltest.TestCase):
  """Importing replaces nothing in JAX; the first capture installs the
  patch inventory (``lazy_install_worker.py``, fresh interpreters)."""

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    scenarios = ['import', 'threads', 'before']
    scenarios += [f'first:{how}' for how in _FIRST_CALLS]
    reports = _run_fresh([[str(WORKER), s] for s in scenarios])
    cls.reports = dict(zip(scenarios, reports))

  def test_import_replaces_no_jax_object(self):
    report = self.reports['import']
    # Every module attribute, registry entry and class or primitive
    # attribute of the JAX modules the inventory touches is the object it
    # was before ``flax.nnx.sow``, its submodules and the NNX shims were
    # imported.
    self.assertEqual(report['changed_by_import'], [])
    self.assertFalse(report['installed_at_import'])

  def test_first_capture_installs_exactly_the_inventory(self):
    report = self.reports['import']
    self.assertTrue(report['installed_after_capture'])
    self.assertEqual(report['collected'], [2.0, 2.0])
    self.assertEqual(report['inventory'], 11)  # a new patch is a deliberate change
    self.assertEqual(report['targets_not_installed'], [])
    self.assertEqual(report['replaced_outside_inventory'], [])
    # The snapshot: every JAX object a capture replaced or added (an
    # attribute set on a JAX primitive or class, a rule registered for a JAX
    # primitive), by name. Removing a patch removes its lines here.
    self.assertEqual(report['replaced'], REPLACED_BY_CAPTURE)

  def test_every_first_call_installs(self):
    expected = {
        'eager': [[3.0, 3.0], [2.0, 2.0]],
        'jit': [[3.0, 3.0], [2.0, 2.0]],
        'eval_shape': [[2], [2]],
        'nnx': [[3.0, 3.0], [2.0, 2.0]],
        'intervene': [[-1.0, -1.0]],  # -(2 * 1) + 1
    }
    names = self.reports['threads']['inventory']
    for how in _FIRST_CALLS:
      report = self.reports[f'first:{how}']
      self.assertFalse(report['installed_before'], msg=how)
      self.assertTrue(report['installed_after'], msg=how)
      self.assertEqual(report['targets_installed'], names, msg=how)
      self.assertEqual(report['values'], expected[how], msg=how)

  def test_concurrent_first_captures_install_once(self):
    report = self.reports['threads']
    self.assertEqual(report['errors'], [])
    self.assertEqual(report['counts'], {n: 1 for n in report['inventory']})
    # Each thread's f ran with every patch in place, and got its own value.
    self.assertEqual(report['seen_installed'], [True] * 8)
    self.assertEqual(report['results'], [[float(i)] * 2 for i in range(8)])

  def test_what_ran_before_the_first_capture_behaves_after_it(self):
    report = self.reports['before']
    self.assertFalse(report['installed_before'])
    self.assertTrue(report['installed_after'])
    # Outside a capture a sow is the identity under vmap(scan), vmap(cond),
    # grad, jit(grad) and jet, without the patches and with them.
    self.assertTrue(report['identity_before_capture'])
    self.assertTrue(report['identity_after_capture'])
    # A function jitted before the first capture: the same values and
    # jaxpr after it, and a capture of it collects the sown values.
    self.assertTrue(report['jitted_plain'])
    self.assertTrue(report['jitted_same_after'])
    self.assertTrue(report['jaxpr_same_after'])
    self.assertTrue(report['collected_h'])
    self.assertEqual(report['collected_shape'], [2, 3, 3])


def _primitive_tree(jaxpr: jex.Jaxpr) -> list:
  """The primitives of ``jaxpr``'s equations, sub-jaxprs nested; sows left
  out."""
  tree = []
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == 'sow':
      continue
    subs = []
    for value in eqn.params.values():
      for v in value if isinstance(value, tuple) else (value,):
        if isinstance(v, jex.ClosedJaxpr):
          subs.append(_primitive_tree(v.jaxpr))
        elif isinstance(v, jex.Jaxpr):
          subs.append(_primitive_tree(v))
    tree.append((eqn.primitive.name, subs))
  return tree


def _count_sows(jaxpr: jex.Jaxpr) -> int:
  n = 0
  for eqn in jaxpr.eqns:
    n += eqn.primitive.name == 'sow'
    for value in eqn.params.values():
      for v in value if isinstance(value, tuple) else (value,):
        if isinstance(v, jex.ClosedJaxpr):
          n += _count_sows(v.jaxpr)
        elif isinstance(v, jex.Jaxpr):
          n += _count_sows(v)
  return n


def _scan_program(with_sow: bool):
  def f(x):
    def body(c, y):
      h = jnp.sin(c * y)
      if with_sow:
        sow(h, name='h')
      return c + h, 2.0 * h

    return jax.lax.scan(body, x, jnp.arange(3.0))

  return jax.vmap(f)


def _cond_program(with_sow: bool):
  def f(x):
    def positive(x):
      h = jnp.sin(x)
      return sow(h, name='h') if with_sow else h

    def negative(x):
      h = jnp.cos(x)
      return sow(h, name='h') if with_sow else h

    return jax.lax.cond(x.sum() > 0, positive, negative, x)

  return jax.vmap(f)


class OutsideCaptureTest(parameterized.TestCase):
  """Outside a capture nothing can collect a sow: under ``jax.vmap``,
  ``scan`` and ``cond`` are batched by JAX's own rules, the sows staying
  where they are, as identities."""

  @parameterized.parameters('scan', 'cond')
  def test_vmap_batches_as_jax_does(self, construct):
    program = {'scan': _scan_program, 'cond': _cond_program}[construct]
    x = jnp.array([[0.5, -1.0, 2.0], [-0.5, -0.25, -3.0]])
    with_sow = jax.make_jaxpr(program(True))(x)
    plain = jax.make_jaxpr(program(False))(x)
    # The same equations as the program without sows, nested alike; the
    # sows are still inside the loop body or the branches.
    self.assertEqual(
        _primitive_tree(with_sow.jaxpr), _primitive_tree(plain.jaxpr)
    )
    self.assertEqual(
        _count_sows(with_sow.jaxpr), {'scan': 1, 'cond': 2}[construct]
    )
    for got, want in zip(
        jax.tree.leaves(program(True)(x)), jax.tree.leaves(program(False)(x))
    ):
      np.testing.assert_array_equal(got, want)


if __name__ == '__main__':
  absltest.main()
