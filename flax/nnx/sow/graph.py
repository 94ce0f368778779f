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

"""NNX graph nodes among a capture's arguments.

``capture(f)(model, x)`` traces ``f``; a Flax NNX graph node (a ``Module``,
an optimizer, ``Rngs``) among the arguments is split into its state, which is
traced like any array argument, and merged into a fresh node inside the
trace. The state ``f`` leaves on that node is returned as an extra output and
written back into the caller's node afterwards, as ``nnx.jit`` does. Shared
references between nodes are kept, since all nodes are split together.
"""

from __future__ import annotations

import contextlib
import typing as tp

import jax
from flax import nnx
from flax.nnx import graphlib


def is_graph_node(x: tp.Any) -> bool:
  """A Flax NNX graph node (``Module``, ``Rngs``, optimizer) or Variable."""
  return graphlib.is_node_module(x) or isinstance(x, nnx.Variable)


def _is_plain(path: tp.Any, variable: tp.Any) -> bool:
  del path
  return not (
      getattr(variable, 'hijax', False) or getattr(variable, 'ref', False)
  )


def _is_traced(path: tp.Any, variable: tp.Any) -> bool:
  del path
  return not getattr(variable, 'hijax', False)


class _NodeSlot:
  """Stands where a graph node was in the argument pytree."""

  __slots__ = ()

  def __repr__(self):
    return '<graph node>'


_SLOT = _NodeSlot()


class GraphArgs:
  """The arguments of one capture call, with graph nodes split into state."""

  def __init__(self, tree: tp.Any):
    leaves, self._treedef = jax.tree_util.tree_flatten(
        tree, is_leaf=is_graph_node
    )
    self._leaves = leaves
    self._positions = [i for i, x in enumerate(leaves) if is_graph_node(x)]
    self._nodes = [leaves[i] for i in self._positions]
    self._inner: list[tp.Any] | None = None
    if not self._nodes:
      self.pytree = tree
      return
    # Plain Variables are traced and written back; ref and Hijax Variables
    # are mutable references, so they reach ``f`` as they are and their
    # updates are staged into the program on the caller's objects.
    self._graphdef, state, self._refs = nnx.split(
        self._nodes, _is_traced, ...
    )
    rest = [_SLOT if is_graph_node(x) else x for x in leaves]
    self.pytree = (rest, state)

  def merge(self, pytree: tp.Any) -> tp.Any:
    """Inside the trace: the arguments with fresh nodes built from state."""
    if not self._nodes:
      return pytree
    rest, state = pytree
    nodes = nnx.merge(self._graphdef, state, self._refs)
    self._inner = nodes
    leaves = list(rest)
    for i, node in zip(self._positions, nodes):
      leaves[i] = node
    return jax.tree_util.tree_unflatten(self._treedef, leaves)

  def module_paths(self, tags: frozenset | None):
    """Inside the trace: a context in which ``Module.sow`` (the NNX shim)
    names each module by its path from the graph nodes ``f`` received."""
    from flax.nnx.sow import nnx_shims  # pylint: disable=g-import-not-at-top

    if not self._nodes:
      return contextlib.nullcontext()
    return nnx_shims.module_scope(self._inner, tags=tags)

  def outputs(self, out: tp.Any) -> tuple[tp.Any, tp.Any]:
    """Inside the trace: ``f``'s output and the nodes' state after ``f``."""
    if not self._nodes:
      return out, None
    return out, nnx.state(self._inner, _is_plain)

  def update(self, updates: tp.Any) -> None:
    """After the call: writes the new state into the caller's nodes."""
    if self._nodes:
      nnx.update(self._nodes, updates)
