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
``(batch, steps, ...)`` like vmap's outputs. Reduced sows are left where
they are. Where no capture is staging (nothing could collect a sow), and for
a construct without sows, JAX's rule runs unchanged.
"""

from __future__ import annotations

import typing as tp

import jax
import jax.numpy as jnp

from flax.nnx.sow import _jax
from flax.nnx.sow import _jax_patches
from flax.nnx.sow import loops
from flax.nnx.sow import reductions
from flax.nnx.sow.capturing import Layout
from flax.nnx.sow.capturing import PLAIN_SOWS
from flax.nnx.sow.capturing import accepts
from flax.nnx.sow.capturing import rewrite_jaxpr
from flax.nnx.sow.capturing import sow_sites
from flax.nnx.sow.primitive import mapped_axis_first
from flax.nnx.sow.primitive import Reduction
from flax.nnx.sow.primitive import bind_sow
from flax.nnx.sow.primitive import sow_p
from flax.nnx.sow.primitive import MARKER_KINDS
from flax.nnx.sow.primitive import intervening
from flax.nnx.sow.primitive import staging_captures


def _has_plain_sows(closed: _jax.ClosedJaxpr) -> bool:
  return any(
      accepts(PLAIN_SOWS, s.tag, s.reduction, s.kind, s.name)
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
        ordinal=spec.ordinal,
    )


def _mark_order(sites) -> None:
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
          treedef=_NO_LEAVES,
          reduction=site.reduction,
          kind='order',
      )


_NO_LEAVES = jax.tree_util.tree_structure(())


def _scan_batcher(jax_rule, axis_data, args, dims, **params):
  body = params['jaxpr']
  if intervening() or not staging_captures() or not _has_plain_sows(body):
    # Nothing a capture could collect: JAX's rule, unchanged.
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


def _check_no_enclosing_capture(branches) -> None:
  """``intervene`` keeps the sows of a cond on a batched predicate in every
  branch, and vmap runs every branch for every example: a capture around
  the intervene would collect every branch's value."""
  for b in branches:
    for s in sow_sites(b.jaxpr):
      if s.kind not in MARKER_KINDS and any(
          accepts(k, s.tag, s.reduction, s.kind, s.name)
          for k in staging_captures()
      ):
        raise NotImplementedError(
            f'sow {s.name!r}{s.where}: a capture around intervene cannot'
            ' collect a sow inside `lax.cond`/`lax.switch` on a predicate'
            ' that `jax.vmap` batches (inside the intervened function): vmap'
            ' runs every branch for every example, so the capture would get'
            " every branch's value. Put the vmap around both, as in"
            ' jax.vmap(capture(intervene(f, values))).'
        )


def _cond_batcher(jax_rule, axis_data, args, dims, *, branches, **params):
  key = intervening()
  if key is not None and dims[0] is not None:
    _check_no_array_replacement(key, branches)
    _check_no_enclosing_capture(branches)
  if (
      dims[0] is None
      or key is not None
      or not staging_captures()
      or not any(sow_sites(b.jaxpr) for b in branches)
  ):
    # Nothing a capture could collect: JAX's rule, unchanged.
    return jax_rule(axis_data, args, dims, branches=branches, **params)
  # A batched predicate: vmap runs every branch for every example and
  # selects. Reduced sows are taken out first, each with a mask of the
  # examples whose branch sowed it; then plain sows, which every branch must
  # sow alike (the value of the branch taken is selected).
  n_out = len(branches[0].out_avals)
  original = branches
  hoisted = _hoist_reduced(branches)
  if hoisted is not None:
    branches, reduced_sites = hoisted
  else:
    reduced_sites = []
  n_kept = len(branches[0].out_avals)  # outputs, then reduced values
  plain = any(_has_plain_sows(b) for b in branches)
  layout = None
  if plain:
    try:
      branches, layout = loops.align_branches(
          [rewrite_jaxpr(b, PLAIN_SOWS, ()) for b in branches],
          n_kept,
          branches,
      )
    except ValueError:
      # Mismatched branches: outside a capture the sows stay identities in
      # every branch. Under a capture that collects them, vmap would run
      # every branch and collect a value for every example, also those that
      # took another branch, so it is the error it is without vmap.
      if any(
          accepts(key, s.tag, s.reduction, s.kind, s.name)
          for key in staging_captures()
          for b in branches
          for s in sow_sites(b.jaxpr)
          if s.reduction is None and s.kind not in MARKER_KINDS
      ):
        raise
      layout = None
  if layout is not None or reduced_sites:
    # The hoisted sows come after the cond; markers before it keep the
    # names in their order of first sow (branch by branch, as without vmap).
    _mark_order([s for b in original for s in sow_sites(b.jaxpr)])
  outs, out_dims = jax_rule(axis_data, args, dims, branches=branches, **params)
  if layout is not None:
    _sow_again(layout, outs[n_kept:], out_dims[n_kept:], axis_data.size)
  if reduced_sites:
    index = mapped_axis_first(args[0], dims[0], axis_data.size)
    _sow_reduced_again(
        reduced_sites,
        index,
        outs[n_out:n_kept],
        out_dims[n_out:n_kept],
        axis_data.size,
    )
  return outs[:n_out], out_dims[:n_out]


def _check_no_array_replacement(key, branches) -> None:
  """``intervene`` cannot give an array entry to a sow in a batched ``cond``.

  vmap runs every branch and selects, so each branch's sow would take an
  entry of its own, where ``capture`` collects one value per site.
  """
  for b in branches:
    for s in sow_sites(b.jaxpr):
      if s.name in key.arrays and key.replaces(s.eqn.params):
        raise ValueError(
            f'intervene: sow {s.name!r}{s.where} is inside `lax.cond`/'
            '`lax.switch` with a predicate batched by `jax.vmap`, which runs'
            ' every branch, so an array replacement cannot be matched to the'
            ' branch taken. Pass a callable (values[name] = fn), or put the'
            ' vmap around intervene.'
        )


# Reduced sows in the branches of a cond on a batched predicate.


class _ReducedSite(tp.NamedTuple):
  branch: int
  params: dict
  avals: tuple[tp.Any, ...]


def _hoist_reduced(branches):
  """Branches without their top-level reduced sows, which they return.

  Every branch returns ``[*outputs, *values]`` where ``values`` has one slot
  per reduced sow of every branch: its own sows' operands, zeros elsewhere.
  Returns ``None`` if no branch holds a staged reduced sow.

  Raises:
    NotImplementedError: for a staged reduced sow nested in a construct
      inside a branch.
  """
  edits = []
  for closed in branches:
    jaxpr = closed.jaxpr
    subst, eqns, found, outs = {}, [], [], []
    for eqn in jaxpr.eqns:
      p = eqn.params
      if (
          eqn.primitive is sow_p
          and p['reduction'] is not None
          and p['effect']
          and not p['remat_copy']
          and p['kind'] not in MARKER_KINDS
      ):
        operands = [
            subst.get(v, v) if isinstance(v, _jax.Var) else v
            for v in eqn.invars
        ]
        subst.update(zip(eqn.outvars, operands))
        found.append((p, tuple(v.aval for v in eqn.invars)))
        outs.extend(operands)
        continue
      nested = [
          s
          for j in _jax.jaxprs_in_params(p)
          for s in sow_sites(j)
          if s.reduction is not None
          and s.eqn.params['effect']
          and s.kind not in MARKER_KINDS
      ]
      if nested:
        raise NotImplementedError(
            f'sow {nested[0].name!r}{nested[0].where}: a reduced sow nested'
            ' in a construct inside a `lax.cond`/`lax.switch` branch whose'
            ' predicate `jax.vmap` batches cannot be collected per example.'
            ' Sow it directly in the branch, or put the vmap around the'
            ' capture (jax.vmap(capture(f))).'
        )
      if subst:
        eqn = eqn.replace(
            invars=[
                subst.get(v, v) if isinstance(v, _jax.Var) else v
                for v in eqn.invars
            ]
        )
      eqns.append(eqn)
    outvars = [
        subst.get(v, v) if isinstance(v, _jax.Var) else v for v in jaxpr.outvars
    ]
    edited = _jax.edit_jaxpr(jaxpr, eqns, [*outvars, *outs])
    edits.append((_jax.ClosedJaxpr(edited, closed.consts), found))
  if not any(found for _, found in edits):
    return None
  sites = [
      _ReducedSite(b, p, avals)
      for b, (_, found) in enumerate(edits)
      for p, avals in found
  ]
  n_out = len(branches[0].out_avals)
  new = []
  for b, (edited, _) in enumerate(edits):

    def fn(*args, edited=edited, b=b):
      outs = _jax.eval_closed(edited, args)
      own = iter(outs[n_out:])
      values = []
      for site in sites:
        for aval in site.avals:
          values.append(
              next(own)
              if site.branch == b
              else jnp.zeros(aval.shape, aval.dtype)
          )
      return [*outs[:n_out], *values]

    new.append(
        _jax.trace_to_closed_jaxpr(fn, branches[b].in_avals, 'cond_reduced')
    )
  return tuple(new), sites


def _sow_reduced_again(sites, index, values, dims, axis_size) -> None:
  """Sows each hoisted reduced value with the mask of its branch's examples.

  ``reduce_fn`` is applied for an example only where the mask is true, so
  each example folds the sows of the branch it took, as without vmap.
  """
  pos = 0
  for site in sites:
    n = len(site.avals)
    leaves = [
        mapped_axis_first(x, d, axis_size)
        for x, d in zip(values[pos : pos + n], dims[pos : pos + n])
    ]
    pos += n
    p = site.params
    batch_dims = p['batch_dims'] + 1
    mask = index == site.branch
    if leaves:
      shape = leaves[0].shape[:batch_dims]
      mask = jnp.broadcast_to(
          mask.reshape((axis_size,) + (1,) * (len(shape) - 1)), shape
      )
    n_value = len(leaves) - p['n_closure']
    value = jax.tree_util.tree_unflatten(p['treedef'], leaves[:n_value])
    packed, treedef = jax.tree_util.tree_flatten((value, mask))
    original = p['reduction']
    snapshot = original.snapshot
    if snapshot is not None:
      snapshot = reductions.masked(snapshot, n_value)
    bind_sow(
        packed,
        name=p['name'],
        tag=p['tag'],
        treedef=treedef,
        reduction=Reduction(
            _masked(original.reduce_fn),
            original.init_fn,
            snapshot,
            original.fixed_type,
        ),
        kind=p['kind'],
        batch_dims=batch_dims,
        closure=leaves[n_value:],
    )


def _masked(reduce_fn):
  def fold(acc, value_and_mask):
    value, taken = value_and_mask
    new = reduce_fn(acc, value)
    return jax.tree.map(lambda n, a: jnp.where(taken, n, a), new, acc)

  return fold


_jax_patches.register('scan_batching', _scan_batcher)
_jax_patches.register('cond_batching', _cond_batcher)
