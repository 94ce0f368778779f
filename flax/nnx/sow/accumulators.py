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

"""Reduced names: one accumulator per name in a scope, and how it is carried.

A reduced name (a sow with ``reduce_fn``/``init_fn``) keeps one accumulator
per scope: the top level of a capture, or a sub-jaxpr a rule rewrites. It
starts from the ``init_fn()`` of the name's first site in program order
(:func:`~flax.nnx.sow.sites.init_order_sites`; the branch written first in a
``cond``); every site then folds its value with its own ``reduce_fn``
(:meth:`Accumulators.fold`). Where a loop or branch holds sites of the name,
the construct's rule asks for their :class:`ReducedSpec` entries
(:meth:`Accumulators.specs`: :class:`ReducedNames` finds, per name, the site
that starts it and the mesh axes it is kept per shard over, and checks the
sites against the scope), passes the accumulators' leaves as extra inputs
of the rewritten sub-jaxpr (:meth:`Accumulators.leaves`), carries them
through it with a fixed type, and hands back the new ones
(:meth:`Accumulators.absorb`). Inside a ``shard_map`` an accumulator has one
copy per shard (``shard_map.ShardAxes``), started by
``constructs/shard_map.py``.

How one site's ``reduce_fn``/``init_fn`` are traced and applied is
``reductions.py``; this file keeps the accumulators.
"""

from __future__ import annotations

import dataclasses
import typing as tp

import jax

from flax.nnx.sow import _jax
from flax.nnx.sow import collect
from flax.nnx.sow import reductions
from flax.nnx.sow.primitive import MARKER_KINDS
from flax.nnx.sow.primitive import Name
from flax.nnx.sow.reductions import Accumulator
from flax.nnx.sow.reductions import Reduction
from flax.nnx.sow.reductions import strong
from flax.nnx.sow.sites import SowSite

# ``ShardAxes`` in annotations: ``constructs/shard_map.py``'s, which lands
# after this file.
from flax.nnx.sow.sites import as_jaxpr
from flax.nnx.sow.sites import site_annotations
from flax.nnx.sow.primitive import sow_p
from flax.nnx.sow.sites import sow_sites


@dataclasses.dataclass(frozen=True)
class ReducedSpec:
  """What a rewritten sub-jaxpr takes and returns for one reduced name."""

  name: Name
  treedef: tp.Any
  avals: tuple[tp.Any, ...]
  # Set when the name is sown inside a ``shard_map``: one accumulator per
  # shard, with these leading axes.
  sharded: ShardAxes | None = None


def _sharded_error(name, where_=''):
  return ValueError(
      f'sow {name!r}{where_}: this reduced name is sown inside a'
      ' `jax.shard_map` (or `jax.pmap`) and also outside it, or inside'
      ' shard_maps whose values vary over different mesh axes. Inside a'
      ' shard_map each shard keeps its own accumulator, which cannot be'
      ' folded together with values from elsewhere; give the sites'
      ' different names and combine the results yourself.'
  )


def _reduction_error(name, where_=''):
  return ValueError(
      f'sow {name!r}{where_}: one site of this name reduces (reduce_fn/'
      'init_fn) and another does not. A name is either reduced into one'
      ' accumulator or collected as a tuple of values; give the sites'
      ' different names, or pass reduce_fn/init_fn at every site.'
  )


_CARRIED_NOTE = (
    ' (Module.sow lets reduce_fn change it only where no loop, branch or'
    ' vmap carries the accumulator: at the top level of the capture or in'
    ' a jit body.)'
)


def _same_type(acc: Accumulator, treedef, avals) -> bool:
  """Whether ``(treedef, avals)`` has the structure, shapes and dtypes of
  ``acc``."""
  old = acc.avals
  return (
      treedef == acc.treedef
      and len(avals) == len(old)
      and all(
          x.shape == y.shape and x.dtype == y.dtype for x, y in zip(avals, old)
      )
  )


def _describe(treedef, avals) -> str:
  types = ', '.join(a.str_short() for a in avals)
  return f'{treedef} of [{types}]'


def _type_error(name, where_, acc: Accumulator, treedef, avals, what_to_do):
  """The error for a ``reduce_fn`` that changed the type of ``acc``."""
  return ValueError(
      f'sow {name!r}{where_}: reduce_fn changed the accumulator from'
      f' {_describe(acc.treedef, acc.avals)} to {_describe(treedef, avals)}'
      + what_to_do
  )


def init_reads_body(site: SowSite) -> bool:
  """Whether the ``init_fn`` of ``site`` reads a value traced inside the
  construct that holds the sow (so it cannot run before that construct)."""
  snap = site.reduction.snapshot
  return snap is not None and bool(snap.n_init_closure)


def init_order_sites(jaxpr: _jax.Jaxpr) -> list[SowSite]:
  """The reduced sows of ``jaxpr`` in the order in which they give a name
  its ``init_fn()``: program order, except that the two branches of a
  ``cond`` come last first. JAX stores ``lax.cond(pred, true_fun,
  false_fun)``'s branches as ``(false_fun, true_fun)``; ``true_fun``, written
  first, comes first (a two-branch ``lax.switch`` is staged the same way).
  By position, so that JAX's transforms, which keep branches in place, do
  not change it."""
  sites = []
  for eqn in jaxpr.eqns:
    if eqn.primitive is sow_p:
      p = eqn.params
      if p['reduction'] is not None and not p['remat_copy']:
        sites.append(
            SowSite(p['sow_name'], p['tag'], p['reduction'], p['kind'], eqn)
        )
      continue
    subs = list(_jax.jaxprs_in_params(eqn.params))
    if eqn.primitive is _jax.cond_p and len(subs) == 2:
      subs = subs[::-1]
    annotate = site_annotations.get(eqn.primitive)
    for sub in subs:
      for site in init_order_sites(sub):
        sites.append(site if annotate is None else annotate(eqn, site))
  return sites


@dataclasses.dataclass(frozen=True)
class ReducedNames:
  """The reduced names some sites sow: for each, the site whose ``init_fn()``
  starts its accumulator and the mesh axes it is kept per shard over.

  Built from the sites of a loop's or branch's sub-jaxprs (:meth:`in_jaxprs`)
  or of a ``shard_map`` body (:meth:`of`); :meth:`specs` checks them against
  one scope's :class:`Accumulators` and gives their :class:`ReducedSpec`.

  Attributes:
    sites: the sites, plain ones included, markers left out, in order.
    first: per reduced name, the site that starts its accumulator.
    sharded: per reduced name, the union of the axes its sites vary over
      inside a ``shard_map`` (``None``: sown outside any).
  """

  sites: tuple[SowSite, ...]
  first: dict[Name, SowSite]
  sharded: dict[Name, ShardAxes | None]

  @classmethod
  def of(
      cls,
      sites: tp.Iterable[SowSite],
      first: tp.Mapping[Name, SowSite] | None = None,
  ) -> ReducedNames:
    """The reduced names of ``sites``; ``first`` may say which site of a name
    starts its accumulator (by default its first in ``sites``).

    Raises:
      ValueError: if a name is sown both inside and outside a ``shard_map``,
        or in ``shard_map``s over different meshes.
    """
    sites = tuple(s for s in sites if s.kind not in MARKER_KINDS)
    first = dict(first or {})
    sharded: dict[Name, ShardAxes | None] = {}
    for site in sites:
      if site.reduction is None:
        continue
      first.setdefault(site.name, site)
      if site.name not in sharded:
        sharded[site.name] = site.sharded
        continue
      seen, here = sharded[site.name], site.sharded
      if seen is None and here is None:
        continue
      both = None if seen is None or here is None else seen.union(here)
      if both is None:
        raise _sharded_error(site.name, site.where)
      sharded[site.name] = both
    return cls(sites, first, sharded)

  @classmethod
  def in_jaxprs(cls, jaxprs, takes, branches: bool = False) -> ReducedNames:
    """The reduced names sown in ``jaxprs`` at the sites ``takes`` accepts.

    A name starts from its first site in :func:`init_order_sites`'s order;
    ``branches``: ``jaxprs`` are the branches of a ``cond`` (two of them:
    the second first).
    """
    jaxprs = list(jaxprs)
    order = jaxprs[::-1] if branches and len(jaxprs) == 2 else jaxprs
    first: dict[Name, SowSite] = {}
    for j in order:
      for site in init_order_sites(as_jaxpr(j)):
        if takes(site):
          first.setdefault(site.name, site)
    return cls.of(
        [s for j in jaxprs for s in sow_sites(as_jaxpr(j)) if takes(s)], first
    )

  def specs(self, accumulators: Accumulators) -> tuple[ReducedSpec, ...]:
    """The names' specs in the scope of ``accumulators``, which starts the
    accumulators of names new there.

    Raises:
      ValueError: if a name is reduced at one site and plain at another.
      NotImplementedError: if a new name's ``init_fn`` reads a value traced
        inside the construct.
    """
    specs: dict[Name, ReducedSpec] = {}
    for site in self.sites:
      if site.reduction is None:
        if site.name in accumulators:
          raise _reduction_error(site.name, site.where)
        continue
      if site.name in specs:
        continue
      site = self.first[site.name]
      if site.name not in accumulators and init_reads_body(site):
        raise NotImplementedError(
            f'sow {site.name!r}{site.where}: its init_fn reads a value traced'
            ' inside the construct that holds the sow, but the accumulator'
            ' is created before the construct runs. Make init_fn return'
            ' constants (e.g. jnp.zeros(shape)).'
        )
      acc = accumulators.start(
          site.name,
          site.reduction,
          (site.eqn.params['treedef'], site.value_avals()),
          site.where,
          sharded=self.sharded[site.name],
      )
      specs[site.name] = ReducedSpec(
          site.name, acc.treedef, acc.avals, accumulators.sharded.get(site.name)
      )
    return tuple(specs.values())


class Accumulators:
  """The running accumulators of the reduced names of one scope (one
  :class:`Collector`): started, folded, carried through sub-jaxprs.

  Args:
    collector: the scope's collector, whose one-name-one-meaning check
      (``claim``), plain names, accepted sites and ``python_folds`` (see
      :class:`~flax.nnx.sow.collect.Collector`) the accumulators use.
  """

  def __init__(self, collector: collect.Collector):
    self.by_name: dict[Name, Accumulator] = {}
    # Reduced names kept per shard of a ``shard_map`` (their accumulators
    # have the leading mesh axes of ``ShardAxes``).
    self.sharded: dict[Name, ShardAxes] = {}
    self._claim = collector.claim
    self._is_plain = collector.plain_names.__contains__
    self._takes = collector.accepts_site
    self.python_folds = collector.python_folds

  def __contains__(self, name: Name) -> bool:
    return name in self.by_name

  def get(self, name: Name) -> Accumulator | None:
    return self.by_name.get(name)

  def value(self, name: Name) -> tp.Any:
    """The accumulator of ``name`` as the pytree ``init_fn()`` gave."""
    acc = self.by_name[name]
    return jax.tree_util.tree_unflatten(acc.treedef, acc.leaves)

  plain_error = staticmethod(_reduction_error)

  def enter(self, specs: tp.Sequence[ReducedSpec], leaves) -> None:
    """Starts a rewritten sub-jaxpr's scope from its accumulator inputs
    (``leaves``, laid out by ``specs``)."""
    pos = 0
    for s in specs:
      n = len(s.avals)
      acc = Accumulator(s.treedef, tuple(leaves[pos : pos + n]))
      self.put(s.name, acc, s.sharded)
      pos += n

  def start(
      self,
      name: Name,
      reduction: Reduction,
      value,
      where_: str = '',
      closure=(),
      sharded: ShardAxes | None = None,
  ) -> Accumulator:
    """The accumulator of ``name``, created from ``init_fn()`` if new.

    ``value`` is ``(treedef, avals)`` of one sown value; ``closure`` the
    site's closure operands (``reductions.py``). ``sharded``: the site is
    inside a ``shard_map``, so the accumulator has one copy per shard.
    """
    acc = self.by_name.get(name)
    if acc is None:
      self._claim(name, 'value', where_)
      if self._is_plain(name):
        raise _reduction_error(name, where_)
      acc = reductions.initial_accumulator(reduction, *value, closure)
      if sharded is not None:
        acc = Accumulator(
            acc.treedef,
            tuple(
                jax.numpy.broadcast_to(x, (*sharded.shape, *x.shape))
                for x in acc.leaves
            ),
        )
      self.put(name, acc, sharded)
    elif self.sharded.get(name) != sharded:
      raise _sharded_error(name, where_)
    return acc

  def fold(
      self,
      name: Name,
      reduction: Reduction,
      treedef,
      leaves,
      batch_dims=0,
      where_: str = '',
      closure=(),
  ):
    """Folds one sown value (or, with ``batch_dims``, a batch) into ``name``.

    ``closure`` holds the site's closure operands, with the same leading
    batch axes as ``leaves``.
    """
    value_avals = [
        _jax.ShapedArray(_jax.typeof(x).shape[batch_dims:], x.dtype)
        for x in leaves
    ]
    closure = list(closure)
    # Under vmap every example has its own closure; the accumulator is
    # created from the first example's.
    first = [x[(0,) * batch_dims] for x in closure] if batch_dims else closure
    acc = self.start(name, reduction, (treedef, value_avals), where_, first)
    fixed = reduction.fixed_type or batch_dims or not self.python_folds
    treedef_box = [acc.treedef]

    def step(acc_leaves, value_leaves, closure_leaves):
      new_leaves, new_treedef = reductions.fold(
          reduction,
          Accumulator(acc.treedef, tuple(acc_leaves)),
          treedef,
          value_leaves,
          closure_leaves,
      )
      new_leaves = tuple(strong(x) for x in new_leaves)
      new_avals = tuple(_jax.typeof(x) for x in new_leaves)
      if fixed and not _same_type(acc, new_treedef, new_avals):
        raise _type_error(
            name,
            where_,
            acc,
            new_treedef,
            new_avals,
            '. The accumulator must keep its structure, shape and dtype; make'
            ' init_fn() return a value of the type reduce_fn produces (e.g.'
            ' with the right dtype).'
            + _CARRIED_NOTE * (not reduction.fixed_type),
        )
      treedef_box[:] = [new_treedef]
      return new_leaves

    if batch_dims:
      # Values sown under vmap: one reduction per example, in order.
      n = len(leaves)
      batch = [
          x.reshape((-1, *x.shape[batch_dims:])) for x in [*leaves, *closure]
      ]
      new_leaves, _ = jax.lax.scan(
          lambda a, v: (step(a, v[:n], v[n:]), None), acc.leaves, batch
      )
    else:
      new_leaves = step(acc.leaves, leaves, closure)
    self.by_name[name] = Accumulator(treedef_box[0], tuple(new_leaves))

  def specs(self, jaxprs, *, branches: bool = False) -> tuple[ReducedSpec, ...]:
    """The specs of the reduced names sown in ``jaxprs``, whose accumulators
    it starts if new (see :class:`ReducedNames`)."""
    return ReducedNames.in_jaxprs(jaxprs, self._takes, branches).specs(self)

  def vary(
      self, specs: tuple[ReducedSpec, ...], axes: frozenset
  ) -> tuple[ReducedSpec, ...]:
    """Marks the accumulators of ``specs`` as varying over manual ``axes``.

    Inside ``shard_map``, a loop or branch whose predicate varies over mesh
    axes runs differently per shard, so what it folds does too, even where
    the values do not vary (a step counter); JAX's types do not say so.
    """
    if not axes:
      return specs
    for spec in specs:
      acc = self.by_name[spec.name]
      leaves = tuple(_jax.pvary(x, tuple(axes)) for x in acc.leaves)
      self.by_name[spec.name] = Accumulator(acc.treedef, leaves)
    return self.current(specs)

  def leaves(self, specs: tp.Sequence[ReducedSpec]) -> list:
    return [x for s in specs for x in self.by_name[s.name].leaves]

  def absorb(self, spec: ReducedSpec, leaves: tp.Sequence[tp.Any]) -> None:
    """The accumulator of ``spec.name`` after a rewritten sub-jaxpr ran.

    Raises:
      ValueError: if a ``Module.sow`` reduction changed the accumulator's
        type inside a ``jit`` within a loop or branch (which carries it with
        a fixed type).
    """
    acc = self.by_name.get(spec.name)
    if (
        not self.python_folds
        and acc is not None
        and not _same_type(acc, spec.treedef, spec.avals)
    ):
      raise _type_error(
          spec.name,
          '',
          acc,
          spec.treedef,
          spec.avals,
          ' inside a `jax.jit` within a loop or branch, which carries it with'
          ' a fixed type. Make init_fn() return a value of the type reduce_fn'
          ' produces.',
      )
    self.by_name[spec.name] = Accumulator(spec.treedef, tuple(leaves))

  def put(
      self, name: Name, acc: Accumulator, sharded: ShardAxes | None = None
  ) -> None:
    """Sets the accumulator of ``name`` (a sub-jaxpr's carried input, or a
    ``shard_map``'s per-shard start)."""
    self.by_name[name] = acc
    if sharded is not None:
      self.sharded[name] = sharded

  def current(self, specs: tp.Sequence[ReducedSpec]) -> tuple[ReducedSpec, ...]:
    """``specs`` with the accumulators' types as they are now."""
    return tuple(
        dataclasses.replace(
            s,
            treedef=self.by_name[s.name].treedef,
            avals=self.by_name[s.name].avals,
        )
        for s in specs
    )


collect.reduced_names.append(Accumulators)
