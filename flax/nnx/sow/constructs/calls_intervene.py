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

"""What ``intervene`` does in ``jit``, ``closed_call``, ``call`` and ``remat``.

The intervene half of ``calls.py``, landing with ``inject.py``:

* ``jax.jit``: re-bound as a ``jit`` whose replacements enter as trailing
  inputs (and the rewrite's constants, such as tracers a callable
  replacement closes over, as leading ones), with shardings and layouts
  extended by :func:`~flax.nnx.sow.constructs.adapter.jit_params`.
* ``closed_call``/``call``: the body is evaluated in place.
* ``jax.checkpoint``: re-bound with the replacements as trailing inputs; the
  policy and flags are kept.
"""

from __future__ import annotations

from flax.nnx.sow import _jax
from flax.nnx.sow.constructs.adapter import hoisted
from flax.nnx.sow.constructs.adapter import jit_params
from flax.nnx.sow.inject import eval_intervening
from flax.nnx.sow.inject import intervene_rules
from flax.nnx.sow.inject import one_body


def _jit_intervene(injector, eqn, invals):
  p = eqn.params
  new, reps = one_body(injector, p['jaxpr'])
  # Constants of the rewrite (e.g. tracers a callable closes over) enter as
  # leading arguments: [*consts, *inputs, *replacements] -> outputs.
  new, consts = hoisted(new)
  params = jit_params(p, leading=len(consts), trailing=len(reps), jaxpr=new)
  return _jax.jit_p.bind(*consts, *invals, *reps, **params)


def _closed_call_intervene(injector, eqn, invals):
  closed = eqn.params['call_jaxpr']
  return eval_intervening(closed.jaxpr, closed.consts, invals, injector)


def _call_intervene(injector, eqn, invals):
  return eval_intervening(eqn.params['call_jaxpr'], (), invals, injector)


def _remat_intervene(injector, eqn, invals):
  p = eqn.params
  new, reps = one_body(injector, _jax.ClosedJaxpr(p['jaxpr'], ()))
  jaxpr, consts = _jax.close_over_nothing(new)
  # close_over_nothing puts the constants first.
  return _jax.remat_p.bind(*consts, *invals, *reps, **dict(p, jaxpr=jaxpr))


intervene_rules[_jax.jit_p] = _jit_intervene
intervene_rules[_jax.closed_call_p] = _closed_call_intervene
intervene_rules[_jax.call_p] = _call_intervene
intervene_rules[_jax.remat_p] = _remat_intervene
