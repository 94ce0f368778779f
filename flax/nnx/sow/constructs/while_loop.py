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
* **Under ``jax.checkpoint``/``jax.linearize``/``jax.jvp``**: JAX keeps
  the known loop and stages the whole loop again; the copy's sows are
  collected nowhere (``partial_eval.py``).
"""

from __future__ import annotations



from flax.nnx.sow import _jax
from flax.nnx.sow import loop_index
from flax.nnx.sow.collect import Collector
from flax.nnx.sow.collect import cached
from flax.nnx.sow.collect import collect_rules
from flax.nnx.sow.constructs.adapter import carries_moved
from flax.nnx.sow.constructs.adapter import hoisted
from flax.nnx.sow.constructs.adapter import with_unused_inputs
from flax.nnx.sow.inject import intervene_rules
from flax.nnx.sow.primitive import MARKER_KINDS
from flax.nnx.sow.sites import construct_names
from flax.nnx.sow.sites import sow_sites

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
