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

"""NumPy values through the NNX shims and the core.

* What a ``Module.sow`` or a ``method_outputs`` method gives as a NumPy
  array or scalar at the top level of an ``nnx.capture`` comes back as that
  object, as Flax 0.12.8 returns it: each program of :data:`PROGRAMS` runs in
  two subprocesses, one that never imports ``flax.nnx.sow`` (Flax's own
  ``Module.sow`` and ``nnx.capture``) and one with the shims, as
  ``test_nnx_flax_parity.py`` does; the results, described with each leaf's
  type, dtype and value, must be equal.
* An integer that the dtype JAX gives it cannot hold (``np.int64(2**40)``
  while ``jax_enable_x64`` is off, which ``jnp.asarray`` wraps to 0) raises an
  ``OverflowError`` naming the sow wherever it would become a JAX array,
  instead of being collected wrapped.
* A model whose ``nnx.Param`` holds a NumPy array (weights from ``np.load``
  or ``nnx.replace_by_pure_dict``) keeps that array through ``intervene``,
  ``capture``, ``nnx.capture`` and ``module_outputs``, eagerly and under
  ``jax.vmap``/``jax.jit``; results equal the plain computation in NumPy.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys

from absl.testing import absltest
from absl.testing import parameterized
from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np

import flax.nnx.sow  # noqa: F401  (installs the shims)
from flax.nnx.sow import capture
from flax.nnx.sow import intervene
from flax.nnx.sow import module_outputs
from flax.nnx.sow import sow

_RUNNER = r"""
import json, sys, warnings
import jax, jax.numpy as jnp, numpy as np
from flax import nnx
if sys.argv[1] == 'shims':
  import flax.nnx.sow
assert ('flax.nnx.sow' in sys.modules) == (sys.argv[1] == 'shims')
warnings.simplefilter('ignore')

def describe(x):
  if isinstance(x, nnx.Variable):
    return {'variable': type(x).__name__, 'value': describe(x.get_value())}
  if isinstance(x, nnx.State):
    return {'state': {repr(k): describe(v) for k, v in sorted(
        x.items(), key=lambda kv: repr(kv[0]))}}
  if isinstance(x, (jax.Array, np.ndarray, np.generic)):
    kind = 'jax' if isinstance(x, jax.Array) else type(x).__name__
    return {kind: str(x.dtype), 'shape': list(np.shape(x)),
            'value': np.asarray(x).tolist()}
  if isinstance(x, (tuple, list)):
    return {type(x).__name__: [describe(v) for v in x]}
  if isinstance(x, dict):
    return {'dict': {repr(k): describe(v) for k, v in x.items()}}
  if x is None or isinstance(x, (bool, int, float, str)):
    return {'py': type(x).__name__, 'value': x}
  return {'other': type(x).__name__}

results = {}
for name, source in json.loads(sys.stdin.read()).items():
  namespace = {'jax': jax, 'jnp': jnp, 'np': np, 'nnx': nnx}
  try:
    exec(source, namespace)
    results[name] = describe(namespace['out'])
  except Exception as e:
    results[name] = {'error': type(e).__name__, 'message': str(e)}
print('RESULTS ' + json.dumps(results))
"""

PROGRAMS = {
    # The report's program: an ndarray and an int64 that int32 cannot hold.
    'numpy_values': (
        """
class M(nnx.Module):
  def __call__(self, x):
    self.sow(nnx.Intermediate, 'h', np.ones(2))
    self.sow(nnx.Intermediate, 'i', np.int64(2**40))
    return x
out = nnx.capture(M(), nnx.Intermediate)(1.0)
"""
    ),
    'numpy_scalars_and_arrays': (
        """
class M(nnx.Module):
  def __call__(self, x):
    self.sow(nnx.Intermediate, 'f32', np.float32(0.5))
    self.sow(nnx.Intermediate, 'f64', np.float64(1e-9))
    self.sow(nnx.Intermediate, 'ints', np.arange(3, dtype=np.int64) * 2**33)
    self.sow(nnx.Intermediate, 'u8', np.uint8(7))
    self.sow(nnx.Intermediate, 'tree', {'a': np.zeros(2), 'b': 3})
    self.sow(nnx.Intermediate, 'twice', np.ones(1))
    self.sow(nnx.Intermediate, 'twice', np.int16(2))
    return x
out = nnx.capture(M(), nnx.Intermediate)(jnp.ones(2))
"""
    ),
    # Flax folds reduce_fn in Python: NumPy arithmetic, float64 kept.
    'numpy_reductions': (
        """
class M(nnx.Module):
  def __call__(self, x):
    for v in (np.float64(1e8), np.float64(1.0)):
      self.sow(nnx.Intermediate, 'total', v, init_fn=lambda: 0,
               reduce_fn=lambda a, b: a + b)
    for v in (np.ones(2), np.arange(2.0)):
      self.sow(nnx.Intermediate, 'vec', v, init_fn=lambda: 0.0,
               reduce_fn=lambda a, b: a + b)
    self.sow(nnx.Intermediate, 'big', np.int64(2**40), init_fn=lambda: 1,
             reduce_fn=lambda a, b: a + b)
    for v in (np.ones(2), np.zeros(2)):
      self.sow(nnx.Intermediate, 'grow', v, init_fn=lambda: (),
               reduce_fn=lambda a, b: (*a, b))
    self.sow(nnx.Intermediate, 'peak', np.float64(2.0),
             init_fn=lambda: jnp.zeros(()), reduce_fn=jnp.maximum)
    return x
out = nnx.capture(M(), nnx.Intermediate)(jnp.ones(2))
"""
    ),
    # A NumPy value, then a JAX array under the same name: Flax keeps both.
    'numpy_then_array': (
        """
class M(nnx.Module):
  def __call__(self, x):
    self.sow(nnx.Intermediate, 'mixed', np.ones(2))
    self.sow(nnx.Intermediate, 'mixed', x)
    return x
out = nnx.capture(M(), nnx.Intermediate)(jnp.ones(2))
"""
    ),
    'numpy_method_outputs': (
        """
class S(nnx.Module):
  def table(self):
    return np.arange(3.0)
  def __call__(self, x):
    self.table()
    return x
out = nnx.capture(S(), nnx.Intermediate,
                  method_outputs=nnx.Intermediate)(jnp.ones(2))
"""
    ),
    'numpy_two_modules': (
        """
class Leaf(nnx.Module):
  def __call__(self, x):
    self.sow(nnx.Intermediate, 'stat', np.float64(x.sum()))
    return x
class Net(nnx.Module):
  def __init__(self):
    self.a, self.b = Leaf(), Leaf()
  def __call__(self, x):
    return self.b(self.a(x) + 1.0)
out = nnx.capture(Net(), nnx.Intermediate)(jnp.ones(2))
"""
    ),
    # Under an nnx.jit around nnx.capture, jit returns arrays in both.
    'numpy_under_jit': (
        """
class M(nnx.Module):
  def __call__(self, x):
    self.sow(nnx.Intermediate, 'h', np.ones(2))
    self.sow(nnx.Intermediate, 'i', np.int64(7))
    return x
out = nnx.jit(lambda m, x: nnx.capture(m, nnx.Intermediate)(x))(
    M(), jnp.ones(2))
"""
    ),
    # In an nnx.jit body: JAX arrays in both.
    'numpy_in_nnx_jit': (
        """
class M(nnx.Module):
  def __call__(self, x):
    self.sow(nnx.Intermediate, 'h', np.ones(2))
    self.sow(nnx.Intermediate, 'i', np.int64(7))
    return x
out = nnx.capture(nnx.jit(lambda m, x: m(x)), nnx.Intermediate)(
    M(), jnp.ones(2))
"""
    ),
}


def _run(programs: dict[str, str], shims: bool) -> dict:
  env = dict(os.environ, JAX_PLATFORMS='cpu')
  done = subprocess.run(
      [sys.executable, '-c', _RUNNER, 'shims' if shims else 'flax'],
      input=json.dumps(programs),
      capture_output=True,
      text=True,
      env=env,
      timeout=600,
      check=False,
  )
  lines = [l for l in done.stdout.splitlines() if l.startswith('RESULTS ')]
  if done.returncode or not lines:
    raise AssertionError(f'subprocess failed:\n{done.stderr[-3000:]}')
  return json.loads(lines[-1][len('RESULTS ') :])


@functools.cache
def _results(shims: bool) -> dict:
  return _run(PROGRAMS, shims)


def _numpy(value):
  value = np.asarray(value)
  return {
      type(value).__name__: str(value.dtype),
      'shape': list(value.shape),
      'value': value.tolist(),
  }


class NumpyValuesFlaxParityTest(parameterized.TestCase):
  """NumPy values sown at the top level come back as Flax returns them."""

  @parameterized.named_parameters((name, name) for name in PROGRAMS)
  def test_same_as_flax(self, name):
    flax_result = _results(False)[name]
    self.assertNotIn('error', flax_result)
    self.assertEqual(_results(True)[name], flax_result)

  def test_flax_keeps_numpy_objects(self):
    # By hand, what the comparison above holds the shims to: the ndarray
    # stays float64 and the int64 keeps 2**40 (a JAX array would be a
    # float32 and an int32 0).
    _, state = _results(True)['numpy_values']['tuple']
    entries = {k: v['value'] for k, v in state['state'].items()}
    self.assertEqual(entries["'h'"], {'tuple': [_numpy(np.ones(2))]})
    self.assertEqual(
        entries["'i'"],
        {'tuple': [{'int64': 'int64', 'shape': [], 'value': 2**40}]},
    )

  def test_in_process_objects(self):
    # The caller's very objects, folded by the user's reduce_fn in NumPy.
    h, i = np.ones(2), np.int64(2**40)

    class M(nnx.Module):

      def __call__(self, x):
        self.sow(nnx.Intermediate, 'h', h)
        self.sow(nnx.Intermediate, 'i', i)
        for v in (np.float64(1e8), np.float64(1.0)):
          self.sow(
              nnx.Intermediate,
              't',
              v,
              init_fn=lambda: 0,
              reduce_fn=lambda a, b: a + b,
          )
        return x

    y, state = nnx.capture(M(), nnx.Intermediate)(1.0)
    self.assertEqual(y, 1.0)
    (got_h,), (got_i,) = state['h'].get_value(), state['i'].get_value()
    self.assertIs(got_h, h)
    self.assertIs(got_i, i)
    total = state['t'].get_value()
    self.assertIsInstance(total, np.float64)
    self.assertEqual(total, 1e8 + 1.0)  # float32 would give 1e8

  def test_numpy_in_a_scan_body_is_stacked(self):
    # Inside a transform a NumPy value becomes a JAX array, stacked per
    # step (Known differences: Flax keeps one value there).

    class L(nnx.Module):

      def __call__(self, xs):
        def body(c, x):
          self.sow(nnx.Intermediate, 'k', np.int64(5))
          return c + x, None

        return jax.lax.scan(body, 0.0, xs)[0]

    _, state = nnx.capture(L(), nnx.Intermediate)(jnp.ones(3))
    (k,) = state['k'].get_value()
    self.assertIsInstance(k, jax.Array)
    self.assertEqual(k.dtype, jnp.int32)
    np.testing.assert_array_equal(k, [5, 5, 5])


class OverflowTest(absltest.TestCase):
  """An integer that JAX's dtype cannot hold raises, naming the sow."""

  def _module(self, sow_it):

    class M(nnx.Module):

      def __call__(self, x):
        sow_it(self, x)
        return x

    return M()

  def test_module_sow_in_nnx_jit_body(self):
    # Flax 0.12.8 returns int32 0 here; the shims refuse to wrap.
    m = self._module(lambda s, x: s.sow(nnx.Intermediate, 'i', np.int64(2**40)))
    with self.assertRaisesRegex(
        OverflowError, r"Module\.sow\(Intermediate, 'i'\) in M.*int32"
    ):
      nnx.capture(nnx.jit(lambda m, x: m(x)), nnx.Intermediate)(m, 1.0)

  def test_module_sow_reduced_in_jax_jit_body(self):
    m = self._module(
        lambda s, x: s.sow(
            nnx.Intermediate,
            'n',
            np.array([1, 2**40]),
            init_fn=lambda: jnp.zeros(2, jnp.int32),
            reduce_fn=lambda a, b: a + b,
        )
    )
    with self.assertRaisesRegex(
        OverflowError, r"Module\.sow\(Intermediate, 'n'\) in M"
    ):
      nnx.capture(lambda m, x: jax.jit(lambda x: m(x))(x), nnx.Intermediate)(
          m, 1.0
      )

  def test_module_sow_after_an_array(self):
    def sow_both(s, x):
      s.sow(nnx.Intermediate, 'mixed', x)
      s.sow(nnx.Intermediate, 'mixed', np.uint64(2**40))

    with self.assertRaisesRegex(
        OverflowError, r"Module\.sow\(Intermediate, 'mixed'\) in M.*uint32"
    ):
      nnx.capture(self._module(sow_both), nnx.Intermediate)(jnp.ones(2))

  def test_method_output_in_nnx_jit_body(self):

    class S(nnx.Module):

      def count(self):
        return np.int64(2**40)

      def __call__(self, x):
        self.count()
        return x

    with self.assertRaisesRegex(
        OverflowError, r'method_outputs=\.\.\.\): the output of S\.count'
    ):
      nnx.capture(
          nnx.jit(lambda m, x: m(x)),
          nnx.Intermediate,
          method_outputs=nnx.Intermediate,
      )(S(), 1.0)

  def test_functional_sow(self):
    values = {
        'scalar': np.int64(2**40),
        'array': np.array([3, -(2**40)]),
        'python': 2**40,
    }
    for kind, value in values.items():
      f = lambda x, v=value: x + sow(v, name=('i', kind)) * 0
      for how, g in (('eager', capture(f)), ('jit', jax.jit(capture(f)))):
        with self.subTest(kind=kind, how=how):
          with self.assertRaisesRegex(OverflowError, rf"sow \('i', '{kind}'\)"):
            g(1)

  def test_functional_perturb(self):
    from flax.nnx.sow import perturb  # pylint: disable=g-import-not-at-top

    with self.assertRaisesRegex(OverflowError, "perturb 'p'"):
      capture(lambda: perturb(np.int64(-(2**40)), name='p'))()

  def test_values_that_fit(self):
    _, collected = capture(lambda: sow(np.int64(2**31 - 1), name='i'))()
    (i,) = collected['i']
    self.assertEqual(i.dtype, jnp.int32)
    self.assertEqual(int(i), 2**31 - 1)
    with jax.enable_x64(True):
      f = lambda: sow(np.int64(2**40), name='i')
      for g in (capture(f), jax.jit(capture(f))):
        _, collected = g()
        (i,) = collected['i']
        self.assertEqual(i.dtype, jnp.int64)
        self.assertEqual(int(i), 2**40)

  def test_outside_a_capture_sow_is_the_identity(self):
    for value in (2**40, np.int64(2**40), np.array([2**40])):
      self.assertIs(sow(value, name='i'), value)


def _numpy_linear():
  """An nnx.Linear whose Params hold NumPy arrays, and those arrays."""
  m = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
  kernel = np.array([[1.0, -2.0, 0.5], [0.25, 1.0, 3.0]], np.float32)
  bias = np.array([0.5, -1.0, 2.0], np.float32)
  state = nnx.state(m)
  nnx.replace_by_pure_dict(state, {'kernel': kernel, 'bias': bias})
  nnx.update(m, state)
  return m, kernel, bias


def _g(m, x):
  """``m(2 x)``, with ``2 x`` sown as 'h'."""
  return m(sow(2.0 * x, name='h'))


class NumpyParamTest(absltest.TestCase):
  """A Param holding NumPy keeps it; results equal the plain computation."""

  def setUp(self):
    super().setUp()
    self.m, self.kernel, self.bias = _numpy_linear()
    self.x = np.array([1.0, -1.0], np.float32)
    self.xs = np.array([[1.0, -1.0], [0.5, 2.0], [0.0, 3.0]], np.float32)
    self.r = np.array([2.0, 1.0], np.float32)  # the replacement of 'h'

  def by_hand(self, h):
    return np.asarray(h) @ self.kernel + self.bias

  def restore(self):
    """The NumPy arrays back in the Params (a failed subtest's call may have
    replaced them)."""
    self.m.kernel.set_value(self.kernel)
    self.m.bias.set_value(self.bias)

  def assert_param_unchanged(self):
    self.assertIs(self.m.kernel.get_value(), self.kernel)
    self.assertIs(self.m.bias.get_value(), self.bias)

  def test_intervene_eager(self):
    m = self.m
    for label, f, args in (
        ('argument', _g, (m, self.x)),
        ('closure', lambda x: _g(m, x), (self.x,)),
    ):
      with self.subTest(label):
        self.restore()
        y = intervene(f, {'h': (self.r,)})(*args)
        np.testing.assert_allclose(y, self.by_hand(self.r), rtol=1e-6)
        self.assert_param_unchanged()

  def test_intervene_under_vmap_and_jit(self):
    m, xs, r = self.m, self.xs, self.r
    rs = np.stack([r, -r, 2 * r])
    expected = self.by_hand(rs)
    callables = {
        'vmap_argument': lambda: jax.vmap(
            lambda x, r: intervene(_g, {'h': (r,)})(m, x)
        )(xs, rs),
        'vmap_closure': lambda: jax.vmap(
            lambda x, r: intervene(lambda x: _g(m, x), {'h': (r,)})(x)
        )(xs, rs),
        'vmap_of_intervene': lambda: jax.vmap(
            intervene(lambda x: _g(m, x), {'h': (r,)})
        )(xs),
        'jit_argument': lambda: jax.jit(
            jax.vmap(lambda x, r: intervene(_g, {'h': (r,)})(m, x))
        )(xs, rs),
    }
    for label, call in callables.items():
      with self.subTest(label):
        self.restore()
        want = (
            self.by_hand([r] * 3)
            if label == 'vmap_of_intervene'
            else (expected)
        )
        np.testing.assert_allclose(call(), want, rtol=1e-6)
        self.assert_param_unchanged()
    # Plain Flax runs the same vmapped model.
    np.testing.assert_allclose(
        jax.vmap(lambda x: m(2.0 * x))(xs), self.by_hand(2.0 * xs), rtol=1e-6
    )

  def test_capture(self):
    m, x, xs = self.m, self.x, self.xs
    y, collected = capture(_g)(m, x)
    np.testing.assert_allclose(y, self.by_hand(2.0 * x), rtol=1e-6)
    np.testing.assert_allclose(collected['h'][0], 2.0 * x)
    self.assert_param_unchanged()
    ys, collected = jax.vmap(lambda x: capture(_g)(m, x))(xs)
    np.testing.assert_allclose(ys, self.by_hand(2.0 * xs), rtol=1e-6)
    np.testing.assert_allclose(collected['h'][0], 2.0 * xs)
    self.assert_param_unchanged()
    y, collected = jax.jit(lambda x: capture(_g)(m, x))(x)
    np.testing.assert_allclose(y, self.by_hand(2.0 * x), rtol=1e-6)
    self.assert_param_unchanged()

  def test_nnx_capture_and_module_outputs(self):
    m, x, xs = self.m, self.x, self.xs
    y, state = nnx.capture(
        _g, nnx.Intermediate, method_outputs=nnx.Intermediate
    )(m, x)
    np.testing.assert_allclose(y, self.by_hand(2.0 * x), rtol=1e-6)
    np.testing.assert_allclose(
        state['__call__'].get_value()[0], self.by_hand(2.0 * x), rtol=1e-6
    )
    self.assert_param_unchanged()
    outputs = module_outputs(_g, nnx.Linear)
    replaced = {('__call__',): (np.zeros(3, np.float32),)}
    for label, call, expected in (
        ('capture', lambda: capture(outputs)(m, x)[0], self.by_hand(2 * x)),
        ('intervene', lambda: intervene(outputs, replaced)(m, x), 0.0),
        (
            'vmap_intervene',
            lambda: jax.vmap(lambda x: intervene(outputs, replaced)(m, x))(xs),
            np.zeros((3, 3)),
        ),
    ):
      with self.subTest(label):
        self.restore()
        np.testing.assert_allclose(call(), expected, rtol=1e-6)
        self.assert_param_unchanged()

  def test_state_argument(self):
    # A State among the arguments (its Variables passed as they are).
    graphdef, state = nnx.split(self.m)
    kernel = state['kernel']
    f = lambda state, x: _g(nnx.merge(graphdef, state), x)
    y = intervene(f, {'h': (self.r,)})(state, self.x)
    np.testing.assert_allclose(y, self.by_hand(self.r), rtol=1e-6)
    self.assertIs(kernel.get_value(), self.kernel)
    ys = jax.vmap(lambda x: intervene(f, {'h': (self.r,)})(state, x))(self.xs)
    np.testing.assert_allclose(ys, self.by_hand([self.r] * 3), rtol=1e-6)
    self.assertIs(kernel.get_value(), self.kernel)

  def test_updates_still_reach_the_caller(self):
    # A Variable f changes is written back; the NumPy Params are not.

    class Counted(nnx.Module):

      def __init__(self, linear):
        self.linear = linear
        self.calls = nnx.Variable(jnp.zeros((), jnp.int32))

      def __call__(self, x):
        self.calls[...] += 1
        return self.linear(sow(2.0 * x, name='h'))

    c = Counted(self.m)
    for _ in range(2):
      y = intervene(lambda c, x: c(x), {'h': (self.r,)})(c, self.x)
      np.testing.assert_allclose(y, self.by_hand(self.r), rtol=1e-6)
    self.assertEqual(int(c.calls.get_value()), 2)
    self.assert_param_unchanged()
    # The same with a State among the arguments.
    weights = np.array([1.0, 2.0], np.float32)
    state = nnx.State(
        {
            'calls': nnx.Variable(jnp.zeros((), jnp.int32)),
            'w': nnx.Param(weights),
        }
    )

    def scaled(state, x):
      state['calls'][...] += 1
      return state['w'][...] * sow(x, name='h')

    y = intervene(scaled, {'h': (self.r,)})(state, self.x)
    np.testing.assert_allclose(y, weights * self.r)
    self.assertEqual(int(state['calls'].get_value()), 1)
    self.assertIs(state['w'].get_value(), weights)
