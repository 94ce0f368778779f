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

"""NNX transforms that slice module state, against Flax 0.12.8 itself.

A module that ``nnx.scan`` scans over (or ``nnx.vmap`` maps over with
``in_axes=0``) is one module per slice in Flax: a reduced ``Module.sow``
keeps one accumulator per layer, and the four-step ``init=`` recipe slices
the perturbations like the layer's state. :data:`PROGRAM` runs each case
twice, in subprocesses: once with Flax's own ``nnx.capture`` (without
importing ``flax.nnx.sow``) and once with the shims; where Flax returns a
result the shims must return the same States (structure, shapes, values).
Where Flax fails, the shims' values are checked by hand.
"""

from __future__ import annotations

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
from flax.nnx.sow import loop_indices
from flax.nnx.sow import sow
from flax.nnx.sow.constructs.rows import loop_row

PROGRAM = r'''
import json
import sys

if sys.argv[1] == 'shim':
  import flax.nnx.sow  # noqa: F401  (installs the shims)

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

CASES = {}


def case(fn):
  CASES[fn.__name__] = fn
  return fn


class Block(nnx.Module):

  def __init__(self, rngs):
    self.linear = nnx.Linear(3, 3, rngs=rngs)

  def __call__(self, x):
    y = jnp.tanh(self.linear(x))
    self.sow(nnx.Intermediate, 'tot', y.sum(),
             reduce_fn=lambda a, b: a + b, init_fn=lambda: 0.0)
    self.sow(nnx.Intermediate, 'act', y)
    y = self.perturb('h', y)
    return y


@nnx.split_rngs(splits=3)
@nnx.vmap(in_axes=(0,))
def create(rngs):
  return Block(rngs)


def scan_forward(blocks, x):
  @nnx.scan(in_axes=(0, nnx.Carry), out_axes=nnx.Carry)
  def forward(block, x):
    return block(x)
  return forward(blocks, x)


def vmap_forward(blocks, x):
  return nnx.vmap(lambda b, x: b(x), in_axes=(0, None))(blocks, x)


def remat_scan_forward(blocks, x):
  @nnx.scan(in_axes=(0, nnx.Carry), out_axes=nnx.Carry)
  def forward(block, x):
    return nnx.remat(lambda b, x: b(x))(block, x)
  return forward(blocks, x)


X = jnp.linspace(-1.0, 1.0, 6).reshape(2, 3)
FORWARDS = {
    'scan': scan_forward,
    'vmap': vmap_forward,
    'remat_scan': remat_scan_forward,
}


def intermediates(fwd):
  blocks = create(nnx.Rngs(0))
  _, st = nnx.capture(fwd, nnx.Intermediate)(blocks, X)
  return {'st': st}


def recipe(fwd, loss_of=lambda y: jnp.sum(y ** 2)):
  blocks = create(nnx.Rngs(0))
  _, perts = nnx.capture(fwd, nnx.Perturbation)(blocks, X)
  def loss(model, perts, x):
    y, st = nnx.capture(fwd, nnx.Intermediate, init=perts)(model, x)
    return loss_of(y), st
  (g, pg), st = nnx.grad(loss, argnums=(0, 1), has_aux=True)(blocks, perts, X)
  return {'perts': perts, 'pg': pg, 'g': g, 'st': st}


for _k, _f in FORWARDS.items():
  CASES[f'{_k}_intermediates'] = (lambda f: lambda: intermediates(f))(_f)
  CASES[f'{_k}_recipe'] = (lambda f: lambda: recipe(f))(_f)


@case
def nnx_jit_around_capture():
  blocks = create(nnx.Rngs(0))
  _, st = nnx.jit(
      lambda b, x: nnx.capture(scan_forward, nnx.Intermediate)(b, x))(blocks, X)
  return {'st': st}


@case
def nnx_jit_in_scan_body():
  blocks = create(nnx.Rngs(0))
  single = Block(nnx.Rngs(5))
  step = nnx.jit(lambda b, x: b(x))

  def fwd(m, x):
    y = step(m['single'], x)

    @nnx.scan(in_axes=(0, nnx.Carry), out_axes=nnx.Carry)
    def forward(block, x):
      return step(block, x)
    return forward(m['blocks'], y)

  m = nnx.Dict(single=single, blocks=blocks)
  out = {}
  for i in range(2):  # the second call hits nnx.jit's cache
    _, out[i] = nnx.capture(fwd, nnx.Intermediate)(m, X)
  return out


class Dense(nnx.Module):

  def __init__(self):
    self.w = nnx.Param(jnp.array([1.0, 2.0, 3.0]))

  def __call__(self, x):
    h = self.perturb('h', x * self.w[...])
    return jnp.sum(h ** 2)


XS = jnp.array([[1.0, 2.0, 3.0], [2.0, 3.0, 4.0]])


def dense_recipe(fwd):
  d = Dense()
  _, perts = nnx.capture(fwd, nnx.Perturbation)(d, XS)
  def loss(model, perts, xs):
    return nnx.capture(fwd, nnx.Intermediate, init=perts)(model, xs)
  (g, pg), st = nnx.grad(loss, argnums=(0, 1), has_aux=True)(d, perts, XS)
  return {'perts': perts, 'pg': pg, 'g': g, 'st': st}


@case
def vmap_broadcast_recipe():
  return dense_recipe(
      lambda m, xs: nnx.vmap(lambda m, x: m(x), in_axes=(None, 0))(m, xs).sum())


@case
def scan_broadcast_recipe():
  return dense_recipe(lambda m, xs: nnx.scan(
      lambda m, c, x: (c + m(x), None), in_axes=(None, nnx.Carry, 0))(
          m, 0.0, xs)[0])


@case
def scan_carry_recipe():
  return dense_recipe(lambda m, xs: nnx.scan(
      lambda m, x: (m, m(x)), in_axes=(nnx.Carry, 0),
      out_axes=(nnx.Carry, 0))(m, xs)[1].sum())


class Head(nnx.Module):

  def __init__(self, rngs):
    self.w = nnx.Param(jax.random.normal(rngs.params(), (3,)))

  def __call__(self, x):
    y = x * self.w[...]
    self.sow(nnx.Intermediate, 'tot', y.sum(),
             reduce_fn=lambda a, b: a + b, init_fn=lambda: 0.0)
    return self.perturb('h', y)


@case
def scan_of_vmap():
  @nnx.split_rngs(splits=2)
  @nnx.vmap(in_axes=(0,))
  def make_layer(rngs):
    @nnx.split_rngs(splits=4)
    @nnx.vmap(in_axes=(0,))
    def make_head(rngs):
      return Head(rngs)
    return make_head(rngs)

  heads = make_layer(nnx.Rngs(1))

  def fwd(heads, x):
    @nnx.scan(in_axes=(0, nnx.Carry), out_axes=nnx.Carry)
    def layer(hs, x):
      return nnx.vmap(lambda h, x: h(x), in_axes=(0, None))(hs, x).mean(0)
    return layer(heads, x)

  x = jnp.array([1.0, -2.0, 0.5])
  _, st = nnx.capture(fwd, nnx.Intermediate)(heads, x)
  _, perts = nnx.capture(fwd, nnx.Perturbation)(heads, x)
  def loss(model, perts, x):
    y, s = nnx.capture(fwd, nnx.Intermediate, init=perts)(model, x)
    return jnp.sum(y ** 2), s
  (g, pg), st2 = nnx.grad(loss, argnums=(0, 1), has_aux=True)(heads, perts, x)
  return {'st': st, 'perts': perts, 'pg': pg, 'g': g, 'st2': st2}


def modes_case(graph, graph_updates):
  blocks = create(nnx.Rngs(0))
  def fwd(blocks, x):
    @nnx.scan(in_axes=(0, nnx.Carry), out_axes=nnx.Carry, graph=graph,
              graph_updates=graph_updates)
    def forward(block, x):
      return block(x)
    return forward(blocks, x)
  def vfwd(blocks, x):
    return nnx.vmap(lambda b, x: b(x), in_axes=(0, None), graph=graph,
                    graph_updates=graph_updates)(blocks, x)
  out = {}
  for k, f in [('scan', fwd), ('vmap', vfwd)]:
    _, out[k] = nnx.capture(f, nnx.Intermediate)(blocks, X)
  return out


@case
def simple_graph_mode():
  return modes_case(True, False)


@case
def tree_mode():
  return modes_case(False, False)


@case
def vmap_broadcast_reduce():
  class R(nnx.Module):
    def __init__(self):
      self.w = nnx.Param(jnp.ones(3))
    def __call__(self, x):
      self.sow(nnx.Intermediate, 'tot', (x * self.w[...]).sum(),
               reduce_fn=lambda a, b: a + b, init_fn=lambda: 0.0)
      return x
  _, st = nnx.capture(
      lambda m, xs: nnx.vmap(lambda m, x: m(x), in_axes=(None, 0))(m, xs),
      nnx.Intermediate)(R(), XS)
  return {'st': st}


# One scanned function (and one nnx.jit) made once, called by several
# captures with different init= values: JAX caches the traced body by the
# function, so each call's init= values must not be baked into it.
@nnx.scan(in_axes=(0, nnx.Carry), out_axes=nnx.Carry)
def forward_made_once(block, x):
  return block(x)


@nnx.jit
def jitted_made_once(block, x):
  return block(x)


@case
def init_twice_one_scan():
  blocks = create(nnx.Rngs(0))
  _, perts = nnx.capture(forward_made_once, nnx.Perturbation)(blocks, X)
  _, sown = nnx.capture(forward_made_once, nnx.Intermediate)(blocks, X)
  out = {}
  for i, shift in enumerate((0.0, 0.5, -1.0)):
    shifted = jax.tree.map(lambda a: a + shift, perts)
    y, out[f'st{i}'] = nnx.capture(
        forward_made_once, nnx.Intermediate, init=shifted)(blocks, X)
    out[f'y{i}'] = y
    # init= for a reduced Module.sow: its accumulator starts there.
    start = jax.tree.map(lambda a: a + shift, sown)
    y, out[f'acc{i}'] = nnx.capture(
        forward_made_once, nnx.Intermediate, init=start)(blocks, X)
  return out


@case
def init_recipe_twice_one_scan():
  blocks = create(nnx.Rngs(0))
  _, perts = nnx.capture(forward_made_once, nnx.Perturbation)(blocks, X)

  def loss(model, perts, x):
    y, st = nnx.capture(forward_made_once, nnx.Intermediate, init=perts)(
        model, x)
    return jnp.sum(y ** 3), st

  out = {}
  for i, shift in enumerate((0.0, 0.25)):
    shifted = jax.tree.map(lambda a: a + shift, perts)
    (g, pg), _ = nnx.grad(loss, argnums=(0, 1), has_aux=True)(
        blocks, shifted, X)
    out[f'g{i}'], out[f'pg{i}'] = g, pg
  return out


@case
def init_twice_one_nnx_jit():
  block = Block(nnx.Rngs(3))
  _, perts = nnx.capture(jitted_made_once, nnx.Perturbation)(block, X)
  out = {}
  for i, shift in enumerate((0.0, 2.0)):
    shifted = jax.tree.map(lambda a: a + shift, perts)
    out[f'y{i}'], out[f'st{i}'] = nnx.capture(
        jitted_made_once, nnx.Intermediate, init=shifted)(block, X)
  return out


def encode(tree):
  if isinstance(tree, nnx.State):
    tree = nnx.to_pure_dict(tree)
  flat = jax.tree_util.tree_flatten_with_path(tree)[0]
  out = {}
  for path, leaf in flat:
    if isinstance(leaf, jax.core.Tracer):
      raise TypeError('leaked tracer')
    arr = np.asarray(leaf, np.float64)
    out[jax.tree_util.keystr(path)] = [list(arr.shape), arr.ravel().tolist()]
  return out


results = {}
for name in sys.argv[2:] or CASES:
  try:
    results[name] = {'ok': encode(CASES[name]())}
  except Exception as e:  # pylint: disable=broad-except
    results[name] = {'err': f'{type(e).__name__}: {str(e)[:300]}'}
print('RESULTS' + json.dumps(results))
'''

# Cases where Flax 0.12.8 returns a result: the shims must return the same.
SAME_AS_FLAX = (
    'scan_intermediates',
    'scan_recipe',
    'vmap_intermediates',
    'vmap_recipe',
    'remat_scan_intermediates',
    'remat_scan_recipe',
    'nnx_jit_around_capture',
    'nnx_jit_in_scan_body',
    'vmap_broadcast_recipe',
    'scan_of_vmap',
    'simple_graph_mode',
    'tree_mode',
    'init_twice_one_scan',
    'init_recipe_twice_one_scan',
    'init_twice_one_nnx_jit',
)


def _run(mode: str) -> subprocess.Popen:
  env = dict(os.environ, JAX_PLATFORMS='cpu')
  return subprocess.Popen(
      [sys.executable, '-c', PROGRAM, mode],
      stdout=subprocess.PIPE,
      stderr=subprocess.PIPE,
      text=True,
      env=env,
  )


def _results(proc: subprocess.Popen) -> dict:
  out, err = proc.communicate(timeout=900)
  lines = [l for l in out.splitlines() if l.startswith('RESULTS')]
  if proc.returncode or not lines:
    raise AssertionError(f'the program failed:\n{err[-3000:]}')
  return json.loads(lines[-1][len('RESULTS') :])


class SameAsFlaxTest(parameterized.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    procs = {mode: _run(mode) for mode in ('flax', 'shim')}
    cls.results = {mode: _results(p) for mode, p in procs.items()}

  def shim(self, case: str) -> dict:
    result = self.results['shim'][case]
    self.assertIn('ok', result, result.get('err'))
    return result['ok']

  def flax_error(self, case: str) -> str:
    result = self.results['flax'][case]
    self.assertIn('err', result)
    return result['err']

  def assert_leaf(self, got: dict, path: str, expected):
    expected = np.asarray(expected, np.float64)
    shape, values = got[path]
    self.assertEqual(tuple(shape), expected.shape, path)
    np.testing.assert_allclose(
        values, expected.ravel(), rtol=1e-5, err_msg=path
    )

  @parameterized.parameters(*SAME_AS_FLAX)
  def test_same_states_as_flax(self, case):
    expected = self.results['flax'][case]
    self.assertIn('ok', expected, expected.get('err'))
    got = self.shim(case)
    self.assertEqual(sorted(got), sorted(expected['ok']))
    for path, (shape, values) in expected['ok'].items():
      self.assertEqual(got[path][0], shape, path)
      np.testing.assert_allclose(
          got[path][1], values, rtol=1e-5, atol=1e-6, err_msg=path
      )

  def test_one_accumulator_per_layer(self):
    # Item 1: Flax's own result is one sum per layer, shape (3,).
    got = self.shim('scan_intermediates')
    self.assertEqual(got["['st']['tot'].value"][0], [3])
    self.assertEqual(got["['st']['act'].value[0]"][0], [3, 2, 3])

  # Where Flax 0.12.8 fails (or drops the State), values by hand: the loss
  # is sum_t sum(h_t ** 2) with h_t = x_t * w, so d/dh_t = 2 h_t and
  # d/dw = sum_t 2 h_t x_t.
  H = np.array([[1.0, 4.0, 9.0], [2.0, 6.0, 12.0]])
  XS = np.array([[1.0, 2.0, 3.0], [2.0, 3.0, 4.0]])

  @parameterized.parameters('scan_broadcast_recipe', 'scan_carry_recipe')
  def test_broadcast_or_carried_module_in_nnx_scan(self, case):
    got = self.shim(case)
    # One perturbation for the module (not one per step), as for a module
    # that nnx.vmap broadcasts, where Flax returns (3,).
    self.assert_leaf(got, "['perts']['h'].value", np.zeros(3))
    self.assert_leaf(got, "['pg']['h'].value", (2 * self.H).sum(0))
    self.assert_leaf(got, "['g']['w'].value", (2 * self.H * self.XS).sum(0))
    if case == 'scan_broadcast_recipe':
      # Flax returns the parameter gradient and drops the perturbations.
      flax = self.results['flax'][case]['ok']
      self.assertEqual(sorted(flax), ["['g']['w'].value"])
      self.assert_leaf(got, "['g']['w'].value", flax["['g']['w'].value"][1])
    else:
      self.assertIn('carry', self.flax_error(case))

  def test_reduced_sow_of_a_broadcast_module_under_nnx_vmap(self):
    self.assertIn('batched', self.flax_error('vmap_broadcast_reduce'))
    # One accumulator, every example folded into it.
    self.assert_leaf(
        self.shim('vmap_broadcast_reduce'), "['st']['tot'].value", 15.0
    )


class Stacked(nnx.Module):

  def __init__(self, rngs):
    self.w = nnx.Param(jax.random.normal(rngs.params(), (3,)))
    self.count = nnx.BatchStat(jnp.zeros(()))

  def __call__(self, x):
    self.sow(
        nnx.Intermediate,
        'tot',
        (x * self.w[...]).sum(),
        reduce_fn=lambda a, b: a + b,
        init_fn=lambda: 0.0,
    )
    return x * self.w[...]


@nnx.split_rngs(splits=2)
@nnx.vmap(in_axes=(0,))
def _stack(rngs):
  return Stacked(rngs)


class UndecidedTest(absltest.TestCase):
  """Where the shapes and in_axes do not tell, the sow raises, named."""

  def test_state_axes_slicing_only_some_variables(self):
    blocks = _stack(nnx.Rngs(0))
    axes = nnx.StateAxes({nnx.Param: 0, ...: None})

    def f(b, x):
      return nnx.vmap(lambda b, x: b(x), in_axes=(axes, None))(b, x)

    # (Flax 0.12.8 fails here too: its captured state is broadcast.)
    with self.assertRaisesRegex(
        ValueError,
        r"Module.sow\(Intermediate, 'tot'\) in Stacked: nnx.vmap .* slices"
        r' some of the Variables',
    ):
      nnx.capture(f, nnx.Intermediate)(blocks, jnp.ones(3))

  def test_two_runs_of_the_transform(self):
    blocks = _stack(nnx.Rngs(0))
    g = nnx.vmap(lambda b, x: b(x), in_axes=(0, None))
    with self.assertRaisesRegex(
        ValueError, r"Module.sow\(Intermediate, 'tot'\).* in 2 runs"
    ):
      nnx.capture(lambda b, x: g(b, g(b, x).sum(0)), nnx.Intermediate)(
          blocks, jnp.ones(3)
      )

  def test_outer_capture_across_a_capture_in_the_body(self):
    blocks = _stack(nnx.Rngs(0))

    def f(b, x):
      inner = lambda b, x: nnx.capture(lambda b, x: b(x), nnx.Perturbation)(
          b, x
      )[0]
      return nnx.vmap(inner, in_axes=(0, None))(b, x)

    with self.assertRaisesRegex(
        ValueError,
        r"Module.sow\(Intermediate, 'tot'\) in Stacked: it goes to a"
        r' capture around an inner capture',
    ):
      nnx.capture(f, nnx.Intermediate)(blocks, jnp.ones(3))

  def test_plain_sow_is_stacked_either_way(self):
    class Plain(Stacked):

      def __call__(self, x):
        self.sow(nnx.Intermediate, 'y', x * self.w[...])
        return x * self.w[...]

    @nnx.split_rngs(splits=2)
    @nnx.vmap(in_axes=(0,))
    def stack(rngs):
      return Plain(rngs)

    blocks = stack(nnx.Rngs(0))
    axes = nnx.StateAxes({nnx.Param: 0, ...: None})
    x = jnp.array([1.0, 2.0, 3.0])
    _, st = nnx.capture(
        lambda b, x: nnx.vmap(lambda b, x: b(x), in_axes=(axes, None))(b, x),
        nnx.Intermediate,
    )(blocks, x)
    np.testing.assert_allclose(st['y'][0], blocks.w[...] * x, rtol=1e-6)


class LoopRowTest(parameterized.TestCase):
  """``loop_row``: the row of a stacked constant for the current iteration.

  In a ``scan`` body it is a marker that the ``scan`` rule of a capture
  rewrites into an extra ``xs``; without a capture around the loop it
  raises. Expected values are the same loops with the stacked value passed
  as ``xs`` (or mapped with ``in_axes=0``), without any capture.
  """

  W = jnp.arange(6.0).reshape(3, 2)
  XS = jnp.array([1.0, 2.0, 3.0])

  @staticmethod
  def with_row(w, xs):
    def body(c, x):
      row = loop_row(w, name='w', anchor=x)
      return c + row * x, row

    return jax.lax.scan(body, jnp.zeros(2), xs)

  @staticmethod
  def with_xs(w, xs):
    def body(c, wx):
      row, x = wx
      return c + row * x, row

    return jax.lax.scan(body, jnp.zeros(2), (w, xs))

  @staticmethod
  def captured(f):
    return lambda *a: capture(f)(*a)[0]

  @parameterized.parameters(False, True)
  def test_scan(self, jit):
    wrap = jax.jit if jit else (lambda f: f)
    expected = self.with_xs(self.W, self.XS)
    for f in (
        wrap(self.captured(self.with_row)),
        self.captured(wrap(self.with_row)),
    ):
      for got, want in zip(f(self.W, self.XS), expected):
        np.testing.assert_allclose(got, want)

  @parameterized.parameters(False, True)
  def test_grad_and_vmap_of_the_captured_scan(self, jit):
    # The capture rewrites the loop before grad and vmap see it.
    wrap = jax.jit if jit else (lambda f: f)
    loss = lambda f: lambda w: f(w, self.XS)[0].sum()
    np.testing.assert_allclose(
        wrap(jax.grad(loss(self.captured(self.with_row))))(self.W),
        jax.grad(loss(self.with_xs))(self.W),
    )
    ws = jnp.stack([self.W, 2.0 * self.W])
    batched = lambda f: jax.vmap(lambda w: f(w, self.XS)[0])
    np.testing.assert_allclose(
        wrap(batched(self.captured(self.with_row)))(ws),
        batched(self.with_xs)(ws),
    )

  @parameterized.parameters(False, True)
  def test_vmap_inside_the_capture(self, jit):
    # vmap batches the marker before the capture rewrites the loop: the row
    # is taken along the axis the batch dimension moved the loop's axis to.
    wrap = jax.jit if jit else (lambda f: f)
    ws = jnp.stack([self.W, 2.0 * self.W])
    for in_axes, ws_ in ((0, ws), (1, jnp.moveaxis(ws, 0, 1))):
      batched = lambda f: jax.vmap(  # pylint: disable=cell-var-from-loop
          lambda w: f(w, self.XS), in_axes=in_axes
      )
      got = self.captured(wrap(batched(self.with_row)))(ws_)
      for g, want in zip(got, batched(self.with_xs)(ws_)):
        np.testing.assert_allclose(g, want)
    # The stacked value unbatched, the xs batched.
    xss = jnp.stack([self.XS, -self.XS])
    got = self.captured(jax.vmap(lambda xs: self.with_row(self.W, xs)))(xss)
    want = jax.vmap(lambda xs: self.with_xs(self.W, xs))(xss)
    for g, w in zip(got, want):
      np.testing.assert_allclose(g, w)

  @parameterized.parameters(False, True)
  def test_grad_inside_the_capture_keeps_the_row_in_the_loop(self, jit):
    # grad with respect to the xs only: the row reads a constant of the
    # loop, which JAX's partial evaluation would hoist out of it.
    wrap = jax.jit if jit else (lambda f: f)
    loss = lambda f: lambda xs: (f(self.W, xs)[0] ** 2).sum()
    got = self.captured(wrap(jax.grad(loss(self.with_row))))(self.XS)
    np.testing.assert_allclose(got, jax.grad(loss(self.with_xs))(self.XS))
    got = self.captured(jax.value_and_grad(loss(self.with_row)))(self.XS)
    want = jax.value_and_grad(loss(self.with_xs))(self.XS)
    for g, w in zip(got, want):
      np.testing.assert_allclose(g, w)
    f = jax.checkpoint(loss(self.with_row))
    np.testing.assert_allclose(
        self.captured(jax.grad(f))(self.XS),
        jax.grad(loss(self.with_xs))(self.XS),
    )

  def test_forward_mode_inside_the_capture(self):
    # The tangent's row is a second marker, on the tangent constant.
    t = jnp.ones_like(self.W) * jnp.arange(3.0)[:, None]
    jvp = lambda f: lambda w: jax.jvp(lambda w: f(w, self.XS), (w,), (t,))
    for got, want in zip(
        jax.tree.leaves(self.captured(jvp(self.with_row))(self.W)),
        jax.tree.leaves(jvp(self.with_xs)(self.W)),
    ):
      np.testing.assert_allclose(got, want)
    jac = lambda f: jax.jacfwd(lambda w: f(w, self.XS)[0])
    np.testing.assert_allclose(
        self.captured(jac(self.with_row))(self.W), jac(self.with_xs)(self.W)
    )

  def test_grad_inside_the_capture_wrt_the_stacked_value_raises(self):
    loss = lambda w: self.with_row(w, self.XS)[0].sum()
    with self.assertRaisesRegex(
        NotImplementedError, "'w'.*transposed program.*outside the capture"
    ):
      self.captured(jax.grad(loss))(self.W)

  def test_grad_inside_the_capture_without_an_anchor_raises(self):
    # Without anchor=, the row reads only a constant of the loop: JAX's
    # partial evaluation hoists it out of the loop, where it raises.
    def with_row(w, xs):
      def body(c, x):
        return c + loop_row(w, name='w') * x, None

      return jax.lax.scan(body, jnp.zeros(2), xs)[0]

    loss = lambda xs: (with_row(self.W, xs) ** 2).sum()
    np.testing.assert_allclose(  # without grad, no hoisting
        self.captured(loss)(self.XS),
        (self.with_xs(self.W, self.XS)[0] ** 2).sum(),
    )
    with self.assertRaisesRegex(
        NotImplementedError, "'w'.*moved out of its loop.*anchor="
    ):
      self.captured(jax.grad(loss))(self.XS)

  def test_closure_over_an_enclosing_tracer(self):
    # The stacked value is a tracer of an enclosing jit, closed over.
    f = jax.jit(self.captured(lambda w: self.with_row(w * 2.0, self.XS)[0]))
    np.testing.assert_allclose(
        f(self.W), self.with_xs(2.0 * self.W, self.XS)[0]
    )

  def test_nested_scans(self):
    # The inner loop's row of the outer loop's row.
    ws = jnp.arange(24.0).reshape(4, 3, 2)

    def with_rows(ws):
      def outer(c, _):
        w = loop_row(ws, name='ws')
        return c + self.with_row(w, self.XS)[0], None

      return jax.lax.scan(outer, jnp.zeros(2), None, length=4)[0]

    def with_xs(ws):
      def outer(c, w):
        return c + self.with_xs(w, self.XS)[0], None

      return jax.lax.scan(outer, jnp.zeros(2), ws)[0]

    np.testing.assert_allclose(self.captured(with_rows)(ws), with_xs(ws))

  def test_loop_inside_a_cond_and_a_while_loop(self):
    w, xs = self.W, self.XS
    cond = lambda f: lambda p: jax.lax.cond(
        p, lambda: f(w, xs)[0], lambda: -f(w, xs)[0]
    )
    for p in (True, False):
      np.testing.assert_allclose(
          self.captured(cond(self.with_row))(p), cond(self.with_xs)(p)
      )
      np.testing.assert_allclose(
          self.captured(jax.jit(cond(self.with_row)))(p),
          cond(self.with_xs)(p),
      )
    loop = lambda f: lambda n: jax.lax.fori_loop(
        0, n, lambda i, c: c + f(w, xs)[0], jnp.zeros(2)
    )
    np.testing.assert_allclose(
        self.captured(loop(self.with_row))(jnp.int32(2)),
        loop(self.with_xs)(jnp.int32(2)),
    )

  def test_intervene_rewrites_the_rows(self):
    def f(w, xs):
      def body(c, x):
        y = sow(loop_row(w, name='w', anchor=x) * x, name='y')
        return c + y, None

      return jax.lax.scan(body, jnp.zeros(2), xs)[0]

    expected = self.with_xs(self.W, self.XS)[0]
    np.testing.assert_allclose(intervene(f, {})(self.W, self.XS), expected)
    np.testing.assert_allclose(
        intervene(f, {'y': lambda v: 2.0 * v})(self.W, self.XS),
        2.0 * expected,
    )
    # An array replacement is one more xs; a callable that asks for the
    # iteration index gets it with the rows' xs in place.
    np.testing.assert_allclose(
        intervene(f, {'y': (jnp.ones((3, 2)),)})(self.W, self.XS),
        jnp.full(2, 3.0),
    )
    skip_row_1 = lambda v: jnp.where(loop_indices()[0] == 1, 0.0, v)
    np.testing.assert_allclose(
        intervene(f, {'y': skip_row_1})(self.W, self.XS),
        (self.W * self.XS[:, None])[jnp.array([0, 2])].sum(0),
    )
    out, collected = capture(f)(self.W, self.XS)
    np.testing.assert_allclose(out, expected)
    np.testing.assert_allclose(
        collected['y'][0], self.W * self.XS[:, None]
    )

  @parameterized.parameters(False, True)
  def test_vmap(self, jit):
    wrap = jax.jit if jit else (lambda f: f)
    f = lambda w: jax.vmap(lambda x: loop_row(w, name='w') * x)(self.XS)
    np.testing.assert_allclose(wrap(f)(self.W), self.W * self.XS[:, None])
    np.testing.assert_allclose(
        wrap(jax.grad(lambda w: f(w).sum()))(self.W),
        jnp.broadcast_to(self.XS[:, None], (3, 2)),
    )

  def test_outside_a_loop_raises(self):
    with self.assertRaisesRegex(NotImplementedError, "'w'.*outside any loop"):
      loop_row(self.W, name='w')

  @parameterized.parameters(False, True)
  def test_scan_without_a_capture_raises(self, jit):
    # No capture rewrites the loop: the marker raises when it is lowered
    # (eagerly, lax.scan compiles its loop too).
    wrap = jax.jit if jit else (lambda f: f)
    with self.assertRaisesRegex(
        NotImplementedError, "'w'.*in a loop that no capture rewrote"
    ):
      wrap(self.with_row)(self.W, self.XS)

  def test_row_of_a_value_computed_in_the_body_raises(self):
    def f(xs):
      def body(c, x):
        return c + loop_row(jnp.stack([x, x]), name='v'), None

      return jax.lax.scan(body, 0.0, xs)[0]

    with self.assertRaisesRegex(
        NotImplementedError, "'v'.*computed inside the loop body"
    ):
      self.captured(f)(jnp.ones(2))

  def test_wrong_length_raises(self):
    with self.assertRaisesRegex(ValueError, "'w'.*3 rows.*4 iterations"):
      self.captured(self.with_row)(self.W, jnp.ones(4))


class RowsUnderTransformsInsideTheCaptureTest(absltest.TestCase):
  """``init=`` of a module ``nnx.scan`` slices, with ``nnx.grad`` (and
  ``nnx.jit``) inside the capture, between the rows and the capture's
  ``scan`` rule. By hand: layer 0 sums ``x * w0``, layer 1 sums
  ``x * w0 * w1``; each starts from its row of ``init``."""

  @staticmethod
  def fwd(b, x):
    return nnx.scan(
        lambda b, x: b(x), in_axes=(0, nnx.Carry), out_axes=nnx.Carry
    )(b, x)

  def test_grad_inside_the_capture(self):
    blocks = _stack(nnx.Rngs(0))
    x = jnp.array([1.0, -2.0, 0.5])
    w = np.asarray(blocks.w[...])
    tot = np.array([(x * w[0]).sum(), (x * w[0] * w[1]).sum()])
    _, st = nnx.capture(self.fwd, nnx.Intermediate)(blocks, x)
    np.testing.assert_allclose(st['tot'][...], tot, rtol=1e-6)
    init = jax.tree.map(lambda v: v + 10.0, st)

    def g(b, x):
      return nnx.grad(lambda b, x: self.fwd(b, x).sum(), argnums=1)(b, x)

    for f in (g, nnx.jit(g)):
      gx, st2 = nnx.capture(f, nnx.Intermediate, init=init)(blocks, x)
      np.testing.assert_allclose(gx, w[0] * w[1], rtol=1e-6)
      np.testing.assert_allclose(st2['tot'][...], tot + 10.0 + tot, rtol=1e-6)


if __name__ == '__main__':
  absltest.main()
