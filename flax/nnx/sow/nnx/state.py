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


"""Conversions between a capture's flat ``collected`` dict and an nnx.State.

``capture`` returns a flat ``dict`` keyed by sow name: a ``str`` or a tuple
path such as ``('blocks', 0, 'act')``. Flax's ``nnx.capture`` returns an
``nnx.State`` nested by module path whose leaves are Variables (for example
``{'blocks': {0: {'act': Intermediate((y,))}}}``). This file owns the mapping
between the two, so code written against either form can read the other; the
NNX shims (``shims.py``) build their ``State`` with it.
"""

from __future__ import annotations

import typing as tp

from flax import nnx

from flax.nnx.sow.inject import values_converters  # PR: nnx_functional
from flax.nnx.sow import api
from flax.nnx.sow import primitive
from flax.nnx.sow.collect import Collected  # PR: nnx_functional

Name = primitive.Name
VariableType = type[nnx.Variable]
TypeSpec = tp.Union[VariableType, tp.Callable[[Name], VariableType]]

__all__ = [
    'collected_to_state',
    'flatten_names',  # PR: nnx_functional
    'name_to_path',
    'state_to_collected',  # PR: nnx_functional
]

# The order of the names a State was built from (an instance attribute that
# is not an entry of the mapping), so that state_to_collected gives it back.
_ORDER_ATTR = '_sow_name_order'


def name_to_path(name: Name) -> tuple[tp.Union[str, int], ...]:
  """Returns the State path of a sow name: ``'a'`` -> ``('a',)``.

  Raises:
    TypeError: if ``name`` is not a str or a non-empty tuple of str/int.
  """
  name = api.check_name(name, 'name_to_path')
  return (name,) if isinstance(name, str) else name


def _variable_type(spec: TypeSpec, name: Name) -> VariableType:
  if isinstance(spec, type) and issubclass(spec, nnx.Variable):
    return spec
  if callable(spec) and not isinstance(spec, type):
    vt = spec(name)
    if isinstance(vt, type) and issubclass(vt, nnx.Variable):
      return vt
    raise TypeError(
        f'collected_to_state: the variable_type function returned {vt!r} for'
        f' {name!r}; it must return a subclass of nnx.Variable.'
    )
  raise TypeError(
      f'collected_to_state: variable_type (used to wrap {name!r}) must be a'
      ' subclass of nnx.Variable (e.g. nnx.Intermediate) or a function'
      f' name -> Variable subclass, got {spec!r}.'
  )


def collected_to_state(
    collected: tp.Mapping[Name, tp.Any],
    variable_type: TypeSpec = nnx.Intermediate,
) -> nnx.State:
  """Nests a flat ``collected`` dict into a path-keyed ``nnx.State``.

  Each name becomes a path (a ``str`` name is a one-element path) and each
  value is wrapped in ``variable_type``, so the result reads like the State
  ``nnx.capture`` returns.

  >>> import jax.numpy as jnp
  >>> from flax import nnx
  >>> from flax.nnx.sow.nnx.state import collected_to_state
  >>> state = collected_to_state({('blocks', 0, 'act'): (jnp.ones(2),),
  ...                             'head': (jnp.zeros(()),)})
  >>> state['blocks'][0]['act'][0].shape
  (2,)
  >>> type(state['head']).__name__
  'Intermediate'

  Args:
    collected: the dict a ``capture`` returns, ``name -> value`` (a tuple of
      pytrees, or a reduced accumulator).
    variable_type: the ``nnx.Variable`` subclass each value is wrapped in, or
      a function ``name -> Variable subclass``.

  Returns:
    An ``nnx.State`` whose leaves are ``variable_type(value)``.

  Raises:
    TypeError: if a name is not a str or a tuple of str/int, or
      ``variable_type`` is not a Variable subclass.
    ValueError: if one name is a prefix of another (``'a'`` and
      ``('a', 'b')``), so one path would be both a leaf and a subtree.
  """
  if not isinstance(collected, tp.Mapping):
    raise TypeError(
        'collected_to_state takes the dict a capture returns (name ->'
        f' value), got {type(collected).__name__}.'
    )
  root = nnx.State({})
  for name, value in collected.items():
    path = name_to_path(name)
    node = root
    for i, key in enumerate(path[:-1]):
      child = node.get(key) if key in node else None
      if child is None:
        child = nnx.State({})
        node[key] = child
      elif not isinstance(child, nnx.State):
        raise ValueError(
            f'collected_to_state: {name!r} nests under {path[: i + 1]!r},'
            ' which is itself a sown name; rename one of them.'
        )
      node = child
    if path[-1] in node:
      raise ValueError(
          f'collected_to_state: {name!r} is both a sown name and the prefix of'
          ' another sown name; rename one of them.'
      )
    # A plain Variable: a result holds values, not mutable references (a
    # Hijax default would make one inside jax.jit fail).
    node[path[-1]] = _variable_type(variable_type, name)(
        value, hijax=False, ref=False
    )
  # The names as given, in order: state_to_collected gives them back.
  object.__setattr__(root, _ORDER_ATTR, tuple(collected))
  return root


def state_to_collected(  # PR: nnx_functional
    state: tp.Mapping[tp.Any, tp.Any],
) -> Collected:
  """Flattens a path-keyed State of Variables into a flat ``collected`` dict.

  The inverse of :func:`collected_to_state`: each Variable leaf becomes
  ``path -> value``, so code that read ``nnx.pop(model, nnx.Intermediate)``
  or the State of ``nnx.capture`` can move to the dict ``capture`` returns.
  One convention: a name is its path, a tuple, as ``capture`` names a
  ``Module.sow`` (``('y',)`` for a sow by the root module). A State built by
  :func:`collected_to_state` gives back the names it was given (a ``str``
  stays a ``str``), in their order.

  >>> import jax.numpy as jnp
  >>> from flax import nnx
  >>> from flax.nnx.sow.nnx.state import state_to_collected
  >>> state = nnx.State({'blocks': {0: {'act': nnx.Intermediate((1.0,))}}})
  >>> dict(state_to_collected(state))
  {('blocks', 0, 'act'): (1.0,)}

  Args:
    state: an ``nnx.State`` (or nested mapping) whose leaves are Variables.

  Returns:
    A ``Collected`` dict (a pytree that keeps its key order, also under
    ``jax.jit``) from name (``str`` or tuple path) to the Variable's value:
    in the order of the names ``collected_to_state`` was given when it built
    ``state``, otherwise in the State's iteration order.

  Raises:
    TypeError: if ``state`` is not a mapping, or a leaf is not a Variable.
  """
  if not isinstance(state, tp.Mapping):
    raise TypeError(
        'state_to_collected takes an nnx.State (a mapping of Variables), got'
        f' {type(state).__name__}.'
    )
  out: dict[Name, tp.Any] = {}
  for path, value in nnx.traversals.flatten_mapping(state).items():
    if not isinstance(value, nnx.Variable):
      raise TypeError(
          f'state_to_collected: the leaf at {path!r} is a'
          f' {type(value).__name__}; expected an nnx.Variable.'
      )
    out[path] = value.get_value()
  names = getattr(state, '__dict__', {}).get(_ORDER_ATTR)
  if names is not None and {name_to_path(n) for n in names} == set(out):
    # Built by collected_to_state: its names, as given and in that order.
    return Collected((n, out[name_to_path(n)]) for n in names)
  return Collected(out)


def flatten_names(  # PR: nnx_functional
    collected: tp.Mapping[Name, tp.Any], sep: str = '/'
) -> Collected:
  """``collected`` with every name written as one string, parts joined by sep.

  ``('blocks', 0, 'act')`` becomes ``'blocks/0/act'``; a ``str`` name stays
  as it is. Logging tools, ``np.savez`` and ``dict`` sorting (which fails on
  a mix of ``str`` and tuple keys) want string keys. Works on traced values,
  so it can run inside ``jax.jit``; the result keeps the key order.

  >>> import jax.numpy as jnp
  >>> from flax.nnx.sow.nnx.state import flatten_names
  >>> dict(flatten_names({('blocks', 0, 'act'): (jnp.ones(2),), 'loss': 1.0}))
  {'blocks/0/act': (Array([1., 1.], dtype=float32),), 'loss': 1.0}

  Args:
    collected: the dict a ``capture`` returns.
    sep: the separator between the parts of a path.

  Returns:
    A ``Collected`` dict with the same values, keyed by strings; names
    marked as ``perturb`` cotangents stay marked (``cotangents``).

  Raises:
    TypeError: if ``collected`` is not a mapping, or ``sep`` is not a str.
    ValueError: if two names give the same string (``'a/b'`` and
      ``('a', 'b')``).
  """
  if not isinstance(collected, tp.Mapping):
    raise TypeError(
        'flatten_names: collected must be the dict a capture returns (name'
        f' -> value), got a {type(collected).__name__}.'
    )
  if not isinstance(sep, str):
    raise TypeError(
        f'flatten_names: sep must be a str, got {sep!r} of type'
        f' {type(sep).__name__}.'
    )
  out = Collected()
  marked = getattr(collected, 'cotangents', frozenset())
  for name, value in collected.items():
    key = sep.join(str(p) for p in name_to_path(name))
    if key in out:
      raise ValueError(
          f'flatten_names: {name!r} and another name both flatten to'
          f' {key!r}; rename one of them or choose another sep.'
      )
    out[key] = value
    if name in marked:
      out.cotangents = out.cotangents | {key}
  return out


def _state_as_values(values):  # PR: nnx_functional
  """A path-keyed ``nnx.State`` (as ``nnx.capture`` returns) as the
  ``values`` of ``intervene``; ``None`` for anything else."""
  if not isinstance(values, nnx.State):
    return None
  # Module.sow names are paths, also one-element ones. An Intermediate holds
  # a tuple of values (capture's layout); a Perturbation holds one value, the
  # replacement of the one perturb of its path.
  out = {}
  for k, v in state_to_collected(values).items():
    name = (k,) if isinstance(k, str) else k
    out[name] = v if isinstance(v, tuple) or callable(v) else (v,)
  return out


values_converters.append(_state_as_values)  # PR: nnx_functional
