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

"""The benchmark workload: a stack of pre-LN transformer blocks in Flax NNX.

Every block marks two intermediates: the attention weights (shape
``(batch, heads, seq, seq)``) and the residual stream after the block (shape
``(batch, seq, d_model)``). How a block marks them is chosen by an *emitter*,
a callable ``emit(layer, name, value) -> value``, so that one model definition
serves every variant that is compared:

* ``emit_sow``: the free function ``flax.nnx.sow.sow``, named
  ``('blocks', layer, name)``;
* ``Manual``: collects the values by hand into a dict with the same keys
  (the floor: what a user would write without any capture system);
* ``emit_none``: marks nothing;
* ``emit_module_sow``: ``Module.sow(nnx.Intermediate, name, value)`` on the
  block, the NNX API (the shim or Flax's original, whichever is installed);
* ``emit_perturb``: ``flax.nnx.sow.perturb`` on the residual stream only.
"""

from __future__ import annotations

import dataclasses
import math
import typing as tp

import jax
import jax.numpy as jnp
from flax import nnx

from flax.nnx.sow import perturb, sow


@dataclasses.dataclass(frozen=True)
class Sizes:
  """The sizes of the transformer workload."""

  layers: int = 12
  d_model: int = 256
  heads: int = 4
  seq: int = 128
  batch: int = 8
  d_ff: int = 1024

  def replace(self, **kwargs) -> Sizes:
    return dataclasses.replace(self, **kwargs)

  def asdict(self) -> dict[str, int]:
    return dataclasses.asdict(self)


FULL = Sizes()
QUICK = Sizes(layers=2, d_model=32, heads=2, seq=8, batch=2, d_ff=64)

Emit = tp.Callable[['Block', int, str, jax.Array], jax.Array]


class Block(nnx.Module):
  """A pre-LN transformer block with causal multi-head self-attention."""

  def __init__(self, sizes: Sizes, *, rngs: nnx.Rngs):
    d = sizes.d_model
    self.heads = sizes.heads
    self.ln1 = nnx.LayerNorm(d, rngs=rngs)
    self.qkv = nnx.Linear(d, 3 * d, rngs=rngs)
    self.proj = nnx.Linear(d, d, rngs=rngs)
    self.ln2 = nnx.LayerNorm(d, rngs=rngs)
    self.fc1 = nnx.Linear(d, sizes.d_ff, rngs=rngs)
    self.fc2 = nnx.Linear(sizes.d_ff, d, rngs=rngs)

  def __call__(self, x: jax.Array, layer: int, emit: Emit) -> jax.Array:
    b, s, d = x.shape
    dh = d // self.heads
    q, k, v = jnp.split(self.qkv(self.ln1(x)), 3, axis=-1)
    q, k, v = (t.reshape(b, s, self.heads, dh) for t in (q, k, v))
    logits = jnp.einsum('bqhd,bkhd->bhqk', q, k) / math.sqrt(dh)
    causal = jnp.tril(jnp.ones((s, s), dtype=bool))
    logits = jnp.where(causal, logits, jnp.finfo(logits.dtype).min)
    attn = emit(self, layer, 'attn', jax.nn.softmax(logits, axis=-1))
    y = jnp.einsum('bhqk,bkhd->bqhd', attn, v).reshape(b, s, d)
    x = x + self.proj(y)
    x = x + self.fc2(jax.nn.gelu(self.fc1(self.ln2(x))))
    return emit(self, layer, 'residual', x)


class Transformer(nnx.Module):
  """``sizes.layers`` blocks followed by a final LayerNorm."""

  def __init__(self, sizes: Sizes, *, rngs: nnx.Rngs):
    self.blocks = nnx.List([Block(sizes, rngs=rngs)
                            for _ in range(sizes.layers)])
    self.ln_f = nnx.LayerNorm(sizes.d_model, rngs=rngs)

  def __call__(self, x: jax.Array, emit: Emit | None = None) -> jax.Array:
    emit = emit_module_sow if emit is None else emit
    for i, block in enumerate(self.blocks):
      x = block(x, i, emit)
    return self.ln_f(x)


def emit_none(block, layer, name, value):
  del block, layer, name
  return value


def emit_sow(block, layer, name, value):
  del block
  return sow(value, name=('blocks', layer, name))


def emit_perturb(block, layer, name, value):
  del block
  if name != 'residual':
    return value
  return perturb(value, name=('blocks', layer, name))


def emit_module_sow(block, layer, name, value):
  del layer
  block.sow(nnx.Intermediate, name, value)
  return value


class Manual:
  """An emitter that collects the intermediates by hand."""

  def __init__(self):
    self.collected = {}

  def __call__(self, block, layer, name, value):
    del block
    self.collected[('blocks', layer, name)] = value
    return value


def make_model(sizes: Sizes, seed: int = 0) -> Transformer:
  return Transformer(sizes, rngs=nnx.Rngs(seed))


def abstract_state(sizes: Sizes):
  """``(graphdef, state)`` of a model whose leaves are ShapeDtypeStructs."""
  model = nnx.eval_shape(lambda: make_model(sizes))
  return nnx.split(model)


def concrete_state(sizes: Sizes, seed: int = 0):
  """``(graphdef, state)`` of an initialised model."""
  return nnx.split(make_model(sizes, seed))


def example_input(sizes: Sizes, seed: int = 1) -> jax.Array:
  return jax.random.normal(
      jax.random.key(seed), (sizes.batch, sizes.seq, sizes.d_model))


def abstract_input(sizes: Sizes) -> jax.ShapeDtypeStruct:
  return jax.ShapeDtypeStruct((sizes.batch, sizes.seq, sizes.d_model),
                              jnp.float32)


def pure_functions(graphdef):
  """The pure functions of ``(state, x)`` that the core benchmarks compare.

  Returns:
    A dict with ``f`` (marks every intermediate with ``sow``), ``f_manual``
    (returns ``(out, {name: value})`` by hand, keys as ``capture`` names
    them), ``f_plain`` (marks nothing) and ``loss`` (a scalar loss that
    marks the residual stream with ``perturb``).
  """

  def f(state, x):
    return nnx.merge(graphdef, state)(x, emit_sow)

  def f_manual(state, x):
    manual = Manual()
    out = nnx.merge(graphdef, state)(x, manual)
    return out, manual.collected

  def f_plain(state, x):
    return nnx.merge(graphdef, state)(x, emit_none)

  def loss(state, x):
    out = nnx.merge(graphdef, state)(x, emit_perturb)
    return jnp.mean(out**2)

  return dict(f=f, f_manual=f_manual, f_plain=f_plain, loss=loss)
