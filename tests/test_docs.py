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
shown as Python). A ```text block directly preceded by ``<!-- output -->``
must appear verbatim in what the file's Python blocks print, so printed
jaxprs in the docs stay real.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import pathlib
import re
import tempfile

from absl.testing import absltest, parameterized

ROOT = pathlib.Path(__file__).resolve().parent.parent
SKIP_MARK = '<!-- skip -->'
OUTPUT_MARK = '<!-- output -->'
_FENCE_CLOSE = re.compile(r'^```\s*$')


@dataclasses.dataclass(frozen=True)
class Block:
  path: pathlib.Path
  line: int  # 1-based line of the first line of code
  code: str
  mark: str  # the last non-empty line before the opening fence


def doc_files() -> list[pathlib.Path]:
  return [ROOT / 'README.md', *sorted((ROOT / 'docs').glob('*.md'))]


def fenced_blocks(path: pathlib.Path, language: str) -> list[Block]:
  """The ```language blocks of a Markdown file, in order."""
  fence_open = re.compile(rf'^```{re.escape(language)}\s*$')
  lines = path.read_text(encoding='utf-8').splitlines()
  blocks = []
  i = 0
  while i < len(lines):
    if not fence_open.match(lines[i]):
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
      raise ValueError(f'{path}:{i + 1}: ```{language} block is never closed')
    blocks.append(
        Block(
            path=path,
            line=start + 1,
            code='\n'.join(lines[start:end]) + '\n',
            mark=previous,
        )
    )
    i = end + 1
  return blocks


def python_blocks(path: pathlib.Path) -> list[Block]:
  return fenced_blocks(path, 'python')


def output_blocks(path: pathlib.Path) -> list[Block]:
  """The ```text blocks marked as printed output of the Python blocks."""
  return [b for b in fenced_blocks(path, 'text') if b.mark == OUTPUT_MARK]


def run_blocks(blocks: list[Block]) -> tuple[int, str]:
  """Executes the blocks in one namespace.

  Returns:
    How many blocks ran (those not marked skip), and what they printed.
  """
  namespace = {'__name__': '__doc_test__'}
  ran = 0
  printed = io.StringIO()
  with contextlib.redirect_stdout(printed):
    for block in blocks:
      if block.mark == SKIP_MARK:
        continue
      # Padding with newlines makes tracebacks point at the Markdown line.
      source = '\n' * (block.line - 1) + block.code
      exec(compile(source, str(block.path), 'exec'), namespace)
      ran += 1
  return ran, printed.getvalue()


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
    self.assertEqual(
        [b.mark == SKIP_MARK for b in blocks], [False, True, False]
    )
    self.assertEqual(blocks[2].code, 'y = x + 1\n')
    self.assertEqual(run_blocks(blocks), (2, ''))

  def test_output_blocks_and_printed_text(self):
    path = self.write_doc(
        '```python\n'
        'print(6 * 7)\n'
        '```\n'
        '<!-- output -->\n'
        '```text\n'
        '42\n'
        '```\n'
        '```text\n'
        'not checked\n'
        '```\n'
    )
    self.assertEqual([b.code for b in output_blocks(path)], ['42\n'])
    self.assertEqual(run_blocks(python_blocks(path)), (1, '42\n'))

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
    ran, printed = run_blocks(blocks)
    self.assertGreater(ran, 0)
    # Output shown in the docs (a ```text block after <!-- output -->) is
    # what the code above it really prints.
    for block in output_blocks(path):
      self.assertIn(
          block.code.strip(),
          printed,
          f'{path}:{block.line}: this output is not what the code prints;'
          " regenerate it by running the page's ```python blocks",
      )


if __name__ == '__main__':
  absltest.main()
