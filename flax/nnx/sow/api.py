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

"""``sow`` and ``perturb``: the user's two tags, and their argument checks.

``sow(value, name=...)`` binds ``sow_p`` (``primitive.py``) of kind
``'value'``; a capture collects the value. ``perturb(value, name=...)`` binds
a marker of kind ``'perturb'`` that collects nothing itself: its JVP routes
the tangent through ``perturb_tangent_p``, a linear identity whose transpose
sows the arriving cotangent (kind ``'cotangent'``). So a cotangent is
collected when the function is differentiated in reverse mode inside a
``capture`` (``capture(jax.grad(f))``), nothing is collected otherwise, and
forward-mode differentiation (``jax.jvp``, ``jax.jacfwd``) sees an identity.

Eagerly (no transform tracing) both return ``value`` itself without binding
anything. Names, tags and leaves are checked here, so that every error names
the sow.
"""

from __future__ import annotations

import itertools  # PR: perturb
import typing as tp

import jax
import jax.numpy as jnp
import numpy as np

from flax.nnx.sow import names  # PR: perturb
from flax.nnx.sow.primitive import Name
from flax.nnx.sow.primitive import bind_sow
from flax.nnx.sow.primitive import is_eager

# Numbers the ``perturb`` calls as they are traced (``ordinal`` in
# primitive.py): within one backward pass, cotangents arrive in decreasing
# order, which is how a capture tells passes apart.
_ORDINALS = itertools.count()  # PR: perturb


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
    ``(leaves, treedef)``, the leaves as they are (:func:`operands` converts
    them for ``sow_p``).

  Raises:
    TypeError: naming the sow and the offending leaf's path and type.
  """
  path_leaves, treedef = jax.tree_util.tree_flatten_with_path(value)
  leaves = []
  for path, leaf in path_leaves:
    if not isinstance(
        leaf, (jax.Array, np.ndarray, jax.core.Tracer, *_SCALAR_TYPES)
    ):
      where = jax.tree_util.keystr(path) or '<value>'
      raise TypeError(
          f'{what} {name!r}: the value at {where} has type'
          f' {type(leaf).__name__}; {what} takes a pytree whose leaves are'
          ' arrays or numeric scalars. Convert it with jnp.asarray or leave'
          ' it out of the sown value.'
      )
    leaves.append(leaf)
  return leaves, treedef


def operands(leaves: list[tp.Any], name: Name, what: str = 'sow') -> list:
  """``leaves`` as ``sow_p``'s operands: scalars converted like
  ``jnp.asarray`` (NumPy arrays are kept: an eager capture hands them back
  to ``f`` as they are, and converts what it collects).

  Raises:
    OverflowError: naming the sow, for an integer leaf (Python or NumPy,
      scalar or array) that the dtype JAX gives it cannot hold (``int32``
      while ``jax_enable_x64`` is off), which ``jnp.asarray`` would wrap
      silently for a NumPy value.
  """
  out = []
  for leaf in leaves:
    if isinstance(leaf, (np.ndarray, np.generic)):
      _check_fits(leaf, name, what)
    if isinstance(leaf, _SCALAR_TYPES):
      try:
        leaf = jnp.asarray(leaf)
      except OverflowError as e:
        raise OverflowError(_overflow_message(name, what, str(e))) from None
    out.append(leaf)
  return out


def _check_fits(leaf: np.ndarray | np.generic, name: Name, what: str):
  """Raises unless JAX's dtype for the NumPy integer ``leaf`` holds it."""
  dtype = leaf.dtype
  if dtype.kind not in 'iu' or leaf.size == 0:
    return
  target = jax.dtypes.canonicalize_dtype(dtype)
  if target == dtype:
    return
  info = np.iinfo(target)
  low, high = np.min(leaf), np.max(leaf)
  if low < info.min or high > info.max:
    bad = low if low < info.min else high
    raise OverflowError(
        _overflow_message(
            name,
            what,
            f'the NumPy {dtype} value {bad} does not fit in {target}, the'
            f' dtype JAX gives {dtype} (jnp.asarray would wrap it to'
            f' {bad.astype(target)})',
        )
    )


def _overflow_message(name: Name, what: str, why: str) -> str:
  return (
      f'{what} {name!r}: {why}. Sow a value that fits, convert it yourself'
      ' (e.g. to float32), or enable 64-bit types'
      " (jax.config.update('jax_enable_x64', True))."
  )


def same_objects(  # PR: toplevel
    value: tp.Any, out: tp.Sequence[tp.Any]
) -> list[tp.Any]:
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
    grad: bool = False,  # PR: perturb
) -> tp.Any:
  """Tags ``value`` as an intermediate that an enclosing ``capture`` collects.

  ``sow`` leaves an identity primitive, ``sow_p``, in the staged program.
  Outside a :func:`capture` it is the identity under every JAX transform,
  compiles to nothing and carries no effect (a jitted function keeps JAX's
  fast dispatch path); while a capture stages its function the primitive
  carries ``SowEffect``, so an unused sow survives until it is collected.
  Inside one, the value is returned by the capture under ``name``. The idea
  follows oryx's ``harvest`` (``sow``/``reap``), built as a jaxpr rewrite in
  the style of JAX's ``checkify``.

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
    grad: also mark the value as :func:`perturb` does, under the name
      ``grad_name(name)`` (``('grad', *as_path(name))``): differentiated
      inside a capture, the cotangent arriving at the value is collected
      there, next to the value under ``name`` (attribution patching from one
      marker per site). ``intervene`` replaces the value under ``name``; the
      cotangent is then the one at the replacement (none for a constant
      replacement, which the differentiated inputs do not reach). The
      gradient name is not a value: ``intervene`` refuses it as a key
      (``ValueError``) and its hooks see only ``name``.

  Returns:
    ``value``, unchanged.

  Raises:
    TypeError: if ``name`` is not a str or a tuple of str/int, if a leaf is
      not an array or a scalar, if ``tag`` is not hashable, if only one of
      ``reduce_fn``/``init_fn`` is given, if either is not callable, or if
      ``grad=True`` comes with a reduction (a cotangent is collected per
      sow, not reduced).
    OverflowError: inside a capture or ``intervene``, if an integer leaf
      does not fit the dtype that ``jnp.asarray`` gives it (``np.int64(2**40)``
      or ``2**40`` while ``jax_enable_x64`` is off): it is not wrapped.
  """
  if grad and reduce_fn is not None:  # PR: perturb
    raise TypeError(
        f'sow {name!r}: grad=True collects the cotangent of every sown value,'
        ' which a reduce_fn/init_fn would fold away. Sow the value to reduce'
        ' under another name, without grad=True.'
    )
  out = sow_site(value, name, tag, reduce_fn, init_fn, fixed_type=True)
  if grad:  # PR: perturb
    name = check_name(name)
    out = _perturb(out, names.grad_name(name), tag, grad_of=name)
  return out


reduction_hooks: list[tp.Any] = []
"""Where reduced sows come from: ``reductions.py`` registers an object with
``check(name, reduce_fn, init_fn)``, which raises ``TypeError`` for a bad
pair, and ``reduction(name, reduce_fn, init_fn, treedef, leaves,
fixed_type) -> (reduction, closure)``: the sow's ``reduction`` parameter and
the traced values its functions close over (extra operands of the sow)."""


def reduction_hook(name: Name) -> tp.Any:
  """The registered reductions (see :data:`reduction_hooks`).

  Raises:
    NotImplementedError: naming the sow, if none is registered.
  """
  if not reduction_hooks:
    raise NotImplementedError(
        f'sow {name!r}: reduce_fn/init_fn need flax.nnx.sow.reductions,'
        ' which is not part of this build. Sow the values without a'
        ' reduction and reduce the collected tuple after the capture.'
    )
  return reduction_hooks[-1]


def sow_site(value, name, tag, reduce_fn, init_fn, *, fixed_type: bool):
  """:func:`sow`; ``fixed_type=False`` lets ``reduce_fn`` change the
  accumulator's type where no loop or branch carries it (``Module.sow``)."""
  name = check_name(name)
  check_tag(tag, name)
  reduced = reduce_fn is not None or init_fn is not None
  if reduced:
    reduction_hook(name).check(name, reduce_fn, init_fn)
  leaves, treedef = array_leaves(value, name)
  if is_eager():
    return value
  leaves = operands(leaves, name)
  reduction, closure = None, ()
  if reduced:
    reduction, closure = reduction_hook(name).reduction(
        name, reduce_fn, init_fn, treedef, leaves, fixed_type
    )
  out = bind_sow(
      leaves,
      name=name,
      tag=tag,
      treedef=treedef,
      reduction=reduction,
      closure=closure,
  )
  out = same_objects(value, out)  # PR: toplevel
  return unflatten(treedef, out)


def perturb(  # PR: perturb
    value: tp.Any, *, name: Name, tag: tp.Hashable = None
) -> tp.Any:
  """Marks ``value`` so that a capture collects the cotangent arriving at it.

  Identity in the forward pass and under every transform. When the function
  is differentiated in reverse mode inside a :func:`~flax.nnx.sow.capturing`,
  the cotangent of ``value`` (same structure, shapes and dtypes as ``value``)
  is collected under ``name``: a tuple of pytrees in call order, stacked per
  iteration inside loops. Without differentiation nothing is collected, and a
  value the differentiated inputs do not reach gets no cotangent (nothing is
  collected for it either). This plays the role of Flax's
  ``Module.perturb`` and of oryx's ``plant``-based gradient capture, without
  an initialisation pass.

  >>> import jax, jax.numpy as jnp
  >>> from flax.nnx.sow import capture, perturb
  >>> def loss(w, x):
  ...   h = perturb(jnp.tanh(w * x), name='h')
  ...   return jnp.sum(h ** 2)
  >>> grad_w, collected = capture(jax.grad(loss))(1.0, jnp.ones(2))
  >>> collected['h'][0]  # d loss / d h = 2 h
  Array([1.5231884, 1.5231884], dtype=float32)

  Args:
    value: a pytree of arrays or scalars.
    name: a ``str`` or tuple of ``str``/``int``; the key of the cotangent.
    tag: hashable or ``None``, as for :func:`~flax.nnx.sow.sow`.

  Returns:
    ``value``, unchanged.

  Raises:
    TypeError: for a bad name, tag or leaf, as :func:`~flax.nnx.sow.sow`.
    OverflowError: for an integer leaf too large for its JAX dtype, as
      :func:`~flax.nnx.sow.sow`.
  """
  return _perturb(value, check_name(name, 'perturb'), tag)


def _perturb(  # PR: perturb
    value: tp.Any, name: Name, tag: tp.Hashable, grad_of: Name | None = None
) -> tp.Any:
  """:func:`perturb` of a checked ``name``; ``grad_of`` names the sow whose
  ``grad=True`` marker this is (``intervene`` does not replace it)."""
  check_tag(tag, name, 'perturb')
  leaves, treedef = array_leaves(value, name, 'perturb')
  if is_eager():
    return value
  leaves = operands(leaves, name, 'perturb')
  out = bind_sow(
      leaves,
      name=name,
      tag=tag,
      treedef=treedef,
      kind='perturb',
      ordinal=next(_ORDINALS),
      grad_of=grad_of,
  )
  out = same_objects(value, out)  # PR: toplevel
  return unflatten(treedef, out)
