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

"""The cotangents ``perturb`` collects, in call order.

A ``perturb`` leaves a forward marker in the program (an entry of kind
``'perturb'`` that collects nothing) and, through ``perturb_tangent_p``, a
sow of its cotangent (kind ``'cotangent'``) in each backward pass that
reaches it. Backward passes run the perturbs last call first, so a capture
receives a name's cotangents in reverse; :func:`in_call_order` puts them
back, matching each cotangent to the marker of its forward call.

Under ``jax.vmap`` of a ``cond`` on a batched predicate every branch runs,
so each branch's perturb sows a cotangent; they share a
:class:`BranchOrdinal` and are added into one entry (the taken branch's
cotangent per example, ``constructs/masked.py``).
"""

from __future__ import annotations

import typing as tp

import jax
import jax.numpy as jnp

class BranchOrdinal(tp.NamedTuple):
  """The ``ordinal`` of a ``perturb`` in a branch of a ``cond`` on a batched
  predicate (``constructs/masked.py``).

  ``jax.vmap`` runs every branch, so the ``k``-th perturb of a name in each
  branch sows a cotangent, zero in the examples that took another branch.
  They share ``ordinal`` (the least of their own) and differ in ``branch``;
  a capture adds them into one entry, the taken branch's cotangent per
  example, and raises if only some of the ``members`` sent one (a branch
  whose perturbed value the differentiated inputs do not reach, as without
  vmap). ``problem``: ``(error type, message)`` where the perturbs of the
  branches do not line up, raised if a cotangent arrives.
  """

  ordinal: int
  branch: tp.Hashable
  members: int | None = None  # how many branches perturb (None: unknown)
  problem: tuple[type, str] | None = None
  # The ordinals of the members' own perturbs: a cotangent sown after the
  # cond from the branches (under a vmap around the differentiation) has
  # one of them.
  ordinals: tuple[int, ...] = ()


def in_call_order(items: list[tuple[tp.Any, tp.Any]]) -> list[tp.Any]:
  """The cotangents of one name, in the order of their ``perturb`` calls.

  ``items`` are the name's entries in the order the program ran them: the
  forward markers (``kind='perturb'``, one per perturb the forward pass ran)
  and the cotangents. A run of markers starts a segment: the backward passes
  of that forward pass follow it. A backward pass sows the cotangents of its
  perturbs last call first, so within a segment the cotangents are matched
  to the markers taken in reverse (:func:`_matched_to_markers`), which is
  exact also where a cached ``jax.jit`` or ``checkpoint`` made several calls
  share one ``ordinal`` (it is fixed when the perturb is traced). Where a
  segment has no marker (its forward pass ran outside this capture), the
  ordinals alone order it (:func:`_by_ordinals`).
  """
  out: list[tp.Any] = []
  for markers, cotangents in _segments(items):
    order = _matched_to_markers(markers, cotangents)
    out.extend(_by_ordinals(cotangents) if order is None else order)
  return out


def _segments(items):
  """``items`` cut at each run of markers: ``[(markers, cotangents)]``."""
  segments: list[tuple[list[tp.Any], list[tuple[tp.Any, tp.Any]]]] = [
      ([], [])
  ]
  for spec, value in items:
    if spec.kind == 'perturb':
      if segments[-1][1]:
        segments.append(([], []))
      segments[-1][0].append(spec)
    else:
      segments[-1][1].append((spec, value))
  return segments


def _matched_to_markers(markers, cotangents) -> list[tp.Any] | None:
  """The cotangents of one segment in call order, each matched to a marker.

  Each backward pass visits the markers in reverse and gives a cotangent to
  those whose perturb its inputs reach: a cotangent takes the next marker
  (in reverse) with its ordinal, and one that has none left starts the next
  backward pass. The perturbs of the branches of one ``cond`` on a batched
  predicate (a :class:`BranchOrdinal`) are one marker, whose cotangent is
  the sum of theirs. ``None`` where the ordinals alone must decide (a
  marker without an ordinal, or a cotangent no marker has).

  Raises:
    ValueError: where markers share an ordinal (one traced perturb called
      several times through a cached ``jit``/``checkpoint``) and a pass
      does not give each of them a cotangent, so which call a cotangent
      belongs to cannot be told; or where the branches' cotangents do not
      line up (:func:`_check_every_branch`).
  """
  if not markers or not cotangents:
    return None
  if any(m.ordinal is None for m in markers):
    return None
  reverse = _marker_keys(markers)[::-1]
  passes = _backward_passes(reverse, cotangents)
  if passes is None:
    return None
  if len(set(reverse)) < len(reverse) and any(
      len(p) < len(reverse) for p in passes
  ):
    raise _shared_trace_error(markers[0].name, len(reverse))
  out = []
  for p in passes:
    for j in sorted(p, reverse=True):
      spec, value, branches = p[j]
      _check_every_branch(branches, spec)
      out.append(value)
  return out


def _key(ordinal) -> int:
  """The ordinal a cotangent is matched by (for the branches of a batched
  ``cond``, the one they share)."""
  if isinstance(ordinal, BranchOrdinal):
    return ordinal.ordinal
  return ordinal


def _marker_keys(markers) -> list[frozenset]:
  """Per perturb call of the forward pass, the ordinals its cotangents may
  have: the markers of the branches of one batched ``cond`` (one per
  branch, between two plain markers) are one call."""
  keys, open_ = [], {}
  for m in markers:
    o = m.ordinal
    if not isinstance(o, BranchOrdinal):
      open_.clear()
      keys.append(frozenset([o]))
      continue
    if o.ordinal in open_ and o.branch not in open_[o.ordinal]:
      open_[o.ordinal].add(o.branch)
    else:
      open_[o.ordinal] = {o.branch}
      keys.append(frozenset([o.ordinal, *o.ordinals]))
  return keys


def _backward_passes(reverse, cotangents) -> list[dict] | None:
  """Per backward pass, ``{marker index in reverse: [spec, value,
  branches]}``; ``None`` for a cotangent no marker has."""
  passes: list[dict] = []
  pos = len(reverse)
  for spec, value in cotangents:
    if passes and _added_to_slot(passes[-1], reverse, spec, value):
      continue
    key = _key(spec.ordinal)
    j = _next_slot(reverse, key, pos)
    if j is None:  # a new backward pass
      j = _next_slot(reverse, key, 0)
      if j is None:
        return None
      passes.append({})
    branches = None
    if isinstance(spec.ordinal, BranchOrdinal):
      branches = {spec.ordinal.branch}
    passes[-1][j] = [spec, value, branches]
    pos = j + 1
  return passes


def _added_to_slot(slots: dict, reverse, spec, value) -> bool:
  """Adds a branch's cotangent to another branch's of the same batched
  ``cond`` call in this pass (``slots``), if there is one."""
  ordinal = spec.ordinal
  if not isinstance(ordinal, BranchOrdinal):
    return False
  for j, slot in slots.items():
    branches = slot[2]
    if (
        _key(ordinal) in reverse[j]
        and branches is not None
        and ordinal.branch not in branches
    ):
      _add_branch(slot, spec, value)
      return True
  return False


def _shared_trace_error(name, calls: int) -> ValueError:
  return ValueError(
      f'capture: perturb {name!r} is called {calls}'
      ' times, some of them through one cached trace (a jax.jit or'
      ' jax.checkpoint function called more than once), and a backward'
      ' pass gives only some of those calls a cotangent (the others'
      ' perturb values the differentiated inputs do not reach), so which'
      ' call a cotangent belongs to cannot be told. Give the calls their'
      ' own names (e.g. name=(name, i)), or perturb only values that are'
      ' differentiated.'
  )


def _next_slot(keys, ordinal, start: int) -> int | None:
  """The first marker at or after ``start`` whose ordinals hold
  ``ordinal``."""
  return next((k for k in range(start, len(keys)) if ordinal in keys[k]), None)


def _by_ordinals(items: list[tuple[tp.Any, tp.Any]]) -> list[tp.Any]:
  """Cotangents in call order by their ordinals alone: a backward pass sows
  them last call first, so their ordinals decrease, and an ordinal that does
  not decrease starts a new pass. Each pass is reversed; the passes keep
  their order. The cotangents of the branches of one :class:`BranchOrdinal`
  in one pass are added into one."""
  passes: list[list[list[tp.Any]]] = [[]]  # [ordinal, value, branches]
  last = None
  for spec, value in items:
    ordinal, branches = spec.ordinal, None
    if isinstance(ordinal, BranchOrdinal):
      if _added_to_branch(passes[-1], spec, value):
        continue
      ordinal, branches = ordinal.ordinal, {ordinal.branch}
    if last is not None and (ordinal is None or ordinal >= last):
      passes.append([])
    passes[-1].append([ordinal, value, branches, spec])
    last = ordinal
  for item in (item for p in passes for item in p):
    _check_every_branch(*item[2:])
  return [item[1] for p in passes for item in reversed(p)]


def _check_every_branch(branches: set | None, spec) -> None:
  members = None if branches is None else spec.ordinal.members
  if members is not None and len(branches) < members:
    raise ValueError(
        f'capture: perturb {spec.name!r} is in {members} branches of a'
        ' `lax.cond`/`lax.switch` whose predicate `jax.vmap` batches, but'
        f' only {len(branches)} of them give it a cotangent (the others'
        ' perturb a value that the differentiated inputs do not reach, or'
        ' one inside a custom derivative rule). The cotangent collected is'
        " the taken branch's, so every branch must give one; perturb a value"
        ' computed from the inputs in every branch, or put the vmap around'
        ' the capture (jax.vmap(capture(f))).'
    )


def _added_to_branch(items: list[list[tp.Any]], spec, value):
  """Adds ``value`` to the cotangent of another branch of its
  :class:`BranchOrdinal` in ``items`` (one pass), if there is one."""
  ordinal = spec.ordinal
  for item in items:
    if (
        item[2] is not None
        and item[0] == ordinal.ordinal
        and ordinal.branch not in item[2]
    ):
      _add_branch(item, spec, value)
      return True
  return False


def _add_branch(item: list[tp.Any], spec, value) -> None:
  """``item[1] += value``, the cotangent of branch ``spec.ordinal.branch``
  (``item[2]``: the branches added so far)."""
  if _shapes(item[1]) != _shapes(value):
    raise ValueError(
        f'capture: perturb {spec.name!r} is in several branches of a'
        ' `lax.cond`/`lax.switch` whose predicate `jax.vmap` batches,'
        f' with cotangents of shapes {_shapes(item[1])} and'
        f' {_shapes(value)}; the cotangent collected is the taken'
        " branch's, so every branch must perturb values of the same"
        ' shapes, in the same constructs (not a loop in one branch'
        ' only).'
    )
  item[1] = jax.tree.map(jnp.add, item[1], value)
  item[2].add(spec.ordinal.branch)


def _shapes(tree) -> list:
  return [(x.shape, x.dtype) for x in jax.tree.leaves(tree)]


def check_arrival(spec) -> None:
  """Raises the problem of a cotangent entry ``spec`` from the branches of a
  batched ``cond`` whose perturbs do not line up (``BranchOrdinal.problem``),
  now that a cotangent arrived."""
  ordinal = spec.ordinal
  if isinstance(ordinal, BranchOrdinal) and ordinal.problem is not None:
    error, message = ordinal.problem
    raise error(message)
