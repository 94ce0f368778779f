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

"""Runs every benchmark of ``flax.nnx.sow`` and prints one table.

Usage::

  python benchmarks/run.py                  # the full suite (minutes)
  python benchmarks/run.py --quick          # a smoke run (seconds)
  python benchmarks/run.py --json out.json  # also write the figures as JSON
  python benchmarks/run.py --only jit_runtime,first_call

Each benchmark compares two things measured alternately in the same run and
reports their ratio; ``benchmarks/README.md`` says what each figure means.
The exit status is 1 when a benchmark raised (its row says why), 0
otherwise; a missed target is reported, not an error.
"""

from __future__ import annotations

import argparse
import functools
import gc
import inspect
import json
import os
import re
import statistics
import sys
import time
import traceback
import typing as tp
import warnings

if __package__ in (None, ''):
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(
      __file__))))

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from benchmarks import timing
from benchmarks import workload as wl
from flax.nnx.sow import capture, intervene, sow

Result = timing.Result


class Config(tp.NamedTuple):
  """The sizes and repeats of one run."""

  quick: bool
  sizes: wl.Sizes
  runtime_repeats: int
  compile_repeats: int
  compile_warmup: int
  trace_repeats: int
  first_call_layers: tuple[int, ...]
  scaling_layers: tuple[int, int]
  scan_steps: tuple[int, int]
  scan_width: int


FULL = Config(
    quick=False, sizes=wl.FULL, runtime_repeats=15, compile_repeats=11,
    compile_warmup=1, trace_repeats=5, first_call_layers=(12, 48, 192),
    scaling_layers=(12, 192), scan_steps=(100, 10_000), scan_width=256)
QUICK = Config(
    quick=True, sizes=wl.QUICK, runtime_repeats=3, compile_repeats=1,
    compile_warmup=0, trace_repeats=2, first_call_layers=(1, 2),
    scaling_layers=(1, 4), scan_steps=(100, 10_000), scan_width=16)

BENCHMARKS: dict[str, tp.Callable[[Config], list[Result]]] = {}


def benchmark(name):
  def register(fn):
    BENCHMARKS[name] = fn
    return fn
  return register


def _check_same(collected, manual):
  """Raises unless ``collected`` holds exactly the values of ``manual``."""
  if list(collected) != list(manual):
    raise AssertionError(
        f'capture collected names {list(collected)}, the manual function '
        f'returns {list(manual)}')
  for name, value in manual.items():
    got = collected[name]
    if not (isinstance(got, tuple) and len(got) == 1):
      raise AssertionError(f'{name}: expected a 1-tuple, got {type(got)}')
    np.testing.assert_allclose(got[0], value, rtol=1e-5, atol=1e-5,
                               err_msg=str(name))


def _hlo_ops(jitted, *args) -> list[str]:
  """``'shape opcode'`` of every instruction in ``jitted``'s optimised HLO.

  Sorted, so that two programs that differ only in names and order compare
  equal.
  """
  text = jitted.lower(*args).compile().as_text()
  return sorted(m.group(1) for m in re.finditer(
      r'^\s*(?:ROOT )?%\S+ = (.+?\S)\(', text, re.MULTILINE))


def _hlo_comparison(a, b, *args) -> dict[str, tp.Any]:
  """Instruction counts of two jitted functions and whether they match.

  ``same_ops`` (the same multiset of shapes and opcodes, tuples aside) means
  XLA compiled the same computation on both sides, so a runtime ratio away
  from 1 is noise, not overhead.
  """
  ops_a, ops_b = _hlo_ops(a, *args), _hlo_ops(b, *args)
  # The output tuple differs whenever A returns more values than B.
  compute = lambda ops: [op for op in ops if not op.endswith(' tuple')]
  return dict(a=len(ops_a), b=len(ops_b),
              same_ops=compute(ops_a) == compute(ops_b))


# --------------------------------------------------------------------------
# core: capture vs the floor
# --------------------------------------------------------------------------


@benchmark('jit_runtime')
def jit_runtime(cfg: Config) -> list[Result]:
  graphdef, state = wl.concrete_state(cfg.sizes)
  x = wl.example_input(cfg.sizes)
  fns = wl.pure_functions(graphdef)
  captured = jax.jit(capture(fns['f']))
  manual = jax.jit(fns['f_manual'])
  (out_c, collected), (out_m, by_hand) = captured(state, x), manual(state, x)
  np.testing.assert_allclose(out_c, out_m, rtol=1e-5, atol=1e-5)
  _check_same(collected, by_hand)
  ta, tb = timing.interleaved(
      lambda: captured(state, x), lambda: manual(state, x),
      cfg.runtime_repeats, warmup=2)
  hlo = _hlo_comparison(captured, manual, state, x)
  return [timing.compare(
      'jit_runtime', 'jax.jit(capture(f))', 'jax.jit(f_manual)', ta, tb,
      target=1.03, sizes=cfg.sizes.asdict(),
      extra=dict(hlo_instructions=hlo))]


def _staged_compile(make_jitted, stages, *args):
  """Traces, lowers and compiles ``make_jitted()`` at ``args``.

  Appends the seconds of each stage to ``stages`` (a dict of lists).
  """
  jitted = make_jitted()
  t0 = time.perf_counter()
  traced = jitted.trace(*args)
  t1 = time.perf_counter()
  lowered = traced.lower()
  t2 = time.perf_counter()
  compiled = lowered.compile()
  t3 = time.perf_counter()
  for stage, dt in zip(('trace', 'lower', 'compile'), (t1 - t0, t2 - t1,
                                                       t3 - t2)):
    stages.setdefault(stage, []).append(dt)
  return compiled


@benchmark('first_call')
def first_call(cfg: Config) -> list[Result]:
  results = []
  for layers in cfg.first_call_layers:
    sizes = cfg.sizes.replace(layers=layers)
    graphdef, state = wl.abstract_state(sizes)
    x = wl.abstract_input(sizes)
    # Fresh functions every time, so that no cache keyed on them helps.
    captured = lambda: jax.jit(capture(wl.pure_functions(graphdef)['f']))
    manual = lambda: jax.jit(wl.pure_functions(graphdef)['f_manual'])
    stages_a, stages_b = {}, {}
    # The largest program compiles for tens of seconds: fewer samples.
    n = cfg.compile_repeats if layers <= 48 else min(cfg.compile_repeats, 3)
    ta, tb = timing.interleaved(
        lambda: _staged_compile(captured, stages_a, state, x),
        lambda: _staged_compile(manual, stages_b, state, x),
        n, warmup=cfg.compile_warmup,
        before=jax.clear_caches)
    stages = {
        stage: dict(a=statistics.median(stages_a[stage][-n:]),
                    b=statistics.median(stages_b[stage][-n:]))
        for stage in stages_a}
    results.append(timing.compare(
        f'first_call[{layers}]',
        'jax.jit(capture(f)) trace+lower+compile',
        'jax.jit(f_manual) trace+lower+compile', ta, tb, target=1.03,
        sizes=sizes.asdict(), extra=dict(stage_medians=stages)))
    # The trace stage alone (where capture does its work), same samples.
    trace_a, trace_b = stages_a['trace'][-n:], stages_b['trace'][-n:]
    results.append(timing.compare(
        f'trace[{layers}]', 'jax.jit(capture(f)).trace',
        'jax.jit(f_manual).trace', trace_a, trace_b,
        target=1.10 if layers == 48 else None, sizes=sizes.asdict()))
  return results


def count_eqns(jaxpr) -> int:
  """Equations of ``jaxpr``, including those of every sub-jaxpr."""
  from jax._src import core as jax_core  # pylint: disable=g-import-not-at-top
  jaxpr = getattr(jaxpr, 'jaxpr', jaxpr)
  n = len(jaxpr.eqns)
  for eqn in jaxpr.eqns:
    for sub in jax_core.jaxprs_in_params(eqn.params):
      n += count_eqns(sub)
  return n


def _rewrite_alone(top_level: bool) -> tp.Callable[[tp.Any], tp.Any] | None:
  """The core's ``rewrite_program(closed_jaxpr) -> closed_jaxpr``, if any.

  With ``top_level=True`` it re-stages the program as ``capture`` does at top
  level (every equation bound through the capture's trace); with
  ``top_level=False`` it forces the interpreter that rules use for
  sub-jaxprs. A core whose ``rewrite_program`` takes no ``top_level``
  keyword always interprets.
  """
  try:
    from flax.nnx.sow import capturing as core  # pylint: disable=g-import-not-at-top
  except ImportError:
    return None
  hook = getattr(core, 'rewrite_program', None)
  if not callable(hook):
    return None
  if 'top_level' in inspect.signature(hook).parameters:
    return functools.partial(hook, top_level=top_level)
  return hook


def _rewrite_method(top_level: bool) -> str:
  hook = _rewrite_alone(top_level)
  if hook is None:
    return 'make_jaxpr(capture(eval_jaxpr)) of the staged jaxpr'
  if isinstance(hook, functools.partial):
    return f'rewrite_program(top_level={top_level}) of the staged jaxpr'
  return 'rewrite_program (interpreter) of the staged jaxpr'


def _restage(closed):
  """JAX's own re-staging of ``closed`` (``eval_jaxpr`` under a new trace).

  The same per-equation work as the rewrite minus the collecting: the
  reference for how any re-staging of this jaxpr scales.
  """
  return jax.make_jaxpr(
      lambda *args: jax.core.eval_jaxpr(closed.jaxpr, closed.consts, *args)
  )(*closed.in_avals)


def _per_eqn_samples(fn, jaxprs, repeats, gc_enabled=True):
  """Seconds per equation of ``fn(jaxpr)``, alternating over ``jaxprs``."""
  sizes = list(jaxprs)
  samples = {n: [] for n in sizes}
  for n in sizes:  # warm-up
    fn(jaxprs[n][0])
  for i in range(repeats):
    for n in sizes if i % 2 == 0 else sizes[::-1]:
      jaxpr, eqns = jaxprs[n]
      gc.collect()
      if not gc_enabled:
        gc.disable()
      try:
        samples[n].append(timing.time_call(lambda: fn(jaxpr) and None) / eqns)
      finally:
        gc.enable()
  return samples


@benchmark('rewrite_scaling')
def rewrite_scaling(cfg: Config) -> list[Result]:
  small, large = cfg.scaling_layers
  jaxprs = {}
  for layers in (small, large):
    sizes = cfg.sizes.replace(layers=layers)
    graphdef, state = wl.abstract_state(sizes)
    f = wl.pure_functions(graphdef)['f']
    jaxpr = jax.make_jaxpr(f)(state, wl.abstract_input(sizes))
    jaxprs[layers] = (jaxpr, count_eqns(jaxpr))

  def rewriter(top_level):
    rewrite = _rewrite_alone(top_level)
    if rewrite is not None:
      return rewrite

    def traced(closed):
      fn = lambda *a: jax.core.eval_jaxpr(closed.jaxpr, closed.consts, *a)
      return jax.make_jaxpr(capture(fn))(*closed.in_avals)
    return traced

  def row(name, samples, target, top_level, **extra):
    a, b = (statistics.median(samples[n]) for n in (large, small))
    return Result(
        name=name, a=f'rewrite s/eqn at {large} layers',
        b=f'rewrite s/eqn at {small} layers', a_median=a, b_median=b,
        unit='s/eqn', ratio=a / b, ratio_kind='ratio of medians',
        target=target, sizes=dict(cfg.sizes.asdict(), layers=[small, large]),
        repeats=len(samples[small]),
        extra=dict(extra, method=_rewrite_method(top_level), eqns={
            small: jaxprs[small][1], large: jaxprs[large][1]}))

  repeats, extra_repeats = cfg.trace_repeats, max(1, cfg.trace_repeats // 2)
  no_gc = _per_eqn_samples(rewriter(True), jaxprs, repeats, gc_enabled=False)
  with_gc = _per_eqn_samples(rewriter(True), jaxprs, extra_repeats)
  loop = _per_eqn_samples(rewriter(False), jaxprs, extra_repeats,
                          gc_enabled=False)
  jax_gc = _per_eqn_samples(_restage, jaxprs, extra_repeats)
  jax_ratio = (statistics.median(jax_gc[large])
               / statistics.median(jax_gc[small]))
  return [
      row('rewrite_scaling', no_gc, 1.5, True, gc='disabled while timed'),
      row('rewrite_scaling[gc]', with_gc, 1.5, True, gc='enabled',
          ratio_jax_restage=jax_ratio),
      row('rewrite_scaling[loop]', loop, None, False,
          gc='disabled while timed'),
  ]


@benchmark('eager_jitted')
def eager_jitted(cfg: Config) -> list[Result]:
  graphdef, state = wl.concrete_state(cfg.sizes)
  x = wl.example_input(cfg.sizes)
  g = jax.jit(wl.pure_functions(graphdef)['f'])
  captured = capture(g)
  ta, tb = timing.interleaved(
      lambda: captured(state, x), lambda: g(state, x),
      cfg.runtime_repeats, warmup=2)
  return [timing.compare(
      'eager_jitted', 'capture(jax.jit(f)) eager', 'jax.jit(f) eager', ta,
      tb, target=1.3, sizes=cfg.sizes.asdict())]


def _mlp_train_step():
  """An 8-layer, 512-wide MLP train step (Adam, batch 256) with a sow per
  layer: small enough that dispatch, not compute, decides its eager time."""
  key = jax.random.PRNGKey(0)
  params = [jax.random.normal(jax.random.fold_in(key, i), (512, 512)) * 0.04
            for i in range(8)]
  opt = optax.adam(1e-3)
  opt_state = opt.init(params)
  x = jax.random.normal(jax.random.fold_in(key, 100), (256, 512))
  y = jax.random.normal(jax.random.fold_in(key, 101), (256, 512))

  def loss(params, x, y):
    h = x
    for i, w in enumerate(params):
      h = sow(jnp.tanh(h @ w), name=('act', i))
    return jnp.mean((h - y) ** 2)

  @jax.jit
  def step(params, opt_state, x, y):
    value, grads = jax.value_and_grad(loss)(params, x, y)
    updates, opt_state = opt.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, value

  return step, (params, opt_state, x, y)


@benchmark('eager_dispatch')
def eager_dispatch(cfg: Config) -> list[Result]:
  step, args = _mlp_train_step()
  captured = capture(step)
  (params_c, _, loss_c), collected = captured(*args)
  params_p, _, loss_p = step(*args)
  np.testing.assert_allclose(loss_c, loss_p, rtol=1e-6)
  jax.tree.map(np.testing.assert_array_equal, params_c, params_p)
  if len(collected) != 8:
    raise AssertionError(f'expected 8 sown layers, got {list(collected)}')
  repeats = 3 if cfg.quick else 4 * cfg.runtime_repeats
  ta, tb = timing.interleaved(
      lambda: captured(*args), lambda: step(*args), repeats, warmup=3)
  return [timing.compare(
      'eager_dispatch', 'capture(jax.jit(step)) eager, MLP train step',
      'jax.jit(step) eager', ta, tb, target=None,
      sizes=dict(layers=8, width=512, batch=256))]


@benchmark('memory_runtime')
def memory_runtime(cfg: Config) -> list[Result]:
  """Peak device memory of the compiled programs (XLA's memory analysis)."""
  graphdef, state = wl.abstract_state(cfg.sizes)
  x = wl.abstract_input(cfg.sizes)
  fns = wl.pure_functions(graphdef)

  def peak(fn):
    stats = jax.jit(fn).lower(state, x).compile().memory_analysis()
    return float(stats.temp_size_in_bytes + stats.argument_size_in_bytes
                 + stats.output_size_in_bytes - stats.alias_size_in_bytes)

  a, b = peak(capture(fns['f'])), peak(fns['f_manual'])
  return [Result(
      name='memory_runtime', a='jax.jit(capture(f)) peak bytes',
      b='jax.jit(f_manual) peak bytes', a_median=a, b_median=b,
      unit='bytes', ratio=a / b, ratio_kind='ratio of medians', target=1.01,
      sizes=cfg.sizes.asdict(), repeats=1,
      extra=dict(method='compile().memory_analysis(): temp + arguments +'
                 ' outputs - aliased'))]


@benchmark('eager_plain')
def eager_plain(cfg: Config) -> list[Result]:
  graphdef, state = wl.concrete_state(cfg.sizes)
  x = wl.example_input(cfg.sizes)
  f = wl.pure_functions(graphdef)['f']
  captured = capture(f)
  repeats = max(2, cfg.runtime_repeats // 3)
  ta, tb = timing.interleaved(
      lambda: captured(state, x), lambda: f(state, x), repeats, warmup=1)
  return [timing.compare(
      'eager_plain', 'capture(f) eager', 'f eager (no jit)', ta, tb,
      target=1.25, sizes=cfg.sizes.asdict())]


@benchmark('eager_functional')
def eager_functional(cfg: Config) -> list[Result]:
  """``capture(f)(state, x)`` / ``f(state, x)``, eager, for the workload's
  functional forward at a small batch and sequence, so that the per-call
  cost of ``capture`` outside the forward itself (the NNX layer's path
  scope among it) is not hidden by the forward's compute."""
  sizes = cfg.sizes if cfg.quick else cfg.sizes.replace(batch=1, seq=8)
  graphdef, state = wl.concrete_state(sizes)
  x = wl.example_input(sizes)
  f = wl.pure_functions(graphdef)['f']
  captured = capture(f)
  out_c, collected = captured(state, x)
  np.testing.assert_allclose(out_c, f(state, x), rtol=1e-5, atol=1e-5)
  if len(collected) != 2 * sizes.layers:
    raise AssertionError(f'expected {2 * sizes.layers} names, got '
                         f'{list(collected)}')
  repeats = 3 if cfg.quick else 4 * cfg.runtime_repeats
  ta, tb = timing.interleaved(
      lambda: captured(state, x), lambda: f(state, x), repeats, warmup=2)
  return [timing.compare(
      'eager_functional', 'capture(f) eager, functional forward',
      'f eager (no jit)', ta, tb, target=None, sizes=sizes.asdict())]


@benchmark('eager_names')
def eager_names(cfg: Config) -> list[Result]:
  """``capture(f, names=<a new lambda each call>)`` / the same with one
  reused function, eager: a selection written inline must reuse the staged
  and compiled work (it is keyed by what it selects, not by the object)."""
  sizes = cfg.sizes if cfg.quick else cfg.sizes.replace(batch=1, seq=8)
  graphdef, state = wl.concrete_state(sizes)
  x = wl.example_input(sizes)
  f = wl.pure_functions(graphdef)['f']
  residual = lambda n: n[-1] == 'residual'
  inline = lambda: capture(f, names=lambda n: n[-1] == 'residual')(state, x)
  reused = lambda: capture(f, names=residual)(state, x)
  (out_a, got_a), (out_b, got_b) = inline(), reused()
  np.testing.assert_allclose(out_a, out_b, rtol=1e-6)
  want = [('blocks', i, 'residual') for i in range(sizes.layers)]
  if list(got_a) != want or list(got_b) != want:
    raise AssertionError(f'expected {want}, got {list(got_a)}, {list(got_b)}')
  repeats = 3 if cfg.quick else 2 * cfg.runtime_repeats
  ta, tb = timing.interleaved(inline, reused, repeats, warmup=2)
  return [timing.compare(
      'eager_names', 'capture(f, names=<new lambda each call>) eager',
      'capture(f, names=<one reused function>) eager', ta, tb, target=1.2,
      sizes=sizes.asdict())]


@benchmark('perturb_grad')
def perturb_grad(cfg: Config) -> list[Result]:
  graphdef, state = wl.concrete_state(cfg.sizes)
  x = wl.example_input(cfg.sizes)
  loss = wl.pure_functions(graphdef)['loss']
  captured = jax.jit(capture(jax.grad(loss)))
  plain = jax.jit(jax.grad(loss))
  (grads_c, collected), grads_p = captured(state, x), plain(state, x)
  jax.tree.map(
      lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6),
      grads_c, grads_p)
  if len(collected) != cfg.sizes.layers:
    raise AssertionError(
        f'expected {cfg.sizes.layers} perturbed cotangents, got '
        f'{list(collected)}')
  ta, tb = timing.interleaved(
      lambda: captured(state, x), lambda: plain(state, x),
      cfg.runtime_repeats, warmup=2)
  hlo = _hlo_comparison(captured, plain, state, x)
  return [timing.compare(
      'perturb_grad', 'jax.jit(capture(jax.grad(loss)))',
      'jax.jit(jax.grad(loss))', ta, tb, target=1.10,
      sizes=dict(cfg.sizes.asdict(), perturbs=cfg.sizes.layers),
      extra=dict(hlo_instructions=hlo))]


@benchmark('intervene_runtime')
def intervene_runtime(cfg: Config) -> list[Result]:
  """Patching one layer's residual stream with ``intervene`` vs by hand.

  The replacement is the residual stream after the middle block in a run on
  another input (activation patching); the baseline is the same model with
  an emitter that returns the replacement, passed as an argument.
  """
  graphdef, state = wl.concrete_state(cfg.sizes)
  x = wl.example_input(cfg.sizes)
  f = wl.pure_functions(graphdef)['f']
  layer = cfg.sizes.layers // 2
  name = ('blocks', layer, 'residual')
  _, collected = jax.jit(capture(f))(state, wl.example_input(cfg.sizes, 2))
  (r,) = collected[name]

  def f_with(state, x, r):
    def emit(block, i, n, value):
      del block
      return r if (i, n) == (layer, 'residual') else value
    return nnx.merge(graphdef, state)(x, emit)

  intervened = jax.jit(
      lambda state, x, r: intervene(f, {name: (r,)})(state, x))
  by_hand = jax.jit(f_with)
  out_i, out_h = intervened(state, x, r), by_hand(state, x, r)
  np.testing.assert_allclose(out_i, out_h, rtol=1e-5, atol=1e-5)
  if np.allclose(out_i, jax.jit(f)(state, x), rtol=1e-3, atol=1e-3):
    raise AssertionError('the patch did not change the output')
  ta, tb = timing.interleaved(
      lambda: intervened(state, x, r), lambda: by_hand(state, x, r),
      cfg.runtime_repeats, warmup=2)
  hlo = _hlo_comparison(intervened, by_hand, state, x, r)
  return [timing.compare(
      'intervene_runtime', 'jax.jit(intervene(f, v))',
      'jax.jit(f_with_replacement_as_argument)', ta, tb, target=1.03,
      sizes=dict(cfg.sizes.asdict(), patched_layer=layer),
      extra=dict(hlo_instructions=hlo))]


SHARDED_DEVICES = 8
_DEVICE_COUNT_FLAG = '--xla_force_host_platform_device_count'


def _sharded_steps(graphdef, mesh):
  """A data-parallel SGD step over ``mesh``'s ``'data'`` axis, two ways.

  ``step`` sows every intermediate inside the ``shard_map`` body (``f``);
  ``step_manual`` returns the same per-device values by hand as extra
  outputs of the ``shard_map`` (``f_manual``), laid out as ``capture`` lays
  them out: a leading device axis, split over ``'data'``.
  """
  from jax.sharding import PartitionSpec as P  # pylint: disable=g-import-not-at-top
  fns = wl.pure_functions(graphdef)

  def loss(state, x):
    return jax.lax.pmean(jnp.mean(fns['f'](state, x) ** 2), 'data')

  def loss_manual(state, x):
    out, values = fns['f_manual'](state, x)
    return jax.lax.pmean(jnp.mean(out ** 2), 'data'), values

  def body(state, x):
    value, grads = jax.value_and_grad(loss)(state, x)
    return value, jax.lax.pmean(grads, 'data')

  def body_manual(state, x):
    (value, values), grads = jax.value_and_grad(loss_manual, has_aux=True)(
        state, x)
    values = {k: v[None] for k, v in values.items()}
    return value, jax.lax.pmean(grads, 'data'), values

  specs = dict(mesh=mesh, in_specs=(P(), P('data')))
  sharded = jax.shard_map(body, out_specs=(P(), P()), **specs)
  sharded_manual = jax.shard_map(
      body_manual, out_specs=(P(), P(), P('data')), **specs)

  def sgd(state, grads):
    return jax.tree.map(lambda p, g: p - 1e-3 * g, state, grads)

  def step(state, x):
    value, grads = sharded(state, x)
    return value, sgd(state, grads)

  def step_manual(state, x):
    value, grads, values = sharded_manual(state, x)
    return (value, sgd(state, grads)), values

  return step, step_manual


def _sharded_step_in_subprocess(cfg: Config) -> list[Result]:
  """``sharded_step`` in a fresh process that has 8 CPU devices.

  XLA reads the device count once, when JAX starts its backend; this
  process started it with fewer devices.
  """
  import subprocess  # pylint: disable=g-import-not-at-top
  import tempfile  # pylint: disable=g-import-not-at-top
  env = dict(os.environ)
  flags = re.sub(rf'{_DEVICE_COUNT_FLAG}=\d+', '', env.get('XLA_FLAGS', ''))
  env['XLA_FLAGS'] = f'{flags} {_DEVICE_COUNT_FLAG}={SHARDED_DEVICES}'.strip()
  env['JAX_PLATFORMS'] = 'cpu'
  with tempfile.TemporaryDirectory() as tmp:
    path = os.path.join(tmp, 'sharded_step.json')
    argv = [sys.executable, os.path.abspath(__file__), '--only',
            'sharded_step', '--json', path, '--repeats',
            str(cfg.runtime_repeats)]
    if cfg.quick:
      argv.append('--quick')
    proc = subprocess.run(argv, env=env, capture_output=True, text=True,
                          check=False, timeout=1800)
    if not os.path.exists(path):
      raise RuntimeError(
          f'the sharded_step subprocess wrote no results:\n{proc.stderr[-2000:]}')
    with open(path) as fp:
      rows = json.load(fp)
  results = []
  for row in rows:
    if 'error' in row:
      raise RuntimeError(f'in the subprocess: {row["error"]}')
    row.pop('met')
    row['extra'] = dict(row['extra'], subprocess=True)
    results.append(Result(**row))
  return results


@benchmark('sharded_step')
def sharded_step(cfg: Config) -> list[Result]:
  """A data-parallel train step on 8 simulated CPU devices (``shard_map``).

  ``jax.jit(capture(step))`` collects every intermediate inside the sharded
  body; ``jax.jit(step_manual)`` returns the same values by hand.
  """
  if jax.device_count() < SHARDED_DEVICES:
    return _sharded_step_in_subprocess(cfg)
  from jax.sharding import NamedSharding, PartitionSpec as P  # pylint: disable=g-import-not-at-top
  batch = -(-cfg.sizes.batch // SHARDED_DEVICES) * SHARDED_DEVICES
  sizes = cfg.sizes.replace(batch=batch)
  mesh = jax.make_mesh((SHARDED_DEVICES,), ('data',),
                       axis_types=(jax.sharding.AxisType.Auto,))
  graphdef, state = wl.concrete_state(sizes)
  state = jax.device_put(state, NamedSharding(mesh, P()))
  x = jax.device_put(wl.example_input(sizes), NamedSharding(mesh, P('data')))
  step, step_manual = _sharded_steps(graphdef, mesh)
  captured, manual = jax.jit(capture(step)), jax.jit(step_manual)
  ((loss_c, state_c), collected) = captured(state, x)
  ((loss_m, state_m), by_hand) = manual(state, x)
  np.testing.assert_allclose(loss_c, loss_m, rtol=1e-5)
  jax.tree.map(
      lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6),
      state_c, state_m)
  if set(collected) != set(by_hand):
    raise AssertionError(
        f'capture collected {sorted(collected)}, the manual step returns '
        f'{sorted(by_hand)}')
  # Per device: a leading axis of 8, as the manual step lays them out.
  _check_same(collected, {name: by_hand[name] for name in collected})
  ta, tb = timing.interleaved(
      lambda: captured(state, x), lambda: manual(state, x),
      cfg.runtime_repeats, warmup=2)
  hlo = _hlo_comparison(captured, manual, state, x)
  return [timing.compare(
      'sharded_step', 'jax.jit(capture(step)), shard_map over 8 devices',
      'jax.jit(step_manual)', ta, tb, target=1.03,
      sizes=dict(sizes.asdict(), devices=SHARDED_DEVICES),
      extra=dict(hlo_instructions=hlo))]


@benchmark('sow_dispatch')
def sow_dispatch(cfg: Config) -> list[Result]:
  """Per-call cost of a jitted function with sows when nothing captures them.

  Tiny sizes in both modes, so that dispatch, not compute, dominates: the
  compiled programs are the same, so any ratio above 1 is dispatch overhead.
  """
  sizes = wl.QUICK
  graphdef, state = wl.concrete_state(sizes)
  x = wl.example_input(sizes)
  fns = wl.pure_functions(graphdef)
  with_sows, plain = jax.jit(fns['f']), jax.jit(fns['f_plain'])
  calls = 20 if cfg.quick else 200

  def many(fn):
    def run_calls():
      for _ in range(calls):
        out = fn(state, x)
      return out
    return run_calls

  ta, tb = timing.interleaved(many(with_sows), many(plain),
                              cfg.runtime_repeats, warmup=1)
  ta, tb = [t / calls for t in ta], [t / calls for t in tb]
  effects = str(jax.make_jaxpr(fns['f'])(state, x).effects)
  return [timing.compare(
      'sow_dispatch', 'jax.jit(f) with sows, no capture, per call',
      'jax.jit(f_plain) without sows, per call', ta, tb, target=None,
      sizes=dict(sizes.asdict(), calls_per_sample=calls),
      extra=dict(jaxpr_effects=effects,
                 hlo=_hlo_comparison(with_sows, plain, state, x)))]


# --------------------------------------------------------------------------
# memory of reductions in long loops
# --------------------------------------------------------------------------


def _add(acc, value):
  return acc + value


def _scan(steps: int, width: int, reduce: bool):
  """A scan of ``steps`` steps that sows its carry at every step."""
  init = functools.partial(jnp.zeros, (width,), jnp.float32)

  def f(w, h0):
    def body(h, _):
      h = jnp.tanh(h @ w)
      if reduce:
        sow(h, name='h', reduce_fn=_add, init_fn=init)
      else:
        sow(h, name='h')
      return h, None
    return jax.lax.scan(body, h0, None, length=steps)[0]

  return f


def _check_scan(short: int, width: int):
  """Raises unless capture collects what the scan computes, at ``short``."""
  w = jax.random.normal(jax.random.key(2), (width, width)) / width**0.5
  h0 = jax.random.normal(jax.random.key(3), (width,))

  def by_hand(w, h0):
    def body(carry, _):
      h, total = carry
      h = jnp.tanh(h @ w)
      return (h, total + h), h
    return jax.lax.scan(body, (h0, jnp.zeros_like(h0)), None, length=short)

  (_, total), ys = jax.jit(by_hand)(w, h0)
  _, reduced = jax.jit(capture(_scan(short, width, True)))(w, h0)
  _, stacked = jax.jit(capture(_scan(short, width, False)))(w, h0)
  np.testing.assert_allclose(reduced['h'], total, rtol=1e-4, atol=1e-4)
  np.testing.assert_allclose(stacked['h'][0], ys, rtol=1e-4, atol=1e-5)


def _memory(fn, *args):
  stats = jax.jit(fn).lower(*args).compile().memory_analysis()
  return stats.temp_size_in_bytes, stats.output_size_in_bytes


@benchmark('reduce_memory')
def reduce_memory(cfg: Config) -> list[Result]:
  width = cfg.scan_width
  w = jax.ShapeDtypeStruct((width, width), jnp.float32)
  h0 = jax.ShapeDtypeStruct((width,), jnp.float32)
  short, long = cfg.scan_steps
  _check_scan(short, width)
  results = []
  for kind, reduce, target in (('reduce', True, 1.1),
                               ('stacked', False, None)):
    figures = {}
    for steps in (short, long):
      f = _scan(steps, width, reduce)
      figures[steps] = dict(zip(('temp', 'output'), _memory(capture(f), w,
                                                            h0)))
      figures[steps]['temp_without_capture'] = _memory(f, w, h0)[0]
    a, b = figures[long]['temp'], figures[short]['temp']
    results.append(Result(
        name=f'reduce_memory[{kind}]',
        a=f'temp bytes, {kind} sow, {long} steps',
        b=f'temp bytes, {kind} sow, {short} steps', a_median=a, b_median=b,
        unit='bytes', ratio=a / b if b else float('inf'),
        ratio_kind='ratio', target=target,
        sizes=dict(steps=[short, long], width=width), repeats=1,
        extra={str(k): v for k, v in figures.items()}))
  return results


# --------------------------------------------------------------------------
# NNX: the nnx.capture shim vs Flax's original nnx.capture
# --------------------------------------------------------------------------


def _nnx_shims():
  from flax.nnx.sow.nnx import shims as nnx_shims  # pylint: disable=g-import-not-at-top
  return nnx_shims


def _make_train_step():
  """A fresh ``nnx.jit`` train step that captures the intermediates."""

  def train_step(model, optimizer, x):
    def loss_fn(model):
      # Looked up at trace time: the shim or the original, as installed.
      out, intermediates = nnx.capture(model, nnx.Intermediate)(x)
      return jnp.mean(out**2), intermediates

    (loss, intermediates), grads = nnx.value_and_grad(
        loss_fn, has_aux=True)(model)
    optimizer.update(model, grads)
    return loss, intermediates

  return nnx.jit(train_step)


@benchmark('eager_nnx')
def eager_nnx(cfg: Config) -> list[Result]:
  """Inspecting a model eagerly: ``nnx.capture(model, nnx.Intermediate)(x)``
  with the shim against Flax 0.12.8's own ``nnx.capture``, at the workload's
  sizes (``eager_nnx``, where the forward's compute decides the time) and at
  sizes so small that only the two captures' own per-call cost shows
  (``eager_nnx[overhead]``)."""
  overhead_sizes = wl.QUICK.replace(layers=cfg.sizes.layers, batch=1)
  return [
      _eager_nnx_row('eager_nnx', cfg.sizes, cfg, 1.05),
      _eager_nnx_row('eager_nnx[overhead]', overhead_sizes, cfg, None),
  ]


def _eager_nnx_row(
    name: str, sizes: wl.Sizes, cfg: Config, target: float | None
) -> Result:
  shims = _nnx_shims()
  x = wl.example_input(sizes)
  model = wl.make_model(sizes)
  # Eager op-by-op compute on a shared CPU varies by several percent from
  # call to call, as much as the difference measured: many pairs.
  repeats = 3 if cfg.quick else 4 * cfg.runtime_repeats

  def run_shim():
    shims.install()
    return nnx.capture(model, nnx.Intermediate)(x)

  def run_orig():
    shims.uninstall()
    return nnx.capture(model, nnx.Intermediate)(x)

  try:
    with warnings.catch_warnings():
      warnings.simplefilter('ignore', DeprecationWarning)
      (out_s, inter_s), (out_o, inter_o) = run_shim(), run_orig()
      np.testing.assert_allclose(out_s, out_o, rtol=1e-5, atol=1e-5)
      jax.tree.map(
          lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5),
          nnx.to_pure_dict(inter_s), nnx.to_pure_dict(inter_o))
      ta, tb = timing.interleaved(run_shim, run_orig, repeats, warmup=1)
  finally:
    shims.install()
  return timing.compare(
      name, 'nnx.capture(model, nnx.Intermediate)(x) eager, shim',
      'the same with Flax 0.12.8 nnx.capture', ta, tb, target=target,
      sizes=sizes.asdict())


@benchmark('nnx_step')
def nnx_step(cfg: Config) -> list[Result]:
  shims = _nnx_shims()
  x = wl.example_input(cfg.sizes)

  def setup():
    model = wl.make_model(cfg.sizes)
    optimizer = nnx.Optimizer(model, optax.adam(1e-4), wrt=nnx.Param)
    return model, optimizer

  try:
    with warnings.catch_warnings():
      # Flax's original nnx.capture warns about the attributes it adds.
      warnings.simplefilter('ignore', DeprecationWarning)
      shims.install()
      model_s, opt_s = setup()
      step_s = _make_train_step()
      loss_s, inter_s = step_s(model_s, opt_s, x)
      shims.uninstall()
      model_o, opt_o = setup()
      step_o = _make_train_step()
      loss_o, inter_o = step_o(model_o, opt_o, x)
      np.testing.assert_allclose(loss_s, loss_o, rtol=1e-5)
      if (jax.tree.structure(nnx.to_pure_dict(inter_s))
          != jax.tree.structure(nnx.to_pure_dict(inter_o))):
        raise AssertionError(
            f'the shim returns {jax.tree.structure(inter_s)}, Flax '
            f'returns {jax.tree.structure(inter_o)}')

      def run_shim():
        shims.install()
        return step_s(model_s, opt_s, x)

      def run_orig():
        shims.uninstall()
        return step_o(model_o, opt_o, x)

      ta, tb = timing.interleaved(run_shim, run_orig, cfg.runtime_repeats,
                                  warmup=2)
      steady = timing.compare(
          'nnx_step[steady]', 'nnx.jit step, nnx.capture shim',
          'nnx.jit step, Flax 0.12.8 nnx.capture', ta, tb, target=1.02,
          sizes=cfg.sizes.asdict())

      def first_shim():
        shims.install()
        return _make_train_step()(model_s, opt_s, x)

      def first_orig():
        shims.uninstall()
        return _make_train_step()(model_o, opt_o, x)

      ta, tb = timing.interleaved(first_shim, first_orig,
                                  cfg.compile_repeats,
                                  warmup=cfg.compile_warmup,
                                  before=jax.clear_caches)
      first = timing.compare(
          'nnx_step[first_call]',
          'first call of a fresh nnx.jit step, shim',
          'first call of a fresh nnx.jit step, Flax 0.12.8', ta, tb,
          target=1.15, sizes=cfg.sizes.asdict())
  finally:
    shims.install()
  return [steady, first]


# --------------------------------------------------------------------------
# driver
# --------------------------------------------------------------------------


def _fmt(value: float, unit: str) -> str:
  if unit == 'bytes':
    return f'{value:,.0f} B'
  if unit == 's/eqn':
    return f'{value * 1e6:.2f} us/eqn'
  if value >= 1:
    return f'{value:.3f} s'
  return f'{value * 1e3:.2f} ms'


def table(rows: list[dict[str, tp.Any]]) -> str:
  """The results as a Markdown table."""
  lines = ['| name | A (measured) | B (baseline) | A | B | A/B | target | '
           'met |', '|---|---|---|---|---|---|---|---|']
  for r in rows:
    if 'error' in r:
      lines.append(f'| {r["name"]} | ERROR: {r["error"]} | | | | | | |')
      continue
    target = '-' if r['target'] is None else f'<= {r["target"]:.2f}'
    met = {True: 'yes', False: 'NO', None: 'report'}[r['met']]
    lines.append(
        f'| {r["name"]} | {r["a"]} | {r["b"]} | '
        f'{_fmt(r["a_median"], r["unit"])} | '
        f'{_fmt(r["b_median"], r["unit"])} | {r["ratio"]:.3f} | {target} | '
        f'{met} |')
  notes = [_note(r) for r in rows if 'error' not in r]
  return '\n'.join(lines + [n for n in notes if n])


def _note(r) -> str:
  """One line of figures from ``extra`` that explain a row, or ''."""
  e = r['extra']
  if r['name'].startswith('rewrite_scaling'):
    jax_ratio = e.get('ratio_jax_restage')
    jax_ratio = ('' if jax_ratio is None else f'; JAX\'s own re-staging '
                 f'(eval_jaxpr) of the same jaxprs: {jax_ratio:.3f}')
    return (f'  {r["name"]}: {e["method"]}, gc {e["gc"]}; equations '
            f'{e["eqns"]}{jax_ratio}')
  if 'stage_medians' in e:
    stages = ', '.join(f'{k} {v["a"]:.3f}/{v["b"]:.3f} s'
                       for k, v in e['stage_medians'].items())
    return (f'  {r["name"]}: ratio of medians {e["ratio_of_medians"]:.3f}, '
            f'of minima {e["ratio_of_minima"]:.3f}; A/B by stage: {stages}')
  if r['name'].startswith('reduce_memory'):
    return f'  {r["name"]}: {json.dumps(e)}'
  if 'ratio_of_minima' in e:
    hlo = e.get('hlo_instructions') or e.get('hlo')
    hlo = (f'; HLO instructions A {hlo["a"]}, B {hlo["b"]}, same ops: '
           f'{hlo["same_ops"]}' if hlo else '')
    return (f'  {r["name"]}: ratio of medians {e["ratio_of_medians"]:.3f}, '
            f'of minima {e["ratio_of_minima"]:.3f}{hlo}')
  return ''


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--quick', action='store_true',
                      help='tiny sizes and few repeats: a smoke run')
  parser.add_argument('--json', metavar='PATH',
                      help='also write the results as a JSON list')
  parser.add_argument('--only', metavar='NAMES',
                      help='comma-separated benchmarks to run (default all: '
                      + ','.join(BENCHMARKS) + ')')
  parser.add_argument('--repeats', type=int,
                      help='override the number of runtime samples')
  parser.add_argument('--compile-repeats', type=int,
                      help='override the number of first-call samples')
  args = parser.parse_args(argv)

  cfg = QUICK if args.quick else FULL
  if args.repeats:
    cfg = cfg._replace(runtime_repeats=args.repeats)
  if args.compile_repeats:
    cfg = cfg._replace(compile_repeats=args.compile_repeats)
  names = args.only.split(',') if args.only else list(BENCHMARKS)
  unknown = [n for n in names if n not in BENCHMARKS]
  if unknown:
    parser.error(f'unknown benchmarks {unknown}; known: {list(BENCHMARKS)}')

  rows, failed = [], False
  for name in names:
    start = time.perf_counter()
    try:
      rows.extend(r.asdict() for r in BENCHMARKS[name](cfg))
    except Exception as e:  # pylint: disable=broad-except
      failed = True
      traceback.print_exc()
      rows.append(dict(name=name, error=f'{type(e).__name__}: {e}'
                       .splitlines()[0][:200]))
    print(f'# {name}: {time.perf_counter() - start:.1f} s', file=sys.stderr,
          flush=True)

  print(f'jax {jax.__version__}, backend {jax.default_backend()}, '
        f'{"quick" if cfg.quick else "full"} run')
  print(table(rows))
  if args.json:
    with open(args.json, 'w') as fp:
      json.dump(rows, fp, indent=2)
  return 1 if failed else 0


if __name__ == '__main__':
  sys.exit(main())
