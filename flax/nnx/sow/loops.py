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

"""Capture rules for loops and branches: ``scan``, ``while``, ``cond``.

* ``scan`` (also ``fori_loop`` with static bounds and ``lax.map``): a plain
  sow in the body becomes an extra ``ys`` output, so it comes back stacked
  along a new leading axis lined up with ``xs``; a reduced name becomes an
  extra carry.
* ``while`` (also ``fori_loop`` with traced bounds): reduced names become
  extra carries; a plain name is an error, since the number of entries is not
  known when the program is staged.
* ``cond``/``switch``: every branch returns the same extra outputs; a branch
  that does not sow a reduced name passes its accumulator through, and every
  branch must sow the same plain names with the same types.

Each also has a rule of ``control.py``'s pass, which says how a predicate
that varies over mesh axes (inside ``shard_map``) makes the outputs vary.
"""

from __future__ import annotations

import collections
import dataclasses
import typing as tp

import numpy as np

from flax.nnx.sow import _jax
from flax.nnx.sow.capturing import Collector
from flax.nnx.sow.capturing import Layout
from flax.nnx.sow.capturing import cached
from flax.nnx.sow.capturing import collect_rules
from flax.nnx.sow.capturing import construct_names
from flax.nnx.sow.capturing import site_annotations
from flax.nnx.sow.capturing import sow_sites
from flax.nnx.sow.reductions import strong
from flax.nnx.sow.control import NO_AXES
from flax.nnx.sow.control import control_rules
from flax.nnx.sow.control import passes_through
from flax.nnx.sow.control import union


def _permuted(closed: _jax.ClosedJaxpr, in_order, out_order, name: str):
  """``closed`` with its inputs and outputs permuted.

  The result's input ``i`` is ``closed``'s input ``in_order[i]``... inverted:
  ``in_order[j]`` is the position in the *new* signature of old input ``j``;
  ``out_order`` lists, for each new output, the old output it returns.
  """
  n_in = len(closed.in_avals)
  new_in_avals = [None] * n_in
  for old, new in enumerate(in_order):
    new_in_avals[new] = closed.in_avals[old]

  def fn(*args):
    outs = _jax.eval_closed(closed, [args[in_order[j]] for j in range(n_in)])
    return [outs[i] for i in out_order]

  return _jax.trace_to_closed_jaxpr(fn, new_in_avals, name)


def _hoisted(closed: _jax.ClosedJaxpr):
  """``(jaxpr taking its constants as leading inputs, constants)``, cached.

  A rewritten body can hold constants that ``f`` never passed to the loop
  (an array a ``reduce_fn`` closes over). JAX caches an eagerly run loop's
  executable by its jaxpr, so such constants would stay alive; passed as
  operands, as ``lax.scan`` does with closures, they do not.
  """

  if not closed.consts:
    return closed, []  # (not cached: the entry would keep its key alive)

  def build():
    open_jaxpr, consts = _jax.close_over_nothing(closed)
    return _jax.ClosedJaxpr(open_jaxpr, ()), consts

  return cached(closed, 'hoisted', build)


# ----------------------------------------------------------------------------
# scan


def _scan_rule(collector: Collector, eqn: _jax.JaxprEqn, invals):
  p = eqn.params
  body = p['jaxpr']
  n_consts, n_carry = p['num_consts'], p['num_carry']
  rewritten, layout, acc_in = collector.prepare(body)
  n_acc = len(acc_in)
  n_body_in = len(body.in_avals)
  n_carry_out = n_carry
  n_ys = len(body.out_avals) - n_carry
  n_entries = layout.num_entry_leaves

  def build():
    # rewritten: [acc, consts, carry, xs] -> [carry, ys, entries, acc]
    # scan body: [consts, acc, carry, xs] -> [acc, carry, ys, entries]
    in_order = [n_consts + i for i in range(n_acc)] + [
        i if i < n_consts else i + n_acc for i in range(n_body_in)
    ]
    base = n_carry_out + n_ys
    out_order = (
        [base + n_entries + i for i in range(n_acc)]
        + list(range(n_carry_out + n_ys))
        + [base + i for i in range(n_entries)]
    )
    return _permuted(rewritten, in_order, out_order, 'scan_capture_body')

  new_body, hoisted = _hoisted(
      cached(rewritten, ('scan', n_consts, n_carry, n_acc, n_ys), build)
  )
  consts, rest = invals[:n_consts], invals[n_consts:]
  outs = _jax.scan_p.bind(
      *hoisted,
      *consts,
      *acc_in,
      *rest,
      **dict(
          p,
          jaxpr=new_body,
          num_consts=len(hoisted) + n_consts,
          num_carry=n_carry + n_acc,
      ),
  )
  acc_out = outs[:n_acc]
  ordinary = outs[n_acc : n_acc + n_carry + n_ys]
  entries = outs[n_acc + n_carry + n_ys :]
  collector.absorb(layout, [*entries, *acc_out])
  return ordinary


collect_rules[_jax.scan_p] = _scan_rule
construct_names[_jax.scan_p] = '`lax.scan`'


# ----------------------------------------------------------------------------
# while


def _while_rule(collector: Collector, eqn: _jax.JaxprEqn, invals):
  p = eqn.params
  cond, body = p['cond_jaxpr'], p['body_jaxpr']
  n_cc, n_bc = p['cond_nconsts'], p['body_nconsts']
  in_cond = collector.accepted_sites([cond])
  if in_cond:
    raise ValueError(
        f'sow {in_cond[0].name!r}{in_cond[0].where}: capture cannot collect'
        ' a sow inside the'
        ' cond_fun of `lax.while_loop`; sow the value in body_fun instead.'
    )
  plain = [s for s in collector.accepted_sites([body]) if s.reduction is None]
  if plain:
    raise ValueError(
        f'sow {plain[0].name!r}{plain[0].where}: a plain sow inside'
        ' `lax.while_loop` (or a'
        ' `fori_loop` with traced bounds) cannot be collected, because the'
        ' number of iterations is not known when the program is staged. Pass'
        ' reduce_fn and init_fn to reduce the values into one accumulator'
        ' (e.g. reduce_fn=lambda acc, v: acc + v, init_fn=lambda:'
        ' jnp.zeros(shape)), or use `lax.scan` / a fori_loop with static'
        ' bounds to stack them.'
    )
  if cond.out_avals[0].shape and collector.accepted_sites([body]):
    site = collector.accepted_sites([body])[0]
    raise NotImplementedError(
        f'sow {site.name!r}{site.where}: a reduced sow'
        ' inside `lax.while_loop` whose predicate `jax.vmap` batches (inside'
        ' the capture) cannot be collected: the loop runs until every'
        ' example is done, so the reduction would also count finished'
        ' examples. Put the vmap around the capture (jax.vmap(capture(f))).'
    )
  # A predicate that varies over mesh axes (inside shard_map) makes every
  # accumulator the loop carries vary over them.
  specs = collector.vary_accumulators(
      collector.reduced_specs([body]), _jax.varying_axes(cond.out_avals[0])
  )
  rewritten, layout = collector.rewrite(body, specs)
  acc_in = collector.accumulator_leaves(specs)
  n_acc = len(acc_in)
  n_carry = len(body.out_avals)

  def build_body():
    # rewritten: [acc, bconsts, carry] -> [carry, acc]
    # while body: [bconsts, acc, carry] -> [acc, carry]
    in_order = [n_bc + i for i in range(n_acc)] + [
        i if i < n_bc else i + n_acc for i in range(n_bc + n_carry)
    ]
    out_order = [n_carry + i for i in range(n_acc)] + list(range(n_carry))
    return _permuted(rewritten, in_order, out_order, 'while_capture_body')

  def build_cond():
    # cond: [cconsts, acc, carry] -> pred, ignoring acc.
    acc_avals = [_jax.typeof(x) for x in acc_in]
    avals = [*cond.in_avals[:n_cc], *acc_avals, *cond.in_avals[n_cc:]]

    def fn(*args):
      return _jax.eval_closed(cond, [*args[:n_cc], *args[n_cc + n_acc :]])

    return _jax.trace_to_closed_jaxpr(fn, avals, 'while_capture_cond')

  new_body, body_hoisted = _hoisted(
      cached(rewritten, ('while_body', n_bc, n_acc), build_body)
  )
  new_cond, cond_hoisted = _hoisted(
      cached(
          cond,
          ('while_cond', n_cc, tuple(_jax.typeof(x) for x in acc_in)),
          build_cond,
      )
  )
  cconsts, bconsts = invals[:n_cc], invals[n_cc : n_cc + n_bc]
  carry = invals[n_cc + n_bc :]
  outs = _jax.while_p.bind(
      *cond_hoisted,
      *cconsts,
      *body_hoisted,
      *bconsts,
      *acc_in,
      *carry,
      **dict(
          p,
          cond_jaxpr=new_cond,
          body_jaxpr=new_body,
          cond_nconsts=len(cond_hoisted) + n_cc,
          body_nconsts=len(body_hoisted) + n_bc,
      ),
  )
  collector.absorb(layout, outs[:n_acc])
  return outs[n_acc:]


collect_rules[_jax.while_p] = _while_rule
construct_names[_jax.while_p] = '`lax.while_loop`'


def _control_axes(axes, site):
  if not axes:
    return site
  return dataclasses.replace(site, control_axes=site.control_axes | axes)


site_annotations[_jax.while_p] = lambda eqn, site: _control_axes(
    _jax.varying_axes(eqn.params['cond_jaxpr'].out_avals[0]), site
)
site_annotations[_jax.cond_p] = lambda eqn, site: _control_axes(
    _jax.varying_axes(eqn.invars[0].aval), site
)


# ----------------------------------------------------------------------------
# Per-device control flow inside shard_map (``control.py``): a loop or branch
# whose predicate varies over mesh axes makes its outputs vary over them,
# whatever their types say, and what it sows.


def _scan_control(control, eqn, in_axes, scope, edit):
  p = eqn.params
  body = p['jaxpr'].jaxpr
  n_consts, n_carry = p['num_consts'], p['num_carry']
  consts = in_axes[:n_consts]
  carry = in_axes[n_consts : n_consts + n_carry]
  xs = in_axes[n_consts + n_carry :]
  carry_avals = [v.aval for v in eqn.outvars[:n_carry]]
  while True:  # the carries' axes grow until they are a fixed point
    outs, _ = control.jaxpr(body, [*consts, *carry, *xs], scope, False)
    grown = [
        (c | o) - _jax.varying_axes(a)
        for c, o, a in zip(carry, outs[:n_carry], carry_avals)
    ]
    if grown == carry:
      break
    carry = grown
  outs, new = control.jaxpr(body, [*consts, *carry, *xs], scope, edit)
  out_axes = [*carry, *outs[n_carry:]]
  if new is None:
    return out_axes, None
  jaxpr = _jax.ClosedJaxpr(new, p['jaxpr'].consts)
  return out_axes, eqn.replace(params=dict(p, jaxpr=jaxpr))


def _while_control(control, eqn, in_axes, scope, edit):
  p = eqn.params
  cond, body = p['cond_jaxpr'], p['body_jaxpr']
  n_cc, n_bc = p['cond_nconsts'], p['body_nconsts']
  cconsts, bconsts = in_axes[:n_cc], in_axes[n_cc : n_cc + n_bc]
  carry = in_axes[n_cc + n_bc :]
  carry_avals = [v.aval for v in eqn.outvars]
  # A carry the body returns as it is stays what it was, however many
  # times the loop runs; every other one depends on the trip count.
  kept = [
      body.jaxpr.outvars[j] is body.jaxpr.invars[n_bc + j]
      for j in range(len(carry))
  ]
  while True:
    (pred,), _ = control.jaxpr(cond.jaxpr, [*cconsts, *carry], scope, False)
    trips = _jax.varying_axes(cond.out_avals[0]) | pred
    outs, _ = control.jaxpr(
        body.jaxpr, [*bconsts, *carry], scope | trips, False
    )
    grown = [
        (c | o | (NO_AXES if k else trips)) - _jax.varying_axes(a)
        for c, o, k, a in zip(carry, outs, kept, carry_avals)
    ]
    if grown == carry:
      break
    carry = grown
  _, new = control.jaxpr(body.jaxpr, [*bconsts, *carry], scope | trips, edit)
  if new is None:
    return carry, None
  jaxpr = _jax.ClosedJaxpr(new, body.consts)
  return carry, eqn.replace(params=dict(p, body_jaxpr=jaxpr))


def _cond_control(control, eqn, in_axes, scope, edit):
  branches = eqn.params['branches']
  # Each device takes the branch its index picks.
  taken = _jax.varying_axes(eqn.invars[0].aval) | in_axes[0]
  outs, new = [], []
  for branch in branches:
    o, n = control.jaxpr(branch.jaxpr, in_axes[1:], scope | taken, edit)
    outs.append(o)
    new.append(branch if n is None else _jax.ClosedJaxpr(n, branch.consts))
  jaxprs = [b.jaxpr for b in branches]
  out_axes = [
      union(o[j] for o in outs)
      | (NO_AXES if passes_through(jaxprs, j) else taken)
      for j in range(len(eqn.outvars))
  ]
  if all(n is b for n, b in zip(new, branches)):
    return out_axes, None
  return out_axes, eqn.replace(params=dict(eqn.params, branches=tuple(new)))


control_rules[_jax.scan_p] = _scan_control
control_rules[_jax.while_p] = _while_control
control_rules[_jax.cond_p] = _cond_control


# ----------------------------------------------------------------------------
# cond / switch


def _entry_keys(layout: Layout) -> list[tuple[tp.Any, int]]:
  """``(name, k)`` for the ``k``-th entry of each name, in layout order."""
  seen = collections.Counter()
  keys = []
  for spec in layout.entries:
    keys.append((spec.name, seen[spec.name]))
    seen[spec.name] += 1
  return keys


def _branch_mismatch(name, branch, what, sources):
  where_ = ''
  for j in sources:
    sites = [s for s in sow_sites(j.jaxpr) if s.name == name]
    if sites:
      where_ = sites[0].where
      break
  if len(sources) == 2:
    # lax.cond(pred, true_fun, false_fun) is a switch on int(pred).
    label = {
        0: 'branch 0 (false_fun of lax.cond)',
        1: 'branch 1 (true_fun of lax.cond)',
    }
    what = what.replace('branch 0', label[0])
    branch = label[branch]
  else:
    branch = f'branch {branch}'
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
  placed = []  # per branch: {(name, k): (spec, first output position)}
  for closed, layout in rewritten:
    pos, where = n_out, {}
    for key, spec in zip(_entry_keys(layout), layout.entries):
      where[key] = (spec, pos)
      pos += spec.size
    placed.append(where)
  keys0 = _entry_keys(rewritten[0][1])
  first = placed[0]
  count0 = collections.Counter(spec.name for spec in rewritten[0][1].entries)
  for i, where in enumerate(placed[1:], 1):
    count = collections.Counter(spec.name for spec in rewritten[i][1].entries)
    for name in {**count0, **count}:
      if count[name] != count0[name]:
        raise _branch_mismatch(
            name,
            i,
            f'sows it {count[name]} time(s) but branch 0 sows it'
            f' {count0[name]} time(s)',
            sources,
        )
    for key in keys0:
      (s0, p0), (si, pi) = first[key], where[key]
      a0 = _strong_avals(rewritten[0][0].out_avals[p0 : p0 + s0.size])
      ai = _strong_avals(rewritten[i][0].out_avals[pi : pi + si.size])
      if s0.treedef != si.treedef or a0 != ai:
        raise _branch_mismatch(
            key[0],
            i,
            f'sows {si.treedef} of {[a.str_short() for a in ai]} but branch'
            f' 0 sows {s0.treedef} of {[a.str_short() for a in a0]}',
            sources,
        )

  # Inside shard_map, a branch may sow a value that varies over mesh axes
  # where another sows one that does not (zeros, say): each entry leaf
  # varies over the axes it varies over in any branch.
  mesh_order = _jax.current_mesh_axes()
  varying = {}
  for key in keys0:
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

  def build(closed, layout, where):
    order = list(range(n_out))
    axes = [()] * n_out
    for key in keys0:
      spec, pos = where[key]
      order.extend(range(pos, pos + spec.size))
      axes.extend(varying[key])
    end = n_out + layout.num_entry_leaves
    order.extend(range(end, end + layout.num_accumulator_leaves))
    axes.extend([()] * layout.num_accumulator_leaves)

    def fn(*args):
      outs = _jax.eval_closed(closed, args)
      return [
          _jax.pvary(strong(outs[i]), a) if i >= n_out else outs[i]
          for i, a in zip(order, axes)
      ]

    return _jax.trace_to_closed_jaxpr(fn, closed.in_avals, 'cond_capture')

  branches = tuple(
      cached(
          closed,
          ('cond', n_out, tuple(keys0)),
          lambda c=closed, l=layout, w=where: build(c, l, w),
      )
      for (closed, layout), where in zip(rewritten, placed)
  )
  names = {n: None for _, layout in rewritten for n in layout.names}
  shared = dataclasses.replace(rewritten[0][1], names=tuple(names))
  return branches, shared


def _strong_avals(avals):
  # Compared without the mesh axes they vary over (see ``align_branches``).
  return [_jax.invariant_aval(a.strip_weak_type()) for a in avals]


def _cond_rule(collector: Collector, eqn: _jax.JaxprEqn, invals):
  branches = eqn.params['branches']
  # An index that varies over mesh axes (inside shard_map) picks a branch
  # per shard, so what the branches sow varies over them too.
  axes = _jax.varying_axes(_jax.typeof(invals[0]))
  specs = collector.vary_accumulators(
      collector.reduced_specs(branches, branches=True), axes
  )
  acc_in = collector.accumulator_leaves(specs)
  n_out = len(eqn.outvars)
  # A perturb's forward marker returns nothing; one branch may hold it and
  # another not (its cotangents, if any, are aligned like values).
  new_branches, layout = align_branches(
      [_without_markers(*collector.rewrite(b, specs)) for b in branches],
      n_out,
      branches,
  )
  new_branches, hoisted = _branches_hoisted(new_branches)
  index, ops = invals[0], invals[1:]
  outs = _jax.cond_p.bind(
      index,
      *hoisted,
      *acc_in,
      *ops,
      **dict(eqn.params, branches=new_branches),
  )
  if axes:
    outs = [*outs[:n_out], *(_jax.pvary(x, tuple(axes)) for x in outs[n_out:])]
  return collector.split_outputs(layout, outs, n_out)


def _without_markers(closed, layout: Layout):
  entries = tuple(e for e in layout.entries if e.kind != 'perturb')
  return closed, dataclasses.replace(layout, entries=entries)


def _branches_hoisted(branches):
  """Branches taking every branch's constants as leading inputs (see
  :func:`_hoisted`); each reads its own and ignores the others'."""
  parts = [_hoisted(b) for b in branches]
  if not any(consts for _, consts in parts):
    return branches, []
  avals = [_jax.typeof(c) for _, consts in parts for c in consts]
  offsets = np.cumsum([0] + [len(consts) for _, consts in parts])
  new = []
  for i, (open_branch, consts) in enumerate(parts):
    lo, hi = int(offsets[i]), int(offsets[i + 1])

    def build(open_branch=open_branch, lo=lo, hi=hi):
      n = len(avals)

      def fn(*args):
        return _jax.eval_closed(open_branch, [*args[lo:hi], *args[n:]])

      in_avals = [*avals, *open_branch.in_avals[hi - lo :]]
      return _jax.trace_to_closed_jaxpr(fn, in_avals, 'cond_capture_consts')

    new.append(cached(open_branch, ('cond_consts', tuple(avals), lo), build))
  return tuple(new), [c for _, consts in parts for c in consts]


collect_rules[_jax.cond_p] = _cond_rule
construct_names[_jax.cond_p] = '`lax.cond`/`lax.switch`'
