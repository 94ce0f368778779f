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

"""Rules of ``control.py``'s pass for ``scan``, ``while_loop``, ``cond``.

Inside ``shard_map`` a loop or branch whose predicate varies over mesh axes
makes its outputs vary over them, whatever their types say, and so what it
sows. Each rule says how its construct gives control axes to its outputs
(``control.control_rules``); the ``while_loop`` and ``cond`` entries of
``sites.site_annotations`` give a sow inside them the axes of their
predicate. They land with ``shard_map.py``, the only rule that runs the pass.
"""

from __future__ import annotations

from flax.nnx.sow import _jax
from flax.nnx.sow.control import NO_AXES
from flax.nnx.sow.control import control_axes
from flax.nnx.sow.control import control_rules
from flax.nnx.sow.control import passes_through
from flax.nnx.sow.control import union
from flax.nnx.sow.sites import site_annotations

# ----------------------------------------------------------------------------
# scan: the carries' axes grow to a fixed point.


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


control_rules[_jax.scan_p] = _scan_control


# ----------------------------------------------------------------------------
# while_loop: the predicate's axes reach every carry the body changes.


site_annotations[_jax.while_p] = lambda eqn, site: control_axes(
    _jax.varying_axes(eqn.params['cond_jaxpr'].out_avals[0]), site
)

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


control_rules[_jax.while_p] = _while_control


# ----------------------------------------------------------------------------
# cond/switch: each device takes the branch its index picks.


site_annotations[_jax.cond_p] = lambda eqn, site: control_axes(
    _jax.varying_axes(eqn.invars[0].aval), site
)

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


control_rules[_jax.cond_p] = _cond_control
