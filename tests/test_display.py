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

"""How a ``Collected`` is shown: ``repr`` as a table, treescope as a dict."""

from absl.testing import absltest
import jax
import jax.numpy as jnp
import numpy as np
import treescope

from flax.nnx.sow import Collected
from flax.nnx.sow import capture
from flax.nnx.sow import perturb
from flax.nnx.sow import sow


def _loss(w, x):
  h = sow(jnp.tanh(w * x), name='h')
  h = perturb(h, name='dh')
  sow({'a': h, 'b': h.sum()}, name=('blocks', 0, 'act'))
  sow(h.sum(), name='tot', reduce_fn=lambda a, b: a + b, init_fn=lambda: 0.0)
  return jnp.sum(h**2)


class ReprTest(absltest.TestCase):

  def test_table_has_one_row_per_name(self):
    _, c = capture(jax.grad(_loss))(0.5, jnp.arange(3.0))
    self.assertEqual(
        repr(c),
        'Collected(4 names:\n'
        "  'h'                   1 entry  float32[3]\n"
        "  'dh'                  1 entry  float32[3]  (cotangent)\n"
        "  ('blocks', 0, 'act')  1 entry  float32[3], float32[]\n"
        "  'tot'                 reduced  float32[]\n"
        ')',
    )

  def test_no_array_values_in_the_repr(self):
    x = jnp.full((2, 3), 0.123456)
    _, c = capture(lambda x: sow(x, name='x') + sow(x, name='x'))(x)
    self.assertNotIn('0.123', repr(c))
    self.assertIn("'x'  2 entries  float32[2, 3]", repr(c))

  def test_empty_and_python_numbers(self):
    self.assertEqual(repr(Collected()), 'Collected(0 names)')
    self.assertIn("'n'  1 entry  float", repr(Collected(n=(0.5,))))

  def test_repr_under_jit_shows_the_abstract_leaves(self):
    seen = []

    def f(x):
      out, c = capture(lambda x: sow(x * 2, name='y'))(x)
      seen.append(repr(c))
      return out

    jax.jit(f)(np.ones((4,), np.int32))
    self.assertEqual(seen, ["Collected(1 name:\n  'y'  1 entry  int32[4]\n)"])


class TreescopeTest(absltest.TestCase):

  def test_renders_as_a_dict_with_its_values(self):
    _, c = capture(lambda x: sow(x, name=('a', 1)))(jnp.array([1.5, 2.5]))
    text = treescope.render_to_text(c)
    self.assertTrue(text.startswith('Collected({'), text)
    self.assertIn("('a', 1):", text)
    self.assertIn('1.5', text)


if __name__ == '__main__':
  absltest.main()
