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
primal and passes the tangent through, and a batching rule that moves the
mapped axis first. Collecting what was sown is ``capture``'s job
(``capturing.py``), not the primitive's.
"""

from __future__ import annotations

import dataclasses
import os
import typing as tp

import jax
import jax.numpy as jnp

from flax.nnx.sow import _jax
from flax.nnx.sow import _jax_patches
from flax.nnx.sow.reductions import Reduction

Name = tp.Union[str, tuple[tp.Union[str, int], ...]]


class SowEffect(_jax.Effect):
  """Marks a staged sow, so that an unused sow is not dead-code eliminated."""

  def __repr__(self):
    return 'Sow'


sow_effect = SowEffect()
_jax.allow_effect(SowEffect)
# Errors name the user's line that called ``sow``, not this package's.
_jax.exclude_from_source_info(os.path.dirname(os.path.abspath(__file__)))


sow_p = _jax.Primitive('sow')
sow_p.multiple_results = True


# The parameters of a sow equation, besides ``name``, ``tag``, ``treedef`` and
# ``reduction``:
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
#   ``intervene`` replaces (it did, at the kept sow).
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
# * ``remat_copy``: the copy of a sow that partial evaluation leaves in a
#   rematerialised (recomputed) program: an identity without effect that no
#   capture collects, so a sow inside ``jax.checkpoint`` is collected once
#   and does not force its value to be saved as a residual. ``HIDDEN``
#   (``'hidden'``, truthy, so every reader treats it as a copy) marks a
#   staged sow hidden for the duration of one partial-evaluation rule of
#   ``while`` (``constructs/while_loop.py``), which then makes it collecting again or a
#   copy; no jaxpr outside that rule holds it.

MARKER_KINDS = ('perturb', 'order')
KEPT = 'kept'  # a ``kind``, see above
HOISTED = 'hoisted'  # a ``kind``, see above
VALUE_KINDS = ('value', HOISTED)  # what a capture collects as sown values
HIDDEN = 'hidden'  # a ``remat_copy`` value, see above

_STAGING = jax.make_user_context(())


def staging(accepts_key: tp.Any = None):
  """The context in which ``capture`` stages its function.

  Its value, the ``tags`` keys of the captures staging (outermost first), is
  part of JAX's tracing cache key, so a ``jax.jit`` traced inside a capture
  (effectful sows) is not reused outside one (effect-free sows), and back.
  The first staging installs the patch inventory (``_jax_patches.py``):
  importing the package replaces nothing in JAX.
  """
  _jax_patches.install()
  return _STAGING((*_STAGING.value, accepts_key))


@dataclasses.dataclass(frozen=True)
class Intervening:
  """The staging key of ``intervene`` (``inject.py``): its sows are
  staged effectful, like a capture's, but no capture accepts them.

  ``names`` and ``tags`` (``None``: every tag) say which sows it replaces;
  ``arrays``, which of the names by arrays (the others by callables).
  """

  names: frozenset[Name]
  arrays: frozenset[Name]
  tags: frozenset | None

  def replaces(self, params: dict[str, tp.Any]) -> bool:
    return (
        params['name'] in self.names
        and params['kind'] in ('value', 'perturb', KEPT)
        and (self.tags is None or params['tag'] in self.tags)
    )


def staging_active() -> bool:
  return bool(_STAGING.value)


def staging_captures() -> tuple[tp.Any, ...]:
  """The ``tags`` keys (``None``: every tag) of the captures staging now."""
  return tuple(k for k in _STAGING.value if not isinstance(k, Intervening))


def intervening() -> Intervening | None:
  """The ``intervene`` staging now, if it is the innermost transform staging.

  Its sows must stay where they are, so that a replacement reaches their
  consumers: a construct that ``jax.vmap`` batches keeps a ``'kept'`` half
  of each in place and hoists only its result (``constructs/batched.py``).
  A sow it replaces comes back batched under ``jax.vmap``: a replacement per
  example has to reach the sow's consumers.
  """
  if _STAGING.value and isinstance(_STAGING.value[-1], Intervening):
    return _STAGING.value[-1]
  return None


def bind_sow(
    leaves,
    *,
    name: Name,
    tag: tp.Hashable,
    treedef,
    reduction: Reduction | None = None,
    kind: str = 'value',
    batch_dims: int = 0,
    closure: tp.Sequence[tp.Any] = (),
    ordinal: int | None = None,
) -> list[tp.Any]:
  """Binds ``sow_p`` (effectful while a capture stages)."""
  extra = {} if ordinal is None else {'ordinal': ordinal}
  return sow_p.bind(
      *leaves,
      *closure,
      name=name,
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
  del params
  return leaves[: len(leaves) - n_closure]


def _identity_impl(*leaves, **params):
  del params
  return leaves


@sow_p.def_effectful_abstract_eval
def _sow_abstract_eval(*avals, effect, remat_copy, n_closure, **params):
  del params
  avals = avals[: len(avals) - n_closure]
  return avals, {sow_effect} if effect and not remat_copy else set()


def _identity_lowering(ctx, *leaves, **params):
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
  out = sow_p.bind(*primals, **params)
  tangents = tangents[: len(tangents) - params['n_closure']]
  if params['kind'] != 'perturb' or all(type(t) is _jax.Zero for t in tangents):
    return out, list(tangents)
  tangents = [_jax.instantiate_zeros(t) for t in tangents]
  return out, perturb_tangent_p.bind(
      *tangents,
      name=params['name'],
      tag=params['tag'],
      treedef=params['treedef'],
      ordinal=params.get('ordinal'),
  )


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
  moved = [
      mapped_axis_first(x, d, axis_data.size) for x, d in zip(leaves, dims)
  ]
  params = dict(params, batch_dims=params['batch_dims'] + 1)
  outs = sow_p.bind(*moved, **params)
  n = len(outs)  # the closure is batched with the value, not returned
  key = intervening()
  if key is not None and params['effect'] and key.replaces(params):
    # ``intervene`` may replace the value per example: every leaf comes
    # back batched. (Only such sows: an unbatched result stays unbatched,
    # as ``vmap(..., out_axes=None)`` and ``jacfwd`` require.)
    return outs, [0] * n
  outs = [o if d is not None else x for o, x, d in zip(outs, leaves, dims)]
  return outs, [None if d is None else 0 for d in dims[:n]]


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
perturb_tangent_p = _jax.Primitive('perturb_tangent')
perturb_tangent_p.multiple_results = True
perturb_tangent_p.def_impl(_identity_impl)
perturb_tangent_p.def_abstract_eval(lambda *avals, **params: avals)
_jax.register_lowering(perturb_tangent_p, _identity_lowering)


def _perturb_tangent_jvp(primals, tangents, **params):
  tangents = [_jax.instantiate_zeros(t) for t in tangents]
  return (
      perturb_tangent_p.bind(*primals, **params),
      perturb_tangent_p.bind(*tangents, **params),
  )


def _perturb_tangent_transpose(cts, *args, name, tag, treedef, ordinal):
  cts = [
      _jax.instantiate_zeros(ct) if type(ct) is _jax.Zero else ct for ct in cts
  ]
  del args
  return bind_sow(
      cts,
      name=name,
      tag=tag,
      treedef=treedef,
      kind='cotangent',
      ordinal=ordinal,
  )


def _perturb_tangent_batch(axis_data, leaves, dims, **params):
  del axis_data
  return perturb_tangent_p.bind(*leaves, **params), list(dims)


_jax.primitive_jvps[perturb_tangent_p] = _perturb_tangent_jvp
_jax.primitive_transposes[perturb_tangent_p] = _perturb_tangent_transpose
_jax.fancy_primitive_batchers[perturb_tangent_p] = _perturb_tangent_batch


def _perturb_tangent_jet(primals, series, **params):
  # The identity on the primal and on every term of its series.
  return perturb_tangent_p.bind(*primals, **params), list(series)


_jax.jet_rules[perturb_tangent_p] = _perturb_tangent_jet


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
  """Whether no transform is tracing (a sow is then returned as it is)."""
  return isinstance(_jax.trace_ctx.trace, _jax.core.EvalTrace)
