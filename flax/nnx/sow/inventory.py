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

"""The one mechanism behind the package's inventories of replacements.

The package replaces a few objects of JAX (``_jax_patches.py``, its
``INVENTORY`` of ``Patch`` entries) and of Flax (``nnx/flax_hooks.py``, of
``Hook`` entries). Each of those files lists its entries in the order they
are put in place, with what each replaces, why, and the public hook that
would make it unnecessary; how an entry is put in place and taken out is
that file's (``put``, ``take_out``). What they share is here: the file
that provides a replacement :meth:`Inventory.register`\\ s it under its
entry's name, :meth:`Inventory.install` puts every registered one in place
in the inventory's order, :meth:`Inventory.uninstall` takes them out in
reverse, all under one lock, so that concurrent callers see every entry in
place or none.
"""

from __future__ import annotations

import threading
import typing as tp


class Inventory:
  """A registry of replacements, put in place in the order of its entries.

  Args:
    what: how errors name the inventory (``'the patch inventory
      (_jax_patches.py)'``).
    entries: returns the entries, each with a ``name`` (read at every call,
      so the owning module's ``INVENTORY`` may be rebound).
    put: ``put(entry, replacement)`` puts one entry in place; idempotent.
    take_out: ``take_out(entry)`` restores what the entry replaced;
      ``None`` for an inventory that is never uninstalled.
    once: :meth:`install` runs once per process (later calls return at
      once, without the lock).
    registrable: whether an entry takes a registered replacement (an entry
      applied around one call only does not).
  """

  def __init__(
      self,
      what: str,
      entries: tp.Callable[[], tp.Sequence[tp.Any]],
      put: tp.Callable[[tp.Any, tp.Callable], None],
      take_out: tp.Callable[[tp.Any], None] | None = None,
      *,
      once: bool = False,
      registrable: tp.Callable[[tp.Any], bool] = lambda entry: True,
  ):
    self.what = what
    self._entries = entries
    self._put = put
    self._take_out = take_out
    self._once = once
    self._registrable = registrable
    self._registered: dict[str, tp.Callable] = {}
    self.lock = threading.RLock()
    self.ran = False  # whether install has run

  def entry(self, name: str) -> tp.Any:
    """The entry ``name``.

    Raises:
      KeyError: ``name`` is not an entry that takes a replacement.
    """
    entry = next((e for e in self._entries() if e.name == name), None)
    if entry is None or not self._registrable(entry):
      raise KeyError(f'{name!r} is not in {self.what}')
    return entry

  def register(self, name: str, replacement: tp.Callable) -> None:
    """Provides the replacement of the entry ``name``.

    Raises:
      KeyError: ``name`` is not an entry that takes a replacement.
    """
    self.entry(name)
    with self.lock:
      self._registered[name] = replacement

  def registered(self, name: str) -> tp.Callable | None:
    """The replacement registered for ``name``, if any."""
    return self._registered.get(name)

  def has_registrations(self) -> bool:
    return bool(self._registered)

  def install(self) -> None:
    """Puts every registered replacement in place, in the entries' order."""
    if self._once and self.ran:
      return
    with self.lock:
      if self._once and self.ran:
        return
      for entry in self._entries():
        replacement = self._registered.get(entry.name)
        if replacement is not None:
          self._put(entry, replacement)
      self.ran = True

  def uninstall(self) -> None:
    """Restores, in reverse order, what the registered entries replaced."""
    with self.lock:
      for entry in reversed(tuple(self._entries())):
        if entry.name in self._registered:
          self._take_out(entry)
