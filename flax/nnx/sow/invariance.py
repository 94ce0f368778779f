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

"""Loop-invariant sows keep one value per iteration under any transform.

JAX's partial evaluation of ``scan`` (``_scan_known_hoisting``, used by
``grad``, ``linearize`` and ``checkpoint``) moves work that depends only on
the loop's constants out of the loop. A sow whose operands are loop-invariant
would move with it and be collected once, without its iteration axis,
breaking the rule that ``capture(T(f))`` collects what ``capture(f)`` does.

This file owns the fix. While a capture stages, every ``scan`` bound with
such a sow in its body is bound instead with one more ``xs`` operand, the
iteration index, and the sow's operands pass through ``anchor_p``: an
identity on its leading operands whose last operand is that index. The
anchored value depends on the iteration, so no partial evaluation can hoist
the sow; consumers of the sow keep reading the original operands, so the
loop-invariant work itself is still hoisted. ``anchor_p`` lowers to nothing.
Outside a capture's staging nothing changes.
"""

from __future__ import annotations

import threading
import weakref

import jax.numpy as jnp
import numpy as np

from flax.nnx.sow import _jax
from flax.nnx.sow.primitive import sow_effect
from flax.nnx.sow.primitive import sow_p
from flax.nnx.sow.primitive import staging_active

# ----------------------------------------------------------------------------
# anchor_p: anchor(*xs, index) -> xs


anchor_p = _jax.Primitive('sow_anchor')
anchor_p.multiple_results = True


@anchor_p.def_impl
def _anchor_impl(*args):
  return args[:-1]


anchor_p.def_abstract_eval(lambda *avals: avals[:-1])
_jax.register_lowering(anchor_p, lambda ctx, *args: args[:-1])


def _anchor_jvp(primals, tangents):
  # The anchor orders the primal; tangents pass through as they are.
  return anchor_p.bind(*primals), list(tangents[:-1])


def _anchor_transpose(cts, *args):
  return [*cts, None]


def _anchor_batch(axis_data, args, dims):
  del axis_data
  return anchor_p.bind(*args), list(dims[:-1])


_jax.primitive_jvps[anchor_p] = _anchor_jvp
_jax.primitive_transposes[anchor_p] = _anchor_transpose
_jax.fancy_primitive_batchers[anchor_p] = _anchor_batch


# ----------------------------------------------------------------------------
# Finding the sows to anchor in a scan body.


def _holds_staged_sow(jaxpr: _jax.Jaxpr) -> bool:
  for eqn in jaxpr.eqns:
    if eqn.primitive is sow_p:
      if eqn.params['effect'] and not eqn.params['remat_copy']:
        return True
    elif any(_holds_staged_sow(j) for j in _jax.jaxprs_in_params(eqn.params)):
      return True
  return False


def _anchored(jaxpr: _jax.Jaxpr, varying: set) -> _jax.Jaxpr | None:
  """``jaxpr`` with one more (last) input, the index, anchoring its sows.

  An equation is anchored when it sows, or holds a sow in a sub-jaxpr, and
  none of its operands depends on ``varying`` (the carry and ``xs``): a sow
  reads its operands through ``anchor_p``; a ``jit`` takes the index as one
  more input and is anchored inside, recursively (it may have no operands
  at all, e.g. a jitted sow of a constant); any other construct reads its
  operands through ``anchor_p``. Returns ``None`` when nothing needs it.
  """
  varying = set(varying)
  index = _jax.Var(_jax.ShapedArray((), np.dtype('int32')))
  eqns, subst, changed = [], {}, False
  for eqn in jaxpr.eqns:
    if subst:
      eqn = eqn.replace(
          invars=[
              subst.get(v, v) if isinstance(v, _jax.Var) else v
              for v in eqn.invars
          ]
      )
    if any(isinstance(v, _jax.Var) and v in varying for v in eqn.invars):
      varying.update(eqn.outvars)
      eqns.append(eqn)
      continue
    if eqn.primitive is sow_p:
      p = eqn.params
      if not p['effect'] or p['remat_copy'] or not eqn.invars:
        eqns.append(eqn)
        continue
      anchored = _anchor_operands(eqns, eqn, index)
      if p['kind'] != 'perturb':
        # Consumers read the operands (the sow is the identity), so only
        # the sow itself runs per iteration. (A perturb's consumers must
        # read its result: that is where its cotangent arrives.)
        subst.update(zip(eqn.outvars, eqn.invars))
        eqn = eqn.replace(
            invars=anchored, outvars=[_jax.Var(v.aval) for v in eqn.outvars]
        )
      else:
        eqn = eqn.replace(invars=anchored)
      changed = True
    elif any(_holds_staged_sow(j) for j in _jax.jaxprs_in_params(eqn.params)):
      if eqn.primitive is _jax.jit_p:
        eqn = _anchored_jit(eqn, index)
        changed = True
      elif eqn.invars:
        eqn = eqn.replace(invars=_anchor_operands(eqns, eqn, index))
        changed = True
      varying.update(eqn.outvars)
    eqns.append(eqn)
  if not changed:
    return None
  outvars = [
      subst.get(v, v) if isinstance(v, _jax.Var) else v for v in jaxpr.outvars
  ]
  new = _jax.edit_jaxpr(jaxpr, eqns, outvars)
  return new.replace(invars=[*jaxpr.invars, index])


def _anchor_operands(eqns, eqn, index):
  """Appends ``anchor_p`` of ``eqn``'s operands to ``eqns``; returns them."""
  anchored = [_jax.Var(v.aval) for v in eqn.invars]
  eqns.append(
      _jax.new_jaxpr_eqn(
          [*eqn.invars, index],
          anchored,
          anchor_p,
          {},
          set(),
          eqn.source_info,
          eqn.ctx,
      )
  )
  return anchored


def _anchored_jit(eqn, index):
  """A ``jit`` equation that takes ``index`` last and anchors its sows."""
  p = eqn.params
  inner = _anchored(p['jaxpr'].jaxpr, set())
  if inner is None:
    return eqn
  return eqn.replace(
      invars=[*eqn.invars, index],
      params=_jax.jit_params_with_input(
          p, _jax.ClosedJaxpr(inner, p['jaxpr'].consts)
      ),
  )


def _anchored_body(closed: _jax.ClosedJaxpr, num_consts: int):
  """``closed`` with one more ``xs`` input that anchors its invariant sows.

  Returns ``None`` when no sow needs an anchor.
  """
  if not _holds_staged_sow(closed.jaxpr):
    return None
  new = _anchored(closed.jaxpr, set(closed.jaxpr.invars[num_consts:]))
  return None if new is None else _jax.ClosedJaxpr(new, closed.consts)


_cache: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_cache_lock = threading.Lock()


def anchored_body(closed: _jax.ClosedJaxpr, num_consts: int):
  """Cached :func:`_anchored_body` (per body jaxpr, weakly)."""
  per = _cache.get(closed)
  if per is not None and num_consts in per:
    return per[num_consts]
  result = _anchored_body(closed, num_consts)
  with _cache_lock:
    _cache.setdefault(closed, {})[num_consts] = result
  return result


def _scan_bind(bind, *args, **params):
  if staging_active():
    body = anchored_body(params['jaxpr'], params['num_consts'])
    if body is not None:
      index = jnp.arange(params['length'], dtype=jnp.int32)
      return bind(*args, index, **dict(params, jaxpr=body))
  return bind(*args, **params)


_jax.wrap_bind(_jax.scan_p, _scan_bind)


# ----------------------------------------------------------------------------
# while under remat: the recomputed copy collects nothing.
#
# ``jax.checkpoint``'s partial evaluation of a ``while_loop``
# (``_while_partial_eval_custom``) keeps the known loop and stages the whole
# equation again for the recomputation, sows included, so a sow in the body
# would be collected twice. Where a known loop runs, the staged copy's sows
# become remat copies (collected nowhere), as ``sow_p``'s own rule does.


def _as_remat_copies(jaxpr: _jax.Jaxpr) -> _jax.Jaxpr:
  eqns = [_remat_copy_eqn(eqn) for eqn in jaxpr.eqns]
  return _jax.edit_jaxpr(jaxpr, eqns, jaxpr.outvars)


def _remat_copy_eqn(eqn: _jax.JaxprEqn) -> _jax.JaxprEqn:
  """``eqn`` with every staged sow in it (or under it) a remat copy."""
  if eqn.primitive is sow_p:
    if eqn.params['effect'] and not eqn.params['remat_copy']:
      eqn = eqn.replace(params=dict(eqn.params, remat_copy=True), effects=set())
  elif any(True for _ in _jax.jaxprs_in_params(eqn.params)):
    params = {k: _map_jaxprs(v) for k, v in eqn.params.items()}
    effects = {e for e in eqn.effects if e is not sow_effect}
    if any(sow_effect in j.effects for j in _jax.jaxprs_in_params(params)):
      effects.add(sow_effect)
    eqn = eqn.replace(params=params, effects=effects)
  return eqn


def _map_jaxprs(value):
  if isinstance(value, _jax.Jaxpr):
    return _as_remat_copies(value)
  if isinstance(value, _jax.ClosedJaxpr):
    return _jax.ClosedJaxpr(_as_remat_copies(value.jaxpr), value.consts)
  if isinstance(value, tuple) and any(
      isinstance(v, (_jax.Jaxpr, _jax.ClosedJaxpr)) for v in value
  ):
    return tuple(_map_jaxprs(v) for v in value)
  return value


def _while_partial_eval_custom(jax_rule, saveable, unks_in, inst_in, eqn):
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


_jax.wrap_rule(
    _jax.partial_eval_jaxpr_custom_rules,
    _jax.while_p,
    _while_partial_eval_custom,
)


# ----------------------------------------------------------------------------
# custom_jvp / custom_vjp under remat: collected once, recomputed freely.
#
# JAX has no partial-evaluation rule for these under ``checkpoint``; its
# default saves the outputs of a known effectful equation as residuals, which
# a ``while_loop`` body cannot have (``_while_partial_eval_custom`` asserts
# it). A sow inside makes the equation effectful only to be collected, so
# the known equation runs (and collects) once and the recomputation uses a
# copy whose sows are remat copies, as for a bare sow. Equations without a
# staged sow get JAX's default behaviour.


def _custom_call_partial_eval_custom(saveable, unks_in, inst_in, eqn):
  n = len(eqn.outvars)
  res = [
      v
      for v, inst in zip(eqn.invars, inst_in)
      if isinstance(v, _jax.Var) and not inst
  ]
  if any(unks_in):
    return None, eqn, [True] * n, [True] * n, res
  if sow_effect in eqn.effects:
    copy = _remat_copy_eqn(eqn)
    if _jax.remat_recomputes(saveable, copy):
      return eqn, copy, [False] * n, [True] * n, res
  elif _jax.remat_recomputes(saveable, eqn):
    return eqn, eqn, [False] * n, [True] * n, res
  return eqn, None, [False] * n, [False] * n, []


for _primitive in (_jax.custom_jvp_call_p, _jax.custom_vjp_call_p):
  _jax.partial_eval_jaxpr_custom_rules.setdefault(
      _primitive, _custom_call_partial_eval_custom
  )
