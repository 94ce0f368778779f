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
* :func:`functional_graph_call` runs a staged call with NNX graph nodes among
  its arguments the way ``nnx.jit`` does (split outside, merge inside, split
  the updates, merge them back into the caller's objects).

A module learns its path from the innermost active capture (a thread-local
stack of scopes, always restored in ``finally``): objects of the captured
root are known by identity, copies made by NNX transforms are mapped back to
the caller's objects through Flax's update contexts, and a copy NNX made
without one (tree mode, ``graph_updates=False``, a user's ``nnx.merge``) is
recognised by its graph structure. No attribute is set on any module.

:func:`install` patches Flax (``Module.sow``, ``Module.perturb``,
``nnx.capture``); :func:`uninstall` restores the originals. Both are
idempotent. Every use of a Flax internal is in the block below.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
import operator
import sys
import threading
import typing as tp
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

# Flax internals used by the shims (adapt here for a new Flax release).
from flax.nnx import extract as _extract
from flax.nnx import graphlib as _graphlib
from flax.nnx import module as _module_lib
from flax.nnx import variablelib as _variablelib

from flax.nnx.sow import state as state_lib

__all__ = [
    'install',
    'uninstall',
    'installed',
    'capture',
    'module_sow',
    'module_perturb',
    'functional_graph_call',
    'module_scope',
]

Name = tp.Union[str, tuple[tp.Union[str, int], ...]]
Path = tuple[tp.Union[str, int], ...]

_TUPLE_REDUCE = _module_lib.tuple_reduce
_TUPLE_INIT = _module_lib.tuple_init
_ORIGINAL_CAPTURE = _module_lib.capture
_ORIGINAL_SOW = _module_lib.Module.sow
_ORIGINAL_PERTURB = _module_lib.Module.perturb


# --------------------------------------------------------------------------
# The functional core, looked up lazily (this file is imported by the
# package's __init__, before or after the core's modules).
# --------------------------------------------------------------------------


def _core_sow():
  return importlib.import_module('flax.nnx.sow.primitive').sow


def _core_perturb():
  try:
    return importlib.import_module('flax.nnx.sow.perturb').perturb
  except (ImportError, AttributeError):
    return None


def _core_capture():
  return importlib.import_module('flax.nnx.sow.capture').capture


# Part of the jit cache key: a jitted function traced inside a capture emits
# sows named by that capture's paths, and outside any capture Module.sow has
# its legacy behaviour, so the two must not share a cache entry.
_TRACE_KEY = jax.make_user_context(None)


@dataclasses.dataclass(frozen=True)
class PerturbationInit:
  """Tag of the zeros a ``Module.perturb`` sows for the initialisation pass.

  ``nnx.capture(model, nnx.Perturbation)`` without differentiation returns
  zeros shaped like each perturbed value (Flax's step 1); the shim sows them
  under this tag, next to the ``perturb`` that collects the cotangent.
  """

  variable_type: type


def _zeros_name(full: Path) -> Path:
  return ('__perturbation_init__', *full)


def _is_graph_leaf(x) -> bool:
  return _graphlib.is_graph_node(x) or isinstance(x, nnx.Variable)


# --------------------------------------------------------------------------
# Scopes: one per active capture, on a thread-local stack.
# --------------------------------------------------------------------------


class _Local(threading.local):

  def __init__(self):
    self.scopes: list[_Scope] = []
    self.resolving = False


_LOCAL = _Local()


class _Scope:
  """What one active capture knows: its roots, tags, records and init."""

  def __init__(
      self,
      kind: str,
      types: frozenset | None,
      method_outputs: type | None = None,
      init_keys: tuple = (),
  ):
    self.kind = kind  # 'nnx' (the nnx.capture shim) or 'functional'
    self.types = types  # accepted tags; None accepts every tag
    self.method_outputs = method_outputs
    self.init_keys = init_keys  # ((full name, Variable type), ...)
    self.init: dict[Path, tuple[type, tp.Any]] = {}
    self.nodes: dict[int, tuple[tp.Any, Path]] = {}
    self.structure: list = []
    self.records: dict[Path, tuple[str, type]] = {}
    self._by_graphdef: list | None = None

  def accepts(self, tag) -> bool:
    return self.types is None or tag in self.types

  def add_root(self, node, prefix: Path = ()) -> None:
    first = not self.nodes
    for path, obj in nnx.iter_graph(node, graph=True):
      if _graphlib.is_graph_node(obj) and not isinstance(obj, nnx.Variable):
        if id(obj) not in self.nodes:
          self.nodes[id(obj)] = (obj, (*prefix, *path))
          if first:
            self.structure.append(((*prefix, *path), type(obj)))
    self._by_graphdef = None

  def fingerprint(self):
    return (
        self.kind,
        self.types,
        self.method_outputs,
        self.init_keys,
        tuple(self.structure),
    )

  def record(self, full: Path, kind: str, variable_type: type) -> None:
    seen = self.records.get(full)
    if seen is None:
      self.records[full] = (kind, variable_type)
    elif seen != (kind, variable_type):
      raise ValueError(
          f'nnx.capture: {full!r} is sown as {seen[1].__name__} ({seen[0]})'
          f' and as {variable_type.__name__} ({kind}) in one capture; give'
          ' each its own name.'
      )

  # Path resolution ---------------------------------------------------------

  def resolve(self, obj) -> Path | None:
    hit = self.nodes.get(id(obj))
    if hit is not None and hit[0] is obj:
      return hit[1]
    node = obj
    for _ in range(64):
      node = _outer_object(node)
      if node is None:
        break
      hit = self.nodes.get(id(node))
      if hit is not None and hit[0] is node:
        self._learn(obj, hit[1])
        return hit[1]
    return self._resolve_by_structure(obj)

  def _learn(self, obj, path: Path) -> None:
    for rel, child in nnx.iter_graph(obj, graph=True):
      if _graphlib.is_graph_node(child) and not isinstance(
          child, nnx.Variable
      ):
        self.nodes.setdefault(id(child), (child, (*path, *rel)))

  def _unique_structural_match(self, obj) -> Path | None:
    if self._by_graphdef is None:
      self._by_graphdef = [
          (nnx.graphdef(o), p)
          for o, p in list(self.nodes.values())
          if isinstance(o, nnx.Module)
      ]
    graphdef = nnx.graphdef(obj)
    paths = {p for g, p in self._by_graphdef if g == graphdef}
    return paths.pop() if len(paths) == 1 else None

  def _resolve_by_structure(self, obj) -> Path | None:
    # A copy made without an update context (tree mode, graph_updates=False,
    # nnx.merge): match its graph structure against the known modules, or
    # find it under a module further up the Python call stack that matches.
    if _LOCAL.resolving or not isinstance(obj, nnx.Module):
      return None
    _LOCAL.resolving = True
    try:
      path = self._unique_structural_match(obj)
      if path is not None:
        self._learn(obj, path)
        return path
      frame = sys._getframe(3)  # pylint: disable=protected-access
      for _ in range(48):
        if frame is None:
          break
        caller = frame.f_locals.get('self')
        frame = frame.f_back
        if caller is obj or not isinstance(caller, nnx.Module):
          continue
        base = self.nodes.get(id(caller))
        base = base[1] if base is not None and base[0] is caller else None
        if base is None:
          base = self._unique_structural_match(caller)
        if base is None:
          continue
        for rel, child in nnx.iter_graph(caller, graph=True):
          if child is obj:
            self._learn(caller, base)
            return (*base, *rel)
      return None
    finally:
      _LOCAL.resolving = False


def _outer_object(obj):
  """The caller's object that an NNX transform merged into ``obj``, or None."""
  stacks = _graphlib.GRAPH_CONTEXT.update_context_stacks
  for stack in list(stacks.values()):
    for ctx in reversed(stack):
      inner = getattr(ctx, 'inner_ref_outer_index', None)
      outer = getattr(ctx, 'outer_index_outer_ref', None)
      if inner is None or outer is None or obj not in inner:
        continue
      return outer.get(inner[obj])
  return None


class _Active:
  """Pushes a scope for the duration of a call, and keys jit caches on it."""

  def __init__(self, scope: _Scope):
    self.scope = scope

  def __enter__(self):
    scopes = _LOCAL.scopes
    scopes.append(self.scope)
    self._key = _TRACE_KEY(tuple(s.fingerprint() for s in scopes))
    try:
      self._key.__enter__()
    except BaseException:
      scopes.pop()
      raise

  def __exit__(self, *exc):
    try:
      self._key.__exit__(*exc)
    finally:
      popped = _LOCAL.scopes.pop()
      assert popped is self.scope


def _locate(obj, tag) -> tuple[_Scope, Path, bool] | None:
  """The scope a module's sow is named in: innermost accepting, else innermost.

  Returns ``(scope, path, accepted)`` or ``None`` when no active capture
  knows ``obj``.
  """
  scopes = _LOCAL.scopes
  for scope in reversed(scopes):
    if scope.accepts(tag):
      path = scope.resolve(obj)
      if path is not None:
        return scope, path, True
  for scope in reversed(scopes):
    if not scope.accepts(tag):
      path = scope.resolve(obj)
      if path is not None:
        return scope, path, False
  return None


# --------------------------------------------------------------------------
# Reductions: every site of a reduced name must use the same functions.
# --------------------------------------------------------------------------

_REDUCTIONS: dict[tp.Any, tuple[tp.Callable, tp.Callable]] = {}
_REDUCTIONS_LOCK = threading.Lock()


def _function_key(fn):
  # Two lambdas written at one place (a new object per call of the method
  # that sows) are the same reduction.
  code = getattr(fn, '__code__', None)
  if code is not None and not getattr(fn, '__closure__', None):
    return ('code', code, getattr(fn, '__defaults__', None))
  return ('object', fn)


def _avals(tree):
  return jax.tree.map(lambda a: (tuple(a.shape), np.dtype(a.dtype)), tree)


def _reduction(reduce_fn, init_fn, value):
  """Canonical ``(reduce_fn, init_fn)`` for a Flax-style reduced sow.

  Flax lets ``init_fn`` return a Python scalar that ``reduce_fn`` broadcasts
  on the first call (``init_fn=lambda: 0`` with ``reduce_fn=operator.add``);
  the capture needs an accumulator of fixed shape and dtype, so the returned
  ``init_fn`` broadcasts the initial value to the accumulator's shape and
  dtype when their pytree structures agree.
  """
  init = init_fn()
  target = jax.eval_shape(reduce_fn, init, value)
  try:
    init_avals = _avals(jax.eval_shape(lambda: init))
  except TypeError:
    init_avals = None
  key = (
      _function_key(reduce_fn),
      _function_key(init_fn),
      str(jax.tree.structure(target)),
      str(_avals(target)),
  )
  with _REDUCTIONS_LOCK:
    found = _REDUCTIONS.get(key)
    if found is not None:
      return found
    same_tree = jax.tree.structure(init) == jax.tree.structure(target)
    if same_tree and init_avals != _avals(target):

      def canonical_init(init_fn=init_fn, target=target):
        return jax.tree.map(
            lambda a, t: jnp.broadcast_to(jnp.asarray(a, t.dtype), t.shape),
            init_fn(),
            target,
        )

    else:
      canonical_init = init_fn
    found = (reduce_fn, canonical_init)
    if len(_REDUCTIONS) > 4096:
      _REDUCTIONS.clear()
    _REDUCTIONS[key] = found
    return found


def _is_array_tree(value) -> bool:
  scalars = (bool, int, float, complex, np.generic)
  return all(
      isinstance(leaf, (jax.Array, np.ndarray, jax.core.Tracer, *scalars))
      for leaf in jax.tree.leaves(value)
  )


# --------------------------------------------------------------------------
# Module.sow / Module.perturb
# --------------------------------------------------------------------------

_LEGACY_MESSAGE = (
    'Module.{what}() was called outside nnx.capture(), so the value is kept'
    ' in the attribute {name!r} of the module (the legacy behaviour, to be'
    ' removed). Run the call under nnx.capture(...) or flax.nnx.sow.capture'
    ' to receive it as a return value instead.'
)


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
      _LEGACY_MESSAGE.format(what='sow', name=name),
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
      _LEGACY_MESSAGE.format(what='perturb', name=name),
      DeprecationWarning,
      stacklevel=3,
  )
  return jax.tree.map(operator.add, current, value)


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
  is a plain sow; any other pair is a reduced sow, whose accumulator is
  carried through loops. Outside any capture it keeps Flax's legacy
  behaviour: the value goes to a Variable attribute named ``name`` (read it
  with ``nnx.pop``), with a ``DeprecationWarning``.

  Returns:
    ``True`` when an active capture collects ``variable_type`` exactly (or,
    outside any capture, as Flax's original returns).
  """
  variable_type = _variable_type(variable_type, 'Module.sow')
  located = _locate(self, variable_type)
  if located is None:
    return _legacy_sow(self, variable_type, name, value, reduce_fn, init_fn)
  scope, path, accepted = located
  full = (*path, name)
  state_lib.name_to_path(full)
  scope.record(full, 'sow', variable_type)
  sow = _core_sow()
  if reduce_fn is _TUPLE_REDUCE and init_fn is _TUPLE_INIT:
    sow(value, name=full, tag=variable_type)
  else:
    reduce_fn, init_fn = _reduction(reduce_fn, init_fn, value)
    sow(
        value, name=full, tag=variable_type, reduce_fn=reduce_fn,
        init_fn=init_fn,
    )
  return accepted


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
  located = _locate(self, variable_type)
  if located is None:
    return _legacy_perturb(self, name, value, variable_type)
  scope, path, accepted = located
  full = (*path, name)
  sow = _core_sow()
  init = scope.init.get(full)
  if init is not None and init[0] is variable_type:
    if accepted:
      scope.record(full, 'perturb_init', variable_type)
      sow(
          init[1], name=_zeros_name(full), tag=PerturbationInit(variable_type)
      )
    return jax.tree.map(operator.add, init[1], value)
  if accepted:
    scope.record(full, 'perturb', variable_type)
    sow(
        jax.tree.map(jnp.zeros_like, value),
        name=_zeros_name(full),
        tag=PerturbationInit(variable_type),
    )
  perturb = _core_perturb()
  if perturb is None:
    return value
  return perturb(value, name=full, tag=variable_type)


# --------------------------------------------------------------------------
# method_outputs: wrap each public method for the duration of a capture.
# --------------------------------------------------------------------------

_WRAPPED: dict[type, tuple[int, dict[str, tp.Any]]] = {}
_WRAPPED_LOCK = threading.Lock()


def _method_output_wrapper(method_name: str, method):

  @functools.wraps(method)
  def wrapper(self, *args, **kwargs):
    result = method(self, *args, **kwargs)
    for scope in reversed(_LOCAL.scopes):
      if scope.method_outputs is None:
        continue
      path = scope.resolve(self)
      if path is None:
        continue
      if _is_array_tree(result):
        full = (*path, method_name)
        scope.record(full, 'method', scope.method_outputs)
        _core_sow()(result, name=full, tag=scope.method_outputs)
      break
    return result

  wrapper._nnx_sow_method_output = True  # pylint: disable=protected-access
  return wrapper


def _wrappable(cls, name, attr) -> bool:
  if name.startswith('_') and name != '__call__':
    return False
  if isinstance(attr, (staticmethod, classmethod, property, type)):
    return False
  return callable(attr) and not getattr(
      attr, '_nnx_sow_method_output', False
  )


def _wrap_methods(classes) -> None:
  with _WRAPPED_LOCK:
    for cls in classes:
      count, originals = _WRAPPED.get(cls, (0, None))
      if count == 0:
        originals = {}
        for name, attr in list(vars(cls).items()):
          if _wrappable(cls, name, attr):
            originals[name] = attr
            setattr(cls, name, _method_output_wrapper(name, attr))
      _WRAPPED[cls] = (count + 1, originals)


def _unwrap_methods(classes) -> None:
  with _WRAPPED_LOCK:
    for cls in classes:
      count, originals = _WRAPPED[cls]
      if count == 1:
        for name, attr in originals.items():
          setattr(cls, name, attr)
        del _WRAPPED[cls]
      else:
        _WRAPPED[cls] = (count - 1, originals)


# --------------------------------------------------------------------------
# Graph nodes among the arguments of a staged call.
# --------------------------------------------------------------------------


class _CallTag:
  """A fresh update-context tag per call (compared by identity)."""


def functional_graph_call(
    stage: tp.Callable[[tp.Callable, tuple, dict], tuple[tp.Any, tp.Any]],
    f: tp.Callable,
    args: tuple,
    kwargs: dict,
    *,
    tags: tp.Iterable[tp.Hashable] | None = None,
    scope: _Scope | None = None,
):
  """Runs ``stage`` on a pure version of ``f`` whose graph nodes are split.

  This is what ``nnx.jit`` does around ``jax.jit``, with ``stage`` in place
  of ``jax.jit``: the NNX graph nodes (Modules, Variables, Rngs, optimizers)
  among ``args``/``kwargs`` are split into pytrees of arrays plus static
  graph definitions; ``stage`` traces ``pure_f``, which merges them into
  fresh objects, calls ``f``, and splits its arguments and output again; the
  caller's objects are then updated from what ``pure_f`` returned (BatchNorm
  statistics, RNG counts, new attributes), and graph nodes in the output
  are the caller's objects. Modules met inside ``f`` (also copies made by
  NNX transforms) sow under their path from the graph-node argument they
  belong to, so ``Module.sow`` works in a functional capture too.

  Args:
    stage: ``stage(pure_f, pure_args, pure_kwargs) -> (pure_out, extra)``;
      called once. ``pure_args``/``pure_kwargs`` contain no graph nodes (only
      array leaves, Python leaves, and NNX's static graph definitions);
      ``stage`` must call ``pure_f`` on them, traced or not, and return its
      output (a pytree of arrays and static nodes) with anything else
      (``collected``).
    f: the user's function.
    args: positional arguments of ``f``.
    kwargs: keyword arguments of ``f``.
    tags: the tags the enclosing capture accepts (``None``: all); decides
      what ``Module.sow`` returns inside ``f``.
    scope: used by the ``nnx.capture`` shim; leave ``None``.

  Returns:
    ``(out, extra)``: ``f``'s output with the caller's objects in place of
    the graph nodes it returns, and ``extra`` as ``stage`` returned it.
  """
  if scope is None:
    scope = _Scope('functional', None if tags is None else frozenset(tags))
  for leaf in jax.tree.leaves((args, kwargs), is_leaf=_is_graph_leaf):
    if _graphlib.is_graph_node(leaf) and not isinstance(leaf, nnx.Variable):
      scope.add_root(leaf)
  ctxtag = _CallTag()

  def pure_f(*leaves):
    inner_args, inner_kwargs = _extract.from_tree(
        jax.tree.unflatten(in_tree, leaves), ctxtag=ctxtag, is_inner=True
    )
    for leaf in jax.tree.leaves(
        (inner_args, inner_kwargs), is_leaf=_is_graph_leaf
    ):
      if _graphlib.is_graph_node(leaf) and not isinstance(
          leaf, nnx.Variable
      ):
        scope.add_root(leaf)
    with _Active(scope):
      out = f(*inner_args, **inner_kwargs)
    args_out, kwargs_out = _extract.clear_non_graph_nodes(
        (inner_args, inner_kwargs)
    )
    return _extract.to_tree((args_out, kwargs_out, out), ctxtag=ctxtag)

  with _graphlib.update_context(ctxtag):
    pure = _extract.to_tree((args, kwargs), ctxtag=ctxtag)
    # Variables are flattened too: what reaches ``stage`` is arrays, Python
    # leaves, and Hijax Variables (which JAX tracks through its own rules).
    leaves, in_tree = jax.tree.flatten(pure)
    pure_out, extra = stage(pure_f, tuple(leaves), {})
    if _unchanged(pure, pure_out):
      # Nothing to write back: skip the merge, which would otherwise touch
      # every Variable (an error for a plain Variable when this capture runs
      # inside a jax.jit that closes over the module).
      out = pure_out[2]
    else:
      _, _, out = _extract.from_tree(pure_out, ctxtag=ctxtag, is_inner=False)
  return out, extra


def _node_states(tree) -> list:
  is_states = lambda x: isinstance(x, _extract.NodeStates)
  return [
      x for x in jax.tree.leaves(tree, is_leaf=is_states) if is_states(x)
  ]


def _unchanged(pure_in, pure_out) -> bool:
  """Whether the call left every graph node as it was (same arrays, graph)."""
  args_out, kwargs_out, out = pure_out
  if _node_states(out):
    return False
  before = _node_states(pure_in)
  after = _node_states((args_out, kwargs_out))
  if len(before) != len(after):
    return False
  for old, new in zip(before, after):
    if old.graphdef.with_no_outer_index() != new.graphdef.with_no_outer_index():
      return False
    old_leaves = jax.tree.leaves(old.states)
    new_leaves = jax.tree.leaves(new.states)
    if len(old_leaves) != len(new_leaves) or any(
        a is not b for a, b in zip(old_leaves, new_leaves)
    ):
      return False
  return True


def module_scope(nodes, tags=None) -> _Active:
  """A context in which ``Module.sow`` names modules by path from ``nodes``.

  For the functional ``capture`` when it merges graph nodes itself: enter it
  around the call of ``f`` with the merged (inner) graph nodes, each a root
  whose modules sow under ``(*path, name)``; ``tags`` are the capture's tags
  (``None``: all), which decide what ``Module.sow`` returns.
  """
  scope = _Scope('functional', None if tags is None else frozenset(tags))
  for node in nodes:
    if _graphlib.is_graph_node(node) and not isinstance(node, nnx.Variable):
      scope.add_root(node)
  return _Active(scope)


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
  entries = {}

  def visit(node, prefix):
    for key, value in node.items():
      if isinstance(value, nnx.Variable):
        entries[(*prefix, key)] = (type(value), value.get_value())
      elif isinstance(value, tp.Mapping):
        visit(value, (*prefix, key))

  visit(init, ())
  return entries


def _sum_entries(entries):
  if not isinstance(entries, tuple):
    return entries
  if len(entries) == 1:
    return entries[0]
  try:
    return functools.reduce(
        lambda a, b: jax.tree.map(operator.add, a, b), entries
    )
  except (TypeError, ValueError):
    return entries


def _build_state(scope: _Scope, collected, variable_type):
  flat: dict[Path, tp.Any] = {}
  for full, (kind, vt) in scope.records.items():
    if vt is not variable_type:
      continue
    if kind in ('sow', 'method'):
      if full not in collected:
        continue
      value = collected[full]
    elif kind == 'perturb' and full in collected:
      value = _sum_entries(collected[full])
    else:  # 'perturb' without a cotangent, or 'perturb_init'
      zeros = collected.get(_zeros_name(full))
      if not zeros:
        continue
      value = zeros[0]
    flat[full] = value
  return state_lib.collected_to_state(flat, variable_type)


def capture(
    fn,
    *var_types: type,
    init=None,
    method_outputs: type | None = None,
):
  """``nnx.capture`` on the functional ``capture``; same API as Flax 0.12.8.

  ``fn`` is a Module (its ``__call__`` is run), a bound method of a Module,
  or a function whose first argument is the Module; the decorator form
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

    def decorator(actual_fn):
      return capture(
          actual_fn, *all_types, init=init, method_outputs=method_outputs
      )

    return decorator
  _check_variable_types(var_types, method_outputs)

  if isinstance(fn, nnx.Module):
    module_instance = fn
    invoke = lambda m, *a, **k: m(*a, **k)
  elif inspect.ismethod(fn) and isinstance(fn.__self__, nnx.Module):
    module_instance = fn.__self__
    func = fn.__func__
    invoke = lambda m, *a, **k: func(m, *a, **k)
  elif callable(fn):
    module_instance = None
    invoke = fn
  else:
    raise TypeError(
        'nnx.capture: fn must be a Module, a bound method of a Module, or a'
        f' function whose first argument is a Module, got {fn!r}.'
    )
  init_entries = _init_entries(init)
  tags = set(var_types)
  tags.update(PerturbationInit(vt) for vt in var_types)
  if method_outputs is not None:
    tags.add(method_outputs)

  def wrapper(*args, **kwargs):
    if module_instance is None:
      if not args or not _graphlib.is_graph_node(args[0]):
        raise TypeError(
            'nnx.capture: when fn is a function, its first argument must be'
            ' the Module whose intermediates are captured, got'
            f' {type(args[0]).__name__ if args else "no arguments"}.'
        )
      module, args = args[0], args[1:]
    else:
      module = module_instance
    keys = tuple(init_entries)
    scope = _Scope(
        'nnx',
        frozenset(var_types) | {method_outputs} - {None}
        if method_outputs is not None
        else frozenset(var_types),
        method_outputs,
        tuple((k, init_entries[k][0]) for k in keys),
    )
    init_values = [init_entries[k][1] for k in keys]

    def staged(m, values, *a, **k):
      scope.init = {
          key: (init_entries[key][0], v) for key, v in zip(keys, values)
      }
      return invoke(m, *a, **k)

    def stage(pure_f, pure_args, pure_kwargs):
      return _core_capture()(pure_f, tags=tags)(*pure_args, **pure_kwargs)

    classes = ()
    if method_outputs is not None:
      classes = {
          type(m)
          for _, m in nnx.iter_graph(module, graph=True)
          if isinstance(m, nnx.Module)
      }
      _wrap_methods(classes)
    try:
      result, collected = functional_graph_call(
          stage, staged, (module, init_values, *args), kwargs, scope=scope
      )
    finally:
      if classes:
        _unwrap_methods(classes)
    if not var_types:
      return result
    # One State per requested type, by exact type (a subclass of a requested
    # type is returned only when it is requested itself).
    states = [_build_state(scope, collected, vt) for vt in var_types]
    return (result, *states)

  if not isinstance(fn, nnx.Module):
    wrapper = functools.wraps(fn)(wrapper)
  return wrapper


# --------------------------------------------------------------------------
# install / uninstall
# --------------------------------------------------------------------------

_INSTALL_LOCK = threading.Lock()


def installed() -> bool:
  """Whether the shims are in place of Flax's originals."""
  return nnx.capture is capture and _module_lib.Module.sow is module_sow


def install() -> None:
  """Puts the shims in place of ``Module.sow``/``perturb`` and ``nnx.capture``.

  Idempotent; importing ``flax.nnx.sow`` calls it.
  """
  with _INSTALL_LOCK:
    _module_lib.Module.sow = module_sow
    _module_lib.Module.perturb = module_perturb
    _module_lib.capture = capture
    nnx.capture = capture


def uninstall() -> None:
  """Restores Flax's original ``Module.sow``/``perturb`` and ``nnx.capture``.

  Idempotent; for code that compares against the originals (benchmarks).
  """
  with _INSTALL_LOCK:
    _module_lib.Module.sow = _ORIGINAL_SOW
    _module_lib.Module.perturb = _ORIGINAL_PERTURB
    _module_lib.capture = _ORIGINAL_CAPTURE
    nnx.capture = _ORIGINAL_CAPTURE
