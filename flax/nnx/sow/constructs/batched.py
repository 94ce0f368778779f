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


"""Plain sows hoisted out of a construct that ``jax.vmap`` batches.

JAX batches a ``scan`` by batching its body, and a ``cond`` on a batched
predicate by running every branch and selecting. Left alone, a sow inside
would come back with the loop axis before the mapped axis, and a sow in an
untaken branch would be collected too. So the batching wrappers of
``scan.py`` and ``cond.py`` first hoist plain sows out (the sown values
become extra outputs), let JAX's rule batch that, and sow the results again
after the construct with the mapped axis first (:func:`sow_again`); markers
before the construct keep each name's order of first sow
(:func:`mark_order`). This file holds that shared half.
"""

from __future__ import annotations


import jax

from flax.nnx.sow import _jax
from flax.nnx.sow.collect import Layout
from flax.nnx.sow.primitive import bind_sow
from flax.nnx.sow.primitive import mapped_axis_first
from flax.nnx.sow.sites import PLAIN_SOWS
from flax.nnx.sow.sites import accepts
from flax.nnx.sow.sites import sow_sites


def has_plain_sows(closed: _jax.ClosedJaxpr) -> bool:
  return any(
      accepts(PLAIN_SOWS, s.tag, s.reduction, s.kind, s.name)
      for s in sow_sites(closed.jaxpr)
  )


def sow_again(layout: Layout, values, dims, axis_size) -> None:
  """Sows the hoisted entries, with the mapped axis first."""
  pos = 0
  for spec in layout.entries:
    leaves = [
        mapped_axis_first(x, d, axis_size)
        for x, d in zip(
            values[pos : pos + spec.size], dims[pos : pos + spec.size]
        )
    ]
    pos += spec.size
    bind_sow(
        leaves,
        name=spec.name,
        tag=spec.tag,
        treedef=spec.treedef,
        kind=spec.kind,
        batch_dims=1,
        ordinal=spec.ordinal,
    )


def mark_order(sites) -> None:
  seen = set()
  for site in sites:
    # One marker per (name, tag): a capture that takes only some tags must
    # still see where each of its names is first sown.
    if (site.name, site.tag) not in seen:
      seen.add((site.name, site.tag))
      bind_sow(
          [],
          name=site.name,
          tag=site.tag,
          treedef=NO_LEAVES,
          reduction=site.reduction,
          kind='order',
      )


NO_LEAVES = jax.tree_util.tree_structure(())
