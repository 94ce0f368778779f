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
pass to the loop (``nnx/slices.py``).

* Under ``jax.vmap`` its batching rule returns ``x`` itself, mapped over
  its leading axis.
* In a ``scan`` body it is staged as ``loop_row_p``; when the ``scan`` is
  bound (``scan_bind`` in the patch inventory), each such equation at the
  top level of the body becomes an extra ``xs`` of the loop, fed with ``x``.
  So no later rule (a capture's, ``jvp``, ``vmap``) sees the marker.
* Its JVP is ``loop_row`` of the tangent (it is linear). Elsewhere (eagerly,
  lowered, transposed, inside a construct that is not the loop) it raises,
  so a row is never silently the whole value.
"""

from __future__ import annotations

import threading
import typing as tp

import jax

from flax.nnx.sow import _jax
from flax.nnx.sow import _jax_patches

loop_row_p = _jax.Primitive('loop_row')


class _Used(threading.local):
  # Whether this thread ever called ``loop_row``: until it does, ``scan``
  # binds as it would without this file.
  yes = False


_USED = _Used()


def current_loop() -> tp.Any:
  """The loop body being traced now, for :func:`loop_row`'s ``loop=`` (an
  opaque handle: the current JAX trace)."""
  return _jax.trace_ctx.trace


def loop_row(x: tp.Any, *, name: tp.Any, loop: tp.Any = None) -> tp.Any:
  """``x[i]`` in iteration ``i`` of the ``scan`` or ``vmap`` whose body is
  being traced (see the module docstring).

  Args:
    x: a pytree of arrays with a leading axis as long as the loop.
    name: what the error messages call ``x``.
    loop: a :func:`current_loop` handle taken at the top level of the body,
      to take the row there from deeper inside it (a ``checkpoint`` or a
      ``jit`` in the body); ``None``: here.

  Returns:
    The pytree of rows, each leaf with the leading axis removed.
  """
  _USED.yes = True
  if loop is None:
    return jax.tree.map(lambda leaf: loop_row_p.bind(leaf, sow_name=name), x)
  with _jax.set_current_trace(loop):
    return jax.tree.map(lambda leaf: loop_row_p.bind(leaf, sow_name=name), x)


def _row_error(name, what: str) -> NotImplementedError:
  return NotImplementedError(
      f'{name!r}: the row of a stacked value for one iteration (the state'
      ' of a module the enclosing nnx.scan or nnx.vmap slices) can only be'
      f' taken at the top level of a lax.scan body or a vmapped function,'
      f' not {what}.'
  )


@loop_row_p.def_abstract_eval
def _abstract_eval(aval, *, sow_name):
  if not aval.shape:
    raise ValueError(
        f'{sow_name!r}: a value of shape () has no row per iteration; it must'
        ' be stacked along a leading axis as long as the loop.'
    )
  return _jax.ShapedArray(aval.shape[1:], aval.dtype)


@loop_row_p.def_impl
def _impl(x, *, sow_name):
  del x
  raise _row_error(sow_name, 'outside any loop')


def _lowering(ctx, x, *, sow_name):
  del ctx, x
  raise _row_error(sow_name, 'inside a construct that is not the loop')


_jax.register_lowering(loop_row_p, _lowering)


def _jvp(primals, tangents, *, sow_name):
  (x,), (t,) = primals, tangents
  out = loop_row_p.bind(x, sow_name=sow_name)
  if type(t) is _jax.Zero:
    return out, _jax.zeros_like_tangent(out)
  return out, loop_row_p.bind(t, sow_name=sow_name)


_jax.primitive_jvps[loop_row_p] = _jvp


def _transpose(ct, x, *, sow_name):
  del ct, x
  raise _row_error(sow_name, 'in a transposed program')


_jax.primitive_transposes[loop_row_p] = _transpose


def _batch(axis_data, args, dims, *, sow_name):
  (x,), (d,) = args, dims
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
# ``scan``: rows become extra xs when the loop is bound.


def _rows_as_xs(args, params):
  """``(args, params)`` of a ``scan`` whose body's top-level ``loop_row``
  equations read extra ``xs`` instead; unchanged when it has none."""
  closed = params['jaxpr']
  jaxpr = closed.jaxpr
  rows = [e for e in jaxpr.eqns if e.primitive is loop_row_p]
  if not rows:
    return args, params
  n_consts = params['num_consts']
  consts = dict(zip(jaxpr.constvars, closed.consts))
  const_in = {v: a for v, a in zip(jaxpr.invars[:n_consts], args[:n_consts])}
  extra = []
  for eqn in rows:
    (v,), name = eqn.invars, eqn.params['sow_name']
    if isinstance(v, _jax.Literal) or (v not in consts and v not in const_in):
      raise _row_error(name, 'of a value computed inside the loop body')
    value = consts[v] if v in consts else const_in[v]
    rows_ = _jax.typeof(value).shape[0]
    if rows_ != params['length']:
      raise ValueError(
          f'{name!r}: its leading axis has {rows_} rows, but the loop runs'
          f" {params['length']} iterations."
      )
    extra.append(value)
  kept = [e for e in jaxpr.eqns if e.primitive is not loop_row_p]
  new = _jax.edit_jaxpr(jaxpr, kept, jaxpr.outvars)
  names = jaxpr.debug_info.safe_arg_names(len(jaxpr.invars))
  new = new.replace(
      invars=[*jaxpr.invars, *(e.outvars[0] for e in rows)],
      debug_info=new.debug_info._replace(
          arg_names=(*names, *('',) * len(rows))
      ),
  )
  params = dict(params, jaxpr=_jax.ClosedJaxpr(new, closed.consts))
  return (*args, *extra), params


def _scan_bind(original, trace, args, avals, params, /):
  if _USED.yes:
    args, params = _rows_as_xs(args, params)
    avals = [_jax.typeof(x) for x in args]
  return original(trace, args, avals, params)


_jax_patches.register('scan_bind', _scan_bind)
