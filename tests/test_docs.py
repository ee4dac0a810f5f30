"""The documentation stays true: the settings reference is what the settings classes generate,
the security page's table of requests is what their declarations generate, every relative link
leads to a file, and no page cites this project's internal issue numbers."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from meshlearn.cli.reference import settings_reference
from meshlearn.network.protocol.rpcs import DOC_BEGIN, DOC_END, authorization_table, message_list

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def test_the_settings_reference_is_what_the_settings_classes_generate():
    written = (ROOT / "docs" / "settings.md").read_text()
    assert written == settings_reference(), \
        "docs/settings.md is out of date: run python3 -m meshlearn.cli.reference > docs/settings.md"


def test_the_settings_reference_lists_every_setting_with_its_default():
    text = settings_reference()
    for row in ["| `nodes` | `--nodes NODES` | `8` |", "| `udp_mode` | `--udp-mode {sync,async}` | `sync` |",
                "| `--providers PROVIDERS` | `4` |", "| `--ttl TTL` | `30.0` |", "| `timeout_ms` | `2500.0` |"]:
        assert row in text


@pytest.mark.parametrize("page, generate, which", [("security.md", authorization_table, "security"),
                                                    ("network.md", message_list, "messages")])
def test_the_pages_generated_from_the_protocol_s_declarations_are_up_to_date(page, generate, which):
    text = (ROOT / "docs" / page).read_text()
    assert text.count(DOC_BEGIN) == 1 and text.count(DOC_END) == 1, f"docs/{page} lost its generated part's markers"
    written = text.split(DOC_BEGIN + "\n")[1].split(DOC_END)[0]
    assert written == generate(), \
        f"docs/{page} is out of date: put the output of python3 -m meshlearn.network.protocol.rpcs {which} " \
        "between its markers"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_relative_link_leads_to_a_file(page):
    targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text())
    missing = [t for t in targets if "://" not in t and not (page.parent / t).exists()]
    assert not missing, f"{page.name} links to files that do not exist: {missing}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_no_page_cites_an_internal_issue_number(page):
    cited = re.findall(r"[Ii]ssues? \d+", page.read_text())
    assert not cited, f"{page.name} cites {cited}: say what the issue decided instead"
