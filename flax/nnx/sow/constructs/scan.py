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
* **Under ``grad``/``linearize``/``checkpoint``**: JAX's partial evaluation
  of ``scan`` moves work that reads only the loop's constants out of the
  loop. While it does, a staged sow counts as loop-dependent: it stays in
  the loop with its (hoisted) operands, so it still runs once per iteration
  at any depth (a ``jit``, a ``custom_jvp`` or a ``cond`` in the body), while
  its consumers read the operands, so invariant work is still hoisted. An
  equation that holds a staged sow (a call, ``custom_vjp_call``, ``cond``
  staged in the loop) is kept there also when its outputs are unused,
  as JAX keeps an effectful primitive but not such a call.
"""

from __future__ import annotations

import threading


from flax.nnx.sow import _jax
from flax.nnx.sow import _jax_patches
from flax.nnx.sow.collect import Collector
from flax.nnx.sow.collect import collect_rules
from flax.nnx.sow.collect import rewrite_jaxpr
from flax.nnx.sow.constructs.adapter import carries_moved
from flax.nnx.sow.constructs.adapter import hoisted
from flax.nnx.sow.constructs.batched import has_plain_sows
from flax.nnx.sow.constructs.batched import kept_in_place
from flax.nnx.sow.constructs.batched import mark_order
from flax.nnx.sow.constructs.batched import sow_again
from flax.nnx.sow.inject import intervene_rules
from flax.nnx.sow.inject import one_body
from flax.nnx.sow.primitive import intervening
from flax.nnx.sow.primitive import replacing
from flax.nnx.sow.primitive import sow_effect
from flax.nnx.sow.primitive import sow_p
from flax.nnx.sow.primitive import staging_captures
from flax.nnx.sow.sites import PLAIN_SOWS
from flax.nnx.sow.sites import construct_names
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
  collector.absorb(layout, [*entries, *acc_out])
  return outs


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
  body = params['jaxpr']
  if not staging_captures() or not has_plain_sows(body):
    # Nothing a capture could collect: JAX's rule, unchanged.
    return jax_rule(axis_data, args, dims, **params)
  # Under intervene, each sow stays in the body (a kept half, which it
  # replaces) and its result is hoisted (``batched.py``).
  split = kept_in_place(body) if intervening() else body
  # [consts, carry, xs] -> [carry, ys, entries]: the entries are extra ys.
  new_body, layout = rewrite_jaxpr(split, PLAIN_SOWS, ())
  # The hoisted sows come after the scan; markers before it keep every name
  # the body sows in its order of first sow.
  mark_order(sow_sites(body.jaxpr))
  outs, out_dims = jax_rule(
      axis_data, args, dims, **dict(params, jaxpr=new_body)
  )
  n = len(outs) - layout.num_extra
  sow_again(layout, outs[n:], out_dims[n:], axis_data.size)
  return outs[:n], out_dims[:n]


_jax_patches.register('scan_batching', _scan_batcher)


# ----------------------------------------------------------------------------
# Loop-invariant sows under scan's hoisting.


class _Hoisting(threading.local):
  depth = 0


_HOISTING = _Hoisting()


def hoisting_loop_invariants() -> bool:
  """Whether scan's partial evaluation is moving loop-invariant work out of
  a loop now: what a partial evaluation finds known is then computed once,
  outside the loop (``constructs/custom.py`` keeps a custom call whose body
  sows in the loop, as :func:`_sow_partial_eval` keeps a sow)."""
  return bool(_HOISTING.depth)


def _keeping_sows_in_loops(rule):
  """``rule`` run with staged sows kept in the loop (see the module doc)."""

  def wrapped(*args, **kwargs):
    _HOISTING.depth += 1
    try:
      return rule(*args, **kwargs)
    finally:
      _HOISTING.depth -= 1

  return wrapped


def _sow_partial_eval(trace, *tracers, **params):
  if (
      _HOISTING.depth
      and params['effect']
      and not params['remat_copy']
      and all(t.pval.is_known() for t in tracers)
  ):
    # Stage the sow in the loop body (kept by its effect), reading the
    # operands as constants the hoisting passes in; consumers keep the
    # known operands, so what they compute may still be hoisted. A marker
    # without operands (``'order'``) stays in the loop too, where it marks
    # the first sow of its name. Not so for a sow an intervene replaces:
    # its consumers read its result (the replacement, per iteration), so
    # they stay in the loop too.
    outs = _jax.stage_unknown(trace, sow_p, tracers, params)
    if replacing(params) is not None:
      return outs
    return list(tracers[: len(tracers) - params['n_closure']])
  return trace.default_process_primitive(sow_p, tracers, params)


class _ScanRemat(threading.local):
  depth = 0


_SCAN_REMAT = _ScanRemat()


def _in_scan_remat_rule(rule, *args, **kwargs):
  """``scan``'s ``checkpoint`` rule, whose hoisting step is watched below."""
  _SCAN_REMAT.depth += 1
  try:
    return rule(*args, **kwargs)
  finally:
    _SCAN_REMAT.depth -= 1


def _partial_eval_nounits(function, *args, **kwargs):
  # Inside scan's checkpoint rule, this is its loop-invariant hoisting.
  if _SCAN_REMAT.depth and not _HOISTING.depth:
    return _keeping_sows_in_loops(function)(*args, **kwargs)
  return function(*args, **kwargs)


def _sow_partial_eval_custom(rule, saveable, unks_in, inst_in, eqn):
  # A ``checkpoint`` (remat) nested in a loop body that is being hoisted:
  # a known sow goes to the part that stays in the loop.
  p = eqn.params
  if _HOISTING.depth and p['effect'] and not p['remat_copy']:
    n = len(eqn.outvars)
    res = [
        v
        for v, inst in zip(eqn.invars, inst_in)
        if isinstance(v, _jax.Var) and not inst
    ]
    return None, eqn, [True] * n, [True] * n, res
  return rule(saveable, unks_in, inst_in, eqn)


def _kept_in_loop(
    new_eqn_recipe, trace, in_tracers, out_tracers, *args, **kwargs
):
  # What JAX's partial evaluation stages while it hoists: a call (a
  # ``closed_call``, ``custom_vjp_call``, ``cond``) that holds a staged sow
  # stays in the loop also when its outputs are unused, as a sow does.
  recipe = new_eqn_recipe(trace, in_tracers, out_tracers, *args, **kwargs)
  if _HOISTING.depth and recipe.primitive is not sow_p:
    _jax.keep_if_sowing(trace, in_tracers, recipe, sow_effect)
  return recipe


_jax.custom_partial_eval_rules[sow_p] = _sow_partial_eval
_jax_patches.register('scan_hoisting', _keeping_sows_in_loops)
_jax_patches.register('scan_remat_rule', _in_scan_remat_rule)
_jax_patches.register('partial_eval_nounits', _partial_eval_nounits)
_jax_patches.register('partial_eval_kept_calls', _kept_in_loop)
_jax.wrap_rule(
    _jax.partial_eval_jaxpr_custom_rules, sow_p, _sow_partial_eval_custom
)
