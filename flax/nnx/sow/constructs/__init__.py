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

Each file holds everything about its construct: the capture rule (registered
in ``collect.collect_rules``), the intervene rule
(``inject.intervene_rules``), its rule of ``control.py``'s pass, and any
batching or partial-evaluation wrapper it needs (registered with
``_jax_patches.register``, installed by the package).

* ``calls.py``: ``jit``, ``closed_call``, ``call``, ``remat``.
* ``custom.py``: ``custom_jvp``, ``custom_vjp`` (and ``optimize_remat``),
  ``custom_vmap``.
* ``linear_solve.py``: ``custom_linear_solve``.
* ``scan.py``, ``while_loop.py``, ``cond.py`` (``cond`` and ``switch``).
* ``shard_map.py``: ``shard_map`` and so ``pmap``.
* ``rows.py``: ``loop_row``, the row of a stacked constant for the current
  iteration of a ``scan`` or ``vmap``.
* ``adapter.py``: the binders every rule adds (leading constants, trailing
  inputs and outputs); ``batched.py``: the half of the ``scan``/``cond``
  batching wrappers they share.

Importing this package registers every construct.
"""

from flax.nnx.sow.constructs import calls
from flax.nnx.sow.constructs import cond
from flax.nnx.sow.constructs import custom
from flax.nnx.sow.constructs import linear_solve
from flax.nnx.sow.constructs import rows
from flax.nnx.sow.constructs import scan
from flax.nnx.sow.constructs import shard_map
from flax.nnx.sow.constructs import while_loop

__all__ = [
    'calls',
    'cond',
    'custom',
    'linear_solve',
    'rows',
    'scan',
    'shard_map',
    'while_loop',
]
