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

"""A ``names=`` callable as a cache key, so an inline lambda retraces nothing.

``capture(f, names=lambda n: ...)`` written inline makes a new callable at
every call. Its capture key (a ``primitive.Selection``) is part of JAX's
tracing cache key, of the rewrite cache (``collect.cached``) and of the
eager ``jax.jit`` cache; compared by identity, every call would trace and
compile again and keep the callable alive. :func:`for_call` wraps the
callable, for one capture call, in a :class:`NameDecisions`, which compares
by what it has selected (``sites.for_call`` calls it).
"""

from __future__ import annotations

import typing as tp

from flax.nnx.sow.primitive import Name
from flax.nnx.sow.primitive import Selection


class NameDecisions:
  """A ``names=`` callable as a cache key: what it has selected.

  A capture's selection is not part of its program: ``capture(f,
  names=lambda n: ...)`` written inline makes a new callable at every call,
  and JAX's tracing caches, the rewrite cache and the eager ``jax.jit``
  cache must not trace and compile again for it, nor keep it alive. So each
  capture call wraps the callable in one of these: it calls the callable
  at most once per name and records the answers, and two are equal when they
  give the same answer for every name either has recorded (a side that no
  longer has its callable, and has no answer for a name, was never asked
  about it, so nothing cached under it depends on that name). The hash is
  the same for all. When the call returns, :meth:`release` drops the
  callable: a cache that keeps the key keeps only the answers.
  """

  __slots__ = ('fn', '_answers', '__weakref__')

  def __init__(self, fn: tp.Callable[[Name], tp.Any]):
    self.fn = fn
    self._answers: dict[Name, bool] = {}

  def __call__(self, name: Name) -> bool:
    try:
      return self._answers[name]
    except KeyError:
      pass
    fn = self.fn
    if fn is None:
      raise RuntimeError(
          f'capture(names=...): sow {name!r} asks the names= callable of a'
          ' capture that has returned (a custom_jvp/custom_vjp/custom_vmap'
          ' rule of the captured function, run later, sows a name its'
          ' function does not). Pass names as a set of names, or'
          ' differentiate inside the capture (capture(jax.grad(f))).'
      )
    answer = bool(fn(name))
    self._answers[name] = answer
    return answer

  def release(self) -> None:
    self.fn = None

  def _answer(self, name: Name):
    """The answer for ``name``; ``None`` if it cannot be known (released
    and never asked), ``_FAILED`` if the callable raises."""
    if name in self._answers:
      return self._answers[name]
    if self.fn is None:
      return None
    try:
      return self(name)
    except Exception:  # pylint: disable=broad-except
      return _FAILED  # raised again where the capture asks

  def __eq__(self, other):
    if not isinstance(other, NameDecisions):
      return NotImplemented
    if other is self or (self.fn is not None and self.fn is other.fn):
      return True
    for name in (*self._answers, *other._answers):
      a, b = self._answer(name), other._answer(name)
      if a is not None and b is not None and a is not b:
        return False
    return True

  def __hash__(self):
    return hash(NameDecisions)

  def __repr__(self):
    return f'NameDecisions({self.fn!r}, {self._answers!r})'


_FAILED = object()


def for_call(accepts_key: Selection) -> Selection:
  """``accepts_key``, a selection by a callable, with the callable wrapped
  in a new :class:`NameDecisions` (see ``sites.for_call``)."""
  fn = accepts_key.names
  if isinstance(fn, NameDecisions):
    fn = fn.fn
  return Selection(accepts_key.tags, NameDecisions(fn))


def release(accepts_key) -> None:
  """Drops the ``names=`` callable of a key made by :func:`for_call`."""
  if isinstance(accepts_key, Selection) and isinstance(
      accepts_key.names, NameDecisions
  ):
    accepts_key.names.release()
