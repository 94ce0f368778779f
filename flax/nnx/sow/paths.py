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

"""Module paths from a captured root, for ``Module.sow`` inside a capture.

Each active capture that runs NNX code pushes a :class:`Scope` on a
thread-local stack (always popped in ``finally``). A scope knows the graph
nodes of its roots by identity and resolves any module met during the call
to its path from the root: objects of the root directly, copies made by NNX
transforms (``nnx.jit``, ``nnx.scan``, ...) through Flax's update contexts,
and copies made without one (tree mode, ``graph_updates=False``, a user's
``nnx.merge``) by their graph structure. No attribute is set on any module.
"""

from __future__ import annotations

import sys
import threading
import typing as tp

import jax
from flax import nnx

# Flax internals (adapt here for a new Flax release).
from flax.nnx import graphlib as _graphlib

Path = tuple[tp.Union[str, int], ...]

# Part of the jit cache key: a jitted function traced inside a capture emits
# sows named by that capture's paths, and outside any capture Module.sow has
# its legacy behaviour, so the two must not share a cache entry.
TRACE_KEY = jax.make_user_context(None)


def is_graph_leaf(x) -> bool:
  return _graphlib.is_graph_node(x) or isinstance(x, nnx.Variable)



class _Local(threading.local):

  def __init__(self):
    self.scopes: list[Scope] = []
    self.resolving = False


LOCAL = _Local()


class Scope:
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
    # Growing reductions, folded when the State is built (nnx_shims.py).
    self.folds: dict[Path, tuple[tp.Callable, tp.Callable]] = {}
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
    if LOCAL.resolving or not isinstance(obj, nnx.Module):
      return None
    LOCAL.resolving = True
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
      LOCAL.resolving = False


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


class ActiveScope:
  """Pushes a scope for the duration of a call, and keys jit caches on it."""

  def __init__(self, scope: Scope):
    self.scope = scope

  def __enter__(self):
    scopes = LOCAL.scopes
    scopes.append(self.scope)
    self._key = TRACE_KEY(tuple(s.fingerprint() for s in scopes))
    try:
      self._key.__enter__()
    except BaseException:
      scopes.pop()
      raise

  def __exit__(self, *exc):
    try:
      self._key.__exit__(*exc)
    finally:
      popped = LOCAL.scopes.pop()
      assert popped is self.scope


def locate(obj, tag) -> tuple[Scope, Path, bool] | None:
  """The scope a module's sow is named in: innermost accepting, else innermost.

  Returns ``(scope, path, accepted)`` or ``None`` when no active capture
  knows ``obj``.
  """
  scopes = LOCAL.scopes
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
