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

"""Constructs beyond the common ones: ``custom_vjp(optimize_remat=True)``,
``custom_vmap``, ``jax.experimental.jet``, and ``jax.checking_leaks()``.

Every expected value is computed without ``sow``: by hand (the derivatives
are written out) or by the same function written without it.
"""

from __future__ import annotations

import itertools

from absl.testing import absltest
from absl.testing import parameterized
import jax
import jax.extend
from jax.experimental.jet import jet
import jax.numpy as jnp
import numpy as np

from flax.nnx.sow import capture
from flax.nnx.sow import intervene
from flax.nnx.sow import perturb
from flax.nnx.sow import sow

X = np.array([0.1, 0.5, -0.3], np.float32)
XS = np.array([[0.1, 0.5, -0.3], [0.7, -0.2, 0.4]], np.float32)  # (2, 3)
R = np.array([1.5, -0.25, 2.0], np.float32)


def assert_close(actual, expected, rtol=1e-5, atol=1e-6):
  """Same pytree structure and leaves equal up to float tolerance."""
  a_leaves, a_tree = jax.tree_util.tree_flatten(actual)
  e_leaves, e_tree = jax.tree_util.tree_flatten(expected)
  assert a_tree == e_tree, f'structure {a_tree} != expected {e_tree}'
  for a, e in zip(a_leaves, e_leaves):
    np.testing.assert_allclose(
        np.asarray(a), np.asarray(e), rtol=rtol, atol=atol
    )


def assert_collected(test, collected, expected):
  """``collected`` has exactly ``expected``'s names, in order, and values."""
  test.assertEqual(list(collected), list(expected))
  for name, value in expected.items():
    if isinstance(value, tuple):
      test.assertIsInstance(collected[name], tuple, msg=repr(name))
      test.assertLen(collected[name], len(value), msg=repr(name))
    assert_close(collected[name], value)


def _add(acc, value):
  return acc + value


def _zero():
  return jnp.zeros((), jnp.float32)


def _primitives(jaxpr):
  names = []
  for eqn in jaxpr.eqns:
    names.append(eqn.primitive.name)
    for sub in jax.extend.core.jaxprs_in_params(eqn.params):
      names.extend(_primitives(sub))
  return names


# ----------------------------------------------------------------------------
# custom_vjp with optimize_remat=True. Its backward rule uses a slope of 5,
# not the derivative of the body, so a test sees whether the custom rule is
# kept: d/dx sum(3 * g(x)) = 15 * cos(2x) by the rule.


def _make_remat_opt(with_sow: bool, forward_input: bool = False):
  @jax.custom_vjp
  def g(x):
    h = 2.0 * x
    if with_sow:
      h = sow(h, name='h')
      sow(jnp.sum(x), name='r', reduce_fn=_add, init_fn=_zero)
    return jnp.sin(h)

  if forward_input:
    # The residual is the input itself (JAX forwards it: no residual
    # output, so dead-code elimination may run the primal instead).
    fwd = lambda x: (g(x), x)
    bwd = lambda x, ct: (5.0 * jnp.cos(2.0 * x) * ct,)
  else:
    fwd = lambda x: (g(x), jnp.cos(2.0 * x))
    bwd = lambda c, ct: (5.0 * c * ct,)
  g.defvjp(fwd, bwd, optimize_remat=True)
  return g


REMAT_OPT = _make_remat_opt(True)
REMAT_OPT_FORWARDED = _make_remat_opt(True, forward_input=True)


def _loss(g):
  return lambda x: jnp.sum(3.0 * g(x))


def _expected_grad(x):
  return 15.0 * np.cos(2.0 * np.asarray(x))


def _expected_loss(x):
  return np.sum(3.0 * np.sin(2.0 * np.asarray(x)))


def _expected_sows(x):
  return {'h': (2.0 * np.asarray(x),), 'r': np.sum(x)}


class RematOptTest(parameterized.TestCase):

  def test_reference_without_sow(self):
    # The construct itself, without sows, gives the values below.
    g = _make_remat_opt(False)
    assert_close(jax.grad(_loss(g))(X), _expected_grad(X))
    assert_close(_loss(g)(X), _expected_loss(X))

  def test_no_differentiation(self):
    out, collected = capture(REMAT_OPT)(X)
    assert_close(out, np.sin(2.0 * X))
    assert_collected(self, collected, _expected_sows(X))

  @parameterized.product(
      g=(REMAT_OPT, REMAT_OPT_FORWARDED),
      wrap=('eager', 'jit_around', 'jit_inside', 'checkpoint'),
  )
  def test_grad_inside_capture(self, g, wrap):
    grad = jax.grad(_loss(g))
    if wrap == 'jit_inside':
      grad = jax.jit(grad)
    elif wrap == 'checkpoint':
      grad = jax.grad(jax.checkpoint(_loss(g)))
    captured = capture(grad)
    if wrap == 'jit_around':
      captured = jax.jit(captured)
    out, collected = captured(X)
    assert_close(out, _expected_grad(X))
    assert_collected(self, collected, _expected_sows(X))

  def test_value_and_grad_inside_capture(self):
    (value, grad), collected = capture(jax.value_and_grad(_loss(REMAT_OPT)))(X)
    assert_close(value, _expected_loss(X))
    assert_close(grad, _expected_grad(X))
    assert_collected(self, collected, _expected_sows(X))

  @parameterized.parameters(False, True)
  def test_grad_around_capture(self, jit):
    def loss(x):
      out, collected = capture(REMAT_OPT)(x)
      return jnp.sum(3.0 * out), collected

    fn = jax.grad(loss, has_aux=True)
    if jit:
      fn = jax.jit(fn)
    grad, collected = fn(X)
    assert_close(grad, _expected_grad(X))  # the custom rule, kept
    assert_collected(self, collected, _expected_sows(X))

  def test_closes_over_enclosing_jit_tracer(self):
    @jax.jit
    def step(c):
      return capture(jax.grad(lambda x: _loss(REMAT_OPT)(x * c)))(X)

    grad, collected = step(jnp.float32(2.0))
    assert_close(grad, 2.0 * _expected_grad(2.0 * X))
    assert_collected(self, collected, _expected_sows(2.0 * X))

  def test_vmap(self):
    grad = jax.grad(_loss(REMAT_OPT))
    for fn in (capture(jax.vmap(grad)), jax.vmap(capture(grad))):
      out, collected = fn(XS)
      assert_close(out, _expected_grad(XS))
      self.assertEqual(list(collected), ['h', 'r'])
      assert_close(collected['h'], (2.0 * XS,))
    # Inside the capture every example folds into one accumulator; around
    # it, each example has its own.
    _, collected = capture(jax.vmap(grad))(XS)
    assert_close(collected['r'], np.sum(XS))
    _, collected = jax.vmap(capture(grad))(XS)
    assert_close(collected['r'], np.sum(XS, axis=1))

  def test_stays_a_remat_opt_equation(self):
    jaxpr = jax.make_jaxpr(capture(jax.grad(_loss(REMAT_OPT))))(X)
    names = _primitives(jaxpr.jaxpr)
    self.assertIn('remat_opt', names)
    self.assertNotIn('sow', names)

  def test_intervene_grad(self):
    fn = jax.value_and_grad(_loss(REMAT_OPT))
    for g in (intervene(fn, {'h': (R,)}), jax.jit(intervene(fn, {'h': (R,)}))):
      value, grad = g(X)
      assert_close(value, np.sum(3.0 * np.sin(R)))
      # The custom rule, for the original input.
      assert_close(grad, _expected_grad(X))
    value, grad = intervene(fn, {'h': lambda h: h + 1.0})(X)
    assert_close(value, np.sum(3.0 * np.sin(2.0 * X + 1.0)))
    assert_close(grad, _expected_grad(X))

  def test_capture_of_intervene_grad(self):
    fn = intervene(jax.grad(_loss(REMAT_OPT)), {'h': (R,)})
    grad, collected = capture(fn)(X)
    assert_close(grad, _expected_grad(X))
    assert_collected(self, collected, {'h': (R,), 'r': np.sum(X)})


# ----------------------------------------------------------------------------
# custom_vmap: the body sows 2x and returns sin(2x); the vmap rule sows 3x and
# returns cos(3x), so a test sees which of the two ran.


@jax.custom_batching.custom_vmap
def vmapped(x):
  return jnp.sin(sow(2.0 * x, name='h'))


@vmapped.def_vmap
def _vmapped_rule(axis_size, in_batched, xs):
  del axis_size
  return jnp.cos(sow(3.0 * xs, name='h')), in_batched[0]


@jax.custom_batching.custom_vmap
def vmapped_reduced(x):
  sow(jnp.sum(x), name='total', reduce_fn=_add, init_fn=_zero)
  return 2.0 * x


@vmapped_reduced.def_vmap
def _vmapped_reduced_rule(axis_size, in_batched, xs):
  del axis_size
  return 2.0 * xs, in_batched[0]


@jax.custom_batching.custom_vmap
def vmapped_other_name(x):
  return jnp.sin(sow(2.0 * x, name='h'))


@vmapped_other_name.def_vmap
def _vmapped_other_name_rule(axis_size, in_batched, xs):
  del axis_size
  return jnp.sin(sow(2.0 * xs, name='not_h')), in_batched[0]


@jax.custom_batching.custom_vmap
def vmapped_no_sow(x):
  return jnp.sin(2.0 * x)


@vmapped_no_sow.def_vmap
def _vmapped_no_sow_rule(axis_size, in_batched, xs):
  del axis_size
  return jnp.cos(3.0 * xs), in_batched[0]


# With a custom_vjp around it (as JAX's documentation combines them), so that
# it can be differentiated.
vmapped_vjp = jax.custom_vjp(vmapped)
vmapped_vjp.defvjp(
    lambda x: (vmapped(x), x),
    lambda x, ct: (2.0 * jnp.cos(2.0 * x) * ct,),
)


class CustomVmapTest(parameterized.TestCase):

  def test_reference_without_sow(self):
    x = np.float32(0.5)
    assert_close(vmapped_no_sow(x), np.sin(2.0 * x))
    assert_close(jax.vmap(vmapped_no_sow)(X), np.cos(3.0 * X))

  @parameterized.parameters('eager', 'jit_around', 'jit_inside')
  def test_body_sows_collected(self, wrap):
    fn = jax.jit(vmapped) if wrap == 'jit_inside' else vmapped
    captured = capture(fn)
    if wrap == 'jit_around':
      captured = jax.jit(captured)
    out, collected = captured(X)
    assert_close(out, np.sin(2.0 * X))
    assert_collected(self, collected, {'h': (2.0 * X,)})

  def test_stays_a_custom_vmap_equation(self):
    names = _primitives(jax.make_jaxpr(capture(vmapped))(X).jaxpr)
    self.assertIn('custom_vmap_call', names)
    self.assertNotIn('sow', names)
    # And it still batches with the user's rule afterwards.
    out, collected = jax.vmap(capture(vmapped))(X)
    assert_close(out, np.cos(3.0 * X))

  @parameterized.parameters(
      'vmap_inside',
      'vmap_around',
      'vmap_of_jit_around',
      'jit_of_vmap_inside',
      'vmap_of_jit_inside',
  )
  def test_vmap_runs_the_rule_and_collects_its_sows(self, how):
    fn = {
        'vmap_inside': lambda: capture(jax.vmap(vmapped)),
        'vmap_around': lambda: jax.vmap(capture(vmapped)),
        'vmap_of_jit_around': lambda: jax.vmap(jax.jit(capture(vmapped))),
        'jit_of_vmap_inside': lambda: capture(jax.jit(jax.vmap(vmapped))),
        'vmap_of_jit_inside': lambda: capture(jax.vmap(jax.jit(vmapped))),
    }[how]()
    out, collected = fn(X)
    assert_close(out, np.cos(3.0 * X))
    # The rule's sow, with the mapped axis first.
    assert_collected(self, collected, {'h': (3.0 * X,)})

  def test_vmap_around_with_unbatched_argument(self):
    @jax.custom_batching.custom_vmap
    def scaled(x, y):
      return jnp.sin(sow(2.0 * x, name='h')) * y

    @scaled.def_vmap
    def _scaled_rule(axis_size, in_batched, x, ys):
      del axis_size
      self.assertEqual(in_batched, [False, True])
      return jnp.cos(sow(3.0 * x, name='h')) * ys, True

    out, collected = jax.vmap(capture(scaled), in_axes=(None, 0))(
        np.float32(0.5), X
    )
    assert_close(out, np.cos(1.5) * X)
    # The rule sows 3 * 0.5 unbatched; each example gets it.
    assert_collected(self, collected, {'h': (np.full(3, 1.5, np.float32),)})
    # Unbatched, the body runs.
    out, collected = capture(scaled)(np.float32(0.5), np.float32(2.0))
    assert_close(out, 2.0 * np.sin(1.0))
    assert_collected(self, collected, {'h': (np.float32(1.0),)})

  def test_closes_over_enclosing_jit_tracer(self):
    @jax.jit
    def step(c):
      return capture(lambda x: vmapped(x * c))(X), jax.vmap(
          capture(lambda x: vmapped(x * c))
      )(X)

    (out, collected), (bout, bcollected) = step(jnp.float32(2.0))
    assert_close(out, np.sin(4.0 * X))
    assert_collected(self, collected, {'h': (4.0 * X,)})
    assert_close(bout, np.cos(6.0 * X))
    assert_collected(self, bcollected, {'h': (6.0 * X,)})

  def test_jvp(self):
    x = np.float32(0.5)
    (out, collected), (t, t_collected) = jax.jvp(
        capture(vmapped), (x,), (np.float32(1.0),)
    )
    assert_close(out, np.sin(1.0))
    assert_close(t, 2.0 * np.cos(1.0))
    assert_collected(self, collected, {'h': (np.float32(1.0),)})
    assert_collected(self, t_collected, {'h': (np.float32(2.0),)})
    (out, t), collected = capture(
        lambda x: jax.jvp(vmapped, (x,), (np.float32(1.0),))
    )(x)
    assert_close((out, t), (np.sin(1.0), 2.0 * np.cos(1.0)))
    assert_collected(self, collected, {'h': (np.float32(1.0),)})

  def test_jacfwd_runs_the_rule(self):
    # jacfwd batches the JVP with vmap: the rule runs, on a basis of one.
    jac, collected = capture(jax.jacfwd(vmapped))(np.float32(0.5))
    assert_close(jac, -3.0 * np.sin(1.5))
    assert_collected(self, collected, {'h': (np.array([1.5], np.float32),)})

  def test_checkpoint(self):
    out, collected = capture(jax.checkpoint(vmapped))(X)
    assert_close(out, np.sin(2.0 * X))
    assert_collected(self, collected, {'h': (2.0 * X,)})

  def test_grad_with_custom_vjp_around(self):
    loss = lambda x: jnp.sum(vmapped_vjp(x))
    grad, collected = capture(jax.grad(loss))(X)
    assert_close(grad, 2.0 * np.cos(2.0 * X))
    assert_collected(self, collected, {'h': (2.0 * X,)})
    grad, collected = jax.jit(
        jax.grad(lambda x: capture(loss)(x), has_aux=True)
    )(X)
    assert_close(grad, 2.0 * np.cos(2.0 * X))
    assert_collected(self, collected, {'h': (2.0 * X,)})

  def test_reduced_name(self):
    out, collected = capture(vmapped_reduced)(X)
    assert_close(out, 2.0 * X)
    assert_collected(self, collected, {'total': np.sum(X)})

  def test_reduced_name_under_vmap_around_raises(self):
    with self.assertRaisesRegex(
        NotImplementedError, "sow 'total'.*custom_vmap.*capture\\(jax.vmap"
    ):
      jax.vmap(capture(vmapped_reduced))(X)

  def test_rule_sowing_other_names_under_vmap_around_raises(self):
    with self.assertRaisesRegex(
        NotImplementedError, "sow 'h'.*custom_vmap.*'not_h'"
    ):
      jax.vmap(capture(vmapped_other_name))(X)
    # Inside the capture, the rule's sow is collected as it ran.
    out, collected = capture(jax.vmap(vmapped_other_name))(X)
    assert_close(out, np.sin(2.0 * X))
    assert_collected(self, collected, {'not_h': (2.0 * X,)})

  def test_intervene(self):
    x = np.float32(0.5)
    assert_close(intervene(vmapped, {'h': (np.float32(1.5),)})(x), np.sin(1.5))
    assert_close(
        jax.jit(intervene(vmapped, {'h': lambda h: h + 1.0}))(x), np.sin(2.0)
    )
    # Batched inside intervene: the rule's sow is replaced.
    assert_close(intervene(jax.vmap(vmapped), {'h': (R,)})(X), np.cos(R))
    # Batched around it: a callable is applied to what the rule sows.
    out = jax.vmap(intervene(vmapped, {'h': lambda h: h + 1.0}))(X)
    assert_close(out, np.cos(3.0 * X + 1.0))
    with self.assertRaisesRegex(
        NotImplementedError, "intervene: sow 'h'.*custom_vmap.*callable"
    ):
      jax.vmap(intervene(vmapped, {'h': (np.float32(1.5),)}))(X)

  def test_capture_of_intervene(self):
    out, collected = capture(intervene(vmapped, {'h': (R,)}))(X)
    assert_close(out, np.sin(R))
    assert_collected(self, collected, {'h': (R,)})


# ----------------------------------------------------------------------------
# jax.experimental.jet: outside a capture a sow is the identity on the series.


def _jet_body(x):
  return jnp.sin(sow(2.0 * x, name='h')) * x


def _jet_body_plain(x):
  return jnp.sin(2.0 * x) * x


def _jet_reduced(x):
  sow(x * x, name='sq', reduce_fn=_add, init_fn=_zero)
  return jnp.exp(x)


class JetTest(parameterized.TestCase):

  def test_without_capture(self):
    x, series = np.float32(0.5), ((np.float32(1.0), np.float32(0.25)),)
    want = jet(_jet_body_plain, (x,), series)
    assert_close(jet(_jet_body, (x,), series), want)
    assert_close(jet(jax.jit(_jet_body), (x,), series), want)
    assert_close(jax.jit(lambda x: jet(_jet_body, (x,), series))(x), want)
    # By hand: f = sin(2x) x, f' = 2 cos(2x) x + sin(2x).
    d1 = 2.0 * np.cos(1.0) * 0.5 + np.sin(1.0)
    assert_close(want[1][0], d1)

  @parameterized.parameters(False, True)
  def test_capture_collects_the_primal(self, jit):
    x, series = np.float32(0.5), ((np.float32(1.0), np.float32(0.25)),)
    fn = capture(lambda x: jet(_jet_body, (x,), series))
    if jit:
      fn = jax.jit(fn)
    out, collected = fn(x)
    assert_close(out, jet(_jet_body_plain, (x,), series))
    assert_collected(self, collected, {'h': (np.float32(1.0),)})

  def test_reduced_and_vmap(self):
    series = ((np.float32(1.0),),)
    out, collected = capture(lambda x: jet(_jet_reduced, (x,), series))(
        np.float32(3.0)
    )
    assert_close(out, (np.exp(3.0), [np.exp(3.0)]))
    assert_collected(self, collected, {'sq': np.float32(9.0)})
    out, collected = capture(
        jax.vmap(lambda x: jet(_jet_body, (x,), ((jnp.ones(()),),)))
    )(X)
    assert_close(out[0], np.sin(2.0 * X) * X)
    assert_collected(self, collected, {'h': (2.0 * X,)})

  def test_perturb(self):
    def loss(x):
      return jnp.sum(perturb(2.0 * x, name='p') ** 2)

    def loss_plain(x):
      return jnp.sum((2.0 * x) ** 2)

    x, series = np.float32(1.5), ((np.float32(1.0),),)
    # perturb_tangent under jet: forward mode inside the jet.
    jvp = lambda f: lambda x: jax.jvp(f, (x,), (jnp.ones(()),))
    assert_close(
        jet(jvp(loss), (x,), series), jet(jvp(loss_plain), (x,), series)
    )
    # The backward pass under jet sows the cotangent 2 * (2x).
    out, collected = capture(lambda x: jet(jax.grad(loss), (x,), series))(x)
    assert_close(out, jet(jax.grad(loss_plain), (x,), series))
    assert_close(out[0], 8.0 * x)
    assert_collected(self, collected, {'p': (np.float32(6.0),)})


# ----------------------------------------------------------------------------
# jax.checking_leaks(): nothing the package keeps holds a tracer past its
# trace. Each program is run inside the leak checker and its values are
# compared with the same program written without sow.


def _programs():
  def plain(x, s):
    return jnp.sum(jnp.sin(s(2.0 * x, 'h')))

  def jitted(x, s):
    return jax.jit(lambda x: plain(x, s))(x)

  def scan(x, s):
    def step(c, xi):
      s(c * xi, 'h')
      return c + xi, None

    return jax.lax.scan(step, 0.5, x)[0]

  def cond(x, s):
    return jax.lax.cond(
        jnp.sum(x) > 0,
        lambda x: jnp.sum(s(x, 'h')),
        lambda x: jnp.sum(s(-x, 'h')),
        x,
    )

  def custom_jvp(x, s):
    @jax.custom_jvp
    def f(x):
      return jnp.sum(s(2.0 * x, 'h'))

    f.defjvp(lambda p, t: (f(p[0]), 2.0 * jnp.sum(t[0])))
    return f(x)

  def custom_vjp(x, s):
    @jax.custom_vjp
    def f(x):
      return jnp.sum(jnp.sin(s(2.0 * x, 'h')))

    f.defvjp(lambda x: (f(x), x), lambda x, g: (2.0 * jnp.cos(2.0 * x) * g,))
    return f(x)

  def remat_opt(x, s):
    @jax.custom_vjp
    def f(x):
      return jnp.sum(jnp.sin(s(2.0 * x, 'h')))

    f.defvjp(
        lambda x: (f(x), x),
        lambda x, g: (2.0 * jnp.cos(2.0 * x) * g,),
        optimize_remat=True,
    )
    return f(x)

  def checkpoint(x, s):
    return jax.checkpoint(lambda x: plain(x, s))(x)

  def vmap(x, s):
    return jnp.sum(jax.vmap(lambda r: s(2.0 * r, 'h'))(x))

  return dict(
      plain=plain,
      jitted=jitted,
      scan=scan,
      cond=cond,
      custom_jvp=custom_jvp,
      custom_vjp=custom_vjp,
      remat_opt=remat_opt,
      checkpoint=checkpoint,
      vmap=vmap,
  )


PROGRAMS = _programs()


def _with_sow(program):
  return lambda x: program(x, lambda v, name: sow(v, name=name))


def _without_sow(program, replace=None):
  def s(v, name):
    del name
    return v if replace is None else replace(v)

  return lambda x: program(x, s)


# Programs whose grad inside a capture cannot be checked: JAX's own partial
# evaluation of a scan with an effectful equation (any, e.g. a
# jax.debug.print) reports a leaked JaxprTrace under checking_leaks.
_JAX_LEAKS_UNDER_GRAD = ('scan',)


class CheckingLeaksTest(parameterized.TestCase):

  @parameterized.parameters(*itertools.product(PROGRAMS, ('eager', 'jit')))
  def test_capture(self, program, how):
    f = _with_sow(PROGRAMS[program])
    plain = _without_sow(PROGRAMS[program])
    fn = capture(f) if how == 'eager' else jax.jit(capture(f))
    with jax.checking_leaks():
      out, collected = fn(X)
    assert_close(out, plain(X))
    self.assertEqual(list(collected), ['h'])

  @parameterized.parameters(*PROGRAMS)
  def test_nested_capture_and_closure(self, program):
    f = _with_sow(PROGRAMS[program])
    plain = _without_sow(PROGRAMS[program])
    with jax.checking_leaks():
      (out, inner), outer = capture(lambda x: capture(f)(x))(X)
      closed = jax.jit(lambda c: capture(lambda y: f(y * c))(X))(
          jnp.float32(2.0)
      )
    assert_close(out, plain(X))
    self.assertEqual(list(inner), ['h'])
    self.assertEqual(dict(outer), {})
    assert_close(closed[0], plain(2.0 * X))

  @parameterized.parameters(*PROGRAMS)
  def test_grad(self, program):
    f = _with_sow(PROGRAMS[program])
    plain = _without_sow(PROGRAMS[program])
    with jax.checking_leaks():
      around = jax.jit(jax.grad(lambda x: capture(f)(x)[0]))(X)
      if program not in _JAX_LEAKS_UNDER_GRAD:
        inside, collected = capture(jax.grad(f))(X)
    assert_close(around, jax.grad(plain)(X))
    if program not in _JAX_LEAKS_UNDER_GRAD:
      assert_close(inside, jax.grad(plain)(X))
      self.assertEqual(list(collected), ['h'])

  @parameterized.parameters(*itertools.product(PROGRAMS, ('eager', 'jit')))
  def test_intervene(self, program, how):
    f = _with_sow(PROGRAMS[program])
    fn = lambda v: v + 1.0
    want = _without_sow(PROGRAMS[program], fn)(X)
    g = intervene(f, {'h': fn})
    if how == 'jit':
      g = jax.jit(g)
    with jax.checking_leaks():
      out = g(X)
    assert_close(out, want)

  @parameterized.parameters('plain', 'jitted', 'custom_jvp', 'custom_vjp')
  def test_intervene_arrays_and_grad(self, program):
    f = _with_sow(PROGRAMS[program])
    r = jnp.full((3,), 0.25, jnp.float32)
    with_r = _without_sow(PROGRAMS[program], lambda v: r)
    with jax.checking_leaks():
      out = jax.jit(lambda r: intervene(f, {'h': (r,)})(X))(r)
      grad = jax.grad(intervene(f, {'h': lambda v: v * 2.0}))(X)
    assert_close(out, with_r(X))
    assert_close(
        grad, jax.grad(_without_sow(PROGRAMS[program], lambda v: v * 2.0))(X)
    )


if __name__ == '__main__':
  absltest.main()
