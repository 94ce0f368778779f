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


"""Which sows a jaxpr holds, which a capture accepts, and editing them.

* :func:`sow_sites`: every sow equation under a jaxpr (any depth), cached by
  jaxpr, with what each construct around it changes (``site_annotations``:
  the mesh axes a ``shard_map`` adds, the control axes of a ``while``/
  ``cond`` on a per-device predicate).
* :func:`for_call` and :func:`release`: a capture's filter
  (``primitive.Selection``, asked by ``primitive.accepts``) for one call, a
  ``names=`` callable made a cache key (``name_keys.NameDecisions``: what it
  selects, not which object it is).
* :func:`edit_sows` and the helpers on it: sows turned into remat copies (an
  identity no capture collects), for a second evaluation of a body whose
  sows already ran once (a rematerialised loop, a custom rule's body).
* ``construct_names``: how errors name each higher-order primitive.
* ``marker_primitives`` and :func:`holds_markers`: markers other than sows
  that the rules rewrite (a construct holding one goes to its rule).
"""

from __future__ import annotations

import dataclasses
import threading
import typing as tp
import weakref

from flax.nnx.sow import _jax
from flax.nnx.sow import name_keys  # PR: name_keys
from flax.nnx.sow.primitive import HIDDEN  # PR: partial_eval
from flax.nnx.sow.primitive import Name
from flax.nnx.sow.primitive import Selection  # pylint: disable=unused-import
from flax.nnx.sow.primitive import sow_effect  # PR: toplevel
from flax.nnx.sow.primitive import sow_p


def for_call(accepts_key):
  """The key of one capture call: a callable ``names=`` is wrapped in a new
  ``name_keys.NameDecisions`` (call :func:`release` on it when the call
  ends); any other key is its own."""
  if isinstance(accepts_key, Selection) and callable(  # PR: name_keys
      accepts_key.names
  ):
    return name_keys.for_call(accepts_key)
  return accepts_key


def release(accepts_key) -> None:
  """Drops the ``names=`` callable of a key made by :func:`for_call`."""
  name_keys.release(accepts_key)  # PR: name_keys


construct_names: dict[_jax.Primitive, str] = {}
"""How errors name a primitive's construct (``'lax.scan'`` for ``scan``)."""


site_annotations: dict[
    _jax.Primitive, tp.Callable[[_jax.JaxprEqn, 'SowSite'], 'SowSite']
] = {}
"""How a primitive changes what the sows in its sub-jaxprs give the caller.

``annotate(eqn, site) -> site``; ``shard_map`` records the mesh axes its
sows gain (``constructs/shard_map.py``).
"""


counted_jaxprs: dict[  # PR: linear_solve
    _jax.Primitive, tp.Callable[[dict], list[_jax.Jaxpr]]
] = {}
"""For a primitive whose sub-jaxprs hold copies of one function's sows
(``custom_linear_solve`` traces ``solve`` again as ``transpose_solve``):
``counted(params)``, the sub-jaxprs that hold the sows an equation counts
(default: all). :func:`sow_sites` gives those sows, and from the other
sub-jaxprs the sows that are not copies of them (same name, same call
site), for the primitive's rules to refuse; ``Injector.consumed`` counts
the entries of the counted ones only."""


marker_primitives: set[_jax.Primitive] = set()  # PR: nnx_transforms
"""Primitives of markers that a capture's or ``intervene``'s rule rewrites
where they are, with or without sows near them (``constructs/rows.py``'s
``loop_row``, which the ``scan`` rules turn into an extra ``xs``)."""


# ----------------------------------------------------------------------------
# Static analysis: which sows does a jaxpr hold?


@dataclasses.dataclass(frozen=True)
class SowSite:
  """One sow equation, found anywhere in a jaxpr or its sub-jaxprs."""

  name: Name
  tag: tp.Hashable
  reduction: tp.Any  # a reductions.Reduction, or None
  kind: str = 'value'
  # Where the sow was called, and what it sows (one example's avals).
  eqn: _jax.JaxprEqn | None = dataclasses.field(default=None, compare=False)
  # The mesh axes of an enclosing ``shard_map`` the value varies over.
  sharded: tp.Any = None  # a shard_map.ShardAxes
  # Manual mesh axes the predicates of the enclosing loops and branches vary
  # over: the site runs differently per shard (``constructs/loops_control.py``).
  control_axes: frozenset = frozenset()

  @property
  def where(self) -> str:
    return '' if self.eqn is None else where(self.eqn)

  @property
  def collectible(self) -> bool:
    """Staged by a capture, not inert (``primitive.collectible``)."""
    return self.eqn is None or bool(self.eqn.params['effect'])

  def value_avals(self) -> tuple[tp.Any, ...]:  # PR: reductions
    p = self.eqn.params
    b = p['batch_dims']
    invars = self.eqn.invars[: len(self.eqn.invars) - p['n_closure']]
    return tuple(
        _jax.ShapedArray(v.aval.shape[b:], v.aval.dtype) for v in invars
    )


def where(eqn: _jax.JaxprEqn) -> str:
  """`` (at file:line)`` of the user's call that staged ``eqn`` (empty where
  JAX recorded none, as in a jaxpr its partial evaluation re-traces)."""
  summary = _jax.summarize_source(eqn.source_info)
  return f' (at {summary})' if summary else ''


_sites_cache: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


_sites_lock = threading.Lock()


def sow_sites(jaxpr: _jax.Jaxpr) -> tuple[SowSite, ...]:
  """Every sow in ``jaxpr`` and its sub-jaxprs, in equation order (cached)."""
  try:
    return _sites_cache[jaxpr]
  except KeyError:
    pass
  sites: list[SowSite] = []
  for eqn in jaxpr.eqns:
    if eqn.primitive is sow_p:
      p = eqn.params
      if not p['remat_copy']:
        sites.append(
            SowSite(p['sow_name'], p['tag'], p['reduction'], p['kind'], eqn)
        )
    else:
      annotate = site_annotations.get(eqn.primitive)
      found = (
          s for j in _jax.jaxprs_in_params(eqn.params) for s in sow_sites(j)
      )
      if eqn.primitive in counted_jaxprs:  # PR: linear_solve
        found = _counted_sites(eqn)  # PR: linear_solve
      for site in found:
        sites.append(site if annotate is None else annotate(eqn, site))
  result = tuple(sites)
  with _sites_lock:
    _sites_cache[jaxpr] = result
  return result


_markers_cache: weakref.WeakKeyDictionary = (  # PR: nnx_transforms
    weakref.WeakKeyDictionary()
)


def holds_markers(jaxpr: _jax.Jaxpr) -> bool:  # PR: nnx_transforms
  """Whether ``jaxpr`` or a sub-jaxpr holds an equation of one of the
  ``marker_primitives`` (cached)."""
  if not marker_primitives:
    return False
  try:
    return _markers_cache[jaxpr]
  except KeyError:
    pass
  found = any(
      eqn.primitive in marker_primitives
      or any(holds_markers(j) for j in _jax.jaxprs_in_params(eqn.params))
      for eqn in jaxpr.eqns
  )
  with _sites_lock:
    _markers_cache[jaxpr] = found
  return found


def _counted_sites(eqn: _jax.JaxprEqn) -> list[SowSite]:  # PR: linear_solve
  """The sows of the sub-jaxprs ``eqn`` counts, then the sows of its other
  sub-jaxprs that are not copies of those (see ``counted_jaxprs``)."""
  counted = counted_jaxprs[eqn.primitive](eqn.params)
  sites = [s for j in counted for s in sow_sites(j)]
  seen = {(s.name, s.where) for s in sites}
  for j in _jax.jaxprs_in_params(eqn.params):
    if not any(j is c for c in counted):
      sites.extend(s for s in sow_sites(j) if (s.name, s.where) not in seen)
  return sites


def as_jaxpr(j: _jax.Jaxpr | _jax.ClosedJaxpr) -> _jax.Jaxpr:
  return j.jaxpr if isinstance(j, _jax.ClosedJaxpr) else j


def construct_name(primitive: _jax.Primitive) -> str:
  return construct_names.get(primitive, f'`{primitive.name}`')


def renamed(atoms, subst: dict) -> list:  # PR: toplevel
  """``atoms`` (an equation's invars, a jaxpr's outvars) with each variable
  that ``subst`` maps replaced by its value (literals kept), as when sows
  removed from a jaxpr hand their operands to their consumers."""
  return [subst.get(v, v) if isinstance(v, _jax.Var) else v for v in atoms]


def holds_staged_sow(jaxpr: _jax.Jaxpr) -> bool:  # PR: partial_eval
  for eqn in jaxpr.eqns:
    if eqn.primitive is sow_p:
      if eqn.params['effect'] and not eqn.params['remat_copy']:
        return True
    elif any(holds_staged_sow(j) for j in _jax.jaxprs_in_params(eqn.params)):
      return True
  return False


# ----------------------------------------------------------------------------
# Remat copies: sows that no capture collects (a second evaluation of a body
# whose sows already ran once).


def without_staged_sows(  # PR: partial_eval
    closed: _jax.ClosedJaxpr,
) -> _jax.ClosedJaxpr:
  """``closed`` with every staged sow a remat copy (an identity no capture
  collects), for a second evaluation whose sows already ran once."""
  if not holds_staged_sow(closed.jaxpr):
    return closed
  return _jax.ClosedJaxpr(as_remat_copies(closed.jaxpr), closed.consts)


def as_remat_copies(jaxpr: _jax.Jaxpr) -> _jax.Jaxpr:  # PR: partial_eval
  return edit_sows_in_jaxpr(jaxpr, to_remat_copy, False)


def remat_copy_eqn(eqn: _jax.JaxprEqn) -> _jax.JaxprEqn:  # PR: partial_eval
  """``eqn`` with every staged sow in it (or under it) a remat copy."""
  return edit_sows(eqn, to_remat_copy, False)


def to_remat_copy(  # PR: partial_eval
    params: dict, in_custom_call: bool
) -> dict | None:
  del in_custom_call
  if params['effect'] and params['remat_copy'] in (False, HIDDEN):
    return dict(params, remat_copy=True)
  return None


def edit_sows(  # PR: toplevel
    eqn: _jax.JaxprEqn, edit: tp.Callable, in_custom_call: bool
) -> _jax.JaxprEqn:
  """``eqn`` with ``edit(params, in_custom_call)`` applied to the parameters
  of every sow in it or under it (``None``: unchanged); effects recomputed.

  ``in_custom_call`` says whether the sow is inside a ``custom_jvp_call`` or
  ``custom_vjp_call``. Returns ``eqn`` itself if nothing changed.
  """
  if eqn.primitive is sow_p:
    params = edit(eqn.params, in_custom_call)
    if params is None:
      return eqn
    staged = params['effect'] and not params['remat_copy']
    return eqn.replace(params=params, effects={sow_effect} if staged else set())
  if not any(True for _ in _jax.jaxprs_in_params(eqn.params)):
    return eqn
  in_custom_call = in_custom_call or eqn.primitive in (
      _jax.custom_jvp_call_p,
      _jax.custom_vjp_call_p,
  )
  params = {
      k: edit_sows_in(v, edit, in_custom_call) for k, v in eqn.params.items()
  }
  if all(params[k] is v for k, v in eqn.params.items()):
    return eqn
  effects = {e for e in eqn.effects if e is not sow_effect}
  if any(sow_effect in j.effects for j in _jax.jaxprs_in_params(params)):
    effects.add(sow_effect)
  return eqn.replace(params=params, effects=effects)


def edit_sows_in_jaxpr(  # PR: toplevel
    jaxpr: _jax.Jaxpr, edit: tp.Callable, in_custom_call: bool
) -> _jax.Jaxpr:
  eqns = [edit_sows(eqn, edit, in_custom_call) for eqn in jaxpr.eqns]
  if all(new is old for new, old in zip(eqns, jaxpr.eqns)):
    return jaxpr
  return _jax.edit_jaxpr(jaxpr, eqns, jaxpr.outvars)


def edit_sows_in(  # PR: toplevel
    value, edit: tp.Callable, in_custom_call: bool
):
  """A parameter's value, with :func:`edit_sows` applied to its jaxprs."""
  if isinstance(value, _jax.Jaxpr):
    return edit_sows_in_jaxpr(value, edit, in_custom_call)
  if isinstance(value, _jax.ClosedJaxpr):
    jaxpr = edit_sows_in_jaxpr(value.jaxpr, edit, in_custom_call)
    if jaxpr is value.jaxpr:
      return value
    return _jax.ClosedJaxpr(jaxpr, value.consts)
  if isinstance(value, tuple) and any(
      isinstance(v, (_jax.Jaxpr, _jax.ClosedJaxpr)) for v in value
  ):
    new = tuple(edit_sows_in(v, edit, in_custom_call) for v in value)
    if all(n is v for n, v in zip(new, value)):
      return value
    # A named tuple (custom_linear_solve's ``jaxprs``) keeps its type.
    return type(value)(*new) if hasattr(value, '_fields') else new
  return value
