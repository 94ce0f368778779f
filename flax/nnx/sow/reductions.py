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

"""Reduced sows: what a site's ``reduce_fn``/``init_fn`` mean, fixed at the sow.

Flax's ``Module.sow`` applies ``reduce_fn`` when the sow runs, so a
``lambda`` that reads a loop variable, or a value computed just before, sees
it as it is then. A capture folds much later, after ``f`` has been staged.
So when a sow is staged, this file traces its ``init_fn()`` and
``reduce_fn(acc, value)`` into small jaxprs (a :class:`Snapshot`): constants
they close over are kept in the jaxprs, and traced values they close over
(intermediates of ``f``) become extra operands of the sow equation, the
*closure*, which the staged program carries to the capture like any value.

It also owns the accumulator's type: a weakly typed leaf of ``init_fn()``
(a Python scalar, ``init_fn=lambda: 0``) takes the dtype and shape that
``reduce_fn(init, value)`` gives it, as weak types promote in ``jnp``.
"""

from __future__ import annotations

import dataclasses
import typing as tp

import jax

from flax.nnx.sow import _jax
from flax.nnx.sow import api
from flax.nnx.sow.primitive import staging_active


@dataclasses.dataclass(frozen=True, eq=False)
class Snapshot:
  """``init_fn`` and ``reduce_fn`` of one site, traced when it was sown.

  ``init`` takes the init closure and returns the leaves of ``init_fn()``;
  ``fold`` takes ``[*fold_closure, *acc_leaves, *value_leaves]`` and returns
  the new accumulator's leaves.
  """

  init: _jax.ClosedJaxpr
  init_treedef: tp.Any
  n_init_closure: int
  fold: _jax.ClosedJaxpr
  acc_treedef: tp.Any
  acc_avals: tuple[tp.Any, ...]
  out_treedef: tp.Any


@dataclasses.dataclass(frozen=True, eq=False)
class Reduction:
  """The ``reduce_fn``/``init_fn`` of one reduced sow site.

  Each site folds its values with its own ``reduce_fn`` (as Flax's
  ``Module.sow`` does), so two sites of one name may hold different function
  objects, e.g. lambdas written inline. Compared by identity. ``snapshot``
  is set for a sow staged inside a capture (see the module docstring).

  ``fixed_type``: the accumulator keeps its structure, shape and dtype at
  every fold (the functional ``sow``). ``False`` (``Module.sow``, as in Flax)
  lets a fold change it where the fold runs in Python, not carried by a
  loop or branch (``accumulators.Accumulators.fold``).
  """

  reduce_fn: tp.Callable[[tp.Any, tp.Any], tp.Any]
  init_fn: tp.Callable[[], tp.Any]
  snapshot: Snapshot | None = None
  fixed_type: bool = dataclasses.field(default=True, repr=False)


_jax.weak_cache_key(Reduction)


@dataclasses.dataclass(frozen=True)
class Accumulator:
  """A reduced name's running value: its structure and leaves."""

  treedef: tp.Any
  leaves: tuple[tp.Any, ...]

  @property
  def avals(self):
    return tuple(_jax.typeof(x) for x in self.leaves)


def strong(x: tp.Any) -> tp.Any:
  """``x`` as an array without a weak type, so loop carries type-check."""
  x = jax.numpy.asarray(x)
  return jax.lax.convert_element_type(x, x.dtype) if x.weak_type else x


class ReadsMutableError(ValueError):
  """An ``init_fn``/``reduce_fn`` reads a ref or Hijax Variable (which
  :func:`take_snapshot` cannot fix at the sow)."""

  def __init__(self, fn_name: str):
    super().__init__(fn_name)
    self.fn_name = fn_name


def _trace(fn, in_avals, name):
  """``(closed jaxpr with concrete constants, traced constants, out box)``.

  Constants of the traced ``fn`` that are tracers become leading inputs of
  the returned jaxpr (the closure); the others stay its constants.
  """
  box = []

  def flat(*args):
    out = fn(*args)
    leaves, treedef = jax.tree_util.tree_flatten(out)
    box.append(treedef)
    return [jax.numpy.asarray(x) for x in leaves]

  closed = _jax.trace_to_closed_jaxpr(flat, in_avals, name)
  if any(_jax.is_mutable(c) for c in closed.consts):
    raise ReadsMutableError(name)
  is_traced = [isinstance(c, jax.core.Tracer) for c in closed.consts]
  if not any(is_traced):
    return closed, [], box[-1]
  open_jaxpr, consts = _jax.close_over_nothing(closed)
  traced = [c for c, t in zip(consts, is_traced) if t]

  def with_closure(*args):  # [*traced constants, *fn's arguments]
    it = iter(args[: len(traced)])
    full = [next(it) if t else c for c, t in zip(consts, is_traced)]
    return _jax.eval_jaxpr(open_jaxpr, (), *full, *args[len(traced) :])

  closed = _jax.trace_to_closed_jaxpr(
      with_closure, [_jax.arg_type(c) for c in traced] + list(in_avals), name
  )
  return closed, traced, box[-1]


def take_snapshot(
    reduce_fn, init_fn, value_treedef, value_avals
) -> tuple[Snapshot, list[tp.Any]]:
  """Traces one site's ``init_fn``/``reduce_fn``; returns it and its closure.

  Raises:
    whatever ``init_fn`` or ``reduce_fn`` raise on these types.
  """
  init, init_closure, init_treedef = _trace(init_fn, [], 'init_fn')
  init_avals = list(init.out_avals)
  value_avals = list(value_avals)

  def fold_fn(*leaves):
    k = len(leaves) - len(value_avals)
    acc = jax.tree_util.tree_unflatten(init_treedef, leaves[:k])
    value = jax.tree_util.tree_unflatten(value_treedef, leaves[k:])
    return reduce_fn(acc, value)

  acc_avals = promoted_avals(fold_fn, init_treedef, init_avals, value_avals)
  fold, fold_closure, out_treedef = _trace(
      fold_fn, [*acc_avals, *value_avals], 'reduce_fn'
  )
  snapshot = Snapshot(
      init,
      init_treedef,
      len(init_closure),
      fold,
      init_treedef,
      tuple(acc_avals),
      out_treedef,
  )
  return snapshot, [*init_closure, *fold_closure]


def promoted_avals(fold_fn, treedef, init_avals, value_avals):
  """The accumulator's avals: weak scalar leaves promoted by ``fold_fn``."""
  strong_avals = [a.strip_weak_type() for a in init_avals]
  if not any(a.weak_type for a in init_avals):
    return strong_avals
  try:
    closed = _jax.trace_to_closed_jaxpr(
        lambda *a: jax.tree_util.tree_leaves(fold_fn(*a)),
        [*init_avals, *value_avals],
        'reduce_fn',
    )
  except Exception:  # pylint: disable=broad-except
    return strong_avals  # the fold reports the error where it happens
  out = closed.out_avals
  if len(out) != len(init_avals):
    return strong_avals
  return [
      _jax.ShapedArray(t.shape, t.dtype)
      if a.weak_type and not a.shape
      else a.strip_weak_type()
      for a, t in zip(init_avals, out)
  ]


def initial_accumulator(
    reduction: Reduction, value_treedef, value_avals, closure=()
) -> Accumulator:
  """``init_fn()`` as an accumulator for values of the given type.

  Uses the site's snapshot (and the init part of its closure) when it has
  one; otherwise calls ``init_fn`` now.
  """
  snap = reduction.snapshot
  if snap is not None:
    leaves = _jax.eval_closed(snap.init, list(closure)[: snap.n_init_closure])
    leaves = [_jax.off_manual_mesh(x) for x in leaves]
    treedef = snap.init_treedef
    avals = snap.acc_avals
  else:
    leaves, treedef = jax.tree_util.tree_flatten(reduction.init_fn())
    leaves = [_jax.off_manual_mesh(jax.numpy.asarray(x)) for x in leaves]

    def fold_fn(*a):
      k = len(a) - len(value_avals)
      return reduction.reduce_fn(
          jax.tree_util.tree_unflatten(treedef, a[:k]),
          jax.tree_util.tree_unflatten(value_treedef, a[k:]),
      )

    avals = promoted_avals(
        fold_fn, treedef, [_jax.typeof(x) for x in leaves], value_avals
    )
  leaves = [
      jax.numpy.broadcast_to(x.astype(a.dtype), a.shape)
      if _jax.typeof(x).weak_type and not x.shape
      else x
      for x, a in zip(leaves, avals)
  ]
  return Accumulator(treedef, tuple(strong(x) for x in leaves))


def fold(
    reduction: Reduction,
    acc: Accumulator,
    value_treedef,
    value_leaves,
    closure=(),
):
  """``reduce_fn(acc, value)`` as ``(leaves, treedef)``.

  With a snapshot whose accumulator type matches ``acc``, the traced
  ``reduce_fn`` with its closure; otherwise ``reduce_fn`` itself.
  """
  snap = reduction.snapshot
  if (
      snap is not None
      and snap.acc_treedef == acc.treedef
      and all(
          a.shape == b.shape and a.dtype == b.dtype
          for a, b in zip(snap.acc_avals, acc.avals)
      )
      and len(snap.acc_avals) == len(acc.leaves)
  ):
    closure = list(closure)[snap.n_init_closure :]
    leaves = _jax.eval_fold(snap.fold, [*closure, *acc.leaves, *value_leaves])
    return _vary_like_acc(leaves, acc), snap.out_treedef
  new = reduction.reduce_fn(
      jax.tree_util.tree_unflatten(acc.treedef, acc.leaves),
      jax.tree_util.tree_unflatten(value_treedef, list(value_leaves)),
  )
  leaves, treedef = jax.tree_util.tree_flatten(new)
  return _vary_like_acc(leaves, acc), treedef


def _vary_like_acc(leaves, acc: Accumulator) -> list:
  """Inside ``shard_map``, an accumulator kept per shard stays per shard
  (varying over its mesh axes) whatever ``reduce_fn`` returns."""
  if len(leaves) != len(acc.leaves):
    return list(leaves)  # the caller reports the changed structure
  return [_jax.vary_like(x, a) for x, a in zip(leaves, acc.leaves)]


def masked(snapshot: Snapshot, n_value: int) -> Snapshot:  # PR: loops
  """``snapshot`` whose fold takes one more value leaf, a boolean mask, and
  leaves the accumulator unchanged where it is false (``constructs/cond.py``).
  """
  fold = snapshot.fold
  n_acc = len(snapshot.acc_avals)
  n_closure = len(fold.in_avals) - n_acc - n_value

  def fn(*args):
    mask = args[-1]
    acc = args[n_closure : n_closure + n_acc]
    new = _jax.eval_fold(fold, args[:-1])
    return [jax.numpy.where(mask, x, a) for x, a in zip(new, acc)]

  mask_aval = _jax.ShapedArray((), jax.numpy.dtype('bool'))
  return dataclasses.replace(
      snapshot,
      fold=_jax.trace_to_closed_jaxpr(
          fn, [*_jax.binder_types(fold), mask_aval], 'masked_reduce_fn'
      ),
  )


# -- the sow's side (``api.sow``) ----------------------------------------------


def check_functions(name, reduce_fn, init_fn) -> None:
  """Raises ``TypeError`` unless ``reduce_fn`` and ``init_fn`` are both
  given and callable."""
  if (reduce_fn is None) != (init_fn is None):
    raise TypeError(
        f'sow {name!r}: reduce_fn and init_fn go together; pass both to'
        ' reduce the sown values into one accumulator, or neither to collect'
        ' every value.'
    )
  if reduce_fn is not None and not callable(reduce_fn):
    raise TypeError(
        f'sow {name!r}: reduce_fn must be a function reduce_fn(acc, value)'
        f' -> acc, got {reduce_fn!r} of type {type(reduce_fn).__name__}.'
    )
  if init_fn is not None and not callable(init_fn):
    raise TypeError(
        f'sow {name!r}: init_fn must be a function init_fn() -> acc, got'
        f' {init_fn!r} of type {type(init_fn).__name__}; for a constant'
        f' start write init_fn=lambda: {init_fn!r}.'
    )


def reduction_of_sow(name, reduce_fn, init_fn, treedef, leaves, fixed_type):
  """``(reduction, closure)`` for a sow of ``leaves`` (see
  ``api.reduction_hooks``): while a capture stages, the
  functions are traced here (:func:`take_snapshot`); outside one nothing is
  traced.

  Raises:
    ValueError: if either function reads a ref or Hijax Variable.
  """
  snapshot, closure = None, ()
  if staging_active():
    # Fix what reduce_fn/init_fn mean now, as Flax applies them at the
    # sow (a lambda reading a loop variable sees its current value).
    try:
      snapshot, closure = take_snapshot(
          reduce_fn, init_fn, treedef, [_jax.typeof(x) for x in leaves]
      )
    except ReadsMutableError as e:
      raise ValueError(
          f'sow {name!r}: its {e.fn_name} reads a ref or Hijax Variable.'
          ' A capture applies reduce_fn and init_fn to values fixed at the'
          ' sow, and cannot fix a mutable Variable there. Read the'
          ' Variable before the sow and close over the value instead, e.g.'
          ' w = v[...]; sow(h, ..., reduce_fn=lambda acc, h: acc + h * w).'
      ) from None
    except Exception as e:
      e.add_note(
          f'(raised by the reduce_fn or init_fn of sow {name!r}, applied to'
          ' the sown value and the accumulator)'
      )
      raise
  return Reduction(reduce_fn, init_fn, snapshot, fixed_type), closure


class SowReductions:
  """This file's ``api.reduction_hooks``."""

  check = staticmethod(check_functions)
  reduction = staticmethod(reduction_of_sow)


api.reduction_hooks.append(SowReductions())
