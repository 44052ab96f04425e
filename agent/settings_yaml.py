"""YAML of the settings (the config file, a ``SYSDRA_*`` value holding YAML) read strictly: a key
given twice in one mapping, nesting deeper than the parser's recursion, an integer too long to
convert are each a ``YamlError`` with a line saying so, never another exception."""

from __future__ import annotations

from typing import Any

import yaml

_MERGE = "tag:yaml.org,2002:merge"


class YamlError(ValueError):
    """The text is not YAML the settings take; ``str()`` says why in a line or a few."""


class _Loader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing a mapping that gives a key twice: the last would win
    unseen, as with two spellings of one setting."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: set = set()
        for key_node, _ in node.value:
            if not isinstance(key_node, yaml.ScalarNode) or key_node.tag == _MERGE:
                continue  # (an unhashable key is the constructor's own error; "<<" merges)
            key = self.construct_object(key_node)
            if key in seen:
                raise yaml.constructor.ConstructorError(None, None, f"key {key!r} given twice", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def load(text: str) -> Any:
    """``text`` as YAML with the safe loader's types."""
    try:
        return yaml.load(text, Loader=_Loader)  # noqa: S506 (a SafeLoader)
    except yaml.YAMLError as err:
        raise YamlError(str(err)) from None
    except RecursionError:
        raise YamlError("nested too deep") from None
    except ValueError:  # an integer beyond Python's conversion limit (4300 digits)
        raise YamlError("a number of more digits than Python converts") from None
