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

"""Activation-patching grids in one call, built on ``intervene``.

This file owns :func:`patching_grid`: the standard grids of activation
patching (the residual stream by layer x position, attention heads by layer
x head), each cell one patched run, all of them one batched program.
"""

from __future__ import annotations

import typing as tp

import jax
import jax.numpy as jnp

from flax.nnx.sow.inject import intervene
from flax.nnx.sow.primitive import Name


def patching_grid(
    f: tp.Callable[..., jax.Array],
    names: tp.Sequence[Name],
    clean: tp.Mapping[Name, tp.Any],
    *,
    axis: int,
    batch_size: int | None = None,
) -> tp.Callable[..., jax.Array]:
  """``f`` run once per cell of an activation-patching grid.

  Cell ``(i, j)`` of ``patching_grid(f, names, clean, axis=a)(*args)`` is
  ``f(*args)`` with the value sown under ``names[i]`` replaced by itself,
  except at index ``j`` of its axis ``a``, where it gets ``clean``'s value
  (the patch of one layer at one position, or one head): TransformerLens'
  ``patching`` grids. With ``args`` the corrupted inputs and ``clean`` what
  ``capture(f)`` collected on the clean ones, a cell near ``f(clean args)``
  marks an activation that carries the difference. Every cell is one run of
  the program, all of them batched with ``jax.vmap`` (in chunks of
  ``batch_size`` cells with ``jax.lax.map``), so under ``jax.jit`` (or
  ``nnx.jit`` for NNX modules among ``args``) the grid is one compiled
  program.

  >>> import jax.numpy as jnp
  >>> from flax.nnx.sow import capture, patching_grid, sow
  >>> def f(x):  # two layers of a residual stream (pos, d)
  ...   r0 = sow(2.0 * x, name=('resid', 0))
  ...   r1 = sow(r0 + jnp.roll(r0, 1, axis=0), name=('resid', 1))
  ...   return r1[-1].sum()
  >>> clean, corrupted = jnp.ones((3, 2)), jnp.zeros((3, 2))
  >>> _, acts = capture(f)(clean)
  >>> grid = patching_grid(f, [('resid', 0), ('resid', 1)], acts, axis=0)
  >>> grid(corrupted)  # (layers, positions): clean f gives 8
  Array([[0., 4., 4.],
         [0., 0., 8.]], dtype=float32)

  Args:
    f: the function to patch; it returns a scalar (a metric such as a logit
      difference) and sows every name of ``names`` once.
    names: the grid's rows, one sow name each (a layer's residual stream,
      or its per-head attention values ``hook_z``).
    clean: for each name of ``names``, a one-entry tuple whose value has
      the sown value's shape and dtype (what ``capture(f)`` returns).
    axis: the axis of the sown values along which cells are patched one
      index at a time: the grid's columns (e.g. ``1`` for positions of a
      ``(batch, pos, d_model)`` stream, ``-2`` for the heads of a
      ``(batch, pos, heads, d_head)`` value).
    batch_size: cells per batch (``None``: all cells at once). A smaller
      one trades time for memory.

  Returns:
    ``g(*args, **kwargs)`` returning a float array ``(len(names), n)``, ``n``
    the size of ``axis``, with ``f``'s output dtype.

  Raises:
    ValueError: ``names`` is empty; a name is not in ``clean``, or has
      other than one entry, or its entries differ in the size of ``axis``;
      (when called) what ``intervene`` raises, e.g. for a name the program
      does not sow.
  """
  names = list(names)
  if not names:
    raise ValueError('patching_grid: names is empty; list the sows to patch.')
  values, sizes = {}, set()
  for name in names:
    if name not in clean:
      raise ValueError(
          f'patching_grid: clean has no entry for {name!r}; pass what'
          ' capture(f) collected on the clean inputs.'
      )
    entries = clean[name]
    if not isinstance(entries, (tuple, list)) or len(entries) != 1:
      raise ValueError(
          f'patching_grid: clean[{name!r}] must hold one entry (a name sown'
          ' once per run, as one layer is), got'
          f' {len(entries) if isinstance(entries, (tuple, list)) else entries!r}.'
      )
    (value,) = entries
    value = jnp.asarray(value)
    try:
      sizes.add(value.shape[axis])
    except IndexError:
      raise ValueError(
          f'patching_grid: axis {axis} is out of range for {name!r}, whose'
          f' values have shape {value.shape}.'
      ) from None
    values[name] = value
  if len(sizes) != 1:
    raise ValueError(
        f'patching_grid: the values of {names!r} have different sizes along'
        f' axis {axis} ({sorted(sizes)}); a grid needs one column count.'
    )
  (size,) = sizes
  rows = {name: i for i, name in enumerate(names)}

  def grid(*args, **kwargs) -> jax.Array:
    def cell(row_and_column):
      row, column = row_and_column

      def hook(name, value):
        v = values[name]
        index = jnp.arange(size).reshape(
            [-1 if d == axis % v.ndim else 1 for d in range(v.ndim)]
        )
        at = (row == rows[name]) & (index == column)
        return jnp.where(at, v.astype(value.dtype), value)

      return intervene(f, hook, names=names)(*args, **kwargs)

    row, column = jnp.divmod(jnp.arange(len(names) * size), size)
    out = jax.lax.map(cell, (row, column), batch_size=batch_size)
    return out.reshape(len(names), size)

  return grid
