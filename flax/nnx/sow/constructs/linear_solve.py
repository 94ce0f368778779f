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


"""``lax.custom_linear_solve``: what a sow inside it does.

The primitive holds four functions: ``matvec`` (the linear map ``A``),
``solve`` (returns ``x`` with ``A x = b``), and, when given (or
``symmetric=True``), ``vecmat`` and ``transpose_solve`` (the same for the
transpose). Evaluating the primitive runs ``solve`` only; JAX runs
``matvec`` and ``solve`` again on tangents under differentiation, and
``vecmat``/``transpose_solve`` on cotangents.

* A sow inside ``solve`` is collected once per primal solve, with its primal
  value. The capture adds what ``solve`` collects as extra auxiliary outputs
  of ``solve`` (JAX's ``has_aux`` path: zero tangents, batched under
  ``vmap``) and the accumulators of reduced names as extra constants of
  ``solve``; ``transpose_solve`` returns zeros in their place, as JAX
  requires the same auxiliary outputs from both. ``intervene`` passes the
  replacements as extra constants of ``solve``.
* Differentiated around the capture or intervene, collected values get
  zero tangents (``custom_linear_solve`` defines the derivative of ``x``
  only). A solve whose ``solve`` intervene replaces a sow in is bound in a
  ``custom_jvp`` that solves tangents with the original ``solve`` (JAX's
  rule would run the replaced one on them), so replacements get a zero
  gradient and forward and reverse mode agree. Differentiated
  inside (``jvp``/``grad``/``linearize`` applied by ``f``), JAX's JVP rule
  binds ``solve`` again on tangents with the very same functions, a copy no
  rule can tell from the primal solve: a sow in ``solve`` that the capture
  or intervene takes there raises ``NotImplementedError``. The rules know
  the solve is differentiated from the ``jvp`` transform its equation (or
  one holding it) records in its name stack (``collect.differentiated``).
* A sow in ``matvec``, ``vecmat`` or ``transpose_solve`` is never run on
  primal values, so nothing can be collected from it. A sow there that is
  also in ``solve`` (``solve`` calls ``matvec``; ``symmetric=True`` traces
  ``solve`` again as ``transpose_solve``) is that copy and ignored; any
  other raises ``NotImplementedError`` naming it. The capture and intervene
  rules decide this for each equation they rewrite, and
  ``sites.counted_jaxprs`` tells the rules of the constructs around it
  (a ``jit`` counting the entries its body consumes) that only the sows of
  ``solve`` count, so each sow counts once.
* JAX's transposition binds the solve with its functions swapped
  (``jaxprs.transpose()``), so ``solve`` then holds the function traced as
  ``transpose_solve``, run on cotangents. Each jaxpr records the function it
  was traced for (``debug_info.traced_for``); an equation whose ``solve``
  was traced as ``transpose_solve`` runs no sow on primal values, and a sow
  a capture or intervene takes there (``jax.linear_transpose`` of a
  function that calls ``custom_linear_solve``) raises
  ``NotImplementedError`` naming it.
"""

from __future__ import annotations


import jax
import jax.numpy as jnp

from flax.nnx.sow import _jax
from flax.nnx.sow.collect import Collector
from flax.nnx.sow.collect import cached
from flax.nnx.sow.collect import collect_rules
from flax.nnx.sow.collect import differentiated
from flax.nnx.sow.constructs.adapter import hoisted
from flax.nnx.sow.constructs.adapter import permuted
from flax.nnx.sow.inject import intervene_rules
from flax.nnx.sow.inject import one_body
from flax.nnx.sow.inject import program_checks
from flax.nnx.sow.sites import construct_names
from flax.nnx.sow.sites import counted_jaxprs
from flax.nnx.sow.sites import sow_sites
from flax.nnx.sow.sites import without_staged_sows

_NAME = '`lax.custom_linear_solve`'
_OTHERS = ('matvec', 'vecmat', 'transpose_solve')
# What JAX's ``custom_linear_solve`` records as the ``traced_for`` of the
# jaxprs it traces for ``vecmat`` and ``transpose_solve``.
_TRACED_AS_TRANSPOSE = 'custom_linear_solve transpose_solve'


def _solve_runs(jaxprs) -> bool:
  """Whether the ``solve`` of an equation is the function traced as
  ``solve``, not the ``transpose_solve`` that JAX's transposition swaps in
  (a jaxpr that records no ``traced_for`` is taken for its field's)."""
  info = jaxprs.solve.jaxpr.debug_info
  return getattr(info, 'traced_for', None) != _TRACED_AS_TRANSPOSE


def _counted(params) -> list[_jax.Jaxpr]:
  """The jaxpr traced as ``solve``, wherever the equation holds it
  (``sites.counted_jaxprs``): its sows are the ones the equation counts; in a
  transposed equation, for the rules to refuse."""
  jaxprs = params['jaxprs']
  if _solve_runs(jaxprs) or jaxprs.transpose_solve is None:
    return [jaxprs.solve.jaxpr]
  return [jaxprs.transpose_solve.jaxpr]


def _check_transposed(jaxprs, takes) -> None:
  """Raises for a sow ``takes`` accepts in an equation JAX transposed."""
  if _solve_runs(jaxprs):
    return
  for closed in jaxprs:
    if closed is None:
      continue
    for site in sow_sites(closed.jaxpr):
      if takes(site):
        raise NotImplementedError(
            f'sow {site.name!r}{site.where} is inside a function of {_NAME}'
            ' that JAX runs transposed here (`jax.linear_transpose` of a'
            ' function that calls `custom_linear_solve`: it solves with'
            ' `transpose_solve` on cotangents), never on the primal values,'
            ' so a capture or intervene cannot give it a value. Sow the'
            ' inputs or the result of `custom_linear_solve` outside it.'
        )


def _check_differentiated(jaxprs, takes, jvped: bool | None = None) -> None:
  """Raises for a sow ``takes`` accepts in ``solve`` where ``f``
  differentiates the solve inside the capture or ``intervene`` (``jvped``;
  by default as ``collect.differentiated`` says)."""
  if not (differentiated() if jvped is None else jvped):
    return
  for site in sow_sites(jaxprs.solve.jaxpr):
    if takes(site):
      raise NotImplementedError(
          f'sow {site.name!r}{site.where} is inside the `solve` function of'
          f' {_NAME}, which is differentiated (`jax.jvp`, `grad`, `vjp` or'
          ' `linearize`) inside the capture or intervene. JAX'
          " differentiates the solve implicitly: its JVP rule binds `solve`"
          ' again on tangents with the same functions, and that copy cannot'
          ' be told from the primal solve, so its values would be collected'
          ' (or replaced) as if they were primal ones. Differentiate a'
          ' function that calls the capture or intervene instead (as'
          ' `jax.value_and_grad(loss, has_aux=True)` of a `loss` that calls'
          ' `capture(f)` and returns `(value, collected)`), or sow the'
          ' inputs or the result of `custom_linear_solve` outside it. (JAX'
          ' change that would lift this: a JVP rule that marks the jaxprs it'
          ' binds again on tangents; see docs/upstream.md.)'
      )


def _check_program(jaxpr: _jax.Jaxpr, takes, jvped: bool = False) -> None:
  """Raises for every equation of ``jaxpr`` (and its sub-jaxprs) that
  :func:`_check_differentiated` refuses; ``intervene`` runs it on the
  program it stages before counting entries (``inject.program_checks``)."""
  for eqn in jaxpr.eqns:
    now = jvped or _jax.transforms_in(eqn.source_info.name_stack, 'jvp') > 0
    if eqn.primitive is _jax.linear_solve_p:
      if now:
        _check_differentiated(eqn.params['jaxprs'], takes, True)
      continue
    for sub in _jax.jaxprs_in_params(eqn.params):
      _check_program(sub, takes, now)


def _copies_in_solve(jaxprs):
  """The (name, call site) of every sow in ``solve``."""
  return {(s.name, s.where) for s in sow_sites(jaxprs.solve.jaxpr)}


def _check_other_functions(jaxprs, takes) -> None:
  """Raises for a sow ``takes`` accepts in a function other than ``solve``
  that is not a copy of one in ``solve`` (same name, same call site)."""
  in_solve = _copies_in_solve(jaxprs)
  for field in _OTHERS:
    closed = getattr(jaxprs, field)
    if closed is None:
      continue
    for site in sow_sites(closed.jaxpr):
      if takes(site) and (site.name, site.where) not in in_solve:
        raise NotImplementedError(
            f'sow {site.name!r}{site.where} is inside the `{field}` function'
            f' of {_NAME}, which JAX runs only on tangents or cotangents'
            ' (to differentiate or batch the solve), never on the primal'
            ' values, so a capture or intervene cannot give it a value. Sow'
            ' inside `solve`, or sow the inputs or the result of'
            ' `custom_linear_solve` outside it.'
        )


def _others_without_sows(jaxprs):
  """``jaxprs`` with every staged sow outside ``solve`` a remat copy."""
  return jaxprs._replace(
      **{
          f: without_staged_sows(getattr(jaxprs, f))
          for f in _OTHERS
          if getattr(jaxprs, f) is not None
      }
  )


def _with_zero_outputs(closed: _jax.ClosedJaxpr, avals) -> _jax.ClosedJaxpr:
  """``closed`` returning zeros of ``avals`` after its own outputs (cached)."""
  avals = tuple(avals)

  def build():
    def fn(*args):
      outs = _jax.eval_closed(closed, args)
      return [*outs, *(jnp.zeros(a.shape, a.dtype) for a in avals)]

    return _jax.trace_to_closed_jaxpr(
        fn, _jax.binder_types(closed), 'linear_solve_transpose_zeros'
    )

  return cached(closed, ('linear_solve_zeros', avals), build)


def _with_solve_consts(eqn, invals, before, after=(), **jaxprs):
  """Binds ``eqn`` with ``before`` and ``after`` around ``solve``'s constants
  and ``jaxprs`` replacing its functions."""
  lengths, old = eqn.params['const_lengths'], eqn.params['jaxprs']
  at = lengths.matvec + lengths.vecmat
  end = at + lengths.solve
  args = [*invals[:at], *before, *invals[at:end], *after, *invals[end:]]
  lengths = lengths._replace(solve=lengths.solve + len(before) + len(after))
  return _jax.linear_solve_p.bind(
      *args, const_lengths=lengths, jaxprs=old._replace(**jaxprs)
  )


# ----------------------------------------------------------------------------
# Capture: [*consts, *accumulators, *solve_consts, *b]
#   -> [*x, *aux, *entries, *accumulators]


def _linear_solve_capture(collector: Collector, eqn: _jax.JaxprEqn, invals):
  jaxprs = eqn.params['jaxprs']
  takes = lambda s: collector.accepts(s.tag, s.reduction, s.kind, s.name)
  _check_transposed(jaxprs, takes)
  _check_differentiated(jaxprs, takes)
  _check_other_functions(jaxprs, takes)
  new_solve, layout, acc_in = collector.prepare(jaxprs.solve)
  new_solve, consts = hoisted(new_solve)
  others = _others_without_sows(jaxprs)
  changes = dict(solve=new_solve)
  if others.transpose_solve is not None:
    extra = new_solve.out_avals[len(eqn.outvars) :]
    changes['transpose_solve'] = _with_zero_outputs(
        others.transpose_solve, extra
    )
  outs = _with_solve_consts(
      eqn,
      invals,
      [*consts, *acc_in],
      matvec=others.matvec,
      vecmat=others.vecmat,
      **changes,
  )
  return collector.split_outputs(layout, outs, len(eqn.outvars))


# ----------------------------------------------------------------------------
# Intervene: [*consts, *solve_consts, *replacements, *b] -> [*x, *aux]


def _linear_solve_intervene(injector, eqn, invals):
  jaxprs = eqn.params['jaxprs']
  takes = lambda s: injector.targets(s.eqn.params)
  _check_transposed(jaxprs, takes)
  _check_differentiated(jaxprs, takes)
  _check_other_functions(jaxprs, takes)
  n_consts = eqn.params['const_lengths'].solve
  new, reps = one_body(injector, jaxprs.solve)
  new, consts = hoisted(new)
  # [*consts, *solve_consts, *b, *reps] -> [..., *solve_consts, *reps, *b]
  n_b = len(new.in_avals) - len(consts) - n_consts - len(reps)
  lead = len(consts) + n_consts
  order = [
      *range(lead),
      *range(lead + len(reps), lead + len(reps) + n_b),
      *range(lead, lead + len(reps)),
  ]
  new = cached(
      new,
      ('linear_solve_reps_first', lead, len(reps)),
      lambda: permuted(new, order, range(len(new.out_avals))),
  )
  others = _others_without_sows(jaxprs)
  bind = lambda invals, consts, reps: _with_solve_consts(
      eqn,
      invals,
      consts,
      reps,
      matvec=others.matvec,
      vecmat=others.vecmat,
      transpose_solve=others.transpose_solve,
      solve=new,
  )
  if not any(takes(s) for s in sow_sites(jaxprs.solve.jaxpr)):
    # What ``solve`` computes has a zero gradient under JAX's implicit rule;
    # stopped, as that rule fails where only these have tangents (it binds
    # symbolic zeros).
    return bind(invals, *jax.lax.stop_gradient((list(consts), list(reps))))
  return _with_original_tangents(eqn, others, bind)(
      list(invals), list(consts), list(reps)
  )


def _with_original_tangents(eqn, others, bind):
  """``bind`` (the equation with ``solve`` replaced) as a ``custom_jvp``
  whose tangents are the original equation's.

  JAX's JVP rule differentiates ``x`` implicitly, ``dx = A^-1 (db - dA x)``,
  and computes ``A^-1`` by binding ``solve`` again on tangents: with the
  replaced ``solve`` it would apply the replacement to the tangent. Here
  ``A^-1`` is the original ``solve`` (its sows copies no capture collects),
  as JAX's transposition uses the original ``transpose_solve``; ``x`` is the
  replaced solve's, so forward and reverse mode agree. Replacements and the
  constants of the rewrite get no tangent (zero gradient), as values
  ``solve`` computes do under JAX's rule.
  """
  lengths = eqn.params['const_lengths']
  n_matvec = lengths.matvec
  n_consts = sum(lengths)
  n_x = len(eqn.invars) - n_consts  # one ``x`` leaf per ``b`` leaf
  tangent_eqn = dict(
      eqn.params,
      jaxprs=others._replace(solve=without_staged_sows(others.solve)),
  )

  @jax.custom_jvp
  def replaced(invals, consts, reps):
    return bind(invals, consts, reps)

  @replaced.defjvp
  def replaced_jvp(primals, tangents):
    invals, consts, reps = primals
    # The primal through ``replaced`` itself: a derivative of this rule
    # (forward over forward) applies it again, not JAX's.
    outs = replaced(invals, consts, reps)
    x = outs[:n_x]
    matvec_consts, dots = invals[:n_matvec], tangents[0]
    _, dA_x = jax.jvp(
        lambda *c: _jax.eval_closed(others.matvec, [*c, *x]),
        matvec_consts,
        dots[:n_matvec],
    )
    rhs = [db - d for db, d in zip(dots[n_consts:], dA_x)]
    x_dot = _jax.linear_solve_p.bind(*invals[:n_consts], *rhs, **tangent_eqn)
    aux_dot = [_jax.zeros_like_tangent(a) for a in outs[n_x:]]
    return outs, [*x_dot[:n_x], *aux_dot]

  return replaced


collect_rules[_jax.linear_solve_p] = _linear_solve_capture


intervene_rules[_jax.linear_solve_p] = _linear_solve_intervene


construct_names[_jax.linear_solve_p] = _NAME


counted_jaxprs[_jax.linear_solve_p] = _counted


program_checks.append(_check_program)
