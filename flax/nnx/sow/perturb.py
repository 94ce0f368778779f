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

"""``perturb``: an identity whose cotangent a capture collects.

Forward, ``perturb`` binds a marker (``sow_p`` of kind ``'perturb'``) that
collects nothing. Its JVP routes the tangent through ``perturb_tangent_p``, a
linear identity whose transpose sows the arriving cotangent (kind
``'cotangent'``). So the cotangent is collected when the function is
differentiated in reverse mode inside a ``capture``
(``capture(jax.grad(f))``), nothing is collected otherwise, and forward-mode
differentiation (``jax.jvp``, ``jax.jacfwd``) sees an identity.
"""

from __future__ import annotations

import itertools
import typing as tp

from flax.nnx.sow import primitive

# Numbers the ``perturb`` calls as they are traced (``ordinal`` in
# primitive.py): within one backward pass, cotangents arrive in decreasing
# order, which is how a capture tells passes apart.
_ORDINALS = itertools.count()


def perturb(
    value: tp.Any, *, name: primitive.Name, tag: tp.Hashable = None
) -> tp.Any:
  """Marks ``value`` so that a capture collects the cotangent arriving at it.

  Identity in the forward pass and under every transform. When the function
  is differentiated in reverse mode inside a :func:`~flax.nnx.sow.capture`,
  the cotangent of ``value`` (same structure, shapes and dtypes as ``value``)
  is collected under ``name``: a tuple of pytrees in call order, stacked per
  iteration inside loops. Without differentiation nothing is collected, and a
  value the differentiated inputs do not reach gets no cotangent (nothing is
  collected for it either). This plays the role of Flax's
  ``Module.perturb`` and of oryx's ``plant``-based gradient capture, without
  an initialisation pass.

  >>> import jax, jax.numpy as jnp
  >>> from flax.nnx.sow import capture, perturb
  >>> def loss(w, x):
  ...   h = perturb(jnp.tanh(w * x), name='h')
  ...   return jnp.sum(h ** 2)
  >>> grad_w, collected = capture(jax.grad(loss))(1.0, jnp.ones(2))
  >>> collected['h'][0]  # d loss / d h = 2 h
  Array([1.5231884, 1.5231884], dtype=float32)

  Args:
    value: a pytree of arrays or scalars.
    name: a ``str`` or tuple of ``str``/``int``; the key of the cotangent.
    tag: hashable or ``None``, as for :func:`~flax.nnx.sow.sow`.

  Returns:
    ``value``, unchanged.

  Raises:
    TypeError: for a bad name, tag or leaf, as :func:`~flax.nnx.sow.sow`.
  """
  name = primitive.check_name(name, 'perturb')
  primitive.check_tag(tag, name, 'perturb')
  leaves, treedef = primitive.array_leaves(value, name, 'perturb')
  if primitive.is_eager():
    return value
  out = primitive.bind_sow(
      leaves,
      name=name,
      tag=tag,
      treedef=treedef,
      kind='perturb',
      ordinal=next(_ORDINALS),
  )
  return primitive.unflatten(treedef, primitive.same_objects(value, out))
