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

"""Functional capture of intermediate values: ``sow``, ``capture``, ``perturb``.

``sow(value, name=...)`` tags a value anywhere in a JAX program;
``capture(f)`` returns ``(f(...), collected)`` with every tagged value by
name; ``perturb(value, name=...)`` collects the cotangent arriving at a value;
``intervene(f, values)`` replaces sown values (activation patching).
Importing this package installs the NNX shims (``nnx_shims.install()``):
``nnx.Module.sow``, ``nnx.Module.perturb`` and ``nnx.capture`` then run on
``capture``; ``nnx_shims.uninstall()`` restores Flax's originals. It replaces
nothing in JAX: the patch inventory (``_jax_patches.py``) is installed when
the first ``capture`` or ``intervene`` stages its function. See
``docs/guide.md`` and ``docs/migration.md``.
"""

from flax.nnx.sow import constructs as _constructs  # registers every construct
from flax.nnx.sow import toplevel as _toplevel  # PR: toplevel
from flax.nnx.sow import accumulators as _accumulators  # PR: reductions
from flax.nnx.sow.nnx import shims as nnx_shims  # PR: nnx
from flax.nnx.sow.nnx import state  # PR: nnx
from flax.nnx.sow.collect import Collected
from flax.nnx.sow.capturing import capture
from flax.nnx.sow.collect import collect_rules
from flax.nnx.sow.inject import intervene  # PR: intervene
from flax.nnx.sow.loop_index import loop_indices  # PR: intervene
from flax.nnx.sow.patching import patching_grid  # PR: intervene
from flax.nnx.sow.names import as_path  # PR: name_keys
from flax.nnx.sow.names import grad_name  # PR: perturb
from flax.nnx.sow.api import perturb  # PR: perturb
from flax.nnx.sow.api import sow
from flax.nnx.sow.primitive import sow_p
from flax.nnx.sow.nnx.state import collected_to_state  # PR: nnx
from flax.nnx.sow.nnx.state import flatten_names  # PR: nnx_functional
from flax.nnx.sow.nnx.hooks import module_outputs  # PR: nnx_functional
from flax.nnx.sow.nnx.state import state_to_collected  # PR: nnx_functional

nnx_shims.install()  # PR: nnx

__all__ = [
    'Collected',
    'as_path',  # PR: name_keys
    'capture',
    'collect_rules',
    'collected_to_state',  # PR: nnx
    'flatten_names',  # PR: nnx_functional
    'grad_name',  # PR: perturb
    'intervene',  # PR: intervene
    'loop_indices',  # PR: intervene
    'module_outputs',  # PR: nnx_functional
    'nnx_shims',  # PR: nnx
    'patching_grid',  # PR: intervene
    'perturb',  # PR: perturb
    'sow',
    'sow_p',
    'state',  # PR: nnx
    'state_to_collected',  # PR: nnx_functional
]

del _constructs
del _toplevel  # PR: toplevel
del _accumulators  # PR: reductions
