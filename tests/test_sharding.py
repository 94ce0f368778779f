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

"""Sows inside ``jax.shard_map`` and ``jax.pmap`` (``sharding.py``).

Runs on the 8 simulated CPU devices that ``conftest.py`` asks XLA for, with
meshes from ``jax.make_mesh`` whose axes are ``Auto`` or ``Explicit``.
Every expected value is the same computation written without ``shard_map``
and without ``sow`` (NumPy, plain ``jnp``, ``jax.grad``), cut by hand into
the layout of SPEC *Across devices*: one leading axis per mesh axis the value
varies over, in mesh order, then the value on that shard. The real
multi-process run (two processes on localhost) is ``MultiProcessTest``.
"""

from __future__ import annotations

import functools
import json
import os
import pathlib
import re
import socket
import subprocess
import sys
import tempfile
import time
from unittest import mock

from absl.testing import absltest
from absl.testing import parameterized
import jax
import jax.numpy as jnp
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import AxisType
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np
import pytest
from flax import nnx

from flax.nnx.sow import capture
from flax.nnx.sow import intervene
from flax.nnx.sow import perturb
from flax.nnx.sow import sow
from flax.nnx.sow import _jax
from flax.nnx.sow.collect import collect_rules

ROOT = pathlib.Path(__file__).resolve().parent.parent
WORKER = ROOT / 'tests' / 'multiprocess_worker.py'

_rng = np.random.default_rng(0)
X = _rng.normal(size=(16, 4)).astype(np.float32)  # 2 rows per device
W1 = _rng.normal(size=(4, 6)).astype(np.float32)
W2 = _rng.normal(size=(6, 3)).astype(np.float32)
W3 = _rng.normal(size=(3, 5)).astype(np.float32)
XS = _rng.normal(size=(5, 16, 3)).astype(np.float32)  # 5 steps of 16 rows

AXIS_TYPES = (('auto', AxisType.Auto), ('explicit', AxisType.Explicit))
COLLECTIVES = (
    'all-gather',
    'all-reduce',
    'reduce-scatter',
    'collective-permute',
    'all-to-all',
)


def make_mesh(shape, names, axis_type):
  return jax.make_mesh(shape, names, axis_types=(axis_type,) * len(names))


def place(x, mesh, spec):
  """``x`` laid out over ``mesh`` as ``spec`` says (Explicit meshes need it)."""
  return jax.device_put(x, NamedSharding(mesh, spec))


def per_device(a, n=8):
  """Rows of ``a`` split over ``n`` devices: ``(n, rows // n, ...)``."""
  a = np.asarray(a)
  return a.reshape(n, a.shape[0] // n, *a.shape[1:])


def add(acc, value):
  return acc + value


def zero():
  return jnp.float32(0.0)


def assert_close(actual, expected, rtol=1e-5, atol=1e-6, msg=''):
  a_leaves, a_tree = jax.tree_util.tree_flatten(actual)
  e_leaves, e_tree = jax.tree_util.tree_flatten(expected)
  assert a_tree == e_tree, f'{msg}: structure {a_tree} != {e_tree}'
  for a, e in zip(a_leaves, e_leaves):
    assert np.shape(a) == np.shape(e), f'{msg}: {np.shape(a)} != {np.shape(e)}'
    np.testing.assert_allclose(
        np.asarray(a), np.asarray(e), rtol=rtol, atol=atol, err_msg=msg
    )


def assert_collected(test, collected, expected, rtol=1e-5, atol=1e-6):
  """``collected`` has exactly ``expected``'s names, in order, and values."""
  test.assertEqual(list(collected), list(expected))
  for name, value in expected.items():
    if isinstance(value, tuple):
      test.assertIsInstance(collected[name], tuple, msg=repr(name))
      test.assertLen(collected[name], len(value), msg=repr(name))
    assert_close(collected[name], value, rtol, atol, msg=repr(name))


def collective_counts(compiled_text: str) -> dict[str, int]:
  """How often each collective opcode occurs in optimised HLO text."""
  ops = re.findall(
      r'^\s*(?:ROOT )?%\S+ = (?:\([^)]*\)|\S+) ([\w-]+)\(',
      compiled_text,
      re.MULTILINE,
  )
  return {c: sum(op in (c, f'{c}-start') for op in ops) for c in COLLECTIVES}


# ----------------------------------------------------------------------------
# The data-parallel MLP of Must show 1, written once; ``emit`` marks values.


def mlp_body(params, x, emit):
  w1, w2 = params
  h = emit(jnp.tanh(x @ w1), 'h1')
  out = emit(h @ w2, 'out')
  loss = jax.lax.pmean(jnp.mean(out**2), 'data')
  return emit(loss, 'loss')


def sow_emit(value, name):
  return sow(value, name=name)


def mlp_reference(x=X):
  """The same MLP on one device, without sow."""
  h = np.tanh(x @ W1)
  out = h @ W2
  return h, out, np.mean(out**2)


# ----------------------------------------------------------------------------
# 1. Data parallel over a ('data',) mesh of 8, and pmap.


class DataParallelTest(parameterized.TestCase):

  @parameterized.product(axis_type=AXIS_TYPES, jit=(False, True))
  def test_mlp_activations_per_device(self, axis_type, jit):
    mesh = make_mesh((8,), ('data',), axis_type[1])
    loss_fn = jax.shard_map(
        lambda p, x: mlp_body(p, x, sow_emit),
        mesh=mesh,
        in_specs=(P(), P('data')),
        out_specs=P(),
    )
    params = place((W1, W2), mesh, P())
    x = place(X, mesh, P('data'))
    g = capture(loss_fn)
    loss, collected = (jax.jit(g) if jit else g)(params, x)

    h, out, expected_loss = mlp_reference()
    np.testing.assert_allclose(loss, expected_loss, rtol=1e-5)
    np.testing.assert_allclose(loss, loss_fn(params, x), rtol=1e-6)
    assert_collected(
        self,
        collected,
        {
            'h1': (per_device(h),),  # (8, 2, 6)
            'out': (per_device(out),),  # (8, 2, 3)
            'loss': (expected_loss,),  # after pmean: invariant, no axis
        },
    )

  @parameterized.named_parameters(('eager', False), ('jit', True))
  def test_pmap_of_the_same_body(self, jit):
    step = jax.pmap(
        lambda p, x: mlp_body(p, x, sow_emit),
        axis_name='data',
        in_axes=(None, 0),
    )
    g = capture(step)
    losses, collected = (jax.jit(g) if jit else g)((W1, W2), per_device(X))
    h, out, expected_loss = mlp_reference()
    np.testing.assert_allclose(losses, np.full(8, expected_loss), rtol=1e-5)
    # pmap does not track which values vary over its axis, so every value
    # has the leading device axis, as pmap's own outputs do.
    assert_collected(
        self,
        collected,
        {
            'h1': (per_device(h),),
            'out': (per_device(out),),
            'loss': (np.full(8, expected_loss, np.float32),),
        },
    )

  @parameterized.named_parameters(*AXIS_TYPES)
  def test_train_step_under_jit_and_grad(self, axis_type):
    mesh = make_mesh((8,), ('data',), axis_type)
    loss_fn = jax.shard_map(
        lambda p, x: mlp_body(p, x, sow_emit),
        mesh=mesh,
        in_specs=(P(), P('data')),
        out_specs=P(),
    )

    @jax.jit
    def train_step(params, x):
      (loss, grads), collected = capture(jax.value_and_grad(loss_fn))(params, x)
      new = jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)
      return new, loss, collected

    params = place((W1, W2), mesh, P())
    new, loss, collected = train_step(params, place(X, mesh, P('data')))

    def plain_loss(params):
      w1, w2 = params
      return jnp.mean((jnp.tanh(X @ w1) @ w2) ** 2)

    expected_grads = jax.grad(plain_loss)((W1, W2))
    h, out, expected_loss = mlp_reference()
    np.testing.assert_allclose(loss, expected_loss, rtol=1e-5)
    assert_close(
        new,
        jax.tree.map(lambda p, g: p - 0.1 * g, (W1, W2), expected_grads),
    )
    assert_collected(
        self,
        collected,
        {
            'h1': (per_device(h),),
            'out': (per_device(out),),
            'loss': (expected_loss,),
        },
    )

  @parameterized.named_parameters(
      ('auto', AxisType.Auto, False),
      ('explicit', AxisType.Explicit, False),
      ('explicit_set_mesh', AxisType.Explicit, True),
  )
  def test_nnx_module_sow_with_split_and_merge_in_the_body(
      self, axis_type, set_mesh
  ):

    class Block(nnx.Module):

      def __init__(self, din, dout, rngs):
        self.linear = nnx.Linear(din, dout, rngs=rngs)

      def __call__(self, x):
        h = jnp.tanh(self.linear(x))
        self.sow(nnx.Intermediate, 'h', h)
        self.sow(
            nnx.Intermediate,
            'dead',
            (h <= 0).sum(dtype=jnp.int32),
            reduce_fn=lambda a, v: a + v,
            init_fn=lambda: jnp.int32(0),
        )
        return h

    class MLP(nnx.Module):

      def __init__(self, rngs):
        self.l1 = Block(4, 6, rngs)
        self.l2 = Block(6, 3, rngs)

      def __call__(self, x):
        return self.l2(self.l1(x))

    mesh = make_mesh((8,), ('data',), axis_type)
    model = MLP(nnx.Rngs(0))

    def loss(model, x):
      graphdef, state = nnx.split(model)

      def body(state, x):
        return jax.lax.pmean(
            jnp.mean(nnx.merge(graphdef, state)(x) ** 2), 'data'
        )

      return jax.shard_map(
          body, mesh=mesh, in_specs=(P(), P('data')), out_specs=P()
      )(state, x)

    x = place(X, mesh, P('data'))
    with jax.set_mesh(mesh) if set_mesh else _nothing():
      out, intermediates = nnx.jit(nnx.capture(loss, nnx.Intermediate))(
          model, x
      )

    # The same forward pass, on one device, from the module's parameters.
    def linear(layer, x):
      return x @ np.asarray(layer.kernel[...]) + np.asarray(layer.bias[...])

    h1 = np.tanh(linear(model.l1.linear, X))
    h2 = np.tanh(linear(model.l2.linear, h1))
    np.testing.assert_allclose(out, np.mean(h2**2), rtol=1e-5)
    expected = {
        'l1': {
            'h': (per_device(h1),),
            'dead': per_device(h1 <= 0).sum((1, 2)),
        },
        'l2': {
            'h': (per_device(h2),),
            'dead': per_device(h2 <= 0).sum((1, 2)),
        },
    }
    got = nnx.to_pure_dict(intermediates)
    self.assertEqual(set(got), {'l1', 'l2'})
    for layer, values in expected.items():
      self.assertEqual(set(got[layer]), {'h', 'dead'})
      assert_close(got[layer]['h'], values['h'], msg=layer)
      np.testing.assert_array_equal(got[layer]['dead'], values['dead'])


class _nothing:

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    return False


# ----------------------------------------------------------------------------
# 2. A 2-D mesh ('data', 'model') of 4 x 2 with a tensor-parallel layer.


def tensor_parallel_body(x, w1, w2):
  """Column-parallel ``w1`` (split over 'model'), row-parallel ``w2``."""
  h = sow(x @ w1, name='h')  # varies over data and model
  sow(jnp.tanh(x).sum(1), name='row_sums')  # data only
  sow(jnp.linalg.norm(w1, axis=0), name='col_norms')  # model only
  y = jax.lax.psum(jnp.tanh(h) @ w2, 'model')  # data only
  sow(y, name='y')
  total = jax.lax.psum(y.sum(), 'data')  # invariant
  sow(total, name='total')
  return y


class TwoDimMeshTest(parameterized.TestCase):

  def setUp(self):
    super().setUp()
    # x: (8, 4) split over 'data'; w1: (4, 6) columns over 'model';
    # w2: (6, 5) rows over 'model'.
    self.x = X[:8]
    self.w2 = _rng.normal(size=(6, 5)).astype(np.float32)

  def expected(self, check_vma=True):
    x, w1, w2 = self.x, W1, self.w2
    h = x @ w1
    # Shard [d, m] holds rows 2d:2d+2 and columns 3m:3m+3.
    h_layout = h.reshape(4, 2, 2, 3).transpose(0, 2, 1, 3)
    row_sums = np.tanh(x).sum(1).reshape(4, 2)
    col_norms = np.linalg.norm(w1, axis=0).reshape(2, 3)
    y = np.tanh(h) @ w2
    total = y.sum()
    if check_vma:
      return {
          'h': (h_layout,),  # (4, 2, 2, 3)
          'row_sums': (row_sums,),  # (4, 2)
          'col_norms': (col_norms,),  # (2, 3)
          'y': (y.reshape(4, 2, 5),),  # (4, 2, 5)
          'total': (total,),  # ()
      }
    # Without check_vma every value gets both mesh axes.
    return {
        'h': (h_layout,),
        'row_sums': (np.repeat(row_sums[:, None], 2, 1),),  # (4, 2, 2)
        'col_norms': (np.repeat(col_norms[None], 4, 0),),  # (4, 2, 3)
        'y': (np.repeat(y.reshape(4, 1, 2, 5), 2, 1),),  # (4, 2, 2, 5)
        'total': (np.full((4, 2), total, np.float32),),
    }

  def sharded(self, mesh, check_vma=True):
    return jax.shard_map(
        tensor_parallel_body,
        mesh=mesh,
        in_specs=(P('data'), P(None, 'model'), P('model')),
        out_specs=P('data'),
        check_vma=check_vma,
    )

  def inputs(self, mesh):
    return (
        place(self.x, mesh, P('data')),
        place(W1, mesh, P(None, 'model')),
        place(self.w2, mesh, P('model')),
    )

  @parameterized.product(axis_type=AXIS_TYPES, jit=(False, True))
  def test_leading_axes_follow_the_varying_axes(self, axis_type, jit):
    mesh = make_mesh((4, 2), ('data', 'model'), axis_type[1])
    g = capture(self.sharded(mesh))
    y, collected = (jax.jit(g) if jit else g)(*self.inputs(mesh))
    expected = self.expected()
    np.testing.assert_allclose(
        y, np.tanh(self.x @ W1) @ self.w2, rtol=1e-5, atol=1e-5
    )
    assert_collected(self, collected, expected, atol=1e-5)

  def test_without_check_vma_every_manual_axis_leads(self):
    mesh = make_mesh((4, 2), ('data', 'model'), AxisType.Auto)
    _, collected = capture(self.sharded(mesh, check_vma=False))(
        *self.inputs(mesh)
    )
    assert_collected(self, collected, self.expected(False), atol=1e-5)


# ----------------------------------------------------------------------------
# 3. Sharding kept: no collective added, the new axes partitioned.


class ShardingKeptTest(parameterized.TestCase):

  def assert_partitioned(self, array, mesh, axes):
    """``array``'s leading axes are split over the mesh ``axes``."""
    sharding = array.sharding
    self.assertIsInstance(sharding, NamedSharding)
    self.assertEqual(sharding.mesh.shape, mesh.shape)
    spec = tuple(sharding.spec) + (None,) * (array.ndim - len(sharding.spec))
    self.assertEqual(spec, (*axes, *(None,) * (array.ndim - len(axes))))
    # Each device holds exactly its own shard.
    self.assertLen(array.addressable_shards, 8)
    for shard in array.addressable_shards:
      self.assertEqual(
          shard.data.shape[: len(axes)], (1,) * len(axes), msg=str(spec)
      )

  @parameterized.named_parameters(*AXIS_TYPES)
  def test_tensor_parallel_step_adds_no_collective(self, axis_type):
    mesh = make_mesh((4, 2), ('data', 'model'), axis_type)
    x = place(X[:8], mesh, P('data'))
    w1 = place(W1, mesh, P(None, 'model'))

    def body(x, w1, emit):
      h = emit(x @ w1, 'h')  # data, model
      emit(jnp.tanh(x).sum(1), 'row_sums')  # data
      y = jax.lax.psum(jnp.tanh(h), 'model')
      total = emit(jax.lax.psum(y.sum(), 'data'), 'total')  # invariant
      return y, total

    specs = dict(
        mesh=mesh,
        in_specs=(P('data'), P(None, 'model')),
    )
    f = jax.shard_map(
        lambda x, w1: body(x, w1, sow_emit),
        out_specs=(P('data'), P()),
        **specs,
    )

    def by_hand(x, w1):
      values = {}

      def emit(value, name):
        values[name] = value
        return value

      y, total = body(x, w1, emit)
      return (
          y,
          total,
          values['h'][None, None],
          values['row_sums'][None],
          values['total'],
      )

    manual = jax.shard_map(
        by_hand,
        out_specs=(P('data'), P(), P('data', 'model'), P('data'), P()),
        **specs,
    )
    captured = jax.jit(capture(f))
    manual = jax.jit(manual)
    counts = collective_counts(captured.lower(x, w1).compile().as_text())
    self.assertEqual(
        counts, collective_counts(manual.lower(x, w1).compile().as_text())
    )
    self.assertGreater(counts['all-reduce'], 0)  # the program has psums

    (_, total), collected = captured(x, w1)
    _, _, h, row_sums, by_hand_total = manual(x, w1)
    assert_collected(
        self,
        collected,
        {'h': (h,), 'row_sums': (row_sums,), 'total': (by_hand_total,)},
    )
    np.testing.assert_allclose(
        h,
        (X[:8] @ W1).reshape(4, 2, 2, 3).transpose(0, 2, 1, 3),
        rtol=1e-5,
        atol=1e-6,
    )
    self.assert_partitioned(collected['h'][0], mesh, ('data', 'model'))
    self.assert_partitioned(collected['row_sums'][0], mesh, ('data',))
    self.assertEqual(collected['total'][0].sharding.spec, P())

  @parameterized.named_parameters(*AXIS_TYPES)
  def test_data_parallel_grad_step_adds_no_collective(self, axis_type):
    mesh = make_mesh((8,), ('data',), axis_type)
    params = place((W1, W2), mesh, P())
    x = place(X, mesh, P('data'))

    def body(params, x, emit):
      loss = mlp_body(params, x, emit)
      emit(jnp.abs(x).sum(), 'abs_sum', reduce=True)
      return loss

    def sow_emit2(value, name, reduce=False):
      if reduce:
        return sow(value, name=name, reduce_fn=add, init_fn=zero)
      return sow(value, name=name)

    f = jax.shard_map(
        lambda p, x: body(p, x, sow_emit2),
        mesh=mesh,
        in_specs=(P(), P('data')),
        out_specs=P(),
    )

    def by_hand(params, x):
      values = {}

      def emit(value, name, reduce=False):
        values[name] = value
        return value

      return body(params, x, emit), {
          'h1': values['h1'][None],
          'out': values['out'][None],
          'abs_sum': values['abs_sum'][None],
      }

    manual = jax.shard_map(
        by_hand,
        mesh=mesh,
        in_specs=(P(), P('data')),
        out_specs=(P(), P('data')),
    )
    captured = jax.jit(capture(jax.grad(f)))
    manual = jax.jit(jax.grad(manual, has_aux=True))
    counts = collective_counts(captured.lower(params, x).compile().as_text())
    self.assertEqual(
        counts,
        collective_counts(manual.lower(params, x).compile().as_text()),
    )
    self.assertGreater(counts['all-reduce'], 0)

    grads, collected = captured(params, x)
    grads_by_hand, values = manual(params, x)
    assert_close(grads, grads_by_hand)
    self.assertEqual(list(collected), ['h1', 'out', 'loss', 'abs_sum'])
    assert_close(collected['h1'], (values['h1'],))
    assert_close(collected['abs_sum'], np.abs(per_device(X)).sum((1, 2)))
    self.assert_partitioned(collected['h1'][0], mesh, ('data',))
    self.assert_partitioned(collected['abs_sum'], mesh, ('data',))


# ----------------------------------------------------------------------------
# 4. Reductions per shard, and perturb.


def add_pairs(acc, value):
  return acc[0] + value[0], acc[1] + value[1]


def zero_pair():
  return jnp.float32(0.0), jnp.float32(0.0)


def neg_inf():
  return jnp.float32(-jnp.inf)


def reducing_body(x):
  """Reduced sows at the top of the body and in a scan over its rows."""
  sow(x.sum(), name='total', reduce_fn=add, init_fn=zero)
  sow(x.max(), name='peak', reduce_fn=jnp.maximum, init_fn=neg_inf)

  def step(carry, row):
    sow(row.sum(), name='total', reduce_fn=add, init_fn=zero)
    # A mean as (sum, count): the count does not vary over the mesh.
    sow(
        (row.sum(), jnp.float32(row.size)),
        name='mean',
        reduce_fn=add_pairs,
        init_fn=zero_pair,
    )
    sow(row.max(), name='peak', reduce_fn=jnp.maximum, init_fn=neg_inf)
    sow(row.sum(), name='row_sums')  # plain, stacked per step
    return carry + row, None

  carry = jax.lax.pcast(jnp.zeros(x.shape[1:]), ('data',), to='varying')
  carry, _ = jax.lax.scan(step, carry, x)
  return carry[None]


class ReductionTest(parameterized.TestCase):

  @parameterized.product(axis_type=AXIS_TYPES, jit=(False, True))
  def test_each_shard_folds_its_own_values(self, axis_type, jit):
    mesh = make_mesh((8,), ('data',), axis_type[1])
    x = _rng.normal(size=(16, 3)).astype(np.float32)
    f = jax.shard_map(
        reducing_body, mesh=mesh, in_specs=P('data'), out_specs=P('data')
    )
    g = capture(f)
    out, collected = (jax.jit(g) if jit else g)(place(x, mesh, P('data')))

    shards = per_device(x)  # (8, 2, 3)
    np.testing.assert_allclose(out, shards.sum(1), rtol=1e-5, atol=1e-6)
    self.assertEqual(list(collected), ['total', 'peak', 'mean', 'row_sums'])
    # Per shard: the top-level sow and one per row.
    assert_close(collected['total'], 2 * shards.sum((1, 2)))
    assert_close(collected['peak'], shards.max((1, 2)))
    assert_close(
        collected['mean'],
        (shards.sum((1, 2)), np.full(8, 6.0, np.float32)),
    )
    assert_close(collected['row_sums'], (shards.sum(2),))  # (8, steps)
    # Combined by the user, they give the single-device results.
    sums, counts = collected['mean']
    np.testing.assert_allclose(sums.sum() / counts.sum(), x.mean(), rtol=1e-5)
    np.testing.assert_allclose(collected['peak'].max(), x.max())
    np.testing.assert_allclose(collected['total'].sum(), 2 * x.sum(), rtol=1e-5)

  def test_two_shard_maps_fold_into_the_same_per_shard_accumulators(self):
    mesh = make_mesh((8,), ('data',), AxisType.Auto)

    def body(x):
      sow(x.sum(), name='total', reduce_fn=add, init_fn=zero)
      return x * 2

    f = jax.shard_map(body, mesh=mesh, in_specs=P('data'), out_specs=P('data'))
    _, collected = jax.jit(capture(lambda x: f(f(x))))(X)
    assert_collected(self, collected, {'total': 3 * per_device(X).sum((1, 2))})

  def test_reduce_fn_that_drops_the_accumulator(self):
    # ``reduce_fn`` returns a value that does not vary over the mesh; the
    # accumulator stays one per shard (the last value sown there).
    mesh = make_mesh((8,), ('data',), AxisType.Auto)

    def body(x):
      def step(carry, row):
        sow(
            jnp.float32(1.0),
            name='last',
            reduce_fn=lambda a, v: v,
            init_fn=zero,
        )
        return carry + row, None

      carry = jax.lax.pcast(jnp.zeros(4), ('data',), to='varying')
      carry, _ = jax.lax.scan(step, carry, x)
      sow(x.sum(), name='last', reduce_fn=lambda a, v: v, init_fn=zero)
      return carry[None]

    f = jax.shard_map(body, mesh=mesh, in_specs=P('data'), out_specs=P('data'))
    _, collected = jax.jit(capture(f))(X)
    assert_collected(self, collected, {'last': per_device(X).sum((1, 2))})

  @parameterized.product(axis_type=AXIS_TYPES, jit=(False, True))
  def test_perturb_cotangents_per_shard(self, axis_type, jit):
    mesh = make_mesh((8,), ('data',), axis_type[1])

    def body(x, w):
      h = perturb(jnp.tanh(x @ w), name='dh')

      def step(carry, row):
        return carry + perturb(row, name='drow').sum() ** 2, None

      start = jax.lax.pcast(jnp.float32(0.0), ('data',), to='varying')
      acc, _ = jax.lax.scan(step, start, h)
      return jax.lax.psum((h**2).sum() + acc, 'data')

    loss = jax.shard_map(
        body, mesh=mesh, in_specs=(P('data'), P()), out_specs=P()
    )
    g = capture(jax.grad(loss, argnums=1))
    # (Eagerly, JAX differentiates a shard_map on an Explicit mesh only in
    # that mesh's context.)
    with jax.set_mesh(mesh):
      grad_w, collected = (jax.jit(g) if jit else g)(
          place(X, mesh, P('data')), place(W1, mesh, P())
      )

    # The same loss on one device, with zeros added where the perturbs are.
    def plain(w, dh, drow):
      h = jnp.tanh(X @ w) + dh
      rows = (h + drow).reshape(8, 2, 6).sum(2)
      return (h**2).sum() + (rows**2).sum()

    zeros = jnp.zeros((16, 6))
    expected_w, expected_dh, expected_drow = jax.grad(plain, (0, 1, 2))(
        W1, zeros, zeros
    )
    assert_close(grad_w, expected_w, rtol=1e-4)
    assert_collected(
        self,
        collected,
        {
            'dh': (per_device(expected_dh),),  # (8, 2, 6)
            'drow': (per_device(expected_drow),),  # (8, steps, 6)
        },
        rtol=1e-4,
    )

  def test_perturb_on_a_two_dim_mesh(self):
    mesh = make_mesh((4, 2), ('data', 'model'), AxisType.Explicit)

    def body(x, w):
      h = perturb(jnp.tanh(x @ w), name='dh')
      return jax.lax.psum((h**2).sum(), ('data', 'model'))

    loss = jax.shard_map(
        body,
        mesh=mesh,
        in_specs=(P('data'), P(None, 'model')),
        out_specs=P(),
    )
    # (Eagerly, JAX cannot differentiate this shard_map on an Explicit
    # mesh without a mesh context; under jit it can.)
    _, collected = jax.jit(capture(jax.grad(loss, argnums=1)))(
        place(X[:8], mesh, P('data')), place(W1, mesh, P(None, 'model'))
    )
    dh = jax.grad(lambda z: ((jnp.tanh(X[:8] @ W1) + z) ** 2).sum())(
        jnp.zeros((8, 6))
    )
    assert_collected(
        self,
        collected,
        {'dh': (np.asarray(dh).reshape(4, 2, 2, 3).transpose(0, 2, 1, 3),)},
        rtol=1e-4,
    )


# ----------------------------------------------------------------------------
# 5. Nested constructs, each also under jax.grad and jax.jit.


@functools.cache
def mesh_1d():
  return make_mesh((8,), ('data',), AxisType.Auto)


def over_data(body):
  return jax.shard_map(
      body, mesh=mesh_1d(), in_specs=P('data'), out_specs=P('data')
  )


def shard_map_in_scan():
  def f(xs):
    def step(carry, x):
      y = over_data(lambda x: sow(jnp.tanh(x), name='t'))(x)
      return carry + y.sum(), None

    return jax.lax.scan(step, 0.0, xs)[0]

  plain = lambda xs: jnp.tanh(xs).sum()
  return f, plain, XS, {'t': (np.tanh(XS).reshape(5, 8, 2, 3),)}


def scan_in_shard_map():
  def body(x):
    def step(c, row):
      return c + 1.0, sow(row * c, name='scaled')

    return jax.lax.scan(step, 1.0, x)[1]

  x = XS[0]
  plain = lambda x: x * jnp.tile(jnp.array([[1.0], [2.0]]), (8, 1))
  # (8 devices, 2 steps, 3): the step axis after the mesh axis.
  expected = per_device(x) * np.array([1.0, 2.0])[None, :, None]
  return over_data(body), plain, x, {'scaled': (expected,)}


def remat_in_shard_map():
  @jax.checkpoint
  def layer(x):
    h = sow(jnp.sin(x), name='h')
    sow(h.sum(), name='h_sum', reduce_fn=add, init_fn=zero)
    return h * 2

  x = XS[0]
  plain = lambda x: jnp.sin(x) * 2
  expected = {
      'h': (per_device(np.sin(x)),),
      'h_sum': per_device(np.sin(x)).sum((1, 2)),
  }
  return over_data(layer), plain, x, expected


def jit_in_shard_map():
  @jax.jit
  def layer(x):
    h = sow(jnp.sin(x), name='h')
    sow(h.sum(), name='h_sum', reduce_fn=add, init_fn=zero)
    return h * 2

  x = XS[0]
  plain = lambda x: jnp.sin(2 * jnp.sin(x)) * 2
  h1 = np.sin(x)
  h2 = np.sin(2 * h1)
  expected = {
      'h': (per_device(h1), per_device(h2)),
      'h_sum': per_device(h1 + h2).sum((1, 2)),
  }
  return over_data(lambda x: layer(layer(x))), plain, x, expected


def cond_in_shard_map():
  def body(x):
    def positive(x):
      sow(x.sum(), name='positive_sums', reduce_fn=add, init_fn=zero)
      return sow(x * 2, name='branch')

    def negative(x):
      return sow(x * 3, name='branch')

    return jax.lax.cond(x.sum() > 0, positive, negative, x)

  x = XS[0]
  shards = per_device(x)
  positive = shards.sum((1, 2)) > 0
  assert 0 < positive.sum() < 8  # shards take different branches
  scale = np.where(positive, 2.0, 3.0)[:, None, None]
  # Names in order of first sow branch by branch, as for any cond: the
  # false branch is branch 0.
  expected = {
      'branch': (shards * scale,),
      'positive_sums': np.where(positive, shards.sum((1, 2)), 0.0),
  }

  def plain(x):
    return (x.reshape(8, 2, 3) * scale).reshape(x.shape)

  return over_data(body), plain, x, expected


def shard_map_in_shard_map():
  mesh = make_mesh((4, 2), ('a', 'b'), AxisType.Explicit)

  def inner(x):
    return sow(x * 2, name='inner')

  def outer(x):
    y = jax.shard_map(
        inner, in_specs=P(None, 'b'), out_specs=P(None, 'b'), axis_names={'b'}
    )(x)
    return sow(y + 1, name='outer')

  f = jax.shard_map(
      outer, mesh=mesh, in_specs=P('a'), out_specs=P('a'), axis_names={'a'}
  )
  x = XS[0][:, :2].reshape(8, 4)
  expected = {
      # (a, b, local): the outer shard_map's axes first.
      'inner': ((2 * x).reshape(4, 2, 2, 2).transpose(0, 2, 1, 3),),
      'outer': ((2 * x + 1).reshape(4, 2, 4),),
  }
  return f, lambda x: 2 * x + 1, place(x, mesh, P('a', 'b')), expected


NESTED = {
    'shard_map_in_scan': shard_map_in_scan,
    'scan_in_shard_map': scan_in_shard_map,
    'remat_in_shard_map': remat_in_shard_map,
    'jit_in_shard_map': jit_in_shard_map,
    'cond_in_shard_map': cond_in_shard_map,
    'shard_map_in_shard_map': shard_map_in_shard_map,
}


class NestedTest(parameterized.TestCase):

  @parameterized.product(
      case=tuple(c for c in NESTED if c != 'shard_map_in_shard_map'),
      transform=('none', 'jit', 'grad'),
  )
  def test_nested(self, case, transform):
    self.check(case, transform)

  # JAX 0.10 cannot differentiate a shard_map nested in another one (the
  # transpose builds an invalid spec), with or without capture.
  @parameterized.parameters('none', 'jit')
  def test_shard_map_in_shard_map(self, transform):
    self.check('shard_map_in_shard_map', transform)

  def check(self, case, transform):
    f, plain, x, expected = NESTED[case]()
    if transform == 'grad':
      grad, collected = capture(jax.grad(lambda x: f(x).sum()))(x)
      assert_close(grad, jax.grad(lambda x: plain(x).sum())(np.asarray(x)))
    else:
      g = capture(f)
      out, collected = (jax.jit(g) if transform == 'jit' else g)(x)
      assert_close(out, plain(np.asarray(x)))
    assert_collected(self, collected, expected)


class UserCodeTest(absltest.TestCase):
  """Closures over a jit's tracers and fresh lambdas, as users write them."""

  def test_body_closes_over_the_tracers_of_an_enclosing_jit(self):
    @jax.jit
    def step(x, scale):
      def body(x):
        sow(
            x.sum(),
            name='scaled_sum',
            reduce_fn=lambda a, v: a + v * scale,
            init_fn=zero,
        )
        return sow(x * scale, name='scaled')

      return capture(over_data(body))(x)

    out, collected = step(X, jnp.float32(3.0))
    np.testing.assert_allclose(out, 3 * X, rtol=1e-6)
    assert_collected(
        self,
        collected,
        {
            'scaled_sum': 3 * per_device(X).sum((1, 2)),
            'scaled': (3 * per_device(X),),
        },
    )

  def test_fresh_lambdas_per_call(self):
    for i in range(3):
      f = over_data(
          lambda x: sow(
              x * i,
              name='v',
              reduce_fn=lambda a, v: a + v.sum(),
              init_fn=lambda: jnp.float32(i),
          )
      )
      out, collected = jax.jit(capture(f))(X)
      np.testing.assert_allclose(out, i * X)
      assert_collected(
          self, collected, {'v': i + i * per_device(X).sum((1, 2))}
      )


# ----------------------------------------------------------------------------
# Bad input: every case raises, naming the sow, the construct and the fix.


def _reduced_total(x):
  return sow(x.sum(), name='total', reduce_fn=add, init_fn=zero)


class BadInputTest(absltest.TestCase):

  def assert_message(self, error, *parts):
    for part in parts:
      self.assertIn(part, str(error))

  def test_reduced_name_inside_and_outside_a_shard_map(self):
    inside = over_data(lambda x: (_reduced_total(x), x)[1])

    def outside_first(x):
      _reduced_total(x)
      return inside(x)

    def inside_first(x):
      y = inside(x)
      _reduced_total(y)
      return y

    for name, f in (
        ('outside first', outside_first),
        ('inside first', inside_first),
    ):
      with self.subTest(name):
        with self.assertRaises(ValueError) as cm:
          capture(f)(X)
        self.assert_message(
            cm.exception,
            "sow 'total'",
            '`jax.shard_map`',
            'also outside it',
            'give the sites different names',
        )
        # Outside a capture the sows are identities.
        np.testing.assert_allclose(f(X), X)

  def test_reduced_name_varying_over_different_mesh_axes(self):
    mesh = make_mesh((4, 2), ('data', 'model'), AxisType.Auto)
    by_data = jax.shard_map(
        lambda x: (_reduced_total(x), x)[1],
        mesh=mesh,
        in_specs=P('data'),
        out_specs=P('data'),
    )
    by_both = jax.shard_map(
        lambda x: (_reduced_total(x), x)[1],
        mesh=mesh,
        in_specs=P('data', 'model'),
        out_specs=P('data', 'model'),
    )
    with self.assertRaises(ValueError) as cm:
      capture(lambda x: by_both(by_data(x)))(X[:8])
    self.assert_message(
        cm.exception, "sow 'total'", 'vary over different mesh axes'
    )

  def test_reduced_sow_in_a_nested_shard_map(self):
    mesh = make_mesh((4, 2), ('a', 'b'), AxisType.Explicit)
    inner = jax.shard_map(
        lambda x: (_reduced_total(x), x)[1],
        in_specs=P(None, 'b'),
        out_specs=P(None, 'b'),
        axis_names={'b'},
    )
    f = jax.shard_map(
        inner, mesh=mesh, in_specs=P('a'), out_specs=P('a'), axis_names={'a'}
    )
    x = place(X[:8], mesh, P('a', 'b'))
    with self.assertRaises(NotImplementedError) as cm:
      capture(f)(x)
    self.assert_message(
        cm.exception,
        "sow 'total'",
        'nested in another `jax.shard_map`',
        'Sow it in the outer shard_map body',
    )

  def test_plain_sow_in_a_shard_map_that_vmap_maps_over(self):
    def direct(x):
      return sow(x * 2, name='v')

    def in_scan(x):
      def step(c, row):
        return c, sow(row * 2, name='v')

      return jax.lax.scan(step, 0.0, x)[1]

    def in_cond(x):
      return jax.lax.cond(
          x.sum() > 0,
          lambda x: sow(x * 2, name='v'),
          lambda x: sow(x * 2, name='v'),
          x,
      )

    for body in (direct, in_scan, in_cond):
      with self.subTest(body.__name__):
        f = jax.vmap(over_data(body))
        with self.assertRaises(NotImplementedError) as cm:
          capture(f)(XS)
        self.assert_message(
            cm.exception,
            "sow 'v'",
            '`jax.shard_map`',
            '`jax.vmap`',
            'jax.vmap(capture(f))',
        )
        # Outside a capture the sow is the identity; and the vmap around
        # the capture, as the message says, collects with the mapped axis
        # first.
        np.testing.assert_allclose(f(XS), 2 * XS, rtol=1e-6)
        out, collected = jax.vmap(capture(over_data(body)))(XS)
        np.testing.assert_allclose(out, 2 * XS, rtol=1e-6)
        # (batch, device, row or step, 3)
        assert_collected(self, collected, {'v': (2 * XS.reshape(5, 8, 2, 3),)})

  def test_plain_sow_in_a_vmapped_shard_map_raises_on_every_route(self):
    # The check reads the name stack of the shard_map (or of the call, loop
    # or branch holding it) that the vmap staged: the same error whether
    # the vmap is applied directly, inside a jit, around a jit or a pmap,
    # under grad, or twice, and whether the capture is eager or jitted.
    def body(x):
      return sow(x * 2, name='v')

    def scan_of_vmapped(xs):  # the vmap inside a scan body
      return jax.lax.scan(
          lambda c, x: (c, jax.vmap(over_data(body))(x)), 0.0, xs
      )[1]

    routes = {
        'jit_around_vmap': (jax.jit(jax.vmap(over_data(body))), XS),
        'vmap_around_jit': (jax.vmap(jax.jit(over_data(body))), XS),
        'vmap_of_pmap': (jax.vmap(jax.pmap(body)), XS[:, :8]),
        'vmap_of_vmap': (jax.vmap(jax.vmap(over_data(body))), XS[None]),
        'vmap_of_grad': (
            jax.vmap(jax.grad(lambda x: over_data(body)(x).sum())),
            XS,
        ),
        'unbatched_predicate': (
            jax.vmap(
                lambda x: jax.lax.cond(
                    True, over_data(body), over_data(body), x
                )
            ),
            XS,
        ),
        'scan_of_vmapped': (scan_of_vmapped, XS[None]),
    }
    for route, (f, x) in routes.items():
      for how, run in (('eager', capture(f)), ('jit', jax.jit(capture(f)))):
        with self.subTest(route=route, how=how):
          with self.assertRaisesRegex(
              NotImplementedError,
              r"sow 'v'.*`jax\.shard_map` \(or `jax\.pmap`\) that"
              r' `jax\.vmap` maps over',
          ):
            run(x)

  def test_vmap_around_the_capture_or_inside_the_body_is_collected(self):
    # Only a vmap inside the capture and around the shard_map is refused:
    # one around the capture (whose name stack the capture's equations
    # carry too), one inside the body (its axis is the value's own, after
    # the mesh axes), and one around a scan that holds the shard_map (the
    # scan's sows are hoisted out of the batched scan, mapped axis first)
    # are collected. Expected values by hand from XS (5 steps of 16 rows).
    def body(x):
      return sow(x * 2, name='v')

    by_device = 2 * XS.reshape(5, 8, 2, 3).transpose(1, 0, 2, 3)
    inner = jax.shard_map(
        jax.vmap(body),
        mesh=mesh_1d(),
        in_specs=P(None, 'data'),
        out_specs=P(None, 'data'),
    )
    inner_jit = jax.shard_map(
        jax.vmap(jax.jit(body)),
        mesh=mesh_1d(),
        in_specs=P(None, 'data'),
        out_specs=P(None, 'data'),
    )
    for f in (inner, inner_jit):
      for run in (capture(f), jax.jit(capture(f))):
        out, collected = run(XS)
        np.testing.assert_allclose(out, 2 * XS, rtol=1e-6)
        # (device, batch, row, 3)
        assert_collected(self, collected, {'v': (by_device,)})
    # Around the capture as well: (outer batch, device, batch, row, 3).
    out, collected = jax.vmap(capture(inner))(np.stack([XS, -XS]))
    assert_collected(
        self, collected, {'v': (np.stack([by_device, -by_device]),)}
    )
    # A vmap around a scan whose body holds the shard_map: (batch, step,
    # device, row, 3).
    scanned = jax.vmap(
        lambda x: jax.lax.scan(
            lambda c, row: (c, over_data(body)(row)), 0.0, x[None]
        )[1]
    )
    for run in (capture(scanned), jax.jit(capture(scanned))):
      out, collected = run(XS)
      assert_collected(
          self, collected, {'v': (2 * XS.reshape(5, 1, 8, 2, 3),)}
      )

  def test_cond_on_a_batched_predicate_inside_a_shard_map_body(self):
    # A vmap inside the body over a cond whose predicate is per example
    # (and per shard): the branch taken is selected per example. Expected
    # by hand: the first branch doubles, the other negates.
    def in_cond(x):
      return jax.lax.cond(
          x.sum() > 0,
          lambda x: sow(x * 2, name='v'),
          lambda x: sow(-x, name='v'),
          x,
      )

    f = jax.shard_map(
        jax.vmap(in_cond),
        mesh=mesh_1d(),
        in_specs=P(None, 'data'),
        out_specs=P(None, 'data'),
    )
    local = XS.reshape(5, 8, 2, 3).transpose(1, 0, 2, 3)  # (device, batch)
    taken = local.sum(axis=(2, 3), keepdims=True) > 0
    expected = np.where(taken, 2 * local, -local)
    for run in (capture(f), jax.jit(capture(f))):
      out, collected = run(XS)
      np.testing.assert_allclose(
          out, expected.transpose(1, 0, 2, 3).reshape(5, 16, 3), rtol=1e-6
      )
      assert_collected(self, collected, {'v': (expected,)})

  def test_reduced_sow_in_a_vmapped_shard_map_is_collected(self):
    # The error's last suggestion: a reduced sow folds every example into
    # the accumulator of each shard, so its layout has no mapped axis.
    f = jax.vmap(over_data(lambda x: (_reduced_total(x), x)[1]))
    per_device = XS.reshape(5, 8, 2, 3).sum(axis=(0, 2, 3))
    for run in (capture(f), jax.jit(capture(f))):
      out, collected = run(XS)
      np.testing.assert_allclose(out, XS)
      assert_collected(self, collected, {'total': per_device}, rtol=1e-4)

  def test_sow_in_a_mapped_construct_without_a_rule(self):
    @custom_partitioning
    def partitioned(x):
      return sow(jnp.sin(x), name='inside_partitioned')

    def partition(mesh, arg_shapes, result_shape):
      sharding = arg_shapes[0].sharding
      return mesh, jnp.sin, sharding, (sharding,)

    partitioned.def_partition(
        partition=partition,
        infer_sharding_from_operands=lambda m, a, r: a[0].sharding,
        sharding_rule='i j -> i j',
    )
    with self.assertRaises(NotImplementedError) as cm:
      capture(partitioned)(X)
    self.assert_message(
        cm.exception,
        "sow 'inside_partitioned'",
        '`custom_partitioning`',
        'has no capture rule',
        'Sow the value outside that construct',
    )
    np.testing.assert_allclose(jax.jit(partitioned)(X), np.sin(X), rtol=1e-6)

  def test_shard_map_without_its_rule_raises_instead_of_dropping(self):
    rules = {
        k: v for k, v in collect_rules.items() if k is not _jax.shard_map_p
    }
    f = over_data(lambda x: sow(x * 2, name='doubled'))
    with mock.patch.dict(collect_rules, rules, clear=True):
      for g in (f, jax.pmap(lambda x: sow(x * 2, name='doubled'))):
        with self.assertRaises(NotImplementedError) as cm:
          capture(g)(X if g is f else per_device(X))
        self.assert_message(
            cm.exception, "sow 'doubled'", '`jax.shard_map`', 'collect_rules'
        )


# ----------------------------------------------------------------------------
# 6. A real multi-process run: two processes on localhost, 4 devices each.


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(('localhost', 0))
    return s.getsockname()[1]


class MultiProcessTest(absltest.TestCase):

  TIMEOUT_S = 120

  @pytest.mark.multiprocess
  def test_two_processes_collect_their_addressable_shards(self):
    # The reference: the train step on one device, without shard_map or
    # sow (multiprocess_worker.reference), saved for the workers.
    sys.path.insert(0, str(WORKER.parent))
    try:
      import multiprocess_worker  # pylint: disable=g-import-not-at-top
    finally:
      sys.path.remove(str(WORKER.parent))
    reference = multiprocess_worker.reference()

    with tempfile.TemporaryDirectory() as tmp:
      ref_path = os.path.join(tmp, 'reference.npz')
      np.savez(ref_path, **reference)
      env = dict(os.environ)
      flags = re.sub(
          r'--xla_force_host_platform_device_count=\d+',
          '',
          env.get('XLA_FLAGS', ''),
      )
      env['XLA_FLAGS'] = (
          f'{flags} --xla_force_host_platform_device_count=4'.strip()
      )
      env['JAX_PLATFORMS'] = 'cpu'
      port = _free_port()
      procs = []
      try:
        for i in range(2):
          procs.append(
              subprocess.Popen(
                  [sys.executable, str(WORKER), str(i), str(port), ref_path],
                  env=env,
                  stdout=subprocess.PIPE,
                  stderr=subprocess.STDOUT,
                  text=True,
              )
          )
        deadline = time.monotonic() + self.TIMEOUT_S
        outputs, timed_out = [], False
        for p in procs:
          try:
            remaining = max(1.0, deadline - time.monotonic())
            outputs.append(p.communicate(timeout=remaining)[0])
          except subprocess.TimeoutExpired:
            timed_out = True
            break
        if timed_out:
          for p in procs:
            p.kill()
          outputs = [p.communicate()[0] for p in procs]
          self.fail(
              f'the two processes did not finish within {self.TIMEOUT_S} s:\n'
              + '\n'.join(
                  f'--- process {i}:\n{out}' for i, out in enumerate(outputs)
              )
          )
      finally:
        for p in procs:  # never leave a process behind
          if p.poll() is None:
            p.kill()
            p.wait()

    for i, (p, output) in enumerate(zip(procs, outputs)):
      self.assertEqual(p.returncode, 0, msg=f'process {i}:\n{output}')
      reports = [
          json.loads(line[len('RESULT ') :])
          for line in output.splitlines()
          if line.startswith('RESULT ')
      ]
      self.assertLen(reports, 1, msg=output)
      report = reports[0]
      self.assertEqual(report['process_index'], i)
      self.assertEqual(report['process_count'], 2)
      self.assertEqual(report['device_count'], 8)
      # Every collected array was checked, shard by shard, on this process.
      self.assertEqual(
          sorted(report['checked']), sorted(multiprocess_worker.COLLECTED)
      )
      for name, shards in report['checked'].items():
        self.assertEqual(shards, 4, msg=name)


if __name__ == '__main__':
  absltest.main()


class ReviewRegressionTest(parameterized.TestCase):
  """Programs a fresh reviewer wrote that once gave wrong results."""

  @parameterized.named_parameters(*AXIS_TYPES)
  def test_while_with_per_device_trip_count(self, axis_type):
    # A reduced step counter: the value sown is the same everywhere, but the
    # loop runs a different number of times on each device.
    mesh = make_mesh((8,), ('data',), axis_type)
    xs = np.arange(1, 9, dtype=np.float32)

    def body(x):
      def step(v):
        sow(
            1,
            name='steps',
            reduce_fn=lambda a, b: a + b,
            init_fn=lambda: jnp.zeros((), jnp.int32),
        )
        return v * 2.0

      return jax.lax.while_loop(lambda v: v[0] < 100.0, step, x)

    f = jax.shard_map(body, mesh=mesh, in_specs=P('data'), out_specs=P('data'))
    expected = np.array([int(np.ceil(np.log2(100.0 / k))) for k in xs])
    x = place(xs, mesh, P('data'))
    for run in (capture(f), jax.jit(capture(f))):
      out, collected = run(x)
      np.testing.assert_array_equal(out, xs * 2.0**expected)
      np.testing.assert_array_equal(collected['steps'], expected)

  @parameterized.named_parameters(*AXIS_TYPES)
  def test_cond_with_per_device_predicate(self, axis_type):
    mesh = make_mesh((8,), ('data',), axis_type)
    xs = np.arange(8, dtype=np.float32)

    def body(x):
      def big(v):
        sow(
            1,
            name='n_big',
            reduce_fn=lambda a, b: a + b,
            init_fn=lambda: jnp.zeros((), jnp.int32),
        )
        sow(jnp.float32(1.0), name='which')
        return v

      def small(v):
        sow(jnp.float32(0.0), name='which')
        return v

      return jax.lax.cond(x[0] >= 4.0, big, small, x)

    f = jax.shard_map(body, mesh=mesh, in_specs=P('data'), out_specs=P('data'))
    _, collected = jax.jit(capture(f))(place(xs, mesh, P('data')))
    np.testing.assert_array_equal(collected['n_big'], (xs >= 4).astype(int))
    np.testing.assert_array_equal(collected['which'][0], (xs >= 4) * 1.0)

  def test_reduce_fn_used_in_pmap_then_outside(self):
    # A constant JAX cached inside the pmap's body (typed for its manual
    # mesh) must not leak into a later capture's accumulator.
    xs = np.arange(24, dtype=np.float32).reshape(8, 3)
    capture(
        jax.pmap(
            lambda x: sow(x.sum(), name='a', reduce_fn=add, init_fn=zero),
            axis_name='i',
        )
    )(xs)
    mesh = make_mesh((8,), ('data',), AxisType.Explicit)

    def f(x):
      sow(x.sum(), name='total', reduce_fn=add, init_fn=zero)
      return x

    _, collected = capture(f)(place(xs, mesh, P('data')))
    np.testing.assert_allclose(collected['total'], xs.sum())


class InterveneTest(parameterized.TestCase):

  @parameterized.named_parameters(*AXIS_TYPES)
  def test_callable_applied_per_shard(self, axis_type):
    mesh = make_mesh((8,), ('data',), axis_type)
    xs = (np.arange(16, dtype=np.float32) / 10).reshape(8, 2)
    steer = np.array([1.0, -1.0], np.float32)

    def body(x):
      h = sow(jnp.tanh(x), name='h')
      return jax.lax.psum((h * 2.0).sum(), 'data')

    f = jax.shard_map(body, mesh=mesh, in_specs=P('data'), out_specs=P())
    x = place(xs, mesh, P('data'))
    steered = intervene(f, {'h': lambda h: h + steer})
    expected = ((np.tanh(xs) + steer) * 2.0).sum()
    assert_close(steered(x), expected, rtol=1e-5)
    assert_close(jax.jit(steered)(x), expected, rtol=1e-5)
    _, collected = capture(steered)(x)
    assert_close(
        collected['h'][0], (np.tanh(xs) + steer).reshape(8, 1, 2), rtol=1e-5
    )
    pmapped = jax.pmap(lambda x: sow(x * 2.0, name='p').sum())
    assert_close(
        intervene(pmapped, {'p': lambda v: v + 1.0})(xs),
        (xs * 2.0 + 1.0).sum(1),
        rtol=1e-5,
    )


# ----------------------------------------------------------------------------
# Values computed from per-device control flow (``control.py``): JAX types
# the outputs of a cond/switch on a per-device index, or of a while_loop with
# a per-device trip count, as the same on every device; sown, they still
# come back one per device.

XC = np.arange(16, dtype=np.float32)  # device d holds [2d, 2d + 1]
BIG = np.arange(8) >= 4  # x[0] >= 8.0, per device
SCALE = np.where(BIG, 2.0, 3.0).astype(np.float32)  # the branch taken
W = np.float32(1.5)


def branch_scale(x, w):
  """``w * 2`` where the shard's first value is >= 8, else ``w * 3``: a
  value that differs per device but that JAX types as invariant."""
  return jax.lax.cond(x[0] >= 8.0, lambda: w * 2.0, lambda: w * 3.0)


def count_up_to(x):
  """``ceil(x[0])`` steps of a while_loop: a per-device trip count."""
  return jax.lax.while_loop(lambda c: c < x[0], lambda c: c + 1.0, 0.0)


def per_device_outputs(fn, mesh, in_specs):
  """``fn``'s outputs as each device computes them, without sow: the same
  shard_map returning them with a leading ``P('data')`` axis."""

  def body(*args):
    return [o[None] for o in fn(*args)]

  return jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=P('data'))


class PerDeviceControlFlowTest(parameterized.TestCase):

  def _inputs(self, mesh):
    return place(XC, mesh, P('data')), place(W, mesh, P())

  @parameterized.product(axis_type=AXIS_TYPES, jit=(False, True))
  def test_sow_after_cond_and_switch(self, axis_type, jit):
    mesh = make_mesh((8,), ('data',), axis_type[1])

    def values(x, w):
      y = branch_scale(x, w)
      k = jax.lax.switch(
          x[0].astype(jnp.int32) % 3,
          [lambda: 0.0, lambda: 1.0, lambda: 2.0],
      )
      return y, jnp.sin(y) + 1.0, k

    def body(x, w):
      y, z, k = values(x, w)
      sow(y, name='y')  # directly after the cond
      sow(z, name='z')  # after further arithmetic
      sow(k, name='k')  # lax.switch
      sow(w * 5.0, name='indep')  # does not depend on the branch
      sow(jax.lax.psum(y, 'data'), name='total')  # the same everywhere
      return x + y

    f = jax.shard_map(
        body, mesh=mesh, in_specs=(P('data'), P()), out_specs=P('data')
    )
    g = jax.jit(capture(f)) if jit else capture(f)
    out, collected = g(*self._inputs(mesh))

    y = W * SCALE
    k = (2 * np.arange(8) % 3).astype(np.float32)
    # The same values as each device computes them, returned without sow.
    ref_y, ref_z, ref_k = per_device_outputs(values, mesh, (P('data'), P()))(
        *self._inputs(mesh)
    )
    assert_close(ref_y, y)
    assert_close(ref_k, k)
    assert_close(out, XC + np.repeat(y, 2))
    assert_collected(
        self,
        collected,
        {
            'y': (y,),
            'z': (np.sin(y) + 1.0,),
            'k': (k,),
            'indep': (np.float32(W * 5.0),),  # one value, as before
            'total': (np.float32(y.sum()),),
        },
    )
    assert_close(collected['z'][0], ref_z)

  @parameterized.product(axis_type=AXIS_TYPES, jit=(False, True))
  def test_sow_after_while_and_fori_loop(self, axis_type, jit):
    mesh = make_mesh((8,), ('data',), axis_type[1])

    def body(x, w):
      n, kept = jax.lax.while_loop(
          lambda c: c[0] < x[0], lambda c: (c[0] + 1.0, c[1]), (0.0, w)
      )
      sow(n, name='n')
      sow(kept, name='kept')  # returned unchanged: the same everywhere
      m = jax.lax.fori_loop(0, x[0].astype(jnp.int32), lambda i, c: c + w, 0.0)
      sow(m * 2.0, name='fori')
      sow(n, name='n_total', reduce_fn=add, init_fn=zero)
      return x

    f = jax.shard_map(
        body, mesh=mesh, in_specs=(P('data'), P()), out_specs=P('data')
    )
    g = jax.jit(capture(f)) if jit else capture(f)
    _, collected = g(*self._inputs(mesh))

    steps = 2.0 * np.arange(8, dtype=np.float32)  # x[0] on each device
    assert_collected(
        self,
        collected,
        {
            'n': (steps,),
            'kept': (W,),
            'fori': (2.0 * W * steps,),
            'n_total': steps,
        },
    )

  @parameterized.named_parameters(*AXIS_TYPES)
  def test_sows_in_later_constructs_fed_by_the_branch(self, axis_type):
    mesh = make_mesh((8,), ('data',), axis_type)

    def body(x, w):
      y = jax.jit(branch_scale)(x, w)  # the cond inside a nested jit
      n = count_up_to(x)

      @jax.jit
      def later(y, w):
        sow(y * 2.0, name='jit_dep')
        sow(w * 2.0, name='jit_indep')
        return y + w

      later(y, w)

      def step(c, i):
        sow(c + i, name='scan_dep')
        sow(w + i, name='scan_indep')
        return c, None

      jax.lax.scan(step, n, jnp.arange(3.0))
      jax.vmap(lambda r: sow(r * y, name='vmap_dep'))(jnp.arange(2.0))
      # A while_loop whose predicate JAX types as invariant, but reads y.
      jax.lax.while_loop(
          lambda c: c < y,
          lambda c: sow(
              c + 1.0,
              name='steps',
              reduce_fn=add,
              init_fn=zero,
          ),
          0.0,
      )
      return x

    f = jax.shard_map(
        body, mesh=mesh, in_specs=(P('data'), P()), out_specs=P('data')
    )
    steps = 2.0 * np.arange(8, dtype=np.float32)
    y = W * SCALE
    trips = np.ceil(y)  # 1.0, 2.0, ... summed per device
    expected = {
        'jit_dep': (2.0 * y,),
        'jit_indep': (np.float32(2.0 * W),),
        'scan_dep': (steps[:, None] + np.arange(3.0),),  # (device, step)
        'scan_indep': (W + np.arange(3.0, dtype=np.float32),),
        'vmap_dep': (np.stack([np.zeros(8), y], 1).astype(np.float32),),
        'steps': (trips * (trips + 1) / 2).astype(np.float32),
    }
    # Also with the capture around a jit of the shard_map, and closing over
    # a tracer of an enclosing jit.
    runs = (
        capture(f),
        jax.jit(capture(f)),
        capture(jax.jit(f)),
        jax.jit(lambda x, w: capture(lambda x: f(x, w))(x)),
    )
    for run in runs:
      _, collected = run(*self._inputs(mesh))
      assert_collected(self, collected, expected)

  def test_perturb_cotangent_from_a_per_device_branch(self):
    mesh = make_mesh((8,), ('data',), AxisType.Auto)
    xs = np.arange(8, dtype=np.float32)

    def body(x, w):
      h = perturb(w * 2.0, name='dh')
      y = jax.lax.cond(x[0] >= 4.0, lambda h: h * 2.0, lambda h: h * 3.0, h)
      g = perturb(y, name='dy')
      return jax.lax.psum(g * x[0], 'data')

    f = jax.shard_map(body, mesh=mesh, in_specs=(P('data'), P()), out_specs=P())
    grad = jax.grad(f, argnums=1)
    expected_grad = grad(xs, W)  # JAX's own, without the capture
    # JAX differentiates y as one value: its cotangent is sum(x) = 28 on
    # every device; each device's transposed branch scales it by its own
    # factor, so the cotangent at h differs per device.
    scale = np.where(xs >= 4.0, 2.0, 3.0).astype(np.float32)
    for run in (capture(grad), jax.jit(capture(grad))):
      out, collected = run(xs, W)
      assert_close(out, expected_grad)
      assert_collected(
          self,
          collected,
          {'dh': (28.0 * scale,), 'dy': (np.float32(28.0),)},
      )

  @parameterized.named_parameters(*AXIS_TYPES)
  def test_two_dim_mesh_adds_only_the_predicate_axes(self, axis_type):
    mesh = make_mesh((4, 2), ('data', 'model'), axis_type)

    def body(x, w, v):
      # Varies over 'data' only through the branch; y * v also over
      # 'model' through its type.
      y = jax.lax.cond(x[0] >= 8.0, lambda: w * 2.0, lambda: w * 3.0)
      sow(y, name='y')
      sow(y * v, name='yv')
      return x

    f = jax.shard_map(
        body,
        mesh=mesh,
        in_specs=(P('data'), P(), P('model')),
        out_specs=P('data'),
    )
    x = place(np.arange(16, dtype=np.float32), mesh, P('data'))
    v = np.array([1.0, -1.0], np.float32)
    _, collected = jax.jit(capture(f))(
        x, place(W, mesh, P()), place(v, mesh, P('model'))
    )
    y = W * np.where(np.arange(4) >= 2, 2.0, 3.0).astype(np.float32)
    assert_collected(
        self,
        collected,
        {'y': (y,), 'yv': ((y[:, None] * v)[..., None],)},  # (4, 2, 1)
    )

  @parameterized.named_parameters(*AXIS_TYPES)
  def test_branches_sow_values_that_vary_differently(self, axis_type):
    # One branch sows a per-device value, the other a constant.
    mesh = make_mesh((8,), ('data',), axis_type)

    def body(x, s):
      def some(x):
        sow(x.sum(), name='v')
        return x

      def none(x):
        sow(jnp.float32(0.0), name='v')
        return x

      return jax.lax.cond(s > 0, some, none, x)

    f = jax.shard_map(
        body, mesh=mesh, in_specs=(P('data'), P()), out_specs=P('data')
    )
    x = place(XC, mesh, P('data'))
    for s, expected in ((1.0, per_device(XC).sum(1)), (-1.0, np.zeros(8))):
      _, collected = jax.jit(capture(f))(x, place(np.float32(s), mesh, P()))
      assert_collected(self, collected, {'v': (expected,)})
