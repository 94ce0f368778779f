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

"""Plain sows inside ``lax.scan`` and ``lax.cond`` under ``jax.vmap``.

JAX batches a ``scan`` by batching its body, and a ``cond`` on a batched
predicate by running every branch and selecting. Left alone, a sow inside
would come back with the loop axis before the mapped axis, and a sow in an
untaken branch would be collected too. So this file wraps JAX's batching
rules for ``scan`` and ``cond``: when the body or branches hold plain sows,
it first hoists them out (rewriting the body so the sown values become extra
outputs, stacked ``ys`` for a scan), lets JAX's rule batch that, and sows the
results again after the construct, with the mapped axis first. An enclosing
capture then sees one sow per site, of the selected branch's value, shaped
``(batch, steps, ...)`` like vmap's outputs. Outside any capture the result
is still the identity. Reduced sows are left where they are.
"""

from __future__ import annotations

import typing as tp

import jax

from flax.nnx.sow import _jax
from flax.nnx.sow import loops
from flax.nnx.sow.capture import Layout
from flax.nnx.sow.capture import PLAIN_SOWS
from flax.nnx.sow.capture import accepts
from flax.nnx.sow.capture import rewrite_jaxpr
from flax.nnx.sow.capture import sow_sites
from flax.nnx.sow.primitive import mapped_axis_first
from flax.nnx.sow.primitive import bind_sow
from flax.nnx.sow.primitive import MARKER_KINDS
from flax.nnx.sow.primitive import staging_active
from flax.nnx.sow.primitive import staging_captures


def _has_plain_sows(closed: _jax.ClosedJaxpr) -> bool:
  return any(
      accepts(PLAIN_SOWS, s.tag, s.reduction, s.kind)
      for s in sow_sites(closed.jaxpr)
  )


def _sow_again(layout: Layout, values, dims, axis_size) -> None:
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
    )


def _mark_order(sites) -> None:
  seen = set()
  for site in sites:
    if site.name not in seen:
      seen.add(site.name)
      bind_sow(
          [],
          name=site.name,
          tag=site.tag,
          treedef=_NO_LEAVES,
          reduction=site.reduction,
          kind='order',
      )


_NO_LEAVES = jax.tree_util.tree_structure(())


def _scan_batcher(jax_rule, axis_data, args, dims, **params):
  body = params['jaxpr']
  if not _has_plain_sows(body):
    return jax_rule(axis_data, args, dims, **params)
  # [consts, carry, xs] -> [carry, ys, entries]: the entries are extra ys.
  new_body, layout = rewrite_jaxpr(body, PLAIN_SOWS, ())
  # The hoisted sows come after the scan; markers before it keep every name
  # the body sows in its order of first sow.
  _mark_order(sow_sites(body.jaxpr))
  outs, out_dims = jax_rule(
      axis_data, args, dims, **dict(params, jaxpr=new_body)
  )
  n = len(outs) - layout.num_extra
  _sow_again(layout, outs[n:], out_dims[n:], axis_data.size)
  return outs[:n], out_dims[:n]


def _cond_batcher(jax_rule, axis_data, args, dims, *, branches, **params):
  if dims[0] is not None and staging_active():
    reduced = [
        s
        for b in branches
        for s in sow_sites(b.jaxpr)
        if s.reduction is not None
    ]
    if reduced:
      raise NotImplementedError(
          f'sow {reduced[0].name!r}{reduced[0].where}: a reduced sow inside'
          ' `lax.cond`/'
          '`lax.switch` whose predicate `jax.vmap` batches, inside a capture,'
          ' would be reduced for every example in every branch (vmap runs'
          ' all branches). Put the vmap around the capture'
          ' (jax.vmap(capture(f))), or sow a plain value and reduce it'
          ' afterwards.'
      )
  if dims[0] is None or not any(_has_plain_sows(b) for b in branches):
    return jax_rule(axis_data, args, dims, branches=branches, **params)
  n_out = len(branches[0].out_avals)
  try:
    new_branches, layout = loops.align_branches(
        [rewrite_jaxpr(b, PLAIN_SOWS, ()) for b in branches], n_out, branches
    )
  except ValueError:
    # Mismatched branches: outside a capture the sows stay identities in
    # every branch. Under a capture that collects them, vmap would run every
    # branch and collect a value for every example, also those that took
    # another branch, so it is the error it is without vmap.
    if any(
        accepts(key, s.tag, s.reduction, s.kind)
        for key in staging_captures()
        for b in branches
        for s in sow_sites(b.jaxpr)
        if s.reduction is None and s.kind not in MARKER_KINDS
    ):
      raise
    return jax_rule(axis_data, args, dims, branches=branches, **params)
  outs, out_dims = jax_rule(
      axis_data, args, dims, branches=new_branches, **params
  )
  _sow_again(layout, outs[n_out:], out_dims[n_out:], axis_data.size)
  return outs[:n_out], out_dims[:n_out]


def _wrap(primitive, batcher: tp.Callable) -> None:
  jax_rule = _jax.fancy_primitive_batchers[primitive]
  if getattr(jax_rule, '_sow_wrapped', False):
    return

  def rule(axis_data, args, dims, **params):
    return batcher(jax_rule, axis_data, args, dims, **params)

  rule._sow_wrapped = True  # pylint: disable=protected-access
  _jax.fancy_primitive_batchers[primitive] = rule


_wrap(_jax.scan_p, _scan_batcher)
_wrap(_jax.cond_p, _cond_batcher)
