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

"""Sow names as paths, and the names a mistyped selection probably meant.

A sow name is a ``str`` or a tuple path of ``str``/``int``. :func:`as_path`
gives every name as a tuple, so one predicate serves both kinds
(``as_path(n)[-1] == 'resid'`` is true for ``'resid'`` and for
``('blocks', 0, 'resid')``, where ``n[-1]`` would test a string's last
character). :func:`closest` is what an error about a name that no sow uses
suggests instead: the same path written the other way (``'h'`` for
``('h',)``, ``'blocks/0/out'`` for ``('blocks', 0, 'out')``), then the names
spelled most alike (``difflib``).
"""

from __future__ import annotations

import typing as tp

from flax.nnx.sow.name_hints import closest  # PR: name_hints
from flax.nnx.sow.primitive import Name


def as_path(name: Name) -> tuple[tp.Union[str, int], ...]:
  """A sow name as a tuple path: ``'h'`` -> ``('h',)``; tuples unchanged.

  >>> as_path('resid'), as_path(('blocks', 0, 'resid'))
  (('resid',), ('blocks', 0, 'resid'))

  Args:
    name: a sow name (a ``str`` or a tuple of ``str``/``int``).

  Returns:
    ``(name,)`` for a ``str``, ``name`` itself for a tuple.

  Raises:
    TypeError: ``name`` is neither.
  """
  if isinstance(name, str):
    return (name,)
  if isinstance(name, tuple):
    return name
  raise TypeError(
      f'as_path: a sow name is a str or a tuple of str/int, not {name!r}'
  )


def grad_name(name: Name) -> tuple[tp.Union[str, int], ...]:  # PR: perturb
  """Where ``sow(..., grad=True)`` collects the cotangent of ``name``.

  >>> grad_name(('resid', 0)), grad_name('h')
  (('grad', 'resid', 0), ('grad', 'h'))
  """
  return ('grad', *as_path(name))


def did_you_mean(  # PR: intervene
    name: tp.Any, sown: tp.Iterable[tp.Any]
) -> str:
  """``' Did you mean ...?'`` (empty when nothing is close), then the names
  the program sows (at most 10 of them)."""
  sown = list(dict.fromkeys(sown))
  near = closest(name, sown)
  hint = f' Did you mean {" or ".join(map(repr, near))}?' if near else ''
  listed = ', '.join(map(repr, sown[:10]))
  more = f' and {len(sown) - 10} more' if len(sown) > 10 else ''
  if not sown:
    return hint + (
        ' The program sows no name here (for an NNX model with no sow in'
        ' its code, module_outputs(f) makes its module calls hook points).'
    )
  return f'{hint} The program sows: {listed}{more}.'
