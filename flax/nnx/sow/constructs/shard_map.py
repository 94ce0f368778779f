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


"""``jax.shard_map`` (and so ``jax.pmap``): capture, intervene, and vmap.

JAX stages ``jax.pmap`` as a ``jit`` of a ``shard_map``, so this one rule
covers both. A value sown inside a ``shard_map`` body is per shard. The
rewritten body returns each leaf with one new leading axis of size 1 per
manual mesh axis the value varies over (its aval's varying manual axes when
``check_vma`` is on, every manual axis otherwise), and an ``out_specs``
entry that splits exactly those axes over the mesh. Outside, the leaf is a
global array ``(*[mesh.shape[a] for a in axes], *local_shape)`` whose entry
``[k0, k1, ...]`` is the value on the shard at those mesh coordinates, and
inside ``jax.jit`` it stays partitioned over the mesh: the capture adds no
collective.

A value that differs per shard through control flow (computed from a
``cond``/``while`` on a per-device predicate) although JAX types it
invariant is sown as varying: the body is first marked by ``control.py``.

A reduced name keeps one accumulator per shard the same way: outside, it has
the leading axes of the union of the axes its sites vary over
(:class:`ShardAxes`); it enters the body split by the
same spec, so each shard folds only its own values. A name new in the scope
starts from ``init_fn()`` run on every shard by a ``shard_map`` with no
inputs (the function was traced inside the body, under its mesh). Such a
name may not also be sown outside a ``shard_map``, nor in a ``shard_map``
nested in another.

``jax.vmap`` of a ``shard_map`` batches its body, so a value sown there would
come back with the mapped axis after the mesh axes: the rule raises for a
plain sow it would collect in a ``shard_map`` that a ``jax.vmap`` inside the
capture maps over (``collect.under_vmap``), also one hoisted out of a
``scan``/``cond`` in the body (``batched.py``). A vmap around the capture, or
inside the body, is collected.

``intervene``: a callable replacement is applied to each shard's value; an
array replacement raises ``NotImplementedError`` (replace the value outside
the ``shard_map``).
"""

from __future__ import annotations

import dataclasses

import jax
from jax.sharding import PartitionSpec

from flax.nnx.sow import _jax
from flax.nnx.sow import control as control_lib
from flax.nnx.sow import reductions
from flax.nnx.sow.accumulators import ReducedNames
from flax.nnx.sow.accumulators import init_reads_body
from flax.nnx.sow.collect import Collector
from flax.nnx.sow.collect import Layout
from flax.nnx.sow.collect import cached
from flax.nnx.sow.collect import collect_rules
from flax.nnx.sow.collect import eval_collecting
from flax.nnx.sow.collect import under_vmap
from flax.nnx.sow.inject import eval_intervening
from flax.nnx.sow.inject import intervene_rules
from flax.nnx.sow.primitive import MARKER_KINDS
from flax.nnx.sow.primitive import PLAIN_SOWS
from flax.nnx.sow.primitive import staging_active
from flax.nnx.sow.reductions import Accumulator
from flax.nnx.sow.sites import SowSite
from flax.nnx.sow.sites import construct_names
from flax.nnx.sow.sites import site_annotations
from flax.nnx.sow.sites import sow_sites


@dataclasses.dataclass(frozen=True)
class ShardAxes:
  """The mesh axes that a value sown inside ``shard_map`` varies over.

  Outside the ``shard_map`` such a value, or the accumulator of such a
  reduced name, carries one leading axis per axis in :attr:`axes`, of the
  sizes in :attr:`shape` (``constructs/shard_map.py``).
  """

  mesh_shape: tuple[tuple[str, int], ...]  # the mesh's axes, in mesh order
  names: frozenset[str]

  @property
  def axes(self) -> tuple[str, ...]:
    return tuple(a for a, _ in self.mesh_shape if a in self.names)

  @property
  def shape(self) -> tuple[int, ...]:
    return tuple(n for a, n in self.mesh_shape if a in self.names)

  def union(self, other: ShardAxes) -> ShardAxes | None:
    """Both sets of axes, or ``None`` if the meshes differ."""
    if other.mesh_shape != self.mesh_shape:
      return None
    return ShardAxes(self.mesh_shape, self.names | other.names)


def _manual_axes(params) -> tuple[tuple[str, int], ...]:
  """The axes this ``shard_map`` makes manual, in mesh order, with sizes."""
  mesh, manual = params['mesh'], params['newly_manual_axes']
  return tuple((a, mesh.shape[a]) for a in mesh.axis_names if a in manual)


def _varying(params, avals) -> frozenset[str]:
  """The manual axes of ``params``' shard_map that ``avals`` vary over."""
  manual = frozenset(params['newly_manual_axes'])
  if not params['check_vma']:
    return manual  # JAX does not track it; every shard may differ
  return frozenset().union(*(_jax.varying_axes(a) for a in avals)) & manual


def _annotate(eqn: _jax.JaxprEqn, site: SowSite) -> SowSite:
  if site.sharded is not None:
    # Sown in a nested shard_map; the rule of the outer one refuses reduced
    # names there (see ``_shard_map_capture``).
    return site
  sow = site.eqn
  n = len(sow.invars) - sow.params['n_closure']
  names = _varying(eqn.params, [v.aval for v in sow.invars[:n]])
  # A loop or branch whose predicate varies over an axis runs differently
  # per shard there, whatever the value's own type says; so does a value
  # computed from its outputs (``control.py``).
  control = site.control_axes
  if eqn.params['check_vma']:
    control |= _marked(eqn.params).sown.get(sow, frozenset())
  names |= control & frozenset(eqn.params['newly_manual_axes'])
  return dataclasses.replace(
      site, sharded=ShardAxes(_manual_axes(eqn.params), names)
  )


site_annotations[_jax.shard_map_p] = _annotate


def _marked(params) -> control_lib.Marked:
  return control_lib.mark_control_varying(
      params['jaxpr'], params['mesh'].axis_names
  )


def _shard_map_capture(collector: Collector, eqn: _jax.JaxprEqn, invals):
  if eqn.params['check_vma']:
    # Sows of values that differ per shard through control flow read a
    # ``pvary`` of them, so their types say so (``control.py``).
    marked = _marked(eqn.params).jaxpr
    if marked is not eqn.params['jaxpr']:
      eqn = eqn.replace(params=dict(eqn.params, jaxpr=marked))
  p = eqn.params
  body = p['jaxpr']
  sites = collector.accepted_sites([body])
  _refuse_vmapped(collector, sites)
  for site in sites:
    if site.reduction is not None and site.sharded is not None:
      raise NotImplementedError(
          f'sow {site.name!r}{site.where}: a reduced sow inside a'
          ' `jax.shard_map` nested in another `jax.shard_map` is not'
          ' supported. Sow it in the outer shard_map body (return the value'
          ' from the inner one), or drop reduce_fn/init_fn to collect the'
          ' values.'
      )
  names = ReducedNames.of(_annotate(eqn, s) for s in sites)
  _start_accumulators(collector, eqn, names)
  specs = names.specs(collector.reduced)
  rewritten = cached(
      body,
      (
          'shard_map',
          collector.accepts_key,
          specs,
          p['mesh'],
          p['newly_manual_axes'],
          p['check_vma'],
      ),
      lambda: _rewrite_body(body, collector.accepts_key, specs, p),
  )
  jaxpr, consts, acc_specs, extra_specs, layout = rewritten
  acc_in = collector.reduced.leaves(specs)
  acc_in = [_place(x, spec, p['mesh']) for x, spec in zip(acc_in, acc_specs)]
  outs = _bind_rewritten(
      eqn,
      jaxpr,
      consts,
      invals,
      leading=acc_in,
      leading_specs=acc_specs,
      out_specs=extra_specs,
  )
  return collector.split_outputs(layout, outs, len(eqn.outvars))


def _bind_rewritten(
    eqn, jaxpr, consts, invals, *, leading=(), leading_specs=(), out_specs=()
):
  """Binds ``eqn``'s ``shard_map`` with ``jaxpr``, its body rewritten to take
  ``[*consts, *leading, *inputs]`` and return ``[*outputs, *extra]``.

  The one binder of the capture and intervene rules: ``consts`` enter
  replicated, ``leading`` split as ``leading_specs`` say, and the extra
  outputs leave as ``out_specs`` says (``in_specs`` and ``out_specs`` are
  the parameters of a ``shard_map`` with one entry per input or output).
  """
  p = eqn.params
  const_specs = tuple(_jax.replicated_spec(_jax.typeof(c)) for c in consts)
  params = dict(
      p,
      jaxpr=jaxpr,
      in_specs=(*const_specs, *leading_specs, *p['in_specs']),
      out_specs=(*p['out_specs'], *out_specs),
  )
  return _jax.bind_equation(
      eqn.replace(params=params), [*consts, *leading, *invals]
  )


def _start_accumulators(
    collector: Collector, eqn: _jax.JaxprEqn, names: ReducedNames
):
  """Starts, one per shard, the accumulators of names new in this scope.

  ``init_fn()`` was traced inside the ``shard_map`` body, so it runs there:
  a ``shard_map`` with no inputs returns each shard's ``init_fn()`` with the
  leading axes of the name (:class:`ShardAxes`), laid out
  over the mesh like the accumulator it starts. Names the collector already
  holds, and those whose ``init_fn`` reads values traced in the body, are
  left to :meth:`~flax.nnx.sow.accumulators.ReducedNames.specs` (which
  continues or refuses them).
  """
  new = [
      site
      for name, site in names.first.items()
      if name not in collector.reduced
      and name not in collector.plain_names
      and not init_reads_body(site)
  ]
  if not new:
    return
  p = eqn.params
  treedefs = []

  def init_body():
    out = []
    treedefs.clear()
    for site in new:
      acc = reductions.initial_accumulator(
          site.reduction, site.eqn.params['treedef'], site.value_avals()
      )
      treedefs.append((acc.treedef, len(acc.leaves)))
      axes = names.sharded[site.name].axes
      for x in acc.leaves:
        x = _jax.pvary(x, axes)
        out.append(x.reshape((1,) * len(axes) + x.shape))
    return out

  with _jax.shard_map_context(
      p['mesh'], p['newly_manual_axes'], p['check_vma']
  ):
    closed = _jax.trace_to_closed_jaxpr(init_body, [], 'shard_map_init')
    jaxpr, consts = _jax.close_over_nothing(closed)
  out_specs = tuple(
      PartitionSpec(*names.sharded[site.name].axes)
      for site, (_, n) in zip(new, treedefs)
      for _ in range(n)
  )
  params = dict(
      p,
      jaxpr=jaxpr,
      in_specs=tuple(_jax.replicated_spec(_jax.typeof(c)) for c in consts),
      out_specs=out_specs,
  )
  leaves = iter(_jax.bind_equation(eqn.replace(params=params), consts))
  for site, (treedef, n) in zip(new, treedefs):
    acc = Accumulator(treedef, tuple(next(leaves) for _ in range(n)))
    collector.reduced.put(site.name, acc, names.sharded[site.name])


def _place(x, spec: PartitionSpec, mesh):
  """An accumulator laid out as ``spec`` says, where the mesh checks it.

  With ``Explicit`` mesh axes ``shard_map`` requires its inputs to be
  sharded as their ``in_specs`` say. An accumulator that a ``shard_map``
  returned already is; one from elsewhere is resharded.
  """
  explicit = getattr(mesh, 'explicit_axes', ())
  if not any(a in explicit for a in spec if a is not None):
    return x
  aval = _jax.typeof(x)
  current = getattr(aval, 'sharding', None)
  if (
      current is not None
      and current.mesh == mesh.abstract_mesh
      and _padded(current.spec, aval.ndim) == _padded(spec, aval.ndim)
  ):
    return x
  return jax.sharding.reshard(x, jax.sharding.NamedSharding(mesh, spec))


def _padded(spec: PartitionSpec, ndim: int) -> tuple:
  return tuple(spec) + (None,) * (ndim - len(spec))


def _rewrite_body(body: _jax.Jaxpr, accepts_key, specs, params):
  """The body with the collected values as extra, per-shard outputs.

  Returns ``(jaxpr, consts, acc_specs, extra_specs, layout)``: the new body
  takes ``[*consts, *accumulators, *inputs]``.
  """
  mesh, manual = params['mesh'], params['newly_manual_axes']
  check_vma = params['check_vma']
  acc_specs = tuple(
      PartitionSpec(*s.sharded.axes) for s in specs for _ in s.avals
  )
  acc_avals = [a for s in specs for a in s.avals]
  acc_local = [
      _jax.shard_aval(
          mesh,
          manual,
          check_vma,
          spec,
          _jax.ShapedArray(a.shape, a.dtype, weak_type=a.weak_type),
      )
      for spec, a in zip(acc_specs, acc_avals)
  ]
  n_acc = len(acc_avals)
  box = []

  def fn(*args):
    acc_leaves, inputs = args[:n_acc], args[n_acc:]
    inner = Collector(accepts_key)
    pos = 0
    for s in specs:
      n, k = len(s.avals), len(s.sharded.axes)
      local = tuple(x.reshape(x.shape[k:]) for x in acc_leaves[pos : pos + n])
      inner.reduced.put(s.name, Accumulator(s.treedef, local))
      pos += n
    outs = eval_collecting(body, (), inputs, inner)
    extra, extra_specs = [], []
    for _, leaves in inner.entries:
      for x in leaves:
        axes = ShardAxes(
            _manual_axes(params), _varying(params, [_jax.typeof(x)])
        ).axes
        extra.append(x.reshape((1,) * len(axes) + x.shape))
        extra_specs.append(PartitionSpec(*axes))
    for s in specs:
      axes = s.sharded.axes
      for x in inner.reduced.get(s.name).leaves:
        extra.append(x.reshape((1,) * len(axes) + x.shape))
        extra_specs.append(PartitionSpec(*axes))
    layout = Layout(
        tuple(spec for spec, _ in inner.entries), specs, tuple(inner.names)
    )
    box.append((layout, tuple(extra_specs)))
    return [*outs, *extra]

  with _jax.shard_map_context(mesh, manual, check_vma):
    closed = _jax.trace_to_closed_jaxpr(
        fn, [*acc_local, *_jax.binder_types(body)], 'shard_map_capture'
    )
    jaxpr, consts = _jax.close_over_nothing(closed)
  layout, extra_specs = box[-1]
  return jaxpr, consts, acc_specs, extra_specs, layout


collect_rules[_jax.shard_map_p] = _shard_map_capture
construct_names[_jax.shard_map_p] = '`jax.shard_map`'


# ----------------------------------------------------------------------------
# ``jax.vmap`` of a ``shard_map``: JAX batches the body, so a value sown in
# it would come back with the mapped axis after the mesh axes, unlike every
# other vmapped sow. Until that is laid out mapped-axis-first, a plain sow
# there raises. The staged program does not say whether the vmap that
# batched the body is around the ``shard_map`` or inside its body (both
# stage the same equation), but the name stack of the ``shard_map``, or of
# a call, loop or branch that holds it, records a vmap around it
# (``collect.under_vmap``).


def _refuse_vmapped(collector: Collector, sites) -> None:
  """Raises for a plain sow this capture collects in a ``shard_map`` that a
  ``jax.vmap`` inside the capture maps over."""
  if collector.accepts_key is PLAIN_SOWS or not under_vmap():
    # Hoisting (``batched.py``) runs while JAX batches a scan or cond, not
    # in a capture's pass; what it hoists leaves the loop mapped axis first.
    return
  for site in sites:
    # A sow the vmap batched has a batch dimension (its batching rule
    # broadcasts an unbatched value); one in a call that JAX bound as it
    # was, all its operands unbatched (a ``checkpoint``), has none.
    if (
        site.reduction is None
        and site.kind not in MARKER_KINDS
        and site.eqn.params['batch_dims']
    ):
      raise _vmap_error(site.name, site.where)


def _vmap_error(name, where_='') -> NotImplementedError:
  return NotImplementedError(
      f'sow {name!r}{where_}: a plain sow inside a `jax.shard_map` (or'
      ' `jax.pmap`) that `jax.vmap` maps over cannot be collected yet (its'
      ' mapped axis would not come first). Move the vmap inside the'
      ' shard_map body, put it around the capture'
      ' (`jax.vmap(capture(f))`), sow the value after the shard_map returns'
      ' it, or make it a reduced sow (reduce_fn/init_fn). Collecting it'
      " mapped axis first needs JAX's shard_map batching rule to tell a"
      " primitive's batching rule that its vmap maps over the shard_map from"
      ' outside (docs/upstream.md).'
  )


def _shard_map_intervene(injector, eqn, invals):
  p = eqn.params
  body = p['jaxpr']
  counts = injector.consumed(body)
  if any(counts.values()):
    name = next(n for n, c in counts.items() if c)
    site = next(s for s in sow_sites(body) if s.name == name)
    raise NotImplementedError(
        f'intervene: sow {name!r}{site.where} is inside `jax.shard_map` (or'
        ' `jax.pmap`), where array replacements are not supported yet. Pass'
        " a callable (values[name] = fn, applied to each shard's value), or"
        ' replace the value outside the shard_map.'
    )
  mesh, manual, check_vma = p['mesh'], p['newly_manual_axes'], p['check_vma']

  def build():
    def fn(*args):
      return eval_intervening(body, (), args, injector.inner((), []))

    with _jax.shard_map_context(mesh, manual, check_vma):
      closed = _jax.trace_to_closed_jaxpr(
          fn, _jax.binder_types(body), 'shard_map_intervene'
      )
      return _jax.close_over_nothing(closed)

  key = ('intervene_shard_map', injector.accepts_key, staging_active())
  jaxpr, consts = injector.cached(body, key, build)
  return _bind_rewritten(eqn, jaxpr, consts, invals)


intervene_rules[_jax.shard_map_p] = _shard_map_intervene
