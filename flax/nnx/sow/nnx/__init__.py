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

"""The NNX layer: the only part of ``flax.nnx.sow`` that imports ``flax.nnx``.

* ``scope.py``: module paths for ``Module.sow`` (roots, copies Flax makes).
* ``calls.py``: capturing and intervening functions of NNX graph nodes (the
  call hook the core runs around every captured call).
* ``shims.py``: ``Module.sow``, ``Module.perturb`` and ``nnx.capture`` on the
  core.
* ``state.py``: ``collected`` <-> ``nnx.State``.
* ``slices.py``: one accumulator per slice of a module that ``nnx.scan`` or
  ``nnx.vmap`` slices.
* ``hooks.py``: module calls as hook points (``module_outputs``, and the
  method wrapper of ``nnx.capture(..., method_outputs=...)``).
* ``flax_hooks.py``: the only file that replaces Flax objects (the inventory
  of what is replaced, why, and the public Flax hook that would replace it).

It reaches the functional core through its public names and the core's
registries (``collect.call_hooks``, ``collect.opaque_leaf_checks``,
``intervene.values_converters``); the core never imports it.
"""
