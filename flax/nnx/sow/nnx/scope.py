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

Every capture call pushes a :class:`Scope` on a thread-local stack (popped in
``finally``). A scope maps graph nodes, by identity, to their path from a
root. The roots (:meth:`Scope.add_roots`) are

* the graph nodes among the capture's arguments, and
* the graph nodes the captured function refers to
  (:func:`referenced_graph_nodes`: closures, globals, bound ``self``,
  ``functools.partial`` arguments),

counting only those that hold a Module and are not inside another root.
A functional capture names them lazily (:meth:`Scope.defer_roots`): when a
module first asks for its path, or an NNX transform hands over copies;
the splits and merges Flax made before that are replayed in order. A
capture of a function that uses no NNX object walks no argument and
searches ``f`` for nothing. One
root is at ``()`` (so ``nnx.capture(model, ...)`` gives Flax's paths); with
several, an argument's root is prefixed by its position (``(0, ...)``, ``(1,
...)``, a keyword by its name, then its place inside the argument's pytree, as
``nnx.jit``'s state is keyed), and a referenced one by the variable that holds
it (``('encoder', ...)``). ``nnx.capture`` of a function names the roots
inside its first argument (a Module, or a dict, list or tuple of them) by
their place there when that argument holds every root, as Flax does
(``('enc', ...)`` for ``{'enc': m}``). Two roots never share a path: where
two would (a keyword and a closure variable of one name), ``Module.sow``
under them raises. The copies that NNX code makes during the call are named from
Flax's own split/merge, the same on every run:

1. **split/merge**: while a scope is active, Flax's ``graphlib.flatten``
   records the graphdef it returns with the object it split, and
   ``graphlib.unflatten`` gives the object it builds from a recorded graphdef
   (the same graphdef object) the paths of the split object, position by
   position. This names
   ``nnx.split``/``nnx.merge`` inside the call and NNX transforms in graph
   mode, with or without ``graph_updates``.
2. **update contexts**: an NNX transform in graph mode also maps its inner
   objects to the caller's (needed where its graphdef comes from a cache).
3. **tree-mode transforms** (``graph=False``): the arguments an NNX transform
   receives (``extract.check_no_aliases``) and the copies its function gets
   (``extract.snapshot``) are paired by pytree position.
4. An object merged from a graphdef the scope never saw split
   (``nnx.merge(graphdef, state)`` with a ``graphdef`` split before the
   capture: the functional NNX pattern) is the root at ``()``, when the
   scope has no other root and every such object has an equal graphdef.

Facts 1-3 name a module exactly (:meth:`Scope.resolve`); 4 only where no
fact 1-3 does (:class:`_Merged`). For ``module_outputs`` (``hooks.py``)
one more fact names the copy that a plain JAX transform (``jax.jit``,
``jax.vmap``, ``jax.grad``) made of a Module passed to it as a pytree: it
holds the original's static attributes, among them the table of data
attributes Flax gives each module (:meth:`Scope.follow_copy`). A sow is
named by the innermost scope that accepts it and names the module
(:func:`locate`). A module that no scope names (one created inside the
call, or a copy a plain JAX transform made of a Module pytree that
``module_outputs`` did not name) makes ``Module.sow`` raise
(``shims.py``). Nothing is kept from one call to the next, and no
attribute is set on any module. The four Flax functions are wrapped by
``flax_hooks.py`` (its inventory says why); outside a capture the wrappers
only check that the thread has no active scope.
"""

from __future__ import annotations

import dis  # PR: nnx_functional
import functools  # PR: nnx_functional
import inspect  # PR: nnx_functional
import threading
import types
import typing as tp

import jax
import numpy as np
from flax import nnx

# Flax internals (adapt here for a new Flax release).
from flax.nnx import graphlib as _graphlib
from flax.nnx import tracers as _tracers

from flax.nnx.sow.nnx import flax_hooks

Path = tuple[tp.Union[str, int], ...]

# Part of the jit cache key: a jitted function traced inside a capture emits
# sows named by that capture's paths, and outside any capture Module.sow has
# its legacy behaviour, so the two must not share a cache entry.
TRACE_KEY = jax.make_user_context(None)
# Its setting, to change the key without a ``with`` block (``trace_key``
# restores it when the captured function returns).
TRACE_KEY_CONFIG = TRACE_KEY._obj  # pylint: disable=protected-access


def is_graph_leaf(x) -> bool:
  if isinstance(x, jax.Array):
    return False  # the common case, answered without Flax's registry
  t = type(x)
  if t in _graphlib.GRAPH_REGISTRY or is_variable_type(t):
    return True
  return _graphlib.is_graph_node(x)


def is_graph_node(x) -> bool:
  """A Module, ``nnx.List``, ``Rngs``, optimizer...; not a Variable."""
  return _graphlib.is_graph_node(x) and not isinstance(x, nnx.Variable)


class _Local(threading.local):

  def __init__(self):
    self.scopes: list[Scope] = []
    # The scope itself is flattening: the hooks stand aside.
    self.busy = False  # PR: nnx_transforms
    # Graph nodes an NNX transform in tree mode received, by position.
    self.transform_args: dict | None = None  # PR: nnx_transforms
    # The bodies of the NNX transforms that may slice module state, running
    # now inside the innermost capture (``slices.py``), outermost first.
    self.frames: list = []  # PR: nnx_transforms


# Called with ``(source, copy)`` for each object Flax copies inside a
# capture (a merge from a graphdef split in the call, or a tree-mode
# transform's copy of an argument; ``slices.py``).
copy_observers: list[tp.Callable[[tp.Any, tp.Any], None]] = []  # PR: nnx_transforms


LOCAL = _Local()


_LEAF_TYPES = (
    jax.Array,
    np.ndarray,
    np.generic,
    int,
    float,
    complex,
    str,
    bytes,
    type(None),
)
_variable_types: dict[type, bool] = {}


def is_variable_type(t: type) -> bool:
  hit = _variable_types.get(t)
  if hit is None:
    hit = _variable_types[t] = issubclass(t, nnx.Variable)
  return hit


def _graph_nodes(node) -> tp.Iterator[tuple[Path, tp.Any]]:
  """``(path, obj)`` for every graph node under ``node``, itself included.

  What ``nnx.iter_graph(node, graph=True)`` yields, filtered by
  :func:`is_graph_node`, in the same order and with the same first-visit
  paths, without visiting the Variables and arrays.
  """
  registry = _graphlib.GRAPH_REGISTRY
  visited: set[int] = set()
  stack: list[tuple[Path, tp.Any, bool]] = [((), node, False)]
  while stack:
    path, obj, done = stack.pop()
    if done:
      yield path, obj
      continue
    t = type(obj)
    impl = registry.get(t)
    if impl is not None:
      if id(obj) in visited:
        continue
      visited.add(id(obj))
      stack.append((path, obj, True))
    elif is_variable_type(t) or isinstance(obj, _LEAF_TYPES):
      continue
    elif _graphlib.is_pytree_node(obj):
      if id(obj) in visited:
        continue
      visited.add(id(obj))
      impl = _graphlib.get_node_impl(obj)
      if impl is None:
        continue
    else:
      if is_graph_node(obj):  # an array ref held directly
        yield path, obj
      continue
    for key, child in reversed(impl.node_dict(obj).items()):
      stack.append(((*path, key), child, False))


def _parameter_names(f) -> list[str]:  # PR: nnx_functional
  """The names of ``f``'s positional parameters (``[]`` if unknown)."""
  try:
    params = inspect.signature(f).parameters.values()
  except (TypeError, ValueError):
    return []
  kinds = (
      inspect.Parameter.POSITIONAL_ONLY,
      inspect.Parameter.POSITIONAL_OR_KEYWORD,
  )
  return [p.name for p in params if p.kind in kinds]


def holds_module(node) -> bool:
  """Whether ``node`` (a graph node or a pytree of them) holds a Module."""
  return any(isinstance(obj, nnx.Module) for _, obj in _graph_nodes(node))


def _keys(keypath) -> Path:
  """A pytree key path as path parts (``[0]['a']`` -> ``(0, 'a')``)."""
  parts = []
  for k in keypath:
    for attr in ('key', 'idx', 'name'):
      if hasattr(k, attr):
        part = getattr(k, attr)
        break
    else:
      part = str(k)
    parts.append(part if isinstance(part, (str, int)) else str(part))
  return tuple(parts)


def _nodes_in(tree, prefix: Path) -> list[tuple[tp.Any, Path]]:
  leaves, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_graph_leaf)
  return [
      (leaf, (*prefix, *_keys(kp)))
      for kp, leaf in leaves
      if is_graph_node(leaf)
  ]


def _candidates(args: tuple, kwargs: dict, referenced) -> list:
  """``(node, path, is_arg)`` for the graph nodes among the arguments (by
  position, then keyword) and for ``referenced``, in that order."""
  from_args = [
      *(n for i, a in enumerate(args) for n in _nodes_in(a, (i,))),
      *(n for k in sorted(kwargs) for n in _nodes_in(kwargs[k], (k,))),
  ]
  candidates = [(n, p, True) for n, p in from_args]
  candidates += [(n, p, False) for n, p in referenced]
  return candidates


def _choose_roots(
    args: tuple, kwargs: dict, f, referenced, inside_first: bool = False
) -> list:
  """The roots and their paths, as the module docstring says.

  The candidates are the graph nodes among ``args``/``kwargs`` (by position
  or keyword) and ``referenced`` (:func:`referenced_graph_nodes` of ``f``);
  a root holds a Module and is not inside a root kept before it.

  Args:
    args: the positional arguments.
    kwargs: the keyword arguments.
    f: the function they are for.
    referenced: :func:`referenced_graph_nodes` of ``f``.
    inside_first: whether the first positional argument is what Flax's
      ``nnx.capture`` walks (a Module, or a dict, list or tuple of them):
      when it holds every root, each is named by its place inside it
      (``('enc',)`` for ``{'enc': m}``), as Flax names it.

  Returns:
    ``[(root, path), ...]``; one root is at ``()``.
  """
  kept = _outermost_modules(_candidates(args, kwargs, referenced))
  if inside_first and kept and all(a and p[0] == 0 for _, p, a in kept):
    return [(node, path[1:]) for node, path, _ in kept]
  if len(kept) == 1:
    return [(kept[0][0], ())]
  if len({is_arg for _, _, is_arg in kept}) > 1:  # PR: nnx_functional
    # Arguments next to variables: arguments by parameter name too, so the
    # keys of one level are all strings (an nnx.State sorts them).
    names = _parameter_names(f)
    return [
        (node, (names[p[0]], *p[1:]))
        if is_arg and isinstance(p[0], int) and p[0] < len(names)
        else (node, p)
        for node, p, is_arg in kept
    ]
  return [(node, path) for node, path, _ in kept]


def _outermost_modules(candidates):
  """The candidates that hold a Module and are not inside one kept before.

  Every graph node under a kept root is walked only once a candidate other
  than a kept root itself has to be tested (one module, passed and
  referenced, is never walked here).
  """
  kept: list[tuple[tp.Any, Path, bool]] = []
  inside: set[int] | None = None
  for node, path, is_arg in candidates:
    if any(node is k for k, _, _ in kept):
      continue
    if kept and inside is None:
      inside = {id(o) for k, _, _ in kept for _, o in _graph_nodes(k)}
    if (inside is not None and id(node) in inside) or not holds_module(node):
      continue
    kept.append((node, path, is_arg))
    if inside is not None:
      inside.update(id(obj) for _, obj in _graph_nodes(node))
  return kept


class _Merged:  # PR: nnx_transforms
  """The objects merged from a graphdef split before the capture.

  They are the root at ``()`` (the functional pattern ``nnx.merge(graphdef,
  state)``) when the capture has no other root and every such object has an
  equal graphdef; otherwise each entry says why its path is not unique.
  Walked only when a sow first asks (most captures never do).
  """

  def __init__(self):
    self.pending: list[tuple[tp.Any, tp.Any]] = []  # (graphdef, object)
    self.graphdef: tp.Any = None
    # id -> (object, path, why the path is not unique or None).
    self.nodes: dict[int, tuple[tp.Any, Path, str | None]] = {}

  def get(self, obj, structure) -> tuple[tp.Any, Path, str | None] | None:
    """``obj``'s ``(object, path, why)``, or ``None``.

    ``structure`` is the scope's other roots (``Scope.structure``): next to
    any, a merged object's path is not unique.
    """
    while self.pending:
      graphdef, node = self.pending.pop(0)
      if not holds_module(node):
        continue  # a State or Variables copied (nnx.clone, nnx.split)
      why = None
      if structure:
        why = (
            f'it was merged from a graphdef split before the capture, and'
            ' the capture also has the root'
            f' {min((p for p, _ in structure), key=len)!r}'
        )
      elif self.graphdef is None:
        self.graphdef = graphdef
      elif graphdef is not self.graphdef and not graphdef == self.graphdef:
        why = (
            'it and another object were merged from different graphdefs'
            ' split before the capture'
        )
      for rel, child in _graph_nodes(node):
        self.nodes.setdefault(id(child), (child, rel, why))
    hit = self.nodes.get(id(obj))
    return hit if hit is not None and hit[0] is obj else None


class Scope:
  """What one active capture knows: its tags, init, roots and their copies."""

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
    # nnx.capture of a function: its first argument is what Flax walks (a
    # Module, or a dict, list or tuple of them), whose roots are named by
    # their place inside it (_choose_roots).
    self.inside_first = False
    # id -> (object, path) for the roots' nodes and the copies linked to
    # them. The objects are held, so ids stay unique.
    self.nodes: dict[int, tuple[tp.Any, Path]] = {}
    # (path, type) of every node under a root, in order.
    self.structure: list[tuple[Path, type]] = []
    # graphdef id -> (graphdef, the object it was split from).
    self.splits: dict[int, tuple[tp.Any, tp.Any]] = {}  # PR: nnx_transforms
    # The same, recorded at once also while the roots are not named.
    self.split_sources: dict[int, tuple[tp.Any, tp.Any]] = {}  # PR: nnx_transforms
    # Root paths two roots would share: a sow under them raises.
    self.shared: dict[Path, str] = {}
    self.merged = _Merged()  # PR: nnx_transforms
    # Lazy roots (defer_roots): what names them, and the splits and merges
    # Flax made before they were named, replayed in order when they are.
    self._pending: tuple[tuple, dict, tp.Any] | None = None  # PR: nnx_functional
    self._events: list[tuple[bool, tp.Any, tp.Any]] = []  # PR: nnx_functional
    self._unnamed: tuple | None = None  # PR: nnx_functional
    # The JAX trace the captured function's top level runs in (trace_key).
    self._trace_state: tp.Any = None  # PR: nnx_functional
    # nnx.capture: where its function's top level runs (start_call), the
    # sows held in Python there and the names given to the core (shims.py).
    self.top_trace: tp.Any = None
    self.python: dict[tuple[Path, type], tp.Any] = {}
    self.to_core: set[tuple[Path, type]] = set()
    self.prefix: dict[tuple[Path, type], tuple] = {}
    # Set by ActiveScope: the capture runs inside the body of an NNX
    # transform that may slice module state (``slices.py``).
    self.inside_frames = False  # PR: nnx_transforms
    # follow_copy: the named modules by their table of data attributes,
    # and the sizes of ``nodes`` and ``merged.nodes`` it was built from.
    self._tables: dict[int, list] = {}  # PR: nnx_functional
    self._tables_size: tuple[int, int] | None = None  # PR: nnx_functional

  def start_call(self) -> None:
    """Marks the current JAX trace as the captured function's top level."""
    self.top_trace = _tracers.current_jax_trace()
    self.python, self.to_core, self.prefix = {}, set(), {}

  def forget_traces(self) -> None:
    """Keeps the trace being made now (e.g. a ``jax.jit`` body, which holds
    a value this call folded in Python as a constant) from serving a later
    call: the later calls' jit cache keys differ."""
    del self
    with _GENERATION_LOCK:
      _HELD_GENERATION[0] += 1

  def at_top(self) -> bool:
    """Whether the code running now is the captured function's top level
    (not the body of a jit, loop, branch or other transform inside it)."""
    return (
        self.top_trace is not None
        and _tracers.current_jax_trace() == self.top_trace
    )

  def defer_roots(  # PR: nnx_functional
      self, args: tuple, kwargs: dict, f
  ) -> None:
    """Names the roots of ``args``/``kwargs`` and ``f`` (:meth:`add_roots`)
    when a path is first asked for, not now: a call in which no module
    sows costs the scope nothing more."""
    self._pending = (args, kwargs, f)
    self._unnamed = _unnamed_key(self._cheap_fingerprint())

  def name_roots(self, args: tuple, kwargs: dict, f) -> None:
    """:meth:`add_roots` of ``args``/``kwargs`` and what ``f`` refers to."""
    self.add_roots(args, kwargs, f, referenced_graph_nodes(f))

  def _ensure_roots(self) -> None:  # PR: nnx_functional
    pending = self._pending
    if pending is None:
      return
    self._pending = None
    with _busy():
      self.name_roots(*pending)
      events, self._events = self._events, []
      for is_split, graphdef, node in events:
        if is_split:
          self.note_split(graphdef, node)
        else:
          self.note_merge(graphdef, node)
    state = self._trace_state
    if state is not None and _tracers.current_jax_trace() != state:
      # Named inside a transform f called (e.g. in a jax.jit's trace, which
      # JAX caches under the key of the unnamed scope): no later call may
      # share that key (see _unnamed_key).
      with _GENERATION_LOCK:
        if _UNNAMED_GENERATION[0] == self._unnamed[2]:
          _UNNAMED_GENERATION[0] += 1
    rekey()

  def accepts(self, tag) -> bool:
    return self.types is None or tag in self.types

  def add_roots(self, args: tuple, kwargs: dict, f, referenced) -> None:
    """Names the roots (:func:`_choose_roots`) and every node under them.

    ``f`` is the function the arguments are for; ``referenced`` is
    :func:`referenced_graph_nodes` of it.
    """
    owners: dict[Path, tp.Any] = {}
    roots = _choose_roots(
        args, kwargs, f, referenced, inside_first=self.inside_first
    )
    for root, prefix in roots:
      other = owners.setdefault(prefix, root)
      if other is not root:
        self.shared[prefix] = (
            f'two modules, a {type(other).__name__} and a'
            f' {type(root).__name__}, are both roots named {prefix!r}'
        )
      for rel, obj in _graph_nodes(root):
        if id(obj) not in self.nodes:
          path = (*prefix, *rel)
          self.nodes[id(obj)] = (obj, path)
          self.structure.append((path, type(obj)))

  def _cheap_fingerprint(self):
    return (
        self.kind,
        self.types,
        self.method_outputs,
        self.init_keys,
        _HELD_GENERATION[0],
    )

  def fingerprint(self):
    """This scope's part of the jit cache key (``trace_key``): an
    :func:`_unnamed_key` while its roots are not named, else what decides
    the names and returns of ``Module.sow`` (tags, roots' paths and
    types)."""
    if self._pending is not None:  # PR: nnx_functional
      return self._unnamed
    return (*self._cheap_fingerprint(), tuple(self.structure))

  # Resolution ----------------------------------------------------------------

  def resolve(self, obj) -> Path | None:
    """``obj``'s path from the roots and the copies linked to them."""
    self._ensure_roots()  # PR: nnx_functional
    hit = self.nodes.get(id(obj))
    if hit is not None and hit[0] is obj:
      return hit[1]
    node = obj  # PR: nnx_transforms
    for _ in range(64):  # PR: nnx_transforms
      # Through nested NNX transforms in graph mode.
      node = _outer_object(node)
      if node is None:
        return None
      hit = self.nodes.get(id(node))
      if hit is not None and hit[0] is node:
        for rel, child in _graph_nodes(obj):
          self.nodes.setdefault(id(child), (child, (*hit[1], *rel)))
        return hit[1]
    return None

  def name_of(self, obj) -> tuple[Path, str | None] | None:
    """``obj``'s path (:meth:`resolve`, else from :class:`_Merged`) and why
    it does not name one module (``None`` when it does)."""
    path = self.resolve(obj)
    if path is None:
      hit = None
      hit = self.merged.get(obj, self.structure)  # PR: nnx_transforms
      return None if hit is None else (hit[1], hit[2])
    prefixes = (path[:k] for k in range(len(path) + 1))
    return path, next(
        (self.shared[p] for p in prefixes if p in self.shared), None
    )

  # Facts from Flax (the hooks below) ----------------------------------------

  def note_split(self, graphdef, node) -> None:  # PR: nnx_transforms
    if self._pending is not None:  # PR: nnx_functional
      self._events.append((True, graphdef, node))
      return
    self.splits[id(graphdef)] = (graphdef, node)

  def note_derived(self, graphdef, derived) -> None:  # PR: nnx_transforms
    """``derived`` is ``graphdef`` with its outer index changed: an object
    merged from it is a copy of what ``graphdef`` was split from."""
    if self._pending is not None:  # PR: nnx_functional
      for is_split, split_graphdef, node in reversed(self._events):
        if is_split and split_graphdef is graphdef:
          self._events.append((True, derived, node))
          return
      return
    hit = self.splits.get(id(graphdef))
    if hit is not None and hit[0] is graphdef:
      self.splits[id(derived)] = (derived, hit[1])

  def note_merge(self, graphdef, node) -> None:  # PR: nnx_transforms
    if self._pending is not None:  # PR: nnx_functional
      self._events.append((False, graphdef, node))
      return
    if self.nodes.get(id(node), (None,))[0] is node:
      return  # an object the scope knows (a NodeRef, a reused object)
    hit = self.splits.get(id(graphdef))
    if hit is not None and hit[0] is graphdef and self.pair(hit[1], node):
      return
    self.merged.pending.append((graphdef, node))

  def pair(self, source, copy) -> bool:  # PR: nnx_transforms
    """Gives each graph node of ``copy`` the path of ``source``'s at its place.

    Returns whether ``source`` held a node this scope knows.
    """
    self._ensure_roots()  # PR: nnx_functional
    at = dict(_graph_nodes(source))
    found = False
    for rel, child in _graph_nodes(copy):
      original = at.get(rel)
      if original is None or type(original) is not type(child):
        continue
      path = self.resolve(original)
      if path is not None:
        found = True
        if child is not original:
          self.nodes.setdefault(id(child), (child, path))
        continue
      # A copy of an object merged from a graphdef split before the
      # capture takes that object's path and standing.
      hit = self.merged.get(original, self.structure)
      if hit is not None:
        found = True
        if child is not original:
          self.merged.nodes.setdefault(id(child), (child, *hit[1:]))
    return found

  def follow_copy(  # PR: nnx_functional
      self, obj
  ) -> tuple[Path, str | None] | None:
    """``obj``'s path (as :meth:`name_of` gives it) when ``obj`` is a copy
    that a plain JAX transform made of a module this scope names.

    ``jax.jit``, ``jax.vmap``, ``jax.grad``, ... given a Module as an
    argument flatten it as a pytree and unflatten a copy inside; JAX's
    unflatten gives the copy the original's static attributes by
    reference. Among them is the table of data attributes that Flax gives
    each module it constructs (``_pytree__nodes``; ``nnx.merge`` and
    ``nnx.clone`` share it too): a copy whose table and static attributes
    are those of the modules at one path is paired with them
    (:meth:`pair`: its submodules get their paths too), and the jit caches
    move on (:meth:`forget_traces`: the trace being made holds that path,
    and the next call may copy another module of an equal structure).

    Raises:
      CopyError: the modules ``obj`` may be a copy of are at several
        paths, or ``obj`` has its class's table (any module of its class
        would look the same).
    """
    matches = self._copy_sources(obj)
    if not matches:
      return None
    paths = sorted({path for _, path in matches}, key=repr)
    owned = _table(obj) is not getattr(type(obj), '_pytree__nodes', None)
    if len(paths) > 1 or not owned:
      raise CopyError(paths, owned)
    source = matches[0][0]
    self.pair(source, obj)
    if LOCAL.frames:
      with _busy():
        for observe in copy_observers:
          observe(source, obj)
    self.forget_traces()
    rekey()
    return self.name_of(obj)

  def _copy_sources(  # PR: nnx_functional
      self, obj
  ) -> list[tuple[tp.Any, Path]]:
    """The named modules whose table and static attributes ``obj`` has."""
    table = _table(obj)
    if table is None:
      return []
    self._ensure_roots()
    self.merged.get(obj, self.structure)  # walks the pending merges
    size = (len(self.nodes), len(self.merged.nodes))
    if size != self._tables_size:
      self._tables_size, self._tables = size, {}
      named = [
          *self.nodes.values(),
          *(h[:2] for h in self.merged.nodes.values()),
      ]
      for node, path in named:
        key = _table(node)
        if key is not None:
          self._tables.setdefault(id(key), []).append((node, path))
    return [
        (node, path)
        for node, path in self._tables.get(id(table), ())
        if node is not obj and _same_statics(node, obj, table)
    ]

  def note_transform_copies(  # PR: nnx_transforms
      self, outer: dict, inner: dict
  ) -> None:
    self._ensure_roots()  # PR: nnx_functional
    for key, copy in inner.items():
      original = outer.get(key)
      if original is not None and type(original) is type(copy):
        self.pair(original, copy)


def _table(obj) -> tp.Any:  # PR: nnx_functional
  """The table of data attributes of ``obj``, a Module JAX can flatten as
  a pytree (``None`` for other objects)."""
  if not getattr(type(obj), '_pytree__is_pytree', False):
    return None
  return getattr(obj, '__dict__', {}).get('_pytree__nodes')


def _same_statics(a, b, table) -> bool:  # PR: nnx_functional
  """Whether ``a`` and ``b`` have the same attributes and the same objects
  as their static (non-data) ones, as a pytree copy has its original's."""
  attrs_a, attrs_b = vars(a), vars(b)
  if attrs_a.keys() != attrs_b.keys():
    return False
  return all(
      table.get(key, False) or attrs_a[key] is value
      for key, value in attrs_b.items()
  )


class CopyError(ValueError):  # PR: nnx_functional
  """A module is a copy that a plain JAX transform made of a module, and
  which one cannot be told (:meth:`Scope.follow_copy`)."""

  def __init__(self, paths: list[Path], owned: bool):
    super().__init__(paths, owned)
    # The paths it may have; whether the modules there have tables of
    # their own (else any module of the class looks the same).
    self.paths, self.owned = paths, owned


# The generation of the keys of unnamed scopes (Scope.fingerprint): a new
# one each time a scope names its roots inside a trace JAX may have cached
# under the current generation's key (a counter, like perturb's ordinals).
_UNNAMED_GENERATION = [0]  # PR: nnx_functional
_GENERATION_LOCK = threading.Lock()
# Part of every scope's key (Scope.forget_traces): a new value each time a
# trace made inside a capture holds a value folded in Python at its top.
_HELD_GENERATION = [0]


def _unnamed_key(cheap) -> tuple:  # PR: nnx_functional
  """A scope's part of the jit cache key while its roots are not named.

  Equal for the unnamed scopes with the same tags on one thread, so that
  what JAX caches inside one capture call (an inner ``jax.jit``, an eager
  primitive) serves the next, until a scope names its roots inside such a
  trace: then the cached trace may hold ``Module.sow`` names from its
  roots, and the generation moves on, so no later call shares its key. A
  plain tuple: JAX hashes it for every eager primitive.
  """
  return ('unnamed', cheap, _UNNAMED_GENERATION[0], threading.get_ident())


class _busy:  # PR: nnx_transforms
  """While the scope flattens for itself, the hooks record nothing."""

  def __enter__(self):
    self.was = LOCAL.busy
    LOCAL.busy = True

  def __exit__(self, *exc):
    LOCAL.busy = self.was


def _outer_object(obj):  # PR: nnx_transforms
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


# ----------------------------------------------------------------------------
# Activation


class ActiveScope:
  """Pushes a scope on this thread for the duration of a capture call."""

  def __init__(self, scope: Scope):
    self.scope = scope

  def __enter__(self):
    # What a tree-mode transform received is this call's (restored after),
    # and the transform bodies around it slice nothing inside it.
    self._transform_args, LOCAL.transform_args = LOCAL.transform_args, None  # PR: nnx_transforms
    self._frames, LOCAL.frames = LOCAL.frames, []  # PR: nnx_transforms
    # Whether this capture runs inside such a body of the capture around.
    self.scope.inside_frames = bool(self._frames)  # PR: nnx_transforms
    LOCAL.scopes.append(self.scope)
    return self.scope

  def __exit__(self, *exc):
    popped = LOCAL.scopes.pop()
    assert popped is self.scope
    LOCAL.transform_args = self._transform_args  # PR: nnx_transforms
    LOCAL.frames = self._frames  # PR: nnx_transforms


class trace_key:
  """Keys jit caches on the active scopes while the captured function runs.

  The key also holds the paths of the modules split last (see
  :func:`_key_on_split`): a function an NNX transform traced for one module
  (``nnx.jit``, ``nnx.scan``, ``nnx.remat`` of one function applied to two
  modules of equal structure) has that module's path in its sows, so its
  cached trace must not serve the other module.
  """

  def __enter__(self):
    for scope in LOCAL.scopes:  # PR: nnx_functional
      if scope._pending is not None and scope._trace_state is None:  # pylint: disable=protected-access
        scope._trace_state = _tracers.current_jax_trace()  # pylint: disable=protected-access
    self._key = TRACE_KEY((_scopes_key(), ()))
    self._key.__enter__()

  def __exit__(self, *exc):
    self._key.__exit__(*exc)


def _scopes_key() -> tuple:
  """The scopes' fingerprints and how many transform bodies that may slice
  module state run now inside the innermost capture (``slices.py``: their
  sows are named and tagged differently)."""
  key = tuple(s.fingerprint() for s in LOCAL.scopes)
  key += (len(LOCAL.frames),)  # PR: nnx_transforms
  return key


def rekey() -> None:
  """Puts the scopes' fingerprints in the key again (after one named its
  roots, or a transform body started or ended) inside a captured function."""
  current = TRACE_KEY.value
  if isinstance(current, tuple) and len(current) == 2:
    key = _scopes_key()
    if key != current[0]:
      TRACE_KEY_CONFIG.swap_local((key, current[1]))


def _key_on_split(node) -> None:  # PR: nnx_transforms
  """Puts the paths of the modules in ``node`` (being split) in the key."""
  current = TRACE_KEY.value
  if not isinstance(current, tuple) or len(current) != 2:
    return  # not inside a captured function
  paths = tuple(
      tuple(scope.resolve(n) for scope in LOCAL.scopes)
      for n, _ in _nodes_in(node, ())
  )
  if paths and paths != current[1]:
    TRACE_KEY_CONFIG.swap_local((current[0], paths))


def innermost_naming(
    obj, *groups: list[Scope], follow_copies: bool = False
) -> tuple[Scope, Path] | None:
  """The first scope of ``groups`` that names ``obj``, and the path.

  The groups and their scopes are tried in order (:meth:`Scope.name_of`;
  with ``follow_copies``, then :meth:`Scope.follow_copy`).

  Raises:
    SharedPathError: (naming nothing; the caller adds the sow) when that
      path would be shared with another module.
    CopyError: (with ``follow_copies``) when ``obj`` is a copy that a plain
      JAX transform made of one of several modules.
  """
  for group in groups:
    for scope in group:
      named = scope.name_of(obj)
      if follow_copies and (  # PR: nnx_functional
          named is None
          or (named[1] is not None and scope.resolve(obj) is None)
      ):
        # Not named, or only as an object merged from a graphdef split
        # before the capture: a copy of a named module (a plain JAX
        # transform's, then perhaps split and merged again by an NNX
        # transform inside it) takes that module's path.
        named = scope.follow_copy(obj) or named
      if named is not None:
        path, why = named
        if why is not None:
          raise SharedPathError(path, why)
        return scope, path
  return None


class SharedPathError(ValueError):
  """A module's path would be shared with another module's."""

  def __init__(self, path: Path, why: str):
    super().__init__(path, why)
    self.path, self.why = path, why


def locate(obj, tag) -> tuple[Scope, Path, bool] | None:
  """The scope a module's sow is named in, and the module's path there.

  The innermost scope that accepts ``tag`` and names ``obj``, else the
  innermost other scope that does (:func:`innermost_naming`). Returns
  ``(scope, path, accepted)``, or ``None`` when no active scope names
  ``obj``.
  """
  scopes = LOCAL.scopes[::-1]
  found = innermost_naming(
      obj,
      [s for s in scopes if s.accepts(tag)],
      [s for s in scopes if not s.accepts(tag)],
  )
  if found is None:
    return None
  scope, path = found
  return scope, path, scope.accepts(tag)


# ----------------------------------------------------------------------------
# Roots a captured function refers to


def referenced_graph_nodes(f) -> list[tuple[tp.Any, Path]]:
  """Graph nodes ``f`` refers to, each with the variable that holds it.

  In a fixed order, without running ``f``: ``f`` itself (a Module, named
  ``'self'``), else what :func:`_search_references` finds in ``f`` (without
  it, only the ``__self__`` of a bound method of a graph node).
  """
  if is_graph_node(f):
    return [(f, ('self',))]
  found = []
  if isinstance(f, types.MethodType) and is_graph_node(f.__self__):
    found = [_method_self(f)]
  found = _search_references(f)  # PR: nnx_functional
  return found


def _method_self(fn: types.MethodType) -> tuple[tp.Any, Path]:
  """A bound method's ``__self__``, named by the method's first parameter."""
  code = getattr(fn.__func__, '__code__', None)
  first = code.co_varnames[0] if code and code.co_argcount else 'self'
  return fn.__self__, (first,)


def _search_references(f) -> list[tuple[tp.Any, Path]]:  # PR: nnx_functional
  """What :func:`_referenced_values` finds in ``f``, following the
  functions found there a few levels deep. Containers (``list``/``tuple``/
  ``dict``) among them are searched as pytrees, the keys added to the name.
  """
  found: list[tuple[tp.Any, Path]] = []
  seen: set[int] = set()

  def value(x, depth, name: Path):
    if id(x) in seen:
      return
    seen.add(id(x))
    if is_graph_node(x):
      found.append((x, name))
    elif isinstance(x, (list, tuple, dict)):
      try:
        nodes = _nodes_in(x, name)
      except Exception:  # pylint: disable=broad-except
        return  # not a pytree (e.g. a dict with unorderable keys)
      for node, path in nodes:
        if id(node) not in seen:
          seen.add(id(node))
          found.append((node, path))
    elif callable(x) and depth < 4:
      for child, child_name in _referenced_values(x):
        value(child, depth + 1, child_name)

  value(f, 0, ())
  return found


def _referenced_values(  # PR: nnx_functional
    fn
) -> tp.Iterator[tuple[tp.Any, Path]]:
  """What the callable ``fn`` refers to directly, each with its name.

  The arguments of a ``functools.partial`` (by parameter or keyword name)
  and its function; the ``__self__`` of a bound method (by the method's
  first parameter); ``__wrapped__``; the contents of closure cells (by the
  free variable's name) and the globals its code loads (by their name, also
  in nested functions; a global function only when it is defined in the
  same module, so library code is not searched).
  """
  if isinstance(fn, functools.partial):
    yield from _partial_values(fn)
    return
  if isinstance(fn, types.MethodType):
    yield _method_self(fn)
    fn = fn.__func__
  wrapped = getattr(fn, '__wrapped__', None)
  if wrapped is not None:
    yield wrapped, ()
  if isinstance(fn, types.FunctionType):
    yield from _closure_values(fn)
    yield from _global_values(fn)


def _partial_values(fn: functools.partial):  # PR: nnx_functional
  """A partial's function, and its arguments by parameter or keyword."""
  yield fn.func, ()
  try:
    params = list(inspect.signature(fn.func).parameters)
  except (TypeError, ValueError):
    params = []
  for i, a in enumerate(fn.args):
    yield a, (params[i] if i < len(params) else i,)
  yield from ((a, (k,)) for k, a in fn.keywords.items())


def _closure_values(fn: types.FunctionType):  # PR: nnx_functional
  """The contents of ``fn``'s closure cells, by free variable name."""
  for var, cell in zip(fn.__code__.co_freevars, fn.__closure__ or ()):
    try:
      contents = cell.cell_contents
    except ValueError:  # an empty cell
      continue
    yield contents, (var,)


def _global_values(fn: types.FunctionType):  # PR: nnx_functional
  """The globals ``fn`` loads, by name; a function only when defined in
  ``fn``'s module (library code is not searched)."""
  for name in _global_names(fn.__code__):
    x = fn.__globals__.get(name)
    if callable(x) and not is_graph_node(x):
      if getattr(x, '__globals__', None) is not fn.__globals__:
        continue  # a library function, a class, a builtin
    if x is not None:
      yield x, (name,)


@functools.lru_cache(maxsize=4096)  # PR: nnx_functional
def _global_names(code: types.CodeType) -> tuple[str, ...]:
  """The globals ``code`` (and the code nested in it) loads, in order."""
  names = {}
  for instr in dis.get_instructions(code):
    if instr.opname in ('LOAD_GLOBAL', 'LOAD_NAME'):
      names.setdefault(instr.argval, None)
  for const in code.co_consts:
    if isinstance(const, types.CodeType):
      names.update(dict.fromkeys(_global_names(const)))
  return tuple(names)


# ----------------------------------------------------------------------------
# Hooks in Flax's split/merge and tree-mode transforms


def _is_splittable(x) -> bool:  # PR: nnx_transforms
  # A graph node or a container of them (nnx.split((model, optimizer))).
  return _graphlib.is_node(x) and not isinstance(x, nnx.Variable)


def watching() -> bool:  # PR: nnx_transforms
  """Whether a capture is active and the hooks should record."""
  return _watching()


def _watching() -> bool:  # PR: nnx_transforms
  return bool(LOCAL.scopes) and not LOCAL.busy


def _flatten(original, node, /, **kwargs):  # PR: nnx_transforms
  out = original(node, **kwargs)
  if _watching() and _is_splittable(node):
    for scope in LOCAL.scopes:
      scope.split_sources[id(out[0])] = (out[0], node)
      scope.note_split(out[0], node)
    with _busy():
      _key_on_split(node)
  return out


def _unflatten(original, graphdef, state, /, **kwargs):  # PR: nnx_transforms
  node = original(graphdef, state, **kwargs)
  if _watching() and _is_splittable(node):
    with _busy():
      for scope in LOCAL.scopes:
        scope.note_merge(graphdef, node)
      if LOCAL.frames:
        source = split_source(graphdef)
        for observe in copy_observers:
          observe(source, node)
  return node


def _derived_graphdef(  # PR: nnx_transforms
    original, graphdef, /, *args, **kwargs
):
  """A graphdef with its outer index changed comes from where ``graphdef``
  was split (``nnx.fori_loop``/``while_loop`` merge from such copies)."""
  out = original(graphdef, *args, **kwargs)
  if _watching():
    for scope in LOCAL.scopes:
      scope.note_derived(graphdef, out)
  return out


def split_source(graphdef) -> tp.Any:  # PR: nnx_transforms
  """The object an active scope saw split into ``graphdef``, or None."""
  for scope in LOCAL.scopes:
    hit = scope.split_sources.get(id(graphdef))
    if hit is not None and hit[0] is graphdef:
      return hit[1]
  return None


def _by_position(trees: tp.Mapping[str, tp.Any]) -> dict:  # PR: nnx_transforms
  """The graph nodes in ``trees``, keyed by label and place."""
  return {
      path: node
      for label, tree in trees.items()
      for node, path in _nodes_in(tree, (label,))
  }


def _check_no_aliases(  # PR: nnx_transforms
    original, fn_name, /, *, check=(), **kwargs
):
  out = original(fn_name, check=check, **kwargs)
  if _watching() and not check:
    # A tree-mode transform about to run: remember what it received.
    LOCAL.transform_args = _by_position(kwargs)
  return out


def _snapshot(original, args):  # PR: nnx_transforms
  out = original(args)
  fields = getattr(args, '_fields', None)
  outer = LOCAL.transform_args
  if _watching() and outer and fields is not None:
    # Inside the transform: its function's copies of those arguments.
    inner = _by_position(dict(zip(fields, args)))
    with _busy():
      for scope in LOCAL.scopes:
        scope.note_transform_copies(outer, inner)
      if LOCAL.frames:
        for key, copy in inner.items():
          if outer.get(key) is not None:
            for observe in copy_observers:
              observe(outer[key], copy)
  return out


# Wrapped in Flax by flax_hooks.py (its inventory says why).
flax_hooks.register('graph_flatten', _flatten)  # PR: nnx_transforms
flax_hooks.register('graph_unflatten', _unflatten)  # PR: nnx_transforms
for _method in (  # PR: nnx_transforms
    'with_no_outer_index',
    'with_same_outer_index',
    'with_matching_outer_index',
):
  flax_hooks.register(f'graphdef_{_method}', _derived_graphdef)
flax_hooks.register('check_no_aliases', _check_no_aliases)  # PR: nnx_transforms
flax_hooks.register('snapshot', _snapshot)  # PR: nnx_transforms


# For ``slices.py``.
graph_nodes = _graph_nodes  # PR: nnx_transforms
outer_object = _outer_object  # PR: nnx_transforms
busy = _busy  # PR: nnx_transforms
