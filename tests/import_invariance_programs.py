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

"""Sow-free programs whose jaxprs ``test_import_invariance`` compares.

Run as ``python import_invariance_programs.py [--import-sow |
--after-capture]`` in a fresh interpreter, with ``XLA_FLAGS`` asking for 8
CPU devices (``conftest.py``): with ``--import-sow`` it imports
``flax.nnx.sow`` before anything else (which registers the package's own
primitive rules and the NNX shims, and replaces nothing in JAX); with
``--after-capture`` it also runs one ``capture`` first, which installs the
patch inventory (``_jax_patches.py``), so every wrapper the package puts in
JAX is in place. Then it stages every program of :func:`programs` with
``jax.make_jaxpr`` and prints one line ``RESULT {json}``: whether
``flax.nnx.sow`` is imported and its patches installed, the device count,
and ``str(jaxpr)`` by program name (``ERROR ...`` where staging raised). No
program here holds a sow, so neither the import nor the installed patches
may change any of them.

The programs are the constructs whose JAX rules the package wraps or sits
next to: ``checkpoint`` policies (saving, offloading) around
``custom_jvp``/``custom_vjp`` calls, loop-invariant work in ``scan`` under
``grad``/``linearize``/``checkpoint``, ``cond``/``switch``/``while`` under
``vmap``, ``shard_map``/``pmap`` under ``grad`` and ``vmap``, and custom
derivatives under every transform.
"""

from __future__ import annotations

import json
import sys
import typing as tp

if __name__ == '__main__' and (
    '--import-sow' in sys.argv or '--after-capture' in sys.argv
):
  # Before JAX is first imported, as a user's program may do.
  import flax.nnx.sow  # noqa: F401

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.ad_checkpoint import Offloadable  # noqa: E402
from jax.sharding import AxisType  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

DEVICES = 8

# Programs whose jaxpr without the import holds this many offload
# ``device_put``s (one to host memory, one back per offloaded value).
OFFLOADING = {
    'checkpoint_offload_custom_jvp_grad': 2,
    'checkpoint_offload_custom_vjp_grad': 2,
    'checkpoint_offload_custom_jvp_in_scan_grad': 2,
    'checkpoint_offload_dot_grad': 2,
}

# A program: the function, its arguments, and the primitives its jaxpr
# (without the import) contains.
Program = tuple[tp.Callable, tuple, tuple[str, ...]]


# ----------------------------------------------------------------------------
# Hand-written custom derivatives.


@jax.custom_jvp
def soft_clip(x):
  return 2.0 * jnp.tanh(x)


@soft_clip.defjvp
def _soft_clip_jvp(primals, tangents):
  (x,), (t,) = primals, tangents
  return soft_clip(x), 2.0 * (1.0 - jnp.tanh(x) ** 2) * t


@jax.custom_vjp
def scaled_sin(x, w):
  return jnp.sin(x) * w


def _scaled_sin_fwd(x, w):
  return scaled_sin(x, w), (x, w)


def _scaled_sin_bwd(res, g):
  x, w = res
  return g * jnp.cos(x) * w, g * jnp.sin(x)


scaled_sin.defvjp(_scaled_sin_fwd, _scaled_sin_bwd)


@jax.custom_jvp
def clip_sz(x):
  return jnp.clip(x, -1.0, 1.0)


@clip_sz.defjvp
def _clip_sz_jvp(primals, tangents):
  (x,), (t,) = primals, tangents
  return clip_sz(x), t  # straight through


@jax.custom_vjp
def through_custom_jvp(x):
  return soft_clip(jnp.sin(x))


through_custom_jvp.defvjp(
    lambda x: (through_custom_jvp(x), x),
    lambda x, g: (g * 2.0 * (1.0 - jnp.tanh(jnp.sin(x)) ** 2) * jnp.cos(x),),
)


def _vjp_opt_fwd(x):
  return jnp.exp(x) * 3.0, x


def _vjp_opt_bwd(x, g):
  return (g * jnp.exp(x) * 3.0,)


def _make_optimize_remat():
  f = jax.custom_vjp(lambda x: jnp.exp(x) * 3.0)
  f.defvjp(_vjp_opt_fwd, _vjp_opt_bwd, optimize_remat=True)
  return f


exp3_optimize_remat = _make_optimize_remat()


# ----------------------------------------------------------------------------
# checkpoint policies.


def offload_custom_calls(prim, *avals, **params):
  """Offloads the outputs of custom-derivative calls to host memory."""
  del avals, params
  if prim.name in ('custom_jvp_call', 'custom_vjp_call'):
    return Offloadable(src='device', dst='pinned_host')
  return False


def save_custom_calls(prim, *avals, **params):
  del avals, params
  return prim.name in ('custom_jvp_call', 'custom_vjp_call')


def unused_effectful_checkpoint(x):
  jax.checkpoint(lambda x: jax.debug.print('{}', 1.5))(x)
  return jnp.sum(jnp.sin(x))


def _grad(f, argnums=0):
  return jax.grad(lambda *a: jnp.sum(f(*a)), argnums=argnums)


x3 = jnp.array([0.3, -1.2, 2.0], jnp.float32)
w3 = jnp.array([1.5, 0.5, -2.0], jnp.float32)
m33 = jnp.arange(9.0, dtype=jnp.float32).reshape(3, 3) / 10.0
xs43 = jnp.arange(12.0, dtype=jnp.float32).reshape(4, 3) / 5.0
xb = jnp.arange(6.0, dtype=jnp.float32).reshape(2, 3) - 2.0


def _checkpoint_programs() -> dict[str, Program]:
  def relu_chain(x):
    return jnp.sin(jax.nn.relu(jnp.sin(x)))

  def vjp_chain(x, w):
    return jnp.sin(scaled_sin(jnp.cos(x), w))

  def dots_custom_jvp(x, m):
    return jnp.sin(soft_clip(jax.nn.relu(x @ m)) @ m)

  def dots_custom_vjp(x, m):
    return jnp.cos(scaled_sin(x @ m, x) @ m)

  def scan_offload(x, xs):
    def body(c, x):
      c = jnp.sin(jax.nn.gelu(c * x) + jax.nn.relu(c))
      return c, None

    return jax.lax.scan(
        jax.checkpoint(body, policy=offload_custom_calls), x, xs
    )[0]

  dot_offload = jax.checkpoint_policies.offload_dot_with_no_batch_dims(
      'device', 'pinned_host'
  )

  def offload_dot(x, m):
    return jnp.sin(jnp.sin(x) @ m)

  dots = jax.checkpoint_policies.dots_saveable
  return {
      'checkpoint_offload_custom_jvp_grad': (
          _grad(jax.checkpoint(relu_chain, policy=offload_custom_calls)),
          (x3,),
          ('remat2', 'custom_jvp_call', 'device_put'),
      ),
      'checkpoint_offload_custom_vjp_grad': (
          _grad(jax.checkpoint(vjp_chain, policy=offload_custom_calls)),
          (x3, w3),
          ('remat2', 'custom_vjp_call', 'device_put'),
      ),
      'checkpoint_offload_custom_jvp_in_scan_grad': (
          _grad(scan_offload),
          (x3, xs43),
          ('remat2', 'scan', 'device_put'),
      ),
      'checkpoint_offload_dot_grad': (
          _grad(jax.checkpoint(offload_dot, policy=dot_offload)),
          (x3, m33),
          ('remat2', 'device_put'),
      ),
      'checkpoint_save_custom_calls_custom_jvp_grad': (
          _grad(jax.checkpoint(relu_chain, policy=save_custom_calls)),
          (x3,),
          ('remat2', 'custom_jvp_call'),
      ),
      'checkpoint_dots_saveable_custom_jvp_grad': (
          _grad(jax.checkpoint(dots_custom_jvp, policy=dots)),
          (x3, m33),
          ('remat2', 'custom_jvp_call'),
      ),
      'checkpoint_dots_saveable_custom_vjp_grad': (
          _grad(jax.checkpoint(dots_custom_vjp, policy=dots), argnums=(0, 1)),
          (x3, m33),
          ('remat2', 'custom_vjp_call'),
      ),
      'checkpoint_nothing_saveable_custom_vjp_grad': (
          _grad(
              jax.checkpoint(
                  vjp_chain, policy=jax.checkpoint_policies.nothing_saveable
              ),
              argnums=(0, 1),
          ),
          (x3, w3),
          ('remat2', 'custom_vjp_call'),
      ),
      'checkpoint_default_custom_jvp_grad': (
          _grad(jax.checkpoint(relu_chain)),
          (x3,),
          ('remat2', 'custom_jvp_call'),
      ),
      'checkpoint_dots_saveable_custom_jvp_linearize': (
          lambda x, m: jax.linearize(
              jax.checkpoint(dots_custom_jvp, policy=dots), x, m
          )[1](x, m),
          (x3, m33),
          ('remat2', 'custom_jvp_call'),
      ),
      # An effectful checkpoint whose inputs and outputs are unused, inside
      # another under grad: JAX drops it (a sow of a constant there is
      # dropped with it, a documented limit).
      'checkpoint_unused_effectful_checkpoint_grad': (
          _grad(jax.checkpoint(unused_effectful_checkpoint)),
          (x3,),
          ('remat2',),
      ),
      'checkpoint_custom_vjp_optimize_remat_grad': (
          _grad(jax.checkpoint(lambda x: jnp.sin(exp3_optimize_remat(x)))),
          (x3,),
          ('remat2',),
      ),
  }


# ----------------------------------------------------------------------------
# Loops and branches.


def _loop_programs() -> dict[str, Program]:
  def scan_invariant(w, xs):
    def body(c, x):
      k = jnp.tanh(w * 2.0) + jnp.sum(w**2)  # loop-invariant
      return c * jnp.sin(k * x), k * x

    c, ys = jax.lax.scan(body, jnp.ones_like(w), xs)
    return c + ys.sum(0)

  def scan_custom_invariant(w, xs):
    def body(c, x):
      k = soft_clip(w) + jax.nn.relu(w)  # loop-invariant custom calls
      return c * scaled_sin(k, x), None

    return jax.lax.scan(body, jnp.ones_like(w), xs)[0]

  def scan_calls_invariant(w, xs):
    def body(c, x):
      # Loop-invariant calls whose results are partly unused: JAX's partial
      # evaluation stages a cond and a custom_vjp_call as equations.
      k = jax.lax.cond(w.sum() > 0, jnp.sin, soft_clip, w)
      e = exp3_optimize_remat(w) + scaled_sin(c, w) * 0.0
      return c * k * x + e, jax.lax.stop_gradient(scaled_sin(w, c))

    return jax.lax.scan(body, jnp.ones_like(w), xs)[0]

  def nested_scan(w, xs):
    def outer(c, x):
      def inner(d, y):
        return d + jnp.sin(w * y) * jnp.cos(w), None

      d = jax.lax.scan(inner, c, x)[0]
      return d, jnp.tanh(w)

    return jax.lax.scan(outer, w, xs.reshape(2, 2, 3))[0]

  def scan_forwarding_cond(w, xs):
    # The cond returns its operand: the carry is loop-invariant, and the
    # cond is hoisted (the partial_eval_kept_calls entry watches it).
    def body(c, x):
      c, k = jax.lax.cond(
          c[0] > 0, lambda v: (v, jnp.sin(v)), lambda v: (v, jnp.cos(v)), c
      )
      return c, k * x

    c, ys = jax.lax.scan(body, w, xs)
    return c * ys.sum(0)

  def fori_static(w):
    return jax.lax.fori_loop(
        0, 4, lambda i, c: c * jnp.cos(w * i) + soft_clip(w), w
    )

  def while_custom(x):
    # The carry does not depend on x: a loop that grad can go through.
    y = jax.lax.while_loop(
        lambda c: c[0] < 3,
        lambda c: (c[0] + 1, soft_clip(scaled_sin(c[1], c[1]))),
        (0, jax.lax.stop_gradient(x)),
    )[1]
    return x * y

  def while_dependent(x):
    return jax.lax.while_loop(
        lambda c: c[0] < 3,
        lambda c: (c[0] + 1, jax.nn.relu(soft_clip(c[1])) * 0.5),
        (0, x),
    )[1]

  def fori_dynamic(x, n):
    return jax.lax.fori_loop(0, n, lambda i, c: soft_clip(c) * 0.5, x)

  def cond(x):
    return jax.lax.cond(
        x.sum() > 0,
        lambda x: jnp.sin(x) * 2.0,
        lambda x: soft_clip(x),
        x,
    )

  def switch(i, x):
    return jax.lax.switch(
        i, [jnp.sin, jax.nn.relu, lambda x: scaled_sin(x, x)], x
    )

  def while_batched(x):
    return jax.lax.while_loop(
        lambda c: c.sum() < 10.0, lambda c: c * 2.0 + 1.0, x
    )

  def while_unbatched(x):
    return jax.lax.while_loop(
        lambda c: c[0] < 3, lambda c: (c[0] + 1, jnp.sin(c[1])), (0, x)
    )[1]

  ckpt = jax.checkpoint
  dots = jax.checkpoint_policies.dots_saveable
  ints = jnp.array([0, 2], jnp.int32)
  return {
      'scan_invariant_grad': (_grad(scan_invariant), (w3, xs43), ('scan',)),
      'scan_invariant_value_and_grad': (
          jax.value_and_grad(lambda w, xs: scan_invariant(w, xs).sum()),
          (w3, xs43),
          ('scan',),
      ),
      'scan_forwarding_cond_grad': (
          _grad(scan_forwarding_cond),
          (w3, xs43),
          ('scan', 'cond'),
      ),
      'scan_forwarding_cond_linearize': (
          lambda w, xs: jax.linearize(lambda w: scan_forwarding_cond(w, xs), w)[
              1
          ](w),
          (w3, xs43),
          ('scan', 'cond'),
      ),
      'scan_invariant_linearize': (
          lambda w, xs: jax.linearize(lambda w: scan_invariant(w, xs), w)[1](w),
          (w3, xs43),
          ('scan',),
      ),
      'scan_custom_invariant_grad': (
          _grad(scan_custom_invariant),
          (w3, xs43),
          ('scan', 'custom_jvp_call', 'custom_vjp_call'),
      ),
      'scan_custom_invariant_linearize': (
          lambda w, xs: jax.linearize(
              lambda w: scan_custom_invariant(w, xs), w
          )[1](w),
          (w3, xs43),
          ('scan', 'custom_jvp_call', 'custom_vjp_call'),
      ),
      'scan_calls_invariant_grad': (
          _grad(scan_calls_invariant),
          (w3, xs43),
          ('scan', 'cond', 'custom_vjp_call'),
      ),
      'scan_calls_invariant_checkpoint_grad': (
          _grad(ckpt(scan_calls_invariant)),
          (w3, xs43),
          ('scan', 'cond', 'remat2'),
      ),
      'scan_calls_invariant_linearize': (
          lambda w, xs: jax.linearize(lambda w: scan_calls_invariant(w, xs), w)[
              1
          ](w),
          (w3, xs43),
          ('scan', 'cond'),
      ),
      'nested_scan_grad': (_grad(nested_scan), (w3, xs43), ('scan',)),
      'scan_checkpoint_grad': (
          _grad(ckpt(scan_invariant)),
          (w3, xs43),
          ('scan', 'remat2'),
      ),
      'scan_checkpoint_dots_grad': (
          _grad(ckpt(scan_custom_invariant, policy=dots)),
          (w3, xs43),
          ('scan', 'remat2', 'custom_jvp_call', 'custom_vjp_call'),
      ),
      'scan_checkpoint_body_grad': (
          _grad(
              lambda w, xs: jax.lax.scan(
                  ckpt(lambda c, x: (jnp.sin(c * w) + soft_clip(x), None)),
                  w,
                  xs,
              )[0]
          ),
          (w3, xs43),
          ('scan', 'remat2'),
      ),
      'scan_checkpoint_linearize': (
          lambda w, xs: jax.linearize(ckpt(lambda w: scan_invariant(w, xs)), w)[
              1
          ](w),
          (w3, xs43),
          ('scan', 'remat2'),
      ),
      'scan_vmap': (
          jax.vmap(scan_invariant, in_axes=(0, None)),
          (xb, xs43),
          ('scan',),
      ),
      'scan_custom_vmap_grad': (
          jax.vmap(_grad(scan_custom_invariant), in_axes=(0, None)),
          (xb, xs43),
          ('scan', 'custom_jvp_call', 'custom_vjp_call'),
      ),
      'scan_checkpoint_vmap': (
          jax.vmap(ckpt(scan_custom_invariant), in_axes=(0, None)),
          (xb, xs43),
          ('scan', 'remat2', 'custom_jvp_call', 'custom_vjp_call'),
      ),
      'fori_static_grad': (
          _grad(fori_static),
          (w3,),
          ('scan', 'custom_jvp_call'),
      ),
      'fori_static_checkpoint_grad': (
          _grad(ckpt(fori_static)),
          (w3,),
          ('scan', 'remat2', 'custom_jvp_call'),
      ),
      'while_custom_checkpoint_grad': (
          _grad(ckpt(while_custom)),
          (x3,),
          ('while', 'remat2', 'custom_jvp_call', 'custom_vjp_call'),
      ),
      'while_custom_checkpoint_dots_grad': (
          _grad(ckpt(while_custom, policy=dots)),
          (x3,),
          ('while', 'remat2', 'custom_jvp_call', 'custom_vjp_call'),
      ),
      'while_dependent_checkpoint_linearize': (
          lambda x: jax.linearize(ckpt(while_dependent), x)[1](x),
          (x3,),
          ('while', 'remat2', 'custom_jvp_call'),
      ),
      'while_dependent_checkpoint_jvp': (
          lambda x: jax.jvp(ckpt(while_dependent), (x,), (x,)),
          (x3,),
          ('while', 'remat2', 'custom_jvp_call'),
      ),
      'fori_dynamic_checkpoint_linearize': (
          lambda x, n: jax.linearize(lambda x: ckpt(fori_dynamic)(x, n), x)[1](
              x
          ),
          (x3, jnp.int32(3)),
          ('while', 'remat2', 'custom_jvp_call'),
      ),
      'while_dependent_vmap': (
          jax.vmap(while_dependent),
          (xb,),
          ('while', 'custom_jvp_call'),
      ),
      'while_batched_vmap': (jax.vmap(while_batched), (xb,), ('while',)),
      'while_unbatched_vmap': (jax.vmap(while_unbatched), (xb,), ('while',)),
      'fori_dynamic_vmap': (
          jax.vmap(fori_dynamic, in_axes=(0, None)),
          (xb, jnp.int32(3)),
          ('while', 'custom_jvp_call'),
      ),
      'cond_batched_vmap': (
          jax.vmap(cond),
          (xb,),
          ('select_n', 'custom_jvp_call'),
      ),
      'cond_unbatched_vmap': (
          jax.vmap(cond, in_axes=None, axis_size=2),
          (x3,),
          ('cond', 'custom_jvp_call'),
      ),
      'cond_vmap_grad': (
          jax.vmap(_grad(cond)),
          (xb,),
          ('select_n', 'custom_jvp_call'),
      ),
      'cond_checkpoint_grad': (
          _grad(ckpt(cond)),
          (x3,),
          ('cond', 'remat2', 'custom_jvp_call'),
      ),
      'switch_batched_vmap': (
          jax.vmap(switch),
          (ints, xb),
          ('select_n', 'custom_jvp_call', 'custom_vjp_call'),
      ),
      'switch_unbatched_vmap': (
          jax.vmap(switch, in_axes=(None, 0)),
          (jnp.int32(1), xb),
          ('cond', 'custom_jvp_call', 'custom_vjp_call'),
      ),
      'cond_in_scan_vmap': (
          jax.vmap(
              lambda x: jax.lax.scan(lambda c, _: (cond(c), c), x, None, 3)
          ),
          (xb,),
          ('scan', 'select_n', 'custom_jvp_call'),
      ),
  }


# ----------------------------------------------------------------------------
# Custom derivatives under every transform.


def _custom_programs() -> dict[str, Program]:
  jvp, vjp = ('custom_jvp_call',), ('custom_vjp_call',)
  # name: (function, arguments, what its jaxpr shows undifferentiated and
  # differentiated; a custom_vjp with optimize_remat=True is a remat_opt
  # once differentiated, and is inlined under checkpoint).
  fns = {
      'relu': (jax.nn.relu, (x3,), jvp, jvp),
      'custom_jvp': (soft_clip, (x3,), jvp, jvp),
      'custom_jvp_straight_through': (clip_sz, (x3,), jvp, jvp),
      'custom_vjp': (scaled_sin, (x3, w3), vjp, vjp),
      'custom_vjp_over_custom_jvp': (
          through_custom_jvp,
          (x3,),
          jvp + vjp,
          jvp + vjp,
      ),
      'custom_vjp_optimize_remat': (
          exp3_optimize_remat,
          (x3,),
          vjp,
          ('remat_opt',),
      ),
  }
  out = {}
  for name, (fn, args, plain, diff) in fns.items():

    def composed(*a, fn=fn):
      return jnp.sin(fn(*a)) * fn(*a)

    batched = tuple(jnp.stack([a, -a]) for a in args)
    ckpt = ('remat2',) if 'optimize_remat' in name else ('remat2', *diff)
    out[f'{name}_grad'] = (_grad(composed), args, diff)
    out[f'{name}_jit_grad'] = (jax.jit(_grad(composed)), args, ('jit', *diff))
    out[f'{name}_jvp'] = (lambda *a, fn=fn: jax.jvp(fn, a, a), args, diff)
    out[f'{name}_linearize'] = (
        lambda *a, fn=fn: jax.linearize(fn, *a)[1](*a),
        args,
        diff,
    )
    out[f'{name}_vmap'] = (jax.vmap(fn), batched, plain)
    out[f'{name}_vmap_grad'] = (jax.vmap(_grad(composed)), batched, diff)
    out[f'{name}_jit'] = (jax.jit(composed), args, ('jit', *plain))
    if 'vjp' in name:  # forward mode cannot go through a custom_vjp
      out[f'{name}_jacrev'] = (jax.jacrev(fn), args, diff)
    else:
      out[f'{name}_jacfwd'] = (jax.jacfwd(fn), args, diff)
      out[f'{name}_hessian'] = (
          jax.hessian(lambda *a, fn=fn: jnp.sum(fn(*a))),
          args,
          diff,
      )
    out[f'{name}_checkpoint_grad'] = (
        _grad(jax.checkpoint(composed)),
        args,
        ckpt,
    )
  return out


# ----------------------------------------------------------------------------
# custom_linear_solve (its JVP rule is wrapped).


def _diag_solve(x):
  """``x = A^{-1} b`` for a diagonal ``A``, with and without symmetry."""
  a = jnp.diag(jnp.array([2.0, 4.0, 8.0]))

  def solve(_, b):
    return b / jnp.diag(a)

  plain = jax.lax.custom_linear_solve(lambda v: a @ v, x, solve, solve)
  sym = jax.lax.custom_linear_solve(
      lambda v: a @ jnp.sin(x) * v, x, solve, symmetric=True
  )
  return plain * sym


def _linear_solve_programs() -> dict[str, Program]:
  need = ('custom_linear_solve',)
  f = _diag_solve
  batched = jnp.stack([x3, -x3])
  return {
      'linear_solve_jit': (jax.jit(f), (x3,), ('jit', *need)),
      'linear_solve_grad': (_grad(f), (x3,), need),
      'linear_solve_jit_grad': (jax.jit(_grad(f)), (x3,), ('jit', *need)),
      'linear_solve_jvp': (lambda x: jax.jvp(f, (x,), (x,)), (x3,), need),
      'linear_solve_linearize': (
          lambda x: jax.linearize(f, x)[1](x),
          (x3,),
          need,
      ),
      'linear_solve_vmap': (jax.vmap(f), (batched,), need),
      'linear_solve_vmap_grad': (jax.vmap(_grad(f)), (batched,), need),
      'linear_solve_checkpoint_grad': (
          _grad(jax.checkpoint(f)),
          (x3,),
          ('remat2', *need),
      ),
  }


# ----------------------------------------------------------------------------
# Across devices.


def _sharding_programs() -> dict[str, Program]:
  mesh = jax.make_mesh((DEVICES,), ('d',), axis_types=(AxisType.Explicit,))
  x_local = jnp.arange(DEVICES * 3, dtype=jnp.float32).reshape(DEVICES, 3)
  x = jax.device_put(x_local / 10.0, NamedSharding(mesh, P('d')))

  def body(x):
    h = soft_clip(jnp.sin(x)) * jax.nn.relu(x)
    return jax.lax.psum(jnp.sum(h), 'd')

  def body_scan(x):
    def step(c, y):
      return c * jnp.cos(y) + scaled_sin(y, y), None

    return jax.lax.scan(step, x[0], x)[0][None]

  smap = jax.shard_map(body, mesh=mesh, in_specs=P('d'), out_specs=P())
  smap_scan = jax.shard_map(
      body_scan, mesh=mesh, in_specs=P('d'), out_specs=P('d')
  )
  return {
      'shard_map_grad': (
          jax.jit(jax.grad(smap)),
          (x,),
          ('shard_map', 'custom_jvp_call'),
      ),
      'shard_map_scan_grad': (
          jax.jit(jax.grad(lambda x: smap_scan(x).sum())),
          (x,),
          ('shard_map', 'scan', 'custom_vjp_call'),
      ),
      'shard_map_checkpoint_grad': (
          jax.jit(jax.grad(jax.checkpoint(smap))),
          (x,),
          ('shard_map', 'remat2', 'custom_jvp_call'),
      ),
      'shard_map_vmap': (
          jax.jit(jax.vmap(smap, in_axes=1)),
          (x,),
          ('shard_map', 'custom_jvp_call'),
      ),
      'pmap_grad': (
          jax.pmap(_grad(lambda x: soft_clip(x) * jnp.sin(x))),
          (x_local,),
          ('shard_map', 'custom_jvp_call'),
      ),
  }


def programs() -> dict[str, Program]:
  """Every program: ``name -> (function, arguments, needs)``.

  ``needs``: primitives the program's jaxpr contains (without the import),
  so that it stages the construct its name says.
  """
  return {
      **_checkpoint_programs(),
      **_loop_programs(),
      **_custom_programs(),
      **_linear_solve_programs(),
      **_sharding_programs(),
  }


def stage_all() -> dict[str, str]:
  """``str(jax.make_jaxpr(fn)(*args))`` for every program."""
  out = {}
  for name, (fn, args, _) in programs().items():
    try:
      out[name] = str(jax.make_jaxpr(fn)(*args))
    except Exception as e:  # pylint: disable=broad-except
      out[name] = f'ERROR {type(e).__name__}: {e}'
  return out


def _first_capture() -> None:
  """One capture, which installs the patch inventory."""
  from flax.nnx import sow as sow_lib  # pylint: disable=g-import-not-at-top

  _, collected = sow_lib.capture(lambda x: sow_lib.sow(x * 2.0, name='y'))(
      jnp.ones(3)
  )
  assert float(collected['y'][0][0]) == 2.0, collected


def _patches_installed() -> bool | None:
  patches = sys.modules.get('flax.nnx.sow._jax_patches')
  return None if patches is None else patches.installed()


def main() -> None:
  if '--after-capture' in sys.argv:
    _first_capture()
  jaxprs = stage_all()
  report = {
      'sow_imported': 'flax.nnx.sow' in sys.modules,
      'patches_installed': _patches_installed(),
      'device_count': jax.device_count(),
      'jaxprs': jaxprs,
  }
  print('RESULT ' + json.dumps(report))


if __name__ == '__main__':
  main()
