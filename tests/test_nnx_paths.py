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

"""How ``Module.sow`` is named inside a capture (``nnx/scope.py``).

A module's sow is named by its path from a root the capture knows: a module
among the arguments or one the captured function refers to, a copy an NNX
transform or ``nnx.merge`` made of one, or an object ``nnx.merge`` built from
a graphdef split before the capture (a root at ``()``). Otherwise it is an
error, never a silently dropped value. Expected values come from calling the
submodules (plain ``nnx.Linear`` layers, which do not sow) on the same input.
"""

from __future__ import annotations

import threading
import warnings

from absl.testing import absltest
from absl.testing import parameterized
from flax import nnx
from flax.nnx import graphlib
import jax
import jax.numpy as jnp
import numpy as np

import flax.nnx.sow  # noqa: F401  (installs the shims)
from flax.nnx.sow import capture
from flax.nnx.sow.nnx import flax_hooks
from flax.nnx.sow.nnx import shims as nnx_shims
from flax.nnx.sow.nnx import scope as paths

nnx_shims.install()


class Block(nnx.Module):
  """A linear layer whose output is sown as 'act'."""

  def __init__(self, rngs):
    self.linear = nnx.Linear(3, 3, rngs=rngs)

  def __call__(self, x):
    y = self.linear(x)
    self.sow(nnx.Intermediate, 'act', y)
    return y


class Model(nnx.Module):
  """Two blocks of identical structure (different weights)."""

  def __init__(self, seed=0):
    rngs = nnx.Rngs(seed)
    self.blocks = nnx.List([Block(rngs), Block(rngs)])

  def __call__(self, x):
    for block in self.blocks:
      x = jnp.tanh(block(x))
    return x


X = np.array([[0.5, -1.0, 2.0], [1.0, 0.25, -0.5]], np.float32)
NAMES = [('blocks', 0, 'act'), ('blocks', 1, 'act')]


def expected_acts(model, x):
  """The sown values, from the blocks' Linear layers (which do not sow)."""
  a0 = model.blocks[0].linear(x)
  a1 = model.blocks[1].linear(jnp.tanh(a0))
  return [np.asarray(a0), np.asarray(a1)], np.asarray(jnp.tanh(a1))


def close(actual, expected):
  np.testing.assert_allclose(actual, expected, rtol=1e-5, atol=1e-6)


def module_attributes(module):
  return {
      path: sorted(vars(node))
      for path, node in nnx.iter_graph(module, graph=True)
      if isinstance(node, nnx.Module)
  }


class PathsTestCase(parameterized.TestCase):

  def assert_acts(self, collected, model, x=X, out=None):
    acts, y = expected_acts(model, x)
    self.assertEqual(list(collected), NAMES)
    for name, act in zip(NAMES, acts):
      self.assertLen(collected[name], 1)
      close(collected[name][0], act)
    if out is not None:
      close(out, y)

  def setUp(self):
    super().setUp()
    # Any DeprecationWarning (the legacy attribute path) fails the test.
    self.enter_context(warnings.catch_warnings())
    warnings.simplefilter('error', DeprecationWarning)


class FunctionalPatternTest(PathsTestCase):
  """``nnx.merge(graphdef, state)`` inside the captured function."""

  def test_merge_inside_capture(self):
    model = Model()
    before = module_attributes(model)
    graphdef, state = nnx.split(model)
    out, collected = capture(lambda s, x: nnx.merge(graphdef, s)(x))(state, X)
    self.assert_acts(collected, model, out=out)
    self.assertEqual(module_attributes(model), before)

  def test_merged_model_calls_an_nnx_transform_on_a_sowing_block(self):
    # The block's copies made by nnx.jit / nnx.vmap / a split and merge
    # inside the merged model keep the block's path (found by a fresh
    # reviewer: it raised that two graphdefs were merged).
    class Block(nnx.Module):

      def __init__(self, rngs):
        self.linear = nnx.Linear(2, 2, rngs=rngs)

      def __call__(self, x):
        y = jnp.tanh(self.linear(x))
        self.sow(nnx.Intermediate, 'act', y)
        return y

    def split_merge(block, x):
      g, s = nnx.split(block)
      return nnx.merge(g, s)(x)

    calls = {
        'jit': lambda block, x: nnx.jit(lambda b, x: b(x))(block, x),
        'split_merge': split_merge,
    }
    for name, call in calls.items():

      class Wrap(nnx.Module):

        def __init__(self, rngs, call=call):
          self.block = Block(rngs)
          self.call = call

        def __call__(self, x):
          return self.call(self.block, x)

      model = Wrap(nnx.Rngs(0))
      graphdef, state = nnx.split(model)
      x = jnp.linspace(-1.0, 1.0, 6).reshape(3, 2)
      lin = model.block.linear
      want = np.tanh(
          np.asarray(x) @ np.asarray(lin.kernel) + np.asarray(lin.bias)
      )
      for run in (capture, lambda f: jax.jit(capture(f))):
        out, collected = run(lambda s, x: nnx.merge(graphdef, s)(x))(state, x)
        self.assertEqual(list(collected), [('block', 'act')], name)
        np.testing.assert_allclose(
            collected[('block', 'act')][0], want, rtol=1e-6
        )
        np.testing.assert_allclose(out, want, rtol=1e-6)

  def test_under_jax_jit(self):
    model = Model()
    graphdef, state = nnx.split(model)
    traces = []

    def forward(s, x):
      traces.append(None)
      return nnx.merge(graphdef, s)(x)

    step = jax.jit(capture(forward))
    out, collected = step(state, X)
    self.assert_acts(collected, model, out=out)
    out, collected = step(state, X)  # cached: not traced again
    self.assert_acts(collected, model, out=out)
    self.assertLen(traces, 1)

  def test_inside_jitted_train_step(self):
    model = Model()
    graphdef, params = nnx.split(model)

    def loss(params, x):
      y, collected = capture(lambda p, x: nnx.merge(graphdef, p)(x))(params, x)
      return jnp.sum(y**2), collected

    @jax.jit
    def train_step(params, x):
      (value, collected), grads = jax.value_and_grad(loss, has_aux=True)(
          params, x
      )
      params = jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)
      return params, value, grads, collected

    _, value, grads, collected = train_step(params, X)
    self.assert_acts(collected, model)

    # The same loss written without sow: the Linear layers by hand.
    def plain_loss(weights, x):
      for w, b in weights:
        x = jnp.tanh(x @ w + b)
      return jnp.sum(x**2)

    weights = [(b.linear.kernel[...], b.linear.bias[...]) for b in model.blocks]
    want_value, want_grads = jax.value_and_grad(plain_loss)(weights, X)
    close(value, want_value)
    for i, (gw, gb) in enumerate(want_grads):
      close(grads['blocks'][i]['linear']['kernel'][...], gw)
      close(grads['blocks'][i]['linear']['bias'][...], gb)

  def test_graphdef_of_a_submodule_split_inside(self):
    # A graphdef split inside the capture from a known submodule: the merged
    # copy keeps that submodule's path.
    model = Model()

    def second_only(model, x):
      graphdef, state = nnx.split(model.blocks[1])
      return nnx.merge(graphdef, state)(x)

    out, collected = capture(second_only)(model, X)
    self.assertEqual(list(collected), [('blocks', 1, 'act')])
    close(collected[('blocks', 1, 'act')][0], model.blocks[1].linear(X))
    close(out, model.blocks[1].linear(X))

  def test_nnx_capture_shim_with_merge(self):
    model = Model()
    graphdef, state = nnx.split(model)
    _, intermediates = nnx.capture(
        lambda m, x: nnx.merge(*nnx.split(m))(x), nnx.Intermediate
    )(model, X)
    acts, _ = expected_acts(model, X)
    close(intermediates['blocks'][0]['act'][0], acts[0])
    close(intermediates['blocks'][1]['act'][0], acts[1])
    del graphdef, state

  def test_multi_head_attention_sow_weights(self):
    layer = nnx.MultiHeadAttention(
        num_heads=2,
        in_features=4,
        qkv_features=4,
        decode=False,
        rngs=nnx.Rngs(0),
    )
    graphdef, state = nnx.split(layer)
    x = jnp.asarray(np.linspace(-1.0, 1.0, 12, dtype=np.float32)).reshape(
        1, 3, 4
    )
    out, collected = jax.jit(
        capture(lambda s, x: nnx.merge(graphdef, s)(x, sow_weights=True))
    )(state, x)
    # softmax(q k^T / sqrt(head_dim)) per head, written out.
    q, k = np.asarray(layer.query(x)), np.asarray(layer.key(x))
    logits = np.einsum('bqhd,bkhd->bhqk', q / np.sqrt(q.shape[-1]), k)
    want = np.exp(logits - logits.max(-1, keepdims=True))
    want = want / want.sum(-1, keepdims=True)
    self.assertEqual(list(collected), [('attention_weights',)])
    self.assertEqual(collected[('attention_weights',)][0].shape, (1, 2, 3, 3))
    close(collected[('attention_weights',)][0], want)
    close(out, layer(x))  # outside a capture, sow_weights=False


class NestedCaptureTest(PathsTestCase):

  def test_inner_capture_collects_what_it_merges(self):
    # The outer capture knows the merged object too (it saw the split); the
    # innermost capture that accepts the sow collects it, naming the object
    # it merged as its root.
    model = Model()

    def outer(m, x):
      graphdef, state = nnx.split(m)
      return capture(lambda s, x: nnx.merge(graphdef, s)(x))(state, x)

    (out, inner), outer_state = nnx.capture(outer, nnx.Intermediate)(model, X)
    self.assert_acts(inner, model, out=out)
    self.assertEqual(dict(outer_state), {})

  def test_outer_capture_collects_what_the_inner_rejects(self):
    model = Model()

    def outer(m, x):
      graphdef, state = nnx.split(m)
      forward = lambda s, x: nnx.merge(graphdef, s)(x)
      return capture(forward, tags=('other',))(state, x)

    (out, inner), outer_state = nnx.capture(outer, nnx.Intermediate)(model, X)
    self.assertEqual(inner, {})
    acts, y = expected_acts(model, X)
    close(out, y)
    close(outer_state['blocks'][0]['act'][0], acts[0])
    close(outer_state['blocks'][1]['act'][0], acts[1])


class ClosedOverTest(PathsTestCase):
  """Modules the captured function refers to are roots."""

  def test_closure(self):
    model = Model()
    before = module_attributes(model)
    out, collected = capture(lambda x: model(x))(X)
    self.assert_acts(collected, model, out=out)
    self.assertEqual(module_attributes(model), before)

  def test_bound_method_and_partial(self):
    model = Model()

    def apply(model, x):
      return model(x)

    import functools  # pylint: disable=g-import-not-at-top

    for f in (model.__call__, functools.partial(apply, model), model):
      out, collected = capture(f)(X)
      self.assert_acts(collected, model, out=out)

  def test_global_through_a_helper(self):
    out, collected = capture(_loss_of_global_model)(X)
    self.assert_acts(collected, GLOBAL_MODEL)
    close(out, np.sum(expected_acts(GLOBAL_MODEL, X)[1]))

  def test_closure_under_jax_jit_and_nnx_shim(self):
    model = Model()
    out, collected = jax.jit(capture(lambda x: model(x)))(X)
    self.assert_acts(collected, model, out=out)
    other = Model(1)
    _, intermediates = nnx.capture(
        lambda m, x: m(x) + model.blocks[0](x), nnx.Intermediate
    )(other, X)
    # Two roots, an argument and a closed-over model: each is named by the
    # variable that holds it, and nothing is shared.
    self.assertEqual(sorted(intermediates), ['m', 'model'])
    acts, _ = expected_acts(other, X)
    close(intermediates['m']['blocks'][0]['act'][0], acts[0])
    close(intermediates['m']['blocks'][1]['act'][0], acts[1])
    self.assertEqual(list(intermediates['model']['blocks']), [0])
    self.assertLen(intermediates['model']['blocks'][0]['act'], 1)
    close(
        intermediates['model']['blocks'][0]['act'][0],
        model.blocks[0].linear(X),
    )


GLOBAL_MODEL = Model(2)


def _forward_global_model(x):
  return GLOBAL_MODEL(x)


def _loss_of_global_model(x):
  return jnp.sum(_forward_global_model(x))


class TransformCopiesTest(PathsTestCase):
  """Copies NNX transforms make, in every mode, keep the caller's paths."""

  @parameterized.named_parameters(
      ('graph', True, True),
      ('graph_no_updates', True, False),
      ('tree', False, False),
  )
  def test_nnx_jit(self, graph, graph_updates):
    model = Model()
    jitted = nnx.jit(
        lambda m, x: m(x), graph=graph, graph_updates=graph_updates
    )
    out, collected = capture(lambda m, x: jitted(m, x))(model, X)
    self.assert_acts(collected, model, out=out)

  def test_tree_mode_blocks_called_from_a_free_function(self):
    # No method of the parent runs: the blocks are named by the position of
    # the model among the transform's arguments.
    model = Model()

    def run(m, x):
      return [jnp.tanh(b(x)) for b in m.blocks]

    jitted = nnx.jit(run, graph=False, graph_updates=False)
    _, collected = capture(lambda m, x: jitted(m, x))(model, X)
    self.assertEqual(list(collected), NAMES)
    close(collected[NAMES[0]][0], model.blocks[0].linear(X))
    close(collected[NAMES[1]][0], model.blocks[1].linear(X))

  def test_tree_mode_two_identical_arguments(self):
    first, second = Model(0), Model(1)

    def both(a, b, x):
      return a.blocks[1](x) + b.blocks[1](x)

    jitted = nnx.jit(both, graph=False, graph_updates=False)
    _, intermediates = nnx.capture(
        lambda ms, x: jitted(ms[0], ms[1], x), nnx.Intermediate
    )(nnx.List([first, second]), X)
    acts = (
        intermediates[0]['blocks'][1]['act'],
        intermediates[1]['blocks'][1]['act'],
    )
    close(acts[0][0], first.blocks[1].linear(X))
    close(acts[1][0], second.blocks[1].linear(X))

  @parameterized.parameters(True, False)
  def test_nnx_vmap_and_scan(self, graph):
    model = Model()
    xs = np.stack([X, 2.0 * X])

    def vmapped(m, xs):
      return nnx.vmap(
          lambda m, x: m(x), in_axes=(None, 0), graph=graph, graph_updates=graph
      )(m, xs)

    out, collected = capture(vmapped)(model, xs)
    self.assertEqual(list(collected), NAMES)
    for k in range(2):
      acts, y = expected_acts(model, xs[k])
      close(collected[NAMES[0]][0][k], acts[0])
      close(collected[NAMES[1]][0][k], acts[1])
      close(out[k], y)

    def scanned(m, xs):
      def body(m, h, x):
        return m(h + x), None

      scan = nnx.scan(
          body,
          in_axes=(None, nnx.Carry, 0),
          out_axes=(nnx.Carry, 0),
          graph=graph,
          graph_updates=graph,
      )
      return scan(m, jnp.zeros_like(xs[0]), xs)[0]

    _, collected = capture(scanned)(model, xs)
    self.assertEqual(list(collected), NAMES)
    h = np.zeros_like(X)
    for k in range(2):
      acts, h = expected_acts(model, h + xs[k])
      close(collected[NAMES[0]][0][k], acts[0])
      close(collected[NAMES[1]][0][k], acts[1])


class Act(nnx.Module):
  """Sows ``scale * x`` as 'act'."""

  def __init__(self, scale):
    self.scale = nnx.Param(jnp.asarray(scale, jnp.float32))

  def __call__(self, x):
    y = x * self.scale[...]
    self.sow(nnx.Intermediate, 'act', y)
    return y


ENC, DEC = Act(2.0), Act(3.0)


def _encode_decode_globals(x):
  return DEC(ENC(x))


class RootNamingTest(PathsTestCase):
  """Several roots: by argument position, or by the variable holding them."""

  def check(self, collected, names, x=X):
    # enc(x) = 2x, dec(enc(x)) = 6x.
    self.assertEqual(list(collected), names)
    for name, want in zip(names, (2.0 * x, 6.0 * x)):
      self.assertLen(collected[name], 1)
      close(collected[name][0], want)

  @parameterized.parameters('eager', 'jit')
  def test_two_arguments(self, mode):
    enc, dec = Act(2.0), Act(3.0)
    f = capture(lambda a, b, x: b(a(x)))
    if mode == 'jit':
      f = jax.jit(f)
    _, collected = f(enc, dec, X)
    self.check(collected, [(0, 'act'), (1, 'act')])
    # Keyword arguments by name; modules in a container by their place.
    _, collected = capture(lambda x, *, a, b: b(a(x)))(X, a=enc, b=dec)
    self.check(collected, [('a', 'act'), ('b', 'act')])
    _, collected = capture(lambda ms, x: ms[1](ms[0](x)))([enc, dec], X)
    self.check(collected, [(0, 0, 'act'), (0, 1, 'act')])

  def test_two_arguments_nnx_capture(self):
    enc, dec = Act(2.0), Act(3.0)
    _, state = nnx.capture(lambda a, b, x: b(a(x)), nnx.Intermediate)(
        enc, dec, X
    )
    self.assertEqual(sorted(state), [0, 1])
    close(state[0]['act'][0], 2.0 * X)
    close(state[1]['act'][0], 6.0 * X)

  @parameterized.parameters('eager', 'jit')
  def test_closed_over_and_globals(self, mode):
    enc, dec = Act(2.0), Act(3.0)
    f = capture(lambda x: dec(enc(x)))
    g = capture(_encode_decode_globals)
    if mode == 'jit':
      f, g = jax.jit(f), jax.jit(g)
    self.check(f(X)[1], [('enc', 'act'), ('dec', 'act')])
    self.check(g(X)[1], [('ENC', 'act'), ('DEC', 'act')])

  def test_jit_closing_over_tracer(self):
    enc, dec = Act(2.0), Act(3.0)

    @jax.jit
    def outer(x):
      shift = jnp.sum(x)  # a tracer of the enclosing jit
      _, collected = capture(lambda a, b: b(a(x + shift)))(enc, dec)
      return collected

    self.check(outer(X), [(0, 'act'), (1, 'act')], x=X + np.sum(X))

  def test_one_root_keeps_flax_paths(self):
    # One module (maybe referred to twice, or with a submodule referred to
    # as well): paths from it, exactly as Flax's own nnx.capture gives them.
    model = Model()

    def run():
      return nnx.capture(
          lambda m, x: m(x) + model.blocks[1](x), nnx.Intermediate
      )(model, X)[1]

    state = run()
    nnx_shims.uninstall()
    try:
      with warnings.catch_warnings():
        warnings.simplefilter('ignore', DeprecationWarning)
        want = run()
    finally:
      nnx_shims.install()
    self.assertEqual(
        jax.tree.structure(nnx.to_pure_dict(state)),
        jax.tree.structure(nnx.to_pure_dict(want)),
    )
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(want)):
      close(a, b)
    self.assertLen(state['blocks'][1]['act'], 2)  # called twice

  def test_shared_name_raises(self):
    # The argument SHARED (named by its parameter, next to a referenced
    # module) and the global SHARED that _use_shared reads are two modules.
    # pylint: disable-next=invalid-name
    f = lambda x, SHARED: SHARED(x) + _use_shared(x)
    with self.assertRaisesRegex(
        ValueError,
        r"Module.sow\(Intermediate, 'act'\) in Act: the module would be"
        r" named \('SHARED',\), but two modules.*both roots",
    ):
      capture(f)(X, Act(7.0))

  def test_merged_unknown_graphdef_next_to_a_root_raises(self):
    graphdef, state = nnx.split(Model())
    enc = Act(2.0)
    with self.assertRaisesRegex(
        ValueError, r"Module.sow\(Intermediate, 'act'\) in Block.*graphdef"
    ):
      capture(lambda s, x: nnx.merge(graphdef, s)(enc(x)))(state, X)


SHARED = Act(5.0)


def _use_shared(x):
  return SHARED(x)


class UnnamedModuleTest(PathsTestCase):
  """A module no capture can name is an error, never a dropped value."""

  def test_module_created_inside(self):
    def make_and_call(x):
      return Block(nnx.Rngs(0))(x)

    with self.assertRaisesRegex(
        ValueError, r"Module.sow\(Intermediate, 'act'\) in Block.*argument"
    ):
      capture(make_and_call)(X)
    self.assertEqual(paths.LOCAL.scopes, [])

  def test_plain_jax_transform_copy(self):
    # jax.jit copies a Module passed to it as a pytree; nothing links the
    # copy to the original (matching structures would be a guess), so the
    # sow raises, pointing to nnx.jit.
    model = Model()
    for module in (model, Block(nnx.Rngs(3))):
      with self.assertRaisesRegex(
          ValueError, r"Module.sow\(Intermediate, 'act'\).*nnx.jit"
      ):
        capture(lambda m, x: jax.jit(lambda m, x: m(x))(m, x))(module, X)
    # Closing over the module works.
    out, collected = capture(lambda m, x: jax.jit(lambda x: m(x))(x))(model, X)
    self.assert_acts(collected, model, out=out)

  def test_not_requested_is_not_an_error(self):
    def make_and_call(x):
      return Block(nnx.Rngs(0))(x)

    out, collected = capture(make_and_call, tags=('other',))(X)
    self.assertEqual(collected, {})
    close(out, Block(nnx.Rngs(0)).linear(X))


class HooksTest(PathsTestCase):

  def test_installed_once_and_idle_outside_capture(self):
    hook = flax_hooks.replacement('graph_unflatten')
    self.assertIs(hook.func, paths._unflatten)  # pylint: disable=protected-access
    self.assertIs(graphlib.unflatten, hook)
    self.assertIs(nnx.merge.__globals__['unflatten'], hook)
    nnx_shims.install()
    self.assertIs(graphlib.unflatten, hook)
    model = Model()
    graphdef, state = nnx.split(model)
    copy = nnx.merge(graphdef, state)  # outside a capture: nothing recorded
    self.assertEqual(paths.LOCAL.scopes, [])
    with self.assertWarns(DeprecationWarning):  # the legacy path
      warnings.simplefilter('always', DeprecationWarning)
      copy.blocks[0](X)
    self.assertIsInstance(copy.blocks[0].act, nnx.Intermediate)

  def test_uninstall_restores_flax(self):
    original = flax_hooks.original('graph_unflatten')
    nnx_shims.uninstall()
    try:
      for hook in flax_hooks.INVENTORY:
        for owner, attribute in hook.targets:
          self.assertIs(
              getattr(owner, attribute), flax_hooks.original(hook.name)
          )
      self.assertIs(graphlib.unflatten, original)
      self.assertIs(nnx.unflatten, original)
    finally:
      nnx_shims.install()
    self.assertIs(graphlib.unflatten, flax_hooks.replacement('graph_unflatten'))

  def test_threads_name_their_own_merges(self):
    models = [Model(0), Model(1)]
    results = [None, None]
    barrier = threading.Barrier(2)

    def work(i):
      graphdef, state = nnx.split(models[i])

      def forward(s, x):
        barrier.wait(timeout=30)
        return nnx.merge(graphdef, s)(x)

      results[i] = capture(forward)(state, X)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for t in threads:
      t.start()
    for t in threads:
      t.join()
    for i in range(2):
      out, collected = results[i]
      self.assert_acts(collected, models[i], out=out)


class SharedTransformedFunctionTest(absltest.TestCase):
  """One NNX-transformed function applied to modules of equal structure."""

  def _block_type(self):
    class Block(nnx.Module):

      def __init__(self, rngs):
        self.lin = nnx.Linear(4, 4, rngs=rngs)

      def __call__(self, x):
        y = jnp.tanh(self.lin(x))
        self.sow(nnx.Intermediate, 'act', y)
        return y

    return Block

  def test_each_module_gets_its_own_path(self):
    block = self._block_type()
    x = jnp.ones((2, 4))
    for transform in (nnx.jit, nnx.remat):
      apply = transform(lambda b, x: b(x))

      class Model(nnx.Module):

        def __init__(self, rngs):
          self.blocks = nnx.List([block(rngs), block(rngs)])

        def __call__(self, x):
          for b in self.blocks:
            x = apply(b, x)
          return x

      model = Model(nnx.Rngs(0))
      _, state = nnx.capture(model, nnx.Intermediate)(x)
      # By hand: block 0 sees x, block 1 sees block 0's output.
      h0 = jnp.tanh(model.blocks[0].lin(x))
      h1 = jnp.tanh(model.blocks[1].lin(h0))
      self.assertEqual(sorted(state['blocks']), [0, 1])
      np.testing.assert_allclose(state['blocks'][0]['act'][0], h0, 1e-6)
      np.testing.assert_allclose(state['blocks'][1]['act'][0], h1, 1e-6)

  def test_nnx_scan_over_two_stacks(self):
    block = self._block_type()

    def stack(rngs):
      @nnx.split_rngs(splits=2)
      @nnx.vmap(in_axes=(0,), out_axes=0)
      def make(rngs):
        return block(rngs)

      return make(rngs)

    @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
    def run(x, b):
      return b(x)

    class EncDec(nnx.Module):

      def __init__(self, rngs):
        self.enc = stack(rngs)
        self.dec = stack(rngs)

      def __call__(self, x):
        return run(run(x, self.enc), self.dec)

    model = EncDec(nnx.Rngs(0))
    x = jnp.ones((2, 4))
    _, state = nnx.capture(model, nnx.Intermediate)(x)
    self.assertEqual(sorted(state), ['dec', 'enc'])
    _, collected = capture(lambda m, x: m(x))(model, x)
    self.assertEqual(list(collected), [('enc', 'act'), ('dec', 'act')])
    self.assertEqual(collected[('enc', 'act')][0].shape, (2, 2, 4))


if __name__ == '__main__':
  absltest.main()
