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

"""Runs the ``>>>`` examples in the package's docstrings."""

import doctest
import importlib
import pkgutil

from absl.testing import absltest
from absl.testing import parameterized

import flax.nnx.sow

_MODULES = sorted(
    m.name
    for m in pkgutil.walk_packages(flax.nnx.sow.__path__, 'flax.nnx.sow.')
)


class DoctestTest(parameterized.TestCase):

  @parameterized.parameters(*_MODULES)
  def test_docstring_examples(self, module_name):
    module = importlib.import_module(module_name)
    result = doctest.testmod(
        module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
    )
    self.assertEqual(result.failed, 0, f'{module_name}: {result}')


if __name__ == '__main__':
  absltest.main()
