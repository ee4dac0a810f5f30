"""The settings reference (``docs/settings.md``), generated from the command line, whose flags are
generated from the settings classes: a default or a description lives in one place, and the
reference cannot drift from it (a test compares the file with this output).

    python3 -m meshlearn.cli.reference > docs/settings.md     # after changing a setting
"""

from __future__ import annotations

import argparse
import sys

from meshlearn.adapter.config import DPWA_NAMES
from meshlearn.cli.flags import DEFAULT
from meshlearn.cli.main import CONFIG_GROUP, build_parser
from meshlearn.config import flat_fields
from meshlearn.definitions.settings import GossipSettings

HEADER = """\
# Settings reference

Every flag of every `meshlearn` command, with its default. Generated from the settings classes
(`python3 -m meshlearn.cli.reference > docs/settings.md`; a test fails when this file is out of
date): do not edit it by hand.

An experiment setting (`simulate`, `experiment`, `node`) can also be written in a YAML file given
with `--config`, under the name in its first column (`udp_mode: async`); flags override the file.
A component's settings may instead be written as its section (`udp: {mode: async, timeout: 0.4}`),
which is how the resolved `config.yaml` of every run shows them. `meshlearn request --config
task.yaml` takes its flags' names as keys the same way.
"""
OWN_FLAGS = ("help", "help_all", "version")  # the help's own, said once, not per command


def _cell(text: str) -> str:
    return text.replace("%%", "%").replace("|", "\\|").replace("\n", " ").strip()


def _split_default(action: argparse.Action) -> tuple[str, str]:
    """(meaning, default) from a flag's help, whose generated text ends with ``(default: X)``."""
    text = action.help or ""
    found = DEFAULT.search(text)
    if found:
        return text[:found.start()], found.group(1)
    if isinstance(action, argparse._StoreTrueAction):
        return text, "off"
    return text, "required" if action.required else ""


def _flag(action: argparse.Action) -> str:
    if not action.option_strings:
        return f"`{action.metavar or action.dest.upper()}`"
    value = "" if action.nargs == 0 else " " + ("{" + ",".join(action.choices) + "}" if action.choices else
                                                 str(action.metavar or action.dest.upper()))
    return f"`{action.option_strings[-1]}{value}`"


def _table(actions: list[argparse.Action], keys: set[str] | None) -> list[str]:
    """One Markdown table of flags; ``keys``: the settings that a YAML file may also give."""
    head = ["| key in a file | flag | default | meaning |", "|---|---|---|---|"] if keys is not None else \
        ["| flag | default | meaning |", "|---|---|---|"]
    rows = []
    for action in actions:
        meaning, default = _split_default(action)
        cells = [_flag(action), f"`{_cell(default)}`" if default else "", _cell(meaning)]
        if keys is not None:
            cells.insert(0, f"`{action.dest}`" if action.dest in keys else "")
        rows.append("| " + " | ".join(cells) + " |")
    return head + rows


def _command(name: str, parser: argparse.ArgumentParser, summary: str) -> list[str]:
    keys = {flat for flat, _ in flat_fields()} if name == "simulate" else None
    lines = [f"## meshlearn {name}", "", summary[:1].upper() + summary[1:] + ".", ""]
    if name == "node":
        lines += ["It also takes every experiment setting of `meshlearn simulate` but `--engine` (a node is one "
                  "process of the process engine), as flags or in its `--config` file.", ""]
    for group in parser._action_groups:
        actions = [a for a in group._group_actions if a.dest not in OWN_FLAGS]
        title = group.title or ""
        if not actions or (name == "node" and title.endswith(CONFIG_GROUP)):
            continue
        title = title.removesuffix(CONFIG_GROUP)
        if title not in ("options", "positional arguments"):
            lines += [f"### {title[:1].upper() + title[1:]}", ""]
        lines += _table(actions, keys) + [""]
    return lines


def _adapter() -> list[str]:
    """The keys of the gossip adapter's YAML file (dpwa's), and what each sets."""
    engine_to_dpwa = {engine: dpwa for dpwa, engine in DPWA_NAMES.items()}
    lines = ["## The gossip adapter's YAML file (dpwa's keys)", "",
             "`GossipAdapter(model, name, config)` reads dpwa's file unchanged (`examples/gossip-4.yaml`): "
             "`nodes:` lists every worker (`name`, `host`, `port`), and these top-level keys set the averaging. "
             "`clock:` and `loss:` sections are accepted and carry nothing, as in dpwa.", "",
             "| key | default | meaning |", "|---|---|---|"]
    for name, field in GossipSettings.model_fields.items():
        key = engine_to_dpwa[name]
        default = field.default * 1000 if key == "timeout_ms" else field.default
        meaning = _cell(field.description or "")
        if key == "timeout_ms":  # the engine's setting is in seconds, dpwa's key in milliseconds
            meaning = "milliseconds to wait for a fetch"
        lines.append(f"| `{key}` | `{str(default).lower() if isinstance(default, bool) else default}` | {meaning} |")
    return lines + [""]


def settings_reference() -> str:
    """The Markdown text of ``docs/settings.md``."""
    parser = build_parser(user_algorithms=False)  # the built-in settings (not a module's loaded by now)
    commands = parser.commands
    summaries = {action.dest: action.help for action in commands._choices_actions}
    lines = [HEADER]
    lines += ["## meshlearn (every command)", "", *_table(
        [a for a in parser._actions if a.option_strings and a.dest not in OWN_FLAGS and a.dest != "command"], None),
        "", ("Every command also takes `-h`/`--help`; `simulate` and `node` list their common flags with it, "
             "and every flag with `--help-all`."), ""]
    for name, sub in commands.choices.items():
        lines += _command(name, sub, summaries.get(name, ""))
    lines += _adapter()
    return "\n".join(lines).rstrip() + "\n"


if __name__ == "__main__":
    sys.stdout.write(settings_reference())
