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

"""The top level of a capture: where the sows ``f`` binds are collected.

``capture(f)(*args)`` runs ``f`` with a :class:`CaptureTrace` as JAX's
current trace. The trace stands between ``f`` and the trace the capture was
called in, its *parent* (an enclosing ``jit``'s staging, ``grad``'s JVP,
``vmap``'s batching, or JAX's eval trace when the capture is called
eagerly). It has no tracers of its own:
every value ``f`` sees is the parent's, and every primitive ``f`` binds is
handed to the parent as it is, except

* an accepted ``sow``: the :class:`~flax.nnx.sow.collect.Collector` records its operands,
  which are the parent's values, and the sow is not bound;
* a higher-order primitive whose sub-jaxprs hold accepted sows: it is staged
  alone into a one-equation jaxpr, which the capture loop
  (``collect.interpret``) evaluates on the parent, so the rule registered for
  the primitive in ``collect_rules`` rewrites it;
* a call that carries Python functions instead of jaxprs (``custom_jvp``,
  ``custom_vjp``, ``shard_map``, ``core.call``): it is staged alone the same
  way first, to see whether its functions sow (eagerly, ``custom_jvp`` and
  ``custom_vjp`` run their body under the trace instead, as JAX's eval
  trace runs it).

Called outside any transform, the parent is the eval trace, so ``f`` sees
concrete values and runs op by op (see *eager captures* below); nothing of
JAX's eager path is replaced. Inside ``jax.jit`` each equation of ``f`` is
staged once, into the caller's jaxpr: there is no second program to copy.
The trace claims no other trace's identity; NNX Variables see through it
by the NNX layer's ``trace_state`` hook (:func:`opaque_trace_state`). The
idea is oryx ``harvest``'s (a trace that reaps sows), kept to the top level;
everything below it is the jaxpr rewrite.
"""

from __future__ import annotations

import contextlib
import threading
import typing as tp

from flax.nnx.sow import _jax
from flax.nnx.sow import _jax_patches  # PR: eager
from flax.nnx.sow import capturing
from flax.nnx.sow import collect as capture_lib
from flax.nnx.sow import sites
from flax.nnx.sow.primitive import sow_p
from flax.nnx.sow.primitive import staging


class _Where:
  """`` (at file:line)`` of the user's call of a sow, formatted on demand."""

  __slots__ = ('source_info',)

  def __init__(self, source_info):
    self.source_info = source_info

  def __format__(self, spec):
    return f' (at {_jax.summarize_source(self.source_info)})'

  __str__ = __repr__ = lambda self: format(self)


_JAXPR_TYPES = frozenset({_jax.Jaxpr, _jax.ClosedJaxpr})


def _jaxprs(params: dict[str, tp.Any]) -> list[_jax.Jaxpr]:
  """What ``jax.core.jaxprs_in_params`` finds, as a list (often empty).

  Runs for every primitive ``f`` binds, so it looks into a tuple only when
  its first entry is a jaxpr (``cond``'s branches) or ``None`` (optional
  entries, as in ``custom_linear_solve``), not into tuples of shardings,
  flags or axes.
  """
  found = []
  for v in params.values():
    t = type(v)
    if t in _JAXPR_TYPES:
      found.append(v)
    elif (t is tuple or (t is not str and isinstance(v, tuple))) and v:
      first = v[0]
      if first is None or type(first) in _JAXPR_TYPES:
        found.extend(x for x in v if type(x) in _JAXPR_TYPES)
  return found


class CaptureTrace(_jax.Trace):
  """Hands what ``f`` binds to ``parent``, collecting accepted sows.

  Args:
    parent: the trace that was current when the capture was called.
    collector: where the sows go (``collect.Collector``).
  """

  def __init__(self, parent, collector: capture_lib.Collector):
    super().__init__()
    self.parent = parent
    self.collector = collector
    # Lowering of Hijax types happens where the parent wants it.
    self.requires_low = parent.requires_low
    # Called outside any transform (the parent is the eval trace, or an
    # eager capture's trace): values are concrete.
    self.eager = _eager_parent(parent)
    # The trace keeps its own identity: objects that record the trace they
    # were made in (NNX Variables) look through it by
    # :func:`opaque_trace_state`.

  def process_primitive(self, primitive, args, params, /):
    if primitive is sow_p:
      if self.collector.takes(params):
        where_ = _Where(_jax.current_source_info())
        with _jax.set_current_trace(self.parent):
          return self.collector.sow(params, list(args), where_)
    elif (
        jaxprs := [params['jaxpr']]
        if primitive is _jax.jit_p  # most calls: jax.numpy's jitted functions
        else _jaxprs(params)
    ) and self.collector.has_work(jaxprs):
      return self._collect_alone(
          lambda *xs: primitive.bind(*xs, **params),
          args,
          primitive,
      )
    # Called by ``bind`` with the eval trace current, as the parent expects.
    return self.parent.process_primitive(primitive, args, params)

  def process_call(self, primitive, f, args, params, /):
    return self._collect_alone(
        lambda *xs: primitive.bind(*xs, subfuns=(f,), **params),
        args,
        primitive,
    )

  def process_custom_jvp_call(
      self, primitive, fun, jvp, args, /, *, symbolic_zeros
  ):
    if self.eager:  # what JAX's eval trace does: run the body
      with _jax.set_current_trace(self):
        return fun.call_wrapped(*args)
    outs = self._collect_alone(
        lambda *xs: primitive.bind(
            *xs, subfuns=(fun, jvp), symbolic_zeros=symbolic_zeros
        ),
        args,
        primitive,
    )
    _one_rule_called(fun, jvp)
    return outs

  def process_custom_vjp_call(
      self, primitive, fun, fwd, bwd, args, /, *, out_trees, symbolic_zeros
  ):
    if self.eager:
      with _jax.set_current_trace(self):
        return fun.call_wrapped(*args)
    outs = self._collect_alone(
        lambda *xs: primitive.bind(
            *xs,
            subfuns=(fun, fwd, bwd),
            out_trees=out_trees,
            symbolic_zeros=symbolic_zeros,
        ),
        args,
        primitive,
    )
    _one_rule_called(fun, fwd)
    return outs

  def process_shard_map(self, primitive, fun, args, **params):
    # ``shard_map`` returns a ``FlatTree`` of its outputs.
    tree = []

    def bind(*xs):
      out = primitive.bind(*xs, subfuns=(fun,), **params)
      tree.append(out)
      return list(out)

    outs = self._collect_alone(bind, args, primitive, multiple_results=True)
    return tree[0].update(outs)

  def stage_value(self, val):
    return self.parent.stage_value(val)

  def cur_qdd(self, x):
    return self.parent.cur_qdd(x)

  def _collect_alone(self, bind, args, primitive, multiple_results=None):
    """Stages ``bind(*args)`` alone, then evaluates it on the parent,
    collecting its sows."""
    closed = _stage_alone(bind, args, primitive, multiple_results)
    top = contextlib.nullcontext()
    # Its equation records the name stack the capture was called in.
    top = capture_lib.top_of_capture(self.collector.outside)  # PR: shard_map
    with _jax.set_current_trace(self.parent), top:
      outs = _evaluate(closed, args, self.collector)
    return _results(outs, primitive, multiple_results)


def _stage_alone(bind, args, primitive, multiple_results) -> _jax.ClosedJaxpr:
  """``bind(*args)`` staged into a one-equation jaxpr."""
  if multiple_results is None:
    multiple_results = primitive.multiple_results

  def one_equation(*xs):
    out = bind(*xs)
    return list(out) if multiple_results else [out]

  # Staged from here, the equation would not see the user's frames (JAX
  # records the stack only below the function it traces): give it those
  # of the call ``f`` made, for error messages and the rules.
  source_info = _jax.current_source_info()
  closed = _jax.trace_to_closed_jaxpr(
      one_equation, [_jax.arg_type(x) for x in args], primitive.name
  )
  return _jax.with_source_info(closed, source_info)


def _evaluate(closed, args, collector) -> list[tp.Any]:
  """``closed`` evaluated on the current trace, ``collector`` collecting."""
  if collector is not None and collector.has_work([closed.jaxpr]):
    return capture_lib.eval_collecting(
        closed.jaxpr, closed.consts, list(args), collector
    )
  return _jax.eval_into_current_trace(closed.jaxpr, closed.consts, list(args))


def _results(outs, primitive, multiple_results):
  if multiple_results is None:
    multiple_results = primitive.multiple_results
  return outs if multiple_results else outs[0]


# -- eager captures ----------------------------------------------------------
#
# Called outside any transform, a capture runs ``f`` under a CaptureTrace on
# JAX's eval trace: every value ``f`` sees is concrete (value-dependent Python
# works, also in custom_jvp/custom_vjp functions, which run as JAX runs them
# eagerly), and nothing of JAX's eager path is replaced. Each operation pays
# one Python call more than without the capture.


def _refuse_compiled_calls() -> None:  # PR: eager
  if isinstance(_jax.trace_ctx.trace, CaptureTrace):
    raise TypeError(
        'capture: f calls an ahead-of-time compiled function'
        ' (jax.jit(g).lower(...).compile()). It runs as a compiled'
        ' executable that no transform can look into, so a capture cannot'
        ' collect the sows inside it. Call the jitted function itself'
        ' (jax.jit(g)) inside the capture instead.'
    )


_jax_patches.register('compiled_calls', _refuse_compiled_calls)  # PR: eager


def _one_rule_called(fun, rule) -> None:
  """Leaves the output structure of a custom rule where JAX looks for it.

  ``custom_jvp``/``custom_vjp`` read it from exactly one of ``fun`` (called
  when the call is staged or evaluated) and ``rule`` (``jvp``/``fwd``, called
  instead when the parent differentiates). We staged ``fun`` to look for
  sows; if the parent then called ``rule``, ``fun``'s record is dropped.
  """
  if _jax.stores_filled(rule):
    _jax.reset_stores(fun)


def trace_and_collect(
    f: tp.Callable[..., tp.Any],
    accepts_key: frozenset | None,
    args: tuple[tp.Any, ...],
    kwargs: dict[str, tp.Any],
) -> tuple[tp.Any, capture_lib.Collected]:
  """Calls ``f(*args, **kwargs)``, collecting its sows: eagerly on the eval
  trace (an eager capture, see above), inside a transform under a
  :class:`CaptureTrace`.

  The arguments reach ``f`` as they are (NNX graph nodes are the caller's
  objects, which ``f`` may update; NumPy arrays stay NumPy arrays), and
  ``f``'s output comes back as it is.

  Returns:
    ``(f's output, collected)``.
  """
  if _jax.jit_disabled():
    raise ValueError(
        'capture cannot run under jax.disable_jit(): JAX then runs'
        ' lax.scan, fori_loop and while_loop as Python loops and lax.cond as'
        ' a Python if, so what a capture collects would not have the layout'
        ' it has with jit (one entry per iteration instead of one stacked'
        ' entry, no accumulator for a name sown only in the branch not'
        ' taken). Leave disable_jit for the capture: `with'
        ' jax.disable_jit(False):` around the call.'
    )
  # Each sow is folded as it is bound (python_folds).
  collector = capture_lib.Collector(accepts_key, python_folds=True)
  # A jax.vmap or jax.grad around the capture is not one inside it.
  collector.outside = capture_lib.outside_transforms()  # PR: shard_map
  parent = _jax.trace_ctx.trace
  # Part of JAX's tracing cache key: its own record of the names that
  # tracing asks about (vmap's rules, rarely), so that it compares cheaply.
  staging_key = sites.for_call(accepts_key)
  try:
    with staging(staging_key):
      out = _call_on(parent, collector, f, args, kwargs)
  finally:
    sites.release(staging_key)
  return out, collector.result()


def _eager_parent(parent) -> bool:
  """Whether a capture on ``parent`` is called outside any transform."""
  return _jax.is_eval_trace(parent) or (
      isinstance(parent, CaptureTrace) and parent.eager
  )


class _EagerTraces(threading.local):
  """One CaptureTrace per eager parent on this thread, reused by every eager
  capture on it: JAX keys its tracing caches by the current trace, so a
  trace made anew for each call would re-trace every ``jax.jit`` (and every
  jitted ``jax.numpy`` function) ``f`` calls, on every call."""

  def __init__(self):
    super().__init__()
    self.by_parent: dict[int, CaptureTrace] = {}


_EAGER_TRACES = _EagerTraces()


def _call_on(parent, collector, f, args, kwargs):
  """``f(*args, **kwargs)`` with its sows collected, under a
  :class:`CaptureTrace` on ``parent`` (eagerly, the thread's one for that
  parent, given ``collector`` for the call)."""
  eager = _eager_parent(parent)
  if eager:
    trace = _EAGER_TRACES.by_parent.get(id(parent))
    if trace is None or trace.parent is not parent:
      trace = CaptureTrace(parent, collector)
      _EAGER_TRACES.by_parent[id(parent)] = trace
    outer, trace.collector = trace.collector, collector
  else:
    trace = CaptureTrace(parent, collector)
  try:
    with _jax.set_current_trace(trace):
      return f(*args, **kwargs)
  finally:
    if eager:
      trace.collector = outer
    else:
      trace.invalidate()


def opaque_trace_state() -> tp.Any:
  """JAX's opaque trace state (``jax.extend.core.get_opaque_trace_state``)
  of the trace that the values ``f`` sees belong to.

  A :class:`CaptureTrace` owns no values: what ``f`` sees is its parent's.
  This is the state of the innermost trace that is not a capture's, so an
  object that records the trace it was made in (an NNX Variable) may be
  updated inside a capture exactly when it could be without it.
  """
  trace = _jax.trace_ctx.trace
  if not isinstance(trace, CaptureTrace):
    return _jax.get_opaque_trace_state(convention='nnx')
  while isinstance(trace, CaptureTrace):
    trace = trace.parent
  with _jax.set_current_trace(trace):
    return _jax.get_opaque_trace_state(convention='nnx')


capturing.runners.append(trace_and_collect)
