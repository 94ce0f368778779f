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

"""Sows in the primal body of a ``custom_jvp``/``custom_vjp`` under AD.

When JAX differentiates a ``custom_jvp`` call (``jax.jvp``, ``jax.grad``,
``jax.linearize``, ...) it runs the ``jvp`` rule instead of the primal
function, and for a ``custom_vjp`` the ``fwd`` rule. The usual rule calls the
primal function (``(f(x), ...)``), so the sows in the primal body run, and
are collected, inside the rule. A rule that computes the primal output its
own way (``cj.defjvp(lambda p, t: (jnp.sin(p[0]), ...))``) never runs the
body, and its sows would be lost.

This file owns what a capture does there. While a capture stages (and only
then: elsewhere, and for calls whose primal body holds no sow, JAX's own
path runs untouched), a differentiated custom call stages its primal body
and its rule, and compares the names they sow. Names the rule sows are
collected from the rule, as before; names only the body sows are collected
by evaluating the body on the primal values, on the parent trace, with the
other sows in it made remat copies. So each sow of the body is collected
once, with its primal value, as ``capture(f)`` collects it. Sows in a
``bwd`` rule are collected when it runs, as before. Under ``jax.jit``, the
evaluated body's outputs are unused and removed by dead-code elimination,
except its sows.
"""

from __future__ import annotations

import functools

from flax.nnx.sow import _jax
from flax.nnx.sow import _jax_patches
from flax.nnx.sow.capturing import sow_sites
from flax.nnx.sow.invariance import without_value_sows_named
from flax.nnx.sow.primitive import staging_active


def _value_sow_names(closed: _jax.ClosedJaxpr) -> frozenset:
  return frozenset(
      s.name for s in sow_sites(closed.jaxpr) if s.kind == 'value'
  )


def _holds_remat_opt(jaxpr: _jax.Jaxpr) -> bool:
  return any(
      eqn.primitive is _jax.remat_opt_p
      or any(_holds_remat_opt(j) for j in _jax.jaxprs_in_params(eqn.params))
      for eqn in jaxpr.eqns
  )


def _stage(call, fun, avals, name) -> _jax.ClosedJaxpr:
  """``call`` (which calls the ``lu.WrappedFun`` ``fun``) staged at
  ``avals``; the auxiliary outputs ``fun`` records are forgotten, so that
  JAX can call it again."""
  closed = _jax.trace_to_closed_jaxpr(call, avals, name)
  _jax.reset_stores(fun)
  return closed


def _rule(primitive, trace, args, params) -> _jax.ClosedJaxpr:
  """The rule the differentiating ``trace`` will run, staged as it calls it:
  ``jvp`` on primals and (instantiated) tangents, ``fwd`` on primals with
  flags saying which of them have tangents."""
  pairs = [trace.to_primal_tangent_pair(x) for x in args]
  avals = [_jax.typeof(p) for p, _ in pairs]
  rule = params['subfuns'][1]
  if primitive is _jax.custom_jvp_call_p:
    tangents = [a.to_tangent_aval() for a in avals]
    return _stage(rule.call_wrapped, rule, [*avals, *tangents], 'custom_jvp')
  flags = [type(t) is not _jax.Zero for _, t in pairs]

  def fwd(*primals):
    return rule.call_wrapped(
        *[v for p, nz in zip(primals, flags) for v in (p, nz)]
    )

  return _stage(fwd, rule, avals, 'custom_vjp_fwd')


def _differentiated_custom_call(
    primitive, original, trace, args, avals, params, /
):
  if not (staging_active() and _jax.is_differentiating(trace)):
    return original(trace, args, avals, params)
  if not any(_jax.has_tangent(trace, x) for x in args):
    return original(trace, args, avals, params)  # the rule does not run
  fun = params['subfuns'][0]
  primals = [_jax.primal_of(trace, x) for x in args]
  with _jax.set_current_trace(trace.parent_trace):
    body = _stage(
        fun.call_wrapped, fun, [_jax.typeof(x) for x in primals], 'primal'
    )
    names = _value_sow_names(body)
    if names:
      rule = _rule(primitive, trace, args, params)
      in_rule = _value_sow_names(rule)
  if not names or names <= in_rule:
    return original(trace, args, avals, params)
  if _holds_remat_opt(rule.jaxpr):
    # custom_vjp(optimize_remat=True): JAX may run the primal function in
    # place of fwd (when its residuals are unused), with the body's sows, so
    # neither collecting them here nor leaving them collects them once.
    missing = sorted(map(repr, names - in_rule))
    raise NotImplementedError(
        f'sow {", ".join(missing)}: a capture cannot collect the sows of a'
        ' `jax.custom_vjp` function defined with optimize_remat=True whose'
        ' fwd rule does not call the function, under differentiation: JAX'
        ' may run the function in place of fwd, or not. Call the function'
        ' in fwd (fwd = lambda x: (f(x), residuals)), or drop'
        ' optimize_remat=True.'
    )
  # The rule does not run (all of) the body: collect what it misses from the
  # body itself, once, with the primal values.
  body = without_value_sows_named(body, in_rule)
  with _jax.set_current_trace(trace.parent_trace):
    _jax.eval_into_current_trace(body.jaxpr, body.consts, primals)
  return original(trace, args, avals, params)


_jax_patches.register(
    'custom_jvp_bind',
    functools.partial(_differentiated_custom_call, _jax.custom_jvp_call_p),
)
_jax_patches.register(
    'custom_vjp_bind',
    functools.partial(_differentiated_custom_call, _jax.custom_vjp_call_p),
)
