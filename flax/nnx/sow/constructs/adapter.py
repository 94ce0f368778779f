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
  re-tracing; :func:`carries_moved` for the extra carries of a loop body
  (JAX's ``scan``/``while`` fix the order of consts, carries and xs).
* :func:`with_unused_inputs`: a body given inputs it ignores (a ``while``
  predicate next to the accumulators, a ``cond`` branch next to another
  branch's constants).
* :func:`jit_params`: ``jit``'s per-input and per-output parameters
  (shardings, layouts, donation) extended for extra inputs and outputs.
"""

from __future__ import annotations


import numpy as np  # PR: loops

from flax.nnx.sow import _jax
from flax.nnx.sow.collect import cached  # PR: intervene


def permuted(closed: _jax.ClosedJaxpr, in_order, out_order):  # PR: loops
  """``closed`` with its binders and outputs reordered, without re-tracing.

  ``in_order[j]`` is the position in the new signature of old input ``j``;
  ``out_order`` lists, for each new output, the old output it returns. The
  equations are shared with ``closed`` (a jaxpr's variables are only
  names); input effects follow their variables.
  """
  jaxpr = closed.jaxpr
  n_in = len(jaxpr.invars)
  names = jaxpr.debug_info.safe_arg_names(n_in)
  paths = jaxpr.debug_info.safe_result_paths(len(jaxpr.outvars))
  invars, arg_names = [None] * n_in, [None] * n_in
  for old, new in enumerate(in_order):
    invars[new], arg_names[new] = jaxpr.invars[old], names[old]
  debug_info = jaxpr.debug_info._replace(
      arg_names=tuple(arg_names),
      result_paths=tuple(paths[i] for i in out_order),
  )
  return _jax.ClosedJaxpr(
      jaxpr.replace(
          invars=invars,
          outvars=[jaxpr.outvars[i] for i in out_order],
          debug_info=debug_info,
      ),
      closed.consts,
  )


def carries_moved(  # PR: loops
    body: _jax.ClosedJaxpr, n_consts: int, n_extra: int
):
  """A loop body's extra carries moved to where ``scan`` and ``while`` take
  them (cached, without re-tracing).

  ``body`` takes ``[*extra, *consts, *rest]`` and returns ``[*outs, *extra]``,
  as a capture's rewrite does (accumulators first in, last out); the result
  takes ``[*consts, *extra, *rest]`` and returns ``[*extra, *outs]``, the
  extra carries ahead of the loop's own.
  """

  def build():
    n_in, n_out = len(body.in_avals), len(body.out_avals)
    in_order = [
        n_consts + j if j < n_extra else j - n_extra
        for j in range(n_extra + n_consts)
    ] + list(range(n_extra + n_consts, n_in))
    out_order = [*range(n_out - n_extra, n_out), *range(n_out - n_extra)]
    return permuted(body, in_order, out_order)

  return cached(body, ('carries_moved', n_consts, n_extra), build)


def with_unused_inputs(closed: _jax.ClosedJaxpr, avals, at: int):  # PR: loops
  """``closed`` taking inputs of ``avals`` that it ignores, inserted before
  its input ``at`` (without re-tracing)."""
  jaxpr = closed.jaxpr
  unused = [_jax.Var(aval) for aval in avals]
  names = jaxpr.debug_info.safe_arg_names(len(jaxpr.invars))
  return _jax.ClosedJaxpr(
      jaxpr.replace(
          invars=[*jaxpr.invars[:at], *unused, *jaxpr.invars[at:]],
          debug_info=jaxpr.debug_info._replace(
              arg_names=(*names[:at], *('',) * len(unused), *names[at:])
          ),
      ),
      closed.consts,
  )


def jit_params(params: dict, *, leading=0, trailing=0, outputs=0, **changes):
  """``jit``'s parameters for ``leading`` extra inputs before the equation's
  own, ``trailing`` after them, and ``outputs`` extra trailing outputs.

  The parameters with one entry per input or output (shardings, layouts,
  donation) grow by unspecified shardings, default layouts and no donation;
  ``changes`` (e.g. ``jaxpr=``) replace entries.
  """
  p = params
  unspecified = _jax.UNSPECIFIED
  return dict(
      p,
      in_shardings=(
          *(unspecified,) * leading,
          *p['in_shardings'],
          *(unspecified,) * trailing,
      ),
      out_shardings=(*p['out_shardings'], *(unspecified,) * outputs),
      in_layouts=(*(None,) * leading, *p['in_layouts'], *(None,) * trailing),
      out_layouts=(*p['out_layouts'], *(None,) * outputs),
      donated_invars=(
          *(False,) * leading,
          *p['donated_invars'],
          *(False,) * trailing,
      ),
      **changes,
  )


def hoisted(closed: _jax.ClosedJaxpr):  # PR: intervene
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


def branches_hoisted(branches):  # PR: loops
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
      # [own consts, *ops] -> [all consts, *ops], the others' ignored.
      after = with_unused_inputs(open_branch, avals[hi:], hi - lo)
      return with_unused_inputs(after, avals[:lo], 0)

    new.append(cached(open_branch, ('cond_consts', tuple(avals), lo), build))
  return tuple(new), [c for _, consts in parts for c in consts]
