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


"""The branches of a ``cond`` on a batched predicate, masked by the branch
taken.

``jax.vmap`` runs every branch of such a ``cond`` for every example and
selects (``cond.py``). Plain sows are hoisted out and sown again after the
``cond``; two kinds of sow stay where they are, masked:

* a ``perturb``: its value is used in the branch, and its cotangent arrives
  in the backward pass. Its result becomes ``where(taken, perturb(x), x)``:
  the same value, with a cotangent that is the one arriving in the examples
  that took the branch and zero in the others (also where the untaken
  branch's derivative is ``nan``). The ``k``-th perturb of a name in each
  branch share one :class:`~flax.nnx.sow.collect.BranchOrdinal`, so a
  capture adds their cotangents into one entry: the taken branch's, per
  example.
* a reduced sow, also inside a construct in the branch (``jit``,
  ``checkpoint``, ``scan``, ``while_loop``, ``cond``): it folds with a mask,
  so an example that took another branch leaves the accumulator as it was.
  ``cond.py`` runs the two branches of a ``lax.cond`` ``true_fun`` first, so
  the sites fold in the order that gives a name its ``init_fn``.

Each branch takes the ``cond``'s index as a trailing operand; the mask
``index == branch`` reaches a construct's body as a constant of the body.
"""

from __future__ import annotations

import collections
import typing as tp

import jax
import jax.numpy as jnp

from flax.nnx.sow import _jax
from flax.nnx.sow import reductions
from flax.nnx.sow.cotangents import BranchOrdinal
from flax.nnx.sow.constructs.adapter import hoisted
from flax.nnx.sow.constructs.adapter import jit_params
from flax.nnx.sow.constructs.scan import bind_scan
from flax.nnx.sow.constructs.while_loop import bind_while
from flax.nnx.sow.primitive import MARKER_KINDS
from flax.nnx.sow.reductions import Reduction
from flax.nnx.sow.primitive import bind_sow
from flax.nnx.sow.primitive import sow_p
from flax.nnx.sow.sites import construct_name
from flax.nnx.sow.sites import edit_sows
from flax.nnx.sow.sites import sow_sites


def is_perturb(params: dict) -> bool:
  """A staged ``perturb`` marker."""
  return (
      params['kind'] == 'perturb'
      and params['effect']
      and not params['remat_copy']
  )


def is_reduced(params: dict) -> bool:
  """A staged reduced sow (not a marker)."""
  return (
      params['reduction'] is not None
      and params['effect']
      and not params['remat_copy']
      and params['kind'] not in MARKER_KINDS
  )


def _holds(jaxpr: _jax.Jaxpr) -> bool:
  """Whether ``jaxpr`` holds a perturb or a reduced sow, at any depth."""
  return any(
      is_perturb(s.eqn.params) or is_reduced(s.eqn.params)
      for s in sow_sites(jaxpr)
  )


def branch_label(branch: int, n_branches: int) -> str:
  if n_branches == 2:
    # lax.cond(pred, true_fun, false_fun) is a switch on int(pred).
    return f'branch {branch} ({("false_fun", "true_fun")[branch]} of lax.cond)'
  return f'branch {branch}'


def masked_branches(branches, index_aval) -> tuple | None:
  """``branches`` taking the index as a trailing operand, their perturbs and
  reduced sows masked; ``None`` if no branch holds any.

  Raises:
    NotImplementedError: for a reduced sow in a construct that cannot be
      given the mask (a custom derivative rule, ``shard_map``).
  """
  if not any(_holds(b.jaxpr) for b in branches):
    return None
  groups = _perturb_groups(branches)
  new = []
  for b, closed in enumerate(branches):

    def fn(*args, closed=closed, b=b):
      *ops, index = args
      state = _Ordinals(b, groups)
      return _eval_masked(closed.jaxpr, closed.consts, ops, index == b, state)

    types = [*_jax.binder_types(closed), index_aval]
    new.append(_jax.trace_to_closed_jaxpr(fn, types, 'cond_masked'))
  return tuple(new)


# ----------------------------------------------------------------------------
# Which perturbs of the branches share an ordinal.


def _perturb_groups(branches) -> dict:
  """``{(name, k): (ordinals, members, problem)}`` for the ``k``-th perturb
  of each name in the branches (in ``sow_sites`` order)."""
  per_branch = []
  for closed in branches:
    by_name = collections.defaultdict(list)
    for s in sow_sites(closed.jaxpr):
      if is_perturb(s.eqn.params):
        by_name[s.name].append(s)
    per_branch.append(by_name)
  groups = {}
  for name in {n: None for by_name in per_branch for n in by_name}:
    counts = [len(by_name[name]) for by_name in per_branch]
    for k in range(max(counts)):
      members = [
          (b, by_name[name][k])
          for b, by_name in enumerate(per_branch)
          if counts[b] > k
      ]
      ordinals = sorted({_base(s.eqn.params['ordinal']) for _, s in members})
      problem = _mismatch(name, counts, members)
      groups[name, k] = (tuple(ordinals), len(members), problem)
  return groups


def _base(ordinal) -> int:
  return ordinal.ordinal if isinstance(ordinal, BranchOrdinal) else ordinal


def _mismatch(name, counts, members) -> tuple[type, str] | None:
  """Why the perturbs ``members`` (``(branch, site)``) cannot give one
  cotangent per example, or ``None``."""
  n = len(counts)
  (b0, s0), *others = members
  what = None
  for b, count in enumerate(counts):
    if count != counts[0]:
      what = (
          f'{branch_label(b, n)} perturbs it {count} time(s) but'
          f' {branch_label(0, n)} {counts[0]} time(s)'
      )
      break
  avals0 = list(s0.value_avals())
  for b, s in others:
    avals = list(s.value_avals())
    if what is None and (
        s.eqn.params['treedef'] != s0.eqn.params['treedef'] or avals != avals0
    ):
      what = (
          f'{branch_label(b, n)} perturbs {[a.str_short() for a in avals]}'
          f' but {branch_label(b0, n)} {[a.str_short() for a in avals0]}'
      )
  if what is None:
    return None
  return ValueError, (
      f'perturb {name!r}{s0.where}: inside `lax.cond`/`lax.switch` with a'
      f' predicate batched by `jax.vmap`, {what}. The cotangent collected'
      " is the taken branch's, so every branch must perturb the same names,"
      ' the same number of times, with the same shapes and dtypes; perturb'
      ' the same value in every branch, or put the vmap around the capture'
      ' (jax.vmap(capture(f))).'
  )


class _Ordinals:
  """The :class:`BranchOrdinal` of each perturb of one branch, in order."""

  def __init__(self, branch: int, groups: dict):
    self.branch = branch
    self.groups = groups
    self.seen = collections.Counter()

  def next(self, params: dict, problem=None) -> BranchOrdinal:
    name = params['sow_name']
    ordinals, members, group_problem = self.groups[name, self.seen[name]]
    self.seen[name] += 1
    old, branch = params['ordinal'], self.branch
    if isinstance(old, BranchOrdinal):  # in a cond in a batched cond
      branch, members = (old.branch, branch), None
      problem = problem or old.problem
      ordinals = tuple(sorted({*ordinals, *old.ordinals}))
    return BranchOrdinal(
        ordinals[0],
        branch,
        members=members,
        problem=problem or group_problem,
        ordinals=ordinals,
    )


# ----------------------------------------------------------------------------
# The masked evaluation of a branch.


def _eval_masked(jaxpr, consts, args, mask, state: _Ordinals) -> list:
  env = {}

  def read(v):
    return v.val if isinstance(v, _jax.Literal) else env[v]

  env.update(zip(jaxpr.constvars, consts))
  env.update(zip(jaxpr.invars, args))
  for eqn in jaxpr.eqns:
    invals = [read(v) for v in eqn.invars]
    with _jax.equation_context(eqn):
      outs = _eval_equation(eqn, invals, mask, state)
    env.update(zip(eqn.outvars, outs))
  return [_jax.as_value(read(v)) for v in jaxpr.outvars]


def _eval_equation(eqn, invals, mask, state: _Ordinals) -> list:
  p = eqn.params
  if eqn.primitive is sow_p:
    if is_perturb(p):
      new = eqn.replace(params=dict(p, ordinal=state.next(p)))
      outs = _jax.bind_equation(new, invals)
      return [jnp.where(mask, o, x) for o, x in zip(outs, invals)]
    if is_reduced(p):
      n = len(invals) - p['n_closure']
      leaves, closure = invals[:n], invals[n:]
      return bind_masked(p, leaves, closure, mask, p['batch_dims'])[:n]
    return _jax.bind_equation(eqn, invals)
  if not any(_holds(j) for j in _jax.jaxprs_in_params(p)):
    return _jax.bind_equation(eqn, invals)
  rule = rules.get(eqn.primitive)
  outs = None
  if rule is not None:
    outs = rule(eqn, invals, lambda c: _body(c, mask, state))
  if outs is None:
    return _jax.bind_equation(_unmasked(eqn, state), invals)
  return outs


def _body(closed: _jax.ClosedJaxpr, mask, state) -> _jax.ClosedJaxpr:
  """``closed`` masked, the mask among its constants."""
  return _jax.trace_to_closed_jaxpr(
      lambda *args: _eval_masked(
          closed.jaxpr, closed.consts, args, mask, state
      ),
      _jax.binder_types(closed),
      'cond_masked',
  )


def _unmasked(eqn, state: _Ordinals):
  """``eqn`` of a construct that cannot take the mask: its perturbs raise
  if a cotangent arrives; a reduced sow raises now."""
  what = construct_name(eqn.primitive)
  for s in sow_sites_of(eqn):
    if is_reduced(s.eqn.params):
      raise NotImplementedError(
          f'sow {s.name!r}{s.where}: a reduced sow inside {what} inside a'
          ' `lax.cond`/`lax.switch` branch whose predicate `jax.vmap`'
          ' batches cannot be collected per example. Sow it outside'
          f' {what} in the branch, or put the vmap around the capture'
          ' (jax.vmap(capture(f))).'
      )

  def edit(params, in_custom_call):
    del in_custom_call
    if not is_perturb(params):
      return None
    problem = NotImplementedError, (
        f'perturb {params["sow_name"]!r}: inside {what} inside a'
        ' `lax.cond`/`lax.switch` branch whose predicate `jax.vmap`'
        ' batches, its cotangent cannot be collected per example. Perturb'
        f' outside {what} in the branch, or put the vmap around the capture'
        ' (jax.vmap(capture(f))).'
    )
    return dict(params, ordinal=state.next(params, problem))

  return edit_sows(eqn, edit, False)


def sow_sites_of(eqn):
  return [s for j in _jax.jaxprs_in_params(eqn.params) for s in sow_sites(j)]


def bind_masked(p: dict, leaves, closure, mask, batch_dims: int) -> list:
  """Binds the reduced sow of parameters ``p`` folding ``leaves`` only where
  ``mask`` (broadcast over their first ``batch_dims`` axes) is true.

  ``reduce_fn`` is applied for an example only where the mask is true, so
  an example folds the sows of the branch it took. Returns the outputs of
  the sow: the leaves, then the mask.
  """
  if leaves:
    shape = _jax.typeof(leaves[0]).shape[:batch_dims]
    mask = jnp.broadcast_to(
        jnp.reshape(mask, mask.shape + (1,) * (len(shape) - mask.ndim)), shape
    )
  n_value = len(leaves)
  value = jax.tree_util.tree_unflatten(p['treedef'], leaves)
  packed, treedef = jax.tree_util.tree_flatten((value, mask))
  original = p['reduction']
  snapshot = original.snapshot
  if snapshot is not None:
    snapshot = reductions.masked(snapshot, n_value)
  return bind_sow(
      packed,
      name=p['sow_name'],
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
      closure=closure,
  )


def _masked(reduce_fn):
  def fold(acc, value_and_mask):
    value, taken = value_and_mask
    new = reduce_fn(acc, value)
    return jax.tree.map(lambda n, a: jnp.where(taken, n, a), new, acc)

  return fold


# ----------------------------------------------------------------------------
# Constructs a branch may hold: ``rule(eqn, invals, masked)`` binds ``eqn``
# again with each sub-jaxpr ``c`` replaced by ``masked(c)`` and returns its
# outputs, or returns ``None`` where it cannot.


def _jit_rule(eqn, invals, masked):
  p = eqn.params
  body, consts = hoisted(masked(p['jaxpr']))
  params = jit_params(p, leading=len(consts), jaxpr=body)
  return _jax.jit_p.bind(*consts, *invals, **params)


def _remat_rule(eqn, invals, masked):
  p = eqn.params
  body = masked(_jax.ClosedJaxpr(p['jaxpr'], ()))
  jaxpr, consts = _jax.close_over_nothing(body)
  prevent_cse = p['prevent_cse']
  if isinstance(prevent_cse, tuple):
    prevent_cse = (*(True,) * len(consts), *prevent_cse)
  params = dict(p, jaxpr=jaxpr, prevent_cse=prevent_cse)
  return _jax.remat_p.bind(*consts, *invals, **params)


def _scan_rule(eqn, invals, masked):
  outs, _, _ = bind_scan(eqn, invals, masked(eqn.params['jaxpr']))
  return outs


def _while_rule(eqn, invals, masked):
  p = eqn.params
  cond = p['cond_jaxpr']
  if _holds(cond.jaxpr):
    return None  # a sow in the predicate: not masked
  outs, _ = bind_while(eqn, invals, cond, masked(p['body_jaxpr']))
  return outs


def _call_rule(eqn, invals, masked):
  closed = eqn.params['call_jaxpr']
  return _jax.eval_closed(masked(closed), invals)


rules: dict[_jax.Primitive, tp.Callable] = {
    _jax.jit_p: _jit_rule,
    _jax.remat_p: _remat_rule,
    _jax.scan_p: _scan_rule,
    _jax.while_p: _while_rule,
    _jax.closed_call_p: _call_rule,
}
"""How each construct takes the mask (``cond.py`` adds ``cond``)."""
