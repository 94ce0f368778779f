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

"""A functional capture names its module roots lazily (``nnx/scope.py``).

``capture(f)(x)`` of a function that uses no NNX object walks no argument,
searches ``f`` for no module and names no root: the NNX layer does O(1)
work per call. The first ``Module.sow`` asks for the roots, which are then
the same as if they had been named at the start. Expected values are
computed by hand or with the submodules' ``nnx.Linear`` layers, which do not
sow.
"""

from __future__ import annotations

import os
import sys

from absl.testing import absltest
from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np

import flax.nnx.sow  # noqa: F401  (installs the shims)
from flax.nnx.sow import capture
from flax.nnx.sow import sow
from flax.nnx.sow.nnx import scope as scope_lib

NNX_LAYER = os.path.dirname(os.path.abspath(scope_lib.__file__))
X = np.array([[0.5, -1.0, 2.0], [1.0, 0.25, -0.5]], np.float32)


class Block(nnx.Module):

  def __init__(self, rngs):
    self.linear = nnx.Linear(3, 3, rngs=rngs)

  def __call__(self, x):
    y = self.linear(x)
    self.sow(nnx.Intermediate, 'act', y)
    return y


class Model(nnx.Module):

  def __init__(self, seed=0):
    rngs = nnx.Rngs(seed)
    self.blocks = nnx.List([Block(rngs), Block(rngs)])

  def __call__(self, x):
    for block in self.blocks:
      x = jnp.tanh(block(x))
    return x


def expected_acts(model, x):
  a0 = model.blocks[0].linear(x)
  a1 = model.blocks[1].linear(jnp.tanh(a0))
  return np.asarray(a0), np.asarray(a1)


def close(actual, expected):
  np.testing.assert_allclose(actual, expected, rtol=1e-5, atol=1e-6)


def plain(x):
  """A plain JAX function: no NNX object anywhere."""
  return jnp.sum(sow(jnp.sin(x), name='s') * 2.0)


class RootFinding:
  """Counts the calls of the functions that name a scope's roots."""

  NAMES = ('referenced_graph_nodes', '_nodes_in', '_graph_nodes')

  def __init__(self, test):
    self.counts = {}
    for name in self.NAMES:
      test.enter_context(
          absltest.mock.patch.object(
              scope_lib, name, self._counted(name, getattr(scope_lib, name))
          )
      )
    test.enter_context(
        absltest.mock.patch.object(
            scope_lib.Scope,
            'add_roots',
            self._counted('add_roots', scope_lib.Scope.add_roots),
        )
    )

  def _counted(self, name, fn):
    self.counts[name] = 0

    def counted(*args, **kwargs):
      self.counts[name] += 1
      return fn(*args, **kwargs)

    return counted


def _nnx_layer_calls(fn) -> list[str]:
  """The functions of the NNX layer (``flax/nnx/sow/nnx/``) ``fn()`` calls."""
  calls = []

  def profile(frame, event, arg):
    del arg
    if event == 'call' and frame.f_code.co_filename.startswith(NNX_LAYER):
      calls.append(frame.f_code.co_name)

  sys.setprofile(profile)
  try:
    jax.block_until_ready(fn())
  finally:
    sys.setprofile(None)
  return calls


class LazyRootsTest(absltest.TestCase):

  def test_plain_function_names_no_roots(self):
    roots = RootFinding(self)
    x = jnp.array([0.5, -1.0, 2.0])
    for run in (capture(plain), jax.jit(capture(plain))):
      out, collected = run(x)
      # By hand: sum(2 sin(x)), and the sown sin(x).
      close(out, 2.0 * np.sum(np.sin([0.5, -1.0, 2.0])))
      self.assertEqual(list(collected), ['s'])
      close(collected['s'][0], np.sin([0.5, -1.0, 2.0]))
    self.assertEqual(
        roots.counts,
        dict(
            referenced_graph_nodes=0, _nodes_in=0, _graph_nodes=0, add_roots=0
        ),
    )

  def test_nnx_layer_work_does_not_grow_with_the_arguments(self):
    def f(tree):
      return sum(
          jnp.sum(sow(leaf, name=('x', i)))
          for i, leaf in enumerate(jax.tree.leaves(tree))
      )

    small = [jnp.ones(2)]
    large = [{'a': jnp.ones(2), 'b': (jnp.ones(2), jnp.ones(2))}] * 32
    captured = capture(f)
    captured(small), captured(large)  # warm JAX's caches
    for run in (captured, jax.jit(capture(f))):
      calls_small = _nnx_layer_calls(lambda: run(small))
      calls_large = _nnx_layer_calls(lambda: run(large))
      self.assertEqual(calls_small, calls_large)
      self.assertNotEmpty(calls_small)  # the call hook runs
      self.assertLess(len(calls_small), 20)
      for heavy in (
          'add_roots',
          'referenced_graph_nodes',
          '_nodes_in',
          '_graph_nodes',
          'is_graph_leaf',
      ):
        self.assertNotIn(heavy, calls_small)

  def test_module_sow_names_the_roots_when_it_asks(self):
    model = Model()
    roots = RootFinding(self)
    out, collected = capture(lambda x: model(x))(X)
    self.assertEqual(roots.counts['add_roots'], 1)
    self.assertEqual(roots.counts['referenced_graph_nodes'], 1)
    a0, a1 = expected_acts(model, X)
    self.assertEqual(
        list(collected), [('blocks', 0, 'act'), ('blocks', 1, 'act')]
    )
    close(collected[('blocks', 0, 'act')][0], a0)
    close(collected[('blocks', 1, 'act')][0], a1)
    close(out, np.tanh(a1))

  def test_roots_by_argument_position_when_named_late(self):
    first, second = Model(0), Model(1)

    def f(x, m1, m2):
      y = jnp.sin(x)  # work before the first sow
      return m1(y) + m2(y)

    _, collected = capture(f)(X, first, second)
    y = np.sin(X)
    self.assertEqual(
        list(collected),
        [
            (1, 'blocks', 0, 'act'),
            (1, 'blocks', 1, 'act'),
            (2, 'blocks', 0, 'act'),
            (2, 'blocks', 1, 'act'),
        ],
    )
    for i, m in ((1, first), (2, second)):
      a0, a1 = expected_acts(m, y)
      close(collected[(i, 'blocks', 0, 'act')][0], a0)
      close(collected[(i, 'blocks', 1, 'act')][0], a1)

  def test_merges_before_the_first_sow_are_replayed(self):
    model = Model()
    graphdef, state = nnx.split(model)

    def f(m, x):
      # A copy made before any module asks for a path: named from the split.
      g, s = nnx.split(m)
      return nnx.merge(g, s)(x)

    roots = RootFinding(self)
    _, collected = capture(f)(model, X)
    self.assertEqual(
        list(collected), [('blocks', 0, 'act'), ('blocks', 1, 'act')]
    )
    a0, a1 = expected_acts(model, X)
    close(collected[('blocks', 0, 'act')][0], a0)
    close(collected[('blocks', 1, 'act')][0], a1)
    self.assertEqual(roots.counts['add_roots'], 1)
    # The functional pattern: merged from a graphdef split before.
    _, collected = capture(lambda s, x: nnx.merge(graphdef, s)(x))(state, X)
    close(collected[('blocks', 1, 'act')][0], a1)

  def test_a_jit_traced_while_unnamed_is_not_reused_with_other_roots(self):
    model, other = Model(0), Model(1)
    g = jax.jit(lambda x: model(x))  # one jitted function, cached by JAX
    traces = []
    h = jax.jit(lambda x: (traces.append(None), jnp.cos(x))[1])

    _, alone = capture(lambda x: g(x) + h(x))(X)
    # model is the only root: Flax's paths.
    self.assertEqual(list(alone), [('blocks', 0, 'act'), ('blocks', 1, 'act')])
    _, both = capture(lambda x: g(x) + other(x) + h(x))(X)
    # Two roots, named by their variables; g's sows must not keep the
    # names of its trace in the first call.
    self.assertEqual(
        list(both),
        [
            ('model', 'blocks', 0, 'act'),
            ('model', 'blocks', 1, 'act'),
            ('other', 'blocks', 0, 'act'),
            ('other', 'blocks', 1, 'act'),
        ],
    )
    a0, _ = expected_acts(model, X)
    close(both[('model', 'blocks', 0, 'act')][0], a0)
    b0, _ = expected_acts(other, X)
    close(both[('other', 'blocks', 0, 'act')][0], b0)

    # A jit with no module inside, in captures that name no roots: traced
    # once for both (the unnamed scopes share a key).
    traces.clear()
    h2 = jax.jit(lambda x: (traces.append(None), jnp.cos(x))[1])
    for _ in range(2):
      out, collected = capture(lambda x: sow(h2(x), name='c'))(X)
      close(out, np.cos(X))
      close(collected['c'][0], np.cos(X))
    self.assertLen(traces, 1)


if __name__ == '__main__':
  absltest.main()
