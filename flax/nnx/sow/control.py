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

"""Values of a ``shard_map`` body that differ per device through control flow.

Inside ``shard_map`` (with ``check_vma``, the default) a value's type records
the manual mesh axes it varies over (``jax.typeof(x)`` prints ``{V:data}``).
A ``lax.cond``/``lax.switch`` whose index varies over an axis takes its own
branch on each device along it, and a ``lax.while_loop`` whose predicate
varies runs its own number of iterations, yet JAX 0.10 types their outputs by
what the branches or the body return, often invariant. Sown as typed, such a
value would come back as one copy (device 0's).

This file finds those values with a dataflow pass over the body. Each value
gets its *control axes*: the manual axes it varies over beyond its type,
because it is computed (through any equations, nested ``jit``, ``scan``,
...) from an output of such a construct. An equation gives its outputs the
union of its inputs' control axes, less the axes their types already vary
over; a collective that makes a value invariant (``psum``) thus ends them.
The rules of :data:`control_rules` say how a construct does it: ``cond``
and ``while`` add their predicate's axes (``constructs/loops_control.py``);
call-like primitives (``jit``, ``remat``, custom derivatives, a nested
``shard_map``) map their inputs to their sub-jaxpr's one to one.

:func:`mark_control_varying` then returns the body with every sow of such a
value (plain or reduced, at any depth) reading a ``pvary`` of it, while the
program itself goes on with the unmarked value: the sow's type now says how
the value varies, so the ``shard_map`` rule (``constructs/shard_map.py``) lays it out per
device like any varying value, and nothing else in the program changes. A
sow inside a loop or branch whose predicate varies is marked too.
"""

from __future__ import annotations

import dataclasses
import typing as tp

from flax.nnx.sow import _jax
from flax.nnx.sow.collect import cached
from flax.nnx.sow.primitive import MARKER_KINDS
from flax.nnx.sow.primitive import sow_p

Axes = frozenset
NO_AXES: Axes = frozenset()

Rule = tp.Callable[
    ['ControlPass', _jax.JaxprEqn, list[Axes], Axes, bool],
    tuple[list[Axes], tp.Optional[_jax.JaxprEqn]],
]

control_rules: dict[_jax.Primitive, Rule] = {}
"""How a construct gives control axes to its outputs, keyed by primitive.

``rule(control, eqn, in_axes, scope, edit) -> (out_axes, new_eqn)``:
``in_axes`` are the control axes of ``eqn``'s inputs, ``scope`` the axes of
the loops and branches around ``eqn`` (every sow inside gains them). The
rule analyses its sub-jaxprs with :meth:`ControlPass.jaxpr`, passing
``edit`` on, and returns the control axes of each output and, if ``edit``
changed a sub-jaxpr, the equation with the new one (else ``None``).
"""


@dataclasses.dataclass(frozen=True)
class Marked:
  """A ``shard_map`` body whose sows of control-varying values are marked."""

  jaxpr: _jax.Jaxpr  # the body itself when nothing is marked
  # The control axes of each marked sow equation of the original body (at
  # any depth), for sites that callers find in the original.
  sown: dict[_jax.JaxprEqn, Axes]


def mark_control_varying(
    body: _jax.Jaxpr, mesh_axes: tp.Sequence[str]
) -> Marked:
  """``body`` with each sow of a control-varying value reading its ``pvary``.

  Args:
    body: the body of a ``shard_map`` with ``check_vma``.
    mesh_axes: the names of its mesh's axes, in mesh order.

  Returns:
    The marked body (cached per ``body``) and the control axes of each sow
    equation of ``body`` that was marked.
  """
  mesh_axes = tuple(mesh_axes)

  def build():
    control = ControlPass(mesh_axes)
    _, new = control.jaxpr(body, (NO_AXES,) * len(body.invars), NO_AXES, True)
    return Marked(body if new is None else new, dict(control.sown))

  return cached(body, ('control_axes', mesh_axes), build)


def axes_of(atom, env: dict) -> Axes:
  return env.get(atom, NO_AXES) if isinstance(atom, _jax.Var) else NO_AXES


def union(axes: tp.Iterable[Axes]) -> Axes:
  return NO_AXES.union(*axes)


class ControlPass:
  """One run of the pass over a ``shard_map`` body (memoised per jaxpr)."""

  def __init__(self, mesh_axes: tuple[str, ...]):
    self.mesh_axes = mesh_axes
    self.sown: dict[_jax.JaxprEqn, Axes] = {}
    self._memo: dict[tuple, tuple] = {}

  def jaxpr(
      self,
      jaxpr: _jax.Jaxpr,
      in_axes: tp.Sequence[Axes],
      scope: Axes,
      edit: bool,
  ) -> tuple[tuple[Axes, ...], _jax.Jaxpr | None]:
    """The control axes of ``jaxpr``'s outputs, given its inputs'.

    With ``edit``, also the jaxpr with its sows marked (``None`` if none
    is). ``scope``: the axes every sow in it gains.
    """
    key = (id(jaxpr), tuple(in_axes), scope, edit)
    hit = self._memo.get(key)
    if hit is None:
      hit = (jaxpr, *self._walk(jaxpr, in_axes, scope, edit))
      self._memo[key] = hit
    return hit[1], hit[2]

  def _walk(self, jaxpr, in_axes, scope, edit):
    env: dict[_jax.Var, Axes] = {
        v: a for v, a in zip(jaxpr.invars, in_axes) if a
    }
    subst: dict[_jax.Var, tp.Any] = {}
    eqns = []
    changed = False
    for eqn in jaxpr.eqns:
      new = _substituted(eqn, subst)
      changed = changed or new is not eqn
      in_ax = [axes_of(v, env) for v in new.invars]
      if eqn.primitive is sow_p:
        out_ax, marked = self._sow(eqn, new, in_ax, scope, edit, eqns, subst)
        changed = changed or marked
      else:
        rule = control_rules.get(eqn.primitive, _call_rule)
        out_ax, edited = rule(self, new, in_ax, scope, edit)
        if edited is not None:
          new, changed = edited, True
        eqns.append(new)
      _record_axes(env, eqn.outvars, out_ax)
    outvars = [_read(v, subst) for v in jaxpr.outvars]
    out_axes = tuple(axes_of(v, env) for v in outvars)
    if not (edit and changed):
      return out_axes, None
    return out_axes, _jax.edit_jaxpr(jaxpr, eqns, outvars)

  def _sow(self, orig, eqn, in_axes, scope, edit, eqns, subst):
    """A sow passes its operands' control axes on; its value is marked.

    Appends the sow (and its ``pvary`` equations) to ``eqns``; returns the
    control axes of its outputs and whether it was marked.
    """
    p = eqn.params
    n = len(eqn.invars) - p['n_closure']
    out_axes = list(in_axes[:n])
    extra = [
        (a | scope) - _jax.varying_axes(v.aval)
        for v, a in zip(eqn.invars[:n], in_axes)
    ]
    if (
        not edit
        or p['remat_copy']
        or p['kind'] in MARKER_KINDS
        or not any(extra)
    ):
      eqns.append(eqn)
      return out_axes, False
    self.sown[orig] = self.sown.get(orig, NO_AXES) | union(extra)
    invars, outvars = list(eqn.invars), list(eqn.outvars)
    for i, axes in enumerate(extra):
      if not axes:
        continue
      ordered = [a for a in self.mesh_axes if a in axes]
      ordered += sorted(a for a in axes if a not in self.mesh_axes)
      pvary, marked = _jax.pvary_equation(invars[i], ordered, eqn)
      eqns.append(pvary)
      if isinstance(outvars[i], _jax.Var):
        subst[outvars[i]] = invars[i]  # the program goes on unmarked
      invars[i] = marked
      outvars[i] = _jax.Var(marked.aval)
    eqns.append(eqn.replace(invars=invars, outvars=outvars))
    return out_axes, True


def _read(atom, subst):
  return subst.get(atom, atom) if isinstance(atom, _jax.Var) else atom


def _substituted(eqn, subst):
  """``eqn`` reading the substitutes of its operands (itself if none)."""
  if not subst or not any(
      isinstance(v, _jax.Var) and v in subst for v in eqn.invars
  ):
    return eqn
  return eqn.replace(invars=[_read(v, subst) for v in eqn.invars])


def _record_axes(env, outvars, out_axes) -> None:
  """Records the control axes of ``outvars`` that their types lack."""
  for v, a in zip(outvars, out_axes):
    a = a - _jax.varying_axes(v.aval)
    if a:
      env[v] = a


def _call_rule(control: ControlPass, eqn, in_axes, scope, edit):
  """Call-like primitives, and the default for every other equation.

  A sub-jaxpr that takes the equation's inputs and returns its outputs one
  to one is analysed (and marked) with them; any other equation gives each
  output the union of its inputs' control axes.
  """
  n_in, n_out = len(eqn.invars), len(eqn.outvars)
  everything = union(in_axes)
  out_axes = [NO_AXES] * n_out
  new_params = {}
  opaque = False
  matched = False
  for k, v in eqn.params.items():
    sub = v.jaxpr if isinstance(v, _jax.ClosedJaxpr) else v
    if not isinstance(sub, _jax.Jaxpr):
      continue
    if len(sub.invars) != n_in or len(sub.outvars) != n_out:
      opaque = True
      continue
    matched = True
    sub_out, new = control.jaxpr(sub, in_axes, scope, edit)
    out_axes = [a | b for a, b in zip(out_axes, sub_out)]
    if new is not None:
      new_params[k] = (
          _jax.ClosedJaxpr(new, v.consts)
          if isinstance(v, _jax.ClosedJaxpr)
          else new
      )
  if opaque or not matched:
    # A first-order primitive, or a construct this pass cannot see into
    # (jaxprs held in other forms): every input may reach every output.
    out_axes = [everything] * n_out
  if not new_params:
    return out_axes, None
  return out_axes, eqn.replace(params=dict(eqn.params, **new_params))


def passes_through(jaxprs: tp.Sequence[_jax.Jaxpr], j: int, offset: int = 0):
  """Whether output ``j`` of every one of ``jaxprs`` is the same input.

  That input is ``jaxpr.invars[offset + i]`` for one ``i`` shared by all; a
  construct whose output is such an input does not change it, whatever
  branch it takes or however often it runs.
  """
  position = None
  for jaxpr in jaxprs:
    v = jaxpr.outvars[j]
    if not isinstance(v, _jax.Var) or v not in jaxpr.invars[offset:]:
      return False
    i = jaxpr.invars.index(v, offset)
    if position is not None and i != position:
      return False
    position = i
  return True


def control_axes(axes, site):
  if not axes:
    return site
  return dataclasses.replace(site, control_axes=site.control_axes | axes)
