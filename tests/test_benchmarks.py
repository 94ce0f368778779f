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

"""Smoke test of ``benchmarks/run.py --quick``: structure, not speed.

The benchmarks compare timings on shared machines, so nothing here asserts
a ratio or meets a target; it checks that every benchmark runs, writes the
JSON the README documents, and that its figures are finite and positive.
"""

import json
import math
import os
import subprocess
import sys
import tempfile

from absl.testing import absltest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUN = os.path.join(ROOT, 'benchmarks', 'run.py')

EXPECTED_NAMES = {
    'jit_runtime', 'first_call[1]', 'first_call[2]', 'trace[1]', 'trace[2]',
    'eager_dispatch', 'memory_runtime', 'eager_nnx', 'eager_nnx[overhead]',
    'rewrite_scaling',
    'rewrite_scaling[gc]', 'rewrite_scaling[loop]', 'eager_jitted',
    'eager_plain', 'eager_functional', 'eager_names', 'perturb_grad',
    'intervene_runtime',
    'sharded_step', 'sow_dispatch',
    'reduce_memory[reduce]', 'reduce_memory[stacked]', 'nnx_step[steady]',
    'nnx_step[first_call]',
}
FIELDS = {
    'name': str, 'a': str, 'b': str, 'a_median': float, 'b_median': float,
    'unit': str, 'ratio': float, 'ratio_kind': str, 'sizes': dict,
    'repeats': int, 'extra': dict,
}


def _positive_finite(x) -> bool:
  return (isinstance(x, (int, float)) and not isinstance(x, bool)
          and math.isfinite(x) and x > 0)


class QuickRunTest(absltest.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    with tempfile.TemporaryDirectory() as tmp:
      path = os.path.join(tmp, 'out.json')
      cls.proc = subprocess.run(
          [sys.executable, RUN, '--quick', '--json', path],
          capture_output=True, text=True, timeout=600, cwd=ROOT,
          check=False)
      cls.rows = None
      if os.path.exists(path):
        with open(path) as fp:
          cls.rows = json.load(fp)

  def test_exits_cleanly(self):
    self.assertEqual(
        self.proc.returncode, 0,
        msg=f'stdout:\n{self.proc.stdout}\nstderr:\n{self.proc.stderr}')

  def test_json_has_every_benchmark_once(self):
    self.assertIsNotNone(self.rows, msg=self.proc.stderr)
    self.assertIsInstance(self.rows, list)
    names = [r['name'] for r in self.rows]
    self.assertCountEqual(names, EXPECTED_NAMES)

  def test_rows_have_the_documented_fields(self):
    self.assertIsNotNone(self.rows, msg=self.proc.stderr)
    for row in self.rows:
      with self.subTest(row.get('name')):
        self.assertNotIn('error', row)
        for field, kind in FIELDS.items():
          self.assertIn(field, row)
          if kind is float:
            self.assertIsInstance(row[field], (int, float))
          else:
            self.assertIsInstance(row[field], kind)
        self.assertIn(row['unit'], ('s', 's/eqn', 'bytes'))
        self.assertIn('target', row)
        self.assertIn('met', row)
        if row['target'] is None:
          self.assertIsNone(row['met'])
        else:
          self.assertTrue(_positive_finite(row['target']))
          self.assertEqual(row['met'], row['ratio'] <= row['target'])
        self.assertGreaterEqual(row['repeats'], 1)
        self.assertNotEmpty(row['sizes'])

  def test_figures_are_finite_and_positive(self):
    self.assertIsNotNone(self.rows, msg=self.proc.stderr)
    for row in self.rows:
      with self.subTest(row.get('name')):
        for field in ('a_median', 'b_median', 'ratio'):
          self.assertTrue(_positive_finite(row.get(field)),
                          msg=f'{field} = {row.get(field)!r}')

  def test_prints_a_table_with_every_row(self):
    self.assertIsNotNone(self.rows, msg=self.proc.stderr)
    for row in self.rows:
      self.assertIn(f'| {row["name"]} |', self.proc.stdout)


if __name__ == '__main__':
  absltest.main()
