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

"""The sow primitive: an identity on its operands that carries an effect.

``sow_p`` owns what a sow *is* in a staged program: its parameters (name, tag,
pytree structure, reduction), its abstract evaluation (the operands' avals plus
``SowEffect``, so dead-code elimination keeps a sow whose result is unused),
and its rules under JAX's transforms: identity lowering, a JVP that sows the
primal and passes the tangent through (except for a sow an ``intervene``
replaces while it stages: zero tangents, or the derivative markers its
rewrite resolves), and a batching rule that moves the mapped axis first. Collecting what was sown is ``capture``'s job
(``capturing.py``), not the primitive's.
"""

from __future__ import annotations

import dataclasses
import functools  # PR: perturb
import os
import threading  # PR: perturb
import typing as tp

import jax
import jax.numpy as jnp

from flax.nnx.sow import _jax
from flax.nnx.sow import name_hints  # PR: name_hints
from flax.nnx.sow import _jax_patches  # PR: eager

Name = tp.Union[str, tuple[tp.Union[str, int], ...]]


class SowEffect(_jax.Effect):
  """Marks a staged sow, so that an unused sow is not dead-code eliminated.

  Every instance is equal to every other, so that ``jax.export`` can
  serialize a program that still holds a staged sow (one a capture or an
  intervene leaves in place) and build the effect again when it reads it.
  """

  def __repr__(self):
    return 'Sow'

  def __eq__(self, other):
    return type(other) is SowEffect

  def __hash__(self):
    return hash(SowEffect)


sow_effect = SowEffect()
_jax.allow_effect(SowEffect)
# Errors name the user's line that called ``sow``, not this package's.
_jax.exclude_from_source_info(os.path.dirname(os.path.abspath(__file__)))


sow_p = _jax.Primitive('sow')
sow_p.multiple_results = True


# The parameters of a sow equation, besides ``sow_name`` (the name; not
# ``name``, which JAX's jaxpr printer takes for a jit's ``str`` name),
# ``tag``, ``treedef`` and ``reduction``:
#
# * ``kind``: ``'value'`` for ``sow``; ``'cotangent'`` for the cotangent a
#   ``perturb`` collects (in the backward pass, so in reverse order: a capture
#   puts such entries back in call order); ``'perturb'`` for ``perturb``'s
#   forward marker, which collects nothing but says where the name is first
#   used and gives the tangent its ``perturb_tangent_p``; ``'order'`` for a
#   marker that only says where a name is first used (``constructs/batched.py``);
#   ``'kept'`` and ``'hoisted'`` for the two halves of a plain sow that
#   ``intervene`` stages inside a construct ``jax.vmap`` batches
#   (``constructs/batched.py``): the ``'kept'`` sow stays where the value is,
#   so that ``intervene`` replaces it there, and no capture collects it; its
#   result is hoisted out of the construct and sown again after it, mapped
#   axis first, as ``'hoisted'``, which a capture collects as a value and no
#   ``intervene`` replaces (it did, at the kept sow). ``'jvp'`` and
#   ``'vjp'``, the *derivative markers*, for a derivative taken inside a
#   function that ``intervene`` stages, of a sow it replaces by a callable
#   (see ``_replaced_tangents``): a ``'jvp'`` marker takes ``[*tangents,
#   *primals]`` (the primals are the closure, ``n_closure`` of them) and
#   gives the tangent of the replacement at the sown value, linear in the
#   tangents; its transpose, the ``'vjp'`` marker, takes ``[*cotangents,
#   *primals]`` and gives the cotangent of the sown value. Both are
#   effect-free identities that no capture collects; intervene's rewrite
#   resolves them with the callable of this call (``inject.py``), never the
#   JVP rule, so a ``jax.jit`` traced once serves every callable.
# * ``batch_dims``: the leading axes that ``jax.vmap`` added to the value. A
#   capture folds a reduced sow's ``reduce_fn`` over them, so under vmap every
#   example is reduced into the one accumulator, as if ``f`` had run once per
#   example.
# * ``effect``: whether the sow carries ``SowEffect``: true for a sow staged
#   while a capture stages its function (see ``staging``), so that an unused
#   sow survives dead-code elimination until the capture collects it; false
#   otherwise, where nothing can collect it: the sow is then an ordinary
#   identity, removed by dead-code elimination and invisible to ``jax.jit``'s
#   dispatch (an effect would disable its C++ fast path).
# * ``n_closure``: the last ``n_closure`` operands are not sown: they are the
#   traced values a reduced sow's ``init_fn``/``reduce_fn`` close over
#   (``reductions.py``), carried to the capture as operands. The outputs are
#   the sown leaves only.
# * ``ordinal`` (only on a ``perturb``'s marker and its cotangent): a number that
#   grows with every ``perturb`` call traced (``api.py``), so that a
#   capture can tell the backward passes of one name apart and put their
#   cotangents in call order (``Collector.result``).
# * ``grad_of`` (only on the ``perturb`` marker of ``sow(..., grad=True)``):
#   the name of that sow. The marker's name holds the sow's gradient, not a
#   value, so ``intervene`` never replaces it (``inject.py``): the sow itself
#   is replaced under its own name.
# * ``differentiated`` (only on a ``perturb``'s marker, once its JVP rule
#   has routed its tangent): a ``jax.vmap`` around that differentiation
#   (``jax.jacfwd``, ``jax.vmap(jax.grad(f))``) leaves the marker unbatched
#   where its value is (its cotangents are batched where they are sown),
#   while one inside it broadcasts an unbatched value (``_sow_batch``).
# * ``loops_mapped`` (only on a ``perturb``'s marker that a ``jax.vmap``
#   broadcast, and on its cotangent): per leading mapped axis, the
#   ``lax.scan`` loops between that ``vmap`` and the marker that a capture
#   has not stacked yet (``with_loops_mapped``); ``pending_loops`` is that
#   count for the ``vmap`` batching the marker now. ``LOOPS_UNKNOWN`` on a
#   marker batched while no capture staged.
# * ``zero_tangent`` (only on a sow an ``intervene`` replaces by arrays, once
#   differentiated inside its function): its tangent was taken to be zero,
#   so the intervene must replace it (``Injector.on_sow``).
# * ``remat_copy``: the copy of a sow that partial evaluation leaves in a
#   rematerialised (recomputed) program: an identity without effect that no
#   capture collects, so a sow inside ``jax.checkpoint`` is collected once
#   and does not force its value to be saved as a residual. ``HIDDEN``
#   (``'hidden'``, truthy, so every reader treats it as a copy) marks a
#   staged sow hidden for the duration of one partial-evaluation rule of
#   ``while`` (``constructs/partial_eval.py``), which then makes it
#   collecting again or a copy; no jaxpr outside that rule holds it.

MARKER_KINDS = ('perturb', 'order')
JVP_MARKER = 'jvp'  # PR: intervene
VJP_MARKER = 'vjp'  # PR: intervene
DERIVATIVE_KINDS = (JVP_MARKER, VJP_MARKER)  # PR: intervene
KEPT = 'kept'  # PR: intervene
HOISTED = 'hoisted'  # PR: intervene
# What a capture collects as sown values.
VALUE_KINDS = ('value', HOISTED)  # PR: custom
# A ``remat_copy`` value, see above.
HIDDEN = 'hidden'  # PR: partial_eval

_STAGING = jax.make_user_context(())


def staging(accepts_key: tp.Any = None):
  """The context in which ``capture`` stages its function.

  Its value, the ``tags`` keys of the captures staging (outermost first), is
  part of JAX's tracing cache key, so a ``jax.jit`` traced inside a capture
  (effectful sows) is not reused outside one (effect-free sows), and back.
  The first staging installs the patch inventory (``_jax_patches.py``):
  importing the package replaces nothing in JAX.
  """
  _jax_patches.install()  # PR: eager
  return _STAGING((*_STAGING.value, accepts_key))


def staging_active() -> bool:
  return bool(_STAGING.value)


def staging_keys() -> tuple[tp.Any, ...]:  # PR: intervene
  """The keys of the transforms staging now, outermost first: a capture's
  ``tags`` key (``accepts``), or an ``intervene``'s."""
  return _STAGING.value


def collectible(params: dict[str, tp.Any]) -> bool:
  """Whether a capture may collect the sow equation with ``params``.

  A sow is collectible when it was bound while a capture or ``intervene``
  staged (``effect``) and is not a remat copy. A program JAX staged before,
  outside any capture (the linear function of a ``jax.linearize`` or the
  pullback of a ``jax.vjp`` called outside, a ``jax.make_jaxpr``) holds its
  sows inert: they may already have been removed by dead-code elimination,
  and what remains of them is JAX's recomputation of primal values (a
  ``while_loop`` staged again, a ``checkpoint``'s rematerialised custom
  call), so a capture that runs such a program collects nothing from it.
  """
  return bool(params['effect']) and not params['remat_copy']


PLAIN_SOWS = object()  # PR: loops
"""A ``Collector.accepts_key`` that takes every plain sow, whatever its tag.

Used to hoist plain sows out of a construct (``constructs/batched.py``).
"""


@dataclasses.dataclass(frozen=True)
class Selection:
  """The ``accepts_key`` of a capture that selects names (``names=``).

  ``tags`` is ``None`` (every tag) or a frozenset; ``names`` a frozenset of
  names or a callable ``name -> bool`` (in the key of one call, a
  ``name_keys.NameDecisions``, see ``sites.for_call``). A capture without
  ``names`` keeps its ``tags`` (``None`` or a frozenset) as its key.
  """

  tags: frozenset | None
  names: tp.Any

  def accepts_name(self, name: Name) -> bool:
    if isinstance(self.names, frozenset):
      if name not in self.names:
        name_hints.passed_over_name(name)  # PR: name_hints
        return False
      return True
    return bool(self.names(name))


def tags_of(accepts_key) -> frozenset | None:
  """The tags a capture's ``accepts_key`` takes (``None``: every tag)."""
  if isinstance(accepts_key, Selection):
    return accepts_key.tags
  return accepts_key


def accepts(
    accepts_key: frozenset | Selection | None | object,
    tag: tp.Hashable,
    reduction: tp.Any,  # a reductions.Reduction, or None
    kind: str = 'value',
    name: Name | None = None,
) -> bool:
  """Whether a capture with ``accepts_key`` collects a sow of ``tag`` and
  ``name``."""
  if kind == KEPT or kind in DERIVATIVE_KINDS:  # PR: intervene
    # Left in place for ``intervene``: a kept sow's value is collected from
    # the ``'hoisted'`` copy (``constructs/batched.py``); a derivative
    # marker is a tangent or cotangent, resolved by the intervene.
    return False
  if accepts_key is PLAIN_SOWS:  # PR: loops
    # Hoisting moves values; markers stay where they are (a perturb marker
    # must meet the JVP there).
    return reduction is None and kind not in MARKER_KINDS
  if accepts_key is None:
    return True
  if isinstance(accepts_key, Selection):
    return (
        accepts_key.tags is None or tag in accepts_key.tags
    ) and accepts_key.accepts_name(name)
  return tag in accepts_key


class _Bound(threading.local):  # PR: custom
  """How many sows this thread has bound (see ``sows_bound``)."""

  count: int = 0
  last: Name | None = None  # the name of the last one


_BOUND = _Bound()  # PR: custom


def sows_bound() -> int:  # PR: custom
  """How many sows this thread has bound so far: a custom rule that binds
  none while it runs holds none (``constructs/custom.py``)."""
  return _BOUND.count


def last_sow_bound() -> Name | None:  # PR: custom
  """The name of the last sow this thread bound (for errors)."""
  return _BOUND.last


def bind_sow(
    leaves,
    *,
    name: Name,
    tag: tp.Hashable,
    treedef,
    reduction: tp.Any = None,  # a reductions.Reduction
    kind: str = 'value',
    batch_dims: int = 0,
    closure: tp.Sequence[tp.Any] = (),
    ordinal: int | None = None,  # PR: perturb
    grad_of: Name | None = None,  # PR: perturb
    loops_mapped: tuple[int, ...] | str = (),  # PR: perturb
) -> list[tp.Any]:
  """Binds ``sow_p`` (effectful while a capture stages)."""
  extra = {}
  if ordinal is not None:  # PR: perturb
    extra['ordinal'] = ordinal
  if grad_of is not None:  # PR: perturb
    extra['grad_of'] = grad_of
  if loops_mapped:  # PR: perturb
    extra['loops_mapped'] = loops_mapped
  _BOUND.count, _BOUND.last = _BOUND.count + 1, name  # PR: custom
  return sow_p.bind(
      *leaves,
      *closure,
      sow_name=name,
      tag=tag,
      treedef=treedef,
      reduction=reduction,
      kind=kind,
      batch_dims=batch_dims,
      n_closure=len(closure),
      effect=staging_active(),
      remat_copy=False,
      **extra,
  )


@sow_p.def_impl
def _sow_impl(*leaves, n_closure, **params):
  return leaves[: len(leaves) - n_closure]


def _identity_impl(*leaves, **params):  # PR: perturb
  del params
  return leaves


@sow_p.def_effectful_abstract_eval
def _sow_abstract_eval(*avals, effect, remat_copy, n_closure, **params):
  del params
  avals = avals[: len(avals) - n_closure]
  return avals, {sow_effect} if effect and not remat_copy else set()


def _identity_lowering(ctx, *leaves, **params):  # PR: perturb
  del ctx, params
  return leaves


def _sow_lowering(ctx, *leaves, n_closure, **params):
  del ctx, params
  return leaves[: len(leaves) - n_closure]


_jax.register_lowering(sow_p, _sow_lowering)


def _sow_jvp(primals, tangents, **params):
  # A sow marks the primal value; tangents pass through untouched (so
  # ``jax.grad`` collects primals). A ``perturb`` marker routes its tangent
  # through ``perturb_tangent_p``, whose transpose sows the cotangent.
  tangents = list(tangents[: len(tangents) - params['n_closure']])
  if params['kind'] == 'perturb':  # PR: perturb
    out = sow_p.bind(*primals, **differentiated(params))
    return out, perturb_tangents(tangents, params)
  out = sow_p.bind(*primals, **params)
  return out, tangents


def differentiated(params: dict[str, tp.Any]) -> dict:  # PR: perturb
  """The parameters of a ``perturb`` marker whose tangent a JVP rule has
  routed (see ``per_example``)."""
  return dict(params, differentiated=True)


_jax.primitive_jvps[sow_p] = _sow_jvp


def _sow_transpose(cts, *args, **params):
  # A sow on a tangent (e.g. in a custom_jvp rule) is the identity: the
  # cotangent passes through and nothing is sown on it.
  del args
  return [*cts, *([None] * params['n_closure'])]


_jax.primitive_transposes[sow_p] = _sow_transpose


def _sow_batch(axis_data, leaves, dims, **params):
  # The sown value gets the mapped axis first, like vmap's outputs; the
  # results keep the operands' own axes, so the sow stays an identity.
  if per_example(params):  # PR: perturb
    params = with_loops_mapped(params)
  elif _unstaged_marker(params):  # PR: perturb
    params = dict(params, loops_mapped=LOOPS_UNKNOWN)
  outs = bind_mapped_first(axis_data, leaves, dims, params)
  n = len(outs)  # the closure is batched with the value, not returned
  if per_example(params):  # PR: perturb
    if any(d is None for d in dims[:n]):
      _BROADCAST.count += 1
      _BROADCAST.last = params['sow_name']
    return outs, [0] * n
  outs = [o if d is not None else x for o, x, d in zip(outs, leaves, dims)]
  return outs, [None if d is None else 0 for d in dims[:n]]


def per_example(params: dict[str, tp.Any]) -> bool:  # PR: perturb
  """Whether a ``jax.vmap`` gives the ``perturb`` marker with ``params``
  one value per example, also where its value does not vary over the vmap.

  A marker staged while a capture or an intervene stages, that no JVP rule
  has differentiated yet (``differentiated``), may be differentiated around
  the vmap (``jax.grad(f)`` with a ``jax.vmap`` inside ``f``, also through a
  ``jax.jit`` staged first): its cotangent is collected with the mapped axis
  first, one per example, as a sown value is, so the value its consumers
  read must be the broadcast one, or the backward pass would add the
  examples' cotangents together before they reach the marker.
  """
  return (
      params['kind'] == 'perturb'
      and params['effect']
      and not params.get('differentiated', False)
  )


def with_loops_mapped(params: dict[str, tp.Any]) -> dict:  # PR: perturb
  """The parameters of a ``per_example`` marker that a ``jax.vmap`` batches
  now: ``loops_mapped`` records, for the new leading axis and those before
  it, how many ``lax.scan`` loops of ``f`` lie between that ``vmap`` and
  the marker (``pending_loops``, set by the loops' batching rule in
  ``constructs/scan.py``; 0 where there is none).

  The cotangent is sown in the transposed loops, which stack it step axis
  first, before the mapped axes; a capture moves each step axis behind the
  mapped axes of the ``vmap`` calls outside its loop
  (``EntrySpec.loops_mapped``), so the cotangent comes back laid out as the
  sown value, ``(batch, steps, ...)``. An outer ``vmap`` encloses every loop
  an inner one does, so the counts never grow along the tuple, and the
  zeros at its end (axes that stay where they are) are dropped.
  """
  params = dict(params)
  loops = (params.pop('pending_loops', 0), *params.pop('loops_mapped', ()))
  loops = tuple(c for c in loops if c)
  return dict(params, loops_mapped=loops) if loops else params


# The ``loops_mapped`` of a ``perturb`` marker that a ``jax.vmap`` batched
# while no capture staged (a pullback or linear function made before the
# capture): the loops between them were not counted.
LOOPS_UNKNOWN = 'unknown'  # PR: perturb


def _unstaged_marker(params: dict[str, tp.Any]) -> bool:  # PR: perturb
  return (
      params['kind'] == 'perturb'
      and not params['effect']
      and not params.get('differentiated', False)
  )


class _Broadcast(threading.local):  # PR: perturb
  """How many ``perturb`` markers this thread has broadcast over a
  ``jax.vmap`` that does not batch their value (``per_example``), and the
  name of the last one (for errors)."""

  count: int = 0
  last: Name | None = None


_BROADCAST = _Broadcast()  # PR: perturb


def naming_broadcast_perturbs(call):  # PR: perturb
  """``call``, with JAX's error for a ``jax.vmap(..., out_axes=None)``
  whose output is batched turned into one that names the ``perturb`` that
  ``per_example`` broadcast while ``call`` ran, if one was."""

  @functools.wraps(call)
  def wrapped(*args, **kwargs):
    before = _BROADCAST.count
    try:
      return call(*args, **kwargs)
    except ValueError as e:
      if _BROADCAST.count == before or 'but output was batched' not in str(e):
        raise
      raise _broadcast_perturb_error(_BROADCAST.last) from e

  return wrapped


def _broadcast_perturb_error(name: Name) -> ValueError:  # PR: perturb
  return ValueError(
      f'perturb {name!r} sits in a `jax.vmap` over which its value does not'
      ' vary, inside a capture or intervene: its cotangent is collected one'
      ' per example, mapped axis first, so the vmap broadcasts the value'
      ' and what it flows into is batched too. A `jax.vmap` there returns'
      ' such a value with out_axes=None, which a batched output cannot'
      ' have. Perturb the value outside that vmap (its cotangent is then'
      ' the sum over the examples), or return it with out_axes=0.'
  )


def bind_mapped_first(axis_data, leaves, dims, params) -> list:
  """Binds the sow with ``params`` on ``leaves`` moved mapped axis first
  (broadcast where ``dims`` has ``None``): one more ``batch_dims``."""
  moved = [
      mapped_axis_first(x, d, axis_data.size) for x, d in zip(leaves, dims)
  ]
  return sow_p.bind(*moved, **dict(params, batch_dims=params['batch_dims'] + 1))


def mapped_axis_first(x, dim: int | None, size: int):
  """``x`` with its mapped axis ``dim`` first (broadcast if not mapped)."""
  if dim is None:
    return jax.lax.broadcast(x, (size,))
  return x if dim == 0 else jnp.moveaxis(x, dim, 0)


_jax.fancy_primitive_batchers[sow_p] = _sow_batch


def _sow_jet(primals, series, **params):
  # ``jax.experimental.jet``: the sow marks the primal (so a capture around
  # the jet collects it); the Taylor series pass through, as tangents do.
  out = sow_p.bind(*primals, **params)
  return out, list(series[: len(out)])


_jax.jet_rules[sow_p] = _sow_jet


# ``perturb_tangent_p``: the tangent of a perturbed value. Linear, the
# identity; its transpose sows the cotangent (kind ``'cotangent'``).
perturb_tangent_p = _jax.Primitive('perturb_tangent')  # PR: perturb
perturb_tangent_p.multiple_results = True  # PR: perturb
perturb_tangent_p.def_impl(_identity_impl)  # PR: perturb
perturb_tangent_p.def_abstract_eval(  # PR: perturb
    lambda *avals, **params: avals
)
_jax.register_lowering(  # PR: perturb
    perturb_tangent_p, _identity_lowering
)


def perturb_tangents(tangents, params) -> list:  # PR: perturb
  """The tangents of a ``perturb`` marker: through ``perturb_tangent_p``,
  whose transpose sows the cotangent, unless all are symbolic zeros."""
  if all(type(t) is _jax.Zero for t in tangents):
    return tangents
  tangents = [_jax.instantiate_zeros(t) for t in tangents]
  return perturb_tangent_p.bind(
      *tangents,
      sow_name=params['sow_name'],
      tag=params['tag'],
      treedef=params['treedef'],
      ordinal=params.get('ordinal'),
      loops_mapped=params.get('loops_mapped', ()),
  )


def _perturb_tangent_jvp(primals, tangents, **params):  # PR: perturb
  tangents = [_jax.instantiate_zeros(t) for t in tangents]
  return (
      perturb_tangent_p.bind(*primals, **params),
      perturb_tangent_p.bind(*tangents, **params),
  )


def _perturb_tangent_transpose(  # PR: perturb
    cts, *args, sow_name, tag, treedef, ordinal, loops_mapped
):
  cts = [
      _jax.instantiate_zeros(ct) if type(ct) is _jax.Zero else ct for ct in cts
  ]
  del args
  return bind_sow(
      cts,
      name=sow_name,
      tag=tag,
      treedef=treedef,
      kind='cotangent',
      ordinal=ordinal,
      loops_mapped=loops_mapped,
  )


def _perturb_tangent_batch(axis_data, leaves, dims, **params):  # PR: perturb
  del axis_data
  return perturb_tangent_p.bind(*leaves, **params), list(dims)


_jax.primitive_jvps[perturb_tangent_p] = _perturb_tangent_jvp  # PR: perturb
_jax.primitive_transposes[perturb_tangent_p] = (  # PR: perturb
    _perturb_tangent_transpose
)
_jax.fancy_primitive_batchers[perturb_tangent_p] = (  # PR: perturb
    _perturb_tangent_batch
)


def _perturb_tangent_jet(primals, series, **params):  # PR: perturb
  # The identity on the primal and on every term of its series.
  return perturb_tangent_p.bind(*primals, **params), list(series)


_jax.jet_rules[perturb_tangent_p] = _perturb_tangent_jet  # PR: perturb


def _sow_partial_eval_custom(saveable, unks_in, inst_in, eqn):
  """Partial evaluation for remat: the sow runs in the known program only."""
  del saveable
  n = len(eqn.outvars)  # the sown leaves; the closure operands follow
  if any(unks_in):
    # A sow of a value only known later is staged whole; its known inputs
    # that the staged program does not compute become residuals.
    res = [
        v
        for v, unk, inst in zip(eqn.invars, unks_in, inst_in)
        if not unk and not inst and isinstance(v, _jax.Var)
    ]
    return None, eqn, [True] * n, [True] * n, res
  # Known: collect here; where the staged program recomputes the operand, it
  # recomputes the result with an effect-free copy instead of saving it.
  keep = [i for i, inst in enumerate(inst_in[:n]) if inst]
  staged = None
  if keep:
    staged = _jax.new_jaxpr_eqn(
        [eqn.invars[i] for i in keep],
        [eqn.outvars[i] for i in keep],
        sow_p,
        dict(eqn.params, remat_copy=True, n_closure=0),
        set(),
        eqn.source_info,
        eqn.ctx,
    )
  return eqn, staged, [False] * n, list(inst_in[:n]), []


_jax.partial_eval_jaxpr_custom_rules[sow_p] = _sow_partial_eval_custom


def is_eager() -> bool:
  """Whether no transform (and no capture) is tracing on this thread (a
  sow is then returned as it is)."""
  return isinstance(_jax.trace_ctx.trace, _jax.core.EvalTrace)
