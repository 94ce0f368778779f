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

"""Module calls as hook points: their outputs sown without editing the model.

This file owns the wrapping of NNX Module methods for the duration of a call
so that their outputs become sows:

* :func:`module_outputs` (the functional API): ``module_outputs(f,
  modules=...)`` is ``f`` in which the output of every selected module's
  ``__call__`` is sown under ``(*path, '__call__')``, the module's path
  from the roots of the innermost capture plus ``'__call__'`` (the key
  Flax's ``nnx.capture(..., method_outputs=...)`` uses). ``capture``
  collects them, ``intervene`` replaces them (the replacement is what the
  module returns), ``grad=True`` also collects their cotangents.
* a module passed as an argument to a plain JAX transform (``jax.jit``,
  ``jax.vmap``, ``jax.grad``) runs as a copy that the transform made of
  the pytree: its calls are named by the original's path
  (``Scope.follow_copy``), so the names and values are those without the
  transform (each such call retraces its ``jax.jit``).
* the method wrapper that ``nnx.capture(..., method_outputs=T)`` installs
  (``shims.py``) is the same one: one wrapper per class serves both.

While a hooked call runs, every Module subclass's public methods and
``__call__`` are wrapped (``flax_hooks.wrap_methods``, counted, restored
when the last user leaves); the wrapper does nothing on a thread with no
active request, so other threads are not affected.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import threading
import typing as tp

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from flax.nnx.sow.api import sow as _core_sow
from flax.nnx.sow.nnx import flax_hooks
from flax.nnx.sow.nnx import scope as scope_lib
from flax.nnx.sow.nnx.scope import LOCAL as SCOPES
from flax.nnx.sow.nnx.scope import SharedPathError

__all__ = ['ModuleOutput', 'module_outputs']


class ModuleOutput:
  """The tag of the sows :func:`module_outputs` leaves at module calls.

  ``capture(f, tags=[ModuleOutput])`` collects only module outputs.
  """


Selector = tp.Callable[[tuple, tp.Any], bool]


@dataclasses.dataclass(frozen=True)
class _Request:
  select: Selector
  grad: bool
  inputs: bool
  attention_weights: bool
  attention_scores: bool

  def wants(self, what: str | None) -> bool:
    """Whether this request makes ``what`` of a selected call a hook point
    (``None``: the output)."""
    return what is None or getattr(self, _WHAT[what])


_WHAT = {
    'input': 'inputs',
    'attention_weights': 'attention_weights',
    'attention_scores': 'attention_scores',
}


class _Local(threading.local):

  def __init__(self):
    super().__init__()
    self.requests: list[_Request] = []
    # The MultiHeadAttention calls whose weights are hook points, innermost
    # last: (module, whether the caller passed sow_weights=True).
    self.attention: list[tuple[tp.Any, bool]] = []


_LOCAL = _Local()

# What ``nnx.capture(..., method_outputs=T)`` records of each wrapped
# method's output (set by ``shims.py``, which owns that API).
method_output_recorder: tp.Callable[[tp.Any, str, tp.Any], None] = (
    lambda self, method_name, result: None
)


def is_array_tree(value) -> bool:
  """Whether every leaf of ``value`` is an array or a scalar (sowable)."""
  scalars = (bool, int, float, complex, np.generic)
  return all(
      isinstance(leaf, (jax.Array, np.ndarray, jax.core.Tracer, *scalars))
      for leaf in jax.tree.leaves(value)
  )


def _selector(modules) -> Selector:
  if modules is True or modules is None:
    return lambda path, module: True
  if isinstance(modules, type) or (
      isinstance(modules, tuple) and all(isinstance(t, type) for t in modules)
  ):
    return lambda path, module: isinstance(module, modules)
  if isinstance(modules, nnx.Module):
    # Callable, but a model, not a predicate: it would be called with
    # (path, module) inside the user's __call__ and fail there.
    raise TypeError(
        'module_outputs: modules must be True (every module), a Module class'
        ' or a tuple of classes (isinstance), or a predicate'
        f' (path, module) -> bool, got a {type(modules).__name__} instance.'
        ' To select the calls of that one module, select its path from the'
        " captured roots: modules=lambda path, m: path == ('blocks', 0) (not"
        ' `m is module`: intervene calls copies of the modules passed to'
        f' it); to select its class, modules={type(modules).__name__}.'
    )
  if callable(modules):
    return modules
  raise TypeError(
      'module_outputs: modules must be True (every module), a Module class'
      ' or a tuple of classes (isinstance), or a predicate'
      f' (path, module) -> bool, got {modules!r}.'
  )


def module_outputs(
    f: tp.Callable[..., tp.Any],
    modules: tp.Any = True,
    *,
    grad: bool = False,
    inputs: bool = False,
    attention_weights: bool = False,
    attention_scores: bool = False,
) -> tp.Callable[..., tp.Any]:
  """``f`` with the outputs of NNX module calls as hook points.

  Every call of a selected module's ``__call__`` inside ``f`` returns
  ``sow(output, name=(*path, '__call__'), tag=ModuleOutput)``, where
  ``path`` is the module's path from the roots of the innermost capture (the
  modules among the captured function's arguments and those it refers to,
  as for ``Module.sow``): a model's code needs no sow. Inside an
  ``nnx.scan`` over stacked layers a block's outputs are stacked per layer,
  inside loops per iteration, under ``nnx.vmap`` with the mapped axis first,
  as for any sow. Outputs that are not pytrees of arrays (a ``str``,
  ``None``) are not sown.

  >>> import jax.numpy as jnp
  >>> from flax import nnx
  >>> from flax.nnx.sow import capture, intervene
  >>> from flax.nnx.sow import module_outputs
  >>> model = nnx.Sequential(nnx.Linear(2, 3, rngs=nnx.Rngs(0)), nnx.relu)
  >>> f = module_outputs(lambda m, x: m(x), nnx.Linear)
  >>> _, collected = capture(f)(model, jnp.ones((1, 2)))
  >>> list(collected)
  [('layers', 0, '__call__')]
  >>> zeroed = intervene(f, {('layers', 0, '__call__'): lambda v: v * 0})
  >>> float(zeroed(model, jnp.ones((1, 2))).sum())
  0.0

  Args:
    f: the function to run; it calls NNX modules.
    modules: which calls are hook points: ``True`` (every module), a Module
      class or a tuple of classes (``isinstance``), or a predicate
      ``(path, module) -> bool``.
    grad: also mark each output as ``sow(..., grad=True)`` does: a capture
      of a differentiated ``f`` collects the cotangent of the output under
      ``('grad', *path, '__call__')`` (attribution patching).
    inputs: also make the first positional argument of each selected call a
      hook point, under ``(*path, '__call__', 'input')``, before the module
      runs: a replacement is what the module receives (e.g. the per-head
      values that an attention's output projection mixes, TransformerLens'
      ``hook_z``).
    attention_weights: also make the attention weights of each selected
      ``nnx.MultiHeadAttention`` call a hook point, under ``(*path,
      '__call__', 'attention_weights')``: the softmax over keys, shape
      ``(*batch, heads, q_length, kv_length)``, that the values are averaged
      with (TransformerLens' ``hook_pattern``); a replacement is what they
      are averaged with. The call then runs Flax's explicit attention (as
      with ``sow_weights=True``) instead of ``jax.nn.dot_product_attention``:
      the same values up to rounding. Only the default ``attention_fn``
      (``nnx.dot_product_attention``) computes weights; with dropout on,
      they are the weights after dropout.
    attention_scores: also make the attention scores of each selected
      ``nnx.MultiHeadAttention`` call a hook point, under ``(*path,
      '__call__', 'attention_scores')``: the logits before the softmax over
      keys, ``query . key / sqrt(head_dim)`` plus the attention bias, with
      masked positions at the dtype's lowest finite value (as Flax masks
      them), shape ``(*batch, heads, q_length, kv_length)``
      (TransformerLens' ``attn_scores``); a replacement is what the softmax
      is taken of. As for ``attention_weights``, only the default
      ``attention_fn`` computes them, and the weights are then computed
      from the (possibly replaced) scores here, equal to Flax's up to
      rounding.

  Returns:
    A function with ``f``'s signature and return value.

  Raises:
    TypeError: ``modules`` is none of the above.
    ValueError: (when called) a selected module would share its path with
      another module (see ``Module.sow``).
    NotImplementedError: (when called) ``attention_scores`` of an attention
      called with dropout on (Flax draws its dropout mask inside the
      function that computes the scores).
  """
  request = _Request(
      _selector(modules), grad, inputs, attention_weights, attention_scores
  )

  @functools.wraps(f)
  def hooked(*args, **kwargs):
    with _requested(request):
      return f(*args, **kwargs)

  return hooked


def _module_classes() -> list[type]:
  seen, todo = {}, [nnx.Module]
  while todo:
    for sub in todo.pop().__subclasses__():
      if sub not in seen:
        seen[sub] = None
        todo.append(sub)
  return list(seen)


@contextlib.contextmanager
def _requested(request: _Request):
  classes = _module_classes()
  _LOCAL.requests.append(request)
  with wrapped(classes):
    try:
      yield
    finally:
      _LOCAL.requests.pop()


@contextlib.contextmanager
def wrapped(classes: tp.Iterable[type]):
  """The public methods and ``__call__`` of ``classes`` wrapped (one
  :func:`_method_wrapper` per class, counted) while the block runs."""
  classes = list(classes)
  flax_hooks.wrap_methods(classes, _wrappable, _method_wrapper)
  try:
    yield
  finally:
    flax_hooks.unwrap_methods(classes)


def _wrappable(name, attr) -> bool:
  if name.startswith('_') and name != '__call__':
    return False
  if isinstance(attr, (staticmethod, classmethod, property, type)):
    return False
  return callable(attr) and not getattr(attr, '_nnx_sow_method_output', False)


def _method_wrapper(method_name: str, method):

  @functools.wraps(method)
  def wrapper(self, *args, **kwargs):
    hooked = method_name == '__call__' and SCOPES.scopes and _LOCAL.requests
    if hooked:
      _name_early(self)
    if hooked and args and any(r.inputs for r in _LOCAL.requests):
      args = (_hook_point(self, args[0], 'input'), *args[1:])
    if hooked and _weights_requested(self):
      result = _with_weights_hooked(method, self, args, kwargs)
    else:
      result = method(self, *args, **kwargs)
    if not SCOPES.scopes:
      return result
    method_output_recorder(self, method_name, result)
    if hooked:
      result = _hook_point(self, result)
    return result

  wrapper._nnx_sow_method_output = True  # pylint: disable=protected-access
  return wrapper


def _named(self, scopes, what: str):
  """``self``'s scope and path, following the copies that plain JAX
  transforms make (``Scope.follow_copy``).

  Raises:
    ValueError: ``self``'s path would be shared with another module's.
    CopyError: ``self`` is a copy of one of several modules.
  """
  try:
    return scope_lib.innermost_naming(self, scopes, follow_copies=True)
  except SharedPathError as e:
    raise ValueError(
        f'{what}: the output of {type(self).__name__} would be named'
        f' {e.path!r}, but {e.why}; give the modules distinct names.'
    ) from None


def _name_early(self) -> None:
  """Names ``self`` as its call starts: where it is a copy that a plain JAX
  transform made (``jax.jit`` given the model), the copies of its
  submodules, called before its output is sown, are then named with it."""
  try:
    _named(self, list(reversed(SCOPES.scopes)), 'module_outputs')
  except ValueError:
    pass  # raised when its output is sown, if that is a hook point


def _copy_error(self, e: scope_lib.CopyError, what: str) -> ValueError:
  names = ' or '.join(repr((*p, '__call__')) for p in e.paths)
  cls = type(self).__name__
  paths = ', '.join(map(repr, e.paths))
  why = f'the modules at {paths} (e.g. nnx.clone copies) look the same to it'
  if not e.owned:
    why = f'{cls} shares its attribute table with every {cls}'
  return ValueError(
      f'{what}: the output of {cls} would be named {names}, but the module'
      ' called is a copy that a plain JAX transform (jax.jit, jax.vmap,'
      f' jax.grad, ...) made of a module passed to it as a pytree, and'
      f' {why}.'
      ' Pass the model through the NNX transform (nnx.jit, nnx.vmap, ...;'
      ' graph=False works too), or let the transformed function close over'
      ' the model.'
  )


def _hook_point(self, value, what: str | None = None):
  """``value`` (the output, or with ``what='input'`` the first argument)
  sown for the innermost request that selects ``self``."""
  if not jax.tree.leaves(value) or not is_array_tree(value):
    return value
  found = _selecting_request(self)
  if found is None or not found[1].wants(what):
    return value
  path, request = found
  name = (*path, '__call__') + ((what,) if what else ())
  return _core_sow(value, name=name, tag=ModuleOutput, grad=request.grad)


def _selecting_request(self):
  """``(path, request)``: ``self``'s path and the innermost request that
  selects it, or ``None``."""
  try:
    found = _named(self, list(reversed(SCOPES.scopes)), 'module_outputs')
  except scope_lib.CopyError as e:
    if any(r.select(p, self) for r in _LOCAL.requests for p in e.paths):
      raise _copy_error(self, e, 'module_outputs') from None
    return None
  if found is None:
    return None
  _, path = found
  for request in reversed(_LOCAL.requests):
    if request.select(path, self):
      return path, request
  return None


# Attention weights (the ``attention_weights`` entry of ``flax_hooks.py``).

_WEIGHTS_SIGNATURE = inspect.signature(
    flax_hooks.original('attention_weights')
)


def _weights_requested(self) -> bool:
  """Whether ``self`` is an attention whose weights or scores a request
  selects."""
  if not isinstance(self, nnx.MultiHeadAttention) or not any(
      r.attention_weights or r.attention_scores for r in _LOCAL.requests
  ):
    return False
  found = _selecting_request(self)
  return found is not None and (
      found[1].attention_weights or found[1].attention_scores
  )


def _with_weights_hooked(method, self, args, kwargs):
  # sow_weights=True passes the module to dot_product_attention, which then
  # computes the weights explicitly (and calls the function below).
  _LOCAL.attention.append((self, bool(kwargs.get('sow_weights', False))))
  try:
    return method(self, *args, **dict(kwargs, sow_weights=True))
  finally:
    _LOCAL.attention.pop()


def _attention_weights(original, *args, **kwargs):
  if not _LOCAL.attention:
    return original(*args, **kwargs)
  bound = _WEIGHTS_SIGNATURE.bind(*args, **kwargs)
  module, caller_sows = _LOCAL.attention[-1]
  if bound.arguments.get('module') is not module:
    return original(*args, **kwargs)
  if not caller_sows:  # the module was passed for the hook alone
    bound.arguments['module'] = None
  found = _selecting_request(module)
  if found is not None and found[1].attention_scores:
    weights = _weights_from_scores(module, bound, caller_sows)
  else:
    weights = original(*bound.args, **bound.kwargs)
  return _hook_point(module, weights, 'attention_weights')


def _weights_from_scores(module, bound, caller_sows: bool):
  """The attention weights of ``dot_product_attention_weights``'s
  arguments ``bound``, with the scores (the logits before the softmax) a
  hook point of ``module``.

  Raises:
    NotImplementedError: with attention dropout on.
  """
  bound.apply_defaults()
  a = bound.arguments
  if not a['deterministic'] and a['dropout_rate'] > 0.0:
    raise NotImplementedError(
        'module_outputs(..., attention_scores=True): the'
        f' {type(module).__name__} is called with attention dropout on'
        f' (dropout_rate={a["dropout_rate"]}), and Flax draws its dropout'
        ' mask inside the function that computes the scores, so they'
        ' cannot be a hook point there. Run it deterministic (model.eval(),'
        ' or deterministic=True), or use attention_weights=True alone.'
    )
  query, key = a['promote_dtype']((a['query'], a['key']), dtype=a['dtype'])
  dtype = query.dtype
  heads, kv_heads = query.shape[-2], key.shape[-2]
  if heads != kv_heads:  # grouped-query attention: consecutive query heads
    key = jnp.repeat(key, heads // kv_heads, axis=-2)  # share a key head
  query = query / jnp.sqrt(query.shape[-1]).astype(dtype)
  scores = jnp.einsum(
      '...qhd,...khd->...hqk', query, key, precision=a['precision']
  )
  if a['bias'] is not None:
    scores = scores + a['bias']
  mask = a['mask']
  if a['is_causal']:
    causal = jnp.tril(jnp.ones(scores.shape[-2:], dtype))
    causal = jnp.broadcast_to(
        causal, scores.shape if mask is None else mask.shape
    )
    mask = causal if mask is None else nnx.combine_masks(mask, causal)
  if mask is not None:
    scores = jnp.where(mask, scores, jnp.finfo(dtype).min)
  scores = _hook_point(module, scores, 'attention_scores')
  weights = jax.nn.softmax(scores).astype(dtype)
  if caller_sows:  # as Flax does with sow_weights=True
    module.sow(nnx.Intermediate, 'attention_weights', weights)
  return weights


flax_hooks.register('attention_weights', _attention_weights)
