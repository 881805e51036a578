"""What the settings of every config group share: reading a parsed section into its dataclass.

Each group declares its options once, as a frozen dataclass in its package
(``pipelines.settings.ModelSettings``, ``input.settings.DataSettings``,
``output.settings.WriterSettings``): each option's default and, in the dataclass's ``Options:``
section, its help; the parser, the checks, preflight and run.json read it, and the class that takes
the options (``DiffusionModule``...) shows that help as its ``Args`` (``documented_by``), which
jsonargparse reads for ``--help``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import fields, replace
from typing import Any, Optional

from lightning_diffusion.core.errors import ConfigError


def group_options(cls: type, given: Mapping[str, Any], owner: str) -> dict[str, Any]:
    """``given`` (a parsed config's section, or keyword arguments) as the options of ``cls``, a
    settings dataclass; an option ``cls`` lacks is refused in one message naming ``owner`` (``the
    model``) and every option it has. jsonargparse's meta keys (``__path__``: the group was given
    as a file) are not options and are dropped."""
    options = {key: value for key, value in given.items() if not key.startswith("__")}
    names = [option.name for option in fields(cls)]
    unknown = sorted(set(options) - set(names))
    if unknown:
        raise ConfigError(f"{owner} has no option {', '.join(unknown)}; it has: {', '.join(names)}.")
    return options


def called_with(cls: type, arguments: Mapping[str, Any]) -> Any:
    """The settings ``cls`` of a constructor's ``arguments`` (its ``locals()`` on entry, ``self``
    among them): each option of ``cls`` from the argument of its name."""
    return cls(**{option.name: arguments[option.name] for option in fields(cls)})


class FromSettings:
    """A class attribute that reads its option from the instance's ``settings`` (a frozen settings
    dataclass): ``data.batch_size`` is ``data.settings.batch_size``, so an option is held once. Set,
    it replaces the settings with that option changed."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __get__(self, instance: Optional[object], owner: Optional[type] = None) -> Any:
        if instance is None:
            return self
        return getattr(instance.settings, self.name)  # type: ignore[attr-defined]

    def __set__(self, instance: object, value: Any) -> None:
        instance.settings = replace(instance.settings, **{self.name: value})  # type: ignore[attr-defined]


def read_from_settings(settings_cls: type) -> Any:
    """A class decorator: each option of ``settings_cls`` the class does not define itself becomes a
    ``FromSettings`` attribute of it."""
    def decorate(cls: type) -> type:
        for option in fields(settings_cls):
            if option.name not in vars(cls):
                setattr(cls, option.name, FromSettings(option.name))
        return cls

    return decorate


OPTIONS_HEADING = "\n    Options:\n"


def documented_by(settings_cls: type) -> Any:
    """A class decorator: the line ``Args: the options of ``SettingsName``.`` of the class's docstring
    becomes its ``Args`` section, the ``Options:`` section of ``settings_cls``'s docstring (the last
    of it), so that each option's help is written once, beside its default."""
    def decorate(cls: type) -> type:
        doc, own = settings_cls.__doc__, cls.__doc__
        marker = f"    Args: the options of ``{settings_cls.__name__}``.\n"
        if doc is None or own is None:  # python -OO: no docstrings at all
            return cls
        if OPTIONS_HEADING not in doc or marker not in own:
            raise TypeError(f"{cls.__name__}'s docstring must say {marker.strip()!r} and {settings_cls.__name__}'s "
                            "must end with an Options: section")
        section = doc[doc.index(OPTIONS_HEADING) + len(OPTIONS_HEADING):].rstrip() + "\n"
        cls.__doc__ = own.replace(marker, "    Args:\n" + section)
        return cls

    return decorate
