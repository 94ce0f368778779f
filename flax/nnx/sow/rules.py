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
``closed_call``/``call``, ``custom_jvp_call``, ``custom_vjp_call``,
``remat_opt`` (the forward pass of ``custom_vjp(optimize_remat=True)``),
``custom_vmap_call`` and ``remat``. Each re-binds its primitive with a rewritten sub-jaxpr that takes
the accumulators of reduced names as leading inputs and returns the collected
values as trailing outputs (see ``capture.Layout``). Loops and branches are in
``loops.py``.
"""

from __future__ import annotations


from flax.nnx.sow import _jax
from flax.nnx.sow.capturing import Collector
from flax.nnx.sow.capturing import cached
from flax.nnx.sow.capturing import is_array
from flax.nnx.sow.capturing import collect_rules
from flax.nnx.sow.capturing import construct_names
from flax.nnx.sow.capturing import eval_collecting
from flax.nnx.sow.invariance import without_staged_sows
from flax.nnx.sow.loops import _hoisted  # pylint: disable=protected-access


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


def stage_vmap_rule(rule, in_tree, out_tree, axis_size, flags, values):
  """A ``custom_vmap`` rule staged on flat ``values`` with batched ``flags``.

  Returns ``(closed, box)``: the jaxpr, and a list whose last entry, once the
  jaxpr is staged, says which outputs the rule batched. Shared by the
  capture and intervene rules of ``custom_vmap_call``.
  """
  box = []

  def run(*xs):
    outs, batched = _jax.call_vmap_rule(
        rule, in_tree, out_tree, axis_size, flags, xs
    )
    box.append(batched)
    return outs

  closed = _jax.trace_to_closed_jaxpr(
      run, [_jax.typeof(x) for x in values], 'custom_vmap_rule'
  )
  return closed, box


def _without_repeated_sows(accepts_key, layout, rule, args, what):
  """``rule(*args)``, dropping the sows this capture took from the body.

  Called from a rule that JAX keeps in the staged program, so it is given
  the capture's ``accepts_key``, never its ``Collector``, whose entries are
  tracers of the staging (``jax.checking_leaks``).

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
  collector = Collector(accepts_key)
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
  return eval_collecting(closed.jaxpr, closed.consts, values, collector)


# ----------------------------------------------------------------------------
# custom_jvp: the primal body is rewritten; the JVP is the original rule for
# the original outputs, and for the collected values their primal (evaluated
# from the rewritten body) with zero tangents.


def _custom_jvp_rule(collector: Collector, eqn: _jax.JaxprEqn, invals):
  p = eqn.params
  new_jaxpr, layout, acc_in = collector.prepare(p['call_jaxpr'])
  n_acc, n_out = len(acc_in), len(eqn.outvars)
  _, orig_jvp = eqn.primitive.get_bind_params(p)['subfuns']
  accepts_key = collector.accepts_key

  def fun(*args):
    return _jax.eval_closed(new_jaxpr, args)

  def jvp(*xs):
    primals, tangents = _split(xs, len(xs) // 2)
    out = _without_repeated_sows(
        accepts_key,
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
  accepts_key = collector.accepts_key

  def fun(*args):
    return _jax.eval_closed(new_jaxpr, args)

  def fwd(*args):
    res_and_outs = _without_repeated_sows(
        accepts_key, layout, orig_fwd, args[2 * n_acc :], 'custom_vjp forward'
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


# ----------------------------------------------------------------------------
# remat_opt: the forward pass of ``f.defvjp(fwd, bwd, optimize_remat=True)``,
# bound where ``jax.grad`` calls ``fwd`` (so its sows see primal values).
# Its ``fwd_jaxpr`` takes ``[*consts, *args]`` and returns
# ``[*residuals, *outputs]``; where the residuals turn out unused, JAX's
# dead-code elimination replaces the equation by the jaxpr that
# ``fun_jaxpr_thunk()`` gives, which takes ``args`` only. The rewritten
# forward pass returns the collected values after the outputs, and the
# replacement is that same rewritten forward pass without the residuals,
# so both give the same extra outputs. Everything it takes is an ordinary
# argument (``num_consts=0``): the constants and accumulators included.


def remat_opt_primal(fwd: _jax.ClosedJaxpr, num_res: int):
  """The ``fun_jaxpr_thunk`` of a rewritten ``remat_opt`` (cached)."""

  def build():
    jaxpr = fwd.jaxpr
    primal = _jax.edit_jaxpr(jaxpr, jaxpr.eqns, jaxpr.outvars[num_res:])
    return lambda: (primal, [])

  return cached(fwd, ('remat_opt_primal', num_res), build)


def bind_remat_opt(fwd: _jax.ClosedJaxpr, args, num_res: int) -> list:
  """Binds ``remat_opt`` with forward pass ``fwd`` (no constants) on
  ``args``; the primal is ``fwd`` without its residuals."""
  return _jax.remat_opt_p.bind(
      *args,
      num_consts=0,
      num_res=num_res,
      fwd_jaxpr=fwd,
      fun_jaxpr_thunk=remat_opt_primal(fwd, num_res),
  )


def _remat_opt_rule(collector: Collector, eqn: _jax.JaxprEqn, invals):
  p = eqn.params
  new_jaxpr, layout, acc_in = collector.prepare(p['fwd_jaxpr'])
  fwd, consts = _hoisted(new_jaxpr)
  outs = bind_remat_opt(fwd, [*consts, *acc_in, *invals], p['num_res'])
  return collector.split_outputs(layout, outs, len(eqn.outvars))


collect_rules[_jax.remat_opt_p] = _remat_opt_rule
construct_names[_jax.remat_opt_p] = '`jax.custom_vjp` (optimize_remat=True)'


# ----------------------------------------------------------------------------
# custom_vmap: the body is rewritten. Unbatched, the rewritten body runs.
# Batched (a ``jax.vmap`` around the capture, or around a ``jax.jit`` of
# it), the user's vmap rule runs instead, and what it sows is collected, as
# under a ``jax.vmap`` inside the capture: its sows must then fill the
# entries the body's sows laid out.


class CollectingVmapRule:
  """The vmap rule of a rewritten ``custom_vmap_call``.

  Runs the user's ``rule`` on the original arguments and collects its sows
  into the extra outputs of the rewritten body (``layout``). It keeps the
  capture's ``accepts_key``, never its ``Collector``: JAX keeps the rule in
  the staged program.
  """

  def __init__(
      self,
      rule,
      in_tree,
      out_tree,
      n_lead,
      layout,
      extra_avals,
      accepts_key,
      where_,
  ):
    self.rule = rule
    self.in_tree = in_tree
    self.out_tree = out_tree
    self.n_lead = n_lead  # constants and accumulators before the arguments
    self.layout = layout
    self.extra_avals = extra_avals  # one example's, per extra output
    self.accepts_key = accepts_key
    self.where = where_

  def __str__(self):
    return str(self.rule)

  def __call__(self, axis_size, in_batched, *args):
    layout = self.layout
    if layout.reduced:
      name = layout.reduced[0].name
      raise NotImplementedError(
          f'sow {name!r}{self.where}: a reduced sow inside a'
          ' `jax.custom_batching.custom_vmap` function that `jax.vmap` maps'
          ' over from outside the capture, where its vmap rule runs instead'
          ' of the function. Put the vmap inside the capture'
          ' (capture(jax.vmap(f))), or sow the value outside the'
          ' custom_vmap function.'
      )
    flags = list(in_batched[self.n_lead :])
    values = list(args[self.n_lead :])
    closed, box = stage_vmap_rule(
        self.rule, self.in_tree, self.out_tree, axis_size, flags, values
    )
    inner = Collector(self.accepts_key)
    outs = eval_collecting(closed.jaxpr, closed.consts, values, inner)
    extra, extra_batched = self._extra_outputs(inner, axis_size)
    return [*outs, *extra], [*box[-1], *extra_batched]

  def _extra_outputs(self, inner: Collector, axis_size: int):
    expected = [(e.name, e.treedef) for e in self.layout.entries]
    got = [(spec.name, spec.treedef) for spec, _ in inner.entries]
    if got != expected or inner.accumulators:
      names = [n for n, _ in expected]
      name = names[0] if names else next(iter(inner.names))
      raise NotImplementedError(
          f'sow {name!r}{self.where}: `jax.vmap` maps over a'
          ' `jax.custom_batching.custom_vmap` function from outside the'
          ' capture, so its vmap rule runs instead of the function, and the'
          f' rule sows {[n for n, _ in got]} where the function sows'
          f' {names} (same names, order and structure needed). Sow the same'
          ' values in the rule, or put the vmap inside the capture'
          ' (capture(jax.vmap(f)) collects what the rule sows).'
      )
    leaves = [x for _, ls in inner.entries for x in ls]
    batched = []
    for (spec, _), x, aval in zip(
        [(s, x) for s, ls in inner.entries for x in ls],
        leaves,
        self.extra_avals,
    ):
      shape, dtype = _jax.typeof(x).shape, _jax.typeof(x).dtype
      if dtype != aval.dtype or shape not in (
          aval.shape,
          (axis_size, *aval.shape),
      ):
        raise ValueError(
            f'sow {spec.name!r}{self.where}: the vmap rule of a'
            ' `jax.custom_batching.custom_vmap` function sows a'
            f' {_jax.typeof(x).str_short()} where the function sows a'
            f' {aval.str_short()} per example; it must sow that value'
            f' batched ({axis_size} examples first) or unbatched.'
        )
      batched.append(shape != aval.shape)
    return leaves, batched


def _custom_vmap_rule(collector: Collector, eqn: _jax.JaxprEqn, invals):
  p = eqn.params
  new_jaxpr, layout, acc_in = collector.prepare(p['call'])
  call, consts = _hoisted(new_jaxpr)
  n_out = len(eqn.outvars)
  extra_avals = call.out_avals[n_out : n_out + layout.num_entry_leaves]
  sites = collector.accepted_sites([p['call']])
  rule = CollectingVmapRule(
      p['rule'],
      p['in_tree'],
      p['out_tree'],
      len(consts) + len(acc_in),
      layout,
      tuple(extra_avals),
      collector.accepts_key,
      sites[0].where if sites else '',
  )
  outs = _jax.bind_custom_vmap(call, [*consts, *acc_in, *invals], rule)
  return collector.split_outputs(layout, outs, n_out)


collect_rules[_jax.custom_vmap_p] = _custom_vmap_rule
construct_names[_jax.custom_vmap_p] = '`jax.custom_batching.custom_vmap`'
