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

"""NNX graph nodes in a capture call, and the path scope around it.

``capture(f)(model, x)``, the ``nnx.capture`` shim and ``intervene`` call
``f`` with arguments that may hold Flax NNX graph nodes (Modules, Variables,
``Rngs``, optimizers). A capture runs ``f`` on the caller's trace
(``toplevel.py``), so ``f`` gets the caller's objects and updates them in
place, as it would without the capture. ``intervene`` stages ``f``, and
:func:`functional_graph_call` does around that staging what ``nnx.jit`` does
around ``jax.jit``: split the nodes into their state outside, merge them into
fresh objects inside, and write the updates into the caller's objects
afterwards, for plain, ref and Hijax Variables. Every call, with graph nodes
among its arguments or not, runs with a path scope (``scope.py``) active, so
a ``Module.sow`` inside it is named by the module's path: from the argument
it belongs to, from a module ``f`` refers to, or from an object ``f`` builds
with ``nnx.merge``. A functional capture names its roots lazily: its
arguments are not walked and ``f`` is not searched for modules until a
module first asks for its path (``Scope.defer_roots``), so capturing a
function that uses no NNX object costs the NNX layer O(1) per call.
"""

from __future__ import annotations

import functools
import typing as tp

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from flax.nnx.sow import collect
from flax.nnx.sow.nnx.scope import ActiveScope
from flax.nnx.sow.nnx.scope import Scope
from flax.nnx.sow.nnx.scope import is_graph_leaf
from flax.nnx.sow.nnx.scope import is_graph_node as _is_graph_node
from flax.nnx.sow.nnx.scope import is_variable_type
from flax.nnx.sow.nnx.scope import trace_key


def _is_traced(path: tp.Any, variable: tp.Any) -> bool:  # PR: nnx_functional
  """Plain and ref Variables are traced; Hijax Variables pass as they are."""
  del path
  return not getattr(variable, 'hijax', False)


def _is_plain(path: tp.Any, variable: tp.Any) -> bool:  # PR: nnx_functional
  """Plain Variables are written back; ref and Hijax ones mutate in place."""
  del path
  return not (
      getattr(variable, 'hijax', False) or getattr(variable, 'ref', False)
  )


class _Slot(tp.NamedTuple):  # PR: nnx_functional
  """Stands for the ``index``-th graph node where it was in a pytree."""

  index: int


class _NewNode(tp.NamedTuple):  # PR: nnx_functional
  """A graph node ``f`` made and returned, split to cross the staging."""

  graphdef: tp.Any
  state: tp.Any


def functional_graph_call(
    stage: tp.Callable[[tp.Callable, tuple, dict], tuple[tp.Any, tp.Any]],
    f: tp.Callable,
    args: tuple,
    kwargs: dict,
    *,
    tags: tp.Iterable[tp.Hashable] | None = None,
    scope: Scope | None = None,
    refers_to: tp.Any = None,
    in_place: bool = False,
    root_args: tuple[tuple, dict] | None = None,
) -> tuple[tp.Any, tp.Any]:
  """Runs ``stage`` on ``f`` with a path scope active and graph nodes split.

  With ``in_place=True`` (``stage`` runs ``f`` on the caller's trace, as a
  capture does) the graph nodes are not split: ``f`` gets them as they are.

  The scope's roots are the graph nodes among ``args``/``kwargs`` (or
  ``root_args``) and those ``refers_to`` (default ``f``) refers to
  (``scope.referenced_graph_nodes``), named as ``scope.py`` says: one
  root at ``()``, several by argument position or variable name. Without
  graph nodes among the arguments, ``stage`` runs
  on ``f`` itself. With them, this is what ``nnx.jit`` does around
  ``jax.jit``, with ``stage`` in place of ``jax.jit``: the graph nodes and
  Variables are split together (shared references are kept) into the state
  of their plain and ref Variables, which ``stage`` traces, and their Hijax
  Variables, which reach ``f`` as they are (JAX stages their updates on the
  caller's objects). Inside, ``pure_f`` merges fresh nodes, calls ``f``, and
  returns the plain Variables' new state; afterwards the caller's nodes are
  updated from it, unless nothing changed (so a capture inside a ``jax.jit``
  that closes over a model which does not update its state works). Ref
  Variables are updated in place.

  Args:
    stage: ``stage(pure_f, pure_args, pure_kwargs) -> (pure_out, extra)``;
      must call ``pure_f(*pure_args, **pure_kwargs)`` once, traced or not,
      and return its output with anything else (``collected``).
    f: the user's function.
    args: positional arguments of ``f``.
    kwargs: keyword arguments of ``f``.
    tags: the tags the enclosing capture accepts (``None``: all); they decide
      what ``Module.sow`` returns inside ``f``.
    scope: the path scope to use (the ``nnx.capture`` shim passes its own).
    refers_to: where to look for the graph nodes ``f`` refers to, when ``f``
      wraps the user's function.
    in_place: whether ``stage`` runs ``f`` on the caller's trace, where it
      may update the caller's objects itself.
    root_args: ``(args, kwargs)`` whose graph nodes are the roots, when
      ``args`` holds more than the user's arguments.

  Returns:
    ``(out, extra)``: ``f``'s output, where a graph node that ``f`` received
    and returned is the caller's object, and ``extra`` as ``stage`` returned
    it.
  """
  lazy = scope is None
  if lazy:
    scope = Scope('functional', None if tags is None else frozenset(tags))
  named_args, named_kwargs = (args, kwargs) if root_args is None else root_args
  user_f = f if refers_to is None else refers_to
  nodes = []
  if not in_place:  # else ``f`` gets the arguments as they are
    args, kwargs, leaves, treedef, positions = _graph_leaves(args, kwargs)
    nodes = [leaves[i] for i in positions]
  # With no graph node to split, a functional capture names its roots when
  # a module first asks for its path.
  name_roots = scope.name_roots
  if lazy and not nodes:  # PR: nnx_functional
    name_roots = scope.defer_roots
  name_roots(named_args, named_kwargs, user_f)
  with ActiveScope(scope):
    if not nodes:
      return stage(_keyed(f), args, kwargs)
    if not graph_node_calls:
      raise NotImplementedError(
          'intervene: the arguments of the function hold an NNX graph node'
          f' or Variable ({type(nodes[0]).__name__}); this version of'
          ' flax.nnx.sow cannot pass them through the staging (split and'
          ' merged as nnx.jit does), so their updates and module paths would'
          ' be lost. Pass their arrays instead.'
      )
    call = graph_node_calls[-1]
    return call(stage, f, scope, leaves, treedef, positions, nodes)


# How a call that stages ``f`` (``intervene``) passes the NNX graph nodes
# among its arguments: ``call(stage, f, scope, leaves, treedef, positions,
# nodes)``, the last one registered (:func:`_graph_node_call` below, which
# splits them as ``nnx.jit`` does). Without one such a call raises.
graph_node_calls: list[tp.Callable[..., tuple[tp.Any, tp.Any]]] = []


def _graph_leaves(args, kwargs):
  """``(args, kwargs)`` flattened to graph leaves, and the positions of the
  graph nodes among them; NumPy arrays become JAX arrays, as they would
  traced (run in place, ``f`` gets the caller's objects, NumPy arrays
  included).

  Returns:
    ``(args, kwargs, leaves, treedef, positions)``.
  """
  leaves, treedef = jax.tree.flatten((args, kwargs), is_leaf=is_graph_leaf)
  positions = [
      i
      for i, x in enumerate(leaves)
      if not isinstance(x, jax.Array) and is_graph_leaf(x)
  ]
  if any(isinstance(x, np.ndarray) for x in leaves):
    leaves = [
        jnp.asarray(x) if isinstance(x, np.ndarray) else x for x in leaves
    ]
    args, kwargs = jax.tree.unflatten(treedef, leaves)
  return args, kwargs, leaves, treedef, positions


def _keyed(f):
  @functools.wraps(f)
  def keyed_f(*a, **k):
    with trace_key():
      return f(*a, **k)

  return keyed_f


def _is_plain_variable(x) -> bool:  # PR: nnx_functional
  return is_variable_type(type(x)) and _is_plain(None, x)


def _cross_out(out, inner):  # PR: nnx_functional
  """``out`` with the graph nodes of ``inner`` as ``_Slot``s and the graph
  nodes ``f`` made split, so that it can leave the staging."""
  index = {id(node): k for k, node in enumerate(inner)}

  def cross(x):
    if id(x) in index:
      return _Slot(index[id(x)])
    if is_graph_leaf(x):
      return _NewNode(*nnx.split(x))
    return x

  return jax.tree.map(cross, out, is_leaf=is_graph_leaf)


def _uncross_out(out, nodes):  # PR: nnx_functional
  def uncross(x):
    if isinstance(x, _Slot):
      return nodes[x.index]
    if isinstance(x, _NewNode):
      return nnx.merge(x.graphdef, x.state)
    return x

  return jax.tree.map(
      uncross, out, is_leaf=lambda x: isinstance(x, (_Slot, _NewNode))
  )


# What ``_variables_call``'s staged function returns for a Variable ``f``
# left alone (a static output, which comes back as this very object).
_UNCHANGED = object()  # PR: nnx_functional


def _variables_call(  # PR: nnx_functional
    stage, f, leaves, treedef, positions, variables
):
  """:func:`_split_call` when the graph leaves are plain Variables only
  (an ``nnx.State`` among the arguments).

  Variables are pytrees whose one leaf is their value: ``stage`` rebuilds
  them under its trace, so ``f`` gets fresh Variables it may update, and
  the new values are written back to the caller's Variables. Flax's graph
  split and merge are not needed.
  """
  unique = list({id(v): v for v in variables}.values())
  slot = {id(v): k for k, v in enumerate(unique)}
  rest = list(leaves)
  for i in positions:
    rest[i] = _Slot(slot[id(leaves[i])])

  def pure_f(rest, fresh):
    before = [v.get_raw_value() for v in fresh]
    full = [fresh[x.index] if isinstance(x, _Slot) else x for x in rest]
    inner_args, inner_kwargs = jax.tree.unflatten(treedef, full)
    with trace_key():
      out = f(*inner_args, **inner_kwargs)
    after = [v.get_raw_value() for v in fresh]
    # Told apart here, where an unchanged value is the staged input itself.
    return _cross_out(out, fresh), [
        _UNCHANGED if new is old else new for old, new in zip(before, after)
    ]

  (out, after), extra = stage(pure_f, (rest, unique), {})
  for v, new in zip(unique, after):
    if new is not _UNCHANGED:
      v.set_raw_value(new)
  return _uncross_out(out, unique), extra


def _leaves_by_path(state) -> dict:  # PR: nnx_functional
  """The leaves of each Variable of ``state``, by path."""
  return {path: jax.tree.leaves(v) for path, v in nnx.to_flat_state(state)}


def _changed(before: dict, after):  # PR: nnx_functional
  """The Variables of the State ``after`` whose leaves are not ``before``'s
  (:func:`_leaves_by_path` of the staged inputs, taken before ``f`` ran).

  Compared by identity while ``f`` is staged, where a value ``f`` left
  alone is the staged input itself: the caller's Variable is then not
  written to, so it keeps its value as it was (a NumPy array stays that
  object; the staged program would return it as a JAX array), and a
  Variable of another trace (a ``jax.vmap`` around the call) is not
  mutated where ``f`` does not mutate it.
  """
  changed = []
  for path, v in nnx.to_flat_state(after):
    old, new = before.get(path), jax.tree.leaves(v)
    if (
        old is None
        or len(old) != len(new)
        or any(a is not b for a, b in zip(old, new))
    ):
      changed.append((path, v))
  return nnx.from_flat_state(changed)


def _split_call(  # PR: nnx_functional
    stage, f, scope, leaves, treedef, positions, nodes
):
  graphdef, plain, refs, kept = nnx.split(nodes, _is_plain, _is_traced, ...)
  rest = list(leaves)
  for k, i in enumerate(positions):
    rest[i] = _Slot(k)

  def pure_f(rest, plain, refs):
    before = _leaves_by_path(plain)  # ``f`` may update these Variables
    inner = nnx.merge(graphdef, plain, refs, kept)
    full = list(rest)
    for i, node in zip(positions, inner):
      full[i] = node
    # The fresh nodes get the caller's paths (the merge hook usually has
    # given them already).
    if not all(
        scope.resolve(n) is not None for n in inner if _is_graph_node(n)
    ):
      scope.pair(nodes, inner)
    inner_args, inner_kwargs = jax.tree.unflatten(treedef, full)
    with trace_key():
      out = f(*inner_args, **inner_kwargs)
    return _cross_out(out, inner), _changed(before, nnx.state(inner, _is_plain))

  (out, updates), extra = stage(pure_f, (rest, plain, refs), {})
  if updates:
    nnx.update(nodes, updates)
  return _uncross_out(out, nodes), extra


def _graph_node_call(  # PR: nnx_functional
    stage, f, scope, leaves, treedef, positions, nodes
):
  if all(_is_plain_variable(n) for n in nodes):
    return _variables_call(stage, f, leaves, treedef, positions, nodes)
  return _split_call(stage, f, scope, leaves, treedef, positions, nodes)


graph_node_calls.append(_graph_node_call)  # PR: nnx_functional


# The NNX layer around every capture and intervene call: the path scope for
# ``Module.sow``, and the NNX graph nodes among the arguments.
collect.call_hooks.append(functional_graph_call)
collect.opaque_leaf_checks.append(is_graph_leaf)
