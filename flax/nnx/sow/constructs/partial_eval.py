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

"""Sows that JAX's partial evaluation moves or copies.

``grad``, ``linearize`` and ``checkpoint`` split a program into a known part
and a staged one, and on the way JAX moves or copies equations, sows among
them. This file keeps each sow collected exactly once, where it runs:

* **Loop-invariant hoisting in ``scan``.** JAX's scan partial evaluation
  moves work that reads only the loop's constants out of the loop. While it
  does (``hoisting_loop_invariants``), a staged sow counts as
  loop-dependent: it stays in the loop with its (hoisted) operands, so it
  still runs once per iteration at any depth (a ``jit`` or a ``cond`` in
  the body), while its consumers read the operands, so invariant work is
  still hoisted. An equation that holds a staged sow (a call,
  ``custom_vjp_call``, ``cond`` staged in the loop) is kept there also when
  its outputs are unused, as JAX keeps an effectful primitive but not such
  a call. A ``custom_jvp``/``custom_vjp`` call on loop-invariant values is
  hoisted whole by JAX's own rules for them, which no rule here sees: the
  hoisting is checked afterwards, and a staged sow it moved out of the loop
  raises ``NotImplementedError`` naming it.
* **A ``while_loop`` under ``checkpoint`` or ``linearize``.** JAX keeps the
  known loop and stages the whole loop again (for the recomputation, or
  into the linear function); the staged copy's sows become remat copies
  (collected nowhere), so applying the linear function, once or many times,
  collects nothing more.

Without this file (an earlier prefix of the series, ``docs/upstream.md``)
such sows are collected as JAX leaves them: once for a loop-invariant sow,
twice for a split ``while_loop``.

Not handled here (a documented limit, ``docs/how_it_works.md``): JAX's
dead-code elimination drops a ``checkpoint`` whose inputs and outputs are all
unused even when its body has effects (``remat_dce`` in
``jax/_src/ad_checkpoint.py``), so a sow of a value computed from constants
inside such a ``checkpoint``, nested in another ``checkpoint`` under
differentiation, is removed with it: its entry is missing.
"""

from __future__ import annotations

import collections
import threading

from flax.nnx.sow import _jax
from flax.nnx.sow import _jax_patches
from flax.nnx.sow.primitive import HIDDEN
from flax.nnx.sow.intervening import replacing
from flax.nnx.sow.primitive import sow_effect
from flax.nnx.sow.primitive import sow_p
from flax.nnx.sow.primitive import staging_active  # PR: custom
from flax.nnx.sow.sites import edit_sows
from flax.nnx.sow.sites import holds_staged_sow
from flax.nnx.sow.sites import remat_copy_eqn
from flax.nnx.sow.sites import sow_sites
from flax.nnx.sow.sites import without_staged_sows


# ----------------------------------------------------------------------------
# Loop-invariant sows under scan's hoisting.


class _Hoisting(threading.local):
  depth = 0


_HOISTING = _Hoisting()


def hoisting_loop_invariants() -> bool:
  """Whether scan's partial evaluation is moving loop-invariant work out of
  a loop now: what a partial evaluation finds known is then computed once,
  outside the loop (:func:`_sow_partial_eval` keeps a sow in the loop; a
  ``custom_jvp``/``custom_vjp`` call moved out raises, see
  :func:`_check_nothing_hoisted`)."""
  return bool(_HOISTING.depth)


def _keeping_sows_in_loops(rule, loop_part=0):
  """``rule`` run with staged sows kept in the loop (see the module doc).

  ``rule`` takes the loop body first and returns, at ``loop_part``, the body
  that stays in the loop; every staged sow of the one must be in the other
  (:func:`_check_nothing_hoisted`).
  """

  def wrapped(*args, **kwargs):
    _HOISTING.depth += 1
    try:
      out = rule(*args, **kwargs)
    finally:
      _HOISTING.depth -= 1
    _check_nothing_hoisted(args[0], out[loop_part])  # PR: custom
    return out

  return wrapped


def _check_nothing_hoisted(body, loop) -> None:  # PR: custom
  """Raises if a staged sow of the loop ``body`` is not in the part that
  stays in the loop, ``loop``.

  JAX's partial evaluation computes a ``custom_jvp`` or ``custom_vjp`` call
  whose inputs are all known where the known part runs (``JaxprTrace``'s
  rules for them, which no rule of this package sees): in the hoisting,
  outside the loop, so each of its sows would give one value where the
  capture's layout has one per iteration.

  Raises:
    NotImplementedError: naming the sow and the construct.
  """
  if not staging_active():  # no capture or intervene reads these sows
    return
  sites = [s for s in sow_sites(body.jaxpr) if s.collectible]
  if not sites:
    return
  kept = collections.Counter(
      s.name for s in sow_sites(loop.jaxpr) if s.collectible
  )
  for site in sites:
    if kept[site.name] <= 0:
      raise NotImplementedError(
          f'sow {site.name!r}{site.where}: it is in a `jax.custom_jvp` or'
          ' `jax.custom_vjp` function inside a `lax.scan` body that'
          ' jax.grad, jax.vjp, jax.linearize or jax.checkpoint splits, and'
          ' the function reads only values that do not change in the loop:'
          ' JAX computes such a call once, outside the loop, so the sow'
          ' would give one value where the capture collects one per'
          ' iteration. Give the call an input that changes in the loop'
          ' (pass the value as xs, one row per iteration), or sow outside'
          ' the custom-derivative function. (JAX could keep such a call in'
          ' the loop if its partial evaluation let an effect opt out of'
          ' loop-invariant hoisting for custom calls.)'
      )
    kept[site.name] -= 1


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
    # The unknown part (the second jaxpr) stays in the loop.
    return _keeping_sows_in_loops(function, loop_part=1)(*args, **kwargs)
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


# ----------------------------------------------------------------------------
# while under remat: the recomputed copy collects nothing.
#
# ``jax.checkpoint``'s partial evaluation of a ``while_loop``
# (``_while_partial_eval_custom``) keeps the known loop and stages the whole
# equation again for the recomputation, sows included, so a sow in the body
# would be collected twice. Where a known loop runs, the staged copy's sows
# become remat copies (collected nowhere), as ``sow_p``'s own rule does.
#
# A ``custom_jvp``/``custom_vjp`` call in the body needs one step more. It has
# no partial-evaluation rule: JAX's default runs a known effectful equation
# once and saves its outputs rather than recompute it, which is right for a
# call holding a staged sow anywhere but in a ``while_loop`` body, which can
# save nothing (JAX's rule asserts it has no residual). So while JAX's rule
# runs, the staged sows in such calls are hidden (``remat_copy=HIDDEN``: no
# effect, collected by nothing) and JAX recomputes the calls as pure
# equations; in the known loop it returns they collect again, and in the
# staged one they are remat copies, so each is collected once.


def _hide_in_custom_calls(params: dict, in_custom_call: bool) -> dict | None:
  if in_custom_call and params['effect'] and not params['remat_copy']:
    return dict(params, remat_copy=HIDDEN)
  return None


def _unhide(params: dict, in_custom_call: bool) -> dict | None:
  del in_custom_call
  if params['remat_copy'] == HIDDEN:
    return dict(params, remat_copy=False)
  return None


def _while_partial_eval_custom(jax_rule, saveable, unks_in, inst_in, eqn):
  hidden = edit_sows(eqn, _hide_in_custom_calls, False)
  if hidden is eqn:
    # No custom call with a staged sow in the loop: JAX's rule, then the
    # staged copy's sows become remat copies.
    known, staged, *rest = jax_rule(saveable, unks_in, inst_in, eqn)
    if (
        known is not None
        and staged is not None
        and any(
            holds_staged_sow(j) for j in _jax.jaxprs_in_params(staged.params)
        )
    ):
      staged = remat_copy_eqn(staged)
    return (known, staged, *rest)
  known, staged, *rest = jax_rule(saveable, unks_in, inst_in, hidden)
  if known is None:
    # JAX stages the whole loop (it runs once, later): it collects there.
    return (known, None if staged is None else eqn, *rest)
  known = edit_sows(known, _unhide, False)
  if staged is not None:
    staged = remat_copy_eqn(staged)
  return (known, staged, *rest)


_jax_patches.register('while_remat_rule', _while_partial_eval_custom)


# ----------------------------------------------------------------------------
# while under linearize: the staged copy collects nothing.
#
# ``jax.linearize`` (and ``jax.jvp`` of a partially known loop) splits a
# ``while_loop`` with JAX's ``_while_partial_eval``: it runs the known part of
# the loop now and stages the whole loop again, primal and tangent, into the
# linear function, so a sow in the body would be collected again each time
# the linear function is applied. Where the known loop runs, the staged
# loop's sows become remat copies.


def _known_loop(tracers, params):
  """The known part of the loop JAX's rule runs: ``(known cond, known body,
  carry_uk)``, the body returning only the known carries; ``None`` where it
  runs none (every input known or unknown, or an unknown predicate)."""
  unknowns = [not t.pval.is_known() for t in tracers]
  if all(unknowns) or not any(unknowns):
    return None
  n_cc, n_bc = params['cond_nconsts'], params['body_nconsts']
  cond_uk, body_uk = unknowns[:n_cc], unknowns[n_cc : n_cc + n_bc]
  carry_uk = unknowns[n_cc + n_bc :]
  for _ in range(1 + len(carry_uk)):
    known, _, out_uk, _ = _jax.partial_eval_jaxpr_nounits(
        params['body_jaxpr'], body_uk + carry_uk, instantiate=carry_uk
    )
    if out_uk == carry_uk:
      break
    carry_uk = [a or b for a, b in zip(carry_uk, out_uk)]
  cond_known, _, [pred_uk], _ = _jax.partial_eval_jaxpr_nounits(
      params['cond_jaxpr'], cond_uk + carry_uk, instantiate=False
  )
  if pred_uk:
    return None
  n_known = len(carry_uk) - sum(carry_uk)
  known = known.replace(
      jaxpr=known.jaxpr.replace(outvars=known.jaxpr.outvars[:n_known])
  )
  return cond_known, known, carry_uk


def _staged_sow_names(jaxpr: _jax.Jaxpr) -> collections.Counter:
  """How many staged (collectible) sows of each name ``jaxpr`` holds."""
  return collections.Counter(
      s.name for s in sow_sites(jaxpr) if s.eqn.params['effect']
  )


def _while_partial_eval(jax_rule, trace, *tracers, **params):
  body = params['body_jaxpr']
  if not holds_staged_sow(body.jaxpr):
    return jax_rule(trace, *tracers, **params)
  split = _known_loop(tracers, params)
  if split is None:
    return jax_rule(trace, *tracers, **params)
  cond_known, body_known, carry_uk = split
  in_known = _staged_sow_names(body_known.jaxpr)
  if not in_known:
    # The sows read unknown carries (or scan's hoisting keeps them in the
    # loop): only the staged loop runs them.
    return jax_rule(trace, *tracers, **params)
  if in_known != _staged_sow_names(body.jaxpr):
    name = next(iter(_staged_sow_names(body.jaxpr) - in_known))
    raise NotImplementedError(
        f'sow {name!r}: inside a `lax.while_loop` that JAX splits into a'
        ' known and a staged part (jax.linearize or jax.jvp with some'
        ' carries known), some of its sows read known values and others'
        ' unknown ones, so the capture cannot collect each once. Sow values'
        ' that depend on the same carries, or sow after the loop.'
    )
  # JAX's rule, with the staged loop's sows as copies (they ran in the known
  # loop): the known part of the loop runs now, and the whole loop is
  # staged for the unknown carries.
  n_cc, n_bc = params['cond_nconsts'], params['body_nconsts']
  uk = [not t.pval.is_known() for t in tracers]
  known_ins = [
      t.pval.get_known()
      for t, u in zip(tracers, uk[: n_cc + n_bc] + carry_uk)
      if not u
  ]
  known_outs = _jax.while_p.bind(
      *known_ins,
      cond_nconsts=n_cc - sum(uk[:n_cc]),
      cond_jaxpr=cond_known,
      body_nconsts=n_bc - sum(uk[n_cc : n_cc + n_bc]),
      body_jaxpr=body_known,
  )
  staged = trace.default_process_primitive(
      _jax.while_p,
      tracers,
      dict(
          params,
          body_jaxpr=without_staged_sows(body),
          cond_jaxpr=without_staged_sows(params['cond_jaxpr']),
      ),
  )
  # Each known carry from the known loop, each unknown one from the staged.
  known_outs = iter(known_outs)
  return [s if u else next(known_outs) for s, u in zip(staged, carry_uk)]


_jax_patches.register('while_partial_eval', _while_partial_eval)
