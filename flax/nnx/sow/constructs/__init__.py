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

"""One file per higher-order primitive: what a sow inside it does.

Each file holds what one pull request of the series (``docs/upstream.md``)
adds for its construct: the capture rule (registered in
``collect.collect_rules``), the intervene rule (``inject.intervene_rules``)
and any batching or partial-evaluation wrapper it needs (registered with
``_jax_patches.register``, installed by the package). Behaviour of a
construct that a later pull request brings sits in a file of its own.

* ``calls.py``: ``jit``, ``closed_call``, ``call``, ``remat``;
  ``calls_intervene.py``: their intervene rules.
* ``custom.py``: ``custom_jvp``, ``custom_vjp`` (and ``optimize_remat``),
  ``custom_vmap``.
* ``linear_solve.py``: ``custom_linear_solve``.
* ``scan.py``, ``while_loop.py``, ``cond.py`` (``cond`` and ``switch``);
  ``loops_control.py``: their rules of ``control.py``'s pass;
  ``partial_eval.py``: the sows JAX's partial evaluation moves or copies
  (loop-invariant hoisting, split ``while_loop``s, unused ``checkpoint``s).
* ``shard_map.py``: ``shard_map`` and so ``pmap``.
* ``rows.py``: ``loop_row``, the row of a stacked constant for the current
  iteration of a ``scan`` (a marker the ``scan`` rules feed as an ``xs``) or
  ``vmap``.
* ``adapter.py``: the binders every rule adds (leading constants, trailing
  inputs and outputs); ``batched.py``: the half of the ``scan``/``cond``
  batching wrappers they share.

Importing this package registers every construct. A line that only a later
pull request needs ends in ``# PR: <name>`` (the name in
``docs/upstream.md``'s series); ``tests/test_series.py`` drops it when it
assembles an earlier prefix of the series.
"""

from flax.nnx.sow.constructs import calls
from flax.nnx.sow.constructs import calls_intervene  # PR: intervene
from flax.nnx.sow.constructs import cond  # PR: loops
from flax.nnx.sow.constructs import custom  # PR: custom
from flax.nnx.sow.constructs import linear_solve  # PR: linear_solve
from flax.nnx.sow.constructs import loops_control  # PR: shard_map
from flax.nnx.sow.constructs import partial_eval  # PR: partial_eval
from flax.nnx.sow.constructs import rows  # PR: nnx_transforms
from flax.nnx.sow.constructs import scan  # PR: loops
from flax.nnx.sow.constructs import shard_map  # PR: shard_map
from flax.nnx.sow.constructs import while_loop  # PR: loops

__all__ = [
    'calls',
    'calls_intervene',  # PR: intervene
    'cond',  # PR: loops
    'custom',  # PR: custom
    'linear_solve',  # PR: linear_solve
    'loops_control',  # PR: shard_map
    'partial_eval',  # PR: partial_eval
    'rows',  # PR: nnx_transforms
    'scan',  # PR: loops
    'shard_map',  # PR: shard_map
    'while_loop',  # PR: loops
]
