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

"""Property-based differential tests of ``capture``.

Hypothesis draws a random program: a tree of nodes that nests ``jax.jit``,
``lax.scan``, ``lax.cond``/``lax.switch``, ``jax.checkpoint``, ``jax.vmap``
and ``jax.custom_jvp`` a few levels deep, with plain and reduced sows at
random places. Two interpreters run the same description:

* :func:`_run_sown` calls ``sow``; ``capture`` collects the values;
* :func:`_run_explicit` writes the same program without ``sow``: it returns
  every value that would be sown as an extra output (scan ``ys``, extra
  outputs of jit/checkpoint/custom_jvp/cond, vmap outputs) and threads the
  reduced names through as extra carries.

The test checks that ``capture`` returns exactly what the explicit program
passes out, and that the program's own output is unchanged. The number of
examples is ``SOW_HYPOTHESIS_EXAMPLES`` (default 25); the examples are
derandomized so that every run draws the same programs.
"""

from __future__ import annotations

import os

from absl.testing import absltest
from absl.testing import parameterized
import hypothesis
from hypothesis import strategies as st
import jax
import jax.numpy as jnp
import numpy as np

from flax.nnx.sow import capture
from flax.nnx.sow import sow

MAX_EXAMPLES = int(os.environ.get('SOW_HYPOTHESIS_EXAMPLES', '25'))
MAX_DEPTH = 3

# Elementwise-ish steps on the running value ``x`` (float32, shape (2,)).
OPS = (
    jnp.sin,
    jnp.tanh,
    lambda x: x * 1.25 + 0.5,
    lambda x: x[::-1] - 0.25,
    lambda x: x + 0.1 * jnp.sum(x),
    jnp.cos,
)

# What a plain sow records: a function of ``x`` (index 0 also feeds the
# sow's result back into the program).
SOWN = (
    lambda x: x,
    lambda x: x * x,
    lambda x: jnp.sum(x),
    lambda x: {'h': x + 1.0, 'n': jnp.sum(x).astype(jnp.int32)},
)

PLAIN_NAMES = ('a', ('blk', 0, 'h'), 'c')


# Reduced names have fixed reductions (one function object per name, as
# capture requires). Each works on a value of any shape.
def _sum_reduce(acc, v):
  return acc + jnp.sum(v)


def _sum_init():
  return jnp.float32(0.0)


def _max_reduce(acc, v):
  return jnp.maximum(acc, jnp.max(v))


def _max_init():
  return jnp.float32(-jnp.inf)


def _count_reduce(acc, v):
  del v
  return acc + 1


def _count_init():
  return jnp.int32(0)


REDUCTIONS = {
    'sum': (_sum_reduce, _sum_init),
    'max': (_max_reduce, _max_init),
    'count': (_count_reduce, _count_init),
}
REDUCED_NAMES = tuple(REDUCTIONS)


def _init_accs():
  return {n: init() for n, (_, init) in REDUCTIONS.items()}


def _combine_vmapped(accs, deltas):
  """Folds per-example accumulators from a ``vmap`` body into ``accs``.

  Inside ``jax.vmap`` a capture reduces a sown value once per example, as
  if the body had run once per example. The explicit program reduces each
  example's values from the identity (the ``deltas``, with a leading batch
  axis) and combines them afterwards: sum, max and count over all examples.
  """
  return {
      'sum': accs['sum'] + jnp.sum(deltas['sum']),
      'max': jnp.maximum(accs['max'], jnp.max(deltas['max'])),
      'count': accs['count'] + jnp.sum(deltas['count']),
  }


def _zero_tangent(x):
  x = jnp.asarray(x)
  if jnp.issubdtype(x.dtype, jnp.inexact):
    return jnp.zeros_like(x)
  return np.zeros(x.shape, jax.dtypes.float0)


# ----------------------------------------------------------------------------
# Program descriptions.
#
#   ('op', k)                        x = OPS[k](x)
#   ('sow', name, k)                 plain sow of SOWN[k](x)
#   ('red', name)                    reduced sow of x (reduction by name)
#   ('jit' | 'remat' | 'cjvp', body) the body under that transform
#   ('scan', body, length, reverse)  x carried, x + 0.25 * t each step
#   ('vmap', body)                   the body mapped over [x, 0.5 - x]
#   ('cond', branches, tail, src)    switch on x or on p; every branch runs
#                                    its body, then the plain sows in tail
#
# A body is a tuple of nodes. Plain sows inside a cond branch are only in its
# tail, so every branch sows the same plain names with the same types.
# Inside a vmap the branch index comes from p, which is never batched.


@st.composite
def _nodes(draw, depth, plain_ok, in_vmap):
  kinds = ['op', 'red', 'red']
  if plain_ok:
    kinds += ['sow', 'sow']
  if depth > 0:
    kinds += ['jit', 'remat', 'cjvp', 'scan', 'vmap', 'cond']
  kind = draw(st.sampled_from(kinds))
  if kind == 'op':
    return ('op', draw(st.integers(0, len(OPS) - 1)))
  if kind == 'sow':
    return (
        'sow',
        draw(st.sampled_from(PLAIN_NAMES)),
        draw(st.integers(0, len(SOWN) - 1)),
    )
  if kind == 'red':
    return ('red', draw(st.sampled_from(REDUCED_NAMES)))
  if kind in ('jit', 'remat', 'cjvp'):
    return (kind, draw(_bodies(depth - 1, plain_ok, in_vmap)))
  if kind == 'scan':
    return (
        'scan',
        draw(_bodies(depth - 1, plain_ok, in_vmap)),
        draw(st.integers(1, 3)),
        draw(st.booleans()),
    )
  if kind == 'vmap':
    return ('vmap', draw(_bodies(depth - 1, plain_ok, True)))
  n_branches = draw(st.integers(2, 3))
  branches = tuple(
      draw(_bodies(depth - 1, False, in_vmap)) for _ in range(n_branches)
  )
  tail = ()
  if plain_ok:
    tail = tuple(
        draw(
            st.lists(
                st.tuples(
                    st.sampled_from(PLAIN_NAMES),
                    st.integers(0, len(SOWN) - 1),
                ),
                max_size=2,
            )
        )
    )
  src = 'p' if in_vmap else draw(st.sampled_from(['x', 'p']))
  return ('cond', branches, tail, src)


@st.composite
def _bodies(draw, depth, plain_ok=True, in_vmap=False):
  n = draw(st.integers(1, 3))
  return tuple(draw(_nodes(depth, plain_ok, in_vmap)) for _ in range(n))


def _branch_index(node, x, p):
  v = jnp.sum(x) if node[3] == 'x' else p
  index = (v > 0.0).astype(jnp.int32)
  if len(node[1]) == 3:
    index = index + (v > 1.0).astype(jnp.int32)
  return index


def _steps(length):
  return jnp.arange(length, dtype=jnp.float32) * 0.25


def _mix(yb):
  return yb[0] * 0.75 + yb[1] * 0.25


# ----------------------------------------------------------------------------
# The program with sows.


def _run_sown(body, x, p):
  for node in body:
    x, p = _node_sown(node, x, p)
  return x


def _node_sown(node, x, p):
  kind = node[0]
  if kind == 'op':
    return OPS[node[1]](x), p
  if kind == 'sow':
    out = sow(SOWN[node[2]](x), name=node[1])
    return (out if node[2] == 0 else x), p
  if kind == 'red':
    reduce_fn, init_fn = REDUCTIONS[node[1]]
    return sow(x, name=node[1], reduce_fn=reduce_fn, init_fn=init_fn), p
  if kind == 'jit':
    return jax.jit(lambda x, p: _run_sown(node[1], x, p))(x, p), p
  if kind == 'remat':
    return jax.checkpoint(lambda x, p: _run_sown(node[1], x, p))(x, p), p
  if kind == 'cjvp':

    @jax.custom_jvp
    def fn(x, p):
      return _run_sown(node[1], x, p)

    @fn.defjvp
    def fn_jvp(primals, tangents):
      return fn(*primals), 2.0 * tangents[0]

    return fn(x, p), p
  if kind == 'scan':

    def step(carry, t):
      x, p = carry
      return (_run_sown(node[1], x + t, p), p - 0.7), None

    (x, p), _ = jax.lax.scan(step, (x, p), _steps(node[2]), reverse=node[3])
    return x, p
  if kind == 'vmap':
    xb = jnp.stack([x, 0.5 - x])
    return _mix(jax.vmap(lambda xi: _run_sown(node[1], xi, p))(xb)), p
  if kind == 'cond':

    def branch(b):
      def run(x, p):
        x = _run_sown(b, x, p)
        for name, k in node[2]:
          sow(SOWN[k](x), name=name)
        return x

      return run

    fns = [branch(b) for b in node[1]]
    return jax.lax.switch(_branch_index(node, x, p), fns, x, p), p
  raise AssertionError(node)


# ----------------------------------------------------------------------------
# The same program, passing every sown value out by hand.
#
# ``log`` is a list of (name, value) for the plain names, in call order; a
# value sown inside a scan is stacked along a new leading axis, one inside a
# vmap has the batch axis first. ``accs`` holds every reduced name.


def _run_explicit(body, x, p, accs):
  log = []
  for node in body:
    x, p, accs, entries = _node_explicit(node, x, p, accs)
    log.extend(entries)
  return x, accs, log


def _wrapped(transform, body):
  """``transform`` applied to the body, with the log as extra outputs."""
  names = []

  def fn(x, p, accs):
    x, accs, log = _run_explicit(body, x, p, accs)
    names[:] = [n for n, _ in log]
    return x, accs, [v for _, v in log]

  return transform(fn), names


def _node_explicit(node, x, p, accs):
  kind = node[0]
  if kind == 'op':
    return OPS[node[1]](x), p, accs, []
  if kind == 'sow':
    v = SOWN[node[2]](x)
    return (v if node[2] == 0 else x), p, accs, [(node[1], v)]
  if kind == 'red':
    reduce_fn, _ = REDUCTIONS[node[1]]
    accs = dict(accs, **{node[1]: reduce_fn(accs[node[1]], x)})
    return x, p, accs, []
  if kind in ('jit', 'remat', 'cjvp'):
    if kind == 'jit':
      transform = jax.jit
    elif kind == 'remat':
      transform = jax.checkpoint
    else:

      def transform(fn):
        fn = jax.custom_jvp(fn)

        @fn.defjvp
        def fn_jvp(primals, tangents):
          out = fn(*primals)
          x_out, accs_out, vals = out
          zeros = jax.tree.map(_zero_tangent, (accs_out, vals))
          return out, (2.0 * tangents[0], *zeros)

        return fn

    fn, names = _wrapped(transform, node[1])
    x, accs, vals = fn(x, p, accs)
    return x, p, accs, list(zip(names, vals))
  if kind == 'scan':
    names = []

    def step(carry, t):
      x, p, accs = carry
      x, accs, log = _run_explicit(node[1], x + t, p, accs)
      names[:] = [n for n, _ in log]
      return (x, p - 0.7, accs), [v for _, v in log]

    (x, p, accs), ys = jax.lax.scan(
        step, (x, p, accs), _steps(node[2]), reverse=node[3]
    )
    return x, p, accs, list(zip(names, ys))
  if kind == 'vmap':
    xb = jnp.stack([x, 0.5 - x])
    names = []

    def per_example(xi):
      y, deltas, log = _run_explicit(node[1], xi, p, _init_accs())
      names[:] = [n for n, _ in log]
      return y, deltas, [v for _, v in log]

    yb, deltas, vals = jax.vmap(per_example)(xb)
    accs = _combine_vmapped(accs, deltas)
    return _mix(yb), p, accs, list(zip(names, vals))
  if kind == 'cond':

    def branch(b):
      def run(x, p, accs):
        x, accs, log = _run_explicit(b, x, p, accs)
        assert not log, 'plain sows in a branch are only in its tail'
        return x, accs, [SOWN[k](x) for _, k in node[2]]

      return run

    fns = [branch(b) for b in node[1]]
    x, accs, vals = jax.lax.switch(
        _branch_index(node, x, p), fns, x, p, accs
    )
    return x, p, accs, [(n, v) for (n, _), v in zip(node[2], vals)]
  raise AssertionError(node)


def _names_in_order(body, out=None):
  """Every sown name, in order of first appearance in the program.

  A ``cond`` lists its branches' names branch by branch.
  """
  out = {} if out is None else out
  for node in body:
    kind = node[0]
    if kind in ('sow', 'red'):
      out.setdefault(node[1], None)
    elif kind in ('jit', 'remat', 'cjvp', 'scan', 'vmap'):
      _names_in_order(node[1], out)
    elif kind == 'cond':
      # Branch by branch, each in its own order (its shared plain names are
      # sown at its end).
      for b in node[1]:
        _names_in_order(b, out)
        for name, _ in node[2]:
          out.setdefault(name, None)
  return out


def _expected_collected(program, accs, log):
  expected = {}
  for name in _names_in_order(program):
    if name in REDUCTIONS:
      expected[name] = accs[name]
    else:
      expected[name] = tuple(v for n, v in log if n == name)
  return expected


X0 = np.array([0.3, -0.8], np.float32)
P0 = np.float32(0.6)


def _plain(program):
  return lambda x, p: _run_sown(program, x, p)


def _explicit(program):
  """The explicit program: ``fn(x, p) -> (x, (accs, values))``, and names.

  ``values[i]`` is the plain entry sown under ``names[i]``, in call order.
  """
  names = []

  def fn(x, p):
    x, accs, log = _run_explicit(program, x, p, _init_accs())
    names[:] = [n for n, _ in log]
    return x, (accs, [v for _, v in log])

  return fn, names


class DifferentialTest(parameterized.TestCase):

  def assert_collected(self, collected, expected):
    self.assertCountEqual(list(collected), list(expected))
    for name, want in expected.items():
      got = collected[name]
      if name in REDUCTIONS:
        self.assertEqual(got.shape, want.shape, name)
        self.assertEqual(got.dtype, want.dtype, name)
        if name == 'sum':
          # Summed in a different order than the explicit program.
          np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
        else:
          np.testing.assert_array_equal(got, want, err_msg=str(name))
        continue
      self.assertIsInstance(got, tuple, name)
      self.assertLen(got, len(want), name)
      for i, (g, w) in enumerate(zip(got, want)):
        gl, gt = jax.tree.flatten(g)
        wl, wt = jax.tree.flatten(w)
        self.assertEqual(gt, wt, (name, i))
        for a, b in zip(gl, wl):
          self.assertEqual(a.shape, b.shape, (name, i))
          self.assertEqual(a.dtype, b.dtype, (name, i))
          np.testing.assert_allclose(
              a, b, rtol=1e-6, atol=1e-6, err_msg=f'{name!r} entry {i}'
          )
    # SPEC: keys in order of first sow (checked after the values).
    self.assertEqual(list(collected), list(expected))

  @hypothesis.settings(
      max_examples=MAX_EXAMPLES,
      deadline=None,
      derandomize=True,
      database=None,
      suppress_health_check=list(hypothesis.HealthCheck),
  )
  @hypothesis.given(
      program=_bodies(MAX_DEPTH),
      outer=st.sampled_from(['eager', 'jit', 'grad']),
  )
  def test_capture_matches_explicit_program(self, program, outer):
    x, p = jnp.asarray(X0), jnp.asarray(P0)
    if outer == 'grad':
      # Differentiate the program: capture collects primal values.
      def loss(x, p):
        return jnp.sum(_run_sown(program, x, p))

      explicit, names = _explicit(program)

      def loss_explicit(x, p):
        y, aux = explicit(x, p)
        return jnp.sum(y), aux

      out, collected = capture(jax.grad(loss))(x, p)
      want_out, (accs, vals) = jax.grad(loss_explicit, has_aux=True)(x, p)
      plain_out = jax.grad(loss)(x, p)
      # The same gradient computation with and without capture.
      np.testing.assert_array_equal(out, plain_out)
      np.testing.assert_allclose(out, want_out, rtol=1e-5, atol=1e-6)
    else:
      wrap = jax.jit if outer == 'jit' else (lambda f: f)
      out, collected = wrap(capture(_plain(program)))(x, p)
      explicit, names = _explicit(program)
      want_out, (accs, vals) = wrap(explicit)(x, p)
      plain_out = wrap(_plain(program))(x, p)
      # The program's own output is the same computation with or without
      # capture: bitwise equal.
      np.testing.assert_array_equal(out, plain_out)
      np.testing.assert_allclose(out, want_out, rtol=1e-6, atol=1e-6)
    self.assert_collected(
        collected,
        _expected_collected(program, accs, list(zip(names, vals))),
    )


if __name__ == '__main__':
  absltest.main()
