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

"""``sow_p`` while an ``intervene`` stages: its staging key and rules.

An ``intervene`` (``inject.py``) stages its function with an
:class:`Intervening` key among the captures' (``primitive.staging``), so the
sows it replaces are staged effectful, and it rewrites the staged program.
Differentiating or batching a replaced sow inside the function must not see
the sown value, since the replacement takes its place. This file wraps
``sow_p``'s rules (``primitive.py``) for those sows, and leaves every other
sow to them:

* JVP: a sow replaced by arrays has zero tangents (a constant), and is
  marked ``zero_tangent`` so the intervene checks that an entry does replace
  it; one replaced by a callable gets a ``'jvp'`` *derivative marker*, the
  tangent of the replacement at the sown value, resolved by the intervene
  with the callable of its call; the markers transpose to one another
  (``'vjp'``).
* batching: a replaced sow comes back batched (a replacement per example);
  an unbatched one replaced by a callable stays unbatched where it is
  (``'kept'``) and a capture collects its value from a ``'hoisted'`` copy
  with the mapped axis first.
* partial evaluation: a replaced sow, and a marker of known operands, are
  known (the replaced value is saved rather than recomputed).
* ``jet``: only a replacement by arrays (zero series) is supported.
"""

from __future__ import annotations

import dataclasses
import typing as tp

import jax.numpy as jnp

from flax.nnx.sow import _jax
from flax.nnx.sow.primitive import DERIVATIVE_KINDS
from flax.nnx.sow.primitive import HOISTED
from flax.nnx.sow.primitive import JVP_MARKER
from flax.nnx.sow.primitive import KEPT
from flax.nnx.sow.primitive import Name
from flax.nnx.sow.primitive import VJP_MARKER
from flax.nnx.sow.primitive import accepts
from flax.nnx.sow.primitive import bind_mapped_first
from flax.nnx.sow.primitive import perturb_tangents
from flax.nnx.sow.primitive import sow_p
from flax.nnx.sow.primitive import staging_keys


@dataclasses.dataclass(frozen=True)
class Intervening:
  """The staging key of ``intervene`` (``inject.py``): its sows are
  staged effectful, like a capture's, but no capture accepts them.

  ``names`` (``None``: every name, for a hook that selects its names once
  the program is staged) and ``tags`` (``None``: every tag) say which sows
  it replaces; ``arrays``, which of the names by arrays (the others by
  callables). ``batched_arrays`` records (for errors) the names replaced by
  arrays whose sown value did not vary over a ``vmap`` it sits in: their
  results come back batched (see ``_sow_batch``).
  """

  names: frozenset[Name] | None
  arrays: frozenset[Name]
  tags: frozenset | None
  batched_arrays: list[Name] = dataclasses.field(
      default_factory=list, compare=False, repr=False
  )

  def replaces(self, params: dict[str, tp.Any]) -> bool:
    return (
        (self.names is None or params['sow_name'] in self.names)
        and params['kind'] in ('value', 'perturb', KEPT)
        and params.get('grad_of') is None
        and (self.tags is None or params['tag'] in self.tags)
    )


def staging_captures() -> tuple[tp.Any, ...]:
  """The ``tags`` keys (``None``: every tag) of the captures staging now."""
  return tuple(k for k in staging_keys() if not isinstance(k, Intervening))


def replacing(params: dict[str, tp.Any]) -> Intervening | None:
  """The ``intervene`` whose staging replaces the sow with ``params``.

  The innermost staging transform that takes the sow decides: a capture
  that accepts it collects it (the intervenes around never see it), an
  intervene that replaces it replaces it; the others leave it to the next.
  So a sow that a capture inside the intervened function does not accept
  (``capture(g, names=...)``) stays the intervene's, also while that
  capture is the innermost transform staging.

  Such a sow must stay where it is, so that a replacement reaches its
  consumers: a construct that ``jax.vmap`` batches keeps a ``'kept'`` half
  of it in place and hoists only its result (``constructs/batched.py``),
  and it comes back batched under ``jax.vmap`` (a replacement per example
  has to reach its consumers; ``_intervened_batch``).
  """
  for key in reversed(staging_keys()):
    if isinstance(key, Intervening):
      if key.replaces(params):
        return key
    elif accepts(
        key,
        params['tag'],
        params['reduction'],
        params['kind'],
        params['sow_name'],
    ):
      return None
  return None


# -- JVP and transpose ----------------------------------------------------


def _intervened_jvp(core_jvp, primals, tangents, **params):
  if params['kind'] in DERIVATIVE_KINDS:
    return _marker_jvp(primals, tangents, params)
  key = replacing(params) if params['effect'] else None
  if key is None:
    return core_jvp(primals, tangents, **params)
  tangents = list(tangents[: len(tangents) - params['n_closure']])
  if params['sow_name'] in key.arrays:
    # Its tangent is taken to be zero: the intervene checks that an entry
    # does replace it (``zero_tangent``, see ``inject.py``).
    params = dict(params, zero_tangent=True)
  out = sow_p.bind(*primals, **params)
  tangents = _replaced_tangents(key, primals[: len(out)], tangents, params)
  if params['kind'] == 'perturb':
    return out, perturb_tangents(tangents, params)
  return out, tangents


def _replaced_tangents(key: Intervening, primals, tangents, params) -> list:
  """The tangents of a sow that the ``intervene`` of ``key`` replaces.

  An array replacement is a constant: zero tangents. A callable's tangent
  is a ``'jvp'`` marker, resolved by the intervene's rewrite with the
  callable of its call (not traced here, where a ``jax.jit`` inside would
  cache it for the next callable).
  """
  if all(type(t) is _jax.Zero for t in tangents):
    return tangents
  if params['sow_name'] in key.arrays:
    return [_jax.Zero(_jax.typeof(x).to_tangent_aval()) for x in primals]
  return bind_marker(
      JVP_MARKER, [_jax.instantiate_zeros(t) for t in tangents], primals, params
  )


def bind_marker(kind: str, linear, primals, params) -> list:
  """Binds a derivative marker of ``kind`` for the sow with ``params``."""
  return sow_p.bind(
      *linear,
      *primals,
      sow_name=params['sow_name'],
      tag=params['tag'],
      treedef=params['treedef'],
      reduction=None,
      kind=kind,
      batch_dims=params['batch_dims'],
      n_closure=len(primals),
      effect=False,
      remat_copy=False,
  )


def _second_order_error(params) -> NotImplementedError:
  name = params['sow_name']
  return NotImplementedError(
      f'intervene: sow {name!r} is replaced by a callable, and a derivative'
      ' of second order taken inside the intervened function (jax.hessian,'
      ' jax.jvp of jax.grad, ...) differentiates the derivative of'
      f' values[{name!r}] at the sown value, which intervene does not'
      ' support. Put that transform outside: jax.hessian(intervene(f,'
      ' values)) is exact; or replace the name by an array.'
  )


def _marker_jvp(primals, tangents, params):
  # A marker is linear in its leading operands; its derivative with
  # respect to the sown value (the closure) would be of second order.
  n = len(primals) - params['n_closure']
  if any(type(t) is not _jax.Zero for t in tangents[n:]):
    raise _second_order_error(params)
  out = sow_p.bind(*primals, **params)
  linear = tangents[:n]
  if all(type(t) is _jax.Zero for t in linear):
    return out, list(linear)
  linear = [_jax.instantiate_zeros(t) for t in linear]
  return out, sow_p.bind(*linear, *primals[n:], **params)


def _intervened_transpose(core_transpose, cts, *args, **params):
  # A derivative marker transposes to the other one, on the same primals.
  if params['kind'] not in DERIVATIVE_KINDS:
    return core_transpose(cts, *args, **params)
  n_closure = params['n_closure']
  primals = args[len(args) - n_closure :]
  if any(_jax.is_undefined_primal(x) for x in primals):
    raise _second_order_error(params)
  if all(type(ct) is _jax.Zero for ct in cts):
    return [None] * len(args)
  other = VJP_MARKER if params['kind'] == JVP_MARKER else JVP_MARKER
  cts = [_jax.instantiate_zeros(ct) for ct in cts]
  return [*bind_marker(other, cts, primals, params), *([None] * n_closure)]


# -- batching -------------------------------------------------------------


def _intervened_batch(core_batch, axis_data, leaves, dims, **params):
  key = replacing(params) if params['effect'] else None
  if _replaced_by_callable_unbatched(key, params, dims):
    return _kept_unbatched(axis_data, leaves, params)
  replaced = key is not None
  if params['kind'] not in DERIVATIVE_KINDS and not replaced:
    return core_batch(axis_data, leaves, dims, **params)
  outs = bind_mapped_first(axis_data, leaves, dims, params)
  # A marker is a function of the value and the tangent; ``intervene`` may
  # replace the value per example: every leaf comes back batched. (Only
  # such sows: an unbatched result stays unbatched, as ``vmap(...,
  # out_axes=None)`` and ``jacfwd`` require.)
  if replaced and params['sow_name'] in key.arrays:
    if all(d is None for d in dims):
      key.batched_arrays.append(params['sow_name'])
  return outs, [0] * len(outs)


def _replaced_by_callable_unbatched(key, params, dims) -> bool:
  """Whether an intervene being staged replaces this unbatched plain sow by
  a callable (it then stays unbatched where it is, see _kept_unbatched)."""
  return (
      key is not None
      and params['kind'] == 'value'
      and params['reduction'] is None
      and all(d is None for d in dims)
      and params['sow_name'] not in key.arrays
  )


def _kept_unbatched(axis_data, leaves, params):
  # A value that does not vary over the axis, replaced by a callable: the
  # sow stays unbatched where it is (``'kept'``, replaced there), so its
  # result stays unbatched (``jax.jacfwd`` needs its primal so); a capture
  # collects that result with the axis first, from a ``'hoisted'`` copy.
  kept = sow_p.bind(*leaves, **dict(params, kind=KEPT))
  hoisted = dict(params, kind=HOISTED)
  bind_mapped_first(axis_data, kept, [None] * len(kept), hoisted)
  return kept, [None] * len(kept)


# -- partial evaluation and jet --------------------------------------------


def _intervened_partial_eval(core_rule, saveable, unks_in, inst_in, eqn):
  """A derivative marker of known operands is a computation, not a
  collection: known, saved where needed. A known sow that an ``intervene``
  replaces here is known too, and its replaced value saved (a recomputation
  would see the value before the replacement)."""
  p = eqn.params
  if not any(unks_in) and (
      p['kind'] in DERIVATIVE_KINDS
      or (p['effect'] and replacing(p) is not None)
  ):
    n = len(eqn.outvars)
    return eqn, None, [False] * n, [False] * n, []
  return core_rule(saveable, unks_in, inst_in, eqn)


def _intervened_jet(core_jet, primals, series, **params):
  key = replacing(params) if params['effect'] else None
  if key is None and params['kind'] not in DERIVATIVE_KINDS:
    return core_jet(primals, series, **params)
  out = sow_p.bind(*primals, **params)
  if key is not None and params['sow_name'] in key.arrays:
    # A constant replacement: every term of its series is zero.
    return out, [[jnp.zeros_like(x)] * len(s) for x, s in zip(out, series)]
  raise NotImplementedError(
      f'intervene: sow {params["sow_name"]!r} is replaced by a callable inside'
      ' jax.experimental.jet, which intervene cannot differentiate there.'
      ' Put jet outside intervene (jet(intervene(f, values), ...)), or'
      ' replace the name by an array.'
  )


def _wrap(registry: dict, wrapper) -> None:
  """``registry[sow_p]`` becomes ``wrapper(core_rule, *args, **params)``."""
  core_rule = registry[sow_p]
  registry[sow_p] = lambda *args, **params: wrapper(core_rule, *args, **params)


_wrap(_jax.primitive_jvps, _intervened_jvp)
_wrap(_jax.primitive_transposes, _intervened_transpose)
_wrap(_jax.fancy_primitive_batchers, _intervened_batch)
_wrap(_jax.partial_eval_jaxpr_custom_rules, _intervened_partial_eval)
_wrap(_jax.jet_rules, _intervened_jet)
