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

"""Capture rules for call-like higher-order primitives.

One rule per primitive, registered in ``capture.collect_rules``: ``jit``,
``closed_call``/``call``, ``custom_jvp_call``, ``custom_vjp_call`` and
``remat``. Each re-binds its primitive with a rewritten sub-jaxpr that takes
the accumulators of reduced names as leading inputs and returns the collected
values as trailing outputs (see ``capture.Layout``). Loops and branches are in
``loops.py``.
"""

from __future__ import annotations


from flax.nnx.sow import _jax
from flax.nnx.sow.capture import Collector
from flax.nnx.sow.capture import is_array
from flax.nnx.sow.capture import collect_rules
from flax.nnx.sow.capture import construct_names
from flax.nnx.sow.capture import eval_collecting
from flax.nnx.sow.invariance import without_staged_sows


def _split(outs, n):
  outs = list(outs)
  return outs[:n], outs[n:]


# ----------------------------------------------------------------------------
# jit: re-bound as a jit (never inlined), so it stays compiled and cached.


def _jit_rule(collector: Collector, eqn: _jax.JaxprEqn, invals):
  p = eqn.params
  new_jaxpr, layout, acc_in = collector.prepare(p['jaxpr'], python_folds=True)
  n_acc, n_extra = len(acc_in), layout.num_extra
  outs = _jax.jit_p.bind(
      *acc_in,
      *invals,
      **dict(
          p,
          jaxpr=new_jaxpr,
          in_shardings=(_jax.UNSPECIFIED,) * n_acc + tuple(p['in_shardings']),
          out_shardings=tuple(p['out_shardings'])
          + (_jax.UNSPECIFIED,) * n_extra,
          in_layouts=(None,) * n_acc + tuple(p['in_layouts']),
          out_layouts=tuple(p['out_layouts']) + (None,) * n_extra,
          donated_invars=(False,) * n_acc + tuple(p['donated_invars']),
      ),
  )
  return collector.split_outputs(layout, outs, len(eqn.outvars))


collect_rules[_jax.jit_p] = _jit_rule
construct_names[_jax.jit_p] = '`jax.jit`'


# ----------------------------------------------------------------------------
# closed_call / call: a plain call has no boundary worth keeping; evaluate its
# body in place.


def _closed_call_rule(collector: Collector, eqn: _jax.JaxprEqn, invals):
  closed = eqn.params['call_jaxpr']
  return eval_collecting(closed.jaxpr, closed.consts, invals, collector)


def _call_rule(collector: Collector, eqn: _jax.JaxprEqn, invals):
  return eval_collecting(eqn.params['call_jaxpr'], (), invals, collector)


collect_rules[_jax.closed_call_p] = _closed_call_rule
collect_rules[_jax.call_p] = _call_rule


# ----------------------------------------------------------------------------
# remat: the policy and flags are kept. Under differentiation the sow (an
# effectful equation) runs in the forward pass only, so it is collected once.


def _remat_rule(collector: Collector, eqn: _jax.JaxprEqn, invals):
  p = eqn.params
  closed = _jax.ClosedJaxpr(p['jaxpr'], ())
  new_jaxpr, layout, acc_in = collector.prepare(closed)
  open_jaxpr, consts = _jax.close_over_nothing(new_jaxpr)
  outs = _jax.remat_p.bind(
      *consts, *acc_in, *invals, **dict(p, jaxpr=open_jaxpr)
  )
  return collector.split_outputs(layout, outs, len(eqn.outvars))


collect_rules[_jax.remat_p] = _remat_rule
construct_names[_jax.remat_p] = '`jax.checkpoint`'


# ----------------------------------------------------------------------------
# custom_jvp and custom_vjp: the user's rule usually runs the primal function
# again (``f.defjvp(lambda p, t: (f(*p), ...))``), sows included, while the
# rewritten primal body already returns what those sows collect.


def _without_repeated_sows(collector, layout, rule, args, what):
  """``rule(*args)``, dropping the sows this capture took from the body.

  When the rule is differentiated after the rewrite (a capture inside a
  ``jax.grad`` that an outer capture stages), the sows it runs again would
  reach the outer capture as well; they are the ones this capture already
  collects from the primal body, so they are removed here. A rule that sows
  a name the body does not would have its value lost, so that is an error.
  """
  args = list(args)
  traced = [i for i, x in enumerate(args) if is_array(x)]

  def call(*values):
    full = list(args)  # non-arrays (custom_vjp's "perturbed" flags) as is
    for i, v in zip(traced, values):
      full[i] = v
    return list(rule.call_wrapped(*full))

  values = [args[i] for i in traced]
  closed = _jax.trace_to_closed_jaxpr(
      call, [_jax.typeof(x) for x in values], 'custom_rule'
  )
  if not collector.has_work([closed]):
    return _jax.eval_closed(closed, values)
  extra = [
      s
      for s in collector.accepted_sites([closed])
      if s.name not in layout.names
  ]
  if extra:
    raise NotImplementedError(
        f'sow {extra[0].name!r}{extra[0].where}: this sow runs in the {what}'
        ' of a function whose primal body the capture has already rewritten'
        ' (a capture inside a differentiated function), so its value cannot'
        ' be collected. Sow it in the primal function, or put the capture'
        ' around the differentiation (capture(jax.grad(f))).'
    )
  return eval_collecting(
      closed.jaxpr, closed.consts, values, Collector(collector.accepts_key)
  )


# ----------------------------------------------------------------------------
# custom_jvp: the primal body is rewritten; the JVP is the original rule for
# the original outputs, and for the collected values their primal (evaluated
# from the rewritten body) with zero tangents.


def _custom_jvp_rule(collector: Collector, eqn: _jax.JaxprEqn, invals):
  p = eqn.params
  new_jaxpr, layout, acc_in = collector.prepare(p['call_jaxpr'])
  n_acc, n_out = len(acc_in), len(eqn.outvars)
  _, orig_jvp = eqn.primitive.get_bind_params(p)['subfuns']

  def fun(*args):
    return _jax.eval_closed(new_jaxpr, args)

  def jvp(*xs):
    primals, tangents = _split(xs, len(xs) // 2)
    out = _without_repeated_sows(
        collector,
        layout,
        orig_jvp,
        [*primals[n_acc:], *tangents[n_acc:]],
        'custom_jvp rule',
    )
    out_primals, out_tangents = _split(out, n_out)
    # The rule ran the body's remaining sows (those this capture does not
    # take); the extra outputs are computed without running them again.
    extra = _jax.eval_closed(without_staged_sows(new_jaxpr), primals)
    extra = extra[n_out:]
    zeros = [_jax.zeros_like_tangent(x) for x in extra]
    return [*out_primals, *extra, *out_tangents, *zeros]

  n_in = len(new_jaxpr.in_avals)
  outs = _jax.custom_jvp_call_p.bind(
      *acc_in,
      *invals,
      subfuns=(
          _jax.wrap_init(fun, 'custom_jvp_capture', n_in),
          _jax.wrap_init(jvp, 'custom_jvp_capture_jvp', 2 * n_in),
      ),
      symbolic_zeros=p['symbolic_zeros'],
  )
  return collector.split_outputs(layout, outs, n_out)


collect_rules[_jax.custom_jvp_call_p] = _custom_jvp_rule
construct_names[_jax.custom_jvp_call_p] = '`jax.custom_jvp`'


# ----------------------------------------------------------------------------
# custom_vjp: the primal body is rewritten; the forward rule is the original
# one plus the collected values (evaluated from the rewritten body), and the
# backward rule is the original one, given only the cotangents of the
# original outputs and returning zero cotangents for the accumulators.


def _custom_vjp_rule(collector: Collector, eqn: _jax.JaxprEqn, invals):
  p = eqn.params
  new_jaxpr, layout, acc_in = collector.prepare(p['call_jaxpr'])
  acc_avals = [_jax.typeof(x) for x in acc_in]
  n_acc, n_out, n_extra = len(acc_in), len(eqn.outvars), layout.num_extra
  _, orig_fwd, orig_bwd = eqn.primitive.get_bind_params(p)['subfuns']

  def fun(*args):
    return _jax.eval_closed(new_jaxpr, args)

  def fwd(*args):
    res_and_outs = _without_repeated_sows(
        collector, layout, orig_fwd, args[2 * n_acc :], 'custom_vjp forward'
    )
    primals = args[::2]
    extra = _jax.eval_closed(without_staged_sows(new_jaxpr), primals)
    return [*res_and_outs, *extra[n_out:]]

  def bwd(*args):
    cts = orig_bwd.call_wrapped(*args[: len(args) - n_extra])
    return [*(_jax.Zero(a.to_tangent_aval()) for a in acc_avals), *cts]

  def out_trees():
    out_tree, res_tree, input_fwds = p['out_trees']()
    shifted = [None if i is None else i + n_acc for i in input_fwds]
    return out_tree, res_tree, shifted

  n_in = len(new_jaxpr.in_avals)
  outs = _jax.custom_vjp_call_p.bind(
      *acc_in,
      *invals,
      subfuns=(
          _jax.wrap_init(fun, 'custom_vjp_capture', n_in),
          _jax.wrap_init(fwd, 'custom_vjp_capture_fwd', 2 * n_in),
          _jax.wrap_init(bwd, 'custom_vjp_capture_bwd', 0),
      ),
      out_trees=out_trees,
      symbolic_zeros=p['symbolic_zeros'],
  )
  return collector.split_outputs(layout, outs, n_out)


collect_rules[_jax.custom_vjp_call_p] = _custom_vjp_rule
construct_names[_jax.custom_vjp_call_p] = '`jax.custom_vjp`'
