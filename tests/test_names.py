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

"""Names as paths, and errors that say which name a mistyped one meant."""

import warnings

from absl.testing import absltest
import jax
import jax.numpy as jnp
import numpy as np

import flax.nnx.sow
from flax.nnx.sow import as_path
from flax.nnx.sow import capture
from flax.nnx.sow import sow
from flax.nnx.sow.capturing import UnusedNameWarning
from flax.nnx.sow.names import closest

# ``intervene`` lands with a later pull request than the classes of this
# file that run on earlier prefixes (``tests/test_series.py``).
intervene = getattr(flax.nnx.sow, 'intervene', None)


def _net(x):
  x = sow(x + 1.0, name=('blocks', 0, 'out'))
  x = sow(x * 2.0, name=('h',))
  return sow(x - 3.0, name='hidden')


class AsPathTest(absltest.TestCase):

  def test_one_predicate_for_str_and_tuple_names(self):
    def f(x):
      sow(x, name='resid')
      sow(x * 2, name=('blocks', 0, 'resid'))
      sow(x * 3, name='resi')  # n[-1] == 'resid' would be False here too
      return x

    _, c = capture(f, names=lambda n: as_path(n)[-1] == 'resid')(1.0)
    self.assertEqual(list(c), ['resid', ('blocks', 0, 'resid')])
    np.testing.assert_allclose(c[('blocks', 0, 'resid')][0], 2.0)

  def test_rejects_what_is_not_a_name(self):
    with self.assertRaisesRegex(TypeError, 'as_path: a sow name'):
      as_path(['a'])


class ClosestTest(absltest.TestCase):

  def test_the_same_path_written_the_other_way_comes_first(self):
    sown = [('blocks', 0, 'out'), ('h',), 'hidden']
    self.assertEqual(closest('blocks/0/out', sown)[0], ('blocks', 0, 'out'))
    self.assertEqual(closest('h', sown)[0], ('h',))
    self.assertEqual(closest(('hidden',), sown)[0], 'hidden')

  def test_spelling(self):
    self.assertEqual(closest('hiden', ['hidden', 'out', 'attn']), ['hidden'])
    self.assertEqual(closest('zzz', ['hidden', 'out']), [])


class InterveneKeyErrorTest(absltest.TestCase):

  def _message(self, key):
    with self.assertRaises(ValueError) as cm:
      intervene(_net, {key: lambda v: v})(jnp.ones(2))
    return str(cm.exception)

  def test_str_for_a_tuple_path(self):
    msg = self._message('blocks/0/out')
    self.assertIn("named 'blocks/0/out'. Did you mean ('blocks', 0, 'out')?",
                  msg)
    self.assertIn("The program sows: ('blocks', 0, 'out'), ('h',), 'hidden'.",
                  msg)

  def test_str_for_a_one_part_tuple(self):
    self.assertIn("Did you mean ('h',)?", self._message('h'))

  def test_typo(self):
    self.assertIn("Did you mean 'hidden'?", self._message('hiden'))

  def test_nothing_close_still_lists_the_names(self):
    msg = self._message('zzz')
    self.assertNotIn('Did you mean', msg)
    self.assertIn("The program sows: ('blocks', 0, 'out')", msg)

  def test_the_right_key_works_under_jit(self):
    out = jax.jit(intervene(_net, {('h',): lambda v: v * 0.0}))(jnp.ones(2))
    np.testing.assert_allclose(out, [-3.0, -3.0])


class CaptureNamesReportTest(absltest.TestCase):

  def _warnings(self, names, wrap=lambda f: f):
    with warnings.catch_warnings(record=True) as caught:
      warnings.simplefilter('always')
      _, c = wrap(capture(_net, names=names))(jnp.ones(2))
    return c, [str(w.message) for w in caught
               if issubclass(w.category, UnusedNameWarning)]

  def test_a_typo_is_reported_with_the_closest_names(self):
    for wrap in (lambda f: f, jax.jit):
      c, msgs = self._warnings(['blocks/0/out'], wrap)
      self.assertEqual(dict(c), {})
      self.assertEqual(msgs, [
          "capture: names= lists 'blocks/0/out', but no sow of that name was"
          " collected. Did you mean ('blocks', 0, 'out')?"
      ])
      _, msgs = self._warnings(['hiden'], wrap)
      self.assertIn("Did you mean 'hidden'?", msgs[0])
      _, msgs = self._warnings(['h'], wrap)
      self.assertIn("Did you mean ('h',)?", msgs[0])

  def test_names_that_collect_and_predicates_are_silent(self):
    c, msgs = self._warnings([('h',), 'hidden'])
    self.assertEqual(list(c), [('h',), 'hidden'])
    self.assertEqual(msgs, [])
    _, msgs = self._warnings(lambda n: n == 'nothing')
    self.assertEqual(msgs, [])


if __name__ == '__main__':
  absltest.main()
