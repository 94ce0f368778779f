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


"""Binders shared by the capture and intervene rules of every construct.

A rule that threads extra values through a higher-order primitive adds
leading inputs (the constants of a rewritten body, accumulators in) and
trailing inputs or outputs (replacements in, sown values out). The helpers
here keep the equation's own parameters consistent with that:

* :func:`hoisted`: a rewritten body's constants as leading inputs (cached),
  so an eagerly run construct keeps no array alive in JAX's executable cache;
  :func:`branches_hoisted` for the branches of a ``cond``.
* :func:`permuted`: a body with its binders and outputs reordered, without
  re-tracing (JAX's ``scan``/``while`` fix the order of consts, carries and
  xs).
* :func:`jit_params`: ``jit``'s per-input and per-output parameters
  (shardings, layouts, donation) extended for extra inputs and outputs.
"""

from __future__ import annotations


import numpy as np

from flax.nnx.sow import _jax
from flax.nnx.sow.collect import cached


def permuted(closed: _jax.ClosedJaxpr, in_order, out_order, name: str):
  """``closed`` with its inputs and outputs permuted.

  The result's input ``i`` is ``closed``'s input ``in_order[i]``... inverted:
  ``in_order[j]`` is the position in the *new* signature of old input ``j``;
  ``out_order`` lists, for each new output, the old output it returns.
  """
  n_in = len(closed.in_avals)
  new_in_avals = [None] * n_in
  for old, new in enumerate(in_order):
    new_in_avals[new] = closed.in_avals[old]

  def fn(*args):
    outs = _jax.eval_closed(closed, [args[in_order[j]] for j in range(n_in)])
    return [outs[i] for i in out_order]

  return _jax.trace_to_closed_jaxpr(fn, new_in_avals, name)


def hoisted(closed: _jax.ClosedJaxpr):
  """``(jaxpr taking its constants as leading inputs, constants)``, cached.

  A rewritten body can hold constants that ``f`` never passed to the loop
  (an array a ``reduce_fn`` closes over). JAX caches an eagerly run loop's
  executable by its jaxpr, so such constants would stay alive; passed as
  operands, as ``lax.scan`` does with closures, they do not.
  """

  if not closed.consts:
    return closed, []  # (not cached: the entry would keep its key alive)

  def build():
    open_jaxpr, consts = _jax.close_over_nothing(closed)
    return _jax.ClosedJaxpr(open_jaxpr, ()), consts

  return cached(closed, 'hoisted', build)


def branches_hoisted(branches):
  """Branches taking every branch's constants as leading inputs (see
  :func:`hoisted`); each reads its own and ignores the others'."""
  parts = [hoisted(b) for b in branches]
  if not any(consts for _, consts in parts):
    return branches, []
  avals = [_jax.typeof(c) for _, consts in parts for c in consts]
  offsets = np.cumsum([0] + [len(consts) for _, consts in parts])
  new = []
  for i, (open_branch, consts) in enumerate(parts):
    lo, hi = int(offsets[i]), int(offsets[i + 1])

    def build(open_branch=open_branch, lo=lo, hi=hi):
      n = len(avals)

      def fn(*args):
        return _jax.eval_closed(open_branch, [*args[lo:hi], *args[n:]])

      in_avals = [*avals, *open_branch.in_avals[hi - lo :]]
      return _jax.trace_to_closed_jaxpr(fn, in_avals, 'cond_capture_consts')

    new.append(cached(open_branch, ('cond_consts', tuple(avals), lo), build))
  return tuple(new), [c for _, consts in parts for c in consts]
