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

"""Interleaved timing and the record that every benchmark returns.

The machines these run on are shared, so absolute times drift from one
minute to the next. Two things are therefore always measured in one run,
alternating (A, B, B, A, A, B, ...), and compared by the median of the
per-pair ratios, which cancels a drift that is slow compared to one pair.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
import typing as tp

import jax


@dataclasses.dataclass
class Result:
  """One row of the table and one object of the JSON output.

  Attributes:
    name: the benchmark, e.g. ``'jit_runtime'`` or ``'first_call[48]'``.
    a: what is measured (the thing under test).
    b: what it is compared to (the baseline).
    a_median: median of the samples of ``a``, in ``unit``.
    b_median: median of the samples of ``b``, in ``unit``.
    unit: ``'s'`` (seconds), ``'s/eqn'`` (seconds per jaxpr equation) or
      ``'bytes'``.
    ratio: ``a`` relative to ``b`` (see ``ratio_kind``); lower is better.
    ratio_kind: ``'median of paired ratios'`` or ``'ratio of medians'``.
    target: the largest ratio that meets the target, or ``None`` (report).
    sizes: the sizes used (layers, d_model, steps, ...).
    repeats: how many samples of each were taken.
    extra: further figures that explain the row (bytes of outputs, ...).
  """

  name: str
  a: str
  b: str
  a_median: float
  b_median: float
  unit: str
  ratio: float
  ratio_kind: str
  target: float | None
  sizes: dict[str, tp.Any]
  repeats: int
  extra: dict[str, tp.Any] = dataclasses.field(default_factory=dict)

  @property
  def met(self) -> bool | None:
    if self.target is None:
      return None
    return self.ratio <= self.target

  def asdict(self) -> dict[str, tp.Any]:
    d = dataclasses.asdict(self)
    d['met'] = self.met
    return d


def block(tree):
  """Waits for every array in ``tree``; returns ``tree``."""
  return jax.block_until_ready(tree)


def time_call(fn: tp.Callable[[], tp.Any]) -> float:
  """Seconds that ``fn()`` takes, including waiting for its arrays."""
  start = time.perf_counter()
  block(fn())
  return time.perf_counter() - start


def interleaved(
    fa: tp.Callable[[], tp.Any],
    fb: tp.Callable[[], tp.Any],
    repeats: int,
    warmup: int = 1,
    before: tp.Callable[[], tp.Any] | None = None,
) -> tuple[list[float], list[float]]:
  """Times ``fa`` and ``fb`` alternately, ``repeats`` samples each.

  The order inside a pair alternates (A B, B A, A B, ...) so that neither
  always runs right after the other. ``before()``, if given, runs untimed
  before every sample (e.g. to clear the compilation caches).

  Returns:
    The samples of ``fa`` and of ``fb``, in seconds.
  """
  for _ in range(warmup):
    block(fa())
    block(fb())
  ta, tb = [], []
  for i in range(repeats):
    order = ((fa, ta), (fb, tb)) if i % 2 == 0 else ((fb, tb), (fa, ta))
    for fn, samples in order:
      if before is not None:
        before()
      samples.append(time_call(fn))
  return ta, tb


def paired_ratio(ta: tp.Sequence[float], tb: tp.Sequence[float]) -> float:
  """Median of ``ta[i] / tb[i]``."""
  return statistics.median(a / b for a, b in zip(ta, tb))


def compare(name: str, a: str, b: str, ta, tb, *, target, sizes,
            extra=None) -> Result:
  """A ``Result`` for two lists of timings taken by ``interleaved``."""
  a_median, b_median = statistics.median(ta), statistics.median(tb)
  extra = dict(
      extra or {}, ratio_of_medians=a_median / b_median,
      ratio_of_minima=min(ta) / min(tb), samples_a=list(ta),
      samples_b=list(tb))
  return Result(
      name=name, a=a, b=b, a_median=a_median, b_median=b_median, unit='s',
      ratio=paired_ratio(ta, tb), ratio_kind='median of paired ratios',
      target=target, sizes=dict(sizes), repeats=len(ta), extra=extra)


def is_positive_finite(x: float) -> bool:
  return isinstance(x, (int, float)) and math.isfinite(x) and x > 0
