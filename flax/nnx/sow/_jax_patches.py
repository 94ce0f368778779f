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

"""The only file that replaces JAX objects: the patch inventory.

Each entry of :data:`INVENTORY` names a JAX object this package replaces,
why, the JAX versions it was checked against, and the hook JAX would expose
to make the patch unnecessary. The files that own a behaviour provide the
wrapper (:func:`register`, at import). Importing the package replaces
nothing: :func:`install` applies every registered patch when the first
``capture`` or ``intervene`` stages its function (``primitive.staging``),
once, under a lock, in the order of the inventory, so wrappers stacked on
one target (``scan``'s batching rule) always stack the same way. Every
wrapper takes JAX's own path for equations that hold no sow a capture is
staging, so a function JAX traced or compiled before the first capture
behaves the same after it (``tests/test_import_invariance.py`` checks that
programs without sows stage to the same jaxpr without this package, with it
imported, and once a capture has installed the inventory).

What the package does register at import is not a patch: rules for its own
primitives (``sow_p``, ``perturb_tangent_p``: their JVP, transpose,
batching, lowering, partial-evaluation and ``jet`` rules), its effect type
in JAX's effect sets, its ``Collected`` pytree, and its directory in JAX's
list of files that tracebacks skip. Each adds an entry JAX does not have,
and none changes a program without a sow.
"""

from __future__ import annotations

import dataclasses
import functools
import typing as tp

from flax.nnx.sow import _jax
from flax.nnx.sow import inventory

JAX_VERSIONS = 'jax 0.10.2 (jax>=0.10.2,<0.11 in pyproject.toml)'


class _Target:
  """Where a patch goes: ``apply(wrapper)`` installs it (idempotent);
  ``current()`` is what is at the target now (JAX's own objects until
  :func:`install`)."""

  def __init__(self, apply, current):
    self.apply = apply
    self.current = current

  def __call__(self, wrapper):
    return self.apply(wrapper)


def _marked(fn):
  fn._sow_wrapped = True  # pylint: disable=protected-access
  return fn


def _is_marked(fn) -> bool:
  return getattr(fn, '_sow_wrapped', False)


def _wrap_attribute(owner, attribute: str):
  """``owner.attribute`` becomes ``wrapper(original, *args, **kwargs)``."""

  def apply(wrapper):
    original = getattr(owner, attribute)
    if _is_marked(original):
      return

    @functools.wraps(original)
    def patched(*args, **kwargs):
      return wrapper(original, *args, **kwargs)

    setattr(owner, attribute, _marked(patched))

  return _Target(apply, lambda: (getattr(owner, attribute),))


def _wrap_rule(registry: dict, primitive):
  """``registry[primitive]`` becomes ``wrapper(original_rule, *args)``."""

  def apply(wrapper):
    original = registry[primitive]
    if _is_marked(original):
      return

    def rule(*args, **kwargs):
      return wrapper(original, *args, **kwargs)

    registry[primitive] = _marked(rule)

  return _Target(apply, lambda: (registry.get(primitive),))


def _new_rule(registry: dict, primitive):  # PR: custom
  """``registry[primitive]``, which JAX leaves unset (it then uses a default
  that ``wrapper`` is given as its first argument), becomes
  ``wrapper(default, *args)``."""

  def apply(wrapper):
    if _is_marked(registry.get(primitive)):
      return
    if primitive in registry:
      raise RuntimeError(
          f'JAX now has a rule for {primitive} in this registry; wrap it'
          ' with _wrap_rule instead.'
      )

    def rule(trace, *args, **kwargs):
      return wrapper(trace.default_process_primitive, trace, *args, **kwargs)

    registry[primitive] = _marked(rule)

  return _Target(apply, lambda: (registry.get(primitive),))


def _scan_hoisting_now():  # PR: partial_eval
  return (_jax.lax_control_flow.loops._scan_known_hoisting,)  # pylint: disable=protected-access


def _replace_scan_hoisting(factory):  # PR: partial_eval
  """``_scan_known_hoisting`` becomes ``factory(original)``; JAX's scan
  rules look it up in their module at each call."""
  loops = _jax.lax_control_flow.loops
  if _is_marked(loops._scan_known_hoisting):  # pylint: disable=protected-access
    return
  loops._scan_known_hoisting = _marked(  # pylint: disable=protected-access
      factory(loops._scan_known_hoisting)  # pylint: disable=protected-access
  )


def _compiled_call_now():
  return (_jax.stages.Compiled.__call__,)


def _guard_compiled_calls(check):
  """``check()`` runs before every call of an ahead-of-time compiled
  function, which JAX runs without binding a primitive."""
  cls = _jax.stages.Compiled
  original = cls.__call__
  if _is_marked(original):
    return

  def __call__(self, *args, **kwargs):
    check()
    return original(self, *args, **kwargs)

  cls.__call__ = _marked(__call__)


@dataclasses.dataclass(frozen=True)
class Patch:
  """One replaced JAX object.

  Attributes:
    name: the key a file registers its wrapper under.
    target: the JAX object replaced.
    owner: the file of this package that provides the wrapper.
    reason: why it is replaced.
    jax_hook: what JAX would need to expose to make it unnecessary.
    apply: ``apply(wrapper)`` installs it (idempotent);
      ``apply.current()`` returns the objects at the target now.
  """

  name: str
  target: str
  owner: str
  reason: str
  jax_hook: str
  apply: _Target


INVENTORY: tuple[Patch, ...] = (
    Patch(
        'compiled_calls',
        'jax._src.stages.Compiled.__call__',
        'toplevel.py',
        'An ahead-of-time compiled function runs without binding anything,'
        ' so a capture would silently miss its sows; the call raises inside'
        ' a capture instead.',
        'A way for a trace to refuse (or see) calls of compiled executables.',
        _Target(_guard_compiled_calls, _compiled_call_now),
    ),
    Patch(  # PR: partial_eval
        'scan_hoisting',
        'jax._src.lax.control_flow.loops._scan_known_hoisting',
        'constructs/partial_eval.py',
        'grad/linearize move loop-invariant work out of a scan; a sow there'
        ' must still give one value per iteration.',
        'A per-effect opt-out of loop-invariant hoisting in scan partial'
        ' evaluation.',
        _Target(_replace_scan_hoisting, _scan_hoisting_now),
    ),
    Patch(  # PR: partial_eval
        'partial_eval_nounits',
        'pe.partial_eval_jaxpr_nounits',
        'constructs/partial_eval.py',
        "The hoisting step of scan's checkpoint rule calls it; sows stay in"
        ' the loop there too.',
        'As for scan_hoisting.',
        _wrap_attribute(_jax.pe, 'partial_eval_jaxpr_nounits'),
    ),
    Patch(  # PR: partial_eval
        'partial_eval_kept_calls',
        'pe.new_eqn_recipe',
        'constructs/partial_eval.py',
        "JAX's partial evaluation keeps an effectful primitive whose outputs"
        ' are unused, but not a call, custom_vjp_call or cond that holds one;'
        ' in the part of a loop that stays in the loop, a sow is kept.',
        'JaxprTrace rules that keep every equation with an effect in'
        ' partial_eval_kept_effects (as pjit and scan do).',
        _wrap_attribute(_jax.pe, 'new_eqn_recipe'),
    ),
    Patch(  # PR: custom
        'remat_opt_partial_eval',
        'pe.custom_partial_eval_rules[remat_opt_p] (unset in JAX)',
        'constructs/custom.py',
        "Under checkpoint, scan's hoisting computes a remat_opt (the fwd of a"
        ' custom_vjp(optimize_remat=True)) on loop-invariant values once,'
        ' outside the loop; one whose forward pass sows stays in the loop.',
        'As for scan_hoisting.',
        _new_rule(_jax.custom_partial_eval_rules, _jax.remat_opt_p),
    ),
    Patch(  # PR: partial_eval
        'scan_remat_rule',
        'pe.partial_eval_jaxpr_custom_rules[scan_p]',
        'constructs/partial_eval.py',
        'Marks where its hoisting runs (see partial_eval_nounits).',
        'As for scan_hoisting.',
        _wrap_rule(_jax.partial_eval_jaxpr_custom_rules, _jax.scan_p),
    ),
    Patch(  # PR: partial_eval
        'while_remat_rule',
        'pe.partial_eval_jaxpr_custom_rules[while_p]',
        'constructs/partial_eval.py',
        'checkpoint keeps the known loop and recomputes the whole loop: the'
        " copy's sows must not be collected again.",
        'A way to mark the staged copy of a split loop as a recomputation.',
        _wrap_rule(_jax.partial_eval_jaxpr_custom_rules, _jax.while_p),
    ),
    Patch(  # PR: partial_eval
        'while_partial_eval',
        'pe.custom_partial_eval_rules[while_p]',
        'constructs/partial_eval.py',
        'linearize runs the known part of a loop and stages the whole loop'
        " again: the copy's sows must not be collected each time the linear"
        ' function is applied.',
        'As for while_remat_rule.',
        _wrap_rule(_jax.custom_partial_eval_rules, _jax.while_p),
    ),
    Patch(  # PR: loops
        'scan_batching',
        'batching.fancy_primitive_batchers[scan_p]',
        'constructs/scan.py',
        'Plain sows in a batched scan are hoisted out, so they come back'
        ' with the mapped axis first.',
        'A batching hook that lets an effect choose where its mapped axis'
        ' goes.',
        _wrap_rule(_jax.fancy_primitive_batchers, _jax.scan_p),
    ),
    Patch(  # PR: loops
        'cond_batching',
        'batching.fancy_primitive_batchers[cond_p]',
        'constructs/cond.py',
        'A cond on a batched predicate runs every branch: plain sows are'
        " hoisted and the taken branch's value selected.",
        'As for scan_batching.',
        _wrap_rule(_jax.fancy_primitive_batchers, _jax.cond_p),
    ),
    Patch(  # PR: custom
        'custom_vmap_jvp',
        'ad.primitive_jvps[custom_vmap_p]',
        'constructs/custom.py',
        "The JVP runs the vmap rule under a vmap of its own that maps only"
        " arguments whose primal or tangent alone is batched; where it maps"
        " none, the rule's sows must not be broadcast over it.",
        'A way for a rule to tell an internal vmap from a user\'s (or the'
        " rule's batching flags passed to the sows it runs).",
        _wrap_rule(_jax.primitive_jvps, _jax.custom_vmap_p),
    ),
)

def _put(patch: Patch, wrapper: tp.Callable) -> None:
  patch.apply(wrapper)


_INVENTORY = inventory.Inventory(
    'the patch inventory (_jax_patches.py)',
    lambda: INVENTORY,
    _put,
    once=True,
)


def register(name: str, wrapper: tp.Callable) -> None:
  """Provides the wrapper of the inventory entry ``name`` (see ``Patch``).

  Raises:
    KeyError: ``name`` is not in the inventory.
  """
  _INVENTORY.register(name, wrapper)


def install() -> None:
  """Applies every registered patch, in the inventory's order.

  Called when a capture or ``intervene`` starts staging; runs once per
  process (later calls return at once), and a thread that calls it while
  another is installing waits until every patch is in place.
  """
  _INVENTORY.install()


def installed() -> bool:
  """Whether :func:`install` has run in this process."""
  return _INVENTORY.ran
