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


"""``lax.while_loop`` (also ``fori_loop`` with traced bounds).

What a sow inside does:

* **Capture**: a reduced name becomes an extra carry; a plain name raises,
  since the number of entries is not known when the program is staged.
* **Intervene**: a callable replacement is applied in the body; an array
  replacement raises (there is no row per iteration to feed).
* **Under ``jax.checkpoint``**: JAX recomputes a ``while_loop`` whole; the
  recomputed copy's sows become remat copies (collected nowhere), as a bare
  sow's own rule does. A ``custom_jvp``/``custom_vjp`` call in the body that
  holds a staged sow is recomputed too (a loop body can save no residual);
  only the known loop collects.
* **Under ``jax.linearize``/``jax.jvp``**: JAX runs the known part of the
  loop and stages the whole loop again into the linear function; where the
  known loop runs, the staged loop's sows become remat copies, so applying
  the linear function (once or many times) collects nothing more.
"""

from __future__ import annotations

import collections


from flax.nnx.sow import _jax
from flax.nnx.sow import loop_index
from flax.nnx.sow import _jax_patches
from flax.nnx.sow.collect import Collector
from flax.nnx.sow.collect import cached
from flax.nnx.sow.collect import collect_rules
from flax.nnx.sow.constructs.adapter import carries_moved
from flax.nnx.sow.constructs.adapter import hoisted
from flax.nnx.sow.constructs.adapter import with_unused_inputs
from flax.nnx.sow.inject import intervene_rules
from flax.nnx.sow.primitive import HIDDEN
from flax.nnx.sow.primitive import MARKER_KINDS
from flax.nnx.sow.sites import construct_names
from flax.nnx.sow.sites import holds_staged_sow
from flax.nnx.sow.sites import remat_copy_eqn
from flax.nnx.sow.sites import edit_sows
from flax.nnx.sow.sites import sow_sites
from flax.nnx.sow.sites import without_staged_sows

# ----------------------------------------------------------------------------
# while


def bind_while(eqn: _jax.JaxprEqn, invals, cond, body, *, carry=()):
  """``eqn``'s ``while`` bound again with ``cond``, ``body`` and extra
  carries.

  The binders both rules add, as checkify threads its error value through
  the loop: a capture carries accumulators, which the predicate ignores.
  The constants of ``cond`` and ``body`` become their leading consts
  (:func:`hoisted`).

  Args:
    eqn: the ``while`` equation.
    invals: its operands, ``[*cond consts, *body consts, *carries]``.
    cond: the predicate, taking ``[*cond consts, *carries]``.
    body: taking ``[*extra carries, *body consts, *carries]`` and returning
      ``[*carries, *extra carries]`` (the order of :meth:`Collector.rewrite`).
    carry: the extra carries' initial values.

  Returns:
    ``(outputs, extra carries out)``.
  """
  p = eqn.params
  n_cc, n_bc = p['cond_nconsts'], p['body_nconsts']
  if carry:
    avals = tuple(_jax.typeof(x) for x in carry)
    body = carries_moved(body, n_bc, len(carry))
    cond = cached(
        cond,
        ('while_cond', n_cc, avals),
        lambda: with_unused_inputs(cond, avals, n_cc),
    )
  cond, cond_hoisted = hoisted(cond)
  body, body_hoisted = hoisted(body)
  outs = _jax.while_p.bind(
      *cond_hoisted,
      *invals[:n_cc],
      *body_hoisted,
      *invals[n_cc : n_cc + n_bc],
      *carry,
      *invals[n_cc + n_bc :],
      **dict(
          p,
          cond_jaxpr=cond,
          body_jaxpr=body,
          cond_nconsts=len(cond_hoisted) + n_cc,
          body_nconsts=len(body_hoisted) + n_bc,
      ),
  )
  return outs[len(carry) :], outs[: len(carry)]


def _while_capture(collector: Collector, eqn: _jax.JaxprEqn, invals):
  cond, body = eqn.params['cond_jaxpr'], eqn.params['body_jaxpr']
  _check_collectible(collector, cond, body)
  # A predicate that varies over mesh axes (inside shard_map) makes every
  # accumulator the loop carries vary over them.
  specs = collector.reduced.vary(
      collector.reduced.specs([body]), _jax.varying_axes(cond.out_avals[0])
  )
  # [acc, bconsts, carry] -> [carry, acc]
  rewritten, layout = collector.rewrite(body, specs)
  acc_in = collector.reduced.leaves(specs)
  outs, acc_out = bind_while(eqn, invals, cond, rewritten, carry=acc_in)
  collector.absorb(layout, acc_out)
  return outs


def _check_collectible(collector: Collector, cond, body) -> None:
  """Raises for a sow the capture cannot collect in a ``while_loop``: one in
  ``cond_fun``, a plain one, or a reduced one under a batched predicate."""
  in_cond = collector.accepted_sites([cond])
  if in_cond:
    raise ValueError(
        f'sow {in_cond[0].name!r}{in_cond[0].where}: capture cannot collect'
        ' a sow inside the'
        ' cond_fun of `lax.while_loop`; sow the value in body_fun instead.'
    )
  # A perturb's forward marker collects nothing (reverse mode cannot
  # differentiate a while_loop, so no cotangent ever arrives there).
  collecting = [
      s for s in collector.accepted_sites([body]) if s.kind not in MARKER_KINDS
  ]
  plain = [s for s in collecting if s.reduction is None]
  if plain:
    raise _plain_in_while_error(plain[0])
  if cond.out_avals[0].shape and collecting:
    site = collecting[0]
    raise NotImplementedError(
        f'sow {site.name!r}{site.where}: a reduced sow'
        ' inside `lax.while_loop` whose predicate `jax.vmap` batches (inside'
        ' the capture) cannot be collected: the loop runs until every'
        ' example is done, so the reduction would also count finished'
        ' examples. Put the vmap around the capture (jax.vmap(capture(f))).'
    )


def _plain_in_while_error(site) -> ValueError:
  """The error for a plain name (a sown value or a ``perturb``'s cotangent)
  in a ``while_loop`` body, whose entries cannot be stacked."""
  if site.kind == 'cotangent':
    return ValueError(
        f'perturb {site.name!r}{site.where}: it is differentiated inside the'
        ' body of `lax.while_loop` (or a `fori_loop` with traced bounds), so'
        ' its cotangents cannot be collected: the number of iterations is not'
        ' known when the program is staged, and a cotangent is not reduced.'
        ' Use `lax.scan` or a `fori_loop` with static bounds for the loop,'
        ' or call perturb outside the loop.'
    )
  return ValueError(
      f'sow {site.name!r}{site.where}: a plain sow inside `lax.while_loop`'
      ' (or a `fori_loop` with traced bounds) cannot be collected, because'
      ' the number of iterations is not known when the program is staged.'
      ' Pass reduce_fn and init_fn to reduce the values into one accumulator'
      ' (e.g. reduce_fn=lambda acc, v: acc + v, init_fn=lambda:'
      ' jnp.zeros(shape)), or use `lax.scan` / a fori_loop with static'
      ' bounds to stack them.'
  )


def _while_intervene(injector, eqn, invals):
  p = eqn.params
  for key in ('cond_jaxpr', 'body_jaxpr'):
    counts = injector.consumed(p[key].jaxpr)
    if any(counts.values()):
      name = next(n for n, c in counts.items() if c)
      site = next(s for s in sow_sites(p[key].jaxpr) if s.name == name)
      raise ValueError(
          f'intervene: sow {name!r}{site.where} is inside `lax.while_loop`'
          ' (or a fori_loop with traced bounds), whose number of iterations'
          ' is not known, so values[name] cannot be a tuple of arrays. Pass'
          ' a callable (values[name] = fn, applied at every iteration).'
      )
  with loop_index.no_index('`lax.while_loop`'):
    cond = injector.rewrite(p['cond_jaxpr'], (), ())
    body = injector.rewrite(p['body_jaxpr'], (), ())
  outs, _ = bind_while(eqn, invals, cond, body)
  return outs


collect_rules[_jax.while_p] = _while_capture
intervene_rules[_jax.while_p] = _while_intervene
construct_names[_jax.while_p] = '`lax.while_loop`'


# ----------------------------------------------------------------------------
# while under remat: the recomputed copy collects nothing.
#
# ``jax.checkpoint``'s partial evaluation of a ``while_loop``
# (``_while_partial_eval_custom``) keeps the known loop and stages the whole
# equation again for the recomputation, sows included, so a sow in the body
# would be collected twice. Where a known loop runs, the staged copy's sows
# become remat copies (collected nowhere), as ``sow_p``'s own rule does.
#
# A ``custom_jvp``/``custom_vjp`` call in the body needs one step more. It has
# no partial-evaluation rule: JAX's default runs a known effectful equation
# once and saves its outputs rather than recompute it, which is right for a
# call holding a staged sow anywhere but in a ``while_loop`` body, which can
# save nothing (JAX's rule asserts it has no residual). So while JAX's rule
# runs, the staged sows in such calls are hidden (``remat_copy=HIDDEN``: no
# effect, collected by nothing) and JAX recomputes the calls as pure
# equations; in the known loop it returns they collect again, and in the
# staged one they are remat copies, so each is collected once.


def _hide_in_custom_calls(params: dict, in_custom_call: bool) -> dict | None:
  if in_custom_call and params['effect'] and not params['remat_copy']:
    return dict(params, remat_copy=HIDDEN)
  return None


def _unhide(params: dict, in_custom_call: bool) -> dict | None:
  del in_custom_call
  if params['remat_copy'] == HIDDEN:
    return dict(params, remat_copy=False)
  return None


def _while_partial_eval_custom(jax_rule, saveable, unks_in, inst_in, eqn):
  hidden = edit_sows(eqn, _hide_in_custom_calls, False)
  if hidden is eqn:
    # No custom call with a staged sow in the loop: JAX's rule, then the
    # staged copy's sows become remat copies.
    known, staged, *rest = jax_rule(saveable, unks_in, inst_in, eqn)
    if (
        known is not None
        and staged is not None
        and any(
            holds_staged_sow(j) for j in _jax.jaxprs_in_params(staged.params)
        )
    ):
      staged = remat_copy_eqn(staged)
    return (known, staged, *rest)
  known, staged, *rest = jax_rule(saveable, unks_in, inst_in, hidden)
  if known is None:
    # JAX stages the whole loop (it runs once, later): it collects there.
    return (known, None if staged is None else eqn, *rest)
  known = edit_sows(known, _unhide, False)
  if staged is not None:
    staged = remat_copy_eqn(staged)
  return (known, staged, *rest)


_jax_patches.register('while_remat_rule', _while_partial_eval_custom)


# ----------------------------------------------------------------------------
# while under linearize: the staged copy collects nothing.
#
# ``jax.linearize`` (and ``jax.jvp`` of a partially known loop) splits a
# ``while_loop`` with JAX's ``_while_partial_eval``: it runs the known part of
# the loop now and stages the whole loop again, primal and tangent, into the
# linear function, so a sow in the body would be collected again each time
# the linear function is applied. Where the known loop runs, the staged
# loop's sows become remat copies.


def _known_body(tracers, params) -> _jax.ClosedJaxpr | None:
  """The body of the known loop JAX's rule runs (the carries that do not
  depend on unknown inputs, with a known predicate), or ``None`` if it runs
  none."""
  unknowns = [not t.pval.is_known() for t in tracers]
  if all(unknowns) or not any(unknowns):
    return None
  n_cc, n_bc = params['cond_nconsts'], params['body_nconsts']
  cond_uk, body_uk = unknowns[:n_cc], unknowns[n_cc : n_cc + n_bc]
  carry_uk = unknowns[n_cc + n_bc :]
  for _ in range(1 + len(carry_uk)):
    known, _, out_uk, _ = _jax.partial_eval_jaxpr_nounits(
        params['body_jaxpr'], body_uk + carry_uk, instantiate=carry_uk
    )
    if out_uk == carry_uk:
      break
    carry_uk = [a or b for a, b in zip(carry_uk, out_uk)]
  *_, [pred_uk], _ = _jax.partial_eval_jaxpr_nounits(
      params['cond_jaxpr'], cond_uk + carry_uk, instantiate=False
  )
  return None if pred_uk else known


def _staged_sow_names(jaxpr: _jax.Jaxpr) -> collections.Counter:
  """How many staged (collectible) sows of each name ``jaxpr`` holds."""
  return collections.Counter(
      s.name for s in sow_sites(jaxpr) if s.eqn.params['effect']
  )


def _while_partial_eval(jax_rule, trace, *tracers, **params):
  body = params['body_jaxpr']
  if not holds_staged_sow(body.jaxpr):
    return jax_rule(trace, *tracers, **params)
  known = _known_body(tracers, params)
  if known is None:
    return jax_rule(trace, *tracers, **params)
  in_known = _staged_sow_names(known.jaxpr)
  if not in_known:
    # The sows read unknown carries (or scan's hoisting keeps them in the
    # loop): only the staged loop runs them.
    return jax_rule(trace, *tracers, **params)
  if in_known != _staged_sow_names(body.jaxpr):
    name = next(iter(_staged_sow_names(body.jaxpr) - in_known))
    raise NotImplementedError(
        f'sow {name!r}: inside a `lax.while_loop` that JAX splits into a'
        ' known and a staged part (jax.linearize or jax.jvp with some'
        ' carries known), some of its sows read known values and others'
        ' unknown ones, so the capture cannot collect each once. Sow values'
        ' that depend on the same carries, or sow after the loop.'
    )
  default = trace.default_process_primitive

  def staged_copy(primitive, tracers_, params_):
    if primitive is _jax.while_p:
      params_ = dict(
          params_,
          body_jaxpr=without_staged_sows(params_['body_jaxpr']),
          cond_jaxpr=without_staged_sows(params_['cond_jaxpr']),
      )
    return default(primitive, tracers_, params_)

  trace.default_process_primitive = staged_copy
  try:
    return jax_rule(trace, *tracers, **params)
  finally:
    del trace.default_process_primitive


_jax_patches.register('while_partial_eval', _while_partial_eval)
