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


"""Custom derivatives: ``custom_jvp``, ``custom_vjp`` (also with
``optimize_remat=True``) and ``custom_vmap``.

What a sow inside does:

* In the primal body of a ``custom_jvp``/``custom_vjp`` call: collected with
  the primal values. The call is re-bound with the rewritten body; its JVP
  or fwd/bwd rule is wrapped so that it never collects the body's sows a
  second time (:func:`_without_repeated_sows`).
* Under differentiation inside the captured function, JAX runs the JVP or
  ``fwd`` rule, not the body: what the rule sows is collected (a rule that
  calls the function runs its sows), and a sow only the body runs is not
  collected there (a missing name, never a wrong value: see
  ``docs/how_it_works.md``, Limitations). ``intervene`` of such a sow finds
  no sow of that name to replace and raises (``Injector.check_sites``).
* In a loop body under differentiation, where scan's partial evaluation
  moves loop-invariant work out of the loop: a ``remat_opt`` on
  loop-invariant values whose forward pass sows stays in the loop; a
  ``custom_jvp``/``custom_vjp`` call there is moved out by JAX's own rules,
  and ``constructs/partial_eval.py`` raises rather than collect one value
  for the whole loop.
* ``custom_vjp(optimize_remat=True)`` (``remat_opt``): the forward rule's
  primal outputs carry the sows. One whose forward rule skips the primal
  under AD sows nothing, unless JAX runs the function in its place (its
  residuals unused): then the function's sows are collected, once.
* ``custom_vmap``: the primal body's sows; under ``vmap``, the rule's.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import typing as tp

import jax


from flax.nnx.sow import _jax
from flax.nnx.sow import _jax_patches
from flax.nnx.sow import loop_index
from flax.nnx.sow.collect import Collector
from flax.nnx.sow.collect import cached
from flax.nnx.sow.collect import collect_rules
from flax.nnx.sow.collect import eval_collecting
from flax.nnx.sow.collect import is_array
from flax.nnx.sow.constructs.adapter import hoisted
from flax.nnx.sow.constructs.partial_eval import hoisting_loop_invariants
from flax.nnx.sow.inject import Injector
from flax.nnx.sow.inject import eval_intervening
from flax.nnx.sow.inject import intervene_rules
from flax.nnx.sow.inject import one_body
from flax.nnx.sow.inject import one_scope
from flax.nnx.sow import intervening  # pylint: disable=unused-import
from flax.nnx.sow.primitive import VALUE_KINDS
from flax.nnx.sow.primitive import last_sow_bound
from flax.nnx.sow.primitive import sow_p
from flax.nnx.sow.primitive import sows_bound
from flax.nnx.sow.primitive import staging
from flax.nnx.sow.primitive import staging_active
from flax.nnx.sow.sites import construct_names
from flax.nnx.sow.sites import holds_staged_sow
from flax.nnx.sow.sites import sow_sites
from flax.nnx.sow.sites import without_staged_sows

# ----------------------------------------------------------------------------
# custom_jvp and custom_vjp: the user's rule usually runs the primal function
# again (``f.defjvp(lambda p, t: (f(*p), ...))``), sows included, while the
# rewritten primal body already returns what those sows collect.


def _split(outs, n):
  outs = list(outs)
  return outs[:n], outs[n:]


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
      run, [_jax.arg_type(x) for x in values], 'custom_vmap_rule'
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
      call, [_jax.arg_type(x) for x in values], 'custom_rule'
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


def _custom_jvp_capture(collector: Collector, eqn: _jax.JaxprEqn, invals):
  p = eqn.params
  new_jaxpr, layout, acc_in = collector.prepare(p['call_jaxpr'])
  n_acc, n_out = len(acc_in), len(eqn.outvars)
  _, orig_jvp = eqn.primitive.get_bind_params(p)['subfuns']
  accepts_key = collector.accepts_key
  # The rule runs the body's remaining sows (those this capture does not
  # take); the extra outputs are computed without running them again (made
  # once, when the call is first differentiated).
  plain = functools.cache(lambda: without_staged_sows(new_jaxpr))

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
    extra, extra_tangents = _extra_outputs(
        plain(), n_acc, n_out, primals, tangents
    )
    return [*out_primals, *extra, *out_tangents, *extra_tangents]

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


def _folds(body, n_acc, n_out, inputs) -> tp.Callable[..., list]:
  """``acc -> body``'s extra outputs (entries, accumulators) at the call's
  ``inputs``, as a function of the ``n_acc`` accumulators entering it.

  The body's own values are constants at every order of differentiation
  (the custom rule stands for the body; a derivative of the rule, as in
  ``jax.hessian``, must not see them vary).
  """
  args = [jax.lax.stop_gradient(x) for x in inputs[n_acc:]]
  return lambda *acc: _jax.eval_closed(body, [*acc, *args])[n_out:]


def _extra_outputs(body, n_acc, n_out, primals, tangents):
  """The extra outputs of the rewritten ``body`` (entries, accumulators)
  and their tangents.

  What the body sows gets a zero tangent (the custom rule stands for the
  body), but an accumulator that enters the call (a name folded before it,
  then in the body) keeps the tangent of what it held: the derivative of the
  body's folds with respect to the accumulator, the body's own values held
  fixed.
  """
  folds = _folds(body, n_acc, n_out, primals)
  if not n_acc:
    extra = folds()
    return extra, [_jax.zeros_like_tangent(x) for x in extra]
  acc_tangents = [_jax.instantiate_zeros(t) for t in tangents[:n_acc]]
  extra, extra_tangents = jax.jvp(
      folds, tuple(primals[:n_acc]), tuple(acc_tangents)
  )
  return list(extra), list(extra_tangents)


def _accumulator_cotangents(body, n_acc, n_out, saved, extra_cts):
  """The cotangents of the accumulators entering a ``custom_vjp`` call:
  the transpose of :func:`_extra_outputs`' accumulator tangents (the body's
  own values held fixed), at the call's inputs ``saved``."""
  _, pullback = jax.vjp(_folds(body, n_acc, n_out, saved), *saved[:n_acc])
  return pullback([_jax.instantiate_zeros(ct) for ct in extra_cts])


class _Body(tp.NamedTuple):
  """A custom call's body rewritten by :func:`_intervened_body`."""

  jaxpr: tp.Any  # the rewritten body, a ClosedJaxpr
  extra: list  # what it takes beyond the call's operands
  ordered: tp.Callable  # [*operands, *extra] in the order the body takes
  in_loops: tp.Callable  # args -> the enclosing loops' indices restored
  scope: tp.Callable  # args -> the injector of the body's scope
  entry_names: frozenset  # the names replaced by array entries in it
  in_a_loop: bool  # whether a loop encloses the call


def _intervened_body(injector, closed, n_orig) -> _Body:
  """The rewritten body of a custom call and what it takes beyond the
  call's ``n_orig`` operands.

  ``extra`` is the replacements, the body's constants (tracers a callable
  closes over, such as the row index of an enclosing ``scan`` body) and the
  row indices of the enclosing loops: passed as operands, since JAX traces
  the custom rules later, when the trace they belong to may be gone.
  ``ordered(args)`` puts the call's ``[*operands, *extra]`` in the order
  the body takes them; ``in_loops(args)`` makes ``loop_indices()`` return
  the indices among them while a rule runs; ``scope(args)`` is the injector
  a rule is evaluated with: the callables, and the array entries of the
  body's sows (among ``args``), so a rule that runs the body gets them too.
  """
  new, reps, spec = one_scope(injector, closed)
  new, consts = hoisted(new)
  n_lead, n_consts = n_orig + len(reps), len(consts)
  frames = loop_index.snapshot()
  indices = loop_index.provided(frames)

  def ordered(args):
    args = list(args)
    return [*args[n_lead : n_lead + n_consts], *args[:n_lead]]

  def in_loops(args):
    # Where JAX traces the rule, the enclosing loops' indices are operands.
    return loop_index.restored(frames, list(args)[n_lead + n_consts :])

  # What the rules need later: the callables and the layout of the array
  # entries, not the entries (they may be tracers of this trace; the rules
  # get them among their operands).
  callables = injector.with_callables_only()

  def scope(args):
    return callables.inner(spec, list(args)[n_orig:n_lead])

  return _Body(
      new,
      [*reps, *consts, *indices],
      ordered,
      in_loops,
      scope,
      frozenset(name for name, *_ in spec),
      bool(frames),
  )


def _custom_jvp_intervene(injector, eqn, invals):
  p = eqn.params
  n_orig, n_out = len(invals), len(eqn.outvars)
  new, extra, ordered, in_loops, scope, _, _ = _intervened_body(
      injector, p['call_jaxpr'], n_orig
  )
  _, orig_jvp = eqn.primitive.get_bind_params(p)['subfuns']
  staging_key = injector.staging_key

  def fun(*args):
    return _jax.eval_closed(new, ordered(args))

  def jvp(*xs):
    primals, tangents = xs[: len(xs) // 2], xs[len(xs) // 2 :]
    rule_args = [*primals[:n_orig], *tangents[:n_orig]]
    if p['symbolic_zeros'] or staging_key is None:
      out = list(orig_jvp.call_wrapped(*rule_args))
    else:
      with in_loops(primals):
        out = _rule_with_replacements(
            scope(primals),
            orig_jvp.call_wrapped,
            rule_args,
            'custom_jvp_rule',
        )
    # The custom rule gives the tangents (a replacement inside has none);
    # the primal outputs are those of the body with its sows replaced.
    return [*_jax.eval_closed(new, ordered(primals)), *out[n_out:]]

  n_in = n_orig + len(extra)
  return _jax.custom_jvp_call_p.bind(
      *invals,
      *extra,
      subfuns=(
          _jax.wrap_init(fun, 'custom_jvp_intervene', n_in),
          _jax.wrap_init(jvp, 'custom_jvp_intervene_jvp', 2 * n_in),
      ),
      symbolic_zeros=p['symbolic_zeros'],
  )


def _rule_with_replacements(
    injector, rule, args, name: str, refused=frozenset()
) -> list:
  """The custom rule ``rule`` (a flat function) on ``args``, traced as
  ``intervene`` staged ``f`` and evaluated with ``injector`` (the scope of
  the body: its callables and its array entries).

  JAX runs a custom rule when the intervened function is differentiated
  (around ``intervene``). A rule that differentiates the sowing body
  (``jax.jvp`` or ``jax.vjp`` of it) then gets what it gets where the
  derivative is taken inside ``f``: a zero tangent at a sow replaced by an
  array, a derivative marker resolved with the callable of a sow replaced
  by one, and residuals computed from the replaced value.
  """
  with staging(injector.staging_key):
    closed = _jax.trace_to_closed_jaxpr(
        rule, [_jax.arg_type(a) for a in args], name
    )
  for site in sow_sites(closed.jaxpr):
    if site.name in refused and site.eqn.params['kind'] in VALUE_KINDS:
      raise ValueError(
          f'intervene: sow {site.name!r}{site.where} is replaced by an'
          ' array entry, and the `jax.custom_vjp` backward rule runs it'
          ' again (it differentiates the body), where the entry cannot'
          ' reach: its operands are only residuals and cotangents. Pass a'
          ' callable (values[name] = fn), or take the residuals in the'
          ' forward rule (fwd = jax.vjp(body, x)) and use them in the'
          ' backward rule.'
      )
  return eval_intervening(closed.jaxpr, closed.consts, args, injector)


collect_rules[_jax.custom_jvp_call_p] = _custom_jvp_capture


intervene_rules[_jax.custom_jvp_call_p] = _custom_jvp_intervene


construct_names[_jax.custom_jvp_call_p] = '`jax.custom_jvp`'


# ----------------------------------------------------------------------------
# custom_vjp: the primal body is rewritten; the forward rule is the original
# one plus the collected values (evaluated from the rewritten body), and the
# backward rule is the original one, given only the cotangents of the
# original outputs and returning zero cotangents for the accumulators.


def _custom_vjp_capture(collector: Collector, eqn: _jax.JaxprEqn, invals):
  p = eqn.params
  new_jaxpr, layout, acc_in = collector.prepare(p['call_jaxpr'])
  acc_avals = [_jax.typeof(x) for x in acc_in]
  n_acc, n_out, n_extra = len(acc_in), len(eqn.outvars), layout.num_extra
  _, orig_fwd, orig_bwd = eqn.primitive.get_bind_params(p)['subfuns']
  accepts_key = collector.accepts_key
  plain = functools.cache(lambda: without_staged_sows(new_jaxpr))  # as in jvp

  def fun(*args):
    return _jax.eval_closed(new_jaxpr, args)

  def fwd(*args):
    res_and_outs = _without_repeated_sows(
        accepts_key, layout, orig_fwd, args[2 * n_acc :], 'custom_vjp forward'
    )
    # The backward rule gives the accumulators their cotangents.
    return [*res_and_outs, *_folds(plain(), 0, n_out, args[::2])()]

  n_in = len(new_jaxpr.in_avals)
  # With accumulators entering the call, the call's inputs are residuals
  # too (forwarded, so JAX stores nothing more), for the accumulators'
  # cotangents: see _accumulator_cotangents.
  n_saved = n_in if n_acc else 0

  def bwd(*args):
    n_res = p['out_trees']()[1].num_leaves
    res, saved = args[:n_res], args[n_res : n_res + n_saved]
    cts = args[n_res + n_saved :]
    out = orig_bwd.call_wrapped(*res, *cts[: len(cts) - n_extra])
    if not n_acc:
      return [*(_jax.Zero(a.to_tangent_aval()) for a in acc_avals), *out]
    acc_cts = _accumulator_cotangents(
        plain(), n_acc, n_out, saved, cts[len(cts) - n_extra :]
    )
    return [*acc_cts, *out]

  def out_trees():
    out_tree, res_tree, input_fwds = p['out_trees']()
    shifted = [None if i is None else i + n_acc for i in input_fwds]
    if not n_saved:
      return out_tree, res_tree, shifted
    saved_tree = jax.tree_util.tree_structure([0] * n_saved)
    res_tree = jax.tree_util.treedef_tuple([res_tree, saved_tree])
    return out_tree, res_tree, [*shifted, *range(n_saved)]

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


def _custom_vjp_intervene(injector, eqn, invals):
  p = eqn.params
  n_orig, n_out = len(invals), len(eqn.outvars)
  new, extra, ordered, in_loops, scope, entry_names, in_a_loop = (
      _intervened_body(injector, p['call_jaxpr'], n_orig)
  )
  extra_avals = [_jax.typeof(x) for x in extra]
  _, orig_fwd, orig_bwd = eqn.primitive.get_bind_params(p)['subfuns']
  # The backward rule gets residuals and cotangents only: the callables.
  callables = injector.with_callables_only()

  def fun(*args):
    return _jax.eval_closed(new, ordered(args))

  def fwd(*args):
    if p['symbolic_zeros'] or callables.staging_key is None:
      res_and_outs = list(orig_fwd.call_wrapped(*args[: 2 * n_orig]))
    else:
      with in_loops(args[::2]):
        res_and_outs = _fwd_with_replacements(
            scope(args[::2]), orig_fwd, args[: 2 * n_orig]
        )
    outs = _jax.eval_closed(new, ordered(args[::2]))
    return [*res_and_outs[: len(res_and_outs) - n_out], *outs]

  def bwd(*args):
    if p['symbolic_zeros'] or callables.staging_key is None:
      cts = list(orig_bwd.call_wrapped(*args))
    else:
      # The loops' indices are not among the backward rule's operands.
      with (
          loop_index.no_index('a `jax.custom_vjp` backward rule')
          if in_a_loop
          else loop_index.restored([], [])
      ):
        cts = _bwd_with_replacements(
            callables, orig_bwd, args, entry_names
        )
    return [*cts, *(_jax.Zero(a.to_tangent_aval()) for a in extra_avals)]

  n_in = n_orig + len(extra)
  return _jax.custom_vjp_call_p.bind(
      *invals,
      *extra,
      subfuns=(
          _jax.wrap_init(fun, 'custom_vjp_intervene', n_in),
          _jax.wrap_init(fwd, 'custom_vjp_intervene_fwd', 2 * n_in),
          _jax.wrap_init(bwd, 'custom_vjp_intervene_bwd', 0),
      ),
      out_trees=p['out_trees'],
      symbolic_zeros=p['symbolic_zeros'],
  )


def _fwd_with_replacements(injector, orig_fwd, args) -> list:
  """The forward rule on ``args`` (``[primal, has tangent, ...]``), as
  :func:`_rule_with_replacements` evaluates a rule."""
  flags = list(args[1::2])

  def flat(*primals):
    return orig_fwd.call_wrapped(
        *[v for x, f in zip(primals, flags) for v in (x, f)]
    )

  return _rule_with_replacements(
      injector, flat, list(args[::2]), 'custom_vjp_fwd'
  )


def _bwd_with_replacements(injector, orig_bwd, args, refused) -> list:
  """The backward rule on ``args``, as :func:`_rule_with_replacements`
  evaluates a rule. The array entries of the names ``refused`` do not
  reach it (its operands are residuals and cotangents): a sow of one of
  them there is a ``ValueError``."""

  def flat(*xs):
    # Symbolic zeros (an input with no cotangent) as arrays of zeros.
    return [_jax.instantiate_zeros(ct) for ct in orig_bwd.call_wrapped(*xs)]

  return _rule_with_replacements(
      injector, flat, list(args), 'custom_vjp_bwd', refused
  )


collect_rules[_jax.custom_vjp_call_p] = _custom_vjp_capture


intervene_rules[_jax.custom_vjp_call_p] = _custom_vjp_intervene


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


def _remat_opt_capture(collector: Collector, eqn: _jax.JaxprEqn, invals):
  p = eqn.params
  new_jaxpr, layout, acc_in = collector.prepare(p['fwd_jaxpr'])
  fwd, consts = hoisted(new_jaxpr)
  outs = bind_remat_opt(fwd, [*consts, *acc_in, *invals], p['num_res'])
  return collector.split_outputs(layout, outs, len(eqn.outvars))


def _remat_opt_intervene(injector, eqn, invals):
  # The forward pass of ``custom_vjp(optimize_remat=True)`` under
  # differentiation: its sows see primal values and are replaced there.
  # See ``stage_vmap_rule`` for the parameters.
  new, reps = one_body(injector, eqn.params['fwd_jaxpr'])
  new, consts = hoisted(new)
  return bind_remat_opt(new, [*consts, *invals, *reps], eqn.params['num_res'])


def _remat_opt_partial_eval(default, trace, *tracers, **params):
  # JAX's partial evaluation computes a remat_opt with known inputs now; in
  # scan's loop-invariant hoisting (under ``checkpoint``) that is outside
  # the loop, where its sows would give one value for the whole loop. One
  # whose forward pass holds a staged sow is staged in the loop instead.
  if (
      staging_active()
      and hoisting_loop_invariants()
      and all(t.pval.is_known() for t in tracers)
      and holds_staged_sow(params['fwd_jaxpr'].jaxpr)
  ):
    tracers = [trace.instantiate_const(t) for t in tracers]
  return default(_jax.remat_opt_p, tracers, params)


_jax_patches.register('remat_opt_partial_eval', _remat_opt_partial_eval)


collect_rules[_jax.remat_opt_p] = _remat_opt_capture


intervene_rules[_jax.remat_opt_p] = _remat_opt_intervene


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
    # Staged as the capture stages (the vmap around it may batch the rule
    # after the capture returned), so the rule's sows are collectible.
    with staging(self.accepts_key):
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
    if got != expected or inner.reduced.by_name:
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


def _custom_vmap_capture(collector: Collector, eqn: _jax.JaxprEqn, invals):
  p = eqn.params
  new_jaxpr, layout, acc_in = collector.prepare(p['call'])
  call, consts = hoisted(new_jaxpr)
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


class _InterveningVmapRule:
  """The vmap rule of a ``custom_vmap_call`` whose body intervene rewrote.

  Batched, the user's ``rule`` runs instead of the body, and its sows are
  replaced by the callables of ``fns``, as under a ``jax.vmap`` inside
  ``intervene``. Array replacements (``n_reps`` trailing arguments) were laid
  out for the body's sows, so they are an error here.
  """

  def __init__(
      self, rule, in_tree, out_tree, n_lead, n_reps, fns, accepts_key, sites
  ):
    self.rule = rule
    self.in_tree = in_tree
    self.out_tree = out_tree
    self.n_lead = n_lead  # constants of the rewrite, before the arguments
    self.n_reps = n_reps
    self.fns = fns
    self.accepts_key = accepts_key
    self.sites = sites  # the replaced sites of the body, for errors

  def __str__(self):
    return str(self.rule)

  def __call__(self, axis_size, in_batched, *args):
    if self.n_reps:
      site = self.sites[0]
      raise NotImplementedError(
          f'intervene: sow {site.name!r}{site.where} is inside a'
          ' `jax.custom_batching.custom_vmap` function that `jax.vmap` maps'
          ' over from outside intervene, so its vmap rule runs instead of'
          ' the function, and an array replacement laid out for the'
          " function's sows cannot be matched to the rule's. Pass a callable"
          ' (values[name] = fn, applied to what the rule sows), or put the'
          ' vmap inside intervene.'
      )
    end = len(args) - self.n_reps
    flags = list(in_batched[self.n_lead : end])
    values = list(args[self.n_lead : end])
    closed, box = stage_vmap_rule(
        self.rule, self.in_tree, self.out_tree, axis_size, flags, values
    )
    injector = Injector(self.accepts_key, dict(self.fns), strict=False)
    outs = eval_intervening(closed.jaxpr, closed.consts, values, injector)
    return outs, box[-1]


def _custom_vmap_intervene(injector, eqn, invals):
  # Unbatched, the body runs with its sows replaced; batched, the user's
  # vmap rule runs, with the callables applied to its sows.
  p = eqn.params
  new, reps = one_body(injector, p['call'])
  new, consts = hoisted(new)
  sites = [
      s for s in sow_sites(p['call'].jaxpr) if injector.targets(s.eqn.params)
  ]
  rule = _InterveningVmapRule(
      p['rule'],
      p['in_tree'],
      p['out_tree'],
      len(consts),
      len(reps),
      injector.fns_in(p['call'].jaxpr),
      injector.accepts_key,
      sites,
  )
  return _jax.bind_custom_vmap(new, [*consts, *invals, *reps], rule)


# JAX's JVP of a ``custom_vmap_call`` runs the vmap rule under a vmap of its
# own (``custom_vmap_jvp``), which maps the arguments whose primal or
# tangent alone is batched and hands the others to the rule with their batch
# axis in place. Where it maps none of them, the rule's sows are already
# batched, so that vmap must not broadcast them again
# (:func:`rule_axis`); where it maps some, it is a vmap of the rule.


class _RuleAxes(threading.local):
  """The vmaps of JAX's JVP of ``custom_vmap`` rules running on this thread."""

  axes: tuple[tp.Any, ...] = ()


_RULE_AXES = _RuleAxes()


@contextlib.contextmanager
def rule_axis(axis_data):
  """Marks ``axis_data`` as the vmap of a ``custom_vmap`` rule's JVP.

  JAX differentiates a ``custom_vmap`` function's vmap rule under a vmap of
  its own (``custom_vmap_jvp``) that maps the arguments whose primal or
  tangent alone is batched. ``constructs/custom.py`` marks it only where it
  maps none of the rule's arguments: the rule then received each with its
  batch axis in place (or unbatched), so what it sows is its value as it
  sows it, and is not broadcast.
  """
  outer = _RULE_AXES.axes
  _RULE_AXES.axes = (*outer, axis_data)
  try:
    yield
  finally:
    _RULE_AXES.axes = outer


def _unmapped_on_rule_axis(axis_data, dims) -> bool:
  """Whether the value does not vary over the vmap of a ``custom_vmap``
  rule's JVP (``rule_axis``): the rule's value, as it sows it."""
  on_rule_axis = any(a is axis_data for a in _RULE_AXES.axes)
  return on_rule_axis and all(d is None for d in dims)


def _rule_axis_batch(core_batch, axis_data, leaves, dims, **params):
  # A sow of a value that does not vary over the vmap of a ``custom_vmap``
  # rule's JVP stays as the rule sows it.
  if _unmapped_on_rule_axis(axis_data, dims):
    outs = sow_p.bind(*leaves, **params)
    return outs, [None] * len(outs)
  return core_batch(axis_data, leaves, dims, **params)


_core_sow_batch = _jax.fancy_primitive_batchers[sow_p]
_jax.fancy_primitive_batchers[sow_p] = functools.partial(
    _rule_axis_batch, _core_sow_batch
)



class _RuleUnderJvp:
  """A ``custom_vmap`` rule that JAX's JVP runs under its own vmap."""

  def __init__(self, rule):
    self.rule = rule
    self.__name__ = getattr(rule, '__name__', str(rule))

  def __str__(self):
    return str(self.rule)

  def __call__(self, axis_size, in_batched, *args):
    trace = _jax.enclosing_batch_trace(axis_size)
    if not any(_jax.mapped_by(trace, x) for x in jax.tree.leaves(args)):
      # The vmap maps nothing: the rule got every argument with its batch
      # axis in place (or unbatched), and sows as under a vmap of it.
      with rule_axis(trace.axis_data):
        return self.rule(axis_size, in_batched, *args)
    # The vmap maps what the rule got unbatched: a vmap of the rule, whose
    # sows are batched as under any vmap, unless other arguments came with
    # their batch axis in place, which a sown value cannot tell apart.
    before = sows_bound()
    outs = self.rule(axis_size, in_batched, *args)
    if any(jax.tree.leaves(in_batched)) and sows_bound() != before:
      raise NotImplementedError(
          f'sow {last_sow_bound()!r}: the vmap rule of a'
          ' `jax.custom_batching.custom_vmap` function sows under `jax.jvp`'
          ' where some arguments are batched in both primal and tangent and'
          ' others in only one of them; JAX'
          ' then maps the rule over the latter, and a sown value cannot'
          ' tell its batch axis apart. Batch the primal and the tangent'
          ' alike (jax.vmap over both), or sow outside the rule.'
      )
    return outs


def _custom_vmap_jvp(original, primals, tangents, *, rule, **params):
  if staging_active():  # else no sow in the rule is collectible
    rule = _RuleUnderJvp(rule)
  return original(primals, tangents, rule=rule, **params)


_jax_patches.register('custom_vmap_jvp', _custom_vmap_jvp)


collect_rules[_jax.custom_vmap_p] = _custom_vmap_capture


intervene_rules[_jax.custom_vmap_p] = _custom_vmap_intervene


construct_names[_jax.custom_vmap_p] = '`jax.custom_batching.custom_vmap`'
