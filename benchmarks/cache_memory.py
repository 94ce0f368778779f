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

"""Do capture's caches stay bounded over many distinct functions?

Captures ``--count`` distinct functions (a fresh closure per call, as a
notebook or a sweep makes them) of each kind, and prints the resident set
size before and after, next to the same loop without ``capture`` (JAX's own
caches grow too, e.g. one executable per distinct eager ``scan``), and the
number of entries left in this package's caches after a garbage collection.

  python benchmarks/cache_memory.py --count 10000
"""

from __future__ import annotations

import argparse
import gc
import os
import time

import jax
import jax.numpy as jnp

from flax.nnx.sow import capture
from flax.nnx.sow import collect
from flax.nnx.sow import sites
from flax.nnx.sow import sow


def rss_mib() -> float:
  with open('/proc/self/statm') as f:
    return int(f.read().split()[1]) * os.sysconf('SC_PAGE_SIZE') / 2**20


def make(kind: str, i: int, with_sow: bool):
  mark = sow if with_sow else (lambda v, **_: v)
  if kind == 'plain':  # the top-level edit
    return lambda x: mark(jnp.tanh(x) * i, name='h') + 1.0
  if kind == 'reduced':  # the interpreter, a fresh lambda per call
    return lambda x: mark(
        x * i,
        name='r',
        reduce_fn=lambda a, b: a + jnp.sum(b),
        init_fn=lambda: 0.0,
    )

  def scanned(x):  # a rule with a rewritten body, under jit
    def body(c, v):
      mark(
          c * v,
          name='s',
          reduce_fn=lambda a, b: a + jnp.sum(b),
          init_fn=lambda: 0.0,
      )
      mark(jnp.sum(x), name='inv')
      return c + v * i, None

    return jax.lax.scan(body, x, jnp.ones((3, 4)))[0]

  return scanned


def run(kind: str, count: int, with_sow: bool) -> tuple[float, float, float]:
  x = jnp.ones(4)
  for i in range(20):  # warm up op-by-op caches
    _call(kind, i, with_sow, x)
  gc.collect()
  before, start = rss_mib(), time.perf_counter()
  for i in range(count):
    _call(kind, i, with_sow, x)
  gc.collect()
  return before, rss_mib(), time.perf_counter() - start


def _call(kind, i, with_sow, x):
  f = make(kind, i, with_sow)
  g = capture(f) if with_sow else (lambda x: (f(x), {}))
  if kind == 'scan':
    g = jax.jit(g)
  jax.block_until_ready(g(x))


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument('--count', type=int, default=10000)
  parser.add_argument('--scan-count', type=int, default=1000)
  args = parser.parse_args()
  for kind in ('plain', 'reduced', 'scan'):
    n = args.scan_count if kind == 'scan' else args.count
    for with_sow in (False, True):
      before, after, secs = run(kind, n, with_sow)
      print(
          f'{kind:8s} {"capture" if with_sow else "no sow ":8s} n={n:6d}'
          f' RSS {before:7.1f} -> {after:7.1f} MiB'
          f' (+{after - before:6.1f}) in {secs:6.1f} s',
          flush=True,
      )
  gc.collect()
  print(
      'entries left: sow_sites',
      len(sites._sites_cache),  # pylint: disable=protected-access
      'rewrites',
      len(collect._rewrite_cache),  # pylint: disable=protected-access
  )


if __name__ == '__main__':
  main()
