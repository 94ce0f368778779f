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

"""What a capture collects, wherever a user can reach it.

Custom rules that never call the primal, linearized functions applied
several times, cotangents of several backward passes, one name with two
meanings, and an eager capture that runs ``f`` as ``f`` runs. Expected values
are computed by hand or by the same program written without ``sow``.
"""

import functools

from absl.testing import absltest
from absl.testing import parameterized
import jax
import jax.numpy as jnp
import numpy as np

from flax.nnx.sow import capture
from flax.nnx.sow import intervene
from flax.nnx.sow import perturb
from flax.nnx.sow import sow

X = np.array([0.5, -1.0, 2.0], np.float32)


def add(a, b):
  return a + b


def zero_count():
  return jnp.int32(0)


def count_step():
  sow(jnp.int32(1), name='steps', reduce_fn=add, init_fn=zero_count)


# ----------------------------------------------------------------------------
# custom rules that do not call the primal function


@jax.custom_jvp
def sin_jvp(x):
  return sow(jnp.sin(x), name='p')


# The rule computes the primal output itself: the body above never runs.
sin_jvp.defjvp(lambda p, t: (jnp.sin(p[0]), jnp.cos(p[0]) * t[0]))


@jax.custom_jvp
def sin_jvp_calls(x):
  return sow(jnp.sin(x), name='p')


# The usual form: the rule calls the primal function.
sin_jvp_calls.defjvp(lambda p, t: (sin_jvp_calls(p[0]), jnp.cos(p[0]) * t[0]))


@jax.custom_vjp
def sin_vjp(x):
  return sow(jnp.sin(x), name='p')


def _sin_fwd(x):
  return jnp.sin(x), x  # does not call sin_vjp


sin_vjp.defvjp(_sin_fwd, lambda x, g: (jnp.cos(x) * g,))


@jax.custom_vjp
def sin_vjp_own(x):
  return sow(jnp.sin(x), name='p')


def _sin_fwd_own(x):
  # The fwd rule's own sow is collected beside the primal body's.
  sow(x * 3.0, name='q')
  return sin_vjp_own(x), x


sin_vjp_own.defvjp(_sin_fwd_own, lambda x, g: (jnp.cos(x) * g,))

CUSTOM = [
    ('jvp_skips_primal', sin_jvp),
    ('jvp_calls_primal', sin_jvp_calls),
    ('vjp_skips_primal', sin_vjp),
]


def _loss(fn):
  return lambda x: jnp.sum(fn(x) * 2.0)


def _differentiated(name, fn):
  loss = _loss(fn)
  return {
      'grad': jax.grad(loss),
      'value_and_grad': lambda x: jax.value_and_grad(loss)(x)[1],
      'jvp': lambda x: jax.jvp(loss, (x,), (jnp.ones_like(x),))[1],
      'linearize': lambda x: jax.linearize(loss, x)[1](x),
      'vjp': lambda x: jax.vjp(loss, x)[1](1.0)[0],
      'grad_of_jit': jax.grad(jax.jit(loss)),
      'grad_of_checkpoint': jax.grad(jax.checkpoint(loss)),
      'grad_of_checkpoint_dots': jax.grad(
          jax.checkpoint(loss, policy=jax.checkpoint_policies.dots_saveable)
      ),
      'hessian_diag': lambda x: jnp.diag(jax.hessian(loss)(x)),
  }[name]


def _skips(custom):
  """Whether the rule of ``CUSTOM``'s ``custom`` does not call the body: JAX
  runs the rule, not the body, under differentiation, so the body's sows do
  not run there (a missing name, documented in docs/how_it_works.md)."""
  return custom.endswith('skips_primal')


class CustomRuleSkipsPrimalTest(parameterized.TestCase):
  """``capture(T(f))`` collects the primal body's sows once where the rule
  calls the body, and misses them (never a wrong value) where it does not."""

  @parameterized.parameters(
      (custom, transform, jit)
      for custom, _ in CUSTOM
      for transform in (
          'grad',
          'value_and_grad',
          'jvp',
          'linearize',
          'vjp',
          'grad_of_jit',
          'grad_of_checkpoint',
          'grad_of_checkpoint_dots',
      )
      # JAX has no forward mode (jvp, linearize) for custom_vjp.
      if not (
          custom == 'vjp_skips_primal' and transform in ('jvp', 'linearize')
      )
      for jit in (False, True)
  )
  def test_primal_sows_collected_once(self, custom, transform, jit):
    fn = dict(CUSTOM)[custom]
    g = _differentiated(transform, fn)
    run = jax.jit(capture(g)) if jit else capture(g)
    out, collected = run(X)
    if _skips(custom):
      self.assertEqual(list(collected), [])  # the body does not run
    else:
      self.assertEqual(list(collected), ['p'])
      self.assertLen(collected['p'], 1)
      np.testing.assert_allclose(collected['p'][0], np.sin(X), rtol=1e-6)
    # The custom rule still gives the derivative: d/dx sum(2 sin x).
    expected = 2.0 * np.cos(X)
    if transform == 'jvp':
      expected = np.sum(expected)
    elif transform == 'linearize':
      expected = np.sum(expected * X)
    np.testing.assert_allclose(out, expected, rtol=1e-5)

  @parameterized.parameters(c for c, _ in CUSTOM)
  def test_hessian(self, custom):
    # jax.hessian is jacfwd(jacrev): vmapped, so the primal carries the
    # basis axis (SPEC, vmap row); every row is sin(x).
    fn = dict(CUSTOM)[custom]
    out, collected = capture(_differentiated('hessian_diag', fn))(X)
    np.testing.assert_allclose(out, -2.0 * np.sin(X), rtol=1e-5, atol=1e-6)
    if _skips(custom):
      self.assertNotIn('p', collected)  # the body does not run
      return
    (p,) = collected['p']
    np.testing.assert_allclose(p, np.broadcast_to(np.sin(X), (3, 3)), 1e-6)

  def test_fwd_rule_sows_are_kept(self):
    out, collected = capture(jax.grad(_loss(sin_vjp_own)))(X)
    np.testing.assert_allclose(out, 2.0 * np.cos(X), rtol=1e-6)
    self.assertEqual(sorted(collected, key=str), ['p', 'q'])
    np.testing.assert_allclose(collected['p'][0], np.sin(X), rtol=1e-6)
    np.testing.assert_allclose(collected['q'][0], 3.0 * X, rtol=1e-6)
    self.assertLen(collected['p'], 1)

  def test_reduced_sow_in_custom_body_counted_once(self):
    @jax.custom_jvp
    def f(x):
      count_step()
      return jnp.sin(x)

    f.defjvp(lambda p, t: (f(p[0]), jnp.cos(p[0]) * t[0]))

    def loss(x):
      return jnp.sum(f(x)) + jnp.sum(f(2.0 * x))

    for g in (loss, jax.grad(loss), jax.jit(jax.grad(loss))):
      _, collected = capture(g)(X)
      self.assertEqual(int(collected['steps']), 2)

  @parameterized.parameters(False, True)
  def test_closure_over_enclosing_jit_tracer(self, calls_body):
    @jax.jit
    def step(x, w):
      @jax.custom_jvp
      def f(y):
        return sow(jnp.sin(y) * w, name='p')  # closes over the jit's w

      if calls_body:
        f.defjvp(lambda p, t: (f(p[0]), jnp.cos(p[0]) * w * t[0]))
      else:
        f.defjvp(lambda p, t: (jnp.sin(p[0]) * w, jnp.cos(p[0]) * w * t[0]))
      return capture(jax.grad(lambda y: jnp.sum(f(y))))(x)

    out, collected = step(X, 3.0)
    np.testing.assert_allclose(out, 3.0 * np.cos(X), rtol=1e-6)
    if not calls_body:
      self.assertNotIn('p', collected)  # the body does not run
      return
    np.testing.assert_allclose(collected['p'][0], 3.0 * np.sin(X), rtol=1e-6)

  @parameterized.parameters(c for c, _ in CUSTOM)
  def test_vmap_of_grad(self, custom):
    xs = np.stack([X, 2.0 * X])
    fn = dict(CUSTOM)[custom]
    out, collected = capture(jax.vmap(jax.grad(_loss(fn))))(xs)
    np.testing.assert_allclose(out, 2.0 * np.cos(xs), rtol=1e-5)
    if _skips(custom):
      self.assertNotIn('p', collected)  # the body does not run
      return
    np.testing.assert_allclose(collected['p'][0], np.sin(xs), rtol=1e-6)

  def test_no_sow_custom_call_unchanged(self):
    # jax.nn.relu's rule gives 0 at 0, and a straight-through estimator
    # keeps its gradient, inside a differentiated capture too.
    @jax.custom_jvp
    def ste(x):
      return jnp.round(x)

    ste.defjvp(lambda p, t: (ste(p[0]), t[0]))

    def loss(x):
      sow(x, name='x')
      return jnp.sum(jax.nn.relu(x) + ste(x))

    x = np.array([0.0, 1.4, -2.0], np.float32)
    out, collected = capture(jax.grad(loss))(x)
    np.testing.assert_allclose(out, [1.0, 2.0, 1.0])
    np.testing.assert_allclose(collected['x'][0], x)


# ----------------------------------------------------------------------------
# custom calls in loops, under differentiation: a call evaluated only for its
# sows (its outputs unused), and a call on loop-invariant values


def assert_collected(test, collected, expected):
  """``collected`` has exactly ``expected``'s names, in order, and values
  (same number of entries, shapes and values)."""
  test.assertEqual(list(collected), list(expected))
  for name, value in expected.items():
    got = collected[name]
    if isinstance(value, tuple):
      test.assertIsInstance(got, tuple, msg=repr(name))
      test.assertLen(got, len(value), msg=repr(name))
    else:
      got, value = (got,), (value,)
    for a, e in zip(got, value):
      test.assertEqual(np.shape(a), np.shape(e), msg=repr(name))
      np.testing.assert_allclose(a, e, rtol=1e-6, atol=1e-6)


def zero_total():
  return jnp.float32(0.0)


def _sowing(name):
  return lambda v: sow(v, name=name)


def _plain(name):
  del name
  return lambda v: v


def _inner_call(kind, mark):
  """``2 x`` with a sow of it, as a custom call whose rule calls it."""
  if kind == 'vjp':

    @jax.custom_vjp
    def inner(x):
      return mark('c')(x * 2.0)

    inner.defvjp(lambda x: (inner(x), None), lambda _, g: (2.0 * g,))
  elif kind == 'vjp_remat':

    @jax.custom_vjp
    def inner(x):
      return mark('c')(x * 2.0)

    inner.defvjp(
        lambda x: (inner(x), None),
        lambda _, g: (2.0 * g,),
        optimize_remat=True,
    )
  else:

    @jax.custom_jvp
    def inner(x):
      return mark('c')(x * 2.0)

    inner.defjvp(lambda p, t: (inner(p[0]), 2.0 * t[0]))
  return inner


def _outer_call(kind, inner):
  """``2 x + 1`` through ``inner``, as a custom call whose rule does not
  call it (``'none'``: no custom call, ``inner``'s result unused)."""
  if kind == 'jvp':

    @jax.custom_jvp
    def outer(x):
      return inner(x) + 1.0

    outer.defjvp(lambda p, t: (p[0] * 2.0 + 1.0, 2.0 * t[0]))
  elif kind == 'vjp':

    @jax.custom_vjp
    def outer(x):
      return inner(x) + 1.0

    outer.defvjp(lambda x: (x * 2.0 + 1.0, None), lambda _, g: (2.0 * g,))
  elif kind == 'jvp_jvp':
    # A rule that does not call its primal around another one.
    middle = _outer_call('jvp', inner)

    @jax.custom_jvp
    def outer(x):
      return middle(x)

    outer.defjvp(lambda p, t: (p[0] * 2.0 + 1.0, 2.0 * t[0]))
  else:

    def outer(x):
      inner(x)  # for its sow only
      return x * 2.0 + 1.0

  return outer


STEPS = 3


def _stepped(x, steps=STEPS):
  """The carries ``c_k`` of ``c -> 2 c + 1`` from ``x``, stacked."""
  cs = [np.asarray(x, np.float32)]
  for _ in range(steps - 1):
    cs.append(2.0 * cs[-1] + 1.0)
  return np.stack(cs)


def _loop(loop, step):
  if loop == 'scan':
    return lambda x: jax.lax.scan(
        lambda c, _: (step(c), None), x, None, length=STEPS
    )[0]

  # nested: STEPS outer iterations of one inner iteration each.
  def outer_body(c, _):
    return jax.lax.scan(lambda d, _: (step(d), None), c, None, length=1)[0]

  return lambda x: jax.lax.scan(
      lambda c, _: (outer_body(c, None), None), x, None, length=STEPS
  )[0]


def _transformed(transform, f):
  loss = lambda x: jnp.sum(f(x) * 3.0)
  return {
      'grad': jax.grad(loss),
      'jit_grad': jax.jit(jax.grad(loss)),
      'value_and_grad': lambda x: jax.value_and_grad(loss)(x)[1],
      'linearize': lambda x: jax.linearize(loss, x)[1](x),
      'grad_of_checkpoint': jax.grad(jax.checkpoint(loss)),
      'grad_of_checkpoint_dots': jax.grad(
          jax.checkpoint(loss, policy=jax.checkpoint_policies.dots_saveable)
      ),
  }[transform]


TRANSFORMS = (
    'grad',
    'jit_grad',
    'value_and_grad',
    'linearize',
    'grad_of_checkpoint',
    'grad_of_checkpoint_dots',
)


FEW_TRANSFORMS = ('grad', 'linearize', 'grad_of_checkpoint')


class CustomCallsInLoopsTest(parameterized.TestCase):
  """A sow in a custom call inside a scan is collected under
  differentiation once per iteration: also when the call runs only for its
  sows (its result unused). Inside an outer rule that does not call the
  primal, JAX does not run it (a missing name, never a wrong value); a call
  whose inputs do not change in the loop, which JAX computes once outside
  the loop, raises."""

  @parameterized.parameters(
      (outer, inner, transform)
      for outer in ('jvp', 'vjp', 'jvp_jvp', 'none')
      for inner in ('vjp', 'jvp', 'vjp_remat')
      for transform in (TRANSFORMS if inner == 'vjp' else FEW_TRANSFORMS)
      # JAX has no forward mode (linearize) for custom_vjp.
      if not (transform == 'linearize' and 'vjp' in (outer, inner[:3]))
  )
  def test_call_run_for_its_sows(self, outer, inner, transform):
    def build(mark):
      return _loop('scan', _outer_call(outer, _inner_call(inner, mark)))

    g = _transformed(transform, build(_sowing))
    out, collected = capture(g)(X)
    if outer == 'none':
      assert_collected(self, collected, {'c': (2.0 * _stepped(X),)})
    else:  # the outer rule does not call the body: inner never runs
      assert_collected(self, collected, {})
    # d/dx sum(3 c_STEPS), c_STEPS = 2^STEPS x + 2^STEPS - 1.
    expected = np.full_like(X, 3.0 * 2.0**STEPS)
    if transform == 'linearize':
      expected = np.sum(expected * X)
    np.testing.assert_allclose(out, expected, rtol=1e-6)
    np.testing.assert_allclose(
        out, _transformed(transform, build(_plain))(X), rtol=1e-6
    )

  @parameterized.parameters(
      (outer, inner, transform)
      for outer, inner in (('jvp', 'vjp'), ('vjp', 'vjp'), ('none', 'vjp'))
      for transform in ('grad', 'jit_grad', 'linearize')
      if not (transform == 'linearize' and 'vjp' == outer)
  )
  def test_nested_scans(self, outer, inner, transform):
    f = _loop('nested', _outer_call(outer, _inner_call(inner, _sowing)))
    out, collected = capture(_transformed(transform, f))(X)
    if outer == 'none':
      # (outer iteration, inner iteration, ...)
      assert_collected(self, collected, {'c': (2.0 * _stepped(X)[:, None],)})
    else:  # the outer rule does not call the body: inner never runs
      assert_collected(self, collected, {})
    expected = np.full_like(X, 3.0 * 2.0**STEPS)
    if transform == 'linearize':
      expected = np.sum(expected * X)
    np.testing.assert_allclose(out, expected, rtol=1e-6)

  def test_while_loop_reduced(self):
    # A reduced sow in a custom_vjp inside a rule that does not call the
    # primal, in a while_loop, under forward-mode differentiation: the rule
    # runs, not the body, so nothing is folded (a missing name); the
    # derivative is the rule's.
    @jax.custom_vjp
    def inner(x):
      sow(jnp.sum(x * 2.0), name='total', reduce_fn=add, init_fn=zero_total)
      return x * 2.0

    inner.defvjp(lambda x: (inner(x), None), lambda _, g: (2.0 * g,))
    outer = _outer_call('jvp', inner)

    def f(x):
      return jax.lax.while_loop(
          lambda c: c[0] < STEPS, lambda c: (c[0] + 1, outer(c[1])), (0, x)
      )[1]

    cs = _stepped(X)
    for g in (
        lambda x: jax.linearize(f, x)[1](x),
        lambda x: jax.jvp(f, (x,), (x,))[1],
    ):
      out, collected = capture(g)(X)
      assert_collected(self, collected, {})
      np.testing.assert_allclose(out, 2.0**STEPS * X, rtol=1e-6)
    # Without differentiation the body runs: folded once per iteration.
    _, collected = capture(f)(X)
    assert_collected(self, collected, {'total': np.sum(2.0 * cs)})

  @parameterized.parameters(
      (call, transform)
      for call in ('vjp', 'jvp', 'vjp_remat', 'cond', 'jvp_in_jit')
      for transform in (TRANSFORMS if call == 'vjp' else FEW_TRANSFORMS)
      if not (transform == 'linearize' and call.startswith('vjp'))
  )
  def test_loop_invariant_call(self, call, transform):
    # The call reads only a value the loop does not change: JAX computes it
    # once, outside the loop; its sow still gives one value per iteration.
    def build(mark):
      if call == 'cond':
        inner = lambda w: jax.lax.cond(
            jnp.sum(w) > 0,
            lambda v: mark('c')(v * 2.0),
            lambda v: mark('c')(v * 2.0),
            w,
        )
      elif call == 'jvp_in_jit':
        inner = jax.jit(_inner_call('jvp', mark))
      else:
        inner = _inner_call(call, mark)

      def f(x):
        w = x * 5.0
        return jax.lax.scan(
            lambda c, _: (c * 2.0 + inner(w), None), x, None, length=STEPS
        )[0]

      return f

    g = _transformed(transform, build(_sowing))
    if call in ('vjp', 'jvp', 'jvp_in_jit'):
      # JAX computes a custom_jvp/custom_vjp call on loop-invariant values
      # once, outside the loop: its sow would give one value, not one per
      # iteration, so it raises.
      with self.assertRaisesRegex(
          NotImplementedError,
          r"sow 'c'.*`jax.custom_jvp` or `jax.custom_vjp`.*`lax.scan`.*"
          r'one value where the capture collects one per iteration',
      ):
        capture(g)(X)
      return
    out, collected = capture(g)(X)
    assert_collected(self, collected, {'c': (np.stack([10.0 * X] * STEPS),)})
    # c_STEPS = 8 x + (4 + 2 + 1) 10 x
    expected = np.full_like(X, 3.0 * (8.0 + 70.0))
    if transform == 'linearize':
      expected = np.sum(expected * X)
    np.testing.assert_allclose(out, expected, rtol=1e-5)

  def test_loop_invariant_call_second_order(self):
    # The custom rule of a loop-invariant call still gives the derivatives
    # of the differentiated program (d/dw of the rule's 5 w t is 5).
    def build(mark):
      @jax.custom_jvp
      def g(w):
        return jnp.sin(mark('c')(w))

      g.defjvp(lambda p, t: (g(p[0]), 5.0 * p[0] * t[0]))

      def f(x):
        return jax.lax.scan(
            lambda c, _: (c * 0.5 + g(x), None), x, None, length=STEPS
        )[0]

      return f

    x = np.float32(0.7)
    # The call reads only x, which the loop does not change: JAX computes it
    # once, outside the loop, so its sow raises rather than give one value.
    with self.assertRaisesRegex(
        NotImplementedError, r"sow 'c'.*one per iteration"
    ):
      capture(jax.grad(jax.grad(build(_sowing))))(x)
    # Outside a capture the rule still gives the derivatives.
    # f(x) = x / 8 + (1 + 1/2 + 1/4) g(x); g'' = 5 by the rule.
    out = jax.grad(jax.grad(build(_sowing)))(x)
    np.testing.assert_allclose(out, 1.75 * 5.0, rtol=1e-5)
    np.testing.assert_allclose(out, jax.grad(jax.grad(build(_plain)))(x))


# ----------------------------------------------------------------------------
# linearized functions applied several times


def _while_counting(x):
  def body(c):
    i, y = c
    count_step()
    return i + 1, jnp.sin(y)

  return jax.lax.while_loop(lambda c: c[0] < 3, body, (0, x))[1]


def _scan_sowing(x):
  def body(c, _):
    count_step()
    sow(c, name='c')
    return jnp.sin(c), None

  return jax.lax.scan(body, x, None, length=3)[0]


def _cond_sowing(x):
  def yes(y):
    count_step()
    sow(y, name='c')
    return jnp.sin(y)

  def no(y):
    count_step()
    sow(2.0 * y, name='c')
    return jnp.cos(y)

  return jax.lax.cond(jnp.sum(x) > 0, yes, no, x)


def _jit_sowing(x):
  @jax.jit
  def g(y):
    count_step()
    sow(y, name='c')
    return jnp.sin(y)

  return g(g(x))


PROGRAMS = {
    'while': (_while_counting, 3, 0),
    'scan': (_scan_sowing, 3, 1),
    'cond': (_cond_sowing, 1, 1),
    'jit': (_jit_sowing, 2, 2),
    'remat_jit': (jax.checkpoint(_jit_sowing), 2, 2),
}


def _applied(how, f):
  if how == 'linearize_once':
    return lambda x: jax.linearize(f, x)[1](x)
  if how == 'linearize_twice':
    return lambda x: (lambda lin: lin(x) + lin(2.0 * x))(jax.linearize(f, x)[1])
  if how == 'jvp':
    return lambda x: jax.jvp(f, (x,), (x,))[1]
  if how == 'vjp_twice':
    return lambda x: (lambda y, pb: pb(y)[0] + pb(2.0 * y)[0])(*jax.vjp(f, x))
  if how == 'transpose_twice':

    def g(x):
      lin = jax.linearize(f, x)[1]
      t = jax.linear_transpose(lin, x)
      return t(x)[0] + t(2.0 * x)[0]

    return g
  raise ValueError(how)


class UnusedCheckpointTest(parameterized.TestCase):
  """A ``jax.checkpoint`` whose inputs and outputs are unused, holding a sow
  of a constant (a documented limit, *Limitations* in
  ``docs/how_it_works.md``). Inside another ``checkpoint`` under ``grad``,
  JAX's dead-code elimination drops such a checkpoint even though its body
  has effects, and the sow with it: the name is missing, never a wrong
  value or a crash. Elsewhere (no enclosing ``checkpoint``, no
  differentiation) it is collected once. The gradient is JAX's either
  way."""

  @staticmethod
  def _loss(x, reduced=False):
    def inner(x):
      if reduced:
        sow(
            1.5,
            name='c',
            reduce_fn=lambda a, b: a + 2.0 * b,
            init_fn=lambda: 0.0,
        )
      else:
        sow(jnp.float32(1.5), name='c')
      return x

    jax.checkpoint(inner)(x)  # its output is unused
    return jnp.sum(jnp.sin(x))

  @parameterized.named_parameters(
      ('grad_of_checkpoint', lambda f: jax.grad(jax.checkpoint(f))),
      (
          'grad_of_checkpoint_nothing',
          lambda f: jax.grad(
              jax.checkpoint(f, policy=jax.checkpoint_policies.nothing_saveable)
          ),
      ),
      (
          'jit_grad_of_checkpoint',
          lambda f: jax.jit(jax.grad(jax.checkpoint(f))),
      ),
      (
          'vmap_grad_of_checkpoint',
          lambda f: jax.vmap(jax.grad(jax.checkpoint(f))),
      ),
      (
          'value_and_grad_of_checkpoint',
          lambda f: lambda x: jax.value_and_grad(jax.checkpoint(f))(x)[1],
      ),
  )
  def test_dropped_with_the_checkpoint(self, transform):
    x = jnp.asarray(X)
    expected_grad = np.cos(X)  # d/dx sum(sin(x))
    if 'vmap' in self._testMethodName:
      x, expected_grad = jnp.stack([x, -x]), np.stack([np.cos(X), np.cos(X)])
    for reduced in (False, True):
      loss = functools.partial(self._loss, reduced=reduced)
      grad, collected = capture(transform(loss))(x)
      np.testing.assert_allclose(grad, expected_grad, rtol=1e-6)
      self.assertEqual(dict(collected), {})  # 'c' is missing

  @parameterized.named_parameters(
      ('eager', lambda f: f),
      ('jit', jax.jit),
      ('checkpoint', jax.checkpoint),
      ('grad', jax.grad),
      ('jit_grad', lambda f: jax.jit(jax.grad(f))),
  )
  def test_collected_once_elsewhere(self, transform):
    for reduced, want in ((False, (1.5,)), (True, 3.0)):  # 0 + 2 * 1.5
      loss = functools.partial(self._loss, reduced=reduced)
      _, collected = capture(transform(loss))(jnp.asarray(X))
      self.assertEqual(list(collected), ['c'])
      np.testing.assert_allclose(
          np.asarray(collected['c'], np.float32), np.asarray(want, np.float32)
      )

  def test_a_sow_that_reads_an_input_is_kept(self):
    # The drop needs a body that reads none of the checkpoint's inputs.
    def loss(x):
      jax.checkpoint(lambda x: sow(2.0 * x, name='c'))(x)
      return jnp.sum(jnp.sin(x))

    grad, collected = capture(jax.grad(jax.checkpoint(loss)))(jnp.asarray(X))
    np.testing.assert_allclose(grad, np.cos(X), rtol=1e-6)
    self.assertEqual(list(collected), ['c'])
    np.testing.assert_allclose(collected['c'][0], 2.0 * X, rtol=1e-6)

  def test_a_checkpoint_whose_output_is_used_is_kept(self):
    def loss(x):
      def inner(x):
        sow(jnp.float32(1.5), name='c')
        return x

      return jnp.sum(jnp.sin(jax.checkpoint(inner)(x)))

    grad, collected = capture(jax.grad(jax.checkpoint(loss)))(jnp.asarray(X))
    np.testing.assert_allclose(grad, np.cos(X), rtol=1e-6)
    self.assertEqual(list(collected), ['c'])
    np.testing.assert_allclose(collected['c'][0], 1.5)

  def test_a_name_also_sown_elsewhere_keeps_the_other_sows(self):
    # Documented: the dropped sow's entry (or its fold) is missing, the
    # others stay.
    def loss(x, reduced):
      def sow_c(v):
        if reduced:
          sow(
              v,
              name='c',
              reduce_fn=lambda a, b: a + 2.0 * b,
              init_fn=lambda: 0.0,
          )
        else:
          sow(jnp.float32(v), name='c')

      def inner(x):
        sow_c(1.5)
        return x

      sow_c(0.25)
      jax.checkpoint(inner)(x)  # its output is unused
      return jnp.sum(jnp.sin(x))

    # reduced: 2 * 0.25, and + 2 * 1.5 where the checkpoint's sow runs
    for reduced, full, kept in (
        (False, (0.25, 1.5), (0.25,)),
        (True, 3.5, 0.5),
    ):
      f = functools.partial(loss, reduced=reduced)
      _, collected = capture(f)(jnp.asarray(X))
      np.testing.assert_allclose(
          np.asarray(collected['c'], np.float32), np.asarray(full, np.float32)
      )
      _, collected = capture(jax.grad(jax.checkpoint(f)))(jnp.asarray(X))
      np.testing.assert_allclose(
          np.asarray(collected['c'], np.float32), np.asarray(kept, np.float32)
      )

  def test_in_a_custom_vjp_whose_fwd_skips_the_primal(self):
    @jax.custom_vjp
    def fn(x):
      jax.checkpoint(
          lambda x: sow(1.5, name='s', reduce_fn=add, init_fn=lambda: 0.0)
      )(x)
      return x

    fn.defvjp(lambda x: (x, None), lambda _, g: (2.0 * g,))
    loss = lambda x: jnp.sum(fn(x))
    # Differentiated, JAX runs fwd, which does not call fn: its body's sow
    # does not run (a missing name, docs/how_it_works.md); inside another
    # checkpoint it would be dropped with it anyway (the limit above).
    _, collected = capture(loss)(jnp.asarray(X))
    self.assertEqual(dict(collected), {'s': 1.5})  # not differentiated
    for transform, expected in (
        (jax.grad, {}),
        (lambda f: jax.grad(jax.checkpoint(f)), {}),
    ):
      grad, collected = capture(transform(loss))(jnp.asarray(X))
      np.testing.assert_allclose(grad, 2.0 * np.ones(3), rtol=1e-6)
      self.assertEqual(dict(collected), expected)


class PerturbInWhileLoopTest(parameterized.TestCase):
  """A ``perturb`` in a ``while_loop`` body: reverse mode cannot
  differentiate the loop, so nothing is ever collected for it (SPEC: not
  differentiated, nothing is collected); it is not a plain sow to refuse.
  Differentiated inside the body (a ``grad`` there), its cotangents cannot
  be stacked: a ``ValueError`` naming the perturb and the loop says what to
  do instead."""

  @staticmethod
  def _loop(x):
    def body(v):
      v = perturb(v * 2.0, name='p')
      sow(jnp.int32(1), name='n', reduce_fn=add, init_fn=zero_count)
      return v

    return jax.lax.while_loop(lambda v: v < 10.0, body, x)

  @parameterized.named_parameters(
      ('eager', lambda f: f),
      ('jit', jax.jit),
      ('jvp', lambda f: lambda x: jax.jvp(f, (x,), (x,))[0]),
  )
  def test_collects_nothing_for_the_perturb(self, transform):
    out, collected = capture(transform(self._loop))(jnp.float32(1.0))
    np.testing.assert_allclose(out, 16.0)  # 1 -> 2 -> 4 -> 8 -> 16
    self.assertEqual(list(collected), ['n'])
    np.testing.assert_array_equal(collected['n'], 4)

  def test_under_vmap_inside_the_capture(self):
    loop = lambda x: jax.lax.while_loop(
        lambda v: v < 10.0, lambda v: perturb(v * 2.0, name='p'), x
    )
    out, collected = capture(jax.vmap(loop))(jnp.array([1.0, 3.0]))
    np.testing.assert_allclose(out, [16.0, 12.0])  # 3 -> 6 -> 12
    self.assertEqual(dict(collected), {})

  @staticmethod
  def _grad_in_body(x, bounds='while'):
    # The perturb is differentiated inside the body: its cotangent would be
    # one entry per iteration, and the number of iterations is unknown.
    def step(v):  # v + d/du (2 u)^2 / 4 = 3 v
      return v + jax.grad(lambda u: perturb(u * 2.0, name='dp') ** 2 / 4.0)(v)

    if bounds == 'fori':  # traced bounds: a while_loop
      n = jnp.int32(3) + 0 * x.astype(jnp.int32)
      return jax.lax.fori_loop(0, n, lambda i, v: step(v), x)
    return jax.lax.while_loop(lambda v: v < 10.0, step, x)

  @parameterized.named_parameters(
      ('while_eager', 'while', lambda f: f),
      ('while_jit', 'while', jax.jit),
      ('fori_traced_bounds_jit', 'fori', jax.jit),  # eagerly they are static
      ('while_vmap', 'while', jax.vmap),
  )
  def test_differentiated_in_the_body_raises(self, bounds, transform):
    f = transform(lambda x: self._grad_in_body(x, bounds))
    x = jnp.array([1.0, 2.0]) if transform is jax.vmap else jnp.float32(1.0)
    with self.assertRaisesRegex(
        ValueError,
        r"(?s)perturb 'dp'.*differentiated inside the body of"
        r' `lax.while_loop`.*Use `lax.scan` or a `fori_loop` with static'
        r' bounds.*or call perturb outside the loop',
    ):
      capture(f)(x)

  def test_differentiated_in_the_body_without_a_capture(self):
    # Without a capture nothing is collected, nothing raises: 1, 3, 9, 27.
    np.testing.assert_allclose(self._grad_in_body(jnp.float32(1.0)), 27.0)
    np.testing.assert_allclose(
        jax.jit(self._grad_in_body)(jnp.float32(1.0)), 27.0
    )

  def test_static_fori_loop_collects_the_cotangents(self):
    # The advice of the error: a fori_loop with static bounds stacks them.
    def f(x):
      step = lambda i, v: v + jax.grad(
          lambda u: perturb(u * 2.0, name='dp') ** 2 / 4.0
      )(v)
      return jax.lax.fori_loop(0, 3, step, x)

    out, collected = capture(f)(jnp.float32(1.0))
    np.testing.assert_allclose(out, 27.0)
    self.assertEqual(list(collected), ['dp'])
    # d (h^2 / 4) / dh = h / 2 = v, at v = 1, 3, 9.
    np.testing.assert_allclose(collected['dp'][0], [1.0, 3.0, 9.0])


class LoopInvariantCondTest(parameterized.TestCase):
  """A ``cond`` in a ``scan`` body whose branches return their operand: the
  carry is loop-invariant, so scan's partial evaluation (``grad``,
  ``linearize``) hoists the ``cond``; its sows must still run once per
  iteration (found by an adversarial differential run)."""

  @staticmethod
  def _scan(x, reduced, switch):
    def sows(v):
      if reduced:
        sow(v[0], name='r', reduce_fn=add, init_fn=lambda: jnp.float32(0.0))
      else:
        sow(v[0], name='r')
      return v

    # Every branch sows a plain name (capture returns the taken branch's);
    # a reduced name is sown in one branch only.
    other = (lambda v: v) if reduced else sows

    def step(c, _):
      if switch:
        return jax.lax.switch(0, [sows, other, sows], c), None
      return jax.lax.cond(c[0] > 0, sows, other, c), None

    return jax.lax.scan(step, x, None, length=3)[0]

  @parameterized.product(
      transform=['grad', 'jit_grad', 'linearize', 'value_and_grad'],
      reduced=[False, True],
      switch=[False, True],
  )
  def test_sows_run_every_iteration(self, transform, reduced, switch):
    f = functools.partial(self._scan, reduced=reduced, switch=switch)
    loss = lambda x: jnp.sum(f(x) * 2.0)
    t = {
        'grad': jax.grad(loss),
        'jit_grad': jax.jit(jax.grad(loss)),
        'linearize': lambda x: jax.linearize(loss, x)[1](x),
        'value_and_grad': lambda x: jax.value_and_grad(loss)(x)[1],
    }[transform]
    x = jnp.array([1.0, 2.0])
    _, collected = capture(t)(x)
    self.assertEqual(list(collected), ['r'])
    # x[0] = 1 is sown at each of the 3 steps.
    want = 3.0 if reduced else (np.ones(3, np.float32),)
    np.testing.assert_allclose(
        np.asarray(collected['r'], np.float32), np.asarray(want, np.float32)
    )


class LinearizedFunctionTest(parameterized.TestCase):
  """Applying a linear map (or its transpose) adds no primal entries."""

  @parameterized.parameters(
      (program, how, jit)
      for program in PROGRAMS
      for how in (
          'linearize_once',
          'linearize_twice',
          'jvp',
          'vjp_twice',
          'transpose_twice',
      )
      # JAX cannot reverse-differentiate a while_loop.
      if not (program == 'while' and how in ('vjp_twice', 'transpose_twice'))
      for jit in (False, True)
  )
  def test_primal_entries_once(self, program, how, jit):
    f, steps, n_plain = PROGRAMS[program]
    g = _applied(how, f)
    run = jax.jit(capture(g)) if jit else capture(g)
    _, collected = run(X)
    self.assertEqual(int(collected['steps']), steps)
    if n_plain:
      self.assertLen(collected['c'], n_plain)
      _, plain = capture(f)(X)
      for got, want in zip(collected['c'], plain['c']):
        np.testing.assert_allclose(got, want, rtol=1e-6)

  def test_jvp_in_a_while_body_linearized_collects_once(self):
    # A jax.jvp inside the body of a loop jax.linearize splits (found by a
    # fresh review of an attempt to refuse split loops, which counted this
    # one twice). The carry runs 1, 2, 3.5, 5.75, 9.125 (c -> 1.5 c + 0.5).
    def f(x):
      def body(c):
        d = jax.jvp(
            lambda c: sow(c**2, name='sq', reduce_fn=add, init_fn=zero_total),
            (c,),
            (1.0,),
        )[1]
        return c + 0.25 * d + 0.5

      return jax.lax.while_loop(lambda c: c < 10.0, body, x)

    want = sum(c**2 for c in (1.0, 2.0, 3.5, 5.75, 9.125))
    for times in (0, 1, 2):

      def g(x):
        lin = jax.linearize(f, x)[1]
        return [lin(1.0) for _ in range(times)]

      _, collected = capture(g)(1.0)
      np.testing.assert_allclose(collected['sq'], want, rtol=1e-6)

  def test_grad_of_a_while_reading_a_stopped_weight(self):
    # The body reads w (differentiated) under stop_gradient: JAX splits the
    # loop, and the copy's tangent is unused (found by the same review).
    def loss(x, w):
      def body(c):
        sow(c, name='csum', reduce_fn=add, init_fn=zero_total)
        return jax.lax.stop_gradient(1.5 * c + w)

      c = jax.lax.while_loop(
          lambda c: c < 10.0, body, jax.lax.stop_gradient(x)
      )
      return c * w + x**2

    grads, collected = capture(jax.grad(loss, (0, 1)))(1.0, 0.5)
    # c: 1, 2, 3.5, 5.75, 9.125 -> 14.1875; d/dx = 2 x, d/dw = c.
    np.testing.assert_allclose(grads, (2.0, 14.1875), rtol=1e-6)
    np.testing.assert_allclose(collected['csum'], 21.375, rtol=1e-6)

  def test_while_linearize_values(self):
    # The tangent of sin(sin(sin(x))) is unchanged by the capture.
    lin = lambda x: jax.linearize(_while_counting, x)[1](x)
    out, collected = capture(lin)(X)
    np.testing.assert_allclose(out, lin(X), rtol=1e-6)
    self.assertEqual(int(collected['steps']), 3)


# ----------------------------------------------------------------------------
# key order under the transforms of SPEC *Invariance*


def _inner_scan(a, c):
  step = lambda c2, z: (c2 + sow(z * c2, name='second'), None)
  return jax.lax.scan(step, c, a[None])[0]


def _inner_fori(a, c):
  body = lambda i, c2: c2 + sow(a * c2, name='second')
  return jax.lax.fori_loop(0, 1, body, c)


def _inner_cond(a, c):
  return jax.lax.cond(
      a > 0.0,
      lambda: c + sow(a * c, name='second'),
      lambda: c - sow(a * c, name='second'),
  )


def _inner_jit(a, c):
  return jax.jit(lambda a: c + sow(a * c, name='second'))(a)


_INNER = {
    'scan': _inner_scan,
    'fori': _inner_fori,
    'cond': _inner_cond,
    'jit': _inner_jit,
}


def _first_then_inner(inner, checkpoint_body=False):
  """A ``vmap`` in a ``scan`` body sows ``'first'``, then runs ``inner``
  (which sows ``'second'``) on it: the batched inner construct leaves an
  order marker with no operands, which scan's hoisting under ``grad`` once
  moved out of the loop, ahead of ``'first'``."""

  def body(c, xi):
    per = lambda v: inner(sow(v * c, name='first'), c)
    return jax.vmap(per)(xi).sum(), None

  if checkpoint_body:
    body = jax.checkpoint(body)
  return lambda x: jax.lax.scan(body, jnp.float32(0.5), x)[0]


def _first_then_inner_by_hand(inner_name, x):
  """``'first'`` and ``'second'`` of :func:`_first_then_inner`, in NumPy."""
  first, second, c = [], [], np.float32(0.5)
  for xi in x:
    a = xi * c
    first.append(a)
    second.append(a * c)
    if inner_name == 'cond':
      c = np.sum(np.where(a > 0, c + a * c, c - a * c))
    else:
      c = np.sum(c + a * c)
  second = np.stack(second)
  if inner_name in ('scan', 'fori'):
    second = second[..., None]  # the inner loop's own (length 1) axis
  return np.stack(first), second


_ONES = np.ones((2, 3), np.float32)
_KEY_ORDER_TRANSFORMS = {
    'identity': lambda f: f,
    'jit': jax.jit,
    'grad': jax.grad,
    'value_and_grad': jax.value_and_grad,
    'jit_grad': lambda f: jax.jit(jax.grad(f)),
    'linearize': lambda f: lambda x: jax.linearize(f, x)[1](_ONES),
    'checkpoint': jax.checkpoint,
    'grad_checkpoint_nothing_saveable': lambda f: jax.grad(
        jax.checkpoint(f, policy=jax.checkpoint_policies.nothing_saveable)
    ),
    'grad_checkpoint_dots_saveable': lambda f: jax.grad(
        jax.checkpoint(f, policy=jax.checkpoint_policies.dots_saveable)
    ),
}


class KeyOrderUnderTransformsTest(parameterized.TestCase):
  """SPEC *Invariance*: ``capture(T(f))`` has the keys of ``capture(f)``, in
  order of first sow in ``f`` as written, for every ``T`` of the SPEC."""

  @parameterized.named_parameters(
      (f'{inner}_{transform}{"_remat_body" * remat}', inner, transform, remat)
      for inner in _INNER
      for transform in _KEY_ORDER_TRANSFORMS
      for remat in (False, True)
  )
  def test_first_sow_first(self, inner, transform, checkpoint_body):
    f = _first_then_inner(_INNER[inner], checkpoint_body)
    x = np.array([[0.5, -1.0, 2.0], [1.5, 0.25, -0.5]], np.float32)
    _, collected = capture(_KEY_ORDER_TRANSFORMS[transform](f))(x)
    self.assertEqual(list(collected), ['first', 'second'])
    first, second = _first_then_inner_by_hand(inner, x)
    (got_first,), (got_second,) = collected['first'], collected['second']
    np.testing.assert_allclose(got_first, first, rtol=1e-5)
    np.testing.assert_allclose(got_second, second, rtol=1e-5)

  @parameterized.named_parameters(
      ('grad', jax.grad), ('linearize', _KEY_ORDER_TRANSFORMS['linearize'])
  )
  def test_under_an_enclosing_jit(self, transform):
    # ``f`` closes over a tracer of the enclosing jit.
    x = np.array([[0.5, -1.0, 2.0], [1.5, 0.25, -0.5]], np.float32)

    @jax.jit
    def run(x, scale):
      f = _first_then_inner(_inner_scan)
      return capture(transform(lambda x: f(x * scale)))(x)[1]

    collected = run(x, jnp.float32(1.0))
    self.assertEqual(list(collected), ['first', 'second'])
    first, _ = _first_then_inner_by_hand('scan', x)
    np.testing.assert_allclose(collected['first'][0], first, rtol=1e-5)


# ----------------------------------------------------------------------------
# cotangents of several backward passes


def _l1(x):
  return jnp.sum(perturb(x, name='p') * 3.0)


def _l2(x):
  return jnp.sum(perturb(x, name='p') * 5.0)


def _two_perturbs(x):
  a = perturb(x, name='p')
  b = perturb(x * 2.0, name='p')
  return jnp.sum(a * 3.0 + b * 7.0)


def _cot_values(collected):
  return [float(np.asarray(v).ravel()[0]) for v in collected['p']]


class BackwardPassOrderTest(parameterized.TestCase):
  """Cotangents come back in the order of the ``perturb`` calls."""

  @parameterized.parameters(False, True)
  def test_two_grads(self, jit):
    f = lambda x: jax.grad(_l1)(x) + jax.grad(_l2)(x)
    run = jax.jit(capture(f)) if jit else capture(f)
    self.assertEqual(_cot_values(run(X)[1]), [3.0, 5.0])
    run = capture(jax.jit(f))
    self.assertEqual(_cot_values(run(X)[1]), [3.0, 5.0])

  def test_jitted_grads_traced_in_another_order(self):
    g1, g2 = jax.jit(jax.grad(_l1)), jax.jit(jax.grad(_l2))
    f = lambda x: (g2(x), g1(x), g2(x))
    self.assertEqual(_cot_values(capture(f)(X)[1]), [5.0, 3.0, 5.0])
    self.assertEqual(_cot_values(jax.jit(capture(f))(X)[1]), [5.0, 3.0, 5.0])

  @parameterized.parameters(False, True)
  def test_pullback_called_twice(self, jit):
    def f(x):
      _, pb = jax.vjp(_two_perturbs, x)
      return pb(1.0)[0] + pb(2.0)[0]

    run = jax.jit(capture(f)) if jit else capture(f)
    # Pass 1 (cotangent 1): 3, 7; pass 2 (cotangent 2): 6, 14.
    self.assertEqual(_cot_values(run(X)[1]), [3.0, 7.0, 6.0, 14.0])

  def test_value_and_grad_in_a_python_loop(self):
    def f(x):
      total = 0.0
      for k in range(3):
        loss = lambda x, k=k: jnp.sum(perturb(x, name='p') * (k + 1.0))
        total = total + jax.grad(loss)(x)
      return total

    for run in (capture(f), jax.jit(capture(f)), capture(jax.jit(f))):
      self.assertEqual(_cot_values(run(X)[1]), [1.0, 2.0, 3.0])

  def test_grads_of_scans(self):
    def loss(scale, x):
      def body(c, xi):
        return c + jnp.sum(perturb(xi, name='p')) * scale, None

      return jax.lax.scan(body, 0.0, x)[0]

    xs = np.ones((4, 2), np.float32)
    f = lambda x: (jax.grad(loss, 1)(3.0, x), jax.grad(loss, 1)(5.0, x))
    for run in (capture(f), jax.jit(capture(f))):
      p1, p2 = run(xs)[1]['p']
      np.testing.assert_allclose(p1, np.full((4, 2), 3.0))
      np.testing.assert_allclose(p2, np.full((4, 2), 5.0))


# ----------------------------------------------------------------------------
# one name, one meaning


class OneNameOneMeaningTest(parameterized.TestCase):

  def _program(self, x):
    sow(x * 10.0, name='m')
    return jnp.sum(perturb(x, name='m') * 2.0)

  @parameterized.parameters('plain', 'grad', 'jit_grad', 'value_and_grad')
  def test_value_and_cotangent_of_one_name_raise(self, how):
    f = {
        'plain': self._program,
        'grad': jax.grad(self._program),
        'jit_grad': jax.jit(jax.grad(self._program)),
        'value_and_grad': jax.value_and_grad(self._program),
    }[how]
    with self.assertRaisesRegex(
        ValueError, r"'m'.*sow\(\.\.\.\) and by perturb"
    ):
      capture(f)(X)
    with self.assertRaisesRegex(
        ValueError, r"'m'.*sow\(\.\.\.\) and by perturb"
    ):
      jax.jit(capture(f))(X)

  def test_reduced_name_and_perturb_raise(self):
    def f(x):
      sow(jnp.sum(x), name='m', reduce_fn=add, init_fn=lambda: 0.0)
      return jnp.sum(perturb(x, name='m'))

    with self.assertRaisesRegex(ValueError, r"'m'.*perturb"):
      capture(jax.grad(f))(X)

  def test_other_names_fine(self):
    def f(x):
      sow(x * 10.0, name='m')
      return jnp.sum(perturb(x, name='dm') * 2.0)

    out, collected = capture(jax.grad(f))(X)
    np.testing.assert_allclose(out, [2.0, 2.0, 2.0])
    np.testing.assert_allclose(collected['m'][0], 10.0 * X)
    np.testing.assert_allclose(collected['dm'][0], [2.0, 2.0, 2.0])
    self.assertEqual(collected.cotangents, frozenset({'dm'}))

  def test_flatten_names_keeps_the_cotangent_mark(self):
    # Imported here: flatten_names lands with the NNX layer, after the
    # constructs the rest of this file tests (tests/test_series.py).
    from flax.nnx.sow import flatten_names  # pylint: disable=g-import-not-at-top
    def f(x):
      sow(x * 10.0, name=('blk', 'm'))
      return jnp.sum(perturb(x, name=('blk', 'dm')) * 2.0)

    _, collected = capture(jax.grad(f))(X)
    flat = flatten_names(collected)
    self.assertEqual(flat.cotangents, frozenset({'blk/dm'}))
    # So intervene still refuses the gradient as a value.
    g = lambda x: f(x)
    with self.assertRaisesRegex(ValueError, 'cotangent'):
      intervene(g, flat)(X)
    # Under jit the mark travels with the pytree.
    flat_jit = jax.jit(lambda c: c)(flat)
    self.assertEqual(flat_jit.cotangents, frozenset({'blk/dm'}))


# ----------------------------------------------------------------------------
# eager capture runs f as f runs


class EagerLikeFTest(parameterized.TestCase):

  def test_numpy_arguments_keep_their_precision(self):
    f = lambda a: float(np.sum(a) - 1.0)
    a = np.array([1.0, 1e-9])
    out, _ = capture(f)(a)
    self.assertEqual(out, f(a))

  def test_value_dependent_python_in_custom_rules(self):
    @jax.custom_jvp
    def signed(x):
      if float(x) > 0:  # fine eagerly, as in JAX
        return sow(x, name='pos')
      return sow(-x, name='neg')

    signed.defjvp(lambda p, t: (signed(p[0]), t[0]))

    @jax.custom_vjp
    def clip(x):
      if float(x) > 1.0:
        return sow(jnp.ones_like(x), name='clipped')
      return x

    clip.defvjp(lambda x: (clip(x), None), lambda _, g: (g,))

    out, collected = capture(lambda x: signed(x) + clip(x))(jnp.float32(2.0))
    self.assertEqual(float(out), 3.0)
    self.assertEqual(list(collected), ['pos', 'clipped'])
    out, collected = capture(lambda x: signed(x) + clip(x))(jnp.float32(-2.0))
    self.assertEqual(float(out), 0.0)
    self.assertEqual(list(collected), ['neg'])
    # Nested eager captures too: the inner one collects.
    (out, inner), outer = capture(lambda x: capture(signed)(x))(
        jnp.float32(2.0)
    )
    self.assertEqual(float(out), 2.0)
    self.assertEqual(list(inner), ['pos'])
    self.assertEqual(dict(outer), {})

  def test_set_mesh_around_the_capture_and_refused_inside(self):
    mesh = jax.make_mesh((1,), ('d',))

    def f(x):
      return sow(x * 2.0, name='y'), jax.sharding.get_abstract_mesh()

    # Around the capture, the mesh is the one f sees.
    with jax.set_mesh(mesh):
      (y, seen), collected = capture(f)(jnp.arange(3.0))
    self.assertEqual(seen, mesh.abstract_mesh)
    np.testing.assert_allclose(y, [0.0, 2.0, 4.0])
    np.testing.assert_allclose(collected['y'][0], [0.0, 2.0, 4.0])
    self.assertTrue(jax.sharding.get_abstract_mesh().empty)

    # Inside f, JAX refuses set_mesh and get_mesh under the capture's trace
    # as it does under jax.jit (an error, never a different mesh).
    def sets_mesh(x):
      with jax.set_mesh(mesh):
        return sow(x * 2.0, name='y')

    for g in (sets_mesh, lambda x: jax.sharding.get_mesh()):
      with self.assertRaisesRegex(ValueError, 'outside of `jax.jit`'):
        capture(g)(jnp.arange(3.0))
      with self.assertRaisesRegex(ValueError, 'outside of `jax.jit`'):
        jax.jit(capture(g))(jnp.arange(3.0))
    self.assertTrue(jax.sharding.get_abstract_mesh().empty)

  def test_disable_jit_raises(self):
    def scan_sows(x):
      return jax.lax.scan(lambda c, xi: (c, sow(xi, name='s')), 0.0, x)[1]

    def branch_reduces(x):
      # Sown only in the branch not taken: with jit the name still gets its
      # init_fn() accumulator, which a Python if could not give.
      return jax.lax.cond(
          x[0] > 100.0,
          lambda x: sow(x[0], name='m', reduce_fn=add, init_fn=lambda: 0.0),
          lambda x: x[0],
          x,
      )

    for f in (
        scan_sows,
        branch_reduces,
        jax.grad(lambda x: jnp.sum(perturb(x, name='s'))),
    ):
      with jax.disable_jit():
        for run in (capture(f), jax.jit(capture(f)), capture(jax.jit(f))):
          with self.assertRaisesRegex(ValueError, 'disable_jit'):
            run(jnp.arange(3.0))
    with jax.disable_jit():
      with jax.disable_jit(False):  # the fix the message gives
        _, scanned = capture(scan_sows)(jnp.arange(3.0))
        _, reduced = capture(branch_reduces)(jnp.arange(3.0))
    np.testing.assert_allclose(scanned['s'][0], [0.0, 1.0, 2.0])
    self.assertEqual(float(reduced['m']), 0.0)
    # A program with no capture still runs under disable_jit, sows included.
    with jax.disable_jit():
      np.testing.assert_allclose(scan_sows(jnp.arange(3.0)), [0.0, 1.0, 2.0])


# ----------------------------------------------------------------------------
# selecting names


def _layers(x):
  """Three tanh layers and a scan; the same program without sow is below."""
  for i in range(3):
    x = sow(jnp.tanh(x + i), name=('blk', i, 'resid'))
    sow(x * 2.0, name=('blk', i, 'attn'))

  def body(c, xi):
    sow(c, name='carry')
    sow(xi, name='xs')
    return c + xi, None

  x = jax.lax.scan(body, x, jnp.ones((4, 3)))[0]
  sow(jnp.sum(x), name='total', reduce_fn=add, init_fn=lambda: 0.0)
  return x


def _layers_by_hand(x):
  resid, attn = [], []
  for i in range(3):
    x = np.tanh(x + i)
    resid.append(x)
    attn.append(x * 2.0)
  carries = []
  for _ in range(4):
    carries.append(x)
    x = x + 1.0
  return x, resid, attn, np.stack(carries)


class NamesSelectionTest(parameterized.TestCase):

  @parameterized.parameters('eager', 'jit', 'jit_inside')
  def test_callable_and_iterable(self, how):
    def run(**kw):
      if how == 'eager':
        return capture(_layers, **kw)(X)
      if how == 'jit':
        return jax.jit(capture(_layers, **kw))(X)
      return capture(jax.jit(_layers), **kw)(X)

    out, resid, attn, carries = _layers_by_hand(X)
    got, collected = run(names=lambda n: n[-1] == 'resid')
    np.testing.assert_allclose(got, out, rtol=1e-6)
    self.assertEqual(list(collected), [('blk', i, 'resid') for i in range(3)])
    for i in range(3):
      np.testing.assert_allclose(
          collected[('blk', i, 'resid')][0], resid[i], rtol=1e-6
      )
    _, collected = run(names=['carry', ('blk', 1, 'attn'), 'total'])
    # In order of first sow, whatever order names lists them in.
    self.assertEqual(list(collected), [('blk', 1, 'attn'), 'carry', 'total'])
    np.testing.assert_allclose(collected['carry'][0], carries, rtol=1e-6)
    np.testing.assert_allclose(
        collected[('blk', 1, 'attn')][0], attn[1], rtol=1e-6
    )
    np.testing.assert_allclose(collected['total'], np.sum(out), rtol=1e-6)

  def test_unselected_sows_cost_nothing(self):
    # Only the output and the one selected entry leave the jitted program.
    jaxpr = jax.make_jaxpr(capture(_layers, names=['carry']))(X)
    self.assertLen(jaxpr.jaxpr.outvars, 2)
    self.assertEqual(jaxpr.out_avals[1].shape, (4, 3))
    # The scan carries no accumulator and stacks only the selected ys.
    (scan,) = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == 'scan']
    self.assertLen(scan.outvars, 2)

  def test_the_rest_stay_for_an_enclosing_capture(self):
    (out, inner), outer = capture(capture(_layers, names=['carry']))(X)
    self.assertEqual(list(inner), ['carry'])
    self.assertEqual(
        list(outer),
        [
            ('blk', 0, 'resid'),
            ('blk', 0, 'attn'),
            ('blk', 1, 'resid'),
            ('blk', 1, 'attn'),
            ('blk', 2, 'resid'),
            ('blk', 2, 'attn'),
            'xs',
            'total',
        ],
    )
    np.testing.assert_allclose(out, _layers_by_hand(X)[0], rtol=1e-6)

  def test_names_and_tags_together(self):
    def f(x):
      sow(x, name='a', tag='t')
      sow(x * 2.0, name='b', tag='t')
      sow(x * 3.0, name='a', tag='u')
      return x

    _, collected = capture(f, tags=['t'], names=['a'])(X)
    self.assertEqual(list(collected), ['a'])
    self.assertLen(collected['a'], 1)
    np.testing.assert_allclose(collected['a'][0], X)

  def test_bad_names(self):
    with self.assertRaisesRegex(TypeError, r"names=\('h',\)"):
      capture(_layers, names='h')
    with self.assertRaisesRegex(TypeError, 'names must be None'):
      capture(_layers, names=3)
    with self.assertRaisesRegex(TypeError, 'name must be a str'):
      capture(_layers, names=[('blk', 1.5)])


class NameConventionTest(absltest.TestCase):
  """A Module.sow name is its path, a tuple, in every result format."""

  def test_one_convention(self):
    from flax import nnx  # pylint: disable=g-import-not-at-top
    from flax.nnx.sow import collected_to_state  # pylint: disable=g-import-not-at-top
    from flax.nnx.sow import state_to_collected  # pylint: disable=g-import-not-at-top

    class Block(nnx.Module):

      def __call__(self, x):
        self.sow(nnx.Intermediate, 'y', x * 2.0)
        return x

    class Net(nnx.Module):

      def __init__(self):
        self.inner = Block()

      def __call__(self, x):
        self.sow(nnx.Intermediate, 'top', x + 1.0)
        return self.inner(x)

    net = Net()
    x = jnp.arange(2.0)
    _, functional = capture(net)(x)
    _, state = nnx.capture(net, nnx.Intermediate)(x)
    from_state = state_to_collected(state)
    self.assertEqual(list(functional), [('top',), ('inner', 'y')])
    self.assertEqual(set(from_state), {('top',), ('inner', 'y')})
    for name in functional:
      np.testing.assert_allclose(from_state[name][0], functional[name][0])
    np.testing.assert_allclose(functional[('top',)][0], [1.0, 2.0])
    np.testing.assert_allclose(functional[('inner', 'y')][0], [0.0, 2.0])
    # A State built from functional names gives them back as they were.
    back = state_to_collected(collected_to_state({'a': (x,), ('b', 1): (x,)}))
    self.assertEqual(list(back), ['a', ('b', 1)])


def _shift_in(acc, v):
  return acc * 10.0 + v


class ReductionOrderTest(parameterized.TestCase):
  """Which init_fn starts a name, and the fold order under vmap."""

  def _gated(self, x):
    def on(x):
      sow(x, name='log', reduce_fn=_shift_in, init_fn=lambda: jnp.float32(1))
      return x

    def off(x):
      sow(x, name='log', reduce_fn=_shift_in, init_fn=lambda: jnp.float32(2))
      return x

    return jax.lax.cond(x > 0, on, off, x)

  @parameterized.parameters(False, True)
  def test_cond_starts_from_true_fun(self, jit):
    run = jax.jit(capture(self._gated)) if jit else capture(self._gated)
    self.assertEqual(float(run(jnp.float32(3.0))[1]['log']), 13.0)
    self.assertEqual(float(run(jnp.float32(-3.0))[1]['log']), 7.0)

  def test_switch_starts_from_branch_zero(self):
    def make(k):
      def branch(x):
        sow(x, name='log', reduce_fn=_shift_in, init_fn=lambda: 5.0 + k)
        return x

      return branch

    f = lambda i, x: jax.lax.switch(i, [make(0), make(1), make(2)], x)
    for i in range(3):
      _, collected = capture(f)(i, jnp.float32(1.0))
      self.assertEqual(float(collected['log']), 51.0)  # 5 * 10 + 1

  @parameterized.named_parameters(
      ('vmap_inside', lambda f: capture(jax.vmap(f))),
      ('jit_vmap_inside', lambda f: jax.jit(capture(jax.vmap(f)))),
      (
          'vmap_in_scan',
          lambda f: capture(
              lambda xs: jax.lax.scan(
                  lambda c, x: (c, jax.vmap(f)(x)), 0.0, xs[None]
              )[1]
          ),
      ),
  )
  def test_batched_cond_starts_from_true_fun(self, run):
    # vmap on a batched predicate runs both branches; the name still starts
    # from true_fun's init_fn (found by a fresh reviewer: it took false_fun's).
    add_fn = lambda a, v: a + v

    def gated(x):
      return jax.lax.cond(
          x > 0,
          lambda x: sow(x, name='s', reduce_fn=add_fn, init_fn=lambda: 100.0),
          lambda x: sow(x, name='s', reduce_fn=add_fn, init_fn=lambda: 0.0),
          x,
      )

    xs = jnp.array([1.0, -2.0])
    # One example per branch: 100 (true_fun's init) + 1 - 2.
    self.assertEqual(float(run(gated)(xs)[1]['s']), 99.0)

  def test_vmap_folds_site_by_site(self):
    def two_sites(x):
      sow(x, name='seq', reduce_fn=_shift_in, init_fn=lambda: 0.0)
      sow(x + 5.0, name='seq', reduce_fn=_shift_in, init_fn=lambda: 0.0)
      return x

    xs = jnp.array([1.0, 2.0])
    for run in (
        capture(jax.vmap(two_sites)),
        jax.jit(capture(jax.vmap(two_sites))),
    ):
      self.assertEqual(float(run(xs)[1]['seq']), 1267.0)


class RaisesRatherThanWrongTest(absltest.TestCase):
  """Combinations a capture cannot collect exactly: an error, not a value."""

  def test_optimize_remat_fwd_skipping_the_primal(self):
    f = jax.custom_vjp(lambda x: sow(jnp.sin(x), name='h'))
    f.defvjp(
        lambda x: (jnp.sin(x), x),
        lambda x, ct: (ct * jnp.cos(x),),
        optimize_remat=True,
    )
    loss = lambda x: jnp.sum(f(x))
    _, collected = capture(f)(X)  # not differentiated: the body runs
    np.testing.assert_allclose(collected['h'][0], np.sin(X), rtol=1e-6)
    # Differentiated, JAX runs fwd, which does not call the body (no entry),
    # or, where it stages the call (under jit), may run the body in place of
    # fwd: then its sow is collected once, with the primal value. Never a
    # wrong value or a second entry.
    for g in (jax.grad(loss), jax.grad(jax.jit(loss))):
      grad, collected = capture(g)(X)
      np.testing.assert_allclose(grad, np.cos(X), rtol=1e-6)
      if 'h' in collected:
        self.assertLen(collected['h'], 1)
        np.testing.assert_allclose(collected['h'][0], np.sin(X), rtol=1e-6)
      else:
        self.assertEqual(list(collected), [])
