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

"""Modules an NNX transform slices: one module per slice, as in Flax.

In Flax 0.12.8 what ``nnx.capture`` collects is part of each module's state,
so a module that ``nnx.scan`` scans over (or ``nnx.vmap`` maps over with
``in_axes=0``) has one accumulator per slice: a reduced ``Module.sow`` is
started from ``init_fn()`` inside the body, for each layer, and the
accumulators come back stacked like the layer's state; ``init=`` values are
sliced like that state too. A broadcast or carried module keeps one
accumulator, carried through the loop. This file gives the shims
(``shims.py``) that distinction:

* **Frames.** The body of ``nnx.scan``/``nnx.vmap`` (``ScanFn``, ``VmapFn``
  and their graph-less forms, wrapped by ``flax_hooks.py``) runs as a
  :class:`Frame`: inside a core capture that takes the frame's own tag, so
  the reduced sows of the modules it slices are folded there, one iteration
  at a time (also through a ``checkpoint``, ``jit`` or loop inside the
  body); when the body returns, each accumulator is sown again as a plain
  value, which the transform stacks like its outputs.
* **Which modules a frame slices.** Flax copies a module for the body (a
  merge of the graphdef it split, or a tree-mode copy;
  ``scope.copy_observers``); the copy is sliced when every array of its
  Variables, as Flax made it, lost the leading axis of the original's (``nnx.scan`` over
  axis 0, ``nnx.vmap(in_axes=0)``), broadcast or carried when every array
  kept its shape. A copy of a copy (``nnx.remat``, ``nnx.jit`` in the body)
  is what its source is. Where the shapes do not decide it (a module with
  no array Variable, some arrays sliced and others not, an axis other than
  0, a ``StateAxes`` that puts the captured Variable type elsewhere than the
  module's state), :func:`slicing_frames` raises, and the shim names the
  sow.
* **init=.** The value of an ``init=`` entry of a sliced module is its row
  for the iteration: ``constructs/rows.py``'s ``loop_row``, taken at the top
  level of each slicing body.
"""

from __future__ import annotations

import dataclasses
import functools
import typing as tp

import jax
import numpy as np
from flax import nnx

# Flax internals (adapt here for a new Flax release).
from flax.nnx import filterlib as _filterlib
from flax.nnx.transforms import iteration as _iteration

from flax.nnx.sow.api import sow as _core_sow
from flax.nnx.sow.capturing import stage_and_collect
from flax.nnx.sow.constructs import rows
from flax.nnx.sow.nnx import flax_hooks
from flax.nnx.sow.nnx import scope as scope_lib
from flax.nnx.sow.nnx.scope import LOCAL

Path = tuple[tp.Union[str, int], ...]

# A reduced sow folded in a frame is named ``(_LOCAL, key, *outer name)``,
# where ``_TAGS[key]`` is the tag it is sown again with (names and tags are
# the same on every call, so a jit cached inside a body stays valid).
_LOCAL = '__sliced_local__'
_TAGS: dict[str, tp.Hashable] = {}


@dataclasses.dataclass(frozen=True)
class FrameTag:
  """The tag of the sows a frame folds: the frame's depth in the capture."""

  depth: int


class Undecided(ValueError):
  """Whether a transform slices a module cannot be told (see the module
  docstring); the shim adds the sow."""


@dataclasses.dataclass(eq=False)
class Frame:
  """One run of the body of an NNX transform that may slice module state.

  Attributes:
    kind: ``'nnx.scan'`` or ``'nnx.vmap'``.
    in_axes: the transform's ``in_axes``.
    depth: how many frames run around it in the innermost capture.
    loop: the body's trace (``rows.current_loop``).
    anchor: an input of an ``nnx.scan`` body that differs per iteration
      (``rows.iteration_anchor``), which the rows read so that JAX's
      partial evaluation keeps them in the loop; ``None`` for ``nnx.vmap``.
    copies: ``id(copy) -> (copy, source, shapes, root shapes)`` for the
      graph nodes Flax copied while the body ran; ``shapes`` are those of
      the arrays of the copy's and the source's Variables when Flax made the
      copy (:func:`_array_shapes`), ``root shapes`` those of the whole
      object copied.
    rows: the ``init=`` rows taken here, by ``(name, Variable type)``.
  """

  kind: str
  in_axes: tp.Any
  depth: int
  loop: tp.Any
  anchor: tp.Any
  copies: dict[int, tuple[tp.Any, tp.Any, tp.Any, tp.Any]] = dataclasses.field(
      default_factory=dict
  )
  rows: dict[tuple[Path, type], tp.Any] = dataclasses.field(
      default_factory=dict
  )

  @property
  def tag(self) -> FrameTag:
    return FrameTag(self.depth)

  def row(self, key: tuple[Path, type], value):
    """``value``'s row for this iteration, taken once per frame."""
    if key not in self.rows:
      self.rows[key] = rows.loop_row(
          value, name=key[0], loop=self.loop, anchor=self.anchor
      )
    return self.rows[key]


def _note_copy(source, copy) -> None:
  """Records the graph nodes of ``copy`` (made from ``source``) in the
  innermost frame, node by node at the same place."""
  frame = LOCAL.frames[-1]
  at = {} if source is None else dict(scope_lib.graph_nodes(source))
  root = None
  for rel, child in scope_lib.graph_nodes(copy):
    original = at.get(rel)
    if original is None or type(original) is not type(child):
      original = scope_lib.outer_object(child)
    if original is None or original is child or id(child) in frame.copies:
      continue
    if root is None:
      root = (_array_shapes(copy), _array_shapes(source or original))
    shapes = (_array_shapes(child), _array_shapes(original))
    frame.copies[id(child)] = (child, original, shapes, root)


scope_lib.copy_observers.append(_note_copy)


# ----------------------------------------------------------------------------
# Which frames slice a module


def _shape(x) -> tuple[int, ...]:
  shape = getattr(x, 'shape', None)
  return tuple(shape) if shape is not None else np.shape(x)


def _array_shapes(node) -> dict[tuple, tuple[int, ...]]:
  out = {}
  for path, x in nnx.iter_graph(node, graph=True):
    if isinstance(x, nnx.Variable):
      for i, leaf in enumerate(jax.tree.leaves(x.get_raw_value())):
        out[(*path, i)] = _shape(leaf)
  return out


def _compare(inner: dict, outer: dict) -> tuple[str, frozenset]:
  """``('sliced', axes)``, ``('same', ())``, ``('mixed', ())`` or
  ``('none', ())``: how the arrays of a copy (their shapes ``inner``) relate
  to its source's (``outer``)."""
  same = sliced = 0
  axes = None
  for path, c in inner.items():
    s = outer.get(path)
    if s is None:
      continue
    if c == s:
      same += 1
      continue
    k = {i for i in range(len(s)) if s[:i] + s[i + 1 :] == c}
    if not k:
      return 'mixed', frozenset()
    axes = k if axes is None else axes & k
    sliced += 1
  if sliced and (same or not axes):
    return 'mixed', frozenset()
  if sliced:
    return 'sliced', frozenset(axes)
  return ('same' if same else 'none'), frozenset()


def _in_axes_leaves(in_axes) -> list:
  return jax.tree.leaves(
      in_axes,
      is_leaf=lambda x: x is None
      or x is _iteration.Carry
      or isinstance(x, _iteration.StateAxes),
  )


def _state_axes_for(in_axes, variable_type) -> list:
  """The axis each ``StateAxes`` in ``in_axes`` gives a Variable of
  ``variable_type`` (what Flax's captured state would get)."""
  probe = variable_type(0)
  found = []
  for leaf in _in_axes_leaves(in_axes):
    if isinstance(leaf, _iteration.StateAxes):
      for filter_, axis in zip(leaf.filters, leaf.axes):
        if _filterlib.to_predicate(filter_)(('__captures__', 0), probe):
          found.append(axis)
          break
  return found


def _verdict(frame: Frame, entry, variable_type) -> bool:
  """Whether ``frame`` slices the copy of ``entry`` (see the docstring).

  Raises:
    Undecided: where the shapes and ``in_axes`` do not tell.
  """
  copy, _, shapes, root_shapes = entry
  how, axes = _compare(*shapes)
  if how == 'none':
    how, axes = _compare(*root_shapes)
  where = f'{frame.kind} (in_axes={frame.in_axes!r})'
  if how == 'none':
    raise Undecided(
        f'{where} copied its {type(copy).__name__} for the body, and'
        ' neither it nor what the transform received holds an array'
        ' Variable, so whether the transform slices it cannot be told'
    )
  if how == 'mixed':
    raise Undecided(
        f'{where} slices some of the Variables of its'
        f' {type(copy).__name__} and not others, so whether the module is'
        ' one per slice cannot be told'
    )
  sliced = how == 'sliced'
  ints = {a for a in _in_axes_leaves(frame.in_axes) if isinstance(a, int)}
  if sliced and (0 not in axes or (len(axes) > 1 and ints - {0})):
    raise Undecided(
        f'{where} slices its {type(copy).__name__} along an axis other'
        ' than 0 (or the shapes do not tell which); only axis 0 is'
        ' supported'
    )
  for axis in _state_axes_for(frame.in_axes, variable_type):
    if isinstance(axis, int) != sliced:
      raise Undecided(
          f'{where} gives {variable_type.__name__} Variables the axis'
          f' {axis!r} with its StateAxes, but the module state it slices'
          f' is {"sliced" if sliced else "not sliced"}'
      )
  return sliced


def slicing_frames(obj, variable_type, scope) -> list[Frame]:
  """The frames that slice ``obj`` (through the copies Flax made of it),
  outermost first; ``scope`` is the capture that names the sow.

  Raises:
    Undecided: naming the transform, where it cannot be told.
  """
  inner = LOCAL.scopes[[id(s) for s in LOCAL.scopes].index(id(scope)) + 1 :]
  if any(s.inside_frames for s in inner):
    raise Undecided(
        'it goes to a capture around an inner capture that runs inside the'
        ' body of an nnx.scan or nnx.vmap, which is not told what that'
        ' transform slices'
    )
  found = []
  x = obj
  for frame in reversed(LOCAL.frames):
    for _ in range(64):
      entry = frame.copies.get(id(x))
      if entry is None or entry[0] is not x:
        break
      if _verdict(frame, entry, variable_type):
        if not found or found[-1] is not frame:
          found.append(frame)
      x = entry[1]
  return found[::-1]


def init_row(frames: list[Frame], key: tuple[Path, type], value):
  """An ``init=`` value as the module sliced by ``frames`` sees it."""
  for frame in frames:
    value = frame.row(key, value)
  return value


def local_name(outer_name: Path, outer_tag) -> Path:
  """The name a frame folds a reduced sow under (sown again as
  ``outer_name``, tagged ``outer_tag``)."""
  key = repr(outer_tag)
  _TAGS.setdefault(key, outer_tag)
  return (_LOCAL, key, *outer_name)


# ----------------------------------------------------------------------------
# The bodies


def _run_body(kind: str, original, fn, args, kwargs):
  if not scope_lib.watching():
    return original(fn, *args, **kwargs)
  loop = rows.current_loop()
  frame = Frame(
      kind, getattr(fn, 'in_axes', None), len(LOCAL.frames), loop,
      rows.iteration_anchor((args, kwargs), loop) if kind == 'nnx.scan'
      else None,
  )
  LOCAL.frames.append(frame)
  scope_lib.rekey()
  try:
    out, collected = stage_and_collect(
        lambda *a, **k: original(fn, *a, **k),
        frozenset({frame.tag}),
        args,
        kwargs,
    )
  finally:
    LOCAL.frames.pop()
    scope_lib.rekey()
  for name, accumulator in collected.items():
    # One accumulator per slice: the transform stacks it like its outputs.
    _core_sow(accumulator, name=tuple(name[2:]), tag=_TAGS[name[1]])
  return out


def _body(hook: str, kind: str):
  original = flax_hooks.original(hook)

  @functools.wraps(original)
  def __call__(self, *args, **kwargs):  # pylint: disable=invalid-name
    return _run_body(kind, original, self, args, kwargs)

  return __call__


flax_hooks.register('scan_body', _body('scan_body', 'nnx.scan'))
flax_hooks.register('simple_scan_body', _body('simple_scan_body', 'nnx.scan'))
flax_hooks.register('vmap_body', _body('vmap_body', 'nnx.vmap'))
flax_hooks.register('simple_vmap_body', _body('simple_vmap_body', 'nnx.vmap'))
