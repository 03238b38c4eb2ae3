"""Loading on demand, so that `raylane --help`, a command's own --help and a mistake in its
arguments or config answer at once, without torch, Ray or MLflow:

* `LazyGroup`: the group knows each command's name, one-line help, help panel and the module
  that defines it (a `Listed`), and imports that module only when the command runs or shows its
  own --help; a `Listed` with commands of its own is a subgroup, as lazy;
* `deferred`: a torch-, Ray- or MLflow-heavy raylane module a command module names at its top
  and imports when the command first uses it, once its arguments and config are checked.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from importlib import import_module
from typing import Any

import typer
import typer.main
from typer.core import TyperCommand, TyperGroup


@dataclass(frozen=True)
class Listed:
    """A command as `raylane --help` lists it: its name, the function that runs it
    ("module:function"; empty for a subgroup of `commands`), its one-line help, the help panel
    it is listed under, and whether it is hidden (an old name kept working)."""

    name: str
    function: str
    help: str
    panel: str | None = None
    hidden: bool = False
    commands: tuple[Listed, ...] = ()

    def load(self) -> TyperCommand | TyperGroup:
        """The command itself: its module imported, its function made a click command (a
        subgroup: its own lazy group)."""
        if self.commands:
            return lazy_group(*self.commands)(
                name=self.name, help=self.help, no_args_is_help=True, hidden=self.hidden
            )
        module, function = self.function.split(":")
        single = typer.Typer(add_completion=False, pretty_exceptions_enable=False)
        single.command(self.name, short_help=self.help, hidden=self.hidden)(
            getattr(import_module(module), function)
        )
        return typer.main.get_command(single)

    def listing(self) -> TyperCommand:
        """The command as its group's --help lists it, nothing imported."""
        return TyperCommand(
            self.name, short_help=self.help, hidden=self.hidden, rich_help_panel=self.panel
        )


class _Commands(Mapping[str, TyperCommand | TyperGroup]):
    """The group's commands by name, in listing order, each loaded when first looked up."""

    def __init__(self, listed: tuple[Listed, ...]) -> None:
        self._listed = {entry.name: entry for entry in listed}
        self._loaded: dict[str, TyperCommand | TyperGroup] = {}

    def __getitem__(self, name: str) -> TyperCommand | TyperGroup:
        if name not in self._loaded:
            self._loaded[name] = self._listed[name].load()
        return self._loaded[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._listed)

    def __len__(self) -> int:
        return len(self._listed)


class LazyGroup(TyperGroup):
    """A Typer group whose commands are `listed` (Typer's `cls=`: see `lazy_group`)."""

    listed: tuple[Listed, ...] = ()

    def __init__(self, **attrs: Any) -> None:
        super().__init__(**attrs)
        self.commands = _Commands(self.listed)

    def format_help(self, ctx, formatter) -> None:
        """The group's help, each command listed by its one-line help, none of them imported."""
        listing = copy.copy(self)
        listing.commands = {entry.name: entry.listing() for entry in self.listed}
        TyperGroup.format_help(listing, ctx, formatter)


def lazy_group(*listed: Listed) -> type[LazyGroup]:
    """A `LazyGroup` class with these commands, in this order."""
    return type("LazyGroup", (LazyGroup,), {"listed": listed})


class DeferredModule:
    """A module imported when one of its attributes is first read."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attribute: str) -> Any:
        return getattr(import_module(self._name), attribute)

    def __repr__(self) -> str:
        return f"<deferred module {self._name!r}>"


def deferred(name: str) -> Any:
    """The module `name`, imported when the command first uses it."""
    return DeferredModule(name)
