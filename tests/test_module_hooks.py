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

"""Module calls as hook points (``module_outputs``), on a model with no sow.

Every expected value is computed by calling the same modules one by one
without hooks (or, for cotangents, by ``jax.grad`` of the rest of the
model with respect to the hooked output).
"""

from absl.testing import absltest
from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np

from flax.nnx.sow import capture
from flax.nnx.sow import intervene
from flax.nnx.sow.nnx.hooks import ModuleOutput
from flax.nnx.sow.nnx.hooks import module_outputs


class Block(nnx.Module):

  def __init__(self, d, rngs):
    self.attn = nnx.MultiHeadAttention(
        num_heads=2, in_features=d, qkv_features=d, decode=False, rngs=rngs
    )
    self.mlp = nnx.Linear(d, d, rngs=rngs)

  def __call__(self, x):
    x = x + self.attn(x)
    return x + jnp.tanh(self.mlp(x))


class Model(nnx.Module):

  def __init__(self, rngs):
    self.embed = nnx.Linear(3, 4, rngs=rngs)
    self.blocks = nnx.List([Block(4, rngs) for _ in range(2)])
    self.head = nnx.Linear(4, 2, rngs=rngs)

  def __call__(self, x):
    x = self.embed(x)
    for block in self.blocks:
      x = block(x)
    return self.head(x)


def _forward(m, x):
  return m(x)


def _by_hand(m, x, mlp1=None):
  """The model's layers one at a time; ``mlp1`` replaces block 1's mlp."""
  e = m.embed(x)
  b0 = m.blocks[0](e)
  b1_in = b0 + m.blocks[1].attn(b0)
  mlp = m.blocks[1].mlp(b1_in) if mlp1 is None else mlp1
  b1 = b1_in + jnp.tanh(mlp)
  return {'embed': e, 'b0': b0, 'b1': b1, 'mlp1': mlp, 'out': m.head(b1)}


class ModuleOutputsTest(absltest.TestCase):

  def setUp(self):
    super().setUp()
    self.model = Model(nnx.Rngs(0))
    self.x = jax.random.normal(jax.random.key(1), (2, 5, 3))

  def test_every_module_call_by_path(self):
    ref = _by_hand(self.model, self.x)
    for wrap in (lambda f: f, jax.jit):
      out, c = wrap(capture(module_outputs(_forward)))(self.model, self.x)
      np.testing.assert_allclose(out, ref['out'], rtol=1e-5, atol=1e-6)
      for name, key in [
          (('embed', '__call__'), 'embed'),
          (('blocks', 0, '__call__'), 'b0'),
          (('blocks', 1, '__call__'), 'b1'),
          (('blocks', 1, 'mlp', '__call__'), 'mlp1'),
          (('head', '__call__'), 'out'),
          (('__call__',), 'out'),
      ]:
        (value,) = c[name]
        np.testing.assert_allclose(value, ref[key], rtol=1e-5, atol=1e-6)
      # The attention's own projections are modules too.
      self.assertIn(('blocks', 0, 'attn', 'query', '__call__'), c)
      self.assertEqual(list(c)[0], ('embed', '__call__'))

  def test_select_by_class_and_by_predicate(self):
    f = module_outputs(_forward, Block)
    _, c = capture(f)(self.model, self.x)
    self.assertEqual(list(c), [('blocks', 0, '__call__'),
                               ('blocks', 1, '__call__')])
    f = module_outputs(_forward, lambda path, m: path[-1:] == ('mlp',))
    _, c = capture(f)(self.model, self.x)
    self.assertEqual(list(c), [('blocks', 0, 'mlp', '__call__'),
                               ('blocks', 1, 'mlp', '__call__')])
    _, c = capture(module_outputs(_forward), tags=[ModuleOutput])(
        self.model, self.x
    )
    self.assertLen(c, 1 + 2 * 7 + 2)  # embed, 7 per block, head, model

  def test_intervene_replaces_what_the_module_returns(self):
    f = module_outputs(_forward, nnx.Linear)
    name = ('blocks', 1, 'mlp', '__call__')
    zeros = jnp.zeros((2, 5, 4))
    ref = _by_hand(self.model, self.x, mlp1=zeros)['out']
    for wrap in (lambda f: f, jax.jit):
      out = wrap(intervene(f, {name: (zeros,)}))(self.model, self.x)
      np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-6)
      out = wrap(intervene(f, {name: lambda v: v * 0.0}))(self.model, self.x)
      np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-6)

  def test_attribution_cotangent_of_a_module_output(self):
    f = module_outputs(lambda m, x: jnp.sum(m(x) ** 2), Block, grad=True)
    _, c = capture(nnx.grad(f))(self.model, self.x)
    ref = _by_hand(self.model, self.x)
    expected = jax.grad(lambda b: jnp.sum(self.model.head(b) ** 2))(ref['b1'])
    (got,) = c[('grad', 'blocks', 1, '__call__')]
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
    self.assertIn(('grad', 'blocks', 1, '__call__'), c.cotangents)

  def test_a_hook_with_grad_hook_points_applies_once(self):
    # With grad=True every output also carries a gradient marker; a hook
    # treats each module output once (steering block 1's mlp by 1.5 here),
    # and the gradient name is not a key intervene replaces.
    f = module_outputs(_forward, nnx.Linear, grad=True)
    name = ('blocks', 1, 'mlp', '__call__')
    mlp1 = _by_hand(self.model, self.x)['mlp1']
    ref = _by_hand(self.model, self.x, mlp1=1.5 * mlp1)['out']
    steer = lambda n, v: 1.5 * v if n == name else v
    for wrap in (lambda f: f, jax.jit):
      out = wrap(intervene(f, steer))(self.model, self.x)
      np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-6)
      with self.assertRaisesRegex(ValueError, 'collects the gradient at'):
        wrap(intervene(f, {('grad', *name): (mlp1,)}))(self.model, self.x)

  def test_a_module_instance_as_the_selector_is_a_type_error(self):
    with self.assertRaisesRegex(
        TypeError,
        r'got a Model instance\. To select the calls of that one module,'
        r" select its path .*modules=lambda path, m: path == \('blocks', 0\)"
        r'.*to select its class, modules=Model\.',
    ):
      module_outputs(_forward, self.model)
    # The suggested path predicate selects that module's calls alone, for
    # capture and intervene (which calls copies of the model).
    f = module_outputs(_forward, lambda path, m: path == ('head',))
    out, c = capture(f)(self.model, self.x)
    self.assertEqual(list(c), [('head', '__call__')])
    np.testing.assert_allclose(c[('head', '__call__')][0], out)
    ref = _by_hand(self.model, self.x)['out']
    steered = intervene(f, lambda n, v: 2.0 * v)(self.model, self.x)
    np.testing.assert_allclose(steered, 2.0 * ref, rtol=1e-5, atol=1e-6)

  def test_input_hook_points_ablate_one_head(self):
    attn = self.model.blocks[0].attn
    e = self.model.embed(self.x)
    q, k, v = attn.query(e), attn.key(e), attn.value(e)
    z = nnx.dot_product_attention(q, k, v)  # (batch, length, heads, dim)
    self.assertEqual(z.shape, (2, 5, 2, 2))
    by_hand = attn.out(z.at[..., 1, :].set(0.0))

    is_out = lambda path, m: path[-1:] == ('out',)
    f = module_outputs(lambda m, x: m.blocks[0].attn(m.embed(x)), is_out,
                       inputs=True)
    name = ('blocks', 0, 'attn', 'out', '__call__', 'input')
    _, c = capture(f)(self.model, self.x)
    self.assertEqual(list(c), [name, name[:-1]])
    np.testing.assert_allclose(c[name][0], z, rtol=1e-5, atol=1e-6)
    ablate = lambda n, z: z.at[..., 1, :].set(0.0)
    for wrap in (lambda f: f, jax.jit):
      out = wrap(intervene(f, ablate, names=[name]))(self.model, self.x)
      np.testing.assert_allclose(out, by_hand, rtol=1e-5, atol=1e-6)

  def test_classes_are_restored_after_the_call_and_an_exception(self):
    before = vars(nnx.Linear)['__call__']

    def boom(m, x):
      m(x)
      raise RuntimeError('boom')

    with self.assertRaisesRegex(RuntimeError, 'boom'):
      capture(module_outputs(boom))(self.model, self.x)
    self.assertIs(vars(nnx.Linear)['__call__'], before)
    # Outside a capture a hooked function is f.
    np.testing.assert_allclose(
        module_outputs(_forward)(self.model, self.x), self.model(self.x)
    )

  def test_bad_selection(self):
    with self.assertRaisesRegex(TypeError, 'module_outputs: modules must'):
      module_outputs(_forward, 'mlp')


def _pattern_by_hand(attn, x):
  """Softmax over keys of the scaled query-key products, per head."""
  q, k = attn.query(x), attn.key(x)
  logits = jnp.einsum('bqhd,bkhd->bhqk', q, k) / jnp.sqrt(q.shape[-1])
  return jax.nn.softmax(logits, axis=-1)


class AttentionWeightsTest(absltest.TestCase):
  """``attention_weights=True``: the pattern of each attention a hook point."""

  def setUp(self):
    super().setUp()
    self.model = Model(nnx.Rngs(0))
    self.x = jnp.linspace(-1.0, 1.0, 15).reshape(1, 5, 3)
    self.f = module_outputs(
        _forward, nnx.MultiHeadAttention, attention_weights=True
    )

  def test_captured_pattern_is_the_softmax(self):
    m = self.model
    by_hand = _by_hand(m, self.x)
    for wrap in (lambda g: g, jax.jit):
      out, c = wrap(capture(self.f))(m, self.x)
      np.testing.assert_allclose(out, by_hand['out'], rtol=1e-5, atol=1e-6)
      (p0,) = c[('blocks', 0, 'attn', '__call__', 'attention_weights')]
      (p1,) = c[('blocks', 1, 'attn', '__call__', 'attention_weights')]
      np.testing.assert_allclose(
          p0, _pattern_by_hand(m.blocks[0].attn, by_hand['embed']),
          rtol=1e-5, atol=1e-6)
      b1_in = by_hand['b0']
      np.testing.assert_allclose(
          p1, _pattern_by_hand(m.blocks[1].attn, b1_in), rtol=1e-5,
          atol=1e-6)
      self.assertEqual(p0.shape, (1, 2, 5, 5))

  def test_a_replaced_pattern_is_what_the_values_are_averaged_with(self):
    m, x = self.model, self.x
    name = ('blocks', 1, 'attn', '__call__', 'attention_weights')
    # Head 0 attends to position 0 only; head 1 keeps its pattern.
    def to_first(n, w):
      return w.at[:, 0].set(jax.nn.one_hot(0, w.shape[-1]))

    e = m.embed(x)
    b0 = m.blocks[0](e)
    attn = m.blocks[1].attn
    w = _pattern_by_hand(attn, b0).at[:, 0].set(jax.nn.one_hot(0, 5))
    z = jnp.einsum('bhqk,bkhd->bqhd', w, attn.value(b0))
    b1_in = b0 + attn.out(z)
    b1 = b1_in + jnp.tanh(m.blocks[1].mlp(b1_in))
    expected = m.head(b1)
    for wrap in (lambda g: g, jax.jit):
      got = wrap(intervene(self.f, to_first, names=[name]))(m, x)
      np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)

  def test_attribution_cotangent_of_the_pattern(self):
    m, x = self.model, self.x
    f = module_outputs(_forward, nnx.MultiHeadAttention, grad=True,
                       attention_weights=True)
    name = ('blocks', 0, 'attn', '__call__', 'attention_weights')
    _, c = capture(nnx.grad(lambda m, x: f(m, x).sum(), argnums=1))(m, x)
    (cot,) = c[('grad', *name)]
    (w,) = capture(self.f)(m, x)[1][name]
    # The same cotangent through intervene's replacement of the pattern.
    expected = jax.grad(
        lambda w: intervene(self.f, {name: (w,)})(m, x).sum()
    )(w)
    np.testing.assert_allclose(cot, expected, rtol=1e-5, atol=1e-6)

  def test_no_pattern_without_the_flag_and_flax_restored(self):
    from flax.nnx.nn import attention as attention_lib  # pylint: disable=g-import-not-at-top
    from flax.nnx.sow.nnx import flax_hooks  # pylint: disable=g-import-not-at-top

    _, c = capture(module_outputs(_forward, nnx.MultiHeadAttention))(
        self.model, self.x
    )
    self.assertEqual(
        list(c),
        [('blocks', 0, 'attn', '__call__'), ('blocks', 1, 'attn', '__call__')],
    )
    # The caller's own sow_weights=True still sows Flax's Intermediate.
    attn = nnx.MultiHeadAttention(
        num_heads=2, in_features=4, qkv_features=4, decode=False,
        rngs=nnx.Rngs(1))
    x = jnp.linspace(-1.0, 1.0, 20).reshape(1, 5, 4)
    f = module_outputs(lambda m, x: m(x, sow_weights=True),
                       nnx.MultiHeadAttention, attention_weights=True)
    _, state = nnx.capture(f, nnx.Intermediate)(attn, x)
    (sown,) = state['attention_weights'].get_value()
    np.testing.assert_allclose(sown, _pattern_by_hand(attn, x), rtol=1e-5,
                               atol=1e-6)
    # Outside a hooked call, the installed function is Flax's.
    replaced = attention_lib.dot_product_attention_weights
    self.assertIsNot(replaced, flax_hooks.original('attention_weights'))
    q, k = attn.query(x), attn.key(x)
    np.testing.assert_array_equal(
        replaced(q, k), flax_hooks.original('attention_weights')(q, k))


def _scores_by_hand(attn, x, mask=None):
  """The scaled query-key products per head, masked as Flax masks them."""
  q, k = attn.query(x), attn.key(x)
  logits = jnp.einsum('bqhd,bkhd->bhqk', q, k) / np.sqrt(q.shape[-1])
  if mask is not None:
    logits = jnp.where(mask, logits, np.finfo(np.float32).min)
  return logits


class AttentionScoresTest(absltest.TestCase):
  """``attention_scores=True``: the logits before the softmax."""

  def setUp(self):
    super().setUp()
    self.attn = nnx.MultiHeadAttention(
        num_heads=2, in_features=4, qkv_features=4, decode=False,
        rngs=nnx.Rngs(2))
    self.x = jnp.linspace(-1.0, 1.0, 40).reshape(2, 5, 4)
    self.mask = nnx.make_causal_mask(jnp.ones((2, 5)))
    self.name = ('__call__', 'attention_scores')

  def test_captured_scores_and_unchanged_output(self):
    attn, x = self.attn, self.x
    for mask in (None, self.mask):
      f = module_outputs(lambda m, x, mask=mask: m(x, mask=mask),
                         attention_scores=True, attention_weights=True)
      for wrap in (lambda g: g, jax.jit):
        out, c = wrap(capture(f))(attn, x)
        np.testing.assert_allclose(out, attn(x, mask=mask), rtol=1e-5,
                                   atol=1e-6)
        (scores,) = c[self.name]
        self.assertEqual(scores.shape, (2, 2, 5, 5))
        np.testing.assert_allclose(scores, _scores_by_hand(attn, x, mask),
                                   rtol=1e-5, atol=1e-6)
        (weights,) = c[('__call__', 'attention_weights')]
        np.testing.assert_allclose(
            weights, jax.nn.softmax(_scores_by_hand(attn, x, mask)),
            rtol=1e-5, atol=1e-6)
        # The scores are sown before the weights they give.
        self.assertLess(list(c).index(self.name),
                        list(c).index(('__call__', 'attention_weights')))

  def test_replaced_scores_are_what_the_softmax_is_taken_of(self):
    attn, x = self.attn, self.x
    f = module_outputs(lambda m, x: m(x), nnx.MultiHeadAttention,
                       attention_scores=True)
    # Head 1 attends uniformly to the first three keys; head 0 is untouched.
    low = np.finfo(np.float32).min
    first_three = jnp.where(jnp.arange(5) < 3, 0.0, low)

    def uniform(v):
      return v.at[:, 1].set(first_three)

    weights = jax.nn.softmax(_scores_by_hand(attn, x))
    weights = weights.at[:, 1].set(jnp.where(jnp.arange(5) < 3, 1 / 3, 0.0))
    z = jnp.einsum('bhqk,bkhd->bqhd', weights, attn.value(x))
    by_hand = attn.out(z)
    for wrap in (lambda g: g, jax.jit):
      out = wrap(intervene(f, {self.name: uniform}))(attn, x)
      np.testing.assert_allclose(out, by_hand, rtol=1e-5, atol=1e-6)
      out = wrap(intervene(f, lambda n, v: uniform(v), names=[self.name]))(
          attn, x)
      np.testing.assert_allclose(out, by_hand, rtol=1e-5, atol=1e-6)

  def test_vmapped_and_sow_weights_kept(self):
    attn, x = self.attn, self.x
    f = module_outputs(lambda m, x: jax.vmap(lambda r: m(r[None])[0])(x),
                       attention_scores=True)
    _, c = capture(f)(attn, x)
    (scores,) = c[self.name]
    self.assertEqual(scores.shape, (2, 1, 2, 5, 5))  # vmap axis first
    np.testing.assert_allclose(scores[:, 0], _scores_by_hand(attn, x),
                               rtol=1e-5, atol=1e-6)
    # The caller's own sow_weights=True still sows Flax's Intermediate.
    g = module_outputs(lambda m, x: m(x, sow_weights=True),
                       attention_scores=True)
    _, state = nnx.capture(g, nnx.Intermediate)(attn, x)
    (sown,) = state['attention_weights'].get_value()
    np.testing.assert_allclose(sown, jax.nn.softmax(_scores_by_hand(attn, x)),
                               rtol=1e-5, atol=1e-6)

  def test_dropout_on_raises(self):
    attn = nnx.MultiHeadAttention(
        num_heads=2, in_features=4, qkv_features=4, decode=False,
        dropout_rate=0.5, deterministic=False, rngs=nnx.Rngs(2))
    f = module_outputs(lambda m, x: m(x, rngs=nnx.Rngs(3)),
                       attention_scores=True)
    with self.assertRaisesRegex(
        NotImplementedError, 'attention dropout on.*model.eval'):
      capture(f)(attn, self.x)
    attn.eval()  # deterministic: the scores are a hook point
    _, c = capture(f)(attn, self.x)
    np.testing.assert_allclose(c[self.name][0],
                               _scores_by_hand(attn, self.x),
                               rtol=1e-5, atol=1e-6)


class Stacked(nnx.Module):

  def __init__(self, rngs):
    @nnx.split_rngs(splits=3)
    @nnx.vmap(in_axes=(0,))
    def create(rngs):
      return nnx.Linear(4, 4, rngs=rngs)

    self.layers = create(rngs)

  def __call__(self, x):
    @nnx.scan(in_axes=(0, nnx.Carry), out_axes=nnx.Carry)
    def forward(layer, x):
      return jnp.tanh(layer(x))

    return forward(self.layers, x)


class InsideNnxTransformsTest(absltest.TestCase):

  def test_scan_over_stacked_layers_stacks_per_layer(self):
    model = Stacked(nnx.Rngs(0))
    x = jnp.linspace(-1.0, 1.0, 8).reshape(2, 4)
    graphdef, state = nnx.split(model.layers)
    h, by_hand = x, []
    for i in range(3):
      layer = nnx.merge(graphdef, jax.tree.map(lambda a, i=i: a[i], state))
      by_hand.append(layer(h))
      h = jnp.tanh(by_hand[-1])
    f = module_outputs(_forward, nnx.Linear)
    for wrap in (lambda f: f, jax.jit):
      out, c = wrap(capture(f))(model, x)
      np.testing.assert_allclose(out, h, rtol=1e-5, atol=1e-6)
      (stacked,) = c[('layers', '__call__')]
      np.testing.assert_allclose(stacked, jnp.stack(by_hand), rtol=1e-5,
                                 atol=1e-6)
    # Replaced in every layer, the change reaching the next layer.
    h = x
    for i in range(3):
      layer = nnx.merge(graphdef, jax.tree.map(lambda a, i=i: a[i], state))
      h = jnp.tanh(0.5 * layer(h))
    name = ('layers', '__call__')
    out = intervene(f, {name: lambda v: 0.5 * v})(model, x)
    np.testing.assert_allclose(out, h, rtol=1e-5, atol=1e-6)
    # An array replacement: row i is layer i's output.
    rows = jnp.stack(by_hand).at[2].set(1.0)
    out = jax.jit(intervene(f, {name: (rows,)}))(model, x)
    np.testing.assert_allclose(out, np.tanh(np.ones((2, 4))), rtol=1e-6)

  def test_remat_and_vmap(self):
    model = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
    x = jnp.arange(12.0).reshape(4, 3) / 10

    def f(m, x):
      return nnx.vmap(nnx.remat(lambda m, x: m(x)), in_axes=(None, 0))(m, x)

    _, c = capture(module_outputs(f))(model, x)
    np.testing.assert_allclose(c[('__call__',)][0], model(x), rtol=1e-6)


if __name__ == '__main__':
  absltest.main()
