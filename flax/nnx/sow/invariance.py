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

"""What a capture collects does not depend on how JAX restructures a program.

This file owns the partial-evaluation behaviour of staged sows that keeps
``capture(T(f))`` collecting what ``capture(f)`` does, for ``T`` in ``grad``,
``linearize`` and ``checkpoint``:

* **Loop-invariant sows stay in the loop.** JAX's partial evaluation of
  ``scan`` (``_scan_known_hoisting``, used by ``grad``/``linearize``, and the
  same step in ``_scan_partial_eval_custom``, used by ``checkpoint``) moves
  work that reads only the loop's constants out of the loop. While it does,
  a staged sow counts as loop-dependent: it is staged in the loop with its
  (hoisted) operands, so it still runs once per iteration, at any depth of
  nesting (a ``jit``, a ``custom_jvp`` or a ``cond`` in the body), while its
  consumers read the operands, so the invariant work is still hoisted.
* **The rematerialised copy collects nothing.** ``checkpoint`` recomputes a
  ``while_loop`` whole; the copy's sows become remat copies, as a bare sow's
  own rule does. A ``custom_jvp``/``custom_vjp`` call that holds a staged sow
  keeps JAX's default (run once, outputs saved), except in a ``while_loop``
  body, which cannot save them: there it is recomputed, and only the known
  loop collects.

Nothing here changes a program that no capture stages: every rule and
wrapper takes JAX's own path for an equation without a staged sow (no
partial-evaluation rule is added for ``custom_jvp_call``/``custom_vjp_call``).
"""

from __future__ import annotations

import collections
import threading
import typing as tp

from flax.nnx.sow import _jax
from flax.nnx.sow import _jax_patches
from flax.nnx.sow.collect import sow_sites
from flax.nnx.sow.primitive import HIDDEN
from flax.nnx.sow.primitive import sow_effect
from flax.nnx.sow.primitive import sow_p

# ----------------------------------------------------------------------------
# Loop-invariant sows under scan's hoisting.


class _Hoisting(threading.local):
  depth = 0


_HOISTING = _Hoisting()


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
    # known operands, so what they compute may still be hoisted.
    trace.default_process_primitive(
        sow_p, [trace.instantiate_const(t) for t in tracers], params
    )
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


_jax.custom_partial_eval_rules[sow_p] = _sow_partial_eval
_jax_patches.register('scan_hoisting', _keeping_sows_in_loops)
_jax_patches.register('scan_remat_rule', _in_scan_remat_rule)
_jax_patches.register('partial_eval_nounits', _partial_eval_nounits)
_jax.wrap_rule(
    _jax.partial_eval_jaxpr_custom_rules, sow_p, _sow_partial_eval_custom
)


def _holds_staged_sow(jaxpr: _jax.Jaxpr) -> bool:
  for eqn in jaxpr.eqns:
    if eqn.primitive is sow_p:
      if eqn.params['effect'] and not eqn.params['remat_copy']:
        return True
    elif any(_holds_staged_sow(j) for j in _jax.jaxprs_in_params(eqn.params)):
      return True
  return False


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


def without_staged_sows(closed: _jax.ClosedJaxpr) -> _jax.ClosedJaxpr:
  """``closed`` with every staged sow a remat copy (an identity no capture
  collects), for a second evaluation whose sows already ran once."""
  if not _holds_staged_sow(closed.jaxpr):
    return closed
  return _jax.ClosedJaxpr(_as_remat_copies(closed.jaxpr), closed.consts)


def without_value_sows_named(
    closed: _jax.ClosedJaxpr, names: frozenset
) -> _jax.ClosedJaxpr:
  """``closed`` with its staged value sows of ``names`` remat copies (for an
  evaluation whose sows of those names are collected elsewhere)."""
  if not names:
    return closed

  def edit(params, in_custom_call):
    del in_custom_call
    if params['kind'] == 'value' and params['name'] in names:
      return _to_remat_copy(params, False)
    return None

  return _jax.ClosedJaxpr(
      _edit_sows_in_jaxpr(closed.jaxpr, edit, False), closed.consts
  )


def _as_remat_copies(jaxpr: _jax.Jaxpr) -> _jax.Jaxpr:
  return _edit_sows_in_jaxpr(jaxpr, _to_remat_copy, False)


def _remat_copy_eqn(eqn: _jax.JaxprEqn) -> _jax.JaxprEqn:
  """``eqn`` with every staged sow in it (or under it) a remat copy."""
  return _edit_sows(eqn, _to_remat_copy, False)


def _to_remat_copy(params: dict, in_custom_call: bool) -> dict | None:
  del in_custom_call
  if params['effect'] and params['remat_copy'] in (False, HIDDEN):
    return dict(params, remat_copy=True)
  return None


def _hide_in_custom_calls(params: dict, in_custom_call: bool) -> dict | None:
  if in_custom_call and params['effect'] and not params['remat_copy']:
    return dict(params, remat_copy=HIDDEN)
  return None


def _unhide(params: dict, in_custom_call: bool) -> dict | None:
  del in_custom_call
  if params['remat_copy'] == HIDDEN:
    return dict(params, remat_copy=False)
  return None


def _edit_sows(
    eqn: _jax.JaxprEqn, edit: tp.Callable, in_custom_call: bool
) -> _jax.JaxprEqn:
  """``eqn`` with ``edit(params, in_custom_call)`` applied to the parameters
  of every sow in it or under it (``None``: unchanged); effects recomputed.

  ``in_custom_call`` says whether the sow is inside a ``custom_jvp_call`` or
  ``custom_vjp_call``. Returns ``eqn`` itself if nothing changed.
  """
  if eqn.primitive is sow_p:
    params = edit(eqn.params, in_custom_call)
    if params is None:
      return eqn
    staged = params['effect'] and not params['remat_copy']
    return eqn.replace(params=params, effects={sow_effect} if staged else set())
  if not any(True for _ in _jax.jaxprs_in_params(eqn.params)):
    return eqn
  in_custom_call = in_custom_call or eqn.primitive in (
      _jax.custom_jvp_call_p,
      _jax.custom_vjp_call_p,
  )
  params = {
      k: _edit_sows_in(v, edit, in_custom_call) for k, v in eqn.params.items()
  }
  if all(params[k] is v for k, v in eqn.params.items()):
    return eqn
  effects = {e for e in eqn.effects if e is not sow_effect}
  if any(sow_effect in j.effects for j in _jax.jaxprs_in_params(params)):
    effects.add(sow_effect)
  return eqn.replace(params=params, effects=effects)


def _edit_sows_in_jaxpr(
    jaxpr: _jax.Jaxpr, edit: tp.Callable, in_custom_call: bool
) -> _jax.Jaxpr:
  eqns = [_edit_sows(eqn, edit, in_custom_call) for eqn in jaxpr.eqns]
  if all(new is old for new, old in zip(eqns, jaxpr.eqns)):
    return jaxpr
  return _jax.edit_jaxpr(jaxpr, eqns, jaxpr.outvars)


def _edit_sows_in(value, edit: tp.Callable, in_custom_call: bool):
  """A parameter's value, with :func:`_edit_sows` applied to its jaxprs."""
  if isinstance(value, _jax.Jaxpr):
    return _edit_sows_in_jaxpr(value, edit, in_custom_call)
  if isinstance(value, _jax.ClosedJaxpr):
    jaxpr = _edit_sows_in_jaxpr(value.jaxpr, edit, in_custom_call)
    if jaxpr is value.jaxpr:
      return value
    return _jax.ClosedJaxpr(jaxpr, value.consts)
  if isinstance(value, tuple) and any(
      isinstance(v, (_jax.Jaxpr, _jax.ClosedJaxpr)) for v in value
  ):
    new = tuple(_edit_sows_in(v, edit, in_custom_call) for v in value)
    if all(n is v for n, v in zip(new, value)):
      return value
    return new
  return value


def _while_partial_eval_custom(jax_rule, saveable, unks_in, inst_in, eqn):
  hidden = _edit_sows(eqn, _hide_in_custom_calls, False)
  if hidden is eqn:
    # No custom call with a staged sow in the loop: JAX's rule, then the
    # staged copy's sows become remat copies.
    known, staged, *rest = jax_rule(saveable, unks_in, inst_in, eqn)
    if (
        known is not None
        and staged is not None
        and any(
            _holds_staged_sow(j) for j in _jax.jaxprs_in_params(staged.params)
        )
    ):
      staged = _remat_copy_eqn(staged)
    return (known, staged, *rest)
  known, staged, *rest = jax_rule(saveable, unks_in, inst_in, hidden)
  if known is None:
    # JAX stages the whole loop (it runs once, later): it collects there.
    return (known, None if staged is None else eqn, *rest)
  known = _edit_sows(known, _unhide, False)
  if staged is not None:
    staged = _remat_copy_eqn(staged)
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


def _known_body(tracers, params) -> _jax.ClosedJaxpr | None:
  """The body of the known loop JAX's rule runs (the carries that do not
  depend on unknown inputs, with a known predicate), or ``None`` if it runs
  none."""
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
  *_, [pred_uk], _ = _jax.partial_eval_jaxpr_nounits(
      params['cond_jaxpr'], cond_uk + carry_uk, instantiate=False
  )
  return None if pred_uk else known


def _staged_sow_names(jaxpr: _jax.Jaxpr) -> collections.Counter:
  """How many staged (collectible) sows of each name ``jaxpr`` holds."""
  return collections.Counter(
      s.name for s in sow_sites(jaxpr) if s.eqn.params['effect']
  )


def _while_partial_eval(jax_rule, trace, *tracers, **params):
  body = params['body_jaxpr']
  if not _holds_staged_sow(body.jaxpr):
    return jax_rule(trace, *tracers, **params)
  known = _known_body(tracers, params)
  if known is None:
    return jax_rule(trace, *tracers, **params)
  in_known = _staged_sow_names(known.jaxpr)
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
  default = trace.default_process_primitive

  def staged_copy(primitive, tracers_, params_):
    if primitive is _jax.while_p:
      params_ = dict(
          params_,
          body_jaxpr=without_staged_sows(params_['body_jaxpr']),
          cond_jaxpr=without_staged_sows(params_['cond_jaxpr']),
      )
    return default(primitive, tracers_, params_)

  trace.default_process_primitive = staged_copy
  try:
    return jax_rule(trace, *tracers, **params)
  finally:
    del trace.default_process_primitive


_jax_patches.register('while_partial_eval', _while_partial_eval)
