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
function, and for a ``custom_vjp`` the ``fwd`` rule: a rule that computes
the primal output its own way (``cj.defjvp(lambda p, t: (jnp.sin(p[0]),
...))``) never runs the primal body, so the sows in it would be lost.

This file owns what a capture does there. While a capture stages (and only
then: elsewhere, and for calls whose primal body holds no sow, JAX's own
path runs untouched), a differentiated custom call first evaluates its
primal body on the primal values, on the parent trace, so its sows are
collected once with their primal values, as ``capture(f)`` collects them.
The rule then runs with those names hidden (``primitive.hiding``): a rule
that calls the primal function again (the common ``(f(x), ...)`` form)
does not collect them a second time. Sows the rule makes under other names
(a ``fwd`` rule's own sows) and sows in a ``bwd`` rule are collected as
before. Where the primal output is not needed, the extra evaluation is
removed by dead-code elimination under ``jax.jit``, except the sows.

The rule may bind a custom call of its own where nothing differentiates
(inside a ``lax.cond`` branch that JAX's JVP rule stages, for instance);
JAX traces that call's ``jvp``/``fwd`` rule later, when the call is
differentiated again (``jax.grad`` of a ``jax.linearize``), outside the
rule. That rule is traced with the same names hidden, or it would collect
the primal body's sows a second time.
"""

from __future__ import annotations

from flax.nnx.sow import _jax
from flax.nnx.sow.capture import sow_sites
from flax.nnx.sow.primitive import hidden_names
from flax.nnx.sow.primitive import hiding
from flax.nnx.sow.primitive import staging_active


def _primal_sow_names(closed: _jax.ClosedJaxpr) -> frozenset:
  return frozenset(
      s.name for s in sow_sites(closed.jaxpr) if s.kind == 'value'
  )


def _rule_hiding(params, names):
  """``params`` whose ``jvp``/``fwd`` rule runs with ``names`` hidden."""
  fun, rule, *rest = params['subfuns']

  def around(call, *args):
    with hiding(names):
      return call(*args)

  return dict(params, subfuns=(fun, _jax.wrap_call(rule, around), *rest))


def _differentiated_custom_call(original, trace, args, avals, params, /):
  if not (staging_active() and _jax.is_differentiating(trace)):
    if staging_active() and hidden_names():
      params = _rule_hiding(params, hidden_names())
    return original(trace, args, avals, params)
  if not any(_jax.has_tangent(trace, x) for x in args):
    return original(trace, args, avals, params)  # the rule does not run
  fun = params['subfuns'][0]
  primals = [_jax.primal_of(trace, x) for x in args]
  with _jax.set_current_trace(trace.parent_trace):
    closed = _jax.trace_to_closed_jaxpr(
        fun.call_wrapped, [_jax.typeof(x) for x in primals], 'custom_primal'
    )
  _jax.reset_stores(fun)  # JAX reads the output tree from the rule's call
  names = _primal_sow_names(closed)
  if not names:
    return original(trace, args, avals, params)
  with _jax.set_current_trace(trace.parent_trace):
    _jax.eval_into_current_trace(closed.jaxpr, closed.consts, primals)
  with hiding(names):
    return original(trace, args, avals, params)


for _primitive in (_jax.custom_jvp_call_p, _jax.custom_vjp_call_p):
  _jax.wrap_bind_with_trace(_primitive, _differentiated_custom_call)
