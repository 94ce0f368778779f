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

"""How a ``Collected`` looks: a compact text table, and treescope rendering.

``repr(collected)`` lists one row per name (the name, how many entries it
holds, the shape and dtype of each leaf, and a mark on ``perturb``
cotangents) instead of dumping every array; ``treescope`` (which Flax uses
to render NNX objects) renders a ``Collected`` as the dictionary it is,
tagged with its type, so the arrays can be unfolded there.
"""

from __future__ import annotations

import typing as tp

import jax
import numpy as np


def _leaf(x: tp.Any) -> str:
  shape, dtype = getattr(x, 'shape', None), getattr(x, 'dtype', None)
  if shape is None or dtype is None:
    return type(x).__name__  # a Python number kept as Flax keeps it
  return f'{np.dtype(dtype).name}{list(shape)}'


def _leaves(value: tp.Any) -> str:
  shown = list(dict.fromkeys(map(_leaf, jax.tree_util.tree_leaves(value))))
  if len(shown) > 3:
    shown = [*shown[:3], f'... ({len(shown) - 3} more)']
  return ', '.join(shown) if shown else '(no leaves)'


def rows(collected: tp.Mapping[tp.Any, tp.Any], cotangents) -> list[str]:
  """One line per name: name, entries, leaf dtypes and shapes, mark."""
  table = []
  for name, value in collected.items():
    if isinstance(value, tuple):
      count = f'{len(value)} entr{"y" if len(value) == 1 else "ies"}'
    else:
      count = 'reduced'
    mark = '  (cotangent)' if name in cotangents else ''
    table.append((repr(name), count, _leaves(value) + mark))
  if not table:
    return []
  widths = [max(len(r[i]) for r in table) for i in range(2)]
  return [
      f'{n.ljust(widths[0])}  {c.ljust(widths[1])}  {s}' for n, c, s in table
  ]


def text(collected: tp.Mapping[tp.Any, tp.Any], cotangents) -> str:
  """``repr`` of a ``Collected``: a header and the table of :func:`rows`."""
  lines = rows(collected, cotangents)
  n = len(lines)
  head = f'Collected({n} name{"" if n == 1 else "s"}'
  if not lines:
    return head + ')'
  return head + ':\n' + '\n'.join('  ' + line for line in lines) + '\n)'


def treescope_repr(collected, path, subtree_renderer):
  """``__treescope_repr__``: the dictionary, tagged with its type."""
  import treescope  # pylint: disable=g-import-not-at-top  (Flax's dependency)

  return treescope.repr_lib.render_dictionary_wrapper(
      object_type=type(collected),
      wrapped_dict=dict(collected),
      path=path,
      subtree_renderer=subtree_renderer,
  )
