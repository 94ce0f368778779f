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

"""``loop_indices()``: where an ``intervene`` callable is, loop by loop.

A callable replacement (or a hook) runs once per sow *site*, and inside a
``lax.scan`` (an ``nnx.scan`` over stacked layers, a ``fori_loop`` with
static bounds) one site is every iteration. ``loop_indices()`` called inside
the callable returns the iteration it is applied at, as the row of the entry
``capture`` stacks for that site, so one callable can patch one layer or one
step (TransformerLens's ``hook.layer()``; JAX's ``lax.axis_index`` is the
same idea for mapped axes).

How it reaches the callable: the ``scan`` rule of ``intervene`` pushes a
:class:`Frame` while it rewrites its body. A first rewrite runs without an
index; a callable that asks for it there raises :class:`IndexNeeded`, and the
rule rewrites the body again with ``iota(length)`` as one more ``xs``, whose
row the frame then holds. A program whose callables do not ask is rewritten
exactly as without this module. A rewrite nested in the body (a ``jit``,
``checkpoint``, ``cond`` or custom rule inside it) closes over the index of
the body, so it is not cached (the cache would keep a tracer of a finished
trace).
"""

from __future__ import annotations

import contextlib
import threading
import typing as tp

import jax
import jax.numpy as jnp

# The state of a frame whose loop has no index (a ``while_loop``).
_UNAVAILABLE = object()


class Frame:
  """One loop whose body ``intervene`` is rewriting."""

  __slots__ = ('construct', 'index', 'reads')

  def __init__(self, construct: str, index: tp.Any = None):
    self.construct = construct
    self.index = index  # None: not provided (yet); a tracer: this row
    self.reads = 0


class IndexNeeded(Exception):
  """A callable asked for the index of ``frame``, rewritten without one."""

  def __init__(self, frame: Frame):
    super().__init__(frame.construct)
    self.frame = frame


class _State(threading.local):

  def __init__(self):
    self.frames: list[Frame] = []
    self.sites: list[str] = []  # the sows whose callables are running
    # Per running callable: the length of the indices it last asked for.
    self.asked: list[int | None] = []


_STATE = _State()


def loop_indices() -> tuple[tp.Any, ...]:
  """The iteration indices of the loops around the sow being replaced.

  Call it inside a callable replacement or a hook of :func:`intervene`.
  ``loop_indices()[k]`` is the iteration of the ``k``-th enclosing
  ``lax.scan`` (outermost first): the row of the entry ``capture`` stacks
  for the site, so with ``reverse=True`` it is the index of ``xs``, not the
  step count, and inside an ``nnx.scan`` over stacked layers it is the
  layer. A sow outside any loop gets ``()``. Under ``jax.vmap`` the index is
  the same for every example, and the derivatives of the replaced program
  (a ``jax.grad`` inside or around the intervened function) see the index
  of the forward iteration.

  >>> import jax, jax.numpy as jnp
  >>> from flax.nnx.sow import intervene, loop_indices, sow
  >>> def f(xs):
  ...   def body(c, x):
  ...     return c + sow(x, name='x'), None
  ...   return jax.lax.scan(body, 0.0, xs)[0]
  >>> only_step_2 = lambda v: jnp.where(loop_indices()[0] == 2, 10.0, v)
  >>> float(intervene(f, {'x': only_step_2})(jnp.ones(4)))
  13.0

  Returns:
    A tuple of int32 scalars, one per enclosing loop.

  Raises:
    RuntimeError: outside a callable that ``intervene`` applies.
    ValueError: for a sow inside a ``lax.while_loop`` (or a ``fori_loop``
      with traced bounds), whose iterations have no index: carry a counter
      and sow it, or use a ``scan``/``fori_loop`` with static bounds.

  Subscripting the result past the loops around the sow raises the tuple's
  ``IndexError``, with a note naming the sow and how many loops it is in.
  """
  if not _STATE.sites:
    raise RuntimeError(
        'loop_indices() is called outside a callable that intervene applies;'
        ' call it inside values[name] = fn or a hook, where it returns the'
        ' iteration of the loops around the sow being replaced.'
    )
  indices = []
  for frame in _STATE.frames:
    if frame.index is _UNAVAILABLE:
      raise ValueError(
          f'loop_indices(): sow {_STATE.sites[-1]} is inside'
          f' {frame.construct}, whose iterations have no index. Carry a'
          ' counter in the loop and sow it, or use a `lax.scan` or a'
          ' `fori_loop` with static bounds.'
      )
    if frame.index is None:
      raise IndexNeeded(frame)
    frame.reads += 1
    indices.append(frame.index)
  _STATE.asked[-1] = len(indices)
  return tuple(indices)


@contextlib.contextmanager
def applying(site: str):
  """Marks a callable of ``intervene`` as running for ``site``.

  An ``IndexError`` of a tuple raised by the callable after it asked for
  :func:`loop_indices` gets a note that says how many loops the sow is in
  (``loop_indices()[0]`` at a sow outside any loop, say); the indices stay
  a plain tuple.
  """
  _STATE.sites.append(site)
  _STATE.asked.append(None)
  try:
    yield
  except IndexError as e:
    n = _STATE.asked[-1]
    if n is not None and 'tuple index out of range' in str(e):
      where = (
          'is in no loop, so loop_indices() is ()'
          if n == 0
          else f'is inside {n} loop(s), so loop_indices() has {n} index(es),'
          ' the outermost loop first'
      )
      e.add_note(
          f'loop_indices(): sow {site} {where}. A hook that also serves'
          ' sows outside loops can test len(loop_indices()) first.'
      )
    raise
  finally:
    _STATE.sites.pop()
    _STATE.asked.pop()


@contextlib.contextmanager
def frame(construct: str, index: tp.Any = None):
  """Pushes a frame for a loop body being rewritten."""
  f = Frame(construct, index)
  _STATE.frames.append(f)
  try:
    yield f
  finally:
    _STATE.frames.pop()


def no_index(construct: str):
  """A frame for a loop whose iterations have no index."""
  return frame(construct, _UNAVAILABLE)


def providing(f: Frame | None, index: tp.Any = None):
  """Sets ``f``'s index while its body is traced (``index``: a tracer)."""
  if f is None:
    return contextlib.nullcontext()
  return _Providing(f, index)


class _Providing:

  def __init__(self, f: Frame, index):
    self.f, self.index = f, index

  def __enter__(self):
    self.saved, self.f.index = self.f.index, self.index

  def __exit__(self, *exc):
    self.f.index = self.saved


def outer_reads(own: Frame | None) -> int:
  """How often the indices of frames other than ``own`` have been read."""
  return sum(f.reads for f in _STATE.frames if f is not own)


def with_index(length: int, rewrite: tp.Callable[[Frame | None], tp.Any]):
  """``rewrite(None)``, or, if a callable asked for the index of this loop,
  ``rewrite(frame)`` whose result takes the row index as a trailing input.

  Returns:
    ``(result, index)``: ``index`` is ``iota(length)`` to pass as the
    trailing ``xs``, or ``None``.
  """
  with frame('`lax.scan`') as f:
    try:
      return rewrite(None), None
    except IndexNeeded as e:
      if e.frame is not f:
        raise
    return rewrite(f), jax.lax.iota(jnp.int32, length)


def snapshot() -> list[tuple[str, tp.Any]]:
  """The loops around the equation being rewritten: ``(construct, index)``
  per frame, outermost first (``index``: a tracer, or not provided)."""
  return [(f.construct, f.index) for f in _STATE.frames]


def provided(frames) -> list[tp.Any]:
  """The indices a :func:`snapshot` holds (tracers of the body's trace)."""
  return [index for _, index in frames if _is_index(index)]


def _is_index(index) -> bool:
  return index is not None and index is not _UNAVAILABLE


@contextlib.contextmanager
def restored(frames, indices):
  """The frames of a :func:`snapshot`, for a custom rule JAX traces later:
  each provided index is the next of ``indices`` (operands of the rule);
  a frame without one has none there (asking is a ``ValueError``)."""
  indices = iter(indices)
  saved = _STATE.frames
  _STATE.frames = [
      Frame(construct, next(indices) if _is_index(index) else _UNAVAILABLE)
      for construct, index in frames
  ]
  try:
    yield
  finally:
    _STATE.frames = saved
