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

"""Programs written the way training and analysis code is written.

* A captured function that closes over tracers of an enclosing transform,
  over arrays and over NNX modules, for every path a sow can take through
  ``capture`` (the top-level edit, the interpreter, a rule that rewrites a
  sub-jaxpr), inside every enclosing construct.
* Loop-invariant sows under ``grad``/``linearize``/``checkpoint``: still one
  value per iteration.
* Reductions written inline: each site folds with its own ``reduce_fn``.
* Names, keys and error locations.

Expected values are computed by the same arithmetic written without ``sow``.
"""

from __future__ import annotations

import itertools

from absl.testing import absltest
from absl.testing import parameterized
from flax import nnx
import jax
import jax.numpy as jnp
from jax.experimental.scheduling_groups import xla_metadata_call
import numpy as np

from flax.nnx.sow import capture
from flax.nnx.sow import flatten_names
from flax.nnx.sow import collected_to_state
from flax.nnx.sow import perturb
from flax.nnx.sow import sow
from flax.nnx.sow import state_to_collected

# ----------------------------------------------------------------------------
# 1. Closures: enclosing construct x path through capture x what f closes over

_ARR = jnp.array([2.0], jnp.float32)


def _linear():
  model = nnx.Linear(1, 1, rngs=nnx.Rngs(0))
  model.kernel.set_value(jnp.array([[3.0]], jnp.float32))
  model.bias.set_value(jnp.array([0.5], jnp.float32))
  return model


def _inner(closure, model, c):
  """``(g, arg)``: the closed-over computation and what the capture gets."""
  if closure == 'tracer':
    return (lambda v: v * c), None
  if closure == 'array':
    return (lambda v: v * _ARR), c
  return (lambda v: model(v)), c


def _expected_g(closure, c, x):
  if closure == 'tracer':
    return x * c
  if closure == 'array':
    return x * c * 2.0
  return x * c * 3.0 + 0.5


def _captured(path, g):
  """A function to capture whose sow of ``g(x)`` takes ``path``."""
  if path == 'edit':
    return lambda x: sow(g(x), name='v') + 1.0
  if path == 'interpreter':
    return (
        lambda x: sow(
            g(x),
            name='v',
            reduce_fn=lambda a, b: a + b,
            init_fn=lambda: jnp.zeros(1, jnp.float32),
        )
        + 1.0
    )
  if path == 'jit':
    return lambda x: jax.jit(lambda y: sow(g(y), name='v'))(x) + 1.0
  if path == 'reduced_jit':
    return (
        lambda x: jax.jit(
            lambda y: sow(
                g(y),
                name='v',
                reduce_fn=lambda a, b: a + b,
                init_fn=lambda: jnp.zeros(1, jnp.float32),
            )
        )(x)
        + 1.0
    )

  def scanned(x):
    def body(carry, k):
      sow(g(x) * k, name='v')
      return carry, None

    jax.lax.scan(body, 0.0, jnp.array([1.0, 2.0], jnp.float32))
    return g(x) + 1.0

  return scanned


def _collected_total(path, gx):
  return 3.0 * jnp.sum(gx) if path == 'scan' else jnp.sum(gx)


def _run(path, closure, model, c, x):
  g, arg = _inner(closure, model, c)
  x_in = x if arg is None else x * arg
  out, collected = capture(_captured(path, g))(x_in)
  total = sum(jnp.sum(v) for v in jax.tree.leaves(collected))
  return out + total


def _run_expected(path, closure, c, x):
  gx = _expected_g(closure, c, x)
  return gx + 1.0 + _collected_total(path, gx)


def _enclose(construct, fn, c, x):
  """``fn(c, x)`` evaluated inside ``construct``, ``c`` and ``x`` traced."""
  if construct == 'jit':
    return jax.jit(fn)(c, x)
  if construct == 'nnx_jit':
    return nnx.jit(fn)(c, x)
  if construct == 'scan':

    def body(carry, xi):
      return carry, fn(carry, xi)

    return jax.lax.scan(body, c, jnp.stack([x, x + 1.0]))[1]
  if construct == 'while':

    def body(state):
      i, acc = state
      return i + 1, fn(c, x + acc * 0.0)

    return jax.lax.while_loop(lambda s: s[0] < 1, body, (0, jnp.zeros_like(x)))[
        1
    ]
  if construct == 'cond':
    return jax.lax.cond(c > 0.0, fn, lambda c, x: jnp.zeros_like(x), c, x)
  if construct == 'vmap':
    return jax.vmap(fn)(jnp.stack([c, c + 1.0]), jnp.stack([x, x * 2.0]))
  if construct == 'grad':
    return jax.grad(lambda c: jnp.sum(fn(c, x)))(c)
  assert construct == 'custom_vjp'

  @jax.custom_vjp
  def h(c, x):
    return fn(c, x)

  def fwd(c, x):
    return fn(c, x), None

  def bwd(_, ct):
    return jnp.sum(ct), jnp.zeros_like(x)

  h.defvjp(fwd, bwd)
  return jax.value_and_grad(lambda c: jnp.sum(h(c, x)))(c)[0]


CONSTRUCTS = (
    'jit',
    'nnx_jit',
    'scan',
    'while',
    'cond',
    'vmap',
    'grad',
    'custom_vjp',
)
PATHS = ('edit', 'interpreter', 'jit', 'reduced_jit', 'scan')
CLOSURES = ('tracer', 'array', 'module')


class ClosureMatrixTest(parameterized.TestCase):

  @parameterized.parameters(*itertools.product(CONSTRUCTS, PATHS, CLOSURES))
  def test_closure(self, construct, path, closure):
    model = _linear() if closure == 'module' else None
    c = jnp.float32(1.5)
    x = jnp.array([0.75], jnp.float32)
    got = _enclose(
        construct, lambda c, x: _run(path, closure, model, c, x), c, x
    )
    want = _enclose(
        construct, lambda c, x: _run_expected(path, closure, c, x), c, x
    )
    np.testing.assert_allclose(got, want, rtol=1e-6)

  def test_jit_train_step_closes_over_batch(self):
    # nnx.jit step, nnx.capture of nnx.value_and_grad of a loss that closes
    # over the step's batch.
    model = _linear()
    optimizer = nnx.Optimizer(model, _sgd(), wrt=nnx.Param)

    class Probe(nnx.Module):

      def __init__(self, inner):
        self.inner = inner

      def __call__(self, x):
        y = self.inner(x)
        self.sow(nnx.Intermediate, 'y', y)
        return y

    probe = Probe(model)

    @nnx.jit
    def step(probe, optimizer, x, t):
      def loss_fn(probe):
        return jnp.mean((probe(x) - t) ** 2)

      (loss, grads), state = nnx.capture(
          nnx.value_and_grad(loss_fn), nnx.Intermediate
      )(probe)
      optimizer.update(probe.inner, grads.inner)
      return loss, state['y'][0]

    x = jnp.array([[1.0], [2.0]], jnp.float32)
    t = jnp.array([[1.0], [1.0]], jnp.float32)
    loss, y = step(probe, optimizer, x, t)
    np.testing.assert_allclose(y, x * 3.0 + 0.5, rtol=1e-6)
    np.testing.assert_allclose(
        loss, np.mean((np.array([[3.5], [6.5]]) - 1.0) ** 2), rtol=1e-6
    )
    # The SGD step was applied to the caller's model (lr 0.1).
    dk = np.mean(2 * (np.array([3.5, 6.5]) - 1.0) * np.array([1.0, 2.0]))
    np.testing.assert_allclose(
        model.kernel.get_value(), [[3.0 - 0.1 * dk]], rtol=1e-6
    )


def _sgd():
  import optax  # pylint: disable=g-import-not-at-top

  return optax.sgd(0.1)


# ----------------------------------------------------------------------------
# 2. Loop-invariant sows keep their iteration axis under every transform.


def _loss_invariant(w, xs):
  def body(c, x):
    sow(jnp.sum(w**2), name='wn')  # does not depend on the carry
    sow(jnp.float32(7.0), name='const')  # a constant
    sow(w * 2.0, name='red', reduce_fn=lambda a, b: a + b, init_fn=lambda: 0.0)
    return c * jnp.tanh(w * x), None

  return jnp.sum(jax.lax.scan(body, jnp.ones(3), xs)[0])


def _loss_fori(w, xs):
  def body(i, c):
    sow(jnp.sum(w**2) + 0.0 * i, name='wn')
    return c * jnp.tanh(w * xs[i])

  return jnp.sum(jax.lax.fori_loop(0, xs.shape[0], body, jnp.ones(3)))


def _transforms(loss, xs):
  return {
      'plain': lambda w: loss(w, xs),
      'jit': jax.jit(lambda w: loss(w, xs)),
      'grad': jax.grad(lambda w: loss(w, xs)),
      'value_and_grad': jax.value_and_grad(lambda w: loss(w, xs)),
      'linearize': lambda w: jax.linearize(lambda w: loss(w, xs), w)[0],
      'jvp': lambda w: jax.jvp(lambda w: loss(w, xs), (w,), (1.0,)),
      'checkpoint': jax.grad(jax.checkpoint(lambda w: loss(w, xs))),
      'checkpoint_dots': jax.grad(
          jax.checkpoint(
              lambda w: loss(w, xs),
              policy=jax.checkpoint_policies.dots_saveable,
          )
      ),
      'jit_value_and_grad': jax.jit(jax.value_and_grad(lambda w: loss(w, xs))),
  }


def _halving(kind):
  """``y -> sin(y) / 2`` as a custom-derivative function that sows ``y`` (the
  sum of its values, and a count), and the same function without sows."""

  def body(y, sowing):
    if sowing:
      sow(
          y.sum(),
          name='y',
          reduce_fn=lambda a, b: a + b,
          init_fn=lambda: jnp.float32(0),
      )
      sow(
          y,
          name='n',
          reduce_fn=lambda a, b: a + 1,
          init_fn=lambda: jnp.int32(0),
      )
    return jnp.sin(y) * 0.5

  def make(sowing):
    if kind == 'custom_jvp_jit_inside':
      inner = jax.jit(lambda y: body(y, sowing))
    else:
      inner = lambda y: body(y, sowing)
    if kind == 'custom_vjp':
      h = jax.custom_vjp(inner)
      h.defvjp(lambda y: (h(y), y), lambda y, g: (0.5 * jnp.cos(y) * g,))
    else:
      h = jax.custom_jvp(inner)
      h.defjvp(lambda p, t: (h(*p), 0.5 * jnp.cos(p[0]) * t[0]))
    return h

  return make(True), make(False)


class InvarianceTest(parameterized.TestCase):

  @parameterized.parameters(*_transforms(_loss_invariant, None))
  def test_loop_invariant_sows_scan(self, transform):
    xs = jnp.arange(4.0)
    w = jnp.float32(0.5)
    _, collected = capture(_transforms(_loss_invariant, xs)[transform])(w)
    self.assertEqual(list(collected), ['wn', 'const', 'red'])
    np.testing.assert_allclose(collected['wn'][0], np.full(4, 0.25))
    np.testing.assert_allclose(collected['const'][0], np.full(4, 7.0))
    self.assertLen(collected['wn'], 1)
    np.testing.assert_allclose(collected['red'], 4 * 1.0)

  @parameterized.parameters(
      'plain', 'grad', 'value_and_grad', 'linearize', 'checkpoint'
  )
  def test_loop_invariant_sows_fori_loop(self, transform):
    xs = jnp.arange(5.0)
    _, collected = capture(_transforms(_loss_fori, xs)[transform])(
        jnp.float32(0.5)
    )
    np.testing.assert_allclose(collected['wn'][0], np.full(5, 0.25))

  def test_gradient_unchanged(self):
    xs = jnp.arange(4.0)
    got, _ = capture(jax.grad(_loss_invariant))(0.5, xs)

    def plain(w):
      c = jnp.ones(3)
      for x in xs:
        c = c * jnp.tanh(w * x)
      return jnp.sum(c)

    np.testing.assert_allclose(got, jax.grad(plain)(0.5), rtol=1e-6)

  def test_loop_invariant_perturb_cotangent_per_iteration(self):
    xs = jnp.arange(1.0, 4.0)

    def loss(w):
      def body(c, x):
        v = perturb(w * 2.0, name='p')  # does not depend on the carry
        return c * jnp.tanh(v * x), None

      return jnp.sum(jax.lax.scan(body, jnp.ones(2), xs)[0])

    def unrolled(vs):  # one v per iteration, written without perturb
      c = jnp.ones(2)
      for v, x in zip(vs, xs):
        c = c * jnp.tanh(v * x)
      return jnp.sum(c)

    _, collected = capture(jax.grad(loss))(0.5)
    np.testing.assert_allclose(
        collected['p'][0], jax.grad(unrolled)(jnp.full(3, 1.0)), rtol=1e-5
    )

  @parameterized.parameters(None, jax.checkpoint_policies.dots_saveable)
  def test_custom_jvp_in_while_under_grad_of_checkpoint(self, policy):
    @jax.custom_jvp
    def halve(y):
      return (
          sow(
              y,
              name='n',
              reduce_fn=lambda a, b: a + 1,
              init_fn=lambda: jnp.int32(0),
          )
          * 0.5
      )

    halve.defjvp(lambda p, t: (halve(*p), 0.5 * t[0]))

    def f(x):
      y = jax.lax.while_loop(
          lambda c: c[0] < 3,
          lambda c: (c[0] + 1, halve(c[1])),
          (0, jax.lax.stop_gradient(x)),
      )[1]
      return jnp.sum(x * y)

    x = jnp.array([1.0, 2.0])
    grad, collected = capture(jax.grad(jax.checkpoint(f, policy=policy)))(x)
    np.testing.assert_allclose(grad, x / 8.0)  # y = x / 8, not differentiated
    self.assertEqual(int(collected['n']), 3)

  @parameterized.product(
      kind=['custom_jvp', 'custom_vjp', 'custom_jvp_jit_inside'],
      policy=[None, 'dots_saveable'],
      transform=['grad', 'jit_grad'],
  )
  def test_custom_call_in_while_under_checkpoint_collects_once(
      self, kind, policy, transform
  ):
    # JAX would save the outputs of the custom call, which a while body
    # cannot: it is recomputed, and only the forward loop collects.
    halve, plain_halve = _halving(kind)
    policy = policy and getattr(jax.checkpoint_policies, policy)

    def loop(x, h):
      y = jax.lax.while_loop(
          lambda c: c[0] < 3,
          lambda c: (c[0] + 1, h(c[1])),
          (0, jax.lax.stop_gradient(x)),
      )[1]
      return jnp.sum(jnp.sin(x) * y)

    f = jax.checkpoint(lambda x: loop(x, halve), policy=policy)
    g = jax.grad(f)
    if transform == 'jit_grad':
      g = jax.jit(g)
    x = jnp.array([1.0, 2.0])
    grad, collected = capture(g)(x)
    self.assertEqual(list(collected), ['y', 'n'])
    y0, y1, y2 = x, np.sin(x) * 0.5, np.sin(np.sin(x) * 0.5) * 0.5
    np.testing.assert_allclose(collected['y'], np.sum(y0 + y1 + y2), rtol=1e-6)
    self.assertEqual(int(collected['n']), 3)
    want = jax.grad(lambda x: loop(x, plain_halve))(x)
    np.testing.assert_allclose(grad, want, rtol=1e-6)
    y3 = np.sin(y2) * 0.5
    np.testing.assert_allclose(grad, np.cos(x) * y3, rtol=1e-6)

  @parameterized.parameters('custom_jvp', 'custom_jvp_jit_inside')
  def test_custom_call_in_while_under_linearize_of_checkpoint(self, kind):
    # The carry depends on x: JAX splits the loop into the known primal
    # loop and a staged loop that recomputes it with the tangents.
    halve, plain_halve = _halving(kind)

    def loop(x, h):
      return jax.lax.while_loop(
          lambda c: c[0] < 2, lambda c: (c[0] + 1, h(c[1])), (0, x)
      )[1]

    x = jnp.array([0.5, -1.0])
    t = jnp.array([1.0, 2.0])

    def linearized(x):
      out, lin = jax.linearize(jax.checkpoint(lambda x: loop(x, halve)), x)
      return out, lin(t), lin(2.0 * t)  # evaluated twice: no new entries

    (out, tangent, tangent2), collected = capture(linearized)(x)
    self.assertEqual(list(collected), ['y', 'n'])
    y1 = np.sin(x) * 0.5
    np.testing.assert_allclose(collected['y'], np.sum(x + y1), rtol=1e-6)
    self.assertEqual(int(collected['n']), 2)
    want_out, want = jax.linearize(lambda x: loop(x, plain_halve), x)
    np.testing.assert_allclose(out, want_out, rtol=1e-6)
    np.testing.assert_allclose(out, np.sin(y1) * 0.5, rtol=1e-6)
    np.testing.assert_allclose(tangent, want(t), rtol=1e-6)
    np.testing.assert_allclose(
        tangent, 0.25 * np.cos(y1) * np.cos(x) * t, rtol=1e-6
    )
    np.testing.assert_allclose(tangent2, 2.0 * want(t), rtol=1e-6)

  @parameterized.parameters('grad', 'value_and_grad', 'jit_grad')
  def test_checkpointed_scan_step(self, transform):
    def f(w, xs):
      @jax.checkpoint
      def step(h, x):
        sow(w * 2.0, name='w2')
        sow(
            w * 2.0, name='r', reduce_fn=lambda a, b: a + b, init_fn=lambda: 0.0
        )
        return h + x * w, None

      return jax.lax.scan(step, 0.0, xs)[0]

    t = {
        'grad': jax.grad(f),
        'value_and_grad': jax.value_and_grad(f),
        'jit_grad': jax.jit(jax.grad(f)),
    }[transform]
    _, collected = capture(t)(1.5, jnp.arange(4.0))
    np.testing.assert_allclose(collected['w2'][0], [3.0] * 4)
    np.testing.assert_allclose(collected['r'], 12.0)

  @parameterized.parameters(
      None,
      jax.checkpoint_policies.dots_saveable,
      jax.checkpoint_policies.nothing_saveable,
  )
  def test_checkpoint_in_scan_body_under_grad_of_checkpoint(self, policy):
    def f(x):
      def body(c, _):
        def inner(c):
          sow(jnp.float32(2.0), name='const')
          sow(
              jnp.float32(1.0),
              name='n',
              reduce_fn=lambda a, b: a + b,
              init_fn=lambda: 0.0,
          )
          return jnp.sin(c)

        return jax.checkpoint(inner, policy=policy)(c), None

      return jnp.sum(jax.lax.scan(body, x, None, length=2, reverse=True)[0])

    x = jnp.array([0.5, 1.0])
    grad, collected = capture(jax.grad(jax.checkpoint(f, policy=policy)))(x)
    np.testing.assert_allclose(collected['const'][0], [2.0, 2.0])
    np.testing.assert_allclose(collected['n'], 2.0)
    np.testing.assert_allclose(grad, np.cos(np.sin(x)) * np.cos(x), rtol=1e-5)

  def test_invariant_reduced_sow_whose_reduce_fn_closes_over_a_value(self):
    def loss(w, xs):
      def body(c, x):
        scale = w * 3.0  # loop-invariant, read by reduce_fn
        sow(
            w,
            name='r',
            reduce_fn=lambda a, v: a + v * scale,
            init_fn=lambda: 0.0,
        )
        return c * jnp.tanh(w * x), None

      return jnp.sum(jax.lax.scan(body, jnp.ones(2), xs)[0])

    xs = jnp.arange(3.0)
    for fn in (loss, jax.grad(loss), jax.grad(jax.checkpoint(loss))):
      _, collected = capture(fn)(0.5, xs)
      np.testing.assert_allclose(collected['r'], 3 * 0.5 * 1.5)

  @parameterized.parameters('plain', 'grad', 'linearize', 'vjp')
  def test_nested_scans_invariant_in_both(self, transform):
    def f(w):
      def outer(h, _):
        def inner(c, _):
          sow(
              1.0,
              name='inner_steps',
              reduce_fn=lambda a, b: a + b,
              init_fn=lambda: 0.0,
          )
          sow(w, name='w')
          return c * w, None

        return jax.lax.scan(inner, h, None, length=3)[0], None

      return jax.lax.scan(outer, 1.0, None, length=4)[0]

    t = {
        'plain': f,
        'grad': jax.grad(f),
        'linearize': lambda w: jax.linearize(f, w)[0],
        'vjp': lambda w: jax.vjp(f, w)[1](1.0),
    }[transform]
    _, collected = capture(t)(0.9)
    self.assertEqual(list(collected), ['inner_steps', 'w'])
    np.testing.assert_allclose(collected['inner_steps'], 12.0)
    np.testing.assert_allclose(collected['w'][0], np.full((4, 3), 0.9))

  def test_jit_vmap_scan_with_python_scalar_init(self):
    def f(xs):
      def step(h, x):
        sow(x, name='x')
        sow(1, name='steps', reduce_fn=lambda a, b: a + b, init_fn=lambda: 0)
        return h + x, None

      return jax.lax.scan(step, 0.0, xs)[0]

    xs = jnp.arange(6.0).reshape(2, 3)
    for g in (jax.vmap(f), jax.jit(jax.vmap(f))):
      out, collected = capture(g)(xs)
      np.testing.assert_allclose(out, [3.0, 12.0])
      np.testing.assert_allclose(collected['x'][0], xs)
      self.assertEqual(int(collected['steps']), 6)

  def test_outside_capture_no_sow_is_left(self):
    xs = jnp.arange(4.0)
    text = str(jax.make_jaxpr(jax.grad(_loss_invariant))(0.5, xs))
    self.assertNotIn('sow', text)

  def test_recurrent_nnx_cell_weight_statistic_per_step(self):
    class Cell(nnx.Module):

      def __init__(self, rngs):
        self.w = nnx.Linear(2, 2, rngs=rngs)

      def __call__(self, h, x):
        # A statistic of the weights only: loop-invariant in the scan.
        self.sow(nnx.Intermediate, 'w_norm', jnp.sum(self.w.kernel[...] ** 2))
        h = jnp.tanh(self.w(h) + x)
        return h, h

    cell = Cell(nnx.Rngs(0))
    xs = jax.random.normal(jax.random.key(1), (6, 2))

    def loss_fn(cell):
      scan = nnx.scan(
          lambda cell, h, x: cell(h, x),
          in_axes=(None, nnx.Carry, 0),
          out_axes=(nnx.Carry, 0),
      )
      h, ys = scan(cell, jnp.zeros(2), xs)
      return jnp.sum(ys**2)

    (loss, grads), state = nnx.capture(
        nnx.value_and_grad(loss_fn), nnx.Intermediate
    )(cell)
    norm = float(jnp.sum(cell.w.kernel[...] ** 2))
    (norms,) = state['w_norm']
    np.testing.assert_allclose(norms, np.full(6, norm), rtol=1e-6)

    def plain_loss(kernel, bias):  # the same recurrence, without sow
      h, total = jnp.zeros(2), 0.0
      for x in xs:
        h = jnp.tanh(h @ kernel + bias + x)
        total = total + jnp.sum(h**2)
      return total

    kernel, bias = cell.w.kernel.get_value(), cell.w.bias.get_value()
    want_loss, want_grad = jax.value_and_grad(plain_loss)(kernel, bias)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
    np.testing.assert_allclose(
        grads['w']['kernel'].get_value(), want_grad, rtol=1e-4
    )


# ----------------------------------------------------------------------------
# 3. Reductions: each site folds with its own reduce_fn.


class PerSiteReductionTest(parameterized.TestCase):

  def test_inline_lambdas_in_python_loop(self):
    def f(x):
      for _ in range(3):
        x = sow(
            jnp.tanh(x),
            name='n',
            reduce_fn=lambda a, b: a + jnp.sum(b),
            init_fn=lambda: 0.0,
        )
      return x

    _, collected = capture(f)(jnp.ones(3))
    t1 = np.tanh(1.0)
    t2 = np.tanh(t1)
    t3 = np.tanh(t2)
    np.testing.assert_allclose(collected['n'], 3 * (t1 + t2 + t3), rtol=1e-6)

  def test_lambda_closing_over_loop_variable(self):
    def f(x):
      for i in range(1, 4):
        sow(
            x,
            name='w',
            reduce_fn=lambda a, b, i=i: a + i * b,
            init_fn=lambda: jnp.zeros(()),
        )
      return x

    _, collected = capture(f)(jnp.float32(2.0))
    np.testing.assert_allclose(collected['w'], 2.0 * (1 + 2 + 3))

  def test_lambda_reading_loop_variable_without_default(self):
    # Flax applies reduce_fn at the sow, so the lambda sees i as it is then.
    def f(x):
      for i in range(3):
        sow(
            x,
            name='s',
            reduce_fn=lambda acc, v: acc + i * v,
            init_fn=lambda: 0.0,
        )
      return x

    _, collected = capture(f)(jnp.float32(1.0))
    np.testing.assert_allclose(collected['s'], 0.0 + 1.0 + 2.0)

  def test_reduce_fn_closing_over_intermediates(self):
    def f(xs):
      scale = jnp.sum(xs)  # an intermediate of the captured function
      sow(
          xs,
          name='top',
          reduce_fn=lambda a, v: a + jnp.sum(v) * scale,
          init_fn=lambda: 0.0,
      )

      def body(c, x):
        weight = x * 2.0  # an intermediate of the loop body
        sow(
            x,
            name='loop',
            reduce_fn=lambda a, v: a + v * weight,
            init_fn=lambda: 0.0,
        )
        return c, None

      jax.lax.scan(body, 0.0, xs)
      jax.vmap(
          lambda x: sow(
              x,
              name='vm',
              reduce_fn=lambda a, v: a + v * x,
              init_fn=lambda: 0.0,
          )
      )(xs)
      return xs

    xs = jnp.array([1.0, 2.0, 3.0])
    for g in (capture(f), jax.jit(capture(f))):
      _, collected = g(xs)
      np.testing.assert_allclose(collected['top'], 6.0 * 6.0)
      np.testing.assert_allclose(collected['loop'], 2.0 * (1 + 4 + 9))
      np.testing.assert_allclose(collected['vm'], 1 + 4 + 9)

  def test_module_sow_reduce_fn_reading_module_state(self):
    class Scaled(nnx.Module):

      def __init__(self):
        self.scale = nnx.Param(jnp.float32(3.0))

      def __call__(self, x):
        for i in range(2):
          self.sow(
              nnx.Intermediate,
              'acc',
              x,
              reduce_fn=lambda a, v: a + v * self.scale[...] + i,
              init_fn=lambda: 0.0,
          )
        return x

    _, state = nnx.capture(Scaled(), nnx.Intermediate)(jnp.float32(2.0))
    np.testing.assert_allclose(state['acc'].get_value(), 6.0 + 0 + 6.0 + 1)

  def test_python_int_init_promotes(self):
    def f(x):
      sow(x, name='s', reduce_fn=lambda a, b: a + b, init_fn=lambda: 0)
      sow(x, name='s', reduce_fn=lambda a, b: a + b, init_fn=lambda: 0)
      return x

    _, collected = capture(f)(jnp.array([1.0, 2.0], jnp.float32))
    self.assertEqual(collected['s'].dtype, jnp.float32)
    np.testing.assert_allclose(collected['s'], [2.0, 4.0])

  def test_error_inside_reduce_fn_names_the_sow(self):
    def f(x):
      return sow(
          x,
          name='bad_fold',
          reduce_fn=lambda a, v: a @ v,
          init_fn=lambda: jnp.zeros(2),
      )

    with self.assertRaises(TypeError) as cm:
      capture(f)(jnp.ones(3))
    self.assertIn("sow 'bad_fold'", ' '.join(cm.exception.__notes__))

  def test_real_type_change_still_raises(self):
    def f(x):
      return sow(
          x,
          name='bad',
          reduce_fn=lambda a, b: a + b,
          init_fn=lambda: jnp.int32(0),
      )

    with self.assertRaisesRegex(ValueError, "sow 'bad'.*accumulator"):
      capture(f)(jnp.float32(1.0))

  def test_scan_while_cond_vmap_nested_jit(self):
    def f(xs):
      def body(c, x):
        sow(x, name='r', reduce_fn=lambda a, b: a + b, init_fn=lambda: 0.0)
        return c, None

      jax.lax.scan(body, 0.0, xs)

      def wbody(s):
        (i,) = s
        sow(
            xs[i],
            name='r',
            reduce_fn=lambda a, b: a + 10 * b,
            init_fn=lambda: 0.0,
        )
        return (i + 1,)

      jax.lax.while_loop(lambda s: s[0] < 2, wbody, (0,))
      jax.lax.cond(
          xs[0] > 0,
          lambda: sow(
              xs[1],
              name='r',
              reduce_fn=lambda a, b: a + 100 * b,
              init_fn=lambda: 0.0,
          ),
          lambda: xs[1],
      )
      jax.vmap(
          lambda v: sow(
              v,
              name='r',
              reduce_fn=lambda a, b: a + 1000 * b,
              init_fn=lambda: 0.0,
          )
      )(xs)
      jax.jit(
          lambda v: sow(
              v, name='r', reduce_fn=lambda a, b: a - b, init_fn=lambda: 0.0
          )
      )(xs[2])
      return xs

    xs = jnp.array([1.0, 2.0, 3.0], jnp.float32)
    _, collected = capture(f)(xs)
    want = 6.0 + 10 * 3.0 + 100 * 2.0 + 1000 * 6.0 - 3.0
    np.testing.assert_allclose(collected['r'], want)

  def test_subset_of_branches_under_vmap_with_batched_predicate(self):
    def per_example(x):
      def hot(x):
        sow(x, name='hot_sum', reduce_fn=lambda a, b: a + b, init_fn=lambda: 0)
        sow(
            jnp.int32(1),
            name='count',
            reduce_fn=lambda a, b: a + b,
            init_fn=lambda: jnp.int32(0),
        )
        return sow(x * 2.0, name='y')

      def mild(x):
        sow(
            jnp.int32(10),
            name='count',
            reduce_fn=lambda a, b: a + b,
            init_fn=lambda: jnp.int32(0),
        )
        return sow(x * 3.0, name='y')

      def cold(x):
        return sow(-x, name='y')

      index = (x > 0).astype(jnp.int32) + (x > 2).astype(jnp.int32)
      return jax.lax.switch(index, (cold, mild, hot), x)

    xs = jnp.array([3.0, -1.0, 1.0, 5.0, 0.5])
    out, collected = capture(jax.vmap(per_example))(xs)
    # By hand: 3 and 5 take `hot`, 1 and 0.5 `mild`, -1 `cold`.
    np.testing.assert_allclose(out, [6.0, 1.0, 3.0, 10.0, 1.5])
    # Names in order of first sow, branch by branch (cold, mild, hot).
    self.assertEqual(list(collected), ['y', 'count', 'hot_sum'])
    np.testing.assert_allclose(collected['hot_sum'], 8.0)
    self.assertEqual(int(collected['count']), 2 * 1 + 2 * 10)
    np.testing.assert_allclose(collected['y'][0], out)

  def test_batched_branch_names_in_order_with_tags(self):
    def per_example(x):
      def first(x):
        sow(x, name='max', reduce_fn=jnp.maximum, init_fn=lambda: -jnp.inf)
        return x

      def second(x):
        sow(
            x,
            name='max',
            tag='t1',
            reduce_fn=jnp.maximum,
            init_fn=lambda: -jnp.inf,
        )
        sow(
            x,
            name='sum',
            tag='t1',
            reduce_fn=lambda a, v: a + v,
            init_fn=lambda: 0.0,
        )
        return x

      return jax.lax.switch(
          (x > 0).astype(jnp.int32) + 1, (lambda x: x, first, second), x
      )

    xs = jnp.array([1.0, -2.0, 3.0])
    _, collected = capture(jax.vmap(per_example), tags=('t1',))(xs)
    self.assertEqual(list(collected), ['max', 'sum'])
    np.testing.assert_allclose(collected['max'], 3.0)
    np.testing.assert_allclose(collected['sum'], 4.0)

  def test_batched_branch_reduce_fn_closing_over_intermediate(self):
    def per_example(x):
      def hot(x):
        w = x * 10.0  # an intermediate of the branch, read by reduce_fn
        sow(x, name='s', reduce_fn=lambda a, v: a + v * w, init_fn=lambda: 0.0)
        return x

      return jax.lax.cond(x > 0, hot, lambda x: -x, x)

    xs = jnp.array([1.0, -2.0, 3.0])
    for g in (jax.vmap(per_example), jax.jit(jax.vmap(per_example))):
      out, collected = capture(g)(xs)
      np.testing.assert_allclose(out, [1.0, 2.0, 3.0])
      np.testing.assert_allclose(collected['s'], 10.0 * (1 + 9))

  def test_module_sow_lambda_closing_over_loop_variable(self):
    class M(nnx.Module):

      def __call__(self, x):
        for i in range(1, 4):
          self.sow(
              nnx.Intermediate,
              'acc',
              x,
              reduce_fn=lambda a, b, i=i: a + i * b,
              init_fn=lambda: 0,
          )
        return x

    m = M()
    _, state = nnx.capture(m, nnx.Intermediate)(jnp.float32(2.0))
    np.testing.assert_allclose(state['acc'].get_value(), 12.0)


class NnxCaptureInitTest(absltest.TestCase):

  def test_init_state_starts_sows_as_in_flax(self):
    class M(nnx.Module):

      def __call__(self, x):
        self.sow(
            nnx.Intermediate,
            'total',
            x,
            reduce_fn=lambda a, b: a + b,
            init_fn=lambda: jnp.zeros(2),
        )
        self.sow(nnx.Intermediate, 'seen', x)
        self.sow(
            nnx.Intermediate,
            'grown',
            x,
            reduce_fn=lambda c, v: (*c, v * 2),
            init_fn=lambda: (),
        )
        return x

    init = nnx.State(
        {
            'total': nnx.Intermediate(jnp.full(2, 10.0)),
            'seen': nnx.Intermediate((jnp.full(2, -1.0),)),
            'grown': nnx.Intermediate((jnp.full(2, 5.0),)),
        }
    )
    _, state = nnx.capture(M(), nnx.Intermediate, init=init)(jnp.ones(2))
    np.testing.assert_allclose(state['total'].get_value(), [11.0, 11.0])
    seen = state['seen'].get_value()
    self.assertLen(seen, 2)
    np.testing.assert_allclose(seen[0], [-1.0, -1.0])
    np.testing.assert_allclose(seen[1], [1.0, 1.0])
    grown = state['grown'].get_value()
    self.assertLen(grown, 2)
    np.testing.assert_allclose(grown[1], [2.0, 2.0])


# ----------------------------------------------------------------------------
# 4. Nothing lost: a branch-only sow under vmap is the error it is without.


class BranchOnlyTest(absltest.TestCase):

  def f(self, p, x):
    return jax.lax.cond(
        p, lambda x: sow(x, name='only') * 2.0, lambda x: x * 3.0, x
    )

  def test_without_vmap(self):
    with self.assertRaisesRegex(ValueError, "sow 'only'"):
      capture(self.f)(True, 1.0)

  def test_with_vmap_batched_predicate(self):
    with self.assertRaisesRegex(ValueError, "sow 'only'"):
      capture(jax.vmap(self.f))(jnp.array([True, False]), jnp.ones(2))

  def test_not_collected_tag_is_fine_under_vmap(self):
    def f(p, x):
      return jax.lax.cond(
          p,
          lambda x: sow(x, name='only', tag='other') * 2.0,
          lambda x: x * 3.0,
          x,
      )

    out, collected = capture(jax.vmap(f), tags=('mine',))(
        jnp.array([True, False]), jnp.ones(2)
    )
    np.testing.assert_allclose(out, [2.0, 3.0])
    self.assertEqual(dict(collected), {})


# ----------------------------------------------------------------------------
# 5. Names, keys and errors.


def _line_of(marker: str) -> int:
  with open(__file__) as f:
    for i, line in enumerate(f, 1):
      if marker in line and '_line_of' not in line:
        return i
  raise AssertionError(marker)


class NamesAndErrorsTest(absltest.TestCase):

  def test_numpy_integer_name_part(self):
    _, collected = capture(lambda x: sow(x, name=('layer', np.int64(2))) * 1.0)(
        jnp.float32(1.0)
    )
    (key,) = collected
    self.assertEqual(key, ('layer', 2))
    self.assertIs(type(key[1]), int)

  def test_numpy_bool_name_part_is_type_error(self):
    with self.assertRaisesRegex(TypeError, 'name'):
      capture(lambda x: sow(x, name=('layer', np.bool_(True))))(1.0)

  def test_function_reading_a_global_registry_with_type_keys(self):
    # capture looks for NNX modules among what f refers to; a global that is
    # not a pytree (unorderable dict keys) must not get in the way.
    _, collected = capture(_reads_registry)(jnp.float32(2.0))
    np.testing.assert_allclose(collected['r'][0], 2.0 * 3)

  def test_capture_of_non_callable(self):
    with self.assertRaisesRegex(TypeError, 'callable'):
      capture(3)

  def test_plain_sow_in_while_names_file_and_line(self):
    def f(x):
      def body(c):
        sow(c, name='in_while')  # LINE-WHILE
        return c + 1.0

      return jax.lax.while_loop(lambda c: c < 3.0, body, x)

    line = _line_of('# LINE-WHILE')
    with self.assertRaisesRegex(
        ValueError, rf"sow 'in_while' \(at .*test_real_programs.py:{line}"
    ):
      capture(f)(jnp.float32(0.0))

  def test_branch_mismatch_names_file_and_line(self):
    def f(p, x):
      return jax.lax.cond(
          p,
          lambda x: sow(x, name='mm'),  # LINE-BRANCH
          lambda x: sow(jnp.stack([x, x]), name='mm')[0],
          x,
      )

    with self.assertRaisesRegex(ValueError, r"sow 'mm' \(at .*test_real_pro"):
      capture(f)(True, jnp.float32(1.0))

  def test_accumulator_change_names_file_and_line(self):
    def f(x):
      return sow(  # LINE-ACC
          x,
          name='acc',
          reduce_fn=lambda a, b: a + b,
          init_fn=lambda: jnp.zeros((3,), jnp.int32),
      )

    line = _line_of('# LINE-ACC')
    with self.assertRaisesRegex(
        ValueError, rf"sow 'acc' \(at .*test_real_programs.py:{line}"
    ):
      capture(f)(jnp.zeros((3,)))

  def test_no_rule_names_file_and_line(self):
    def f(x):
      # A higher-order primitive that no construct file handles.
      return xla_metadata_call(
          lambda v: sow(v, name='matvec') * 2.0,  # LINE-SOLVE
          scheduling_group='g',
      )(x)

    line = _line_of('# LINE-SOLVE')
    with self.assertRaisesRegex(
        NotImplementedError,
        rf"sow 'matvec' \(at .*test_real_programs.py:{line}.*"
        r'xla_metadata_call.*no capture rule',
    ):
      capture(f)(jnp.ones(2))

  def test_flatten_names_under_jit(self):
    def f(x):
      sow(x, name=('blocks', 0, 'act'))
      sow(x * 2, name='loss')
      return x

    @jax.jit
    def g(x):
      _, collected = capture(f)(x)
      return {**flatten_names(collected)}

    out = g(jnp.float32(1.5))
    self.assertEqual(sorted(out), ['blocks/0/act', 'loss'])
    np.testing.assert_allclose(out['blocks/0/act'][0], 1.5)
    np.testing.assert_allclose(out['loss'][0], 3.0)

  def test_flatten_names_collision(self):
    with self.assertRaisesRegex(ValueError, 'a/b'):
      flatten_names({'a/b': 1, ('a', 'b'): 2})

  def test_state_round_trip_keeps_key_order(self):
    c = {('b', 0, 'x'): (1.0,), 'a': (2.0,), ('b', 1, 'y'): (3.0,)}
    back = state_to_collected(collected_to_state(c))
    self.assertEqual(list(back), list(c))
    self.assertEqual(back, c)

  def test_perturb_numpy_name(self):
    def loss(x):
      return jnp.sum(perturb(x, name=('h', np.int32(1))) ** 2)

    _, collected = capture(jax.grad(loss))(jnp.array([1.0, 2.0]))
    np.testing.assert_allclose(collected[('h', 1)][0], [2.0, 4.0])


# ----------------------------------------------------------------------------
# Custom rules that run the primal again, under nested captures.


class NestedCustomRuleTest(absltest.TestCase):

  def test_rule_sowing_another_name_is_an_error_not_a_loss(self):
    @jax.custom_jvp
    def h(x):
      return sow(x * 2.0, name='a')

    @h.defjvp
    def h_jvp(primals, tangents):
      sow(tangents[0], name='tangent_in_rule')  # not sown by the body
      return h(*primals), 2.0 * tangents[0]

    def loss(x):
      y, inner = capture(h)(x)
      return y, inner

    with self.assertRaisesRegex(
        NotImplementedError, "sow 'tangent_in_rule'.*custom_jvp rule"
    ):
      capture(jax.grad(loss, has_aux=True))(jnp.float32(1.0))

  def test_sows_the_inner_capture_leaves_reach_the_outer_once(self):
    @jax.custom_vjp
    def h(x):
      sow(x * 2.0, name='a')  # not taken by the inner capture
      sow(x * 3.0, name='b', tag='t1')  # taken by the inner capture
      return jnp.sin(x)

    h.defvjp(lambda x: (h(x), x), lambda x, ct: (jnp.cos(x) * ct,))

    def loss(x):
      return capture(h, tags=('t1',))(x)

    (g, inner), outer = capture(jax.grad(loss, has_aux=True))(jnp.float32(1.0))
    np.testing.assert_allclose(g, np.cos(1.0), rtol=1e-6)
    self.assertEqual(list(inner), ['b'])
    np.testing.assert_allclose(inner['b'][0], 3.0)
    self.assertEqual(list(outer), ['a'])
    self.assertLen(outer['a'], 1)
    np.testing.assert_allclose(outer['a'][0], 2.0)

  def test_custom_vjp_forward_runs_primal_again(self):
    @jax.custom_vjp
    def h(x):
      return sow(x * 3.0, name='b')

    h.defvjp(lambda x: (h(x), None), lambda _, ct: (3.0 * ct,))

    def loss(x):
      y, inner = capture(h)(x)
      return y, inner

    (g, inner), outer = capture(jax.grad(loss, has_aux=True))(jnp.float32(2.0))
    np.testing.assert_allclose(g, 3.0)
    np.testing.assert_allclose(inner['b'][0], 6.0)
    self.assertEqual(dict(outer), {})


_REGISTRY = {int: 3, float: 4}


def _reads_registry(x):
  return sow(x * _REGISTRY[int], name='r')


# ----------------------------------------------------------------------------
# 6. Caches hold nothing the user owns.


class FreedAfterCallTest(absltest.TestCase):

  def test_closed_over_array_and_module_are_freed(self):
    import gc  # pylint: disable=g-import-not-at-top
    import weakref  # pylint: disable=g-import-not-at-top

    class Probe(nnx.Module):

      def __init__(self):
        self.w = nnx.Param(jnp.full((3,), 2.0))

      def __call__(self, x):
        y = x * self.w[...]
        self.sow(nnx.Intermediate, 'y', y)
        return y

    def run():
      big = jnp.full((3,), 3.0)
      weights = jnp.full((3,), 0.5)
      model = Probe()

      def f(x):
        def body(c, v):
          sow(
              c * big,
              name='s',
              reduce_fn=lambda a, b: a + jnp.sum(b),
              init_fn=lambda: 0.0,
          )
          # A reduce_fn that closes over an array (the array must not be
          # kept alive by any cache once the call is over).
          sow(
              c,
              name='w',
              reduce_fn=lambda a, b: a + jnp.sum(b * weights),
              init_fn=lambda: 0,
          )
          return c + v, None

        c, _ = jax.lax.scan(body, x, jnp.ones((2, 3)))
        return sow(c, name='c') + jax.jit(lambda y: sow(y, name='j'))(c)

      _, collected = capture(f)(jnp.ones(3))
      np.testing.assert_allclose(collected['s'], 3.0 * (3 + 6))
      np.testing.assert_allclose(collected['w'], 0.5 * (3 + 6))
      _, state = nnx.capture(model, nnx.Intermediate)(jnp.ones(3))
      np.testing.assert_allclose(state['y'][0], [2.0, 2.0, 2.0])
      return [weakref.ref(v) for v in (big, weights, model, f)]

    refs = run()
    gc.collect()
    self.assertEqual([r() for r in refs], [None] * 4)


class CacheBoundTest(absltest.TestCase):

  def test_rewrite_cache_does_not_keep_jitted_captures_alive(self):
    import gc  # pylint: disable=g-import-not-at-top

    from flax.nnx.sow import collect as collect_lib  # pylint: disable=g-import-not-at-top

    def make(i):
      def scanned(x):
        def body(c, v):
          sow(
              c * v,
              name='s',
              reduce_fn=lambda a, b: a + jnp.sum(b),
              init_fn=lambda: 0.0,
          )
          sow(jnp.sum(x), name='inv')
          return c + v * i, None

        return jax.lax.scan(body, x, jnp.ones((3, 4)))[0]

      return scanned

    gc.collect()
    before = len(collect_lib._rewrite_cache)  # pylint: disable=protected-access
    for i in range(5):
      _, collected = jax.jit(capture(make(i)))(jnp.ones(4))
      np.testing.assert_allclose(collected['inv'][0], [4.0] * 3)
    gc.collect()
    after = len(collect_lib._rewrite_cache)  # pylint: disable=protected-access
    self.assertLessEqual(after, before)


class ReduceClosureFreedTest(parameterized.TestCase):

  @parameterized.parameters('scan', 'while', 'cond', 'jit', 'checkpoint')
  def test_array_closed_over_by_reduce_fn_is_freed(self, construct):
    import gc  # pylint: disable=g-import-not-at-top
    import weakref  # pylint: disable=g-import-not-at-top

    def run():
      weights = jnp.full((3,), 0.5)

      def red(a, b):
        return a + jnp.sum(b * weights)

      def mark(x):
        return sow(x, name='w', reduce_fn=red, init_fn=lambda: 0)

      def f(x):
        if construct == 'scan':
          return jax.lax.scan(
              lambda c, v: (mark(c) + v, None), x, jnp.ones((2, 3))
          )[0]
        if construct == 'while':
          return jax.lax.while_loop(
              lambda c: c[0] < 3.0, lambda c: mark(c) + 1.0, x
          )
        if construct == 'cond':
          return jax.lax.cond(x[0] > 0, mark, lambda x: x, x)
        if construct == 'jit':
          return jax.jit(mark)(x)
        return jax.checkpoint(mark)(x)

      _, collected = capture(f)(jnp.ones(3))
      # scan: c = 1 then 2; while: c = 1, 2; otherwise one sow of ones.
      want = {'scan': 1.5 + 3.0, 'while': 1.5 + 3.0}.get(construct, 1.5)
      np.testing.assert_allclose(collected['w'], want)
      return weakref.ref(weights)

    ref = run()
    gc.collect()
    self.assertIsNone(ref())


if __name__ == '__main__':
  absltest.main()
