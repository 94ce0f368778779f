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

"""Importing ``flax.nnx.sow`` changes no program that holds no sow.

The package installs rules and wrappers into JAX when it is imported
(partial-evaluation rules, batching wrappers, ...). Each must take JAX's own
path for an equation with no sow a capture is staging. This test stages the
sow-free programs of ``import_invariance_programs.py`` in two fresh
interpreters, one that imports ``flax.nnx.sow`` first and one that never
imports it, and compares the jaxprs as text.
"""

from __future__ import annotations

import difflib
import json
import os
import pathlib
import re
import subprocess
import sys

from absl.testing import absltest

HERE = pathlib.Path(__file__).resolve().parent
PROGRAMS = HERE / 'import_invariance_programs.py'
TIMEOUT_S = 300

sys.path.insert(0, str(HERE))
try:
  import import_invariance_programs as corpus  # pylint: disable=g-import-not-at-top
finally:
  sys.path.remove(str(HERE))


def _stage_in_fresh_interpreters() -> tuple[dict, dict]:
  """The reports of the corpus run without and with ``flax.nnx.sow``."""
  env = dict(os.environ)  # XLA_FLAGS asks for 8 devices (conftest.py)
  env['JAX_PLATFORMS'] = 'cpu'
  procs = [
      subprocess.Popen(
          [sys.executable, str(PROGRAMS), *flags],
          env=env,
          stdout=subprocess.PIPE,
          stderr=subprocess.PIPE,
          text=True,
          cwd=str(HERE),
      )
      for flags in ((), ('--import-sow',))
  ]
  try:
    outputs = [p.communicate(timeout=TIMEOUT_S) for p in procs]
  finally:
    for p in procs:  # never leave a process behind
      if p.poll() is None:
        p.kill()
        p.wait()
  reports = []
  for p, (out, err) in zip(procs, outputs):
    if p.returncode != 0:
      raise AssertionError(
          f'{" ".join(p.args)} exited with {p.returncode}:\n{out}\n{err}'
      )
    lines = [l for l in out.splitlines() if l.startswith('RESULT ')]
    if len(lines) != 1:
      raise AssertionError(f'no single RESULT line:\n{out}\n{err}')
    reports.append(json.loads(lines[0][len('RESULT ') :]))
  return reports[0], reports[1]


class ImportInvarianceTest(absltest.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.without, cls.with_sow = _stage_in_fresh_interpreters()

  def test_interpreters_differ_only_by_the_import(self):
    self.assertFalse(self.without['sow_imported'])
    self.assertTrue(self.with_sow['sow_imported'])
    for report in (self.without, self.with_sow):
      self.assertEqual(report['device_count'], corpus.DEVICES)
      self.assertEqual(sorted(report['jaxprs']), sorted(corpus.programs()))

  def test_every_program_stages_without_the_import(self):
    errors = {
        name: text
        for name, text in self.without['jaxprs'].items()
        if text.startswith('ERROR')
    }
    self.assertEmpty(errors)

  def test_programs_exercise_their_construct(self):
    # Each program's jaxpr shows the primitives it is meant to stage (a
    # construct that JAX inlines or rewrites would test nothing).
    missing = [
        (name, primitive)
        for name, (_, _, needs) in corpus.programs().items()
        for primitive in needs
        if not re.search(rf'\b{primitive}\b', self.without['jaxprs'][name])
    ]
    self.assertEmpty(missing)

  def test_corpus_exercises_the_offload_branch(self):
    # Without the import, JAX's default partial evaluation offloads the
    # policy's values to host memory and back: the branch a rule copied
    # from JAX's default once dropped.
    for name, count in corpus.OFFLOADING.items():
      text = self.without['jaxprs'][name]
      self.assertEqual(text.count('device_put'), count, msg=name)
      self.assertIn('MemorySpace.Host', text, msg=name)

  def test_jaxprs_identical_with_and_without_the_import(self):
    changed = [
        name
        for name, text in self.without['jaxprs'].items()
        if self.with_sow['jaxprs'].get(name) != text
    ]
    diffs = [
        f'--- {name}\n'
        + '\n'.join(
            difflib.unified_diff(
                self.without['jaxprs'][name].splitlines(),
                self.with_sow['jaxprs'].get(name, '').splitlines(),
                'without flax.nnx.sow',
                'with flax.nnx.sow',
                lineterm='',
            )
        )
        for name in changed
    ]
    self.assertEmpty(changed, msg='\n'.join(diffs))


if __name__ == '__main__':
  absltest.main()
