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

"""What a capture collects and the loop over staged jaxprs.

This file owns collection (which equations hold accepted sows is
``sites.py``): the :class:`Collector` of one scope
(entries of plain names, accumulators of reduced names, their layouts as
extra outputs of a rewritten sub-jaxpr), the :class:`Collected` dict a
capture returns, the rewrite of one sub-jaxpr (:func:`rewrite_jaxpr`) and
the generic loop :func:`eval_collecting`, an interpreter that binds every
equation as ``jax.core.eval_jaxpr`` would, except that

* an accepted ``sow`` equation is recorded in a :class:`Collector` instead of
  being bound, and
* a higher-order primitive whose sub-jaxprs hold accepted sows is handed to
  the rule registered for it in :data:`collect_rules`; the rule re-binds the
  primitive with rewritten sub-jaxprs that return the collected values as
  extra outputs (one file per construct in ``constructs/``).

Everything else, including every sub-jaxpr with nothing to collect, is bound
exactly as it was, so custom rules and compiled ``jit`` entries are kept.
``capturing.py`` holds the transform itself; ``toplevel.py`` its top level.
"""

from __future__ import annotations

import contextlib  # PR: shard_map
import contextvars  # PR: shard_map
import dataclasses
import json  # PR: collected
import threading
import typing as tp
import weakref

import jax
import jax.numpy as jnp
import numpy as np

from flax.nnx.sow import _jax
from flax.nnx.sow import cotangents  # PR: perturb
from flax.nnx.sow import display  # PR: collected
from flax.nnx.sow.primitive import MARKER_KINDS  # PR: toplevel
from flax.nnx.sow.primitive import Name
from flax.nnx.sow.primitive import collectible
from flax.nnx.sow.primitive import sow_p
from flax.nnx.sow.sites import SowSite
from flax.nnx.sow.primitive import accepts
from flax.nnx.sow.sites import as_jaxpr
from flax.nnx.sow.sites import construct_name
from flax.nnx.sow.sites import renamed  # PR: toplevel
from flax.nnx.sow.sites import holds_markers  # PR: nnx_transforms
from flax.nnx.sow.sites import sow_sites
from flax.nnx.sow.sites import where

Rule = tp.Callable[['Collector', _jax.JaxprEqn, list[tp.Any]], list[tp.Any]]
# What a rewritten sub-jaxpr takes and returns for one reduced name
# (``accumulators.ReducedSpec``).
ReducedSpec = tp.Any

collect_rules: dict[_jax.Primitive, Rule] = {}
"""Rules for higher-order primitives, keyed by primitive.

``rule(collector, eqn, invals) -> outvals`` binds ``eqn`` so that the accepted
sows in its sub-jaxprs reach ``collector`` (via :meth:`Collector.rewrite` and
:meth:`Collector.absorb`), and returns the equation's ordinary outputs.
"""

CallHook = tp.Callable[..., tp.Any]

call_hooks: list[CallHook] = []
"""Hooks around every call of a captured or intervened function.

``hook(run, f, args, kwargs, *, tags, in_place) -> out`` must call
``run(f2, args2, kwargs2)`` once, and return what it returns (possibly
changed back, e.g. objects restored). ``tags`` are the tags the capture
accepts (``None``: all); ``in_place`` says whether ``run`` calls ``f`` on the
caller's trace (a capture) or stages it (``intervene``). The NNX layer
registers one (``nnx/calls.py``: the path scope for ``Module.sow``, NNX graph
nodes among the arguments); the functional core knows nothing of NNX.
"""

opaque_leaf_checks: list[tp.Callable[[tp.Any], bool]] = []  # PR: eager
"""Predicates for objects a capture must not flatten as pytrees (NNX graph
nodes, registered by ``nnx/calls.py``)."""


class NoReducedNames:
  """The reduced names of a scope before ``accumulators.py`` lands: none
  (``api.sow`` refuses a ``reduce_fn`` without it). The interface a
  :class:`Collector` and the construct rules use of ``self.reduced``."""

  def __contains__(self, name: Name) -> bool:
    return False

  def specs(self, jaxprs, *, branches: bool = False) -> tuple:
    del jaxprs, branches
    return ()

  def leaves(self, specs) -> list:
    return []

  def current(self, specs) -> tuple:
    return tuple(specs)


reduced_names: list[tp.Callable] = [lambda collector: NoReducedNames()]
"""What keeps a :class:`Collector`'s reduced names, given the collector, last
one registered: ``accumulators.Accumulators`` (its ``fold``, ``absorb``,
``enter`` and ``get`` serve what the reductions add here)."""


def is_opaque_leaf(x) -> bool:  # PR: eager
  return any(check(x) for check in opaque_leaf_checks)


def run_with_call_hooks(run, f, args, kwargs, *, tags, in_place):
  """``run(f, args, kwargs)`` inside every registered call hook."""
  for hook in reversed(call_hooks):
    run = _around(hook, run, tags, in_place)
  return run(f, args, kwargs)


def _around(hook, run, tags, in_place):
  return lambda f, a, kw: hook(run, f, a, kw, tags=tags, in_place=in_place)


class EntrySpec(tp.NamedTuple):
  """One plain entry among a rewritten jaxpr's extra outputs.

  A ``perturb``'s forward marker is an entry of ``size`` 0 and kind
  ``'perturb'``: it returns nothing, but says where the forward pass of that
  perturb ran among the cotangents, so that :meth:`Collector.result` can put
  the cotangents of several backward passes in call order.
  """

  name: Name
  tag: tp.Hashable
  treedef: tp.Any
  size: int  # number of leaves
  kind: str = 'value'  # or 'cotangent' or 'perturb' (see primitive.py)
  # For 'perturb' and 'cotangent': the perturb call's ordinal (api.py), or
  # a cotangents.BranchOrdinal.
  ordinal: tp.Any = None
  # For 'cotangent': per leading mapped axis of its leaves, the loops of
  # ``f`` inside that ``vmap`` not yet stacked, or ``LOOPS_UNKNOWN`` (see
  # primitive.py).
  loops_mapped: tuple[int, ...] | str = ()  # PR: perturb

  @classmethod
  def of_sow(cls, p: dict[str, tp.Any], size: int) -> EntrySpec:
    """The entry of a sow with parameters ``p`` that returns ``size`` leaves."""
    return cls(
        p['sow_name'],
        p['tag'],
        p['treedef'],
        size,
        p['kind'],
        p.get('ordinal'),
        p.get('loops_mapped', ()),  # PR: perturb
    )


@dataclasses.dataclass(frozen=True)
class Layout:
  """The extra outputs of a rewritten jaxpr, after its ordinary outputs.

  A rewritten jaxpr takes ``[*accumulators_in, *inputs]`` and returns
  ``[*outputs, *entry_leaves, *accumulators_out]``: first the leaves of every
  plain entry, in call order, then one accumulator per reduced name, in the
  order of ``reduced``.
  """

  entries: tuple[EntrySpec, ...]
  reduced: tuple[ReducedSpec, ...]
  names: tuple[Name, ...]  # every name, in order of first sow

  @property
  def num_entry_leaves(self) -> int:
    return sum(e.size for e in self.entries)

  @property
  def num_accumulator_leaves(self) -> int:
    return sum(len(r.avals) for r in self.reduced)

  @property
  def num_extra(self) -> int:
    return self.num_entry_leaves + self.num_accumulator_leaves


def _meaning_error(name, where_=''):  # PR: perturb
  return ValueError(
      f'capture: {name!r}{where_} is used by sow(...) and by perturb(...) in'
      ' one capture. A name holds sown values or perturb cotangents, never'
      ' both (intervene could not tell a gradient from a value); give the'
      ' perturb another name, e.g. name=(..., "grad"), or collect the two in'
      ' separate captures by tag (capture(f, tags=[...])).'
  )


def _meaning(kind: str) -> str:  # PR: perturb
  return 'cotangent' if kind in ('perturb', 'cotangent') else 'value'


class Collector:
  """What one capture has collected so far in one scope of the program.

  A scope is the top-level jaxpr or a sub-jaxpr being rewritten by a rule.
  Plain names collect a list of entries; reduced names keep one accumulator.

  ``python_folds``: every sow here is folded once, in Python, when it is
  reached (the top level of a capture, the body of a ``jit``), so a
  ``Module.sow`` reduction (``Reduction.fixed_type=False``) may change the
  accumulator's type, as in Flax. Elsewhere a loop or branch carries the
  accumulator, and its type is fixed.
  """

  def __init__(self, accepts_key: frozenset | None, python_folds: bool = False):
    self.accepts_key = accepts_key
    self.python_folds = python_folds
    self.entries: list[tuple[EntrySpec, list[tp.Any]]] = []
    self.names: dict[Name, None] = {}
    self.plain_names: set[Name] = set()  # PR: reductions
    # 'value' or 'cotangent' per name: one name, one meaning.
    self.meanings: dict[Name, str] = {}  # PR: perturb
    self.reduced = reduced_names[-1](self)
    # At the top of a capture: the ``vmap`` and ``jvp`` transforms in the
    # name stack it was called in (see ``outside_transforms``).
    self.outside = (0, 0)  # PR: shard_map

  # -- which sows this capture takes --------------------------------------

  def accepts(  # PR: linear_solve
      self,
      tag: tp.Hashable,
      reduction: tp.Any,  # a reductions.Reduction, or None
      kind: str = 'value',
      name: Name | None = None,
  ) -> bool:
    return accepts(self.accepts_key, tag, reduction, kind, name)

  def takes(self, params: dict[str, tp.Any]) -> bool:
    """Whether this capture collects the sow equation with ``params``."""
    p = params
    return collectible(p) and accepts(
        self.accepts_key, p['tag'], p['reduction'], p['kind'], p['sow_name']
    )

  def accepts_site(self, s: SowSite) -> bool:
    """Whether this capture collects the site ``s`` (never an inert sow of
    a program staged outside any capture: ``primitive.collectible``)."""
    key = self.accepts_key
    return s.collectible and accepts(key, s.tag, s.reduction, s.kind, s.name)

  def accepted_sites(
      self, jaxprs: tp.Iterable[_jax.Jaxpr | _jax.ClosedJaxpr]
  ) -> list[SowSite]:
    return [
        s
        for j in jaxprs
        for s in sow_sites(as_jaxpr(j))
        if self.accepts_site(s)
    ]

  def has_work(self, jaxprs) -> bool:
    if any(holds_markers(as_jaxpr(j)) for j in jaxprs):  # PR: nnx_transforms
      return True
    return any(
        self.accepts_site(s) for j in jaxprs for s in sow_sites(as_jaxpr(j))
    )

  # -- recording ----------------------------------------------------------

  def claim(self, name: Name, kind: str, where_: str = '') -> None:
    """Records that ``name`` holds values or cotangents (by ``kind``).

    Raises:
      ValueError: if the name already holds the other.
    """
    meaning = _meaning(kind)  # PR: perturb
    if self.meanings.setdefault(name, meaning) != meaning:  # PR: perturb
      raise _meaning_error(name, where_)

  def add_entry(
      self, spec: EntrySpec, leaves: tp.Sequence[tp.Any], where_: str = ''
  ):
    if spec.name in self.reduced:  # PR: reductions
      raise self.reduced.plain_error(spec.name, where_)
    if spec.kind == 'cotangent':  # PR: perturb
      cotangents.check_arrival(spec)
    self.claim(spec.name, spec.kind, where_)
    self.names.setdefault(spec.name, None)
    self.plain_names.add(spec.name)  # PR: reductions
    self.entries.append((spec, list(leaves)))

  def on_sow(self, eqn: _jax.JaxprEqn, invals: list[tp.Any]) -> list[tp.Any]:
    if not self.takes(eqn.params):
      return _jax.bind_equation(eqn, invals)
    return self.sow(eqn.params, invals, where(eqn))

  def sow(self, p: dict[str, tp.Any], invals: list[tp.Any], where_) -> list:
    """Records one accepted sow with parameters ``p``; returns its value.

    ``where_`` formats as `` (at file:line)`` for errors.
    """
    if p['kind'] == 'perturb':  # PR: perturb
      # Collects nothing, but the name takes its place in the order of
      # first sow here, and the marker says where this forward pass ran
      # (a perturb's cotangent arrives later, in the backward pass).
      self.add_entry(EntrySpec.of_sow(p, 0), [], where_)
      return invals
    if p['kind'] in MARKER_KINDS:  # PR: loops
      self.names.setdefault(p['sow_name'], None)
      return invals
    n = len(invals) - p['n_closure']
    given = invals[:n]  # returned as they are (NumPy stays NumPy)
    invals = [
        x
        if isinstance(x, (jax.Array, jax.core.Tracer)) or _jax.is_ref(x)
        else jnp.asarray(x)
        for x in invals
    ]
    values, closure = invals[:n], invals[n:]
    if p['reduction'] is not None:  # PR: reductions
      self.names.setdefault(p['sow_name'], None)
      self.reduced.fold(
          p['sow_name'],
          p['reduction'],
          p['treedef'],
          values,
          p['batch_dims'],
          where_,
          closure,
      )
      return given
    self.add_entry(EntrySpec.of_sow(p, len(values)), values, where_)
    return given

  # -- sub-jaxprs ---------------------------------------------------------

  def prepare(
      self, jaxpr: _jax.ClosedJaxpr, python_folds: bool = False
  ) -> tuple[_jax.ClosedJaxpr, Layout, list[tp.Any]]:
    """What a rule for a one-body primitive needs, in one call.

    Returns:
      ``(rewritten, layout, accumulators)``: ``jaxpr`` rewritten for this
      capture (see :meth:`rewrite`), the layout of its extra outputs, and the
      accumulator leaves to pass as its leading inputs. ``python_folds``:
      the sub-jaxpr runs once per equation, its sows folded in order (a
      ``jit``, see :class:`Collector`).
    """
    specs = self.reduced.specs([jaxpr])
    rewritten, layout = self.rewrite(jaxpr, specs, python_folds)
    return rewritten, layout, self.reduced.leaves(specs)

  def rewrite(
      self,
      jaxpr: _jax.ClosedJaxpr,
      specs: tuple[ReducedSpec, ...],
      python_folds: bool = False,
  ) -> tuple[_jax.ClosedJaxpr, Layout]:
    """``jaxpr`` with what this capture collects in it as extra outputs.

    See :class:`Layout` for the signature. Cached per (jaxpr, tags,
    accumulator types), so re-binding a rewritten ``jit`` hits its cache.
    """
    return rewrite_jaxpr(jaxpr, self.accepts_key, specs, python_folds)

  def absorb(self, layout: Layout, extra: tp.Sequence[tp.Any]) -> None:
    """Records the extra outputs of a rewritten jaxpr, laid out by ``layout``.

    Entries from a loop carry one more leading axis, which changes nothing
    here.
    """
    extra = list(extra)
    assert len(extra) == layout.num_extra, (len(extra), layout)
    for name in layout.names:  # keeps the order of first sow
      self.names.setdefault(name, None)
    pos = 0
    for spec in layout.entries:
      self.add_entry(spec, extra[pos : pos + spec.size])
      pos += spec.size
    for spec in layout.reduced:  # PR: reductions
      n = len(spec.avals)
      self.reduced.absorb(spec, extra[pos : pos + n])
      self.names.setdefault(spec.name, None)
      pos += n

  def split_outputs(
      self, layout: Layout, outs: tp.Sequence[tp.Any], n_out: int
  ) -> list[tp.Any]:
    """Absorbs the extra outputs after the first ``n_out``; returns those."""
    outs = list(outs)
    self.absorb(layout, outs[n_out:])
    return outs[:n_out]

  def layout(self, specs: tuple[ReducedSpec, ...]) -> Layout:
    entries = tuple(spec for spec, _ in self.entries)
    return Layout(entries, self.reduced.current(specs), tuple(self.names))

  def extra_outputs(self, specs: tuple[ReducedSpec, ...]) -> list[tp.Any]:
    leaves = [x for _, ls in self.entries for x in ls]
    return leaves + self.reduced.leaves(specs)

  def result(self) -> Collected:
    """The ``collected`` dict: names in order of first sow."""
    plain: dict[Name, list[tuple[EntrySpec, tp.Any]]] = {}
    for spec, ls in self.entries:
      value = None
      if spec.kind != 'perturb':
        value = jax.tree_util.tree_unflatten(spec.treedef, ls)
      plain.setdefault(spec.name, []).append((spec, value))
    out = Collected()
    arrived = set()  # PR: perturb
    for name in self.names:
      if name in self.reduced:
        out[name] = self.reduced.value(name)
        continue
      if self.meanings.get(name) == 'cotangent':  # PR: perturb
        values = cotangents.in_call_order(plain.get(name, []))
        if values:  # else: a perturb never differentiated: nothing
          out[name] = tuple(values)
          arrived.add(name)
        continue
      if name in plain:
        out[name] = tuple(v for _, v in plain[name])
    out.cotangents = frozenset(arrived)  # PR: perturb
    return out


class Collected(dict):
  """The ``dict`` a capture returns; a pytree that keeps insertion order.

  A plain ``dict`` is flattened in sorted key order, which fails for a mix of
  ``str`` and tuple names and would reorder names under ``jax.jit``; this
  subclass flattens in the order of first sow. ``cotangents`` names the
  entries that are ``perturb`` cotangents (so ``intervene`` does not patch
  a gradient in as a value). It is registered with ``jax.export``, so an
  exported capture serializes; its keys and the mark survive the round trip.
  """

  cotangents: frozenset = frozenset()

  def __repr__(self) -> str:  # PR: collected
    """A table: one row per name (entries, leaf dtypes and shapes)."""
    return display.text(self, self.cotangents)

  def __treescope_repr__(self, path, subtree_renderer):  # PR: collected
    return display.treescope_repr(self, path, subtree_renderer)


def _flatten_collected(d):
  keys = tuple(d)
  children = [(jax.tree_util.DictKey(k), d[k]) for k in keys]
  return children, (keys, d.cotangents)


def _unflatten_collected(aux, values):
  keys, cotangents = aux
  out = Collected(zip(keys, values))
  out.cotangents = cotangents
  return out


jax.tree_util.register_pytree_with_keys(
    Collected, _flatten_collected, _unflatten_collected
)


def _name_to_json(name: tp.Any) -> tp.Any:  # PR: collected
  if isinstance(name, str):
    return name
  if (
      isinstance(name, tuple)
      and name
      and all(
          isinstance(p, str) or (isinstance(p, int) and not isinstance(p, bool))
          for p in name
      )
  ):
    return list(name)
  raise TypeError(
      f'jax.export: cannot serialize a Collected with the key {name!r} of'
      f' type {type(name).__name__}; only sow names (a str or a tuple of'
      ' str/int) serialize. Rename the entry, or return a plain dict.'
  )


def _name_from_json(name: tp.Any) -> Name:  # PR: collected
  return name if isinstance(name, str) else tuple(name)


def _serialize_collected_aux(aux) -> bytes:  # PR: collected
  keys, cotangents = aux
  # The cotangent names in key order, so equal aux data give equal bytes.
  marked = [k for k in keys if k in cotangents]
  marked += sorted((k for k in cotangents if k not in keys), key=repr)
  return json.dumps(
      {
          'keys': [_name_to_json(k) for k in keys],
          'cotangents': [_name_to_json(k) for k in marked],
      }
  ).encode('utf-8')


def _deserialize_collected_aux(data: bytes):  # PR: collected
  aux = json.loads(data.decode('utf-8'))
  keys = tuple(_name_from_json(k) for k in aux['keys'])
  return keys, frozenset(_name_from_json(k) for k in aux['cotangents'])


# ``jax.export``'s ``Exported.serialize`` writes the in and out trees of the
# exported function; a capture returns a Collected, so it must be known there
# (with its key order and its cotangent mark).
jax.export.register_pytree_node_serialization(  # PR: collected
    Collected,
    serialized_name='flax.nnx.sow.Collected',
    serialize_auxdata=_serialize_collected_aux,
    deserialize_auxdata=_deserialize_collected_aux,
)


# ----------------------------------------------------------------------------
# The rewrite of one sub-jaxpr.

_rewrite_cache: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_rewrite_lock = threading.Lock()


def cached(
    source: tp.Any,
    key: tp.Hashable,
    build: tp.Callable[[], tp.Any],
    owner: tp.Any = None,
    keep: tp.Callable[[], bool] | None = None,
):
  """``build()``, memoised per ``source`` object (weakly) and ``key``.

  Rules derive new jaxprs from the ones in an equation; returning the same
  object for the same input keeps JAX's compilation caches warm. With an
  ``owner``, the entry is that object's alone and is dropped when it is
  collected (``inject.Injector.cached``). Where ``keep()`` is false after the
  build, the result is not memoised.
  """
  if owner is not None:  # PR: intervene
    key = (*key, id(owner))
  per_source = _rewrite_cache.get(source)
  if per_source is not None and key in per_source:
    return per_source[key]
  result = build()
  if keep is not None and not keep():  # PR: intervene
    return result
  with _rewrite_lock:
    _rewrite_cache.setdefault(source, {})[key] = result
  if owner is not None:  # PR: intervene
    # Runs before the owner's id can be reused.
    weakref.finalize(owner, _evict, weakref.ref(source), key)
  return result


def _evict(source_ref, key) -> None:  # PR: intervene
  source = source_ref()
  if source is None:
    return
  with _rewrite_lock:
    _rewrite_cache.get(source, {}).pop(key, None)


@dataclasses.dataclass(frozen=True)
class Edited:  # PR: toplevel
  """A jaxpr whose accepted sows were removed and their operands returned."""

  jaxpr: _jax.Jaxpr  # returns [*outputs, *entry_leaves]
  layout: Layout


def edit_plain_sows(  # PR: toplevel
    jaxpr: _jax.Jaxpr, accepts_key: frozenset | None | object
) -> Edited | None:
  """The rewrite as an edit of ``jaxpr``, where that is all it takes.

  When every sow the capture accepts is a plain sow at the top level of
  ``jaxpr`` and no sub-jaxpr holds one, collecting is an edit: drop those
  equations, let their consumers read the operands instead, and append the
  operands to the outputs. Nothing is re-traced, and the edited jaxpr can be
  copied into the caller's trace whole. Returns ``None`` otherwise (reduced
  sows or sub-jaxprs with work need the interpreter).
  """
  subst: dict[_jax.Var, tp.Any] = {}
  eqns = []
  entries = []
  names = {}
  sown = []
  for eqn in jaxpr.eqns:
    p = eqn.params
    if eqn.primitive is sow_p and collectible(p):
      if accepts(
          accepts_key, p['tag'], p['reduction'], p['kind'], p['sow_name']
      ):
        if p['reduction'] is not None:  # PR: reductions
          return None
        operands = renamed(eqn.invars, subst)
        subst.update(zip(eqn.outvars, operands))
        names.setdefault(p['sow_name'], None)
        if p['kind'] == 'perturb':  # PR: perturb
          entries.append(EntrySpec.of_sow(p, 0))  # the forward marker
        if p['kind'] not in MARKER_KINDS:
          entries.append(EntrySpec.of_sow(p, len(operands)))
          sown.extend(operands)
        continue
    elif _accepted_inside(accepts_key, p):
      return None
    if subst and any(
        isinstance(v, _jax.Var) and v in subst for v in eqn.invars
    ):
      eqn = eqn.replace(invars=renamed(eqn.invars, subst))
    eqns.append(eqn)
  outvars = renamed(jaxpr.outvars, subst)
  return Edited(
      _jax.edit_jaxpr(jaxpr, eqns, [*outvars, *sown]),
      Layout(tuple(entries), (), tuple(names)),
  )


def _accepted_inside(accepts_key, params) -> bool:  # PR: toplevel
  """Whether a sub-jaxpr in ``params`` holds a sow the capture collects
  (or a marker its rules rewrite)."""
  if any(  # PR: nnx_transforms
      holds_markers(sub) for sub in _jax.jaxprs_in_params(params)
  ):
    return True
  return any(
      s.collectible and accepts(accepts_key, s.tag, s.reduction, s.kind, s.name)
      for sub in _jax.jaxprs_in_params(params)
      for s in sow_sites(sub)
  )


def rewrite_jaxpr(
    jaxpr: _jax.ClosedJaxpr,
    accepts_key: frozenset | None,
    specs: tuple[ReducedSpec, ...],
    python_folds: bool = False,
) -> tuple[_jax.ClosedJaxpr, Layout]:
  """See :meth:`Collector.rewrite`."""
  return cached(
      jaxpr,
      ('rewrite', accepts_key, specs, python_folds),
      lambda: _rewrite_jaxpr(jaxpr, accepts_key, specs, python_folds),
  )


def _rewrite_jaxpr(jaxpr, accepts_key, specs, python_folds=False):
  if not specs:  # PR: toplevel
    edited = edit_plain_sows(jaxpr.jaxpr, accepts_key)
    if edited is not None:
      return _jax.ClosedJaxpr(edited.jaxpr, jaxpr.consts), edited.layout
  num_acc = sum(len(s.avals) for s in specs)
  layout_box = []

  def rewritten(*args):
    acc_leaves, inputs = args[:num_acc], args[num_acc:]
    inner = Collector(accepts_key, python_folds)
    inner.reduced.enter(specs, acc_leaves)  # PR: reductions
    outs = eval_collecting(jaxpr.jaxpr, jaxpr.consts, inputs, inner)
    layout_box.append(inner.layout(specs))
    return [*outs, *inner.extra_outputs(specs)]

  in_avals = [a for s in specs for a in s.avals] + _jax.binder_types(jaxpr)
  new = _jax.trace_to_closed_jaxpr(rewritten, in_avals, 'capture_rewrite')
  return new, layout_box[-1]


# ----------------------------------------------------------------------------
# The generic loop.


def eval_collecting(
    jaxpr: _jax.Jaxpr,
    consts: tp.Sequence[tp.Any],
    args: tp.Sequence[tp.Any],
    collector: Collector,
) -> list[tp.Any]:
  """Evaluates ``jaxpr`` on the current trace, collecting into ``collector``."""
  return interpret(jaxpr, consts, args, collector, collect_rules, _unsupported)


def interpret(jaxpr, consts, args, handler, rules, unsupported) -> list:
  """The loop of :func:`eval_collecting` (and of ``intervene``).

  Binds every equation of ``jaxpr`` as ``jax.core.eval_jaxpr`` would, except
  that a sow goes to ``handler.on_sow(eqn, invals)`` and a higher-order
  primitive whose sub-jaxprs ``handler.has_work`` to ``rules[primitive]``
  (``unsupported(eqn, handler)`` is raised where there is none).
  """
  env: dict[_jax.Var, tp.Any] = {}

  def read(v):
    return v.val if isinstance(v, _jax.Literal) else env[v]

  env.update(zip(jaxpr.constvars, consts))
  env.update(zip(jaxpr.invars, args))
  for eqn in jaxpr.eqns:
    invals = [read(v) for v in eqn.invars]
    with _jax.equation_context(eqn) as context:
      context.enter_context(_entering(eqn))  # PR: shard_map
      if eqn.primitive is sow_p:
        outs = handler.on_sow(eqn, invals)
      else:
        subs = list(_jax.jaxprs_in_params(eqn.params))
        if subs and handler.has_work(subs):
          rule = rules.get(eqn.primitive)
          if rule is None:
            raise unsupported(eqn, handler)
          outs = rule(handler, eqn, invals)
        else:
          outs = _jax.bind_equation(eqn, invals)
    env.update(zip(eqn.outvars, outs))
  return [_jax.as_value(read(v)) for v in jaxpr.outvars]


# ----------------------------------------------------------------------------
# Which equations a ``jax.vmap`` or a differentiation applied inside the
# capture transformed.
#
# JAX stages an equation that ``jax.vmap`` batches (a batched ``shard_map``,
# or the call, loop or branch that holds one) with a ``vmap`` transform in
# its name stack, relative to the jaxpr that holds it, and one that
# ``jax.jvp``/``grad``/``linearize`` differentiates with a ``jvp`` transform;
# the jaxpr itself does not show which axis the vmap added, nor which
# equations JAX's rules bound again on tangents. ``constructs/shard_map.py``
# reads the first to refuse a plain sow in a ``shard_map`` that such a vmap
# maps over; ``constructs/linear_solve.py`` the second. The state is
# ``(mapped, differentiated, outside)``: whether an equation being
# interpreted, or one holding it, records a vmap, and a jvp; and how many
# vmap and jvp transforms the next equation records that are not the
# capture's own (the top-level equations a capture stages carry the whole
# name stack it was called in, which a ``jax.vmap`` or ``jax.grad`` around
# the capture is part of).
_TRANSFORMED = contextvars.ContextVar(  # PR: shard_map
    'flax_nnx_sow_transformed', default=(False, False, (0, 0))
)


def under_vmap() -> bool:  # PR: shard_map
  """Whether the equation being interpreted is mapped over by a
  ``jax.vmap`` that ``f`` applied inside the capture (not one around it)."""
  return _TRANSFORMED.get()[0]


def differentiated() -> bool:  # PR: linear_solve
  """Whether the equation being interpreted was differentiated by a
  ``jax.jvp``, ``grad``, ``vjp`` or ``linearize`` that ``f`` applied inside
  the capture or ``intervene`` (not one around it)."""
  return _TRANSFORMED.get()[1]


def outside_transforms() -> tuple[int, int]:  # PR: shard_map
  """How many ``vmap`` and ``jvp`` transforms the name stack records now:
  those of a capture or ``intervene`` called here are not its own."""
  stack = _jax.current_name_stack()
  return (_jax.transforms_in(stack, 'vmap'), _jax.transforms_in(stack, 'jvp'))


def top_of_capture(outside: tuple[int, int]):  # PR: shard_map
  """The context in which a capture (or ``intervene``) interprets the
  equations it staged from ``f``'s binds, which carry the name stack it was
  called in, holding ``outside`` (:func:`outside_transforms`)."""
  return _setting((False, False, outside))


def _entering(eqn):  # PR: shard_map
  """The state while ``eqn`` (and what it holds) is interpreted."""
  mapped, jvped, outside = state = _TRANSFORMED.get()
  stack = eqn.source_info.name_stack
  now = (
      mapped or _jax.transforms_in(stack, 'vmap') > outside[0],
      jvped or _jax.transforms_in(stack, 'jvp') > outside[1],
      (0, 0),
  )
  return _UNCHANGED if now == state else _setting(now)


_UNCHANGED = contextlib.nullcontext()  # PR: shard_map


@contextlib.contextmanager
def _setting(state):  # PR: shard_map
  token = _TRANSFORMED.set(state)
  try:
    yield
  finally:
    _TRANSFORMED.reset(token)


def no_rule_error(transform: str, eqn, sites) -> NotImplementedError:
  """The error for a sow inside a construct ``transform`` has no rule for.

  Args:
    transform: ``'capture'`` or ``'intervene'``.
    eqn: the equation of the construct (a higher-order primitive).
    sites: the sow sites inside it that the transform would act on.
  """
  names = sorted({repr(s.name) for s in sites})
  what, registry, fix = _NO_RULE[transform]
  return NotImplementedError(
      f'{transform}: sow {", ".join(names)}{sites[0].where} is inside'
      f' {construct_name(eqn.primitive)} (primitive `{eqn.primitive.name}`'
      f' has no {transform} rule), so {transform} cannot {what} it. {fix},'
      f' or register a rule for the primitive in {registry} (see'
      ' CONTRIBUTING.md, *Adding a construct*).'
  )


_NO_RULE = {
    'capture': (
        'collect',
        'flax.nnx.sow.collect_rules',
        'Sow the value outside that construct (return it from it and sow'
        ' the result)',
    ),
    'intervene': (  # PR: intervene
        'replace',
        'flax.nnx.sow.inject.intervene_rules',
        'Replace the value outside that construct (return it from it and'
        ' sow the result there)',
    ),
}


def _unsupported(eqn, collector) -> NotImplementedError:
  sites = collector.accepted_sites(_jax.jaxprs_in_params(eqn.params))
  return no_rule_error('capture', eqn, sites)


def is_array(x) -> bool:
  return isinstance(x, (jax.Array, np.ndarray, jax.core.Tracer)) or (
      _jax.is_ref(x)
  )
