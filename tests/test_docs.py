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

"""Runs every ```python block of README.md and docs/*.md.

One test per file: its blocks run in order in one fresh namespace, so a later
block may use what an earlier one defined. A block directly preceded by the
line ``<!-- skip -->`` is not run (meant only for shell sessions or output
shown as Python).
"""

from __future__ import annotations

import dataclasses
import pathlib
import re
import tempfile

from absl.testing import absltest, parameterized

ROOT = pathlib.Path(__file__).resolve().parent.parent
SKIP_MARK = '<!-- skip -->'
_FENCE_OPEN = re.compile(r'^```python\s*$')
_FENCE_CLOSE = re.compile(r'^```\s*$')


@dataclasses.dataclass(frozen=True)
class Block:
  path: pathlib.Path
  line: int  # 1-based line of the first line of code
  code: str
  skip: bool


def doc_files() -> list[pathlib.Path]:
  return [ROOT / 'README.md', *sorted((ROOT / 'docs').glob('*.md'))]


def python_blocks(path: pathlib.Path) -> list[Block]:
  """The ```python blocks of a Markdown file, in order."""
  lines = path.read_text(encoding='utf-8').splitlines()
  blocks = []
  i = 0
  while i < len(lines):
    if not _FENCE_OPEN.match(lines[i]):
      i += 1
      continue
    previous = next(
        (line.strip() for line in reversed(lines[:i]) if line.strip()), ''
    )
    start = i + 1
    end = start
    while end < len(lines) and not _FENCE_CLOSE.match(lines[end]):
      end += 1
    if end == len(lines):
      raise ValueError(f'{path}:{i + 1}: ```python block is never closed')
    blocks.append(
        Block(
            path=path,
            line=start + 1,
            code='\n'.join(lines[start:end]) + '\n',
            skip=previous == SKIP_MARK,
        )
    )
    i = end + 1
  return blocks


def run_blocks(blocks: list[Block]) -> int:
  """Executes the blocks in one namespace; returns how many ran."""
  namespace = {'__name__': '__doc_test__'}
  ran = 0
  for block in blocks:
    if block.skip:
      continue
    # Padding with newlines makes tracebacks point at the Markdown line.
    source = '\n' * (block.line - 1) + block.code
    exec(compile(source, str(block.path), 'exec'), namespace)
    ran += 1
  return ran


class ParserTest(absltest.TestCase):

  def write_doc(self, text: str) -> pathlib.Path:
    directory = tempfile.TemporaryDirectory()
    self.addCleanup(directory.cleanup)
    path = pathlib.Path(directory.name) / 'doc.md'
    path.write_text(text, encoding='utf-8')
    return path

  def test_finds_blocks_skip_marks_and_line_numbers(self):
    path = self.write_doc(
        'text\n'
        '```python\n'
        'x = 1\n'
        '```\n'
        '<!-- skip -->\n'
        '\n'
        '```python\n'
        'raise RuntimeError\n'
        '```\n'
        '```sh\n'
        'echo no\n'
        '```\n'
        '```python\n'
        'y = x + 1\n'
        '```\n'
    )
    blocks = python_blocks(path)
    self.assertEqual([b.line for b in blocks], [3, 8, 14])
    self.assertEqual([b.skip for b in blocks], [False, True, False])
    self.assertEqual(blocks[2].code, 'y = x + 1\n')
    self.assertEqual(run_blocks(blocks), 2)

  def test_traceback_points_at_markdown_line(self):
    path = self.write_doc('# t\n\n```python\nok = 1\nassert ok == 2\n```\n')
    try:
      run_blocks(python_blocks(path))
    except AssertionError as e:
      tb = e.__traceback__
    else:
      self.fail('the failing block did not raise')
    while tb.tb_next is not None:
      tb = tb.tb_next
    self.assertEqual(tb.tb_frame.f_code.co_filename, str(path))
    self.assertEqual(tb.tb_lineno, 5)


class DocsTest(parameterized.TestCase):

  @parameterized.named_parameters(
      (str(path.relative_to(ROOT)).replace('/', '_').replace('.', '_'), path)
      for path in doc_files()
      if path.exists()
  )
  def test_code_blocks_run(self, path):
    blocks = python_blocks(path)
    self.assertNotEmpty(blocks, f'{path} has no ```python block')
    self.assertGreater(run_blocks(blocks), 0)


if __name__ == '__main__':
  absltest.main()
