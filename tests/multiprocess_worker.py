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

"""One process of the two-process run in ``test_sharding.MultiProcessTest``.

Run as ``python multiprocess_worker.py PROCESS_ID PORT REFERENCE.npz``, with
``XLA_FLAGS=--xla_force_host_platform_device_count=4``: it joins the other
process through ``jax.distributed.initialize`` (coordinator on
``localhost:PORT``, CPU collectives over gloo), builds a mesh of all 8
devices, runs a jitted data-parallel train step whose loss is captured, and
checks that every addressable shard of every collected array (and of the
updated parameters) equals the single-process reference the test computed
with :func:`reference`. It prints one line ``RESULT {json}`` and exits 0, or
raises.

Imported by the test only for :func:`reference` and the constants (no JAX
distribution happens at import).
"""

from __future__ import annotations

import json
import sys

import numpy as np

DEVICES = 8
LEARNING_RATE = 0.1
COLLECTED = ('h1', 'dh1', 'out', 'abs_h', 'loss', 'w1', 'w2')


def data():
  """The global batch and parameters; the same in every process."""
  rng = np.random.default_rng(7)
  x = rng.normal(size=(16, 4)).astype(np.float32)
  y = rng.normal(size=(16, 3)).astype(np.float32)
  w1 = rng.normal(size=(4, 6)).astype(np.float32)
  w2 = rng.normal(size=(6, 3)).astype(np.float32)
  return x, y, w1, w2


def per_device(a):
  a = np.asarray(a)
  return a.reshape(DEVICES, a.shape[0] // DEVICES, *a.shape[1:])


def reference() -> dict[str, np.ndarray]:
  """The train step on one device, without ``shard_map`` or ``sow``.

  Values are laid out as ``capture`` returns them from the sharded step:
  per-device values with a leading axis of 8, the loss without one.
  """
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top

  x, y, w1, w2 = data()

  def loss(w1, w2, dh):
    h = jnp.tanh(x @ w1) + dh
    return jnp.mean((h @ w2 - y) ** 2)

  h = np.tanh(x @ w1)
  value, (g1, g2, dh) = jax.value_and_grad(loss, (0, 1, 2))(
      w1, w2, jnp.zeros((16, 6))
  )
  return {
      'h1': per_device(h),
      'dh1': per_device(dh),
      'out': per_device(h @ w2),
      'abs_h': per_device(np.abs(h)).sum((1, 2)),
      'loss': np.asarray(value),
      'w1': np.asarray(w1 - LEARNING_RATE * g1),
      'w2': np.asarray(w2 - LEARNING_RATE * g2),
  }


def train_step_fn(mesh):
  """A jitted data-parallel SGD step whose loss is captured."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from jax.sharding import PartitionSpec as P  # pylint: disable=g-import-not-at-top

  from flax.nnx.sow import capture, perturb, sow  # pylint: disable=g-import-not-at-top

  def body(params, x, y):
    w1, w2 = params
    h = perturb(sow(jnp.tanh(x @ w1), name='h1'), name='dh1')
    sow(
        jnp.abs(h).sum(),
        name='abs_h',
        reduce_fn=lambda a, v: a + v,
        init_fn=lambda: jnp.float32(0),
    )
    out = sow(h @ w2, name='out')
    loss = jax.lax.pmean(jnp.mean((out - y) ** 2), 'data')
    return sow(loss, name='loss')

  loss_fn = jax.shard_map(
      body, mesh=mesh, in_specs=(P(), P('data'), P('data')), out_specs=P()
  )

  @jax.jit
  def train_step(params, x, y):
    (loss, grads), collected = capture(jax.value_and_grad(loss_fn))(
        params, x, y
    )
    params = jax.tree.map(lambda p, g: p - LEARNING_RATE * g, params, grads)
    return params, loss, collected

  return train_step


def main(process_id: int, port: int, reference_path: str) -> None:
  import jax  # pylint: disable=g-import-not-at-top

  jax.config.update('jax_cpu_collectives_implementation', 'gloo')
  jax.distributed.initialize(
      coordinator_address=f'localhost:{port}',
      num_processes=2,
      process_id=process_id,
      initialization_timeout=60,
  )
  from jax.sharding import NamedSharding  # pylint: disable=g-import-not-at-top
  from jax.sharding import PartitionSpec as P  # pylint: disable=g-import-not-at-top

  assert jax.device_count() == DEVICES, jax.devices()
  mesh = jax.make_mesh(
      (DEVICES,), ('data',), axis_types=(jax.sharding.AxisType.Auto,)
  )

  def global_array(a, spec):
    return jax.make_array_from_callback(
        a.shape, NamedSharding(mesh, spec), lambda index: a[index]
    )

  x, y, w1, w2 = data()
  params = (global_array(w1, P()), global_array(w2, P()))
  (new_w1, new_w2), _, collected = train_step_fn(mesh)(
      params, global_array(x, P('data')), global_array(y, P('data'))
  )
  arrays = {
      'h1': collected['h1'][0],
      'dh1': collected['dh1'][0],
      'out': collected['out'][0],
      'abs_h': collected['abs_h'],
      'loss': collected['loss'][0],
      'w1': new_w1,
      'w2': new_w2,
  }
  assert list(collected) == ['h1', 'dh1', 'abs_h', 'out', 'loss'], list(
      collected
  )
  expected = np.load(reference_path)
  checked = {}
  for name, array in arrays.items():
    assert array.shape == expected[name].shape, (name, array.shape)
    shards = array.addressable_shards
    for shard in shards:
      np.testing.assert_allclose(
          np.asarray(shard.data),
          expected[name][shard.index],
          rtol=1e-5,
          atol=1e-6,
          err_msg=f'{name} on {shard.device}',
      )
    checked[name] = len(shards)
  print(
      'RESULT '
      + json.dumps(
          {
              'process_index': jax.process_index(),
              'process_count': jax.process_count(),
              'device_count': jax.device_count(),
              'checked': checked,
          }
      ),
      flush=True,
  )
  jax.distributed.shutdown()


if __name__ == '__main__':
  main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
