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

"""The NNX shims against Flax 0.12.8 itself.

Each program in :data:`PROGRAMS` runs twice, in two subprocesses: one that
never imports ``flax.nnx.sow`` (so ``Module.sow``, ``Module.perturb`` and
``nnx.capture`` are Flax 0.12.8's own), and one that imports it (the shims
install on import). Their results, described as JSON (types of Python
values included), must be equal, except where ``docs/migration.md``'s
*Known differences* says otherwise: those tests check Flax's side of the
claim against Flax and the shims' side by hand. Programs Flax cannot run
(the functional ``capture``, a capture under ``jax.jit``) are checked in
this process against the same computation written without sow.
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

_RUNNER = r'''
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
    return {'state': {repr(k): describe(v) for k, v in x.items()}}
  if isinstance(x, (jax.Array, np.ndarray)):
    return {'array': str(x.dtype), 'shape': list(x.shape),
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
'''

PROGRAMS = {
    # 1. init= entries that this call does not sow.
    'init_not_sown_perturbation': """
class M(nnx.Module):
  def __init__(self):
    self.w = nnx.Param(jnp.ones(3))
  def __call__(self, x, train):
    h = x * self.w[...]
    if train:
      h = self.perturb('h', h)
    return jnp.sum(self.perturb('g', h) ** 2)
m, x = M(), jnp.arange(3.0)
_, p = nnx.capture(m, nnx.Perturbation)(x, True)
y, q = nnx.capture(m, nnx.Perturbation, init=p)(x, False)
def loss(m, p, x):
  return nnx.capture(m, nnx.Intermediate, init=p)(x, False)
(_, g), _ = nnx.grad(loss, argnums=(0, 1), has_aux=True)(m, p, x)
out = (y, q, g)
""",
    'init_not_sown_intermediate': """
class Inner(nnx.Module):
  def __call__(self, x, train):
    if train:
      self.sow(nnx.Intermediate, 'a', x)
    self.sow(nnx.Intermediate, 'b', 2.0 * x)
    return x
class Outer(nnx.Module):
  def __init__(self):
    self.inner = Inner()
  def __call__(self, x, train):
    return self.inner(x, train)
m, x = Outer(), jnp.arange(2.0)
_, s = nnx.capture(m, nnx.Intermediate)(x, True)
out = nnx.capture(m, nnx.Intermediate, init=s)(x + 1.0, False)
""",
    # 2. Python numbers keep their type where Flax folds in Python.
    'python_numbers': """
class M(nnx.Module):
  def __call__(self, x):
    self.sow(nnx.Intermediate, 'f', 0.1)
    self.sow(nnx.Intermediate, 'big', 2**40)
    self.sow(nnx.Intermediate, 'i', 3)
    self.sow(nnx.Intermediate, 'i', 4)
    self.sow(nnx.Intermediate, 'text', 'hello')
    for v in (1e8, 1.0):
      self.sow(nnx.Intermediate, 'total', v, init_fn=lambda: 0,
               reduce_fn=lambda a, b: a + b)
    self.sow(nnx.Intermediate, 'peak', 2.0, init_fn=lambda: jnp.zeros(()),
             reduce_fn=jnp.maximum)
    return x
out = nnx.capture(M(), nnx.Intermediate)(jnp.ones(2))
""",
    'python_numbers_from_init': """
class M(nnx.Module):
  def __call__(self, x):
    self.sow(nnx.Intermediate, 'f', 0.1)
    self.sow(nnx.Intermediate, 'n', 1, init_fn=lambda: 0,
             reduce_fn=lambda a, b: a + b)
    return x
m = M()
_, first = nnx.capture(m, nnx.Intermediate)(jnp.ones(2))
out = nnx.capture(m, nnx.Intermediate, init=first)(jnp.ones(2))
""",
    'python_numbers_in_nnx_jit': """
class M(nnx.Module):
  def __call__(self, x):
    self.sow(nnx.Intermediate, 'f', 0.1)
    return x
out = nnx.capture(nnx.jit(lambda m, x: m(x)), nnx.Intermediate)(
    M(), jnp.ones(2))
""",
    # 3. A reduce_fn that changes the accumulator's type under nnx.remat.
    'remat_type_change': """
class R(nnx.Module):
  def __call__(self, x):
    self.sow(nnx.Intermediate, 'peak', x, init_fn=lambda: 0.0,
             reduce_fn=jnp.maximum)
    for v in (x, x + 1.0):
      self.sow(nnx.Intermediate, 'all', v, init_fn=lambda: (),
               reduce_fn=lambda a, v: (*a, v))
    return x * 2.0
class Outer(nnx.Module):
  def __init__(self):
    self.r = R()
  def __call__(self, x):
    return nnx.remat(lambda r, x: r(x))(self.r, x)
out = nnx.capture(Outer(), nnx.Intermediate)(jnp.arange(2.0))
""",
    # 4. Reduced sows in nnx.fori_loop / nnx.while_loop, with init=.
    'fori_loop_init': """
class L(nnx.Module):
  def __call__(self, x):
    def body(i, c):
      m, x = c
      m.sow(nnx.Intermediate, 'n', x, init_fn=lambda: jnp.zeros(2),
            reduce_fn=lambda a, v: a + v)
      return m, x * 2.0
    return nnx.fori_loop(0, 3, body, (self, x))[1]
class P(nnx.Module):
  def __init__(self):
    self.l = L()
  def __call__(self, x):
    return self.l(x)
init = nnx.State({'l': {'n': nnx.Intermediate(jnp.full(2, 10.0))}})
out = (nnx.capture(P(), nnx.Intermediate, init=init)(jnp.ones(2)),
       nnx.capture(L(), nnx.Intermediate, init=init['l'])(jnp.ones(2)))
""",
    'while_loop_init': """
class W(nnx.Module):
  def __call__(self, x):
    def body(c):
      m, i, x = c
      m.sow(nnx.Intermediate, 'n', x, init_fn=lambda: jnp.zeros(2),
            reduce_fn=lambda a, v: a + v)
      return m, i + 1, x * 2.0
    return nnx.while_loop(lambda c: c[1] < 3, body, (self, 0, x))[2]
class P(nnx.Module):
  def __init__(self):
    self.w = W()
  def __call__(self, x):
    return self.w(x)
init = nnx.State({'w': {'n': nnx.Intermediate(jnp.full(2, 10.0))}})
out = nnx.capture(P(), nnx.Intermediate, init=init)(jnp.ones(2))
""",
    # 5. method_outputs of methods that return no array.
    'method_outputs_python': """
class S(nnx.Module):
  def greet(self):
    return 'hi'
  def count(self):
    return 3
  def __call__(self, x):
    self.greet()
    self.count()
    return x
out = nnx.capture(S(), nnx.Intermediate,
                  method_outputs=nnx.Intermediate)(jnp.ones(2))
""",
    # 6. A type requested twice.
    'repeated_type': """
class T(nnx.Module):
  def __call__(self, x):
    self.sow(nnx.Intermediate, 'a', x)
    return x
out = nnx.capture(T(), nnx.Intermediate, nnx.Intermediate)(jnp.ones(2))
""",
}

# Programs whose results differ as docs/migration.md's Known differences
# say: run under Flax only, and checked against what that section claims.
FLAX_CLAIMS = {
    'sow_and_perturb_one_name': """
class Both(nnx.Module):
  def __init__(self):
    self.w = nnx.Param(jnp.ones(3))
  def __call__(self, x):
    h = x * self.w[...]
    self.sow(nnx.Intermediate, 'h', h)
    return jnp.sum(self.perturb('h', h) ** 2)
x = jnp.arange(3.0)
out = (nnx.capture(Both(), nnx.Perturbation, nnx.Intermediate)(x)[1:],
       nnx.capture(Both(), nnx.Intermediate, nnx.Perturbation)(x)[1:])
""",
    'subclass_filtering': """
class Mine(nnx.Intermediate):
  pass
class S(nnx.Module):
  def __call__(self, x):
    self.sow(Mine, 'a', x)
    self.sow(nnx.Intermediate, 'b', x)
    return x
out = (nnx.capture(S(), nnx.Intermediate, Mine)(1.0)[1:],
       nnx.capture(S(), Mine, nnx.Intermediate)(1.0)[1:])
""",
    'direct_perturb': """
class Scaled(nnx.Module):
  def __init__(self):
    self.w = nnx.Param(jnp.ones(3))
  def __call__(self, x):
    return jnp.sum(3.0 * self.perturb('x', x * self.w[...]))
out = nnx.capture(nnx.grad(lambda m, x: m(x)), nnx.Perturbation)(
    Scaled(), jnp.ones(3))[1]
""",
    'nested_same_module': """
import warnings
class T(nnx.Module):
  def __call__(self, x):
    self.sow(nnx.Intermediate, 'a', x)
    return x
def twice(m, x):
  y, inner = nnx.capture(m, nnx.Intermediate)(x)
  return m(y), inner
t = T()
with warnings.catch_warnings(record=True) as caught:
  warnings.simplefilter('always')
  (_, inner), outer = nnx.capture(twice, nnx.Intermediate)(t, 1.0)
out = (inner, outer, hasattr(t, 'a'),
       [w.category.__name__ for w in caught])
""",
    'python_numbers_in_scan': """
class L(nnx.Module):
  def __call__(self, xs):
    def body(c, x):
      self.sow(nnx.Intermediate, 'f', 0.1)
      self.sow(nnx.Intermediate, 'big', 2**40)
      return c + x, None
    return jax.lax.scan(body, 0.0, xs)[0]
out = nnx.capture(L(), nnx.Intermediate)(jnp.ones(3))[1]
""",
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
  return json.loads(lines[-1][len('RESULTS '):])


@functools.cache
def _results(shims: bool) -> dict:
  programs = dict(PROGRAMS, **({} if shims else FLAX_CLAIMS))
  return _run(programs, shims)


def _py(value):
  return {'py': type(value).__name__, 'value': value}


def _array(value, dtype='float32'):
  value = np.asarray(value)
  return {'array': dtype, 'shape': list(value.shape), 'value': value.tolist()}


def _var(kind, value):
  return {'variable': kind, 'value': value}


def _state(**entries):
  return {'state': {repr(k): v for k, v in entries.items()}}


class FlaxParityTest(parameterized.TestCase):
  """The same program gives the same result with and without the shims."""

  @parameterized.named_parameters((name, name) for name in PROGRAMS)
  def test_same_as_flax(self, name):
    flax_result = _results(False)[name]
    self.assertNotIn('error', flax_result)
    self.assertEqual(_results(True)[name], flax_result)

  def test_init_entries_not_sown_are_returned(self):
    # By hand: the eval call perturbs only 'g'; 'h' comes back from init=.
    _, q, g = _results(True)['init_not_sown_perturbation']['tuple']
    zeros = _var('Perturbation', _array([0.0, 0.0, 0.0]))
    self.assertEqual(q, _state(g=zeros, h=zeros))
    # d sum(g^2)/dg = 2g = 2x; 'h' is not on the eval path.
    self.assertEqual(
        g, _state(g=_var('Perturbation', _array([0.0, 2.0, 4.0])), h=zeros)
    )

  def test_init_entries_not_sown_under_jit(self):
    # By hand, the capture under jax.jit (Flax cannot): the eval call does
    # not perturb 'h', which comes back as init= gave it.

    class M(nnx.Module):

      def __init__(self):
        self.w = nnx.Param(jnp.ones(3))

      def __call__(self, x, train):
        h = x * self.w[...]
        if train:
          h = self.perturb('h', h)
        return jnp.sum(self.perturb('g', h) ** 2)

    m, x = M(), jnp.arange(3.0)
    _, p = nnx.capture(m, nnx.Perturbation)(x, True)
    p = jax.tree.map(lambda v: v + 1.0, p)  # not zeros: seen as given
    run = jax.jit(
        lambda x, p: nnx.capture(m, nnx.Perturbation, init=p)(x, False)
    )
    y, q = run(x, p)
    np.testing.assert_allclose(y, np.sum((np.arange(3.0) + 1.0) ** 2))
    self.assertEqual(sorted(q), ['g', 'h'])
    np.testing.assert_array_equal(q['h'][...], [1.0, 1.0, 1.0])
    np.testing.assert_array_equal(q['g'][...], [1.0, 1.0, 1.0])

  def test_python_numbers_keep_their_type(self):
    _, state = _results(True)['python_numbers']['tuple']
    entries = {k: v['value'] for k, v in state['state'].items()}
    self.assertEqual(entries["'f'"], {'tuple': [_py(0.1)]})
    self.assertEqual(entries["'big'"], {'tuple': [_py(2**40)]})
    self.assertEqual(entries["'i'"], {'tuple': [_py(3), _py(4)]})
    self.assertEqual(entries["'text'"], {'tuple': [_py('hello')]})
    self.assertEqual(entries["'total'"], _py(1e8 + 1.0))

  def test_python_number_next_to_an_array(self):
    # Flax keeps the Python values next to the array; known differences:
    # after the name is sown with an array, a Python number is an array.

    class M(nnx.Module):

      def __call__(self, x):
        self.sow(nnx.Intermediate, 'mixed', 0.5)
        self.sow(nnx.Intermediate, 'mixed', x)
        self.sow(nnx.Intermediate, 'mixed', 2**40)
        self.sow(nnx.Intermediate, 'mixed', 0.25)
        return x

    with self.assertRaisesRegex(
        OverflowError, r"Module\.sow\(Intermediate, 'mixed'\) in M"
    ):
      nnx.capture(M(), nnx.Intermediate)(jnp.ones(2))

    class N(nnx.Module):

      def __call__(self, x):
        self.sow(nnx.Intermediate, 'mixed', 0.5)
        self.sow(nnx.Intermediate, 'mixed', x)
        self.sow(nnx.Intermediate, 'mixed', 0.25)
        return x

    _, state = nnx.capture(N(), nnx.Intermediate)(jnp.ones(2))
    first, second, third = state['mixed'].get_value()
    self.assertEqual((type(first), first), (float, 0.5))
    np.testing.assert_array_equal(second, [1.0, 1.0])
    self.assertEqual(third.dtype, jnp.float32)
    self.assertEqual(float(third), 0.25)

  def test_python_value_then_the_same_name_in_a_cached_jit(self):
    # Each call starts the jit body's fold from this call's Python value
    # (n + 1, as Flax gives), also when nnx.jit's trace of an earlier call
    # could serve it.

    class Counter(nnx.Module):

      def __call__(self, x, n):
        self.sow(nnx.Intermediate, 'count', n, init_fn=lambda: 0,
                 reduce_fn=lambda a, b: a + b)
        self.sow(nnx.Intermediate, 'seen', n)
        return x

    @nnx.jit
    def inner(m, x):
      m.sow(nnx.Intermediate, 'count', 1, init_fn=lambda: 0,
            reduce_fn=lambda a, b: a + b)
      m.sow(nnx.Intermediate, 'seen', x)
      return x

    class Model(nnx.Module):

      def __init__(self):
        self.c = Counter()

      def __call__(self, x, n):
        self.c(x, n)
        return inner(self.c, x)

    model = Model()
    for n in (10, 20, 30):
      _, state = nnx.capture(model, nnx.Intermediate)(jnp.ones(()), n)
      self.assertEqual(int(state['c']['count'].get_value()), n + 1)
      first, second = state['c']['seen'].get_value()
      self.assertEqual((type(first), first), (int, n))
      self.assertEqual(float(second), 1.0)

  def test_reduce_fn_that_needs_arrays(self):
    # A reduce_fn that Python numbers cannot run (Flax raises an
    # AttributeError) folds them as arrays, by hand 1 + 2.

    class M(nnx.Module):

      def __call__(self, x):
        for v in (1.0, 2.0):
          self.sow(nnx.Intermediate, 's', v, init_fn=lambda: 0.0,
                   reduce_fn=lambda a, v: a + v.sum())
        return x

    _, state = nnx.capture(M(), nnx.Intermediate)(1.0)
    self.assertEqual(float(state['s'].get_value()), 3.0)

  def test_method_outputs_without_arrays(self):
    _, state = _results(True)['method_outputs_python']['tuple']
    self.assertEqual(state['state']["'greet'"]['value'], {'tuple': [_py('hi')]})
    self.assertEqual(state['state']["'count'"]['value'], {'tuple': [_py(3)]})

  def test_repeated_type_gets_an_empty_state(self):
    _, first, second = _results(True)['repeated_type']['tuple']
    self.assertEqual(first, _state(a=_var('Intermediate', {
        'tuple': [_array([1.0, 1.0])]})))
    self.assertEqual(second, _state())


class KnownDifferencesTest(absltest.TestCase):
  """What docs/migration.md's Known differences says, on both sides."""

  def flax(self, name):
    result = _results(False)[name]
    self.assertNotIn('error', result)
    return result

  def test_sow_and_perturb_one_name(self):
    # Flax: one entry, the type requested later overwrites the other.
    p_first, i_first = self.flax('sow_and_perturb_one_name')['tuple']
    sown = _var('Intermediate', {'tuple': [_array([0.0, 1.0, 2.0])]})
    zeros = _var('Perturbation', _array([0.0, 0.0, 0.0]))
    self.assertEqual(p_first, {'tuple': [_state(), _state(h=sown)]})
    # Perturbation subclasses Intermediate: it lands in the first State.
    self.assertEqual(i_first, {'tuple': [_state(h=zeros), _state()]})

    class Both(nnx.Module):

      def __init__(self):
        self.w = nnx.Param(jnp.ones(3))

      def __call__(self, x):
        h = x * self.w[...]
        self.sow(nnx.Intermediate, 'h', h)
        return jnp.sum(self.perturb('h', h) ** 2)

    x = jnp.arange(3.0)
    _, p, i = nnx.capture(Both(), nnx.Perturbation, nnx.Intermediate)(x)
    np.testing.assert_array_equal(p['h'][...], np.zeros(3))
    np.testing.assert_array_equal(i['h'][0], x)

  def test_subclass_filtering(self):
    parent_first, child_first = self.flax('subclass_filtering')['tuple']
    mine = _var('Mine', {'tuple': [_py(1.0)]})
    sown = _var('Intermediate', {'tuple': [_py(1.0)]})
    self.assertEqual(
        parent_first, {'tuple': [_state(a=mine, b=sown), _state()]}
    )
    self.assertEqual(child_first, {'tuple': [_state(a=mine), _state(b=sown)]})

    class Mine(nnx.Intermediate):
      pass

    class S(nnx.Module):

      def __call__(self, x):
        self.sow(Mine, 'a', x)
        self.sow(nnx.Intermediate, 'b', x)
        return x

    _, parent, child = nnx.capture(S(), nnx.Intermediate, Mine)(1.0)
    self.assertEqual(list(parent), ['b'])
    self.assertEqual(list(child), ['a'])
    self.assertIs(type(child['a']), Mine)

  def test_direct_perturb(self):
    zeros = _var('Perturbation', _array([0.0, 0.0, 0.0]))
    self.assertEqual(self.flax('direct_perturb'), _state(x=zeros))

    class Scaled(nnx.Module):

      def __init__(self):
        self.w = nnx.Param(jnp.ones(3))

      def __call__(self, x):
        return jnp.sum(3.0 * self.perturb('x', x * self.w[...]))

    _, grads = nnx.capture(nnx.grad(lambda m, x: m(x)), nnx.Perturbation)(
        Scaled(), jnp.ones(3)
    )
    np.testing.assert_array_equal(grads['x'][...], [3.0, 3.0, 3.0])

  def test_nested_capture_of_the_same_module(self):
    inner, outer, attribute, warned = self.flax('nested_same_module')['tuple']
    self.assertEqual(
        inner, _state(a=_var('Intermediate', {'tuple': [_py(1.0)]}))
    )
    self.assertEqual(outer, _state())
    self.assertEqual(attribute, _py(True))
    self.assertEqual(warned, {'list': [_py('DeprecationWarning')]})

    class T(nnx.Module):

      def __call__(self, x):
        self.sow(nnx.Intermediate, 'a', x)
        return x

    def twice(m, x):
      y, inner = nnx.capture(m, nnx.Intermediate)(x)
      return m(y), inner

    t = T()
    (_, inner), outer = nnx.capture(twice, nnx.Intermediate)(t, 1.0)
    self.assertEqual(inner['a'].get_value(), (1.0,))
    self.assertEqual(outer['a'].get_value(), (1.0,))
    self.assertFalse(hasattr(t, 'a'))

  def test_python_numbers_in_a_loop(self):
    flax_result = self.flax('python_numbers_in_scan')
    self.assertEqual(
        flax_result,
        _state(
            f=_var('Intermediate', {'tuple': [_py(0.1)]}),
            big=_var('Intermediate', {'tuple': [_py(2**40)]}),
        ),
    )

    class L(nnx.Module):

      def __init__(self, big):
        self.big = big

      def __call__(self, xs):
        def body(c, x):
          self.sow(nnx.Intermediate, 'f', 0.1)
          if self.big:
            self.sow(nnx.Intermediate, 'big', 2**40)
          return c + x, None

        return jax.lax.scan(body, 0.0, xs)[0]

    # A stacked array, as documented (one entry per step, float32).
    _, state = nnx.capture(L(False), nnx.Intermediate)(jnp.ones(3))
    (f,) = state['f'].get_value()
    self.assertEqual(f.dtype, jnp.float32)
    np.testing.assert_array_equal(f, np.full(3, 0.1, np.float32))
    with self.assertRaisesRegex(
        OverflowError, r"Module\.sow\(Intermediate, 'big'\) in L: .*int32"
    ):
      nnx.capture(L(True), nnx.Intermediate)(jnp.ones(3))


class Lin(nnx.Module):

  def __init__(self):
    self.lin = nnx.Linear(2, 2, rngs=nnx.Rngs(0))

  def __call__(self, x):
    y = self.lin(x)
    self.sow(nnx.Intermediate, 'y', y)
    return y


class StateCopiesTest(parameterized.TestCase):
  """State copies Flax makes inside a captured f are not merged modules."""

  @parameterized.named_parameters(
      ('clone_replace_by_pure_dict', 'clone_pure'),
      ('tree_map', 'tree_map'),
      ('split_merge_round_trip', 'split_merge'),
      ('state_round_trip', 'state'),
      ('filter_merge_state', 'filter_merge'),
      ('clone_filter', 'clone_filter'),
      ('split_a_state', 'split_state'),
  )
  def test_merge_of_a_copied_state(self, kind):
    model = Lin()
    graphdef, state = nnx.split(model)
    pure = nnx.to_pure_dict(state)
    x = jnp.array([1.0, -2.0])
    copies = {
        'clone_pure': lambda s: _replaced(nnx.clone(s), pure),
        'tree_map': lambda s: jax.tree.map(lambda v: v, s),
        'split_merge': lambda s: nnx.split(nnx.merge(graphdef, s))[1],
        'state': lambda s: nnx.state(nnx.merge(graphdef, s)),
        'filter_merge': lambda s: nnx.merge_state(
            *nnx.split_state(s, nnx.Param, ...)
        ),
        'clone_filter': lambda s: nnx.filter_state(nnx.clone(s), nnx.Param),
        'split_state': lambda s: nnx.merge(*nnx.split(s)),
    }

    def f(s, x):
      return nnx.merge(graphdef, copies[kind](s))(x)

    expected = x @ model.lin.kernel[...] + model.lin.bias[...]
    for run in (capture(f), jax.jit(capture(f))):
      y, collected = run(state, x)
      self.assertEqual(list(collected), [('y',)])
      np.testing.assert_allclose(y, expected, rtol=1e-6)
      np.testing.assert_allclose(collected[('y',)][0], expected, rtol=1e-6)

  def test_two_different_graphdefs_still_raise(self):
    graphdef_a, state_a = nnx.split(Lin())
    graphdef_b, state_b = nnx.split(nnx.Sequential(Lin()))

    def f(a, b, x):
      return nnx.merge(graphdef_b, b)(nnx.merge(graphdef_a, a)(x))

    with self.assertRaisesRegex(ValueError, "Module.sow\\(Intermediate, 'y'"):
      capture(f)(state_a, state_b, jnp.ones(2))


def _replaced(state, pure):
  nnx.replace_by_pure_dict(state, pure)
  return state


class LoopsUnderJitTest(absltest.TestCase):
  """The loop cases again, the capture under jax.jit (Flax cannot)."""

  def test_fori_and_while_loop_with_init(self):

    class L(nnx.Module):

      def __call__(self, x):
        def body(i, c):
          m, x = c
          m.sow(nnx.Intermediate, 'n', x, init_fn=lambda: jnp.zeros(2),
                reduce_fn=lambda a, v: a + v)
          return m, x * 2.0

        return nnx.fori_loop(0, 3, body, (self, x))[1]

    class P(nnx.Module):

      def __init__(self):
        self.l = L()

      def __call__(self, x):
        return self.l(x)

    model = P()
    init = nnx.State({'l': {'n': nnx.Intermediate(jnp.full(2, 10.0))}})
    run = jax.jit(lambda x: nnx.capture(model, nnx.Intermediate, init=init)(x))
    y, state = run(jnp.ones(2))
    np.testing.assert_array_equal(y, [8.0, 8.0])
    # 10 + (1 + 2 + 4): the init value, then one fold per iteration.
    np.testing.assert_array_equal(state['l']['n'][...], [17.0, 17.0])

  def test_remat_reduce_changes_type_under_jit(self):

    class R(nnx.Module):

      def __call__(self, x):
        for v in (x, x + 1.0):
          self.sow(nnx.Intermediate, 'all', v, init_fn=lambda: (),
                   reduce_fn=lambda a, v: (*a, v))
        return x * 2.0

    r = R()

    def f(x):
      return jax.checkpoint(
          lambda x: r(x), policy=jax.checkpoint_policies.nothing_saveable
      )(x)

    for run in (capture(lambda x: f(x)), jax.jit(capture(lambda x: f(x)))):
      _, collected = run(jnp.arange(2.0))
      first, second = collected[('all',)]
      np.testing.assert_array_equal(first, [0.0, 1.0])
      np.testing.assert_array_equal(second, [1.0, 2.0])


if __name__ == '__main__':
  absltest.main()
