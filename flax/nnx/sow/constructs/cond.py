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


"""``lax.cond`` and ``lax.switch``.

What a sow inside does:

* **Capture**: every branch returns the same extra outputs
  (:func:`align_branches`); a branch that does not sow a reduced name passes
  its accumulator through, and every branch must sow the same plain names
  with the same types. A name first sown in a ``cond`` starts from the
  ``init_fn`` of the branch written first (``true_fun``, branch 0 of
  ``switch``).
* **Intervene**: replacements enter as extra operands of every branch.
* **Under ``vmap`` on a batched predicate**: JAX runs every branch and
  selects; plain sows are hoisted out and the selected branch's value is
  sown again after the ``cond`` (``batched.py``); reduced sows, at any
  depth, fold where they are with a mask, so an untaken branch leaves the
  accumulator as it was, and a perturb's cotangent is the taken branch's,
  one entry (``masked.py``). While ``intervene`` stages, a kept half of each
  plain sow stays in every branch for it to replace, and the hoisted value
  is the kept sow's result.
"""

from __future__ import annotations

import collections
import dataclasses
import typing as tp


from flax.nnx.sow import _jax
from flax.nnx.sow import _jax_patches
from flax.nnx.sow.collect import Collector
from flax.nnx.sow.collect import Layout
from flax.nnx.sow.collect import cached
from flax.nnx.sow.collect import collect_rules
from flax.nnx.sow.collect import rewrite_jaxpr
from flax.nnx.sow.constructs.adapter import branches_hoisted
from flax.nnx.sow.constructs.batched import has_plain_sows
from flax.nnx.sow.constructs.batched import kept_in_place
from flax.nnx.sow.constructs.batched import mark_order
from flax.nnx.sow.constructs.batched import sow_again
from flax.nnx.sow.constructs.masked import branch_label
from flax.nnx.sow.constructs.masked import masked_branches
from flax.nnx.sow.constructs.masked import rules as masked_rules
from flax.nnx.sow.inject import intervene_rules
from flax.nnx.sow.primitive import MARKER_KINDS
from flax.nnx.sow.intervening import replacing
from flax.nnx.sow.intervening import staging_captures
from flax.nnx.sow.reductions import strong
from flax.nnx.sow.primitive import PLAIN_SOWS
from flax.nnx.sow.primitive import accepts
from flax.nnx.sow.sites import construct_names
from flax.nnx.sow.accumulators import init_order_sites
from flax.nnx.sow.sites import sow_sites

# ----------------------------------------------------------------------------
# cond / switch


def _entry_positions(layout: Layout, n_out: int) -> dict:
  """``{(name, k): (spec, first output)}`` for the ``k``-th entry of each
  name, in layout order; the entries follow the ``n_out`` outputs."""
  seen = collections.Counter()
  pos, where = n_out, {}
  for spec in layout.entries:
    where[spec.name, seen[spec.name]] = (spec, pos)
    seen[spec.name] += 1
    pos += spec.size
  return where


def _branch_mismatch(name, branch, what, sources):
  where_ = ''
  for j in sources:
    sites = [s for s in sow_sites(j.jaxpr) if s.name == name]
    if sites:
      where_ = sites[0].where
      break
  n = len(sources)
  what = what.replace('branch 0', branch_label(0, n))
  branch = branch_label(branch, n)
  return ValueError(
      f'sow {name!r}{where_}: inside `lax.cond`/`lax.switch`, {branch}'
      f' {what}.'
      ' Every branch must sow the same plain names, the same number of'
      ' times, with the same shapes and dtypes, since capture returns the'
      ' value of the branch taken; sow the same value in every branch (e.g.'
      ' zeros in the others), or pass reduce_fn/init_fn to reduce it.'
  )


def align_branches(
    rewritten: tp.Sequence[tuple[_jax.ClosedJaxpr, Layout]],
    n_out: int,
    sources: tp.Sequence[_jax.ClosedJaxpr] = (),
) -> tuple[tuple[_jax.ClosedJaxpr, ...], Layout]:
  """Branches whose extra outputs line up with the first branch's.

  Args:
    rewritten: ``(jaxpr, layout)`` of each branch, rewritten with the same
      reduced specs.
    n_out: the number of ordinary outputs.
    sources: the branches before the rewrite (errors say where the
      mismatched name is sown).

  Returns:
    The branches, each returning ``[*outputs, *entries, *accumulators]`` with
    the entries in the first branch's order and without weak types, and the
    layout they share (names from every branch).

  Raises:
    ValueError: if the branches do not sow the same plain names the same
      number of times with the same structure, shapes and dtypes.
  """
  placed = [_entry_positions(layout, n_out) for _, layout in rewritten]
  for i in range(1, len(rewritten)):
    _check_like_branch_0(rewritten, placed, i, sources)
  varying = _varying_entry_axes(rewritten, placed)
  branches = tuple(
      cached(
          closed,
          ('cond', n_out, tuple(placed[0])),
          lambda c=closed, l=layout, w=where: _aligned(c, l, w, n_out, varying),
      )
      for (closed, layout), where in zip(rewritten, placed)
  )
  names = {n: None for _, layout in rewritten for n in layout.names}
  shared = dataclasses.replace(rewritten[0][1], names=tuple(names))
  return branches, shared


def _check_like_branch_0(rewritten, placed, i: int, sources) -> None:
  """Raises unless branch ``i`` sows the plain names branch 0 sows, as many
  times, with the same structure, shapes and dtypes."""
  count0 = collections.Counter(name for name, _ in placed[0])
  count = collections.Counter(name for name, _ in placed[i])
  for name in {**count0, **count}:
    if count[name] != count0[name]:
      raise _branch_mismatch(
          name,
          i,
          f'sows it {count[name]} time(s) but branch 0 sows it'
          f' {count0[name]} time(s)',
          sources,
      )
  (closed0, _), (closed, _) = rewritten[0], rewritten[i]
  for key, (s0, p0) in placed[0].items():
    si, pi = placed[i][key]
    a0 = _strong_avals(closed0.out_avals[p0 : p0 + s0.size])
    ai = _strong_avals(closed.out_avals[pi : pi + si.size])
    if s0.treedef != si.treedef or a0 != ai:
      raise _branch_mismatch(
          key[0],
          i,
          f'sows {si.treedef} of {[a.str_short() for a in ai]} but branch'
          f' 0 sows {s0.treedef} of {[a.str_short() for a in a0]}',
          sources,
      )


def _strong_avals(avals):
  # Compared without the mesh axes they vary over (see ``align_branches``).
  return [_jax.invariant_aval(a.strip_weak_type()) for a in avals]


def _varying_entry_axes(rewritten, placed) -> dict:
  """For each entry (in branch 0's order), the mesh axes each of its leaves
  varies over in any branch: inside ``shard_map``, a branch may sow a value
  that varies over mesh axes where another sows one that does not (zeros,
  say)."""
  mesh_order = _jax.current_mesh_axes()
  varying = {}
  for key in placed[0]:
    per_branch = []
    for (closed, _), where in zip(rewritten, placed):
      spec, pos = where[key]
      per_branch.append(closed.out_avals[pos : pos + spec.size])
    varying[key] = [
        tuple(
            a
            for a in mesh_order
            if any(a in _jax.varying_axes(aval) for aval in avals)
        )
        for avals in zip(*per_branch)
    ]
  return varying


def _aligned(closed, layout: Layout, where: dict, n_out: int, varying: dict):
  """``closed`` returning its outputs, its entries in the order of
  ``varying`` (strong, varying over its axes), then its accumulators."""
  order, axes = list(range(n_out)), [()] * n_out
  for key, leaf_axes in varying.items():
    spec, pos = where[key]
    order.extend(range(pos, pos + spec.size))
    axes.extend(leaf_axes)
  end = n_out + layout.num_entry_leaves
  order.extend(range(end, end + layout.num_accumulator_leaves))
  axes.extend([()] * layout.num_accumulator_leaves)

  def fn(*args):
    outs = _jax.eval_closed(closed, args)
    return [
        _jax.pvary(strong(outs[i]), a) if i >= n_out else outs[i]
        for i, a in zip(order, axes)
    ]

  return _jax.trace_to_closed_jaxpr(
      fn, _jax.binder_types(closed), 'cond_capture'
  )


def _bind_cond(
    eqn: _jax.JaxprEqn, invals, branches, *, leading=(), trailing=()
):
  """``eqn``'s ``cond`` bound again with ``branches`` and extra operands.

  The binders both rules add, as checkify makes every branch return its
  error value: a capture passes accumulators as leading operands,
  ``intervene`` replacements as trailing ones. Every branch's constants
  become leading operands (:func:`branches_hoisted`).

  Args:
    eqn: the ``cond`` equation.
    invals: its operands, ``[index, *operands]``.
    branches: each taking ``[*leading, *operands, *trailing]`` and returning
      ``[*outputs, *extra outputs]``, the same extra outputs in every branch.
    leading: the extra operands before the equation's own.
    trailing: the extra operands after them.

  Returns:
    ``(outputs, extra outputs)``.
  """
  branches, consts = branches_hoisted(branches)
  index, *ops = invals
  outs = _jax.cond_p.bind(
      index,
      *consts,
      *leading,
      *ops,
      *trailing,
      **dict(eqn.params, branches=branches),
  )
  n_out = len(eqn.outvars)
  return outs[:n_out], outs[n_out:]


def _cond_capture(collector: Collector, eqn: _jax.JaxprEqn, invals):
  branches = eqn.params['branches']
  # An index that varies over mesh axes (inside shard_map) picks a branch
  # per shard, so what the branches sow varies over them too.
  axes = _jax.varying_axes(_jax.typeof(invals[0]))
  specs = collector.reduced.vary(
      collector.reduced.specs(branches, branches=True), axes
  )
  acc_in = collector.reduced.leaves(specs)
  # A perturb's forward marker returns nothing; one branch may hold it and
  # another not (its cotangents, if any, are aligned like values).
  rewritten = [collector.rewrite(b, specs) for b in branches]
  new_branches, layout = align_branches(
      [_without_markers(*r) for r in rewritten], len(eqn.outvars), branches
  )
  outs, extra = _bind_cond(eqn, invals, new_branches, leading=acc_in)
  if axes:
    extra = [_jax.pvary(x, tuple(axes)) for x in extra]
  # The names first, in the order of first sow (markers included), then
  # the markers: a marker claims its name where the forward pass has it.
  collector.absorb(layout, extra)
  _add_markers(collector, [layout for _, layout in rewritten])
  return outs


def _add_markers(collector: Collector, layouts) -> None:
  """Records branch 0's perturb markers where every branch has the same
  (by name, in order): whichever branch runs, the forward pass perturbs
  those names there, and the cotangents, aligned like values, carry branch
  0's entries, so ``Collected`` can match them to these markers (their
  call order). Branches that perturb differently leave the ordinals alone
  to order the cotangents."""
  markers = [[e for e in l.entries if e.kind == 'perturb'] for l in layouts]
  first = [e.name for e in markers[0]]
  if first and all([e.name for e in m] == first for m in markers[1:]):
    for spec in markers[0]:
      collector.add_entry(spec, [])


def _cond_intervene(injector, eqn, invals):
  branches = eqn.params['branches']
  leaves, spec = injector.take(injector.branch_consumed(branches))
  avals = [_jax.typeof(x) for x in leaves]
  new = tuple(injector.rewrite(b, spec, avals) for b in branches)
  outs, _ = _bind_cond(eqn, invals, new, trailing=leaves)
  return outs


def _without_markers(closed, layout: Layout):
  entries = tuple(e for e in layout.entries if e.kind != 'perturb')
  return closed, dataclasses.replace(layout, entries=entries)


collect_rules[_jax.cond_p] = _cond_capture
intervene_rules[_jax.cond_p] = _cond_intervene
construct_names[_jax.cond_p] = '`lax.cond`/`lax.switch`'


def _cond_batcher(jax_rule, axis_data, args, dims, *, branches, **params):
  if dims[0] is not None:
    _check_no_array_replacement(branches)
  if (
      dims[0] is None
      or not staging_captures()
      or not any(sow_sites(b.jaxpr) for b in branches)
  ):
    # Nothing a capture could collect: JAX's rule, unchanged.
    return jax_rule(axis_data, args, dims, branches=branches, **params)
  return _batched_predicate(jax_rule, axis_data, args, dims, branches, params)


def _scalar_like(aval):
  """The type of one example's index, where ``aval`` is the batched one's.

  Inside a ``shard_map`` body an index that varies over manual mesh axes
  keeps them (a type without sharding may not).
  """
  if aval.manual_axis_type.empty:
    return aval.update(shape=(), sharding=None)
  return aval.update(shape=(), sharding=aval.sharding.update(spec=()))


def _batched_predicate(jax_rule, axis_data, args, dims, branches, params):
  """A batched predicate: vmap runs every branch for every example and
  selects.

  Perturbs and reduced sows are masked where they are (``masked.py``): a
  reduced sow folds only for the examples that took its branch; then plain
  sows, which every branch must sow alike, are taken out (the value of the
  branch taken is selected) and sown again after the ``cond``.
  """
  n_out = len(branches[0].out_avals)
  original = branches
  index_aval = _scalar_like(_jax.typeof(args[0]))
  masked = masked_branches(branches, index_aval)
  if masked is not None:
    # The index enters every branch as a trailing operand.
    branches, args, dims = masked, [*args, args[0]], [*dims, dims[0]]
  branches, layout = _plain_hoisted(branches, n_out)
  if layout is None and masked is None:
    return jax_rule(axis_data, args, dims, branches=branches, **params)
  # The hoisted sows come after the cond; markers before it keep the names
  # in their order of first sow (branch by branch, as without vmap) and
  # give a reduced name the init_fn of its first site there.
  mark_order(_with_init_reductions(original))
  if (
      masked is not None
      and len(branches) == 2
      and 'branches_platforms' not in params
  ):
    # JAX runs the branches in order: true_fun, written first, runs (and
    # folds) first, as without vmap.
    branches, args = branches[::-1], [1 - args[0], *args[1:]]
  outs, out_dims = jax_rule(axis_data, args, dims, branches=branches, **params)
  if layout is not None:
    sow_again(layout, outs[n_out:], out_dims[n_out:], axis_data.size)
  return outs[:n_out], out_dims[:n_out]


def _plain_hoisted(branches, n_kept: int):
  """``(branches, layout)``: the branches returning their plain sows' values
  after their ``n_kept`` outputs, and the layout of those; ``layout`` is
  ``None`` (the branches unchanged) where they sow no plain name, or sow
  them differently and no capture staging collects them.

  Under intervene, each sow stays in its branch (a kept half, which it
  replaces in every branch) and its result is hoisted (``batched.py``).
  """
  if not any(has_plain_sows(b) for b in branches):
    return branches, None
  split = [kept_in_place(b) for b in branches]
  try:
    return align_branches(
        [rewrite_jaxpr(b, PLAIN_SOWS, ()) for b in split], n_kept, branches
    )
  except ValueError:
    # Mismatched branches: outside a capture the sows stay identities in
    # every branch. Under a capture that collects them, vmap would run
    # every branch and collect a value for every example, also those that
    # took another branch, so it is the error it is without vmap.
    if _collects_plain(branches):
      raise
    return branches, None


def _collects_plain(branches) -> bool:
  """Whether a capture staging now collects a plain sow of ``branches``."""
  return any(
      accepts(k, s.tag, s.reduction, s.kind, s.name)
      for k in staging_captures()
      for b in branches
      for s in sow_sites(b.jaxpr)
      if s.reduction is None and s.kind not in MARKER_KINDS
  )


def _check_no_array_replacement(branches) -> None:
  """``intervene`` cannot give an array entry to a sow in a batched ``cond``.

  vmap runs every branch and selects, so each branch's sow would take an
  entry of its own, where ``capture`` collects one value per site.
  """
  for b in branches:
    for s in sow_sites(b.jaxpr):
      key = replacing(s.eqn.params) if s.eqn.params['effect'] else None
      if key is not None and s.name in key.arrays:
        raise ValueError(
            f'intervene: sow {s.name!r}{s.where} is inside `lax.cond`/'
            '`lax.switch` with a predicate batched by `jax.vmap`, which runs'
            ' every branch, so an array replacement cannot be matched to the'
            ' branch taken. Pass a callable (values[name] = fn), or put the'
            ' vmap around intervene.'
        )


# The init_fn of a reduced name sown in the branches.


def _with_init_reductions(branches) -> list:
  """The sites of ``branches`` in program order, each reduced one with the
  reduction of its name's first site in :func:`init_order_sites`'s order
  (``true_fun`` first), so the order markers give a name its ``init_fn``
  as without vmap."""
  found = [s for b in branches for s in sow_sites(b.jaxpr)]
  init = {}
  for b in _in_init_order(branches):
    for site in init_order_sites(b.jaxpr):
      init.setdefault(site.name, site.reduction)
  return [
      dataclasses.replace(s, reduction=init[s.name])
      if s.reduction is not None and s.name in init
      else s
      for s in found
  ]


def _in_init_order(seq):
  """Branches (or their sites' branch numbers) in the order in which they
  give a name its ``init_fn``: a two-branch ``cond`` is staged as
  ``(false_fun, true_fun)``, and ``true_fun``, written first, comes first."""
  seq = list(seq)
  return seq[::-1] if len(seq) == 2 else seq


def _cond_masked(eqn, invals, masked):
  branches = tuple(masked(b) for b in eqn.params['branches'])
  outs, _ = _bind_cond(eqn, invals, branches)
  return outs


masked_rules[_jax.cond_p] = _cond_masked

_jax_patches.register('cond_batching', _cond_batcher)
