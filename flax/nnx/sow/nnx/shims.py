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


"""NNX shims: ``Module.sow``, ``Module.perturb`` and ``nnx.capture`` on capture.

This file owns the bridge between Flax NNX's object API and the functional
core (``sow``, ``perturb``, ``capture``):

* ``Module.sow(variable_type, name, value)`` becomes a ``sow`` named by the
  module's path from the captured root plus ``name`` and tagged by the
  Variable type; ``Module.perturb`` becomes a ``perturb`` the same way.
* ``nnx.capture(fn, *var_types, init=None, method_outputs=None)`` stages
  ``fn`` with ``capture`` and returns Flax's ``(result, State)``.

A module learns its path from the innermost active capture (``scope.py``);
graph nodes among the arguments are handled as ``nnx.jit`` does
(``calls.py``). No attribute is set on any module, and nothing is kept from
one call to the next: the State is built from what the capture returns.
``nnx.capture(fn, T1, T2, ...)`` nests one functional capture per Variable
type (``tags`` that type), so a name sown as ``Intermediate`` and perturbed
as ``Perturbation`` lands in two captures and two States (Flax keeps one).

:func:`install` puts every Flax replacement of the NNX layer in place (the
inventory of ``flax_hooks.py``: these shims and the split/merge hooks of
``scope.py``); :func:`uninstall` restores the originals. Both are
idempotent. Every use of a Flax internal is in the block below.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import operator
import typing as tp
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

# Flax internals used by the shims (adapt here for a new Flax release).
from flax.nnx import graphlib as _graphlib
from flax.nnx import module as _module_lib
from flax.nnx import variablelib as _variablelib

from flax.nnx.sow.nnx import flax_hooks
from flax.nnx.sow.nnx import hooks  # PR: nnx_functional
from flax.nnx.sow.nnx import state as state_lib
from flax.nnx.sow import toplevel
from flax.nnx.sow.capturing import stage_and_collect
from flax.nnx.sow.nnx.calls import functional_graph_call
from flax.nnx.sow.nnx import scope as scope_lib
from flax.nnx.sow.nnx import slices  # PR: nnx_transforms
from flax.nnx.sow.nnx.scope import LOCAL
from flax.nnx.sow.nnx.scope import Path
from flax.nnx.sow.nnx.scope import Scope
from flax.nnx.sow.nnx.scope import SharedPathError
from flax.nnx.sow.api import perturb as _core_perturb
from flax.nnx.sow.api import sow as _core_sow
from flax.nnx.sow.api import sow_site

__all__ = [
    'install',
    'uninstall',
    'installed',
    'capture',
    'module_sow',
    'module_perturb',
]

_TUPLE_REDUCE = _module_lib.tuple_reduce
_TUPLE_INIT = _module_lib.tuple_init


@dataclasses.dataclass(frozen=True)
class PerturbationInit:
  """Tag of the zeros a ``Module.perturb`` sows for the initialisation pass.

  ``nnx.capture(model, nnx.Perturbation)`` without differentiation returns
  zeros shaped like each perturbed value (Flax's step 1); the shim sows them
  under this tag, next to the ``perturb`` that collects the cotangent.
  """

  variable_type: type


_ZEROS = '__perturbation_init__'
# A reduced sow by a module an NNX transform slices comes back as one entry,
# stacked per slice, under ``(_SLICED, *name)`` (``slices.py``).
_SLICED = '__sliced__'  # PR: nnx_transforms


def _zeros_name(full: Path) -> Path:
  return (_ZEROS, *full)


def _last(acc, value):
  del acc
  return value


def _slicing(self, scope, variable_type, name, what: str) -> list:
  """``slices.slicing_frames``, raising naming the sow where it cannot
  tell whether a transform slices the module (none without ``slices.py``,
  where no copy that an NNX transform makes of a module is named)."""
  frames = []
  try:  # PR: nnx_transforms
    frames = slices.slicing_frames(self, variable_type, scope)
  except slices.Undecided as e:
    raise ValueError(
        f'{_where(self, variable_type, name, what)}: {e}. Flax keeps this'
        ' value in the module state, one per slice where the transform'
        ' slices the module; pass the module with in_axes=0 (all of its'
        ' state sliced) or None/nnx.Carry (none of it), or sow without'
        ' reduce_fn/init_fn and init= (a plain sow is stacked either way).'
    ) from None
  return frames


def _reduced_sow(scope, frames, value, full, tag, reduce_fn, init_fn, fixed):
  """A reduced sow: folded per slice of the innermost transform that slices
  the module (``frames``), else one accumulator in the capture."""
  if frames:  # PR: nnx_transforms
    outer = (_SLICED, *full) if scope.kind == 'nnx' else full
    sow_site(
        value,
        slices.local_name(outer, tag),
        frames[-1].tag,
        reduce_fn,
        init_fn,
        fixed_type=fixed,
    )
    return
  sow_site(value, full, tag, reduce_fn, init_fn, fixed_type=fixed)


class _OneCall:
  """The perturbation state of a module (:func:`_state_sow`), with the rank
  of each leaf in one call of the module (static: the pytree's aux data).

  The state comes back with the axes of the transforms that slice the
  module (``nnx.scan`` over layers) in front of those ranks; a cotangent
  of the perturbed value has, after those, the axes of the loops and
  ``vmap``s inside a slice (or inside the call, if nothing slices the
  module), which :func:`_as_state` sums.
  """

  def __init__(self, value, ranks: tuple[int, ...]):
    self.value, self.ranks = value, ranks


jax.tree_util.register_pytree_node(
    _OneCall,
    lambda x: ((x.value,), x.ranks),
    lambda ranks, children: _OneCall(children[0], ranks),
)


def _state_sow(scope, frames, value, full, tag) -> None:
  """Sows ``value`` as the perturbation state Flax keeps for ``full``: one
  value (the last one sown), per slice where a transform slices the module.
  """
  ranks = tuple(np.ndim(x) for x in jax.tree.leaves(value))
  value = _OneCall(value, ranks)
  structs = jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(np.shape(x), jnp.result_type(x)), value
  )
  zeros = lambda: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), structs)
  _reduced_sow(scope, frames, value, full, tag, _last, zeros, True)


def _no_jax_arrays(value) -> bool:
  """Whether no leaf of ``value`` is a JAX array or tracer: Python numbers,
  strings, NumPy arrays and scalars, which Flax keeps as they are."""
  arrays = (jax.Array, jax.core.Tracer)
  return not any(isinstance(x, arrays) for x in jax.tree.leaves(value))


_NOTHING = object()  # nothing held in Python for a name
_IN_PYTHON = object()  # the sow was folded in Python


def _fold_in_python(scope, key, value, reduce_fn, init_fn):
  """Folds a sow of Python and NumPy values (no JAX array leaf) in Python,
  as Flax does.

  At the top level of an ``nnx.capture``'s function, where Flax folds in
  Python, a name sown only with values that hold no JAX array is kept in
  Python (``scope.python``): ``0.1`` stays a ``float``, ``2**40`` an
  ``int``, a NumPy array the caller's ``np.ndarray`` (float64 if it is),
  ``np.int64(2**40)`` that scalar, and ``reduce_fn`` folds them as Flax
  does. Once a sow of the name needs the core (a JAX array, or a sow inside
  a jit, loop or other transform) the name goes to the core for the rest of
  the call, starting from what was held.

  Returns:
    ``_IN_PYTHON`` when the value was folded in Python; otherwise what was
    held for the name before (``_NOTHING`` if nothing), for the core sow to
    start from.
  """
  held = scope.python.pop(key, _NOTHING)
  if key not in scope.to_core and _no_jax_arrays(value) and scope.at_top():
    start = init_fn() if held is _NOTHING else held
    new = _NOTHING
    if _no_jax_arrays(start):
      try:
        new = reduce_fn(start, value)
      except (TypeError, AttributeError):
        pass  # e.g. v.sum(): the core folds it on arrays, as it did before
    if new is not _NOTHING and _no_jax_arrays(new):
      scope.python[key] = new
      return _IN_PYTHON
    if held is _NOTHING:
      held = start
  scope.to_core.add(key)
  return held


def _to_core(where: str, emit: tp.Callable[[], tp.Any]) -> None:
  """``emit()``, naming the sow when a Python or NumPy integer is out of
  range (the core raises rather than wrap it)."""
  try:
    emit()
  except OverflowError as e:
    raise OverflowError(
        f'{where}: {str(e).rstrip(".")}. Inside a jit, loop or other'
        ' transform (or next to a JAX array sown under the same name) a sown'
        ' Python number or NumPy value becomes a JAX array (int32/float32'
        ' while jax_enable_x64 is off, as jnp.asarray makes it); at the top'
        ' level of the captured function it is kept as it is.'
    ) from None


# --------------------------------------------------------------------------
# Module.sow / Module.perturb
# --------------------------------------------------------------------------

# Flax 0.12.8's messages, verbatim at the start, so that warning filters
# written for Flax (``message=...`` is matched from the start) keep matching.
_FLAX_GUIDE = (
    'https://flax.readthedocs.io/en/latest/guides/extracting_intermediates.html'
    ' for more information.\n'
)
_FLAX_SOW_MESSAGE = (
    "Using 'Module.sow()' outside of 'nnx.capture()' is deprecated; see\n"
    + ' ' * 8
    + _FLAX_GUIDE
    + ' ' * 8
)
_FLAX_PERTURB_MESSAGE = (
    "\n      Using 'Module.perturb()' outside of 'nnx.capture()' is deprecated;"
    ' see\n' + ' ' * 6 + _FLAX_GUIDE + ' ' * 6
)
_LEGACY_NOTE = (
    '(flax.nnx.sow: the value is kept in the attribute {name!r} of the'
    ' module; run the call under nnx.capture(...) or flax.nnx.sow.capture'
    ' to receive it as a return value instead.)'
)


def _legacy_message(what: str, name: str) -> str:
  flax_message = _FLAX_SOW_MESSAGE if what == 'sow' else _FLAX_PERTURB_MESSAGE
  return flax_message + _LEGACY_NOTE.format(name=name)


def _legacy_sow(self, variable_type, name, value, reduce_fn, init_fn):
  # Outside any capture: keep the value in a Variable attribute, as Flax's
  # Module.sow always did, so code that reads it with nnx.pop keeps working.
  if hasattr(self, name):
    variable = getattr(self, name)
    if not isinstance(variable, nnx.Variable):
      raise ValueError(
          f'Module.sow: expected the attribute {name!r} of'
          f' {type(self).__name__} to be a Variable, got'
          f' {type(variable).__name__}; sow under another name.'
      )
    if type(variable) is not variable_type:
      raise ValueError(
          f'Module.sow: expected the attribute {name!r} of'
          f' {type(self).__name__} to be of type {variable_type.__name__!r},'
          f' got {type(variable).__name__!r}; use one Variable type per name.'
      )
    variable.set_value(reduce_fn(variable.get_value(), value))
  else:
    setattr(self, name, variable_type(reduce_fn(init_fn(), value)))
  warnings.warn(
      _legacy_message('sow', name),
      DeprecationWarning,
      stacklevel=3,
  )
  return True


def _legacy_perturb(self, name, value, variable_type):
  if hasattr(self, name):
    variable = getattr(self, name)
    if not isinstance(variable, variable_type):
      raise ValueError(
          f'Module.perturb: expected the attribute {name!r} of'
          f' {type(self).__name__} to be of type {variable_type.__name__!r},'
          f' got {type(variable).__name__!r}; perturb under another name.'
      )
    current = variable.get_value()
  else:
    current = jax.tree.map(jnp.zeros_like, value)
    setattr(self, name, variable_type(current))
  warnings.warn(
      _legacy_message('perturb', name),
      DeprecationWarning,
      stacklevel=3,
  )
  return jax.tree.map(operator.add, current, value)


def _where(self, variable_type, name, what: str) -> str:
  return f'Module.{what}({variable_type.__name__}, {name!r}) in' + (
      f' {type(self).__name__}'
  )


# What gives a module a path, for the error of :func:`_unnamed`.
_NAMED_BY = ['as an argument of the captured function']
_NAMED_BY.append('refer to it from that function')  # PR: nnx_functional
_NAMED_BY.append('build it there with nnx.merge(graphdef, state)')  # PR: nnx_transforms
# The copies that have no path.
_UNNAMED_COPIES = (
    'a copy that a transform (nnx.jit, nnx.scan, nnx.split/nnx.merge,'
    ' jax.jit, ...) made of a module'
)
_UNNAMED_COPIES = (  # PR: nnx_transforms
    'a copy that a plain JAX transform (jax.jit, jax.vmap, ...) made of a'
    ' Module passed to it as a pytree: use the NNX transform (nnx.jit,'
    ' nnx.vmap, ...; graph=False works too), or let the transformed'
    ' function close over the module'
)


def _unnamed(self, variable_type, name, what: str) -> bool:
  """A sow inside a capture by a module no active capture can name.

  Raises when a capture would collect it; otherwise nothing collects it, and
  it returns ``False`` like a sow no capture requests.
  """
  if not any(scope.accepts(variable_type) for scope in LOCAL.scopes):
    return False
  ways = ', '.join(_NAMED_BY[:-1]) + ', or ' if len(_NAMED_BY) > 1 else ''
  raise ValueError(
      f'{_where(self, variable_type, name, what)}: no active capture can'
      ' tell which module this is, so the value has no name. Pass the'
      f' module (or one that contains it) {ways}{_NAMED_BY[-1]}; a module'
      ' created inside the captured function has no path, and neither has'
      f' {_UNNAMED_COPIES}.'
  )


def _locate(self, variable_type, name, what: str):
  """``paths.locate``, raising naming the sow where two modules would share
  its path."""
  try:
    return scope_lib.locate(self, variable_type)
  except SharedPathError as e:
    raise ValueError(
        f'{_where(self, variable_type, name, what)}: the module would be'
        f' named {e.path!r}, but {e.why}, so their values would be mixed.'
        ' Give the modules distinct names (pass them in one container, e.g.'
        ' nnx.Dict(encoder=..., decoder=...), or as separate arguments of a'
        ' function that takes nothing else that holds a Module).'
    ) from None


def _variable_type(variable_type, what: str) -> type:
  if isinstance(variable_type, str):
    return _variablelib.variable_type_from_name(
        variable_type, allow_register=True
    )
  if isinstance(variable_type, type) and issubclass(
      variable_type, nnx.Variable
  ):
    return variable_type
  raise TypeError(
      f'{what}: variable_type must be an nnx.Variable subclass (e.g.'
      f' nnx.Intermediate) or its collection name, got {variable_type!r}.'
  )


def module_sow(
    self,
    variable_type,
    name: str,
    value,
    reduce_fn=_TUPLE_REDUCE,
    init_fn=_TUPLE_INIT,
) -> bool:
  """``Module.sow`` on ``capture``; same signature and return as Flax 0.12.8.

  Inside a capture that knows this module, emits ``sow(value, name=(*path,
  name), tag=variable_type)``, where ``path`` is the module's path from the
  captured root. Flax's default ``reduce_fn``/``init_fn`` (a tuple of values)
  is a plain sow; any other pair (or an ``init=`` value for this name) is a
  reduced sow, whose accumulator is carried through loops. As in Flax, its
  ``reduce_fn`` may change the accumulator's type (``jnp.maximum`` from a
  scalar ``init_fn``, a tuple that grows) where the fold runs once per sow in
  Python: at the capture's top level and in ``jit``/``remat`` bodies;
  inside a loop, branch or ``vmap`` the type is fixed (``ValueError`` naming
  the sow). At the top level of an ``nnx.capture``, values that hold no
  array (Python numbers, strings) are folded in Python and keep their type
  (:func:`_fold_in_python`). The module's path comes from ``scope.py``: a
  module among the capture's arguments or referred to by the captured
  function, one inside them, a copy an NNX transform or ``nnx.merge`` made
  of one, or an object ``nnx.merge`` built from a graphdef split before the
  capture. Outside any capture it keeps Flax's legacy behaviour: the value
  goes to a Variable attribute named ``name`` (read it with ``nnx.pop``),
  with Flax's ``DeprecationWarning`` (its message begins as Flax's).

  Returns:
    ``True`` when an active capture collects ``variable_type`` exactly (or,
    outside any capture, as Flax's original returns).

  Raises:
    ValueError: inside a capture that collects ``variable_type``, when no
      capture can name this module (e.g. it was created inside the captured
      function), or when its path would be shared with another module's.
  """
  variable_type = _variable_type(variable_type, 'Module.sow')
  located = _locate(self, variable_type, name, 'sow')
  if located is None:
    if LOCAL.scopes:
      return _unnamed(self, variable_type, name, 'sow')
    return _legacy_sow(self, variable_type, name, value, reduce_fn, init_fn)
  scope, path, accepted = located
  full = (*path, name)
  state_lib.name_to_path(full)
  where = _where(self, variable_type, name, 'sow')
  init = scope.init.get(full)
  has_init = init is not None and init[0] is variable_type
  key = (full, variable_type)
  held = _held_before(scope, key, init if has_init else None, accepted,
                      value, reduce_fn, init_fn)
  if held is _IN_PYTHON:
    return True
  if reduce_fn is _TUPLE_REDUCE and not has_init:
    if held is not _NOTHING:  # the entries before, held in Python
      scope.prefix[(full, variable_type)] = held
    _to_core(where, lambda: _core_sow(value, name=full, tag=variable_type))
    return accepted
  frames = _slicing(self, scope, variable_type, name, 'sow')
  if has_init and held is init[1]:  # PR: nnx_transforms
    held = slices.init_row(frames, key, init[1])
  if held is not _NOTHING:
    if not scope.at_top():
      # This trace holds ``held`` (this call's init= value, or what it
      # folded in Python) as a constant: it must not serve a later call.
      scope.forget_traces()
    init_fn = lambda: held  # pylint: disable=unnecessary-lambda
  # A reduced sow, folded as Flax folds it: where no loop or branch carries
  # the accumulator, reduce_fn may change its type (e.g. a tuple that grows);
  # per slice where an NNX transform slices the module (slices.py).
  _to_core(
      where,
      lambda: _reduced_sow(
          scope, frames, value, full, variable_type, reduce_fn, init_fn, False
      ),
  )
  return accepted


def _held_before(scope, key, init, accepted, value, reduce_fn, init_fn):
  """What a ``Module.sow`` folds into: ``init``'s value, the accumulator
  Flax would hold in Python, ``_IN_PYTHON`` where this sow was folded there,
  or ``_NOTHING``.

  ``init``: ``(variable_type, value)`` of ``init=`` for this sow, or
  ``None``.
  """
  held = _NOTHING
  in_nnx = accepted and scope.kind == 'nnx'
  if init is not None:
    # init= holds this sow's starting value (Flax sets the attribute to it
    # before the call): the accumulator starts from it (a tuple of values
    # for the default reduce_fn, which then appends to it).
    held = init[1]
    if in_nnx and _no_jax_arrays(held) and key not in scope.to_core:
      # A Python value: Flax folds on from it in Python.
      scope.python.setdefault(key, held)
  if in_nnx and (init is None or key in scope.python):
    held = _fold_in_python(scope, key, value, reduce_fn, init_fn)
  return held


def module_perturb(self, name: str, value, variable_type=nnx.Perturbation):
  """``Module.perturb`` on ``perturb``; same signature as Flax 0.12.8.

  Inside a capture that knows this module:

  * with ``init=`` holding a value for this path and type (Flax's step 2),
    returns ``value + init_value``, so differentiating with respect to the
    ``init`` State gives the gradient of the intermediate;
  * otherwise emits ``perturb(value, name=(*path, name), tag=variable_type)``
    so a capture of a differentiated function collects the cotangent, and,
    when the capture requests ``variable_type``, sows zeros shaped like
    ``value`` (Flax's step 1 result when nothing is differentiated).

  Outside any capture it keeps Flax's legacy behaviour (a Variable
  attribute holding the perturbation, with a ``DeprecationWarning``).
  """
  variable_type = _variable_type(variable_type, 'Module.perturb')
  located = _locate(self, variable_type, name, 'perturb')
  if located is None:
    if LOCAL.scopes:
      _unnamed(self, variable_type, name, 'perturb')
      return value
    return _legacy_perturb(self, name, value, variable_type)
  scope, path, accepted = located
  full = (*path, name)
  init = scope.init.get(full)
  tag = PerturbationInit(variable_type)
  if init is not None and init[0] is variable_type:
    frames = _slicing(self, scope, variable_type, name, 'perturb')
    # Flax slices the init= value like the module's state.
    row = init[1]
    row = slices.init_row(frames, (full, variable_type), row)  # PR: nnx_transforms
    if not scope.at_top():
      # This trace (a jit or loop body JAX caches by its function) holds
      # this call's init= value as a constant: a later call, with other
      # init= values, must trace it again.
      scope.forget_traces()
    if accepted:
      _state_sow(scope, frames, row, _zeros_name(full), tag)
    return jax.tree.map(operator.add, row, value)
  if accepted and scope.kind == 'nnx':
    # nnx.capture returns zeros for a perturbation nothing differentiates
    # (Flax's step 1), shaped like the module's state: one value, per slice
    # where a transform slices the module; a functional capture has no such
    # entry.
    frames = _slicing(self, scope, variable_type, name, 'perturb')
    zeros = jax.tree.map(jnp.zeros_like, value)
    _state_sow(scope, frames, zeros, _zeros_name(full), tag)
  return _core_perturb(value, name=full, tag=variable_type)


# --------------------------------------------------------------------------
# method_outputs: what a wrapped method's output records (``hooks.py``
# wraps the methods, one wrapper per class, for this and module_outputs).
# --------------------------------------------------------------------------


def _record_method_output(  # PR: nnx_functional
    self, method_name: str, result
) -> None:
  """Sows ``result`` under ``(*path, method_name)`` for the innermost
  ``nnx.capture(..., method_outputs=T)`` that names ``self``."""
  scopes = [s for s in reversed(LOCAL.scopes) if s.method_outputs]
  if not scopes:
    return
  try:
    found = scope_lib.innermost_naming(self, scopes)
  except SharedPathError as e:
    raise ValueError(
        f'nnx.capture(method_outputs=...): the output of'
        f' {type(self).__name__}.{method_name} would be named'
        f' {(*e.path, method_name)!r}, but {e.why}; give the modules'
        ' distinct names.'
    ) from None
  if found is not None:
    scope, path = found
    full = (*path, method_name)
    key = (full, scope.method_outputs)
    # Kept in Python where Flax keeps it (a str, a Python number); an
    # output with no array leaf inside a transform is not recorded.
    held = _fold_in_python(scope, key, result, _TUPLE_REDUCE, _TUPLE_INIT)
    if held is not _IN_PYTHON and hooks.is_array_tree(result):
      if held is not _NOTHING:
        scope.prefix[key] = held
      _to_core(
          f'nnx.capture(method_outputs=...): the output of'
          f' {type(self).__name__}.{method_name}',
          lambda: _core_sow(result, name=full, tag=scope.method_outputs),
      )


hooks.method_output_recorder = _record_method_output  # PR: nnx_functional


# --------------------------------------------------------------------------
# nnx.capture
# --------------------------------------------------------------------------


def _check_variable_types(var_types, method_outputs) -> None:
  for vt in var_types:
    if not (isinstance(vt, type) and issubclass(vt, nnx.Variable)):
      raise TypeError(
          'nnx.capture: every type to capture must be an nnx.Variable'
          f' subclass (e.g. nnx.Intermediate), got {vt!r}.'
      )
  if method_outputs is not None and not (
      isinstance(method_outputs, type)
      and issubclass(method_outputs, nnx.Variable)
  ):
    raise TypeError(
        'nnx.capture: method_outputs must be an nnx.Variable subclass (e.g.'
        f' nnx.Intermediate) or None, got {method_outputs!r}.'
    )


def _init_entries(init) -> dict[Path, tuple[type, tp.Any]]:
  if init is None:
    return {}
  if not isinstance(init, tp.Mapping):
    raise TypeError(
        'nnx.capture: init must be the State a previous nnx.capture'
        f' returned (e.g. of nnx.Perturbation), got {type(init).__name__}.'
    )
  return {
      path: (type(value), value.get_value())
      for path, value in nnx.traversals.flatten_mapping(init).items()
      if isinstance(value, nnx.Variable)
  }


def _sum_entries(entries: tuple):
  if len(entries) == 1:
    return entries[0]
  try:
    return functools.reduce(
        lambda a, b: jax.tree.map(operator.add, a, b), entries
    )
  except (TypeError, ValueError):
    return entries


def _as_state(cotangent, state: _OneCall | None):
  """A cotangent of a perturbed value, summed to the shape of the module's
  perturbation ``state`` (the zeros of step 1).

  The perturbation is module state, as in Flax: one per module, one per
  slice where an ``nnx.scan``/``nnx.vmap`` slices it. A loop or ``vmap``
  inside the module's slice (a ``lax.scan``, an ``nnx.vmap`` or ``nnx.scan``
  that broadcasts the module) stacks the cotangent along one more axis,
  after the slices' axes; the gradient of the one perturbation added at
  every iteration or example (what ``init=`` does) is their sum.
  """
  if state is None:
    return cotangent
  leaves, treedef = jax.tree.flatten(cotangent)
  targets, target_def = jax.tree.flatten(state.value)
  if treedef != target_def or len(state.ranks) != len(leaves):
    return cotangent
  out = []
  for leaf, target, rank in zip(leaves, targets, state.ranks):
    sliced = np.ndim(target) - rank  # the slices' axes, in front
    extra = np.ndim(leaf) - np.ndim(target)
    if sliced >= 0 and extra > 0:
      leaf = jnp.sum(leaf, axis=tuple(range(sliced, sliced + extra)))
    out.append(leaf)
  return jax.tree.unflatten(treedef, out)


def _stacked(name: Path, entries: tuple, variable_type):  # PR: nnx_transforms
  """The one entry of the accumulators of a sliced module, stacked."""
  if len(entries) == 1:
    return entries[0]
  full = name[1:] if name[0] == _ZEROS else name
  raise ValueError(
      f'Module.sow({variable_type.__name__}, {full[-1]!r}) (named'
      f' {full!r}): a module that an nnx.scan or nnx.vmap slices reduced it in'
      f' {len(entries)} runs of the transform. Flax keeps one accumulator'
      ' per slice across them; here each run starts its own. Sow under a'
      ' name per call, or reduce the values yourself.'
  )


def _check_no_nesting(flat: dict, variable_type, perturbed, module) -> None:
  """Raises where a sown name is also the path of a submodule that sows.

  ``self.sow(T, 'block', v)`` next to ``self.block = Sub()``, whose own sows
  are named ``('block', ...)``: one State entry cannot be both a Variable and
  the submodule's State. ``perturbed``: the names ``Module.perturb`` gave.

  Raises:
    ValueError: naming the sow, the submodule and what to rename.
  """
  for name in flat:
    for k in range(1, len(name)):
      if name[:k] not in flat:
        continue
      owner, attribute = name[: k - 1], name[k - 1]
      vt = variable_type.__name__
      what, renamed = 'sow', f"self.sow({vt}, '{attribute}_out', ...)"
      if name[:k] in perturbed:
        what, renamed = 'perturb', f"self.perturb('{attribute}_out', ...)"
      classes = {}
      if module is not None:
        classes = {p: type(m).__name__ for p, m in nnx.iter_modules(module)}
      where = f' in {classes[owner]}' if owner in classes else ''
      sub = classes.get(name[:k], 'submodule')
      raise ValueError(
          f'Module.{what}({vt}, {attribute!r}){where} (named {name[:k]!r}):'
          f' {attribute!r} is also the attribute of the {sub} at'
          f' {name[:k]!r}, whose sows are named under it ({name!r}), and one'
          ' State entry cannot be both. Flax 0.12.8 keeps only the value'
          f" sown under {attribute!r} and silently drops the {sub}'s values."
          f' Rename the sow (e.g. {renamed}) or the attribute'
          f' {attribute!r}.'
      )


def _build_state(collected, variable_type, held: dict, module=None):
  """The State of one Variable type, from its own capture's ``collected``.

  A plain ``Module.sow`` gives its tuple, a reduced one its accumulator, a
  ``Module.perturb`` the sum of its cotangents (``collected.cotangents``),
  each summed to the shape of the module's perturbation (:func:`_as_state`),
  or, when nothing differentiated it, the zeros (or ``init=`` value) sown
  under :func:`_zeros_name`. ``held`` (:func:`_held`) adds the entries the
  capture did not return. Raises where a sown name is also the path of a
  submodule that sows (:func:`_check_no_nesting`).
  """
  entries = []
  states: dict[Path, _OneCall] = {}
  for name, value in collected.items():
    if isinstance(name, tuple) and name[0] == _SLICED:  # PR: nnx_transforms
      name, value = name[1:], _stacked(name[1:], value, variable_type)
    if isinstance(name, tuple) and name[0] == _ZEROS:
      states[name[1:]] = value
    entries.append((name, value))
  flat: dict[Path, tp.Any] = {}
  for name, value in entries:
    if isinstance(name, tuple) and name[0] == _ZEROS:
      full = name[1:]
      if full not in collected:
        flat[full] = value.value
    elif name in collected.cotangents:
      state = states.get(name)
      flat[name] = _sum_entries(tuple(_as_state(v, state) for v in value))
    else:
      flat[name] = value
  for name, value in held.items():
    if not isinstance(value, _Prefix):
      flat.setdefault(name, value)  # an init= entry not sown this call
    elif name not in flat:
      flat[name] = value.value
    else:  # a plain name: its entries held in Python come first
      flat[name] = (*value.value, *flat[name])
  perturbed = {*states, *collected.cotangents}
  _check_no_nesting(flat, variable_type, perturbed, module)
  return state_lib.collected_to_state(flat, variable_type)


def _held(scope, variable_type, init_entries, module) -> dict[Path, tp.Any]:
  """The entries of ``variable_type``'s State that the core did not return.

  The sows folded in Python (:func:`_fold_in_python`; for a name the core
  got later, the entries before, which come first), and, as Flax starts
  every module's captures from ``init=``, the ``init=`` entries of that type
  for a module of ``module`` that the call did not sow (e.g. a perturbation
  that runs in training only, in an evaluation call), as they were given.
  """
  out = {}
  inits = {
      path: value
      for path, (vt, value) in init_entries.items()
      if vt is variable_type
  }
  if inits:
    modules = {path for path, _ in _module_lib.iter_modules(module)}
    out.update((p, v) for p, v in inits.items() if p[:-1] in modules)
  out.update(
      (full, _Prefix(value))
      for held in (scope.python, scope.prefix)
      for (full, vt), value in held.items()
      if vt is variable_type
  )
  return out


class _Prefix(tp.NamedTuple):
  """What was held in Python for a name, before what the core returned."""

  value: tp.Any


def capture(
    fn,
    *var_types: type,
    init=None,
    method_outputs: type | None = None,
):
  """``nnx.capture`` on the functional ``capture``; same API as Flax 0.12.8.

  ``fn`` is a Module (its ``__call__`` is run), a bound method of a Module,
  or a function whose first argument is the Module (or, as in Flax, a dict,
  list or tuple of Modules, nested too, whose States are keyed by the place
  of each module there: ``{'enc': {'y': ...}}``); the decorator form
  ``nnx.capture(nnx.Intermediate)(fn)`` is accepted. The call is staged with
  ``capture`` over :func:`functional_graph_call`, so the Module's state
  updates reach the caller's objects as with ``nnx.jit``, and works inside
  and around ``nnx.jit``/``nnx.scan``/``nnx.vmap``/``jax.jit``.

  Nested captures: a sow goes to the innermost capture that requests its
  Variable type (exactly); the others pass it outward, as the functional
  rule does with tags.

  Args:
    fn: the Module, bound method, or function to run.
    *var_types: the Variable types to return, one State each, matched by
      exact type.
    init: a State from a previous capture whose ``nnx.Perturbation`` values
      ``Module.perturb`` adds to the perturbed values (Flax's step 2).
    method_outputs: when a Variable type, the output of every public method
      and ``__call__`` of the Module's submodules is sown under
      ``(*path, method_name)``.

  Returns:
    A function returning ``result`` for no types, ``(result, state)`` for
    one, ``(result, state1, state2, ...)`` for several. Each State is keyed by
    module path (``{'blocks': {0: {'act': Intermediate((y,))}}}``); a plain
    ``Module.sow`` gives a tuple of the values in call order (stacked per
    iteration inside loops), a reduced one its final accumulator, a
    ``Module.perturb`` the cotangent of the value (zeros when nothing was
    differentiated).

  Raises:
    TypeError: if a type is not an ``nnx.Variable`` subclass, or no Module is
      given.
  """
  if isinstance(fn, type) and issubclass(fn, nnx.Variable):
    all_types = (fn, *var_types)
    _check_variable_types(all_types, method_outputs)
    return lambda actual_fn: capture(
        actual_fn, *all_types, init=init, method_outputs=method_outputs
    )
  _check_variable_types(var_types, method_outputs)
  module_instance, invoke = _module_call(fn)
  init_entries = _init_entries(init)
  init_keys = tuple((key, vt) for key, (vt, _) in init_entries.items())
  init_values = [value for _, value in init_entries.values()]
  # One functional capture per type, nested: each collects its own type's
  # sows, perturbations and zeros, so two types never share a name.
  types = tuple(dict.fromkeys(var_types))
  keys = tuple(frozenset({vt, PerturbationInit(vt)}) for vt in types)

  def wrapper(*args, **kwargs):
    root_args = (args, kwargs)
    module = module_instance
    if module is None:
      if not args or not (
          _graphlib.is_graph_node(args[0]) or scope_lib.holds_module(args[0])
      ):
        raise TypeError(
            'nnx.capture: when fn is a function, its first argument must be'
            ' the Module whose intermediates are captured (or a dict, list'
            ' or tuple of Modules), got'
            f' {type(args[0]).__name__ if args else "no arguments"}.'
        )
      module, args = args[0], args[1:]
    scope = Scope(
        'nnx',
        frozenset(types),
        method_outputs if method_outputs in types else None,
        init_keys,
    )
    # As in Flax, the modules inside the first argument (a dict, list or
    # tuple of them too) are named by their place there.
    scope.inside_first = module_instance is None

    def staged(m, values, *a, **k):
      scope.init = {key: (vt, v) for (key, vt), v in zip(init_keys, values)}
      scope.start_call()
      return invoke(m, *a, **k)

    with _methods_sowing_outputs(module, method_outputs):
      result, collected = functional_graph_call(
          functools.partial(_capture_each, keys),
          staged,
          (module, init_values, *args),
          kwargs,
          scope=scope,
          refers_to=fn,
          in_place=True,
          root_args=root_args,
      )
    if not var_types:
      return result
    # One State per requested type, by exact type (a subclass of a requested
    # type is returned only when it is requested itself). A type requested
    # again gets an empty State, as Flax's split_state gives it.
    states = [
        _build_state(c, vt, _held(scope, vt, init_entries, module), module)
        for c, vt in zip(collected, types)
    ]
    by_type = dict(zip(types, states))
    return (
        result,
        *(
            by_type.pop(vt) if vt in by_type else nnx.State({})
            for vt in var_types
        ),
    )

  if not isinstance(fn, nnx.Module):
    wrapper = functools.wraps(fn)(wrapper)
  return wrapper


def _module_call(fn) -> tuple[tp.Any, tp.Callable]:
  """``(module, invoke)``: the Module ``fn`` runs (``None`` when it is the
  first argument) and ``invoke(module, *args, **kwargs)``, which runs it."""
  if isinstance(fn, nnx.Module):
    return fn, lambda m, *a, **k: m(*a, **k)
  if inspect.ismethod(fn) and isinstance(fn.__self__, nnx.Module):
    func = fn.__func__
    return fn.__self__, lambda m, *a, **k: func(m, *a, **k)
  if callable(fn):
    return None, fn
  raise TypeError(
      'nnx.capture: fn must be a Module, a bound method of a Module, or a'
      f' function whose first argument is a Module, got {fn!r}.'
  )


def _capture_each(keys: tuple, pure_f, args: tuple, kwargs: dict):
  """Runs ``pure_f`` in one functional capture per key (``tags``), nested
  with the first outermost; returns ``(out, (collected, ...))``."""
  if not keys:
    return pure_f(*args, **kwargs), ()
  inner = lambda *a, **k: _capture_each(keys[1:], pure_f, a, k)
  (out, rest), collected = stage_and_collect(inner, keys[0], args, kwargs)
  return out, (collected, *rest)


# Wraps the public methods of the given classes while a call runs, for
# ``method_outputs=`` (``hooks.wrapped``: the method wrapper that
# ``module_outputs`` shares); ``None`` without ``hooks.py``.
_wrap_methods = None
_wrap_methods = hooks.wrapped  # PR: nnx_functional


@contextlib.contextmanager
def _methods_sowing_outputs(module, method_outputs: type | None):
  """With ``method_outputs``, the public methods of the classes of
  ``module``'s submodules sow their outputs (``hooks.py``'s method wrapper)
  while the capture runs."""
  if method_outputs is None:
    yield
    return
  if _wrap_methods is None:
    raise NotImplementedError(
        'nnx.capture(method_outputs=...): this version of flax.nnx.sow does'
        ' not sow the outputs of module methods (module calls as hook'
        ' points, flax/nnx/sow/nnx/hooks.py); capture without'
        ' method_outputs=.'
    )
  classes = {
      type(m)
      for _, m in nnx.iter_graph(module, graph=True)
      if isinstance(m, nnx.Module)
  }
  with _wrap_methods(classes):
    yield


# --------------------------------------------------------------------------
# install / uninstall
# --------------------------------------------------------------------------

# Put in place of Flax's by flax_hooks.py (its inventory says why).
flax_hooks.register('module_sow', module_sow)
flax_hooks.register('module_perturb', module_perturb)
flax_hooks.register('capture', capture)
flax_hooks.register('trace_state', toplevel.opaque_trace_state)


def installed() -> bool:
  """Whether the shims and hooks are in place of Flax's originals."""
  return flax_hooks.installed()


def install() -> None:
  """Puts the shims in place of ``Module.sow``/``perturb`` and ``nnx.capture``,
  and the split/merge hooks of ``scope.py`` in Flax (``flax_hooks.py``).

  Idempotent; importing ``flax.nnx.sow`` calls it.
  """
  flax_hooks.install()


def uninstall() -> None:
  """Restores Flax's originals (``flax_hooks.py``).

  Idempotent; for code that compares against the originals (benchmarks).
  """
  flax_hooks.uninstall()
