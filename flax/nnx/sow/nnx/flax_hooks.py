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

"""The only file that replaces Flax objects: the Flax hook inventory.

The NNX counterpart of ``_jax_patches.py``. Each entry of :data:`INVENTORY`
names the Flax attributes replaced, the file of the NNX layer that provides
the replacement, why, the Flax versions it was checked against, and the
public hook Flax would add so that the entry can go. The owning files
:func:`register` their replacement at import; :func:`install` puts every
registered one in place, in the order of the inventory, and
:func:`uninstall` restores Flax's originals (both idempotent and
thread-safe; ``nnx_shims.install()``/``uninstall()`` call them), with the
mechanism of every inventory of the package (``inventory.Inventory``).

One entry is per call, not installed: ``nnx.capture(method_outputs=T)``
wraps the public methods of the Module classes it runs, for the duration of
that call only (:func:`wrap_methods`, :func:`unwrap_methods`, counted so
that nested and concurrent calls restore the originals once).
"""

from __future__ import annotations

import dataclasses
import functools  # PR: nnx_transforms
import typing as tp

from flax import nnx

# Flax internals replaced here (adapt here for a new Flax release).
from flax.nnx import extract as _extract  # PR: nnx_transforms
from flax.nnx import graphlib as _graphlib  # PR: nnx_transforms
from flax.nnx import module as _module_lib
from flax.nnx import tracers as _tracers
from flax.nnx.nn import attention as _attention_lib  # PR: nnx_functional
from flax.nnx.transforms import iteration as _iteration  # PR: nnx_transforms

from flax.nnx.sow import inventory

FLAX_VERSIONS = 'flax 0.12.8 (flax>=0.12.8,<0.13 in pyproject.toml)'


@dataclasses.dataclass(frozen=True)
class Hook:
  """One replaced Flax object.

  Attributes:
    name: the key its owner registers the replacement under.
    targets: ``(object, attribute)`` pairs that get the replacement (a
      function Flax re-exports is replaced where each caller looks it up).
    target: the replaced object, as a reader finds it in Flax.
    owner: the file of the NNX layer that provides the replacement.
    reason: why it is replaced.
    flax_hook: the public hook Flax would add to make it unnecessary.
    wraps: whether the replacement is ``wrapper(original, *args,
      **kwargs)`` (``False``: it is the new attribute itself).
    per_call: set for entries applied around one call, not installed.
    flax_versions: the Flax versions the entry was checked against.
  """

  name: str
  targets: tuple[tuple[tp.Any, str], ...]
  target: str
  owner: str
  reason: str
  flax_hook: str
  wraps: bool = False
  per_call: bool = False
  flax_versions: str = FLAX_VERSIONS


_CORE_API = (
    '`Module.sow`, `Module.perturb` and `nnx.capture` written in'
    ' flax/nnx/module.py on the core (`flax.nnx.sow.sow`/`perturb`/'
    '`capture`): no install step, no `__captures__` attribute machinery.'
)
_SPLIT_MERGE_OBSERVER = (  # PR: nnx_transforms
    'A public observer on graph split/merge (`graphlib` calling registered'
    ' callbacks with `(node, graphdef)` after `flatten` and `(graphdef,'
    ' node)` after `unflatten`, or `_graph_unflatten` recording inner ->'
    ' path), which also covers the transforms built on them.'
)
_TREE_MODE_OBSERVER = (  # PR: nnx_transforms
    'The same observer, called by tree-mode transforms with the arguments'
    ' they received and the copies their function gets (pairs by pytree'
    ' position).'
)

INVENTORY: tuple[Hook, ...] = (
    Hook(
        'module_sow',
        ((_module_lib.Module, 'sow'),),
        'flax.nnx.Module.sow',
        'shims.py',
        'Inside a capture a sow is a `sow` named by the module path and'
        ' tagged by the Variable type, with no attribute added to the'
        ' module; outside it keeps the legacy attribute.',
        _CORE_API,
    ),
    Hook(
        'module_perturb',
        ((_module_lib.Module, 'perturb'),),
        'flax.nnx.Module.perturb',
        'shims.py',
        'As for module_sow, emitting a `perturb`.',
        _CORE_API,
    ),
    Hook(
        'capture',
        ((_module_lib, 'capture'), (nnx, 'capture')),
        'flax.nnx.capture (flax.nnx.module.capture)',
        'shims.py',
        'Flax returns intermediates through `__captures__` attributes set on'
        ' every module during the call; the shim builds the same State from'
        ' what `capture` returns.',
        _CORE_API,
    ),
    Hook(
        'trace_state',
        ((_tracers, 'current_jax_trace'),),
        'flax.nnx.tracers.current_jax_trace (the trace a Variable or'
        ' Module records, and may be updated under)',
        'shims.py',
        'A capture runs `f` under a trace of its own that forwards every'
        ' value to the trace it was called in; a Variable made outside the'
        ' capture must stay updatable inside it, as without the capture'
        " (BatchNorm statistics, RNG counts), so NNX sees the capture's"
        ' parent trace.',
        'NNX asking JAX for the trace state with traces that only forward'
        ' (and so do not own the values) looked through: a'
        ' `jax.extend.core.get_opaque_trace_state` that skips traces marked'
        ' as forwarding, or a Flax-side registry of such trace types.',
    ),
    Hook(  # PR: nnx_transforms
        'graph_flatten',
        ((_graphlib, 'flatten'), (nnx, 'flatten')),
        'flax.nnx.graphlib.flatten (nnx.split, graph-mode transforms)',
        'scope.py',
        'Records which object each graphdef split inside a capture came'
        ' from, so the objects merged from it keep its paths.',
        _SPLIT_MERGE_OBSERVER,
        wraps=True,
    ),
    Hook(  # PR: nnx_transforms
        'graph_unflatten',
        ((_graphlib, 'unflatten'), (nnx, 'unflatten')),
        'flax.nnx.graphlib.unflatten (nnx.merge, graph-mode transforms)',
        'scope.py',
        'Gives an object merged inside a capture the paths of the object'
        ' its graphdef was split from.',
        _SPLIT_MERGE_OBSERVER,
        wraps=True,
    ),
    *(  # PR: nnx_transforms
        Hook(
            f'graphdef_{method}',
            ((_graphlib.GraphDef, method),),
            f'flax.nnx.graphlib.GraphDef.{method} (nnx.fori_loop,'
            ' nnx.while_loop, nnx.grad)',
            'scope.py',
            'These transforms merge from a copy of a graphdef with its outer'
            ' index changed: the copy is recorded as split from the object the'
            ' graphdef was split from, so the merged objects keep its paths.',
            _SPLIT_MERGE_OBSERVER,
            wraps=True,
        )
        for method in (
            'with_no_outer_index',
            'with_same_outer_index',
            'with_matching_outer_index',
        )
    ),
    Hook(  # PR: nnx_transforms
        'check_no_aliases',
        ((_extract, 'check_no_aliases'),),
        'flax.nnx.extract.check_no_aliases',
        'scope.py',
        'A tree-mode transform (`graph=False`) calls it with the arguments'
        ' it received: they are remembered by position.',
        _TREE_MODE_OBSERVER,
        wraps=True,
    ),
    Hook(  # PR: nnx_transforms
        'snapshot',
        ((_extract, 'snapshot'),),
        'flax.nnx.extract.snapshot',
        'scope.py',
        'Inside a tree-mode transform it gets the copies its function'
        ' receives: each is given the path of the argument at its place.',
        _TREE_MODE_OBSERVER,
        wraps=True,
    ),
    *(  # PR: nnx_transforms
        Hook(
            name,
            ((cls, '__call__'),),
            f'flax.nnx.transforms.iteration.{cls.__name__}.__call__ (the'
            f' body of {transform})',
            'slices.py',
            'Flax keeps what a capture collects in the module state, so a'
            ' module the transform slices has one accumulator per slice: the'
            ' body runs in a capture that folds the reduced sows of such'
            ' modules one iteration at a time, and sows the accumulators'
            ' again for the transform to stack.',
            'A public hook around the body of NNX transforms, told which'
            ' modules they slice (the in_axes prefix of each graph node).',
        )
        for name, cls, transform in (
            ('scan_body', _iteration.ScanFn, 'nnx.scan'),
            ('simple_scan_body', _iteration.SimpleScanFn, 'nnx.scan'),
            ('vmap_body', _iteration.VmapFn, 'nnx.vmap'),
            ('simple_vmap_body', _iteration.SimpleVmapFn, 'nnx.vmap'),
        )
    ),
    Hook(  # PR: nnx_functional
        'attention_weights',
        ((_attention_lib, 'dot_product_attention_weights'),),
        'flax.nnx.nn.attention.dot_product_attention_weights (looked up by'
        ' dot_product_attention, the default attention_fn)',
        'hooks.py',
        '`module_outputs(..., attention_weights=True)` makes the weights'
        ' of a selected `MultiHeadAttention` call a hook point (a sow whose'
        ' replacement the values are averaged with); Flax computes them'
        ' inside the function, where no module method returns them. While'
        ' no such call runs on the thread, the replacement calls Flax\'s'
        ' function unchanged.',
        'A hook point for the attention weights in `dot_product_attention`'
        ' (e.g. passing them through a replaceable `Module.sow`, one that'
        ' returns the value it sows).',
        wraps=True,
    ),
    Hook(  # PR: nnx_functional
        'method_outputs',
        (),
        'the public methods and `__call__` of every Module class that an'
        ' `nnx.capture(..., method_outputs=T)` call runs',
        'shims.py',
        'Flax 0.12.8 sows every method output under `(*path, method)`; the'
        ' shim wraps the methods of the classes in the captured module for'
        ' the duration of that call only (wrap_methods/unwrap_methods), so'
        ' no class stays changed and other calls are unaffected.',
        "A per-call method interceptor in flax/nnx/module.py (as Linen's"
        ' `intercept_methods`), run by `Module` itself.',
        per_call=True,
    ),
)

# The Flax objects as they were when the NNX layer was imported.
_ORIGINALS = {h.name: getattr(*h.targets[0]) for h in INVENTORY if h.targets}
_REPLACEMENTS: dict[str, tp.Callable] = {}  # made once: identity is stable


def _put(hook: Hook, given: tp.Callable) -> None:
  del given  # made once, by ``replacement``
  new = replacement(hook.name)
  for owner, attribute in hook.targets:
    if getattr(owner, attribute) is not new:
      setattr(owner, attribute, new)


def _take_out(hook: Hook) -> None:
  new = _REPLACEMENTS.get(hook.name)
  for owner, attribute in hook.targets:
    if new is not None and getattr(owner, attribute) is new:
      setattr(owner, attribute, _ORIGINALS[hook.name])


_INVENTORY = inventory.Inventory(
    'the Flax hook inventory',
    lambda: INVENTORY,
    _put,
    _take_out,
    registrable=lambda hook: not hook.per_call,
)
_LOCK = _INVENTORY.lock


def register(name: str, replacement: tp.Callable) -> None:
  """Provides the replacement of the inventory entry ``name`` (see ``Hook``).

  Raises:
    KeyError: ``name`` is not an installed entry of the inventory.
  """
  with _LOCK:
    _INVENTORY.register(name, replacement)
    _REPLACEMENTS.pop(name, None)


def original(name: str) -> tp.Any:
  """Flax's own object that the entry ``name`` replaces."""
  return _ORIGINALS[name]


def replacement(name: str) -> tp.Any:
  """What :func:`install` puts in place for the entry ``name``."""
  with _LOCK:
    made = _REPLACEMENTS.get(name)
    if made is None:
      made = given = _INVENTORY.registered(name)
      hook = _INVENTORY.entry(name)
      if hook.wraps:  # PR: nnx_transforms
        on_class = any(isinstance(owner, type) for owner, _ in hook.targets)
        made = _wrapping(given, _ORIGINALS[name], on_class)
      _REPLACEMENTS[name] = made
    return made


def _wrapping(  # PR: nnx_transforms
    given: tp.Callable, flax_original: tp.Callable, on_class: bool
) -> tp.Callable:
  """``given(flax_original, *args, **kwargs)``: a ``functools.partial``, or,
  for a method (``on_class``), a function, which binds to its instance."""
  if not on_class:
    return functools.wraps(flax_original)(
        functools.partial(given, flax_original)
    )

  @functools.wraps(flax_original)
  def made(*args, **kwargs):
    return given(flax_original, *args, **kwargs)

  return made


def install() -> None:
  """Puts every registered replacement in place, in the inventory's order.

  Idempotent.
  """
  _INVENTORY.install()


def uninstall() -> None:
  """Restores Flax's originals where a replacement is in place; idempotent."""
  _INVENTORY.uninstall()


def installed() -> bool:
  """Whether every registered replacement is in place."""
  with _LOCK:
    return _INVENTORY.has_registrations() and all(
        getattr(owner, attribute) is _REPLACEMENTS.get(hook.name)
        for hook in INVENTORY
        if _INVENTORY.registered(hook.name) is not None
        for owner, attribute in hook.targets
    )


# The per-call entry ``method_outputs``.

_WRAPPED: dict[type, tuple[int, dict[str, tp.Any]]] = {}  # PR: nnx_functional


def wrap_methods(  # PR: nnx_functional
    classes: tp.Iterable[type],
    wrappable: tp.Callable[[str, tp.Any], bool],
    make_wrapper: tp.Callable[[str, tp.Any], tp.Any],
) -> None:
  """Replaces each ``wrappable(name, attr)`` attribute of each class (its
  own ``vars``) by ``make_wrapper(name, attr)``, until the matching
  :func:`unwrap_methods`; a class already wrapped only counts one more user.
  """
  with _LOCK:
    for cls in classes:
      count, originals = _WRAPPED.get(cls, (0, None))
      if count == 0:
        originals = {}
        for name, attr in list(vars(cls).items()):
          if wrappable(name, attr):
            originals[name] = attr
            setattr(cls, name, make_wrapper(name, attr))
      _WRAPPED[cls] = (count + 1, originals)


def unwrap_methods(classes: tp.Iterable[type]) -> None:  # PR: nnx_functional
  """Undoes one :func:`wrap_methods` of each class; the last restores it."""
  with _LOCK:
    for cls in classes:
      count, originals = _WRAPPED[cls]
      if count == 1:
        for name, attr in originals.items():
          setattr(cls, name, attr)
        del _WRAPPED[cls]
      else:
        _WRAPPED[cls] = (count - 1, originals)
