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

"""A selection is not a program: written inline, it costs no retrace.

``capture(f, names=lambda n: ...)`` in a loop makes a new callable at every
call. What it selects, not the object, keys JAX's tracing caches, the
rewrite cache and the eager ``jax.jit`` cache (``sites.NameDecisions``), so
the staged and compiled work is reused and no cache keeps a dead callable,
function or program alive. Each test calls a capture (or ``intervene``) a
few hundred times, each time with new callables, checks every value by hand,
and checks that how often the jitted block is traced, how many entries every
cache holds and how many callables, functions and jaxprs are alive do not
grow with the number of calls.
"""

from __future__ import annotations

import gc
import types

from absl.testing import absltest
import jax
from jax._src import pjit  # the tracing cache, to count its entries
import jax.extend.core as jex
import jax.numpy as jnp
import numpy as np

from flax.nnx.sow import capture, intervene, sow
from flax.nnx.sow import capturing as capturing_lib
from flax.nnx.sow import collect as collect_lib
from flax.nnx.sow import sites as sites_lib

CALLS = 200
X = np.linspace(-1.0, 2.0, 6, dtype=np.float32).reshape(2, 3)


def _cache_entries() -> dict[str, int]:
  """Entries of every cache of the package, and of JAX's tracing cache."""
  # pylint: disable=protected-access
  return {
      'rewrite': sum(len(v) for v in collect_lib._rewrite_cache.values()),
      'rewrite_sources': len(collect_lib._rewrite_cache),
      'sites': len(sites_lib._sites_cache),
      'eager_jit': sum(
          len(v) for v in capturing_lib._EagerJitted._cache.values()
      ),
      'jax_tracing': pjit._infer_params_cached.cache_info().currsize,
  }


def _alive(code: types.CodeType) -> dict[str, int]:
  """Live functions made from ``code`` and live jaxprs."""
  gc.collect()
  objects = gc.get_objects()
  return {
      'callables': sum(
          1
          for o in objects
          if isinstance(o, types.FunctionType) and o.__code__ is code
      ),
      'jaxprs': sum(
          1 for o in objects if isinstance(o, (jex.Jaxpr, jex.ClosedJaxpr))
      ),
  }


class _Program:
  """``f`` with a jitted block (its traces counted) and eager ``jnp``."""

  def __init__(self):
    self.traces = 0

    @jax.jit
    def block(x):
      self.traces += 1
      h = sow(jnp.tanh(x), name=('blk', 'act'), tag='t')
      return sow(h * 2.0, name=('blk', 'resid'), tag='t')

    def f(x):
      y = block(x)
      return sow(jnp.sum(jnp.sin(y)), name='total')

    self.f = f


def _inline_lambda(fn) -> types.CodeType:
  """The code of the lambda written inside ``fn``."""
  return next(
      c
      for c in fn.__code__.co_consts
      if isinstance(c, types.CodeType) and c.co_name == '<lambda>'
  )


def _tanh2(x):
  return np.tanh(x) * 2.0


class SelectionCacheTest(absltest.TestCase):

  def _assert_flat(self, run, code, calls=CALLS):
    """``run(i)`` ``calls`` times: after the first few calls, the traces of
    the block, every cache and the live objects stay where they were.

    Live functions are counted against those alive before the first call:
    other tests of the same process may keep functions made from ``code``
    alive (a ``jax.jit(capture(f))`` held by a module, say)."""
    before = _alive(code)['callables']
    for i in range(5):
      run(i)
    jax.effects_barrier()
    entries, alive = _cache_entries(), _alive(code)
    traces = self.program.traces
    for i in range(5, calls):
      run(i)
    self.assertLessEqual(self.program.traces, traces)
    after = _cache_entries()
    for name, n in entries.items():
      self.assertLessEqual(after[name], n + 2, msg=f'{name}: {entries} {after}')
    now = _alive(code)
    self.assertLessEqual(now['callables'], before + 2, msg=(before, now))
    self.assertLessEqual(now['jaxprs'], alive['jaxprs'] + 20, msg=(alive, now))

  def setUp(self):
    super().setUp()
    self.program = _Program()

  def test_names_lambda_inline_eager(self):
    f = self.program.f

    def run(i):
      out, collected = capture(f, names=lambda n: n[-1] == 'resid')(X)
      self.assertEqual(list(collected), [('blk', 'resid')])
      np.testing.assert_allclose(collected[('blk', 'resid')][0], _tanh2(X),
                                 rtol=1e-6)
      np.testing.assert_allclose(
          out, np.sum(np.sin(_tanh2(X))), rtol=1e-5, atol=1e-6
      )

    self._assert_flat(run, _inline_lambda(run))
    self.assertEqual(self.program.traces, 1)

  def test_names_lambda_inline_eager_jitted_function(self):
    g = jax.jit(self.program.f)  # capture of a jax.jit: compiled eagerly

    def run(i):
      _, collected = capture(g, names=lambda n: n[0] == 'blk')(X + i)
      self.assertEqual(list(collected), [('blk', 'act'), ('blk', 'resid')])
      np.testing.assert_allclose(
          collected[('blk', 'act')][0], np.tanh(X + i), rtol=1e-6
      )

    self._assert_flat(run, _inline_lambda(run))

  def test_tags_and_names_lambda_inline(self):
    f = self.program.f

    def run(i):
      _, collected = capture(
          f, tags=('t',), names=lambda n: n != ('blk', 'act')
      )(X)
      # 'total' has no tag: not collected.
      self.assertEqual(list(collected), [('blk', 'resid')])

    self._assert_flat(run, _inline_lambda(run))

  def test_a_new_selection_that_selects_other_names_is_honoured(self):
    f = self.program.f
    for i in range(4):
      wanted = ('blk', 'act') if i % 2 else ('blk', 'resid')
      _, collected = capture(f, names=lambda n: n == wanted)(X)
      self.assertEqual(list(collected), [wanted])
      want = np.tanh(X) if i % 2 else _tanh2(X)
      np.testing.assert_allclose(collected[wanted][0], want, rtol=1e-6)

  def test_a_selection_asked_while_tracing_is_keyed_by_its_answer(self):
    # vmap of a cond on a batched predicate asks, while JAX traces the jit,
    # whether the capture collects 'a', sown in one branch only: if it
    # does, that is an error; if not, the sow stays an identity. A jit
    # traced for a selection without 'a' must not be reused for one with it.
    @jax.jit
    def f(x):
      return jax.vmap(
          lambda x: jax.lax.cond(
              x > 0, lambda x: sow(x * 2.0, name='a'), lambda x: x, x
          )
      )(x)

    xs = np.array([1.0, -1.0], np.float32)
    for _ in range(2):
      out, collected = capture(f, names=lambda n: n == 'b')(xs)
      self.assertEqual(dict(collected), {})
      np.testing.assert_allclose(out, [2.0, -1.0])
      with self.assertRaisesRegex(ValueError, "'a'"):
        capture(f, names=lambda n: n == 'a')(xs)

  def test_capture_rebuilt_at_every_call(self):
    f = self.program.f

    def run(i):
      _, collected = capture(f)(X)
      self.assertEqual(
          list(collected), [('blk', 'act'), ('blk', 'resid'), 'total']
      )

    self._assert_flat(run, capture(f).__code__)  # the captured functions
    self.assertEqual(self.program.traces, 1)

  def test_intervene_lambda_inline(self):
    f = self.program.f

    def run(i):
      out = intervene(f, {('blk', 'resid'): lambda v: v * 0.0 + float(i)})(X)
      np.testing.assert_allclose(
          out, 6 * np.sin(float(i)), rtol=1e-5, atol=1e-6
      )

    self._assert_flat(run, _inline_lambda(run), calls=CALLS // 2)


if __name__ == '__main__':
  absltest.main()
