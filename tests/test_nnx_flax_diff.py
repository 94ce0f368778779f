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

"""The NNX shims return what Flax 0.12.8 itself returns.

``nnx_diff_programs.py`` generates programs whose modules call
``Module.sow``/``Module.perturb`` under NNX transforms and capture them with
``nnx.capture``. Two fresh interpreters run the same batch: one with plain
Flax 0.12.8 (``flax.nnx.sow`` never imported), one with the shims installed.
Wherever Flax returns a concrete result (no exception, no tracer in it),
the shims must return the same States, output and gradients (rtol 1e-5),
program by program; where the shims raise and Flax does not, that is a
failure too. Programs that the migration guide lists as behaving
differently (*Known differences*, and the table's rows where Flax's result
is no reference) are excluded (``nnx_diff_programs.excluded``), or checked
only for the shims not raising (``nnx_diff_programs.errors_only``). The
test prints how many programs were compared, skipped (Flax raised or
leaked a tracer) and excluded.

``SOW_NNX_DIFF_PROGRAMS=N`` runs N programs (default :data:`DEFAULT_COUNT`),
``SOW_NNX_DIFF_SEED=S`` another seed.
"""

from __future__ import annotations

import collections
import json
import os
import pathlib
import pickle
import subprocess
import sys
import tempfile
import time
import typing as tp

from absl.testing import absltest
import numpy as np

HERE = pathlib.Path(__file__).resolve().parent
RUNNER = HERE / 'nnx_diff_programs.py'
DEFAULT_COUNT = 48
TIMEOUT_S = 1200
RTOL = 1e-5
ATOL = 1e-6

sys.path.insert(0, str(HERE))
try:
  import nnx_diff_programs as generator  # noqa: E402
finally:
  sys.path.remove(str(HERE))


def _run_batches(batch: list[dict], tmp: str) -> tuple[dict, dict]:
  """The results of ``batch`` without and with the shims."""
  inp = os.path.join(tmp, 'programs.json')
  with open(inp, 'w') as f:
    json.dump(batch, f)
  env = dict(os.environ, JAX_PLATFORMS='cpu')
  outs = [os.path.join(tmp, f'{n}.pkl') for n in ('flax', 'shims')]
  procs = [
      subprocess.Popen(
          [sys.executable, str(RUNNER), *flags, inp, out],
          env=env,
          stdout=subprocess.PIPE,
          stderr=subprocess.PIPE,
          text=True,
          cwd=str(HERE),
      )
      for flags, out in zip(((), ('--shims',)), outs)
  ]
  try:
    logs = [p.communicate(timeout=TIMEOUT_S) for p in procs]
  finally:
    for p in procs:  # never leave a process behind
      if p.poll() is None:
        p.kill()
        p.wait()
  results = []
  for p, (stdout, stderr), out in zip(procs, logs, outs):
    if p.returncode != 0:
      raise AssertionError(
          f'{" ".join(p.args)} exited with {p.returncode}:\n{stdout}\n'
          f'{stderr[-5000:]}'
      )
    with open(out, 'rb') as f:
      results.append(pickle.load(f))
  return results[0], results[1]


def _is_status(value: tp.Any, status: str) -> bool:
  return (
      isinstance(value, tuple) and len(value) == 2 and value[0] == status
      and isinstance(value[1], str)
  )


def first_difference(a: tp.Any, b: tp.Any, path: str = '') -> str | None:
  """Where ``b`` (the shims) differs from ``a`` (Flax), or None."""
  if isinstance(a, dict) or isinstance(b, dict):
    if not (isinstance(a, dict) and isinstance(b, dict)):
      return f'{path}: {_describe(a)} != {_describe(b)}'
    # Key order is not compared: Flax's follows the order the States were
    # filled in, which no user code reads (State equality ignores it).
    if sorted(a, key=repr) != sorted(b, key=repr):
      return f'{path}: keys {sorted(a, key=repr)} != {sorted(b, key=repr)}'
    for k in a:
      d = first_difference(a[k], b[k], f'{path}/{k!r}')
      if d:
        return d
    return None
  if isinstance(a, (list, tuple)) or isinstance(b, (list, tuple)):
    if type(a) is not type(b) or len(a) != len(b):
      return f'{path}: {_describe(a)} != {_describe(b)}'
    for i, (x, y) in enumerate(zip(a, b)):
      d = first_difference(x, y, f'{path}[{i}]')
      if d:
        return d
    return None
  if isinstance(a, (np.ndarray, np.generic)) or isinstance(
      b, (np.ndarray, np.generic)
  ):
    if type(a) is not type(b):
      return f'{path}: {_describe(a)} != {_describe(b)}'
    if a.shape != b.shape or a.dtype != b.dtype:
      return f'{path}: {_describe(a)} != {_describe(b)}'
    try:
      np.testing.assert_allclose(b, a, rtol=RTOL, atol=ATOL)
    except AssertionError as e:
      return f'{path}: values differ\n{e}'
    return None
  if type(a) is not type(b) or a != b:
    return f'{path}: {_describe(a)} != {_describe(b)}'
  return None


def _describe(v: tp.Any) -> str:
  if isinstance(v, (np.ndarray, np.generic)):
    return f'{type(v).__name__}{v.shape} {v.dtype} {np.asarray(v).tolist()}'
  if isinstance(v, (list, tuple)):
    return f'{type(v).__name__} of {len(v)}: {v!r}'[:300]
  return f'{type(v).__name__} {v!r}'[:300]


def compare(
    programs: list[generator.Program], flax_results: dict, shim_results: dict
) -> tuple[collections.Counter, list[tuple[generator.Program, str]]]:
  """The counts, and each program whose shim result differs from Flax's
  with where it differs."""
  counts = collections.Counter(compared=0, failed=0)
  failures = []
  for p in programs:
    if p.excluded:
      counts['excluded'] += 1
      continue
    expected, actual = flax_results[p.name], shim_results[p.name]
    if _is_status(expected, 'ERROR'):
      counts['skipped: Flax raised'] += 1
      continue
    if _is_status(expected, 'LEAKED'):
      counts['skipped: Flax leaked a tracer'] += 1
      continue
    counts['compared'] += 1
    if _is_status(actual, 'ERROR') or _is_status(actual, 'LEAKED'):
      diff = f'shims: {actual[0]} {actual[1]}'
    elif p.errors_only:
      counts['compared: only that the shims return'] += 1
      diff = None
    else:
      diff = first_difference(expected, actual)
    if diff:
      counts['failed'] += 1
      failures.append((p, diff))
  return counts, failures


class NnxFlaxDiffTest(absltest.TestCase):

  def test_shims_return_what_flax_returns(self):
    count = int(os.environ.get('SOW_NNX_DIFF_PROGRAMS', DEFAULT_COUNT))
    seed = int(os.environ.get('SOW_NNX_DIFF_SEED', '0'))
    programs = generator.programs(seed, count)
    batch = [
        {'name': p.name, 'source': p.source}
        for p in programs
        if not p.excluded
    ]
    start = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
      flax_results, shim_results = _run_batches(batch, tmp)
    self.assertFalse(flax_results.pop('__shims__'))
    self.assertTrue(shim_results.pop('__shims__'))
    counts, failures = compare(programs, flax_results, shim_results)
    print(
        f'\nnnx diff: {len(programs)} programs (seed {seed}) in '
        f'{time.monotonic() - start:.1f} s: '
        + ', '.join(f'{k} {v}' for k, v in sorted(counts.items()))
    )
    if failures:
      self.fail(
          f'{len(failures)} of {counts["compared"]} programs differ from '
          'Flax 0.12.8:\n'
          + '\n'.join(
              f'--- {p.name} ({p.spec.kind}): {diff}\n{p.source}'
              for p, diff in failures
          )
      )


if __name__ == '__main__':
  absltest.main()
