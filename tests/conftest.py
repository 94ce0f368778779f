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

"""Eight simulated CPU devices for every test process.

The sharding tests (``test_sharding.py``) need a mesh of 8 devices. XLA
reads ``XLA_FLAGS`` once, when JAX first initialises its CPU backend, so the
flag is set here, before any test module runs JAX code. It is appended to
flags already in the environment; a count given there is kept.
"""

from __future__ import annotations

import os

DEVICE_COUNT_FLAG = '--xla_force_host_platform_device_count'
DEVICE_COUNT = 8


def _with_device_count(flags: str) -> str:
  if DEVICE_COUNT_FLAG in flags:
    return flags
  return f'{flags} {DEVICE_COUNT_FLAG}={DEVICE_COUNT}'.strip()


os.environ['XLA_FLAGS'] = _with_device_count(os.environ.get('XLA_FLAGS', ''))
