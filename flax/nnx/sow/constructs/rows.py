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

"""``loop_row``: the row of a stacked value for the current iteration.

``loop_row(x, name=...)``, called at the top level of a ``lax.scan`` body or
of a function ``jax.vmap`` maps, on a value ``x`` from outside (a constant of
the body) with a leading axis as long as the loop (or the mapped axis), is
``x[i]`` in iteration ``i`` (example ``i``): what the loop would give the
body had ``x`` been one of its ``xs`` (mapped with ``in_axes=0``). The NNX
layer uses it where Flax slices a module's state that the caller did not
pass to the loop (``nnx/slices.py``), always inside a capture.

* Under ``jax.vmap`` (the current trace is a ``BatchTrace``) its batching
  rule returns ``x`` itself, mapped over its leading axis.
* In a ``scan`` body it is staged as a ``loop_row`` equation (a marker),
  which the ``scan`` rules of ``capture`` and ``intervene`` rewrite: each
  such equation at the top level of the body becomes an extra ``xs`` of the
  loop, fed with ``x`` (``_rows_as_xs``). ``sites.marker_primitives`` has
  every capture and ``intervene`` send a construct holding one to its rule,
  sows or not. Until then the marker's own rules carry it through JAX's
  transforms: its JVP is ``loop_row`` of the tangent (it is linear); under
  ``vmap`` of the loop it takes the row along the axis the batch dimension
  moved it to (the ``axis`` parameter). Its ``anchor=`` operand, an input
  of the body, keeps JAX's partial evaluation from treating it as
  loop-invariant: the loop-invariant hoisting of ``scan`` under ``grad``
  (``_scan_known_hoisting``) would otherwise compute it once, outside the
  loop, where it raises.
* Where no rule rewrites it (eagerly, lowered, in a loop no capture sees,
  transposed, nested below the body's top level, or on a value computed
  inside the body) it raises, so a row is never silently the whole value.
  No JAX object is replaced: the rules are the marker's own, and the
  ``scan`` rules it wraps are the package's (``collect_rules``,
  ``intervene_rules``).
"""

from __future__ import annotations

import typing as tp

import jax
import jax.numpy as jnp

# Registers the scan rules this file wraps (below) first.
import flax.nnx.sow.constructs.scan  # pylint: disable=unused-import
from flax.nnx.sow import _jax
from flax.nnx.sow import sites
from flax.nnx.sow.collect import collect_rules
from flax.nnx.sow.inject import intervene_rules

loop_row_p = _jax.Primitive('loop_row')
sites.marker_primitives.add(loop_row_p)


def current_loop() -> tp.Any:
  """The loop body being traced now, for :func:`loop_row`'s ``loop=`` (an
  opaque handle: the current JAX trace)."""
  return _jax.trace_ctx.trace


def loop_row(
    x: tp.Any, *, name: tp.Any, loop: tp.Any = None, anchor: tp.Any = None
) -> tp.Any:
  """``x[i]`` in iteration ``i`` of the ``scan`` or ``vmap`` whose body is
  being traced (see the module docstring).

  Args:
    x: a pytree of arrays with a leading axis as long as the loop.
    name: what the error messages call ``x``.
    loop: a :func:`current_loop` handle taken at the top level of the body,
      to take the row there from deeper inside it (a ``checkpoint`` or a
      ``jit`` in the body); ``None``: here.
    anchor: in a ``scan`` body, an array that differs per iteration (a
      carry or a row of the ``xs``), which the marker reads, so that JAX's
      partial evaluation (``grad`` inside the capture) keeps the row in the
      loop; ``None``: none (the marker then reads only a constant of the
      loop, which ``scan``'s loop-invariant hoisting moves out of it, where
      it raises).

  Returns:
    The pytree of rows, each leaf with the leading axis removed.
  """
  trace = current_loop() if loop is None else loop
  # A vmap's batching rule takes the row at once; in a scan body it is a
  # marker for the capture's scan rule.
  vmap = isinstance(trace, _jax.batching.BatchTrace)
  anchors = () if vmap or anchor is None else (anchor,)
  bind = lambda leaf: loop_row_p.bind(
      leaf, *anchors, sow_name=name, vmap=vmap, axis=0
  )
  if loop is None:
    return jax.tree.map(bind, x)
  with _jax.set_current_trace(loop):
    return jax.tree.map(bind, x)


def iteration_anchor(args: tp.Any, loop: tp.Any) -> tp.Any:
  """An array of ``args`` (the inputs of a ``scan`` body whose trace is
  ``loop``) for :func:`loop_row`'s ``anchor=``; ``None`` if none is a value
  of that body."""
  for leaf in jax.tree.leaves(args):
    if isinstance(leaf, jax.core.Tracer) and leaf._trace is loop:  # pylint: disable=protected-access
      return leaf
  return None


def _row_error(name, what: str) -> NotImplementedError:
  return NotImplementedError(
      f'{name!r}: the row of a stacked value for one iteration (the state'
      ' of a module the enclosing nnx.scan or nnx.vmap slices) can only be'
      ' taken at the top level of a vmapped function, or of a lax.scan body'
      ' that a capture (nnx.capture, capture, intervene) sees, which feeds'
      f' the rows to the loop as xs; not {what}.'
  )


@loop_row_p.def_abstract_eval
def _abstract_eval(aval, *anchor, sow_name, vmap, axis):
  del anchor, vmap
  if len(aval.shape) <= axis:
    raise ValueError(
        f'{sow_name!r}: a value of shape {aval.shape} has no row per'
        ' iteration; it must be stacked along a leading axis as long as the'
        ' loop.'
    )
  shape = aval.shape[:axis] + aval.shape[axis + 1 :]
  return _jax.ShapedArray(shape, aval.dtype)


@loop_row_p.def_impl
def _impl(*args, sow_name, vmap, axis):
  del args, vmap, axis
  raise _row_error(
      sow_name,
      'outside any loop (or moved out of its loop by the loop-invariant'
      ' hoisting of a jax.grad inside the capture, where no anchor= ties it'
      ' to the iteration)',
  )


def _lowering(ctx, *args, sow_name, vmap, axis):
  del ctx, args, vmap, axis
  raise _row_error(
      sow_name,
      'in a loop that no capture rewrote, nested below the top level of its'
      ' body, or outside the loop (JAX has no way for a primitive to add an'
      ' xs to the scan around it, nor an iteration index primitive)',
  )


_jax.register_lowering(loop_row_p, _lowering)


def _jvp(primals, tangents, **params):
  # Linear in the value; the anchor only keeps it in the loop.
  x, *anchor = primals
  t = tangents[0]
  out = loop_row_p.bind(x, *anchor, **params)
  if type(t) is _jax.Zero:
    return out, _jax.zeros_like_tangent(out)
  return out, loop_row_p.bind(t, *anchor, **params)


_jax.primitive_jvps[loop_row_p] = _jvp


def _transpose(ct, *args, sow_name, vmap, axis):
  del ct, args, vmap, axis
  raise _row_error(
      sow_name,
      'in a transposed program (a jax.grad or jax.vjp inside the capture'
      ' that differentiates with respect to the stacked value: the'
      " cotangent's row has no iteration index to go to; differentiate"
      ' outside the capture, which rewrites the loop first)',
  )


_jax.primitive_transposes[loop_row_p] = _transpose


def _batch(axis_data, args, dims, *, sow_name, vmap, axis):
  (x, *anchor), (d, *_) = args, dims
  if not vmap:
    # A marker of a scan body, under a vmap of the loop: the row along the
    # axis the batch dimension moved the loop's axis to. The anchor is read
    # for its dependence only, mapped or not.
    params = dict(sow_name=sow_name, vmap=False)
    if d is None:
      return loop_row_p.bind(x, *anchor, axis=axis, **params), None
    moved = axis if axis < d else axis + 1
    out = loop_row_p.bind(x, *anchor, axis=moved, **params)
    return out, (d if d < moved else d - 1)
  if d is not None:
    raise _row_error(sow_name, 'of a value the vmap already maps over')
  size = _jax.typeof(x).shape[0] if _jax.typeof(x).shape else None
  if size != axis_data.size:
    raise ValueError(
        f'{sow_name!r}: its leading axis has {size} rows, but the vmap maps'
        f' over {axis_data.size} examples.'
    )
  return x, 0


_jax.fancy_primitive_batchers[loop_row_p] = _batch


# ----------------------------------------------------------------------------
# ``scan``: the capture's and intervene's rules feed the rows as extra xs.


def _rows_as_xs(eqn: _jax.JaxprEqn, invals):
  """``(eqn, invals)`` of a ``scan`` whose body's top-level ``loop_row``
  equations read extra ``xs`` instead (appended to ``invals``); unchanged
  when it has none."""
  params = eqn.params
  closed = params['jaxpr']
  jaxpr = closed.jaxpr
  rows = [e for e in jaxpr.eqns if e.primitive is loop_row_p]
  if not rows:
    return eqn, invals
  n_consts = params['num_consts']
  consts = dict(zip(jaxpr.constvars, closed.consts))
  const_in = dict(zip(jaxpr.invars[:n_consts], invals[:n_consts]))
  extra = []
  for row in rows:
    v, p = row.invars[0], row.params
    name = p['sow_name']
    if isinstance(v, _jax.Literal) or (v not in consts and v not in const_in):
      raise _row_error(name, 'of a value computed inside the loop body')
    value = consts[v] if v in consts else const_in[v]
    n_rows = _jax.typeof(value).shape[p['axis']]
    if n_rows != params['length']:
      raise ValueError(
          f'{name!r}: its leading axis has {n_rows} rows, but the loop runs'
          f" {params['length']} iterations."
      )
    extra.append(jnp.moveaxis(value, p['axis'], 0) if p['axis'] else value)
  kept = [e for e in jaxpr.eqns if e.primitive is not loop_row_p]
  new = _jax.edit_jaxpr(jaxpr, kept, jaxpr.outvars)
  names = jaxpr.debug_info.safe_arg_names(len(jaxpr.invars))
  new = new.replace(
      invars=[*jaxpr.invars, *(e.outvars[0] for e in rows)],
      debug_info=new.debug_info._replace(
          arg_names=(*names, *('',) * len(rows))
      ),
  )
  new_params = dict(params, jaxpr=_jax.ClosedJaxpr(new, closed.consts))
  return eqn.replace(params=new_params), [*invals, *extra]


def _with_rows(rule):
  def with_rows(handler, eqn, invals):
    eqn, invals = _rows_as_xs(eqn, list(invals))
    return rule(handler, eqn, invals)

  return with_rows


collect_rules[_jax.scan_p] = _with_rows(collect_rules[_jax.scan_p])
intervene_rules[_jax.scan_p] = _with_rows(intervene_rules[_jax.scan_p])
