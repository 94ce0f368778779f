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


def _invariant_sows(body: _jax.Jaxpr, num_consts: int) -> list[int]:
  """Equations of ``body`` that sow and read only loop-invariant values.

  An equation qualifies when it is a staged sow, or holds one in a
  sub-jaxpr, and none of its operands depends on the carry or ``xs``.
  """
  varying = set(body.invars[num_consts:])
  found = []
  for i, eqn in enumerate(body.eqns):
    reads_varying = any(
        isinstance(v, _jax.Var) and v in varying for v in eqn.invars
    )
    if reads_varying:
      varying.update(eqn.outvars)
      continue
    if eqn.primitive is sow_p:
      p = eqn.params
      if p['effect'] and not p['remat_copy'] and eqn.invars:
        found.append(i)
    elif eqn.invars and any(
        _holds_staged_sow(j) for j in _jax.jaxprs_in_params(eqn.params)
    ):
      found.append(i)
      varying.update(eqn.outvars)
  return found


def _anchored_body(closed: _jax.ClosedJaxpr, num_consts: int):
  """``closed`` with one more ``xs`` input that anchors its invariant sows.

  Returns ``None`` when no sow needs an anchor.
  """
  jaxpr = closed.jaxpr
  if not _holds_staged_sow(jaxpr):
    return None
  which = _invariant_sows(jaxpr, num_consts)
  if not which:
    return None
  index = _jax.Var(_jax.ShapedArray((), np.dtype('int32')))
  eqns = []
  subst = {}
  for i, eqn in enumerate(jaxpr.eqns):
    if subst:
      eqn = eqn.replace(
          invars=[
              subst.get(v, v) if isinstance(v, _jax.Var) else v
              for v in eqn.invars
          ]
      )
    if i in set(which):
      anchored = [_jax.Var(v.aval) for v in eqn.invars]
      eqns.append(
          _jax.new_jaxpr_eqn(
              [*eqn.invars, index], anchored, anchor_p, {}, set(),
              eqn.source_info, eqn.ctx,
          )
      )
      if eqn.primitive is sow_p and eqn.params['kind'] != 'perturb':
        # Consumers read the operands (the sow is the identity), so only
        # the sow itself runs per iteration. (A perturb's consumers must
        # read its result: that is where its cotangent arrives.)
        subst.update(zip(eqn.outvars, eqn.invars))
        fresh = [_jax.Var(v.aval) for v in eqn.outvars]
        eqn = eqn.replace(invars=anchored, outvars=fresh)
      else:
        eqn = eqn.replace(invars=anchored)
    eqns.append(eqn)
  outvars = [
      subst.get(v, v) if isinstance(v, _jax.Var) else v for v in jaxpr.outvars
  ]
  new = _jax.edit_jaxpr(jaxpr, eqns, outvars)
  new = new.replace(invars=[*jaxpr.invars, index])
  return _jax.ClosedJaxpr(new, closed.consts)


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
