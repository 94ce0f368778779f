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


"""``jit``, ``closed_call``, ``call`` and ``remat`` (``jax.checkpoint``).

What a sow inside does:

* ``jax.jit``: the call is re-bound as a ``jit`` (never inlined), so it stays
  compiled and cached; its sows become trailing outputs (capture) or its
  replacements trailing inputs (intervene), with shardings and layouts
  extended by :func:`~flax.nnx.sow.constructs.adapter.jit_params`.
* ``closed_call``/``call``: no boundary worth keeping; the body is evaluated
  in place.
* ``jax.checkpoint``: the policy and flags are kept. Under differentiation
  the sow (an effectful equation) runs in the forward pass only, so it is
  collected once.
"""

from __future__ import annotations


from flax.nnx.sow import _jax
from flax.nnx.sow.collect import Collector
from flax.nnx.sow.collect import collect_rules
from flax.nnx.sow.collect import eval_collecting
from flax.nnx.sow.constructs.adapter import jit_params
from flax.nnx.sow.sites import construct_names

# ----------------------------------------------------------------------------
# jit: re-bound as a jit (never inlined), so it stays compiled and cached.


def _jit_capture(collector: Collector, eqn: _jax.JaxprEqn, invals):
  p = eqn.params
  new_jaxpr, layout, acc_in = collector.prepare(p['jaxpr'], python_folds=True)
  # [*accumulators, *inputs] -> [*outputs, *entries, *accumulators]
  params = jit_params(
      p, leading=len(acc_in), outputs=layout.num_extra, jaxpr=new_jaxpr
  )
  outs = _jax.jit_p.bind(*acc_in, *invals, **params)
  return collector.split_outputs(layout, outs, len(eqn.outvars))


collect_rules[_jax.jit_p] = _jit_capture


construct_names[_jax.jit_p] = '`jax.jit`'


# ----------------------------------------------------------------------------
# closed_call / call: a plain call has no boundary worth keeping; evaluate its
# body in place.


def _closed_call_capture(collector: Collector, eqn: _jax.JaxprEqn, invals):
  closed = eqn.params['call_jaxpr']
  return eval_collecting(closed.jaxpr, closed.consts, invals, collector)


def _call_capture(collector: Collector, eqn: _jax.JaxprEqn, invals):
  return eval_collecting(eqn.params['call_jaxpr'], (), invals, collector)


collect_rules[_jax.closed_call_p] = _closed_call_capture


collect_rules[_jax.call_p] = _call_capture


# ----------------------------------------------------------------------------
# remat: the policy and flags are kept. Under differentiation the sow (an
# effectful equation) runs in the forward pass only, so it is collected once.
# As in a jit body, each sow is folded once where it is reached, so a
# Module.sow reduction may change the accumulator's type there.


def _remat_capture(collector: Collector, eqn: _jax.JaxprEqn, invals):
  p = eqn.params
  closed = _jax.ClosedJaxpr(p['jaxpr'], ())
  new_jaxpr, layout, acc_in = collector.prepare(closed, python_folds=True)
  open_jaxpr, consts = _jax.close_over_nothing(new_jaxpr)
  outs = _jax.remat_p.bind(
      *consts, *acc_in, *invals, **dict(p, jaxpr=open_jaxpr)
  )
  return collector.split_outputs(layout, outs, len(eqn.outvars))


collect_rules[_jax.remat_p] = _remat_capture


construct_names[_jax.remat_p] = '`jax.checkpoint`'
