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


"""``lax.scan`` (also ``fori_loop`` with static bounds and ``lax.map``).

What a sow inside does:

* **Capture**: a plain sow in the body becomes an extra ``ys`` output, so it
  comes back stacked along a new leading axis lined up with ``xs``; a
  reduced name becomes an extra carry.
* **Intervene**: an array replacement enters as an extra ``xs`` (one row per
  iteration); a callable is applied in the body.
* **Under ``vmap``**: plain sows are hoisted out of the batched body and
  sown again after the loop with the mapped axis first (``batched.py``), so
  they come back ``(batch, steps, ...)`` like ``vmap``'s outputs. While
  ``intervene`` stages, a kept half of each sow stays in the body for it to
  replace, and the hoisted value is the kept sow's result.
* **Under ``grad``/``linearize``/``checkpoint``**: a loop-invariant sow
  still gives one value per iteration (``partial_eval.py``).
"""

from __future__ import annotations

import dataclasses

from flax.nnx.sow import _jax
from flax.nnx.sow import _jax_patches
from flax.nnx.sow.collect import Collector
from flax.nnx.sow.collect import Layout
from flax.nnx.sow.collect import cached
from flax.nnx.sow.collect import collect_rules
from flax.nnx.sow.collect import rewrite_jaxpr
from flax.nnx.sow.constructs.adapter import carries_moved
from flax.nnx.sow.constructs.adapter import hoisted
from flax.nnx.sow.constructs.batched import has_plain_sows
from flax.nnx.sow.constructs.batched import kept_in_place
from flax.nnx.sow.constructs.batched import mark_order
from flax.nnx.sow.constructs.batched import sow_again
from flax.nnx.sow.constructs.batched import steps_behind_mapped
from flax.nnx.sow.inject import intervene_rules
from flax.nnx.sow.inject import one_body
from flax.nnx.sow.intervening import staging_captures
from flax.nnx.sow.primitive import per_example
from flax.nnx.sow.primitive import PLAIN_SOWS
from flax.nnx.sow.sites import construct_names
from flax.nnx.sow.sites import edit_sows_in
from flax.nnx.sow.sites import sow_sites

# ----------------------------------------------------------------------------
# scan


def bind_scan(eqn: _jax.JaxprEqn, invals, body, *, carry=(), xs=()):
  """``eqn``'s ``scan`` bound again with ``body``, extra carries and xs.

  The binders both rules add, as checkify threads its error value: a
  capture carries accumulators, ``intervene`` feeds replacements as xs.
  The body's constants become leading consts (:func:`hoisted`).

  Args:
    eqn: the ``scan`` equation.
    invals: its operands, ``[*consts, *carries, *xs]``.
    body: taking ``[*extra carries, *consts, *carries, *xs, *extra xs]``
      and returning ``[*carries, *ys, *extra ys, *extra carries]``, the
      order in which :meth:`Collector.rewrite` and :func:`one_body` add
      binders.
    carry: the extra carries' initial values.
    xs: the extra xs, one row per iteration.

  Returns:
    ``(outputs, extra carries out, extra ys)``.
  """
  p = eqn.params
  n_consts, n_carry, n_acc = p['num_consts'], p['num_carry'], len(carry)
  if carry:
    body = carries_moved(body, n_consts, n_acc)
  body, lifted = hoisted(body)
  outs = _jax.scan_p.bind(
      *lifted,
      *invals[:n_consts],
      *carry,
      *invals[n_consts:],
      *xs,
      **dict(
          p,
          jaxpr=body,
          num_consts=len(lifted) + n_consts,
          num_carry=n_carry + n_acc,
      ),
  )
  n_out = n_acc + len(eqn.outvars)
  return outs[n_acc:n_out], outs[:n_acc], outs[n_out:]


def _scan_capture(collector: Collector, eqn: _jax.JaxprEqn, invals):
  # [acc, consts, carry, xs] -> [carry, ys, entries, acc]
  rewritten, layout, acc_in = collector.prepare(eqn.params['jaxpr'])
  outs, acc_out, entries = bind_scan(eqn, invals, rewritten, carry=acc_in)
  layout, entries = _steps_placed(layout, entries)
  collector.absorb(layout, [*entries, *acc_out])
  return outs


def _steps_placed(layout: Layout, leaves):
  """The stacked entries of a loop, with each step axis behind the mapped
  axes outside the loop (:func:`steps_behind_mapped`)."""
  if not any(spec.loops_mapped for spec in layout.entries):
    return layout, leaves
  specs, placed, pos = [], [], 0
  for spec in layout.entries:
    spec, moved = steps_behind_mapped(spec, leaves[pos : pos + spec.size])
    specs.append(spec)
    placed.extend(moved)
    pos += spec.size
  return dataclasses.replace(layout, entries=tuple(specs)), placed


def _scan_intervene(injector, eqn, invals):
  # [consts, carry, xs, replacement rows] -> [carry, ys]
  p = eqn.params
  new, reps = one_body(injector, p['jaxpr'], length=p['length'])
  outs, _, _ = bind_scan(eqn, invals, new, xs=reps)
  return outs


collect_rules[_jax.scan_p] = _scan_capture
intervene_rules[_jax.scan_p] = _scan_intervene
construct_names[_jax.scan_p] = '`lax.scan`'


def _scan_batcher(jax_rule, axis_data, args, dims, **params):
  if not staging_captures():
    # Nothing a capture could collect: JAX's rule, unchanged.
    return jax_rule(axis_data, args, dims, **params)
  # A perturb that this vmap broadcasts counts the loops between them
  # (``primitive.with_loops_mapped``).
  body = _with_loops_pending(params['jaxpr'])
  params = dict(params, jaxpr=body)
  if not has_plain_sows(body):
    return jax_rule(axis_data, args, dims, **params)
  # Under intervene, each sow stays in the body (a kept half, which it
  # replaces) and its result is hoisted (``batched.py``).
  split = kept_in_place(body)
  # [consts, carry, xs] -> [carry, ys, entries]: the entries are extra ys.
  new_body, layout = rewrite_jaxpr(split, PLAIN_SOWS, ())
  # The hoisted sows come after the scan; markers before it keep every name
  # the body sows in its order of first sow.
  mark_order(sow_sites(body.jaxpr))
  outs, out_dims = jax_rule(
      axis_data, args, dims, **dict(params, jaxpr=new_body)
  )
  n = len(outs) - layout.num_extra
  sow_again(layout, outs[n:], out_dims[n:], axis_data.size, steps=True)
  return outs[:n], out_dims[:n]


def _with_loops_pending(body: _jax.ClosedJaxpr) -> _jax.ClosedJaxpr:
  """``body`` with one more loop counted on each ``per_example`` marker
  under it, at any depth: this vmap batches the marker inside this loop,
  and inside every loop of the body that holds it, whose batching adds its
  own count (``primitive.with_loops_mapped`` takes the sum)."""
  if not any(per_example(s.eqn.params) for s in sow_sites(body.jaxpr)):
    return body
  return cached(
      body,
      ('loops_pending',),
      lambda: edit_sows_in(body, _one_more_loop, False),
  )


def _one_more_loop(params, in_custom_call):
  del in_custom_call
  if not per_example(params):
    return None
  return dict(params, pending_loops=params.get('pending_loops', 0) + 1)


_jax_patches.register('scan_batching', _scan_batcher)
