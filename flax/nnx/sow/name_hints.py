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

"""What ``capture(names=...)`` says about a name that collected nothing.

A name listed in ``names=`` that no sow of the call collected is most often
a typo. While a capture runs, the names its selection passed over are
recorded (``primitive.Selection`` calls :func:`passed_over_name`); when the
call returns, a listed name that collected nothing raises an
:class:`UnusedNameWarning` naming the closest of them (:func:`closest`:
the same path written the other way, ``'blocks/0/out'`` for ``('blocks', 0,
'out')``, then the names spelled most alike, by ``difflib``).
"""

from __future__ import annotations

import contextlib
import difflib
import threading
import typing as tp
import warnings


class _PassedOver(threading.local):
  # The names a ``names=`` set passed over on this thread since
  # ``passed_over()`` was last entered: what ``capture`` suggests when one
  # of the set's names collected nothing (a typo).

  def __init__(self):
    super().__init__()
    self.names: dict = {}


_PASSED_OVER = _PassedOver()


@contextlib.contextmanager
def passed_over():
  """Collects, in the dict it yields, the names that a ``names=`` set
  passed over while the block runs (names seen by tracing only)."""
  before = _PASSED_OVER.names
  _PASSED_OVER.names = seen = dict(before)
  try:
    yield seen
  finally:
    _PASSED_OVER.names = before


def passed_over_name(name) -> None:
  """Records that a ``names=`` set passed over ``name`` (for the hint)."""
  _PASSED_OVER.names.setdefault(name, None)


def _text(name: tp.Any) -> str:
  if isinstance(name, tuple):
    return '/'.join(map(str, name))
  return str(name)


def closest(name: tp.Any, sown: tp.Iterable[tp.Any], n: int = 3) -> list:
  """The names in ``sown`` that ``name`` was most likely meant to be.

  First the names that are ``name`` written as the other kind of path (a
  ``str`` for a one-part tuple, ``'a/b/0'`` for ``('a', 'b', 0)``), then
  those spelled most alike, at most ``n`` in all, in that order.
  """
  sown = list(dict.fromkeys(sown))
  same_path = [s for s in sown if s != name and _text(s) == _text(name)]
  by_text = {}
  for s in sown:
    by_text.setdefault(_text(s), s)
  alike = difflib.get_close_matches(_text(name), list(by_text), n=n)
  out = same_path + [by_text[t] for t in alike if by_text[t] not in same_path]
  return out[:n]


class UnusedNameWarning(UserWarning):
  """``capture(names=[...])`` collected nothing for one of the names."""


def _report_unused_names(key, collected, seen: dict) -> None:
  """Warns, with the closest names sown, when a name of a ``names=`` set
  collected nothing (a typo, or a sow that did not run this call)."""
  if not isinstance(getattr(key, 'names', None), frozenset):
    return  # not a capture that selects a set of names
  missing = [n for n in key.names if n not in collected]
  if not missing:
    return
  name = sorted(missing, key=repr)[0]
  hint = closest(name, seen)
  warnings.warn(
      f'capture: names= lists {name!r}, but no sow of that name was'
      ' collected' + (
          f'. Did you mean {" or ".join(map(repr, hint))}?' if hint else
          ' (check the name: capture(f) without names= returns them all).'
      ),
      UnusedNameWarning,
      stacklevel=4,  # the caller of the captured function
  )


def reporting(call):
  """``call(key, args, kwargs) -> (out, collected)``, warning when a name of
  the key's ``names=`` set collected nothing."""

  def reported(key, args, kwargs):
    with passed_over() as seen:
      out = call(key, args, kwargs)
    _report_unused_names(key, out[1], seen)
    return out

  return reported
