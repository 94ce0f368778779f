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

"""``perturb`` and reduced sows in a ``cond``/``switch`` on a predicate that
``jax.vmap`` batches inside the capture.

Expected cotangents come from the same program without ``perturb``: a zero
``eps`` added where the perturb is, differentiated with respect to ``eps``.
"""

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest
from absl.testing import parameterized
from jax import lax

from flax.nnx.sow import capture
from flax.nnx.sow import perturb
from flax.nnx.sow import sow

X = jnp.array([[1.0, 2.0], [-1.0, -3.0], [0.5, 0.5], [0.0, -2.0]])


def _p(value, name='g'):
  return perturb(value, name=name)


def _cond(y, p=_p):
  return lax.cond(y.sum() > 0, lambda y: p(y) * 2, lambda y: p(y) * 3, y)


def _cond_eps(y, eps):
  return lax.cond(
      y.sum() > 0, lambda y: (y + eps) * 2, lambda y: (y + eps) * 3, y
  )


def _switch(y):
  # Three branches, two perturbs of one name in each.
  i = jnp.clip(jnp.sum(y > 0), 0, 2)
  return lax.switch(
      i,
      [
          lambda y: _p(y, 'a') * 2 + _p(y * y, 'a'),
          lambda y: _p(y, 'a') * 3 + _p(y, 'a') ** 2,
          lambda y: jnp.sin(_p(y, 'a')) + _p(y, 'a') * 5,
      ],
      y,
  )


def _switch_eps(y, e0, e1):
  i = jnp.clip(jnp.sum(y > 0), 0, 2)
  return lax.switch(
      i,
      [
          lambda y: (y + e0) * 2 + (y * y + e1),
          lambda y: (y + e0) * 3 + (y + e1) ** 2,
          lambda y: jnp.sin(y + e0) + (y + e1) * 5,
      ],
      y,
  )


def _switch_wanted():
  zeros = jnp.zeros_like(X)
  return jax.grad(
      lambda e0, e1: jax.vmap(_switch_eps)(X, e0, e1).sum(), argnums=(0, 1)
  )(zeros, zeros)


class PerturbInBatchedCondTest(parameterized.TestCase):

  def test_taken_branch_cotangent_one_entry(self):
    _, collected = capture(jax.grad(lambda z: jax.vmap(_cond)(z).sum()))(X)
    wanted = jax.grad(lambda e: jax.vmap(_cond_eps)(X, e).sum())(
        jnp.zeros_like(X)
    )
    self.assertLen(collected['g'], 1)
    np.testing.assert_array_equal(collected['g'][0], wanted)
    # By hand: 2 where the row sums to more than 0, else 3.
    np.testing.assert_array_equal(
        collected['g'][0], [[2, 2], [3, 3], [2, 2], [3, 3]]
    )

  @parameterized.named_parameters(
      ('grad', lambda loss: capture(jax.grad(loss))),
      ('jit', lambda loss: jax.jit(capture(jax.grad(loss)))),
      ('jit_inside', lambda loss: capture(jax.jit(jax.grad(loss)))),
      (
          'value_and_grad',
          lambda loss: capture(jax.jit(jax.value_and_grad(loss))),
      ),
  )
  def test_switch_several_perturbs_per_branch(self, transform):
    _, collected = transform(lambda z: jax.vmap(_switch)(z).sum())(X)
    wanted = _switch_wanted()
    self.assertLen(collected['a'], 2)
    for got, want in zip(collected['a'], wanted):
      np.testing.assert_allclose(got, want, rtol=1e-6)

  def test_linearize_and_linear_transpose(self):
    def f(x):
      out, f_lin = jax.linearize(jax.vmap(_switch), x)
      return jax.linear_transpose(f_lin, x)(jnp.ones_like(out))

    _, collected = capture(f)(X)
    for got, want in zip(collected['a'], _switch_wanted(), strict=True):
      np.testing.assert_allclose(got, want, rtol=1e-6)

  def test_untaken_branch_nan_does_not_leak(self):
    # sqrt of a negative row is nan in the branch that row does not take.
    def f(y, p=_p):
      return lax.cond(
          y.sum() > 0,
          lambda y: jnp.sqrt(p(y)).sum(),
          lambda y: (p(y) * 0.0).sum(),
          y,
      )

    def f_eps(y, eps):
      return f(y, lambda v: v + eps)

    _, collected = capture(jax.grad(lambda z: jax.vmap(f)(z).sum()))(X)
    wanted = jax.grad(lambda e: jax.vmap(f_eps)(X, e).sum())(jnp.zeros_like(X))
    self.assertFalse(np.isnan(wanted).any())
    np.testing.assert_allclose(collected['g'][0], wanted, rtol=1e-6)

  def test_cond_in_scan_closing_over_carry(self):
    def loss(z, cond=_cond):
      def body(c, x):
        return c + jax.vmap(cond)(x * c).sum(), None

      return lax.scan(body, 1.0, jnp.stack([z, z * 2]))[0]

    def loss_eps(z, eps):
      def body(c, xe):
        x, e = xe
        return c + jax.vmap(_cond_eps)(x * c, e).sum(), None

      return lax.scan(body, 1.0, (jnp.stack([z, z * 2]), eps))[0]

    _, collected = capture(jax.grad(loss))(X)
    wanted = jax.grad(loss_eps, argnums=1)(X, jnp.zeros((2,) + X.shape))
    self.assertLen(collected['g'], 1)
    np.testing.assert_allclose(collected['g'][0], wanted, rtol=1e-6)

  def test_nested_vmaps(self):
    y = jnp.stack([X, -X * 0.5])
    loss = lambda z: jax.vmap(jax.vmap(_cond))(z).sum()
    _, collected = capture(jax.grad(loss))(y)
    wanted = jax.grad(lambda e: jax.vmap(jax.vmap(_cond_eps))(y, e).sum())(
        jnp.zeros_like(y)
    )
    self.assertLen(collected['g'], 1)
    np.testing.assert_array_equal(collected['g'][0], wanted)

  def test_perturb_in_jit_in_branch_and_cond_in_jit(self):
    def f(y):
      return lax.cond(
          y.sum() > 0,
          lambda y: jax.jit(lambda y: _p(y) * 2)(y),
          lambda y: _p(y) * 3,
          y,
      )

    wanted = jax.grad(lambda e: jax.vmap(_cond_eps)(X, e).sum())(
        jnp.zeros_like(X)
    )
    for g in (f, jax.jit(_cond)):
      _, collected = capture(jax.grad(lambda z: jax.vmap(g)(z).sum()))(X)
      self.assertLen(collected['g'], 1)
      np.testing.assert_array_equal(collected['g'][0], wanted)

  def test_perturb_in_one_branch_only(self):
    # As without vmap: every branch must perturb the same names.
    def f(y):
      return lax.cond(y.sum() > 0, lambda y: _p(y) * 2, lambda y: y * 3, y)

    with self.assertRaisesRegex(ValueError, r"'g'.*branch.*perturbs it"):
      capture(jax.grad(lambda z: jax.vmap(f)(z).sum()))(X)
    with self.assertRaisesRegex(
        ValueError, r"'g'.*false_fun of lax.cond\) sows it 0"
    ):
      capture(jax.grad(lambda z: f(z).sum()))(X[0])
    # Not differentiated: nothing is collected, and nothing raises.
    _, collected = capture(jax.vmap(f))(X)
    self.assertEqual(dict(collected), {})

  def test_constant_perturbed_in_one_branch(self):
    # The differentiated input does not reach the perturb in false_fun: it
    # gets no cotangent, an error as without vmap (not zeros for its rows).
    def f(y):
      return lax.cond(
          y.sum() > 0,
          lambda y: _p(y) * 2,
          lambda y: _p(jnp.ones(2)) * 3 + y,
          y,
      )

    with self.assertRaisesRegex(ValueError, r"'g'.*only 1 of them"):
      capture(jax.grad(lambda z: jax.vmap(f)(z).sum()))(X)
    with self.assertRaisesRegex(ValueError, r"'g'.*sows it 0"):
      capture(jax.grad(lambda z: f(z).sum()))(X[0])

  def test_branches_perturb_different_shapes(self):
    def f(y):
      return lax.cond(
          y.sum() > 0,
          lambda y: _p(y) * 2,
          lambda y: _p(y.sum()) * 3 + y,
          y,
      )

    with self.assertRaisesRegex(
        ValueError, r"perturb 'g'.*float32\[2\].*float32\[\]"
    ):
      capture(jax.grad(lambda z: jax.vmap(f)(z).sum()))(X)


def _add(a, v):
  return a + v


def _red(v):
  return sow(v, name='t', reduce_fn=_add, init_fn=lambda: 0.0)


_WRAPS = {
    'jit': jax.jit,
    'checkpoint': jax.checkpoint,
    'scan': lambda fn: (
        lambda y: lax.scan(lambda c, _: (c + fn(y), None), 0.0, None, length=2)[
            0
        ]
    ),
    'while_loop': lambda fn: (
        lambda y: lax.while_loop(
            lambda c: c[0] < 2, lambda c: (c[0] + 1, c[1] + fn(y)), (0, 0.0)
        )[1]
    ),
}


class ReducedSowNestedInBatchedCondTest(parameterized.TestCase):

  @parameterized.parameters(
      ('jit', 1), ('checkpoint', 1), ('scan', 2), ('while_loop', 2)
  )
  def test_folds_only_taken_examples(self, construct, times):
    wrap = _WRAPS[construct]

    def f(y):
      br1 = lambda y: wrap(lambda y: _red(y.sum()))(y) * 2
      return lax.cond(y.sum() > 0, br1, lambda y: y.sum() * 3, y)

    sums = X.sum(1)
    wanted_t = times * sums[sums > 0].sum()  # examples 0 and 2: 3 + 1
    wanted_out = jnp.where(sums > 0, times * sums * 2, sums * 3)
    for g in (capture(jax.vmap(f)), jax.jit(capture(jax.vmap(f)))):
      out, collected = g(X)
      np.testing.assert_allclose(out, wanted_out)
      np.testing.assert_allclose(collected['t'], wanted_t)

  @parameterized.parameters('plain', 'checkpoint', 'grad_checkpoint')
  def test_python_constant_counted_per_taken_example_in_scan(self, transform):
    # sow(1.0) folds a Python literal (not an array) in a branch on a
    # batched predicate, in a scan: the count is the (step, example) pairs
    # that took the branch, under checkpoint and grad too.
    steps = jnp.array([1.0, -1.0, 2.0])

    def f(x):
      def body(c, s):
        def per(y):
          return lax.cond(
              y.sum() > 0,
              lambda y: y + 0.0 * sow(
                  1.0, name='n', reduce_fn=jnp.add, init_fn=lambda: 0.0
              ),
              lambda y: y * 2.0,
              y,
          )

        return c, jax.vmap(per)(c * s)

      return lax.scan(body, x, steps)[1].sum()

    g = {
        'plain': f,
        'checkpoint': jax.checkpoint(f),
        'grad_checkpoint': jax.grad(jax.checkpoint(f)),
    }[transform]
    taken = (np.asarray(X).sum(1)[None, :] * np.asarray(steps)[:, None]) > 0
    for run in (capture(g), jax.jit(capture(g))):
      _, collected = run(X)
      np.testing.assert_allclose(collected['n'], taken.sum())  # 6 of 12

  @parameterized.parameters('direct', 'jit', 'checkpoint')
  def test_fold_order_true_fun_first(self, construct):
    # A fold that is not commutative: the sites of true_fun (examples 0
    # and 2) fold first, then false_fun's (example 1): 0 -> 1 -> 12 -> 125.
    wrap = {'direct': lambda fn: fn}.get(construct) or _WRAPS[construct]

    def red(v):
      return wrap(
          lambda v: sow(
              v,
              name='t',
              reduce_fn=lambda a, v: a * 10 + v,
              init_fn=lambda: jnp.int32(0),
          )
      )(v)

    def f(y):
      return lax.cond(
          y > 0, lambda y: red(y), lambda y: red(jnp.int32(5) + 0 * y), y
      )

    _, collected = capture(jax.vmap(f))(jnp.array([1, -1, 2], jnp.int32))
    np.testing.assert_array_equal(collected['t'], 125)


if __name__ == '__main__':
  absltest.main()
