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

While ``intervene`` stages its function, a sow it replaces
(``intervening.replacing``: one that no capture staged inside it accepts)
must stay where its value is used, so that a replacement reaches its
consumers; a capture around the intervene must still get the value hoisted,
with the mapped axis first and only for the branch taken, as it gets from
the function with the replacement written by hand. So each plain sow is
split first (:func:`kept_in_place`): a ``'kept'`` sow that stays (the
intervene replaces it; no capture collects it), then a ``'hoisted'`` sow of
its result, which is hoisted and sown again like any other (a capture
collects it; no intervene replaces it again).
"""

from __future__ import annotations


import jax
import jax.numpy as jnp

from flax.nnx.sow import _jax
from flax.nnx.sow.collect import EntrySpec
from flax.nnx.sow.collect import Layout
from flax.nnx.sow.collect import cached
from flax.nnx.sow.intervening import replacing
from flax.nnx.sow.primitive import HOISTED
from flax.nnx.sow.primitive import KEPT
from flax.nnx.sow.primitive import LOOPS_UNKNOWN
from flax.nnx.sow.primitive import bind_sow
from flax.nnx.sow.primitive import mapped_axis_first
from flax.nnx.sow.primitive import sow_p
from flax.nnx.sow.primitive import PLAIN_SOWS
from flax.nnx.sow.primitive import accepts
from flax.nnx.sow.sites import sow_sites


def has_plain_sows(closed: _jax.ClosedJaxpr) -> bool:
  return any(
      accepts(PLAIN_SOWS, s.tag, s.reduction, s.kind, s.name)
      for s in sow_sites(closed.jaxpr)
  )


def sow_again(
    layout: Layout, values, dims, axis_size, *, steps: bool = False
) -> None:
  """Sows the hoisted entries, with the mapped axis first.

  ``steps``: the entries are a loop's, stacked along a step axis (after the
  mapped axis), which goes behind the mapped axes of a cotangent's
  ``loops_mapped`` (:func:`steps_behind_mapped`).

  Raises:
    NotImplementedError: for a cotangent whose mapped axes would still need
      a loop outside this construct stacked first (no program we know of).
  """
  pos = 0
  for spec in layout.entries:
    leaves = [
        mapped_axis_first(x, d, axis_size)
        for x, d in zip(
            values[pos : pos + spec.size], dims[pos : pos + spec.size]
        )
    ]
    pos += spec.size
    if steps:
      spec, leaves = steps_behind_mapped(spec, leaves, step_axis=1)
    if spec.loops_mapped:
      raise _layout_error(spec)
    bind_sow(
        leaves,
        name=spec.name,
        tag=spec.tag,
        treedef=spec.treedef,
        kind=spec.kind,
        batch_dims=1,
        ordinal=spec.ordinal,
    )


def steps_behind_mapped(
    spec: EntrySpec, leaves: list, *, step_axis: int = 0
) -> tuple[EntrySpec, list]:
  """A loop's entry with its step axis (``step_axis``) moved behind the
  mapped axes its ``spec.loops_mapped`` says lie outside that loop.

  A ``perturb``'s cotangent in ``jax.grad(jax.vmap(g))``, with the perturb in
  a ``lax.scan`` of ``g``, is sown in the transposed loop with the mapped
  axis first, and the loop stacks it step axis first: ``(steps, batch,
  ...)``. Moved, it is ``(batch, steps, ...)``, as the sown value under the
  same transforms (``scan.py`` hoists that one out of the batched loop).
  Returns the entry with one loop fewer counted, and its leaves.
  """
  mapped = spec.loops_mapped
  if not mapped:
    return spec, leaves
  if mapped == LOOPS_UNKNOWN:
    raise _unknown_loops_error(spec)
  # Every count is at least 1 (zeros are dropped): every one of these axes
  # lies outside this loop.
  leaves = [jnp.moveaxis(x, step_axis, step_axis + len(mapped)) for x in leaves]
  return spec._replace(loops_mapped=tuple(c - 1 for c in mapped if c > 1)), leaves


def _unknown_loops_error(spec: EntrySpec) -> NotImplementedError:
  return NotImplementedError(
      f'capture: the cotangent of perturb {spec.name!r} is stacked by a'
      ' `lax.scan`, but a `jax.vmap` batched that perturb before the capture'
      ' (a pullback or linear function made outside it, by `jax.vjp` or'
      ' `jax.linearize`), so whether the vmap is around the loop or inside'
      ' its body was not recorded, and the layout of the cotangents'
      ' ((batch, steps, ...) or (steps, batch, ...)) cannot be told. Call'
      ' `jax.vjp`/`jax.linearize`/`jax.grad` inside the captured function.'
  )


def _layout_error(spec: EntrySpec) -> NotImplementedError:
  return NotImplementedError(
      f'capture: the cotangent of perturb {spec.name!r} is batched by a'
      ' `jax.vmap` outside a `lax.scan` that encloses it, but that loop is'
      ' not stacked before the vmap\'s axis is: its layout would not be'
      ' (batch, steps, ...). Perturb the value inside a loop that the vmap'
      ' maps directly, or collect the cotangent without the vmap.'
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


# ----------------------------------------------------------------------------
# Under ``intervene``: each plain sow split into a kept and a hoisted half.


def kept_in_place(closed: _jax.ClosedJaxpr) -> _jax.ClosedJaxpr:
  """``closed`` with every staged plain value sow that an ``intervene``
  staging now replaces (``replacing``), at any depth, split in two.

  ``y = sow(x)`` becomes ``k = sow[kind='kept'](x); y = sow[kind='hoisted'](k)``:
  hoisting the plain sows (``PLAIN_SOWS``) then takes the hoisted half, whose
  operand is the kept sow's result (the replacement, once ``intervene`` has
  replaced the kept sow), and leaves the kept half in place. A sow that a
  capture staged inside the intervene accepts is that capture's: it is
  hoisted whole, as without intervene. ``closed`` itself where no sow is
  split; cached per jaxpr and sows split.
  """
  split = tuple(_splits(s.eqn.params) for s in sow_sites(closed.jaxpr))
  if not any(split):
    return closed
  return cached(closed, ('kept_in_place', split), lambda: _split_closed(closed))


def _split_closed(closed):
  jaxpr = _split_jaxpr(closed.jaxpr)
  return (
      closed
      if jaxpr is closed.jaxpr
      else _jax.ClosedJaxpr(jaxpr, closed.consts)
  )


def _splits(params) -> bool:
  return (
      params['kind'] == 'value'
      and params['reduction'] is None
      and not params['n_closure']
      and params['effect']
      and not params['remat_copy']
      and replacing(params) is not None
  )


def _split_jaxpr(jaxpr: _jax.Jaxpr) -> _jax.Jaxpr:
  eqns, changed = [], False
  for eqn in jaxpr.eqns:
    p = eqn.params
    if eqn.primitive is sow_p:
      if not _splits(p):
        eqns.append(eqn)
        continue
      mid = [_jax.Var(v.aval) for v in eqn.outvars]
      eqns.append(eqn.replace(outvars=mid, params=dict(p, kind=KEPT)))
      # (A plain sow has no closure operands: the kept half's results are
      # the whole value.)
      eqns.append(eqn.replace(invars=mid, params=dict(p, kind=HOISTED)))
      changed = True
      continue
    if any(True for _ in _jax.jaxprs_in_params(p)):
      params = {k: _split_param(v) for k, v in p.items()}
      if any(params[k] is not v for k, v in p.items()):
        eqn = eqn.replace(params=params)
        changed = True
    eqns.append(eqn)
  if not changed:
    return jaxpr
  return _jax.edit_jaxpr(jaxpr, eqns, jaxpr.outvars)


def _split_param(value):
  if isinstance(value, _jax.Jaxpr):
    return _split_jaxpr(value)
  if isinstance(value, _jax.ClosedJaxpr):
    return _split_closed(value)
  if isinstance(value, tuple) and any(
      isinstance(v, (_jax.Jaxpr, _jax.ClosedJaxpr)) for v in value
  ):
    new = tuple(_split_param(v) for v in value)
    return value if all(a is b for a, b in zip(new, value)) else new
  return value
