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

"""The one place where this package touches JAX internals.

Every ``jax._src`` name the rewrite and the rules use is imported here, so a
new JAX release is adapted in this file alone. The tested range is declared in
``pyproject.toml`` (``jax>=0.10.2,<0.11``) and checked here at import
(:func:`check_jax_version`): outside it, importing ``flax.nnx.sow`` raises an
``ImportError`` that names the range, before any internal is read.
"""

from __future__ import annotations

import contextlib
import os  # PR: intervene
import typing as tp

import jax
import jax.numpy as jnp
import numpy as np  # PR: reductions

# The JAX versions these aliases were written and tested against (also in
# pyproject.toml). Outside the range a renamed internal would fail somewhere
# deep in a capture; fail here instead, saying what to do.
TESTED_JAX = ((0, 10, 2), (0, 11, 0))  # [lowest, first untested)


def _release(version: str) -> tuple[int, ...]:
  parts = []
  for p in version.split('.')[:3]:
    digits = ''.join(c for c in p if c.isdigit()) or '0'
    parts.append(int(digits))
  return tuple(parts + [0] * (3 - len(parts)))


def check_jax_version(version: str) -> None:
  """Raises ``ImportError`` unless ``version`` is in :data:`TESTED_JAX`."""
  low, high = TESTED_JAX
  if not low <= _release(version) < high:
    raise ImportError(
        f'flax.nnx.sow was tested with jax>={".".join(map(str, low))},'
        f'<{".".join(map(str, high))} and reads JAX internals that change'
        f' between releases; found jax {version}. Install a JAX in that'
        ' range, or adapt flax/nnx/sow/_jax.py (the only file that reads'
        ' JAX internals) and widen the range there and in pyproject.toml.'
    )


check_jax_version(jax.__version__)

# pylint: disable=g-import-not-at-top,wrong-import-position
# (after the version check, so an untested JAX gets its message first)
from jax._src import core
from jax._src import custom_batching  # PR: custom
from jax._src import custom_derivatives  # PR: custom
from jax._src import effects
from jax._src import linear_util as lu
from jax._src import config as jax_config  # PR: toplevel
from jax._src import mesh as mesh_lib  # PR: reductions
from jax._src import shard_map as shard_map_lib  # PR: shard_map
from jax._src import source_info_util
from jax._src import stages  # PR: eager
from jax._src import util as jax_util  # PR: reductions
from jax._src.interpreters import ad
from jax._src.interpreters import batching
from jax._src.interpreters import mlir
from jax._src.interpreters import partial_eval as pe
from jax._src.lax import control_flow as lax_control_flow  # PR: partial_eval
from jax._src.named_sharding import UNSPECIFIED
from jax._src.state import types as state_types  # PR: reductions
from jax.experimental import jet as jet_lib
from jax.extend import core as jex_core
from jax.extend.core import primitives as jex_primitives

# pylint: enable=g-import-not-at-top,wrong-import-position


# Public names first (jax.extend), internal ones where JAX exposes none.
Jaxpr = jex_core.Jaxpr
ClosedJaxpr = jex_core.ClosedJaxpr
JaxprEqn = jex_core.JaxprEqn
Literal = jex_core.Literal
Var = jex_core.Var
Primitive = jex_core.Primitive
Effect = jex_core.Effect
Zero = ad.Zero  # PR: perturb
ShapedArray = core.ShapedArray

jit_p = jex_primitives.jit_p
closed_call_p = jex_primitives.closed_call_p
call_p = jex_primitives.call_p
remat_p = jex_primitives.remat_p
custom_jvp_call_p = jex_primitives.custom_jvp_call_p  # PR: toplevel
custom_vjp_call_p = jex_primitives.custom_vjp_call_p  # PR: toplevel
scan_p = jex_primitives.scan_p  # PR: loops
while_p = jex_primitives.while_p  # PR: loops
cond_p = jex_primitives.cond_p  # PR: reductions
# The forward pass of a ``custom_vjp`` with ``optimize_remat=True``.
remat_opt_p = custom_derivatives.remat_opt_p  # PR: custom
custom_vmap_p = custom_batching.custom_vmap_p  # PR: custom
shard_map_p = shard_map_lib.shard_map_p  # PR: shard_map
shard_aval = core.shard_aval  # PR: shard_map
linear_solve_p = lax_control_flow.linear_solve_p  # PR: linear_solve

typeof = core.typeof  # PR: reductions


def arg_type(x: tp.Any) -> tp.Any:
  """``x``'s type for tracing a function of it: its aval, with its current
  quasi-dynamic data (the structure of a Hijax Variable) for a mutable type."""
  return core.aval_qdd_from_current_val(core.typeof(x), x)


def binder_types(jaxpr: Jaxpr | ClosedJaxpr) -> list[tp.Any]:
  """The types to re-trace ``jaxpr`` at: its input avals, with the initial
  quasi-dynamic data of mutable (Hijax) binders, which JAX needs to lower a
  construct that reads them."""
  return list(jaxpr.in_aval_qdds)


Trace = core.Trace  # PR: toplevel
set_current_trace = core.set_current_trace  # PR: toplevel
current_source_info = source_info_util.current  # PR: toplevel
eval_jaxpr = core.eval_jaxpr  # PR: toplevel
trace_ctx = core.trace_ctx
get_opaque_trace_state = jex_core.get_opaque_trace_state  # PR: toplevel
convert_constvars_jaxpr = pe.convert_constvars_jaxpr


def partial_eval_jaxpr_nounits(*args, **kwargs):  # PR: partial_eval
  """``pe.partial_eval_jaxpr_nounits``, looked up at each call (it is
  wrapped: see ``_jax_patches.py``)."""
  return pe.partial_eval_jaxpr_nounits(*args, **kwargs)


primitive_jvps = ad.primitive_jvps
primitive_transposes = ad.primitive_transposes
instantiate_zeros = ad.instantiate_zeros  # PR: perturb
is_undefined_primal = ad.is_undefined_primal  # PR: intervene
fancy_primitive_batchers = batching.fancy_primitive_batchers
jet_rules = jet_lib.jet_rules  # jax.experimental.jet's rule registry
register_lowering = mlir.register_lowering
partial_eval_jaxpr_custom_rules = pe.partial_eval_jaxpr_custom_rules
new_jaxpr_eqn = pe.new_jaxpr_eqn
user_context = source_info_util.user_context
current_name_stack = source_info_util.current_name_stack


def transforms_in(name_stack, transform: str) -> int:  # PR: shard_map
  """How many ``transform`` transforms (``'vmap'``, ``'jvp'``)
  ``name_stack`` (an equation's, or :func:`current_name_stack`) records:
  ``jax.vmap`` pushes ``vmap`` while it traces its function, and
  ``jax.jvp``/``grad``/``vjp``/``linearize`` push ``jvp``, so every
  equation staged under one, also the call, loop or branch holding one,
  records it."""
  return sum(
      1
      for e in name_stack.stack
      if isinstance(e, source_info_util.Transform) and e.name == transform
  )


def is_eval_trace(trace) -> bool:  # PR: toplevel
  """Whether ``trace`` is JAX's eval trace (no transform is tracing)."""
  return isinstance(trace, core.EvalTrace)


def jit_disabled() -> bool:  # PR: toplevel
  """Whether ``jax.disable_jit()`` is in force."""
  return bool(jax_config.disable_jit.value)


def call_vmap_rule(  # PR: custom
    rule: tp.Callable, in_tree, out_tree, axis_size: int, in_batched, args
) -> tuple[list[tp.Any], list[bool]]:
  """Calls a ``custom_vmap_call``'s ``rule`` on flat ``args`` (as JAX's
  batching rule does); returns its flat outputs and which are batched."""
  out, out_batched = custom_batching.call_rule(
      rule,
      axis_size,
      jax.tree_util.tree_unflatten(in_tree, list(in_batched)),
      jax.tree_util.tree_unflatten(in_tree, list(args)),
  )
  flat_out, tree = jax.tree_util.tree_flatten(out)
  flat_batched, batched_tree = jax.tree_util.tree_flatten(out_batched)
  custom_batching.check_vmap_rule_trees(rule, out_tree, tree, batched_tree)
  return flat_out, flat_batched


def bind_custom_vmap(  # PR: custom
    call: ClosedJaxpr, args: tp.Sequence[tp.Any], rule: tp.Callable
) -> list[tp.Any]:
  """Binds ``custom_vmap_call`` with body ``call`` and a flat ``rule``.

  ``rule(axis_size, in_batched, *args) -> (outs, out_batched)`` takes and
  returns flat lists, one entry per argument and output of ``call``.
  """
  n_in, n_out = len(args), len(call.out_avals)
  return custom_batching.custom_vmap_p.bind(
      *args,
      call=call,
      rule=rule,
      in_tree=jax.tree_util.tree_structure((0,) * n_in),
      out_tree=jax.tree_util.tree_structure([0] * n_out),
  )


def summarize_source(source_info) -> str:
  """``file:line:column (function)`` of the user's frame in ``source_info``."""
  return source_info_util.summarize(source_info)


def traced_under_lax_map_batch(source_info) -> bool:  # PR: intervene
  """Whether an equation was staged under ``lax.map(..., batch_size=k)``.

  That is, by the ``jax.vmap(f)`` in the body of its ``lax.scan``. ``lax.map`` with ``batch_size`` scans over ``jax.vmap(f)``; the staged
  program is the same as a ``lax.scan`` the user wrote around a vmap, so this
  reads the Python frames recorded when the equation was staged: the frame
  inside ``lax.map``'s scan body (a lambda in ``lax/control_flow/loops.py``)
  calls ``jax.vmap``'s wrapper directly. ``False`` when the frames are not
  recorded or JAX lays them out differently.
  """
  traceback = getattr(source_info, 'traceback', None)
  if traceback is None:
    return False
  frames = traceback.frames  # innermost first
  loops_file = os.path.join('lax', 'control_flow', 'loops.py')
  api_file = os.path.join('jax', '_src', 'api.py')
  for i, frame in enumerate(frames):
    if frame.file_name.endswith(loops_file) and frame.function_name in (
        'map.<locals>.<lambda>',
        '<lambda>',
    ):
      callee = [
          f for f in frames[:i] if not f.file_name.endswith('traceback_util.py')
      ]
      if (
          callee
          and callee[-1].file_name.endswith(api_file)
          and 'vmap' in callee[-1].function_name
      ):
        return True
  return False


def exclude_from_source_info(path: str) -> None:
  """Makes frames under ``path`` count as library frames, not the user's.

  Errors that name where a sow was called then point at the user's line,
  not at this package's ``sow``.
  """
  source_info_util.register_exclusion(path)


def weak_cache_key(cls: type) -> None:  # PR: reductions
  """Makes JAX's parameter-keyed caches hold objects of ``cls`` weakly.

  The abstract-evaluation cache keys on an equation's parameters; a
  parameter holding user functions (a sow's ``reduce_fn``) would otherwise
  keep them, and all they close over, alive until evicted.
  """
  jax_util.weakref_cache_key_types.add(cls)


def is_ref(x: tp.Any) -> bool:
  """Whether ``x`` is a mutable array reference (``jax.new_ref``)."""
  return isinstance(x, core.Ref)


def is_mutable(x: tp.Any) -> bool:  # PR: reductions
  """Whether ``x`` is a mutable JAX value: an array reference (a ref
  Variable's) or a mutable Hijax type (a Hijax Variable), also as a tracer."""
  aval = core.typeof(x)
  return isinstance(aval, state_types.AbstractRef) or bool(
      getattr(aval, 'has_qdd', False)
  )


def allow_effect(effect_type: type[Effect]) -> None:
  """Registers ``effect_type`` where JAX checks effects of staged programs."""
  effects.lowerable_effects.add_type(effect_type)
  effects.control_flow_allowed_effects.add_type(effect_type)
  effects.custom_derivatives_allowed_effects.add_type(effect_type)
  effects.remat_allowed_effects.add_type(effect_type)
  effects.partial_eval_kept_effects.add_type(effect_type)


def debug_info(name: str, num_args: int) -> lu.DebugInfo:
  """A ``DebugInfo`` for a function this package traces itself."""
  return lu.DebugInfo(
      'capture', name, tuple(f'arg{i}' for i in range(num_args)), None
  )


def wrap_init(fn: tp.Callable, name: str, num_args: int) -> lu.WrappedFun:
  return lu.wrap_init(fn, debug_info=debug_info(name, num_args))


def _stores(fun: lu.WrappedFun) -> list[lu.Store]:  # PR: toplevel
  return [
      s._store if isinstance(s, lu.EqualStore) else s  # pylint: disable=protected-access
      for s in fun.stores
      if s is not None
  ]


def stores_filled(fun: lu.WrappedFun) -> bool:  # PR: toplevel
  """Whether calling ``fun`` has written its auxiliary outputs."""
  return any(bool(s) for s in _stores(fun))


def reset_stores(fun: lu.WrappedFun) -> None:  # PR: toplevel
  """Forgets the auxiliary outputs calling ``fun`` wrote."""
  for s in _stores(fun):
    s.reset()


def trace_to_closed_jaxpr(
    fn: tp.Callable, in_avals: tp.Sequence[tp.Any], name: str
) -> ClosedJaxpr:
  """Stages flat ``fn`` at ``in_avals`` into a closed jaxpr."""
  wrapped = wrap_init(fn, name, len(in_avals))
  jaxpr, _, consts = pe.trace_to_jaxpr_dynamic(wrapped, list(in_avals))
  return ClosedJaxpr(jaxpr, consts)


def with_source_info(  # PR: toplevel
    closed: ClosedJaxpr, source_info
) -> ClosedJaxpr:
  """``closed`` with ``source_info`` on each of its top-level equations."""
  eqns = [e.replace(source_info=source_info) for e in closed.jaxpr.eqns]
  return ClosedJaxpr(closed.jaxpr.replace(eqns=eqns), closed.consts)


def close_over_nothing(closed: ClosedJaxpr) -> tuple[Jaxpr, list[tp.Any]]:
  """Turns constants into leading inputs, for rules that need an open jaxpr."""
  return convert_constvars_jaxpr(closed.jaxpr), list(closed.consts)


def jaxprs_in_params(params: dict[str, tp.Any]) -> tp.Iterator[Jaxpr]:
  return core.jaxprs_in_params(params)


def bind_equation(eqn: JaxprEqn, invals: tp.Sequence[tp.Any]) -> list[tp.Any]:
  """Binds ``eqn``'s primitive on the current trace, as ``eval_jaxpr`` does."""
  params = eqn.primitive.get_bind_params(eqn.params)
  out = eqn.primitive.bind(*invals, **params)
  return list(out) if eqn.primitive.multiple_results else [out]


def equation_context(eqn: JaxprEqn):
  """The source-info and equation context ``eval_jaxpr`` binds ``eqn`` in."""
  name_stack = current_name_stack() + eqn.source_info.name_stack
  stack = contextlib.ExitStack()
  stack.enter_context(
      user_context(eqn.source_info.traceback, name_stack=name_stack)
  )
  stack.enter_context(eqn.ctx.manager)
  return stack


def zeros_like_tangent(x: tp.Any) -> tp.Any:  # PR: custom
  """Instantiated zeros of the tangent type of ``x`` (float0 for integers)."""
  return ad.instantiate_zeros(Zero(typeof(x).to_tangent_aval()))


def as_value(x: tp.Any) -> tp.Any:
  """A literal's value as an array; anything else unchanged."""
  if isinstance(x, (core.Tracer, jax.Array)):
    return x
  return jnp.asarray(x)


def eval_closed(  # PR: reductions
    closed: ClosedJaxpr, args: tp.Sequence[tp.Any]
) -> list:
  """``eval_jaxpr`` of a closed jaxpr; literal outputs come back as arrays."""
  return [as_value(x) for x in eval_jaxpr(closed.jaxpr, closed.consts, *args)]


def eval_fold(  # PR: reductions
    closed: ClosedJaxpr, args: tp.Sequence[tp.Any]
) -> list:
  """:func:`eval_closed` for a ``reduce_fn`` traced at one site.

  Inside ``shard_map`` the jaxpr was traced with the accumulator's type as
  ``init_fn()`` gives it, invariant over the mesh, but an accumulator kept
  per shard varies over mesh axes. So the fold is re-typed as JAX would
  have traced it with the real types: a ``pvary`` only adds the axes its
  operand does not vary over yet, and the operands of a first-order
  primitive that vary over different axes are ``pvary``-ed to the union
  (as ``jax.numpy`` does before binding).
  """
  env: dict[Var, tp.Any] = {}

  def read(v):
    return v.val if isinstance(v, Literal) else env[v]

  jaxpr = closed.jaxpr
  env.update(zip(jaxpr.constvars, closed.consts))
  env.update(zip(jaxpr.invars, args))
  for eqn in jaxpr.eqns:
    invals = [read(v) for v in eqn.invars]
    if eqn.primitive is core.pvary_p:
      (x,) = invals
      axes = tuple(
          a for a in eqn.params['axes'] if a not in varying_axes(typeof(x))
      )
      outs = [core.pvary_p.bind(x, axes=axes) if axes else x]
    else:
      if len(invals) > 1 and not any(
          True for _ in jaxprs_in_params(eqn.params)
      ):
        vmas = {varying_axes(typeof(x)) for x in invals}
        if len(vmas) > 1:
          invals = list(core.auto_insert_reshard(*invals))
      outs = bind_equation(eqn, invals)
    env.update(zip(eqn.outvars, outs))
  return [as_value(read(v)) for v in jaxpr.outvars]


def eval_into_current_trace(  # PR: toplevel
    jaxpr: Jaxpr, consts: tp.Sequence[tp.Any], args: tp.Sequence[tp.Any]
) -> list[tp.Any]:
  """``eval_jaxpr``, but copying the equations when staging into a jaxpr.

  Under a ``DynamicJaxprTrace`` (``jax.jit``, ``make_jaxpr``) the equations
  are copied into the trace as they are, several times faster than binding
  each one; elsewhere (eagerly, under ``grad``/``vmap``) each is bound.
  """
  trace = trace_ctx.trace
  if isinstance(trace, pe.DynamicJaxprTrace) and not trace.requires_low:
    src = source_info_util.current()
    # Constants may be tracers of this very trace (``f`` closed over a
    # ``jit``'s argument or a scan's carry): they enter as inputs, which
    # ``to_jaxpr_tracer`` keeps as they are, never as literal constants.
    tracers = [trace.to_jaxpr_tracer(x, src) for x in (*consts, *args)]
    outs = pe.inline_jaxpr_into_trace(
        trace, src, convert_constvars_jaxpr(jaxpr), (), *tracers
    )
    # An input returned as it is comes back as the caller's own object.
    inputs = dict(zip(jaxpr.invars, args))
    outs = [
        inputs.get(v, x) if isinstance(v, Var) else x
        for v, x in zip(jaxpr.outvars, outs)
    ]
  else:
    outs = eval_jaxpr(jaxpr, consts, *args)
  return [as_value(x) for x in outs]


def edit_jaxpr(  # PR: toplevel
    jaxpr: Jaxpr, eqns: list[JaxprEqn], outvars: list[tp.Any]
) -> Jaxpr:
  """``jaxpr`` with new equations and outputs (effects recomputed)."""
  effects_ = pe.make_jaxpr_effects(jaxpr.constvars, jaxpr.invars, outvars, eqns)
  debug = jaxpr.debug_info
  if debug is not None:
    debug = debug._replace(result_paths=None)
  return jaxpr.replace(
      eqns=eqns, outvars=outvars, effects=effects_, debug_info=debug
  )


def _staged(  # PR: partial_eval
    trace, ins, out_avals, primitive, params, effs, source, ctx=None
):
  """One equation staged into the partial evaluation ``trace`` on the
  unknown tracers ``ins``, kept whether or not its outputs are used if its
  effects are ones partial evaluation keeps; its output tracers."""
  outs = [
      pe.JaxprTracer(trace, pe.PartialVal.unknown(a), None) for a in out_avals
  ]
  recipe = pe.new_eqn_recipe(
      trace, ins, outs, primitive, params, effs, source, ctx
  )
  for t in outs:
    t.recipe = recipe
  if effects.partial_eval_kept_effects.filter_in(effs):
    trace.effect_handles.append(pe.EffectHandle(ins, recipe))
  return outs


def keep_if_sowing(  # PR: partial_eval
    trace, in_tracers, recipe, effect
) -> None:
  """Keeps the partial evaluation ``trace``'s staged ``recipe`` whether or
  not its outputs are used, if it carries ``effect``."""
  if effect in recipe.effects:
    trace.effect_handles.append(pe.EffectHandle(list(in_tracers), recipe))


def stage_unknown(  # PR: partial_eval
    trace, primitive, tracers, params
) -> list[tp.Any]:
  """Stages ``primitive`` (multiple results) in the partial evaluation
  ``trace``'s unknown program, also when every operand is known or there is
  none (``default_process_primitive`` would run it on the known side)."""
  tracers = [
      trace.instantiate_const(trace.to_jaxpr_tracer(t)) for t in tracers
  ]
  out_avals, effs = primitive.abstract_eval(
      *[t.aval for t in tracers], **params
  )
  source = source_info_util.current()
  return _staged(trace, tracers, out_avals, primitive, params, effs, source)


def enclosing_batch_trace(axis_size: int) -> tp.Any:  # PR: custom
  """The ``BatchTrace`` of the innermost ``jax.vmap`` around the current
  trace.

  Raises:
    AssertionError: no vmap of ``axis_size`` encloses the current trace.
  """
  trace = trace_ctx.trace
  while trace is not None and not isinstance(trace, batching.BatchTrace):
    trace = getattr(trace, 'parent_trace', None)
  assert trace is not None and trace.axis_data.size == axis_size, trace
  return trace


def mapped_by(trace, x) -> bool:  # PR: custom
  """Whether the vmap of ``trace`` maps ``x`` (or its primal or tangent)."""
  if isinstance(x, ad.JVPTracer):
    return mapped_by(trace, x.primal) or mapped_by(trace, x.tangent)
  return isinstance(x, batching.BatchTracer) and x._trace is trace  # pylint: disable=protected-access


def wrap_rule(  # PR: partial_eval
    registry: dict, primitive: Primitive, wrapper: tp.Callable
):
  """``registry[primitive]`` becomes ``wrapper(original_rule, *args)``.

  Idempotent.
  """
  original = registry[primitive]
  if getattr(original, '_sow_wrapped', False):
    return

  def rule(*args, **kwargs):
    return wrapper(original, *args, **kwargs)

  rule._sow_wrapped = True  # pylint: disable=protected-access
  registry[primitive] = rule


custom_partial_eval_rules = pe.custom_partial_eval_rules  # PR: partial_eval


def shard_map_context(  # PR: shard_map
    mesh, manual_axes: frozenset, check_vma: bool
):
  """What tracing a ``shard_map`` body runs under (as JAX stages one).

  The axis environment of the manual axes, the manual abstract mesh and the
  ``check_vma`` setting.
  """
  stack = contextlib.ExitStack()
  all_manual = manual_axes | set(mesh.manual_axes)
  stack.enter_context(
      core.extend_axis_env_nd(
          [(k, v) for k, v in mesh.shape.items() if k in all_manual]
      )
  )
  stack.enter_context(
      mesh_lib.use_abstract_mesh(
          mesh.abstract_mesh.update_axis_types(
              {n: mesh_lib.AxisType.Manual for n in manual_axes}
          )
      )
  )
  stack.enter_context(jax_config._check_vma(check_vma))  # pylint: disable=protected-access
  return stack


def replicated_spec(aval) -> tp.Any:  # PR: shard_map
  """The ``in_specs`` entry ``shard_map`` gives a constant of its body."""
  return shard_map_lib._repspec(aval)  # pylint: disable=protected-access


def varying_axes(aval) -> frozenset:  # PR: reductions
  """The manual mesh axes a value inside ``shard_map`` varies over."""
  mat = getattr(aval, 'mat', None)
  return frozenset(mat.varying) if mat is not None else frozenset()


def invariant_aval(aval) -> tp.Any:  # PR: loops
  """``aval`` without the manual mesh axes it varies over."""
  mat = getattr(aval, 'mat', None)
  if mat is None or not mat.varying:
    return aval
  return aval.update(manual_axis_type=mat.update(varying=frozenset()))


def current_mesh_axes() -> tuple[str, ...]:  # PR: loops
  """The axis names of the abstract mesh in context, in mesh order."""
  return tuple(mesh_lib.get_abstract_mesh().axis_names)


def pvary(x: tp.Any, axes: tp.Sequence[str]) -> tp.Any:  # PR: reductions
  """``x`` marked as varying over the manual mesh ``axes`` (a no-op where
  ``check_vma`` is off or it varies over them already)."""
  missing = frozenset(axes) - varying_axes(typeof(x))
  if not missing:
    return x
  return core.pvary(x, tuple(a for a in axes if a in missing))


def pvary_equation(  # PR: shard_map
    x: tp.Any, axes: tp.Sequence[str], like: JaxprEqn
) -> tuple[JaxprEqn, Var]:
  """A ``pvary`` equation that marks the atom ``x`` as varying over ``axes``.

  For editing a jaxpr inside a ``shard_map`` body without re-tracing it:
  ``axes`` are manual mesh axes, in mesh order, that ``x`` does not vary
  over yet; the equation takes ``like``'s source location and context.
  Returns the equation and its output variable.
  """
  aval = x.aval
  mesh = like.ctx.cur_abstract_mesh
  out = Var(
      aval.update(
          sharding=aval.sharding.update(mesh=mesh),
          manual_axis_type=aval.mat.update(
              varying=aval.mat.varying | frozenset(axes)
          ),
      )
  )
  eqn = core.new_jaxpr_eqn(
      [x],
      [out],
      core.pvary_p,
      {'axes': tuple(axes)},
      set(),
      like.source_info,
      like.ctx,
  )
  return eqn, out


def vary_like(x: tp.Any, like: tp.Any) -> tp.Any:  # PR: reductions
  """``x``, ``pvary``-ed to also vary over the manual axes ``like`` varies
  over (inside ``shard_map`` with ``check_vma``; elsewhere ``x``)."""
  missing = varying_axes(typeof(like)) - varying_axes(typeof(x))
  if not missing:
    return x
  return core.pvary(x, tuple(missing))


def off_manual_mesh(x: tp.Any) -> tp.Any:  # PR: reductions
  """A concrete array typed for a ``shard_map`` body, placed as a plain one.

  JAX can hand out a cached constant created inside a ``shard_map`` body (its
  sharding names the manual abstract mesh) to code outside any, where it
  does not type-check against arrays of other meshes.
  """
  if isinstance(x, core.Tracer) or not isinstance(x, jax.Array):
    return x
  mesh = getattr(typeof(x).sharding, 'mesh', None)
  if isinstance(mesh, mesh_lib.AbstractMesh) and mesh.manual_axes:
    return jax.device_put(np.array(x))
  return x
