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
(``capture.py``), not the primitive's.
"""

from __future__ import annotations

import dataclasses
import os
import typing as tp

import jax
import jax.numpy as jnp
import numpy as np

from flax.nnx.sow import _jax
from flax.nnx.sow import reductions
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
#   marker that only says where a name is first used (``batching.py``).
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
#   grows with every ``perturb`` call traced (``perturb.py``), so that a
#   capture can tell the backward passes of one name apart and put their
#   cotangents in call order (``Collector.result``).
# * ``remat_copy``: the copy of a sow that partial evaluation leaves in a
#   rematerialised (recomputed) program: an identity without effect that no
#   capture collects, so a sow inside ``jax.checkpoint`` is collected once
#   and does not force its value to be saved as a residual.

MARKER_KINDS = ('perturb', 'order')

_STAGING = jax.make_user_context(())


def staging(accepts_key: tp.Any = None):
  """The context in which ``capture`` stages its function.

  Its value, the ``tags`` keys of the captures staging (outermost first), is
  part of JAX's tracing cache key, so a ``jax.jit`` traced inside a capture
  (effectful sows) is not reused outside one (effect-free sows), and back.
  """
  return _STAGING((*_STAGING.value, accepts_key))


@dataclasses.dataclass(frozen=True)
class Intervening:
  """The staging key of ``intervene`` (``intervene.py``): its sows are
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
        and params['kind'] in ('value', 'perturb')
        and (self.tags is None or params['tag'] in self.tags)
    )


_HIDDEN = jax.make_user_context(frozenset())


def hiding(names: tp.Iterable[Name]):
  """The context in which value sows of ``names`` are bound as remat copies.

  Used while a custom derivative rule runs for a primal whose sows were
  already collected (``custom_primal.py``): a rule that calls the primal
  function again must not collect them twice. Part of JAX's tracing cache
  key, like :func:`staging`.
  """
  return _HIDDEN(_HIDDEN.value | frozenset(names))


def hidden_names() -> frozenset:
  """The names :func:`hiding` hides now."""
  return _HIDDEN.value


def staging_active() -> bool:
  return bool(_STAGING.value)


def staging_captures() -> tuple[tp.Any, ...]:
  """The ``tags`` keys (``None``: every tag) of the captures staging now."""
  return tuple(k for k in _STAGING.value if not isinstance(k, Intervening))


def intervening() -> Intervening | None:
  """The ``intervene`` staging now, if it is the innermost transform staging.

  Its sows must stay where they are (``batching.py``), and a sow it replaces
  comes back batched under ``jax.vmap``: a replacement per example has to
  reach the sow's consumers.
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
      remat_copy=bool(_HIDDEN.value)
      and kind == 'value'
      and name in _HIDDEN.value,
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


def check_name(name: tp.Any, what: str = 'sow') -> Name:
  """``name`` as a str or a tuple of str/int; NumPy integers become ``int``.

  Raises:
    TypeError: unless ``name`` is a str or a non-empty tuple of str and
      integers (Python or NumPy; not bool).
  """
  if isinstance(name, str):
    return name
  if isinstance(name, tuple) and name:
    parts = []
    for p in name:
      if isinstance(p, str):
        parts.append(p)
      elif isinstance(p, (int, np.integer)) and not isinstance(
          p, (bool, np.bool_)
      ):
        parts.append(int(p))
      else:
        break
    else:
      return tuple(parts)
  raise TypeError(
      f'{what}: name must be a str or a non-empty tuple of str/int (a path'
      f" such as ('blocks', 0, 'act')), got {name!r} of type"
      f' {type(name).__name__}.'
  )


def check_tag(tag: tp.Any, name: Name, what: str = 'sow') -> None:
  try:
    hash(tag)
  except TypeError:
    raise TypeError(
        f'{what} {name!r}: tag must be hashable, got {tag!r} of type'
        f' {type(tag).__name__}.'
    ) from None


_SCALAR_TYPES = (bool, int, float, complex, np.generic)


def array_leaves(value: tp.Any, name: Name, what: str = 'sow'):
  """Flattens ``value``; every leaf must be an array or a scalar.

  Returns:
    ``(leaves, treedef)`` with scalar leaves converted like ``jnp.asarray``.

  Raises:
    TypeError: naming the sow and the offending leaf's path and type.
  """
  path_leaves, treedef = jax.tree_util.tree_flatten_with_path(value)
  leaves = []
  for path, leaf in path_leaves:
    if isinstance(leaf, (jax.Array, np.ndarray, jax.core.Tracer)):
      leaves.append(leaf)
    elif isinstance(leaf, _SCALAR_TYPES):
      leaves.append(jnp.asarray(leaf))
    else:
      where = jax.tree_util.keystr(path) or '<value>'
      raise TypeError(
          f'{what} {name!r}: the value at {where} has type'
          f' {type(leaf).__name__}; {what} takes a pytree whose leaves are'
          ' arrays or numeric scalars. Convert it with jnp.asarray or leave'
          ' it out of the sown value.'
      )
  return leaves, treedef


def is_eager() -> bool:
  """Whether no transform is tracing (a sow is then returned as it is)."""
  return isinstance(_jax.trace_ctx.trace, _jax.core.EvalTrace)


def same_objects(value: tp.Any, out: tp.Sequence[tp.Any]) -> list[tp.Any]:
  """``out``, where a leaf is not traced, as the caller's own leaf of
  ``value`` (an eager capture then hands ``f`` back its NumPy arrays and
  Python scalars, as ``sow`` does outside any capture)."""
  given = jax.tree_util.tree_leaves(value)
  return [
      o if isinstance(o, jax.core.Tracer) else x for x, o in zip(given, out)
  ]


def unflatten(treedef, leaves):
  return jax.tree_util.tree_unflatten(treedef, leaves)


def sow(
    value: tp.Any,
    *,
    name: Name,
    tag: tp.Hashable = None,
    reduce_fn: tp.Callable[[tp.Any, tp.Any], tp.Any] | None = None,
    init_fn: tp.Callable[[], tp.Any] | None = None,
) -> tp.Any:
  """Tags ``value`` as an intermediate that an enclosing ``capture`` collects.

  ``sow`` leaves an identity primitive, ``sow_p``, in the staged program.
  Outside a :func:`capture` it is the identity under every JAX transform,
  compiles to nothing and carries no effect (a jitted function keeps JAX's
  fast dispatch path); while a capture stages its function the primitive
  carries ``SowEffect``, so an unused sow survives until it is collected. Inside one, the value is returned by the capture under
  ``name``. The idea follows oryx's ``harvest`` (``sow``/``reap``), built as a
  jaxpr rewrite in the style of JAX's ``checkify``.

  >>> import jax.numpy as jnp
  >>> from flax.nnx.sow import capture, sow
  >>> def f(x):
  ...   h = sow(jnp.tanh(x), name='h')
  ...   return 2 * h
  >>> out, collected = capture(f)(jnp.zeros(3))
  >>> collected['h'][0].shape
  (3,)

  Args:
    value: a pytree whose leaves are arrays (``jax.Array``, ``numpy.ndarray``,
      tracers) or Python/NumPy scalars, of any shape and dtype.
    name: a ``str`` or a tuple of ``str``/``int`` (a path such as
      ``('blocks', 0, 'act')``); the key of the collected value.
    tag: any hashable, or ``None``; ``capture(f, tags=...)`` collects only
      sows whose tag it lists.
    reduce_fn: ``reduce_fn(acc, value) -> acc``. With ``init_fn``, the
      capture keeps one accumulator per name, updated in the staged program
      (also inside ``while_loop``), instead of a tuple of values. Each site
      folds with its own ``reduce_fn``, traced when the sow runs (as Flax
      applies it then), so inline lambdas that read loop variables or
      values computed just before work. The accumulator must keep its
      structure, shape and dtype.
    init_fn: ``init_fn() -> acc``, the accumulator before the first sow; the
      first site of the name in program order provides it. A Python scalar
      takes the dtype and shape ``reduce_fn`` gives it.

  Returns:
    ``value``, unchanged.

  Raises:
    TypeError: if ``name`` is not a str or a tuple of str/int, if a leaf is
      not an array or a scalar, if ``tag`` is not hashable, or if only one of
      ``reduce_fn``/``init_fn`` is given.
  """
  name = check_name(name)
  check_tag(tag, name)
  if (reduce_fn is None) != (init_fn is None):
    raise TypeError(
        f'sow {name!r}: reduce_fn and init_fn go together; pass both to'
        ' reduce the sown values into one accumulator, or neither to collect'
        ' every value.'
    )
  leaves, treedef = array_leaves(value, name)
  if is_eager():
    return value
  reduction, closure = None, ()
  if reduce_fn is not None:
    snapshot = None
    if staging_active():
      # Fix what reduce_fn/init_fn mean now, as Flax applies them at the
      # sow (a lambda reading a loop variable sees its current value).
      try:
        snapshot, closure = reductions.take_snapshot(
            reduce_fn, init_fn, treedef, [_jax.typeof(x) for x in leaves]
        )
      except Exception as e:
        e.add_note(
            f'(raised by the reduce_fn or init_fn of sow {name!r}, applied to'
            ' the sown value and the accumulator)'
        )
        raise
    reduction = Reduction(reduce_fn, init_fn, snapshot)
  out = bind_sow(
      leaves,
      name=name,
      tag=tag,
      treedef=treedef,
      reduction=reduction,
      closure=closure,
  )
  return unflatten(treedef, same_objects(value, out))
