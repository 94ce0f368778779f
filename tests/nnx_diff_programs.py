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

"""Generated NNX programs that ``test_nnx_flax_diff`` runs with and without
the shims, and the runner that executes a batch of them.

A program is the source of a Python module that defines ``run()``, which
builds a tiny model whose blocks call ``Module.sow``/``Module.perturb``
(plain, or reduced with ``reduce_fn``/``init_fn``) under NNX transforms
(``nnx.scan`` with the module as carry or over stacked layers,
``nnx.vmap`` broadcasting or mapping the module, ``nnx.jit``,
``nnx.remat``, ``nnx.cond``, ``nnx.split``/``nnx.merge``), captures them
with ``nnx.capture`` (by type, with ``method_outputs=``, or through Flax's
four-step ``init=`` perturbation recipe) and returns a dict: the function's
output, the returned States and, for the recipe, the Param gradients.

:func:`programs` builds a batch from a seed: first one program of each
targeted kind (:data:`TARGETED`), then random combinations. Run as::

  python nnx_diff_programs.py [--shims] IN.json OUT.pkl

the runner executes every program of ``IN.json`` (a list of
``{'name', 'source'}``) in this one interpreter, with Flax 0.12.8 as it is
or (``--shims``) after ``import flax.nnx.sow``, and pickles, by name, the
result as nested pure Python (dicts, lists, tuples, numpy arrays, Python
scalars; Variables as ``('Variable', type name, value)``), ``('ERROR',
text)`` where ``run()`` raised, or ``('LEAKED', path)`` where the result
holds a tracer.
"""

from __future__ import annotations

import dataclasses
import random
import sys
import textwrap
import typing as tp

D = 3  # features
N = 2  # batch rows / scan steps
L = 3  # stacked layers

# Statements a Block may run after computing ``y``; ``D`` is substituted.
SOWS = {
    'plain': "self.sow(nnx.Intermediate, 'a', y)",
    'reduced_vec': (
        "self.sow(nnx.Intermediate, 'r', y, init_fn=lambda: jnp.zeros(D),"
        ' reduce_fn=lambda acc, v: acc + v)'
    ),
    'reduced_scalar': (
        "self.sow(nnx.Intermediate, 'm', jnp.max(y),"
        ' init_fn=lambda: jnp.zeros(()), reduce_fn=jnp.maximum)'
    ),
    'reduced_pyint': (
        "self.sow(nnx.Intermediate, 'n', 1, init_fn=lambda: 0,"
        ' reduce_fn=lambda acc, v: acc + v)'
    ),
    'pyfloat': "self.sow(nnx.Intermediate, 'c', 1.5)",
    'pytree': "self.sow(nnx.Intermediate, 't', {'sq': y * y, 'neg': -y})",
    'perturb': "y = self.perturb('p', y)",
    'sow_and_perturb': (
        "self.sow(nnx.Intermediate, 'h', y)\n    y = self.perturb('h', y)"
    ),
}

# The sows whose fold is Flax's default, a growing tuple.
TUPLE_SOWS = ('plain', 'pyfloat', 'pytree', 'sow_and_perturb')

# How a block ``b`` is called on ``x`` (the body of the program's ``call``).
CALLS = {
    'direct': 'b(x)',
    'jit': 'nnx.jit(lambda b, x: b(x))(b, x)',
    'remat': 'nnx.remat(lambda b, x: b(x))(b, x)',
    'cond': (
        'nnx.cond(jnp.sum(x) > 0, lambda b, x: b(x), lambda b, x: b(-x),'
        ' b, x)'
    ),
    'split_merge_update': 'split_merge(b, x, update=True)',
    'split_merge': 'split_merge(b, x, update=False)',
}

# The model's structure: how ``__init__`` builds the blocks, how
# ``__call__`` runs them (``call(b, x)`` is one of CALLS), and the input.
STRUCTURES = {
    'single': ('self.block = Block(rngs)', 'y = call(self.block, x)', (D,)),
    'twice': (
        'self.block = Block(rngs)',
        'y = call(self.block, x)\n    y = call(self.block, y)',
        (D,),
    ),
    'shared': (
        'blk = Block(rngs)\n    self.a = blk\n    self.b = blk',
        'y = call(self.a, x)\n    y = call(self.b, y)',
        (D,),
    ),
    'list': (
        'self.blocks = nnx.List([Block(rngs), Block(rngs)])',
        'y = x\n    for b in self.blocks:\n      y = call(b, y)',
        (D,),
    ),
    'vmap_broadcast': (
        'self.block = Block(rngs)',
        'y = nnx.vmap(lambda b, x: call(b, x), in_axes=(None, 0))'
        '(self.block, x)',
        (N, D),
    ),
    'vmap_mapped': (
        'self.blocks = stacked(rngs)',
        'y = nnx.vmap(lambda b, x: call(b, x), in_axes=(0, 0))'
        '(self.blocks, x)',
        (L, D),
    ),
    'scan_carry': (
        'self.block = Block(rngs)',
        'def body(b, x):\n      return b, call(b, x)\n'
        '    _, y = nnx.scan(body, in_axes=(nnx.Carry, 0),'
        ' out_axes=(nnx.Carry, 0))(self.block, x)',
        (N, D),
    ),
    'scan_stacked': (
        'self.blocks = stacked(rngs)',
        'def body(x, b):\n      return call(b, x)\n'
        '    y = nnx.scan(body, in_axes=(nnx.Carry, 0),'
        ' out_axes=nnx.Carry)(x, self.blocks)',
        (D,),
    ),
    # A plain jax.lax.scan: Flax's State holds the body's tracers.
    'lax_scan': (
        'self.block = Block(rngs)',
        'def body(c, x):\n      y = call(self.block, c + x)\n'
        '      return y, y\n'
        '    _, y = jax.lax.scan(body, jnp.zeros(D), x)',
        (N, D),
    ),
    'scan_broadcast': (
        'self.block = Block(rngs)',
        'def body(b, c, x):\n      y = call(b, c + x)\n      return y, y\n'
        '    _, y = nnx.scan(body, in_axes=(None, nnx.Carry, 0),'
        ' out_axes=(nnx.Carry, 0))(self.block, jnp.zeros(D), x)',
        (N, D),
    ),
}

# What ``nnx.capture`` wraps.
TARGETS = {
    'model': 'model',
    'fn': 'lambda m, x: m(x)',
    'nnx_jit_fn': 'nnx.jit(lambda m, x: m(x))',
    'method': 'model.forward',
}

MODES = (
    'intermediate',
    'perturbation',
    'both',  # Perturbation first: see _capture_source
    'repeated',  # nnx.capture(f, T, T)
    'method_outputs',
    'recipe',  # Flax's four-step init= recipe (Module.perturb docstring)
    'init',  # nnx.capture(..., init=) with what an earlier capture sowed
)

HEADER = '''\
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

D, N, L = {D}, {N}, {L}


def call(b, x):
  return {template}


def split_merge(b, x, update):
  graphdef, state = nnx.split(b)
  copy = nnx.merge(graphdef, state)
  y = copy(x)
  if update:
    nnx.update(b, nnx.state(copy))
  return y


class Block(nnx.Module):

  def __init__(self, rngs):
    self.linear = nnx.Linear(D, D, rngs=rngs)

  def features(self, x):
    return self.linear(x)

  def label(self):
    return 'block'

  def __call__(self, x):
    y = jnp.tanh(self.features(x))
{label}    {sows}
    return y


@nnx.split_rngs(splits=L)
@nnx.vmap(in_axes=(0,), out_axes=0)
def stacked(rngs):
  return Block(rngs)


class Model(nnx.Module):

  def __init__(self, rngs):
    {init}

  def __call__(self, x, extra=False):
    {call}
{root_sow}    if extra:
      self.sow(nnx.Intermediate, 'extra', jnp.sum(x))
    return {ret}

  def forward(self, x):
    return self(x)


def run():
  model = Model(nnx.Rngs(0))
  x = jnp.linspace(-1.0, 1.0, {size}).reshape({shape})
'''


@dataclasses.dataclass(frozen=True)
class Spec:
  """What a program is made of (the generator's choices)."""

  structure: str
  call: str
  sows: tuple[str, ...]
  target: str
  mode: str
  root_sow: bool = False
  label: bool = False  # a method returning a str (for method_outputs)

  @property
  def kind(self) -> str:
    return (
        f'{self.mode}/{self.structure}/{self.call}/{self.target}/'
        f'{"+".join(self.sows)}'
        + ('/root_sow' if self.root_sow else '')
        + ('/str_method' if self.label else '')
    )


# One program of each kind the differential test is meant to watch first
# (the kinds where the shims were seen to differ from Flax).
TARGETED = (
    Spec('scan_stacked', 'direct', ('reduced_vec',), 'model', 'intermediate'),
    Spec('scan_stacked', 'direct', ('perturb',), 'model', 'recipe'),
    Spec('vmap_broadcast', 'direct', ('perturb',), 'model', 'recipe'),
    Spec('vmap_mapped', 'direct', ('reduced_vec',), 'model', 'intermediate'),
    Spec('vmap_mapped', 'direct', ('reduced_scalar',), 'model',
         'intermediate'),
    Spec('single', 'direct', ('perturb', 'plain'), 'model', 'recipe'),
    Spec('single', 'direct', ('pyfloat',), 'model', 'intermediate'),
    Spec('single', 'direct', ('plain',), 'model', 'method_outputs',
         label=True),
    Spec('single', 'direct', ('plain',), 'model', 'repeated'),
    Spec('scan_stacked', 'direct', ('plain',), 'model', 'intermediate'),
    Spec('scan_carry', 'direct', ('reduced_vec',), 'model', 'intermediate'),
    Spec('shared', 'jit', ('plain', 'reduced_pyint'), 'fn', 'intermediate'),
    Spec('list', 'remat', ('sow_and_perturb',), 'model', 'both'),
    Spec('single', 'cond', ('plain',), 'nnx_jit_fn', 'intermediate'),
    Spec('twice', 'split_merge_update', ('plain',), 'model',
         'intermediate'),
    Spec('vmap_mapped', 'jit', ('plain', 'pytree'), 'method',
         'method_outputs'),
    Spec('vmap_mapped', 'direct', ('perturb',), 'model', 'recipe'),
    Spec('single', 'direct', ('plain', 'reduced_vec'), 'model', 'init'),
    Spec('single', 'direct', ('reduced_pyint',), 'model', 'intermediate'),
    Spec('scan_broadcast', 'direct', ('perturb',), 'fn', 'recipe'),
    Spec('lax_scan', 'direct', ('plain',), 'model', 'intermediate'),
    Spec('single', 'remat', ('plain',), 'model', 'init'),
)


def random_spec(rng: random.Random) -> Spec:
  """A random combination."""
  mode = rng.choice(MODES)
  sows = rng.sample(sorted(SOWS), rng.choice((1, 1, 2)))
  if mode in ('perturbation', 'both', 'recipe') and not any(
      'perturb' in s for s in sows
  ):
    sows.append(rng.choice(('perturb', 'sow_and_perturb')))
  return Spec(
      structure=rng.choice(sorted(STRUCTURES)),
      call=rng.choice(sorted(CALLS)),
      sows=tuple(sows),
      target=rng.choice(sorted(TARGETS)),
      mode=mode,
      root_sow=rng.random() < 0.2,
      label=mode == 'method_outputs' and rng.random() < 0.3,
  )


def _capture_source(spec: Spec) -> str:
  """The lines of ``run()`` after the model and the input."""
  target = TARGETS[spec.target]
  args = '(model, x)' if spec.target in ('fn', 'nnx_jit_fn') else '(x)'
  if spec.mode == 'recipe':
    return _recipe_source(target, args)
  if spec.mode == 'init':
    # The first capture also sows 'extra', which the second call does not:
    # Flax keeps the init= entries it is given, sown this call or not.
    return (
        '  _, first = nnx.capture(lambda m, x: m(x, extra=True),'
        ' nnx.Intermediate)(model, x)\n'
        f'  y, second = nnx.capture({target}, nnx.Intermediate,'
        f' init=first){args}\n'
        "  return {'out': y, 'states': [first, second]}\n"
    )
  capture = {
      'intermediate': 'nnx.Intermediate',
      # Perturbation before Intermediate: Flax's split_state gives a
      # subclass to the first filter it matches, so the other order puts
      # Flax's perturbations in its Intermediate State (the migration
      # guide's table: 'filtering by type', exact types with the shims).
      'both': 'nnx.Perturbation, nnx.Intermediate',
      'perturbation': 'nnx.Perturbation',
      'repeated': 'nnx.Intermediate, nnx.Intermediate',
      'method_outputs': 'nnx.Intermediate, method_outputs=nnx.Intermediate',
  }[spec.mode]
  return (
      f'  y, *states = nnx.capture({target}, {capture}){args}\n'
      "  return {'out': y, 'states': states}\n"
  )


def _recipe_source(target: str, args: str) -> str:
  """Flax's four steps (``Module.perturb``'s docstring), on a sum."""
  inner = (
      'nnx.capture(model, nnx.Intermediate, init=perturbations)(x)'
      if target in ('model', 'model.forward')
      else f'nnx.capture({target}, nnx.Intermediate,'
      ' init=perturbations)(model, x)'
  )
  return textwrap.indent(textwrap.dedent(f'''\
      _, perturbations = nnx.capture({target}, nnx.Perturbation){args}

      def loss(model, perturbations, x):
        return {inner}

      (grads, perturb_grads), sowed = nnx.grad(
          loss, argnums=(0, 1), has_aux=True)(model, perturbations, x)
      metrics = nnx.merge_state(perturb_grads, sowed)
      return {{'states': [perturbations, perturb_grads, sowed, metrics],
              'grads': nnx.state(grads, nnx.Param)}}
  '''), '  ')


def source(spec: Spec) -> str:
  """The program's source."""
  init, call, shape = STRUCTURES[spec.structure]
  size = 1
  for n in shape:
    size *= n
  recipe = spec.mode == 'recipe'
  text = HEADER.format(
      D=D, N=N, L=L,
      template=CALLS[spec.call],
      label="    _ = self.label()\n" if spec.label else '',
      sows='\n    '.join(SOWS[s] for s in spec.sows),
      init=init,
      call=call,
      root_sow=(
          "    self.sow(nnx.Intermediate, 'out', y)\n" if spec.root_sow else ''
      ),
      ret='jnp.sum(y)' if recipe else 'y',
      size=size,
      shape=shape,
  )
  return text + _capture_source(spec)


def errors_only(spec: Spec) -> str | None:
  """Why only "the shims raise where Flax returns" is checked, or None."""
  if spec.structure == 'scan_broadcast':
    # The guide's table, row "nnx.scan/nnx.vmap with a broadcast module":
    # Flax returns an empty State, the shims the stacked values (and the
    # recipe then feeds those back through init=).
    return 'nnx.scan with a broadcast module (guide table)'
  return None


# Known differences (docs/migration.md) that exclude a program.
def excluded(spec: Spec) -> str | None:
  """Why a program is not compared, citing the migration guide, or None."""
  if spec.mode == 'both' and 'sow_and_perturb' in spec.sows:
    # The guide's table, row "sow(Intermediate, 'h') and perturb('h') in
    # one module: two States": in ONE nnx.capture requesting both types,
    # Flax's _extract_captures writes both Variables to the same key of one
    # State, so the later type overwrites the earlier one and Flax's
    # result is no reference.
    return 'sow and perturb under one name in one capture (guide table)'
  carried = spec.call == 'cond' or spec.structure.startswith(('scan', 'vmap'))
  if spec.mode == 'init' and carried and set(spec.sows) & set(TUPLE_SOWS):
    # Known differences, fourth bullet: a reduce_fn that grows a tuple
    # "inside a lax.scan/nnx.scan, while_loop, cond or vmap, which carry
    # the accumulator, ... is a ValueError naming the sow"; with init= the
    # default tuple fold starts from the earlier call's tuple and grows.
    return 'init= tuple grown where it is carried (Known differences, 4)'
  python = {'reduced_pyint', 'pyfloat'}
  if spec.structure == 'lax_scan' and set(spec.sows) & python:
    # Known differences, the Python values bullet: inside a loop a sown
    # Python number becomes an array, stacked per iteration, where Flax
    # 0.12.8 folds it once at trace time in a jax.lax.scan body.
    return 'a Python number sown in a lax.scan body (Known differences)'
  return None


@dataclasses.dataclass(frozen=True)
class Program:
  name: str
  spec: Spec
  source: str
  excluded: str | None
  errors_only: str | None = None


def programs(seed: int, count: int) -> list[Program]:
  """``count`` programs: the targeted ones first, then random ones."""
  specs = list(TARGETED[:count])
  rng = random.Random(seed)
  while len(specs) < count:
    specs.append(random_spec(rng))
  return [
      Program(f'p{i:04d}', s, source(s), excluded(s), errors_only(s))
      for i, s in enumerate(specs)
  ]


# ----------------------------------------------------------------------------
# The runner (executed as a script in a fresh interpreter).


def _to_pure(value: tp.Any, path: str, jax, nnx, np) -> tp.Any:
  """``value`` as pure Python and numpy; raises _Leaked on a tracer."""
  if isinstance(value, jax.core.Tracer):
    raise _Leaked(path)
  if isinstance(value, nnx.Variable):
    inner = _to_pure(value.get_value(), path, jax, nnx, np)
    return ('Variable', type(value).__name__, inner)
  if isinstance(value, (nnx.State, dict)) or hasattr(value, 'items'):
    return {
        k: _to_pure(v, f'{path}/{k!r}', jax, nnx, np)
        for k, v in value.items()
    }
  if isinstance(value, (list, tuple)):
    items = [
        _to_pure(v, f'{path}[{i}]', jax, nnx, np) for i, v in enumerate(value)
    ]
    return tuple(items) if isinstance(value, tuple) else items
  if isinstance(value, jax.Array):
    return np.asarray(value)
  if isinstance(value, (int, float)) and hasattr(value, 'aval'):
    # JAX's TypedInt/TypedFloat: a jitted function's literal output, a
    # weakly typed JAX scalar (Flax returns one where an nnx.remat body's
    # fold is constant), not a Python number a user sowed.
    return np.asarray(value, dtype=value.dtype)
  if value is None or isinstance(value, (bool, int, float, str, np.ndarray,
                                         np.generic)):
    return value
  return ('UNKNOWN', type(value).__name__, repr(value))


class _Leaked(Exception):
  pass


def _run_one(src: str, jax, nnx, np) -> tp.Any:
  namespace = {'__name__': 'nnx_diff_program'}
  try:
    exec(compile(src, '<program>', 'exec'), namespace)  # noqa: S102
    result = namespace['run']()
    return _to_pure(result, '', jax, nnx, np)
  except _Leaked as e:
    return ('LEAKED', str(e))
  except Exception as e:  # noqa: BLE001 -- reported, compared by the test
    return ('ERROR', f'{type(e).__name__}: {e}'[:2000])


def main(argv: list[str]) -> None:
  shims = '--shims' in argv
  paths = [a for a in argv[1:] if not a.startswith('--')]
  if shims:
    import flax.nnx.sow  # noqa: F401,PLC0415
    from flax.nnx.sow import nnx_shims  # noqa: PLC0415

    assert nnx_shims.installed()
  import json  # noqa: PLC0415
  import pickle  # noqa: PLC0415
  import warnings  # noqa: PLC0415

  import jax  # noqa: PLC0415
  import numpy as np  # noqa: PLC0415
  from flax import nnx  # noqa: PLC0415

  if not shims:
    assert 'flax.nnx.sow' not in sys.modules
  warnings.simplefilter('ignore', DeprecationWarning)
  with open(paths[0]) as f:
    batch = json.load(f)
  results = {p['name']: _run_one(p['source'], jax, nnx, np) for p in batch}
  results['__shims__'] = 'flax.nnx.sow' in sys.modules
  with open(paths[1], 'wb') as f:
    pickle.dump(results, f)


if __name__ == '__main__':
  main(sys.argv)
