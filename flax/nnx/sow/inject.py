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

"""The intervene transform: replace sown values (activation patching).

``intervene(f, values)`` stages ``f`` like ``capture`` does and evaluates
its jaxpr with :func:`eval_intervening`, an interpreter that binds every
equation as it was, except that an accepted sow named in ``values`` is bound
on its replacement instead of its own value (so its consumers, and any
capture around, see the replacement). It is the mirror image of the capture
rewrite: where a capture turns sows into extra *outputs* of the constructs
that hold them, intervene turns replacements into extra *inputs*: a
rewritten ``jit`` takes the entries its sows consume as arguments, a ``scan``
takes the stacked entries of its sites as extra ``xs`` (entry ``i`` of a loop
site replaces iteration ``i``), a ``cond`` passes them to every branch. A
callable replacement is applied in place, wherever the sow is.
A derivative taken inside ``f`` is traced while ``f`` is staged: the JVP
rule of a sow replaced here gives zero tangents for arrays, and for a
callable a tangent marker (transposed: a cotangent marker, see
``primitive.py``) that :meth:`Injector.on_marker` resolves with the callable
of this call.

The layout of ``values[name]`` is the layout ``capture`` returns, so
``intervene(f, collected)`` patches exactly what a capture of another run
collected. The idea is activation patching / causal tracing (Meng et al.,
2022, "Locating and Editing Factual Associations in GPT"; Vig et al., 2020);
oryx's ``plant`` is the closest prior art in JAX.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import typing as tp

import jax
import jax.numpy as jnp

from flax.nnx.sow import _jax
from flax.nnx.sow import loop_index
from flax.nnx.sow import names as names_lib
from flax.nnx.sow.capturing import capture as capture_transform
from flax.nnx.sow.capturing import check_tags
from flax.nnx.sow.primitive import accepts
from flax.nnx.sow.sites import as_jaxpr
from flax.nnx.sow.collect import cached
from flax.nnx.sow.collect import interpret
from flax.nnx.sow.collect import no_rule_error
from flax.nnx.sow.sites import counted_jaxprs  # PR: linear_solve
from flax.nnx.sow.sites import holds_markers  # PR: nnx_transforms
from flax.nnx.sow.sites import sow_sites
from flax.nnx.sow.capturing import stage
from flax.nnx.sow.sites import where
from flax.nnx.sow.collect import run_with_call_hooks
from flax.nnx.sow.primitive import DERIVATIVE_KINDS
from flax.nnx.sow.intervening import Intervening
from flax.nnx.sow.primitive import JVP_MARKER
from flax.nnx.sow.primitive import KEPT
from flax.nnx.sow.primitive import Name
from flax.nnx.sow.primitive import naming_broadcast_perturbs
from flax.nnx.sow.primitive import sow_p
from flax.nnx.sow.primitive import staging_active
from flax.nnx.sow.reductions import strong

Rule = tp.Callable[['Injector', _jax.JaxprEqn, list[tp.Any]], list[tp.Any]]

intervene_rules: dict[_jax.Primitive, Rule] = {}
"""Rules for higher-order primitives, keyed by primitive.

``rule(injector, eqn, invals) -> outvals`` binds ``eqn`` so that the sows in
its sub-jaxprs named in the injector's values return their replacements.
"""

program_checks: list[tp.Callable[[_jax.Jaxpr, tp.Callable], None]] = []  # PR: linear_solve
"""``check(jaxpr, takes)`` for each program ``intervene`` stages, before it
counts the entries each sow consumes: raises where a construct cannot
replace a sow ``takes(site)`` accepts (a refusal a rule would make only
after the counting had failed with a less precise error)."""

# A ``'kept'`` sow is replaced where it is; its ``'hoisted'`` copy is not
# (``constructs/batched.py``).
_REPLACEABLE_KINDS = ('value', 'perturb', KEPT)


# ----------------------------------------------------------------------------
# What is replaced.


@dataclasses.dataclass(frozen=True)
class Entries:
  """Array replacements of one name: ``entries[i]`` for its ``i``-th sow."""

  entries: tuple[tp.Any, ...]
  offset: int = 0  # index of ``entries[0]`` in the user's tuple
  rows: bool = False  # inside a loop: each entry is one iteration's row


def _label(name, entries: Entries, i: int) -> str:
  """How an error names ``entries.entries[i]`` of ``values[name]``."""
  label = f'values[{name!r}][{entries.offset + i}]'
  if entries.rows:  # what the user passed has one more axis per loop
    label += ' (its row for one iteration of an enclosing loop)'
  return label


def _describe(tree) -> str:
  leaves, treedef = jax.tree_util.tree_flatten(tree)
  types = ', '.join(_jax.typeof(x).str_short() for x in leaves)
  return f'{treedef} of [{types}]'


def _same_type(a, b) -> bool:
  return a.shape == b.shape and a.dtype == b.dtype


def as_replacement_leaves(tree) -> tuple[list[tp.Any], tp.Any]:
  """``tree``'s leaves converted as ``jnp.asarray`` converts them, and its
  treedef: the one conversion a replacement gets before its structure,
  shape and dtype are compared with the sown value's (so a float64 NumPy
  array becomes float32 unless ``jax_enable_x64`` is set, and an int stays
  an int)."""
  leaves, treedef = jax.tree_util.tree_flatten(tree)
  return [jax.numpy.asarray(x) for x in leaves], treedef


_TYPE_RULE = (
    ' A replacement, converted as jnp.asarray converts it (a float64 NumPy'
    ' array becomes float32 unless jax_enable_x64 is set), must have the'
    ' structure (a list is not a tuple), shape and dtype of the value it'
    ' replaces: nothing is broadcast, and nothing else is cast.'
)


# A sow in the body of a custom-derivative function that ``f`` differentiates
# does not run when the function's rule does not call it: JAX runs the rule
# instead, so no equation of the staged program holds that sow, and nothing
# can replace it (its replacement would silently not apply). A name that
# reaches fewer sows than it names is refused above; this says why.
_SKIPPED_BODY_HINT = (
    ' (A sow in the body of a `jax.custom_jvp`/`jax.custom_vjp` function'
    ' that f differentiates does not run when its jvp/fwd rule does not call'
    ' the function: JAX runs the rule instead. Differentiate outside'
    ' intervene, jax.grad(intervene(f, values)), or call the function in its'
    ' rule. A JAX hook run before a differentiating trace applies a custom'
    ' rule would let intervene reach it.)'
)


class Injector:
  """Evaluates one scope of the program with its sows replaced.

  A scope is the top-level jaxpr or a sub-jaxpr a rule rewrites. The
  injector holds the scope's replacements and how many entries it has
  handed out: ``values`` maps a name to a callable, applied to every sow of
  the name, or to its array :class:`Entries`, one per sow in call order: a
  sow here takes the next one (:meth:`replacement`), a sub-jaxpr the next
  ones its sows consume (:meth:`take`); the errors for entries that cannot
  be matched to a sow are raised here. A sow it targets is bound on its
  replacement; a sub-jaxpr is rewritten to take the array entries its sows
  consume as extra inputs (:meth:`rewrite`), and evaluated with the
  injector of its own scope (:meth:`inner`). Callables are shared by every
  scope.
  """

  def __init__(
      self,
      accepts_key,
      values: dict[Name, tp.Any],
      strict: bool,
      token: tp.Any = None,
      staging_key: Intervening | None = None,
  ):
    self.accepts_key = accepts_key
    self.values = values  # name -> callable | Entries
    self.strict = strict
    self.next: collections.Counter = collections.Counter()
    # One per intervene(...) call: rewrites that apply its callables are
    # cached for it alone (see :meth:`Injector.cached`).
    self.token = token
    # The key intervene staged ``f`` with: custom rules traced later (when
    # the intervened function is differentiated) are traced with it.
    self.staging_key = staging_key

  # -- which sows are replaced ---------------------------------------------

  def targets(self, params) -> bool:
    name, kind = params['sow_name'], params['kind']
    return (
        not params['remat_copy']
        and params.get('grad_of') is None
        and name in self.values
        and (
            kind in _REPLACEABLE_KINDS
            # A derivative marker stands for a callable's derivative.
            or (
                kind in DERIVATIVE_KINDS
                and not isinstance(self.values[name], Entries)
            )
        )
        # By tag only: the kinds are checked above (a ``'kept'`` sow, which
        # no capture accepts, is replaced here).
        and accepts(
            self.accepts_key,
            params['tag'],
            params['reduction'],
            'value',
            params['sow_name'],
        )
    )

  def has_work(self, jaxprs) -> bool:
    if any(holds_markers(as_jaxpr(j)) for j in jaxprs):  # PR: nnx_transforms
      return True
    return any(
        self.targets(s.eqn.params)
        for j in jaxprs
        for s in sow_sites(as_jaxpr(j))
    )

  def consumed(self, jaxpr: _jax.Jaxpr) -> collections.Counter:
    """How many array entries of each name one call of ``jaxpr`` consumes."""
    counts: collections.Counter = collections.Counter()
    for eqn in jaxpr.eqns:
      p = eqn.params
      if eqn.primitive is sow_p:
        if self.targets(p) and isinstance(self.values[p['sow_name']], Entries):
          counts[p['sow_name']] += 1
        continue
      subs = list(_jax.jaxprs_in_params(p))
      if not subs or not self.has_work(subs):
        continue
      if eqn.primitive in counted_jaxprs:  # PR: linear_solve
        subs = counted_jaxprs[eqn.primitive](p)  # PR: linear_solve
      if eqn.primitive is _jax.cond_p:
        counts.update(self.branch_consumed(p['branches']))
      else:
        for sub in subs:
          counts.update(self.consumed(sub))
    return counts

  def branch_consumed(self, branches) -> collections.Counter:
    """:meth:`consumed` of one ``cond``/``switch``: whichever branch runs
    must consume the same entries, or they could not be matched to sows."""
    per_branch = [self.consumed(b.jaxpr) for b in branches]
    counts: collections.Counter = collections.Counter()
    for name in set().union(*per_branch):
      ns = [c[name] for c in per_branch]
      if len(set(ns)) > 1:
        site = next(
            s for b in branches for s in sow_sites(b.jaxpr) if s.name == name
        )
        raise ValueError(
            f'intervene: sow {name!r}{site.where}: the branches of'
            f' `lax.cond`/`lax.switch` sow it {ns} times, so an entry of'
            ' values cannot be matched to a sow. Pass a callable'
            ' (values[name] = fn) instead.'
        )
      counts[name] = ns[0]
    return counts

  # -- handing entries out ---------------------------------------------------

  def replacement(self, name: Name, value, batch_dims: int):
    """What replaces the sow of ``name`` reached now, whose value is ``value``.

    Returns ``(replacement, label)``, ``label`` naming it for errors, or
    ``None`` where the entries of ``name`` have run out (``strict=False``:
    the sow keeps its value).
    """
    v = self.values[name]
    if not isinstance(v, Entries):
      return _apply(v, value, batch_dims, name), f'values[{name!r}](value)'
    i = self.next[name]
    self.next[name] += 1
    if i >= len(v.entries):
      if self.strict:
        raise self._count_error(name, i + 1)
      return None
    return v.entries[i], _label(name, v, i)

  def take(self, counts: collections.Counter, length: int | None = None):
    """The next ``counts[name]`` entries of each name, for a sub-jaxpr.

    Returns ``(leaves, spec)``: the entries' leaves (to pass as extra
    operands) and, per name, ``(offset, treedefs)`` to rebuild them inside.
    ``length``: the sub-jaxpr is a loop body; every entry is stacked over
    the loop and must have that leading axis.
    """
    leaves, spec = [], []
    for name, n in counts.items():
      if not n:
        continue
      ent: Entries = self.values[name]
      start = self.next[name]
      self.next[name] += n
      stop = min(start + n, len(ent.entries))
      if stop - start < n and self.strict:
        raise self._count_error(name, start + n)
      treedefs = []
      for i in range(start, stop):
        entry_leaves, treedef = as_replacement_leaves(ent.entries[i])
        if length is not None:
          for x in entry_leaves:
            if not x.shape or x.shape[0] != length:
              raise ValueError(
                  f'intervene: {_label(name, ent, i)} replaces a'
                  f' sow inside a loop of {length} iterations, so each leaf'
                  f' needs a leading axis of {length} (entry j replaces'
                  f' iteration j, as capture stacks them); got'
                  f' {_describe(ent.entries[i])}.'
              )
        leaves.extend(entry_leaves)
        treedefs.append((treedef, len(entry_leaves)))
      rows = ent.rows or length is not None
      spec.append((name, ent.offset + start, tuple(treedefs), rows))
    return leaves, tuple(spec)

  def _count_error(self, name, reached) -> ValueError:
    ent = self.values[name]
    return ValueError(
        f'intervene: values[{name!r}] has {len(ent.entries) + ent.offset}'
        f' entries, but the program sows {name!r} at least'
        f' {reached + ent.offset} times (one entry per sow executed at top'
        ' level, one stacked entry per sow site inside a loop, as capture'
        ' returns them). Pass a tuple of that length, or a callable.'
    )

  # -- the checks of the whole program ---------------------------------------

  def check_sites(self, jaxpr: _jax.Jaxpr) -> None:
    """Checks before anything runs: no reduced name is replaced; with
    ``strict``, every name is sown somewhere in the program."""
    refuse_gradient_names(jaxpr, self.values)
    sites = [s for s in sow_sites(jaxpr) if self.targets(s.eqn.params)]
    for s in sites:
      if s.reduction is not None:
        raise ValueError(
            f'intervene: sow {s.name!r}{s.where} is reduced (reduce_fn/'
            'init_fn): its sites fold into one accumulator, so there is no'
            ' value to replace. Replace the values it reduces (sow them'
            ' under another name), or drop the name from values.'
        )
    if not self.strict:
      return
    sown = {s.name for s in sites}
    unused = [n for n in self.values if n not in sown]
    if unused:
      raise ValueError(
          f'intervene: no sow that this intervene accepts is named'
          f' {", ".join(map(repr, unused))}.'
          f'{names_lib.did_you_mean(unused[0], self._sown_names(jaxpr))}'
          ' Check the names (capture(f) returns them) and tags, or pass'
          ' strict=False to ignore names the program does not sow. (A sow'
          ' that a capture inside f collects is gone before intervene sees'
          ' it: write capture(intervene(g, values)) instead.)'
          f'{_SKIPPED_BODY_HINT}'
      )

  def _sown_names(self, jaxpr: _jax.Jaxpr) -> list[Name]:
    """The names of the sows this intervene's tags accept, in order."""
    return [s.name for s in replaceable_sites(jaxpr, self.accepts_key)]

  def finish(self) -> None:
    """The count check of ``strict=True`` once the whole program has run."""
    if not self.strict:
      return
    for name, v in self.values.items():
      if isinstance(v, Entries) and self.next[name] != len(v.entries):
        raise ValueError(
            f'intervene: values[{name!r}] has {len(v.entries)} entries, but'
            f' the program sows {name!r} {self.next[name]} times (one entry'
            ' per sow executed at top level, one stacked entry per sow site'
            ' inside a loop, as capture returns them). Pass a tuple of that'
            ' length, or strict=False.'
            f'{_SKIPPED_BODY_HINT}'
        )


# ----------------------------------------------------------------------------
# A scope evaluated with them.

  # -- sub-jaxprs ------------------------------------------------------------

  def check_unbatched_loop(self, jaxpr: _jax.Jaxpr, construct: str) -> None:
    """Array entries cannot replace a sow in a loop under ``jax.vmap``.

    Its value carries the mapped axes inside the loop, but whether
    ``capture`` stacks it ``(steps, batch, ...)`` (a vmap inside the body)
    or ``(batch, steps, ...)`` (a vmap around the loop) is not in the body.
    """
    for s in sow_sites(jaxpr):
      p = s.eqn.params
      if (
          self.targets(p)
          and isinstance(self.values[s.name], Entries)
          and p['batch_dims']
      ):
        if _jax.traced_under_lax_map_batch(s.eqn.source_info):
          raise ValueError(
              f'intervene: sow {s.name!r}{s.where} is inside'
              ' `lax.map(..., batch_size=...)`, which scans over batches of'
              ' the mapped function under `jax.vmap`; capture returns its'
              ' values as an entry (n_batches, batch_size, ...), then one'
              ' (n % batch_size, ...) for the remainder, and intervene cannot'
              ' lay an array replacement out over that. Pass a callable'
              ' (values[name] = fn, applied per example), or drop batch_size'
              ' (one entry stacked (n, ...), which intervene accepts).'
          )
        raise ValueError(
            f'intervene: sow {s.name!r}{s.where} is inside {construct}'
            ' under `jax.vmap`, or has a `jax.vmap` around it inside the'
            ' loop body: the two look the same in the staged program, and'
            ' their captured layouts differ ((batch, steps, ...) and'
            ' (steps, batch, ...)), so an array replacement cannot be laid'
            ' out unambiguously. Pass a callable (values[name] = fn, applied'
            ' per example and iteration), or put the vmap around intervene.'
        )

  def inner(self, spec, leaves) -> Injector:
    """The injector of a sub-jaxpr given the entries ``take`` handed it."""
    values = self._callables()
    pos = 0
    for name, offset, treedefs, rows in spec:
      entries = []
      for treedef, n in treedefs:
        entries.append(
            jax.tree_util.tree_unflatten(treedef, leaves[pos : pos + n])
        )
        pos += n
      values[name] = Entries(tuple(entries), offset, rows)
    # Names whose entries this scope does not get are not replaced in it.
    return Injector(
        self.accepts_key, values, self.strict, self.token, self.staging_key
    )

  def with_callables_only(self) -> Injector:
    """An injector that applies this one's callables and nothing else."""
    return Injector(
        self.accepts_key, self._callables(), False, self.token,
        self.staging_key,
    )

  def _callables(self) -> dict[Name, tp.Any]:
    """The names replaced by callables, with their callables."""
    return {
        n: v
        for n, v in self.values.items()
        if not isinstance(v, Entries)
    }

  def fns_in(self, jaxpr: _jax.Jaxpr) -> tuple[tuple[Name, tp.Any], ...]:
    """The callables of the names ``jaxpr`` sows."""
    sown = {s.name for s in sow_sites(jaxpr)}
    return tuple((n, v) for n, v in self._callables().items() if n in sown)

  def cached(self, source, key, build, loop=None):
    """``collect.cached(source, key, build)`` for a rewrite by this injector.

    A callable is traced into the rewritten jaxpr, with whatever it reads
    then (a global, an attribute, a closed-over list). So a rewrite that
    applies callables (those of the names ``source`` sows) is cached for
    one ``intervene(...)`` call (its ``token``) only: calling the same
    ``g`` again reuses it, as ``jax.jit`` reuses a trace, while a new
    ``intervene(f, {'h': steer})`` traces ``steer`` again. The entry is
    dropped when ``g`` is collected, so a sweep over many ``intervene``
    calls does not accumulate entries (or the tracers a lambda closes
    over). A rewrite whose callables read the index of an enclosing loop
    body (``loop_indices()``; ``loop`` is the loop this rewrite is the body
    of) closes over a tracer of that body's trace, and is not cached.
    """
    fns = self.fns_in(as_jaxpr(source))
    if not fns:
      return cached(source, key, build)
    key = (*key, tuple(name for name, _ in fns))
    before = loop_index.outer_reads(loop)
    return cached(
        source,
        key,
        build,
        owner=self.token,
        keep=lambda: loop_index.outer_reads(loop) == before,
    )

  def rewrite(
      self,
      closed: _jax.ClosedJaxpr,
      spec,
      rep_avals: tp.Sequence[tp.Any],
      loop: loop_index.Frame | None = None,
  ) -> _jax.ClosedJaxpr:
    """``closed`` taking the replacement leaves as trailing inputs, with its
    sows replaced (cached per jaxpr, replacement layout and callables).

    With ``loop``, the body of that loop: it takes one more trailing input,
    the iteration's row index, which ``loop_indices()`` returns there.
    """
    key = (
        'intervene',
        self.accepts_key,
        self.strict,
        spec,
        tuple(rep_avals),
        staging_active(),
        loop is not None,
    )
    index_avals = [] if loop is None else [_jax.ShapedArray((), jnp.int32)]

    def build():
      n_in, n_reps = len(closed.in_avals), len(rep_avals)

      def fn(*args):
        inner = self.inner(spec, args[n_in : n_in + n_reps])
        with loop_index.providing(loop, *args[n_in + n_reps :]):
          return eval_intervening(
              closed.jaxpr, closed.consts, args[:n_in], inner
          )

      return _jax.trace_to_closed_jaxpr(
          fn,
          [*_jax.binder_types(closed), *rep_avals, *index_avals],
          'intervene_rewrite',
      )

    return self.cached(closed, key, build, loop)

  # -- the sow --------------------------------------------------------------

  def on_sow(self, eqn: _jax.JaxprEqn, invals: list[tp.Any]) -> list[tp.Any]:
    p = eqn.params
    if p['kind'] in DERIVATIVE_KINDS:
      if not self.targets(p):  # another intervene's (effect-free as it is)
        return _jax.bind_equation(eqn, invals)
      return self.on_marker(eqn, invals)
    rebind = eqn.replace(params=dict(p, effect=staging_active()))
    if not self.targets(p):
      return _jax.bind_equation(rebind, invals)
    name = p['sow_name']
    n = len(invals) - p['n_closure']
    leaves, closure = list(invals[:n]), list(invals[n:])
    value = jax.tree_util.tree_unflatten(p['treedef'], leaves)
    found = self.replacement(name, value, p['batch_dims'])
    if found is None:  # past the last entry, with strict=False
      if p.get('zero_tangent'):
        raise ValueError(
            f'intervene: sow {name!r}{where(eqn)} is differentiated inside'
            f' the intervened function, and values[{name!r}] (strict=False)'
            ' has no entry left for it, so it keeps its value, while its'
            ' derivative was taken to be that of a constant replacement.'
            ' Pass an entry for every sow of the name, or a callable.'
        )
      return _jax.bind_equation(rebind, invals)
    new, label = found
    new_leaves, new_treedef = as_replacement_leaves(new)
    if new_treedef != p['treedef'] or not all(
        _same_type(_jax.typeof(a), _jax.typeof(b))
        for a, b in zip(new_leaves, leaves)
    ):
      got = jax.tree_util.tree_unflatten(new_treedef, new_leaves)
      raise ValueError(
          f'intervene: sow {name!r}{where(eqn)}: {label} is'
          f' {_describe(got)}, but the sown value is {_describe(value)}.'
          + _TYPE_RULE
      )
    # A weakly typed replacement (``jnp.full(3, 5.0)``) takes the sown
    # value's strong type, so what it flows into is typed as in ``f``.
    new_leaves = [
        strong(x) if not _jax.typeof(a).weak_type else x
        for x, a in zip(new_leaves, leaves)
    ]
    # Inside shard_map, a replacement varies over the mesh axes the value
    # did (a constant steering vector added per shard, say).
    new_leaves = [_jax.vary_like(x, a) for x, a in zip(new_leaves, leaves)]
    return _jax.bind_equation(rebind, [*new_leaves, *closure])


  def on_marker(self, eqn: _jax.JaxprEqn, invals: list[tp.Any]) -> list:
    """A derivative marker: the tangent (``'jvp'``) or cotangent (``'vjp'``)
    of this call's callable at the sown value, which it applies exactly as
    :meth:`on_sow` does (vmapped over the sow's ``batch_dims``)."""
    p = eqn.params
    fn = self.values[p['sow_name']]
    n = len(invals) - p['n_closure']
    linear = jax.tree_util.tree_unflatten(p['treedef'], invals[:n])
    value = jax.tree_util.tree_unflatten(p['treedef'], invals[n:])
    fn_applied = functools.partial(
        _apply, fn, batch_dims=p['batch_dims'], name=p['sow_name']
    )
    if p['kind'] == JVP_MARKER:
      out = jax.jvp(fn_applied, (value,), (linear,))[1]
    else:
      out = jax.vjp(fn_applied, value)[1](linear)[0]
    out_leaves, out_treedef = jax.tree_util.tree_flatten(out)
    if out_treedef != p['treedef']:
      raise ValueError(
          f'intervene: sow {p["sow_name"]!r}{where(eqn)}:'
          f' values[{p["sow_name"]!r}]'
          f'(value) is {_describe(fn_applied(value))}, but the sown value is'
          f' {_describe(value)}. A replacement must have the structure,'
          ' shape and dtype of the value it replaces.'
      )
    # Typed as the marker's own results, as ``on_sow`` types a replacement.
    return [
        _jax.vary_like(strong(x) if not _jax.typeof(a).weak_type else x, a)
        for x, a in zip(out_leaves, invals[:n])
    ]


def _apply(fn, value, batch_dims: int, name: Name):
  """``fn`` applied to one example's value (``vmap``-ed over batch axes)."""
  for _ in range(batch_dims):
    fn = jax.vmap(fn)
  with loop_index.applying(repr(name)):
    return fn(value)


# ----------------------------------------------------------------------------
# The generic loop.


def eval_intervening(
    jaxpr: _jax.Jaxpr,
    consts: tp.Sequence[tp.Any],
    args: tp.Sequence[tp.Any],
    injector: Injector,
) -> list[tp.Any]:
  """Evaluates ``jaxpr`` on the current trace with sows replaced."""
  return interpret(jaxpr, consts, args, injector, intervene_rules, _unsupported)


def _unsupported(eqn, injector) -> NotImplementedError:
  sites = [
      s
      for sub in _jax.jaxprs_in_params(eqn.params)
      for s in sow_sites(sub)
      if injector.targets(s.eqn.params)
  ]
  return no_rule_error('intervene', eqn, sites)


# ----------------------------------------------------------------------------
# Rules. Each passes the array entries its sub-jaxprs consume as extra
# trailing operands.


def one_scope(injector, closed):
  """``closed`` rewritten as a scope of its own: ``(new, leaves, spec)``,
  ``leaves`` the array entries its sows consume (``new`` takes them as
  trailing inputs) and ``spec`` their layout (for :meth:`Injector.inner`)."""
  leaves, spec = injector.take(injector.consumed(closed.jaxpr))
  avals = [_jax.typeof(x) for x in leaves]
  return injector.rewrite(closed, spec, avals), leaves, spec


def one_body(injector, closed, *, length=None):
  if length is None:
    new, leaves, _ = one_scope(injector, closed)
    return new, leaves
  injector.check_unbatched_loop(closed.jaxpr, '`lax.scan`')
  counts = injector.consumed(closed.jaxpr)
  leaves, spec = injector.take(counts, length)
  avals = [_jax.typeof(x) for x in leaves]
  # A loop body: the row index joins the trailing xs where a callable asks.
  avals = [_jax.ShapedArray(a.shape[1:], a.dtype) for a in avals]
  new, index = loop_index.with_index(
      length, lambda loop: injector.rewrite(closed, spec, avals, loop)
  )
  return new, leaves if index is None else [*leaves, index]


# ----------------------------------------------------------------------------
# The transform.


def _normalize(values) -> dict[Name, tp.Any]:
  cotangents = [n for n in getattr(values, 'cotangents', ()) if n in values]
  if cotangents:
    raise ValueError(
        f'intervene: values[{cotangents[0]!r}] holds the cotangents that'
        ' capture collected for a perturb (gradients, not values), so'
        ' patching them in would replace the perturbed value with its'
        ' gradient. Drop those names: {k: v for k, v in collected.items()'
        ' if k not in collected.cotangents}.'
    )
  if not isinstance(values, tp.Mapping):
    raise TypeError(
        'intervene: values must be a mapping from sow name to a tuple of'
        ' replacements (the layout capture returns) or a callable, got'
        f' {type(values).__name__}.'
    )
  out = {}
  for name, v in values.items():
    if callable(v) and not isinstance(v, jax.Array):
      out[name] = v
    elif isinstance(v, (tuple, list)):
      out[name] = Entries(tuple(v))
    else:
      raise TypeError(
          f'intervene: values[{name!r}] must be a tuple (or a list) with one'
          ' replacement per sow (as capture returns it: wrap a single value'
          ' as (value,)) or a callable fn(value) -> value, got'
          f' {type(v).__name__}.'
      )
  return out


values_converters: list[tp.Callable[[tp.Any], tp.Any]] = []
"""Converters of other forms of ``values`` to a name-keyed mapping.

``convert(values) -> mapping | None``: the first that returns a mapping wins.
The NNX layer registers one for the path-keyed ``nnx.State`` that
``nnx.capture`` returns (``nnx/state.py``); the core knows nothing of NNX.
"""


def _converted(values):
  for convert in values_converters:
    out = convert(values)
    if out is not None:
      return out
  return values


def intervene(
    f: tp.Callable[..., tp.Any],
    values: tp.Mapping[Name, tp.Any] | tp.Callable[[Name, tp.Any], tp.Any],
    *,
    tags: tp.Iterable[tp.Hashable] | None = None,
    names: tp.Iterable[Name] | tp.Callable[[Name], bool] | None = None,
    strict: bool = True,
) -> tp.Callable[..., tp.Any]:
  """Transforms ``f`` so that named sows return replacements.

  ``intervene(f, values)(*args, **kwargs)`` is ``f(*args, **kwargs)``,
  except that every sow accepted by ``tags`` whose name is a key of
  ``values`` returns its replacement instead of its own value; whatever
  consumes the sown value (and any ``capture`` around) sees the
  replacement. This is activation patching (Vig et al., 2020; Meng et al.,
  2022) as a function transform.

  >>> import jax.numpy as jnp
  >>> from flax.nnx.sow import capture, intervene, sow
  >>> def f(x):
  ...   h = sow(x * 2, name='h')
  ...   return h + 1
  >>> intervene(f, {'h': (jnp.float32(10.0),)})(jnp.float32(1.0))
  Array(11., dtype=float32)
  >>> intervene(f, {'h': lambda h: -h})(jnp.float32(1.0))
  Array(-1., dtype=float32)

  Args:
    f: the function; it may close over arrays and tracers.
    values: a mapping from sow name to either a tuple in the layout
      ``capture`` returns for that name (one entry per sow executed at top
      level, one entry stacked along a new leading axis per sow site inside
      ``lax.scan``/``fori_loop``/``lax.map``, entry ``i`` replacing iteration
      ``i``; values sown under ``jax.vmap`` with the mapped axis first), or
      a callable ``fn(value) -> value`` applied to every sown value of the
      name (per example under ``vmap``, per iteration in loops). A list
      of entries is read as the tuple. Each replacement is converted as
      ``jnp.asarray`` converts it (under the default ``jax_enable_x64=False``
      a float64 NumPy array becomes float32), and must then have the sown
      value's pytree structure (a list is not a tuple), shape and dtype
      exactly. A ``perturb`` name can be replaced (the primal value is). A
      path-keyed ``nnx.State`` as ``nnx.capture`` returns is accepted too.
      Or a hook ``hook(name, value) -> value``, called for every sow that
      ``names`` selects with the sow's name (so one hook can tell layer and
      position from it), as a callable in ``values`` is.
    tags: ``None`` to replace sows of any tag, or an iterable of tags.
    names: with a hook only: ``None`` (every accepted sow that is not
      reduced), an iterable of names (exact match), or a predicate
      ``name -> bool`` (which also passes over reduced names), as
      ``capture(names=...)`` selects.
    strict: reject names that no accepted sow uses (in ``values`` or an
      iterable ``names``; the error lists the closest names the program
      sows) and tuples whose length is not the number of sows of their
      name.

  Returns:
    ``g`` with ``g(*args, **kwargs)`` returning what ``f`` returns.
    Differentiable with respect to ``values``: the gradient at a replaced
    entry is the partial derivative with the other replaced entries held
    fixed; it equals the cotangent ``perturb`` collects at that sow (the
    total derivative, which attribution patching uses) where the replaced
    sites do not feed each other. A
    derivative taken inside ``f`` is that of the replaced program (an array
    replacement is a constant; a callable contributes its derivative).

  Raises:
    ValueError: a replacement whose structure, shape or dtype (after that
      conversion) differs from the sown value; a reduced name; with
      ``strict``, an unknown name or a wrong number of entries; an array
      replacement for a sow inside ``lax.while_loop`` (pass a callable);
      with ``strict=False``, a sow differentiated inside ``f`` that its
      entries do not reach; a key (or a ``names=`` entry) that is the
      gradient name of a ``sow(..., grad=True)`` (it holds cotangents:
      replace the sow's own name; a hook never sees it).
    TypeError: ``values`` or one of its entries of the wrong type, or
      ``names`` with a mapping of values.
    NotImplementedError: a replaced sow inside a construct with no
      intervene rule (e.g. ``shard_map``); a second derivative, or
      ``jax.experimental.jet``, inside ``f`` through a callable
      replacement.
  """
  if not callable(f):
    raise TypeError(
        f'intervene: f must be callable, got {f!r} of type'
        f' {type(f).__name__}.'
    )
  accepts_key = check_tags(tags, 'intervene')

  inner = getattr(f, '_sow_captured', None)
  if inner is not None and getattr(f, '__wrapped__', None) is not inner[0]:
    # Not capture's own function but one that copied its attributes (a
    # functools.wraps decorator, jax.jit): intervene on it as it is.
    inner = None
  if names is not None and not (callable(values) and not isinstance(
      values, tp.Mapping)):
    raise TypeError(
        'intervene: names= selects the sows of a hook, intervene(f,'
        ' hook, names=...) with hook(name, value) -> value; with a mapping'
        ' of values, its keys are the names.'
    )
  if inner is None:
    if callable(values) and not isinstance(values, tp.Mapping):
      values = _hook(values, names)
    else:
      values = _normalize(_converted(values))
  else:
    # intervene(capture(g), v) is capture(intervene(g, v)): the capture
    # collects the replaced values.
    g, capture_tags, capture_names = inner
    return capture_transform(
        intervene(g, values, tags=tags, names=names, strict=strict),
        tags=capture_tags,
        names=capture_names,
    )

  token = _Token()

  @functools.wraps(f)
  def intervened(*args, **kwargs):
    out, _ = run_with_call_hooks(
        lambda pure_f, a, kw: (
            _stage_and_intervene(
                pure_f, accepts_key, values, strict, token, a, kw
            ),
            None,
        ),
        f,
        args,
        kwargs,
        # intervene collects nothing: a Module.sow inside is named here but
        # recorded by an enclosing capture that accepts it (nnx.capture).
        tags=(),
        in_place=False,
    )
    return out

  return intervened


def replaceable_sites(jaxpr: _jax.Jaxpr, accepts_key) -> list:
  """The sow sites under ``jaxpr`` that an intervene with ``accepts_key``
  (its tags) could replace, whatever their name, in program order."""
  return [
      s
      for s in sow_sites(jaxpr)
      if not s.eqn.params['remat_copy']
      and s.eqn.params.get('grad_of') is None
      and s.eqn.params['kind'] in _REPLACEABLE_KINDS
      and accepts(accepts_key, s.eqn.params['tag'], None, 'value', s.name)
  ]


def refuse_gradient_names(
    jaxpr: _jax.Jaxpr, names: tp.Container, what: str = 'values has'
) -> None:
  """Raises if ``names`` holds the gradient name of a ``sow(...,
  grad=True)`` in ``jaxpr``.

  That name holds the cotangent at the sow, not a value: its marker passes
  the sow's value through, so replacing it would silently replace the sown
  value under another name (a capture's gradient entries patched in as
  values). Hooks selected by a predicate skip such markers.

  Raises:
    ValueError: naming the gradient name and the sow to replace instead.
  """
  for s in sow_sites(jaxpr):
    of = s.eqn.params.get('grad_of')
    if of is not None and s.name in names:
      raise ValueError(
          f'intervene: {what} {s.name!r}, the name under which'
          f' sow(..., name={of!r}, grad=True){s.where} collects the gradient at'
          ' that sow: it holds cotangents, not values, so there is nothing of'
          f' its own to replace. To replace the sown value, use {of!r}'
          ' (capture returns its values under that name); drop'
          f' {s.name!r}.'
      )


@dataclasses.dataclass(frozen=True)
class Hook:
  """``intervene(f, hook, names=...)``: one ``hook(name, value)`` for every
  selected sow; the names are chosen once the program is staged."""

  fn: tp.Callable[[Name, tp.Any], tp.Any]
  names: frozenset | tp.Callable[[Name], bool] | None

  def per_name(self, jaxpr, accepts_key, strict: bool) -> dict[Name, tp.Any]:
    """One callable per selected name the program sows (not reduced)."""
    sites = replaceable_sites(jaxpr, accepts_key)
    sown = list(dict.fromkeys(s.name for s in sites))
    if isinstance(self.names, frozenset):
      refuse_gradient_names(jaxpr, self.names, 'names= lists')
      chosen = self._listed(sown, strict)
    else:
      # A predicate selects silently; reduced names have no value to hook.
      reduced = {s.name for s in sites if s.reduction is not None}
      chosen = [
          n
          for n in sown
          if n not in reduced and (self.names is None or self.names(n))
      ]
    return {n: functools.partial(self.fn, n) for n in chosen}

  def _listed(self, sown: list[Name], strict: bool) -> list[Name]:
    """The listed names, in program order; with ``strict``, every one."""
    missing = [n for n in self.names if n not in sown]
    if missing and strict:
      raise ValueError(
          f'intervene: names= lists {missing[0]!r}, which no sow that this'
          ' intervene accepts uses.'
          f'{names_lib.did_you_mean(missing[0], sown)} Check the names'
          ' (capture(f) returns them), or pass strict=False.'
      )
    return [n for n in sown if n in self.names]


def _hook(values, names_) -> Hook:
  if isinstance(names_, str) or not (
      names_ is None or callable(names_) or isinstance(names_, tp.Iterable)
  ):
    raise TypeError(
        'intervene: names= is an iterable of sow names (wrap one name in a'
        ' list: names=[name]) or a predicate name -> bool, got'
        f' {names_!r}.'
    )
  if names_ is not None and not callable(names_):
    names_ = frozenset(names_)
  return Hook(values, names_)


def _unmapped_output_error(names) -> ValueError:
  names = ', '.join(repr(n) for n in dict.fromkeys(names))
  return ValueError(
      f'intervene: sow {names} sits in a `jax.vmap` over which its value'
      ' does not vary, and values[...] replaces it by arrays, which carry'
      " the vmap's axis (the layout capture returns: one replacement per"
      ' example), so what the replacement flows into is batched too; that'
      ' vmap returns it with out_axes=None, which a batched output cannot'
      ' have (`jax.jacfwd` and `jax.hessian` map their basis so). Pass a'
      ' callable (values[name] = lambda v: replacement), which keeps the'
      ' value unmapped, or apply that transform outside the intervened'
      ' function (jax.jacfwd(intervene(f, values)) is exact).'
  )


class _Token:
  """Identifies one ``intervene(...)`` call (see :meth:`Injector.cached`)."""

  __slots__ = ('__weakref__',)


def _stage_and_intervene(f, accepts_key, values, strict, token, args, kwargs):
  if isinstance(values, Hook):
    key = Intervening(None, frozenset(), accepts_key)
  else:
    key = Intervening(
        frozenset(values),
        frozenset(n for n, v in values.items() if isinstance(v, Entries)),
        accepts_key,
    )
  try:
    staged = naming_broadcast_perturbs(stage)(f, key, args, kwargs)
  except ValueError as e:
    if key.batched_arrays and 'but output was batched' in str(e):
      raise _unmapped_output_error(key.batched_arrays) from e
    raise
  if isinstance(values, Hook):
    values = values.per_name(staged.closed.jaxpr, accepts_key, strict)
  injector = Injector(accepts_key, values, strict, token, key)
  closed = staged.closed
  for check in program_checks:  # PR: linear_solve
    check(closed.jaxpr, lambda s: injector.targets(s.eqn.params))
  injector.check_sites(closed.jaxpr)
  outs = eval_intervening(closed.jaxpr, closed.consts, staged.arrays, injector)
  injector.finish()
  return staged.output(outs)
