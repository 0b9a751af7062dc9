"""The README stays a few screens that point to the docs, and the docs' links and wording hold.

An admin's first hour starts at the README: it must stay short, name the commands CI runs,
link only to files that exist, and say things plainly (no tracker numbers to look up). What the
README used to hold lives in docs/ by audience; the facts a site needs most are checked to
stay there. The demo excerpt's matcher is checked here; the excerpt itself against a real run
in tests/e2e/test_story.py.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.readme_excerpt import README, excerpt, line_pattern, missing_lines, strip_time

REPO = README.parent
DOCS = sorted((REPO / "docs").glob("*.md"))
MAX_README_LINES = 200
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
HTML_SRC = re.compile(r"<img\s[^>]*\bsrc=\"([^\"]+)\"")
ISSUE_REF = re.compile(r"\bissues? \d+\b|(?<![\w/])#\d+\b", re.IGNORECASE)
FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.MULTILINE | re.DOTALL)
INLINE_CODE = re.compile(r"`[^`\n]*`")


def prose(markdown: str) -> str:
    """The text outside code blocks and inline code spans."""
    return INLINE_CODE.sub("", FENCE.sub("", markdown))


def broken_links(path: Path) -> list[str]:
    """Relative links (and `<img src>`) of a Markdown file whose target file does not exist
    (anchors ignored)."""
    text = prose(path.read_text())
    broken = []
    for target in [*LINK.findall(text), *HTML_SRC.findall(text)]:
        if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue  # a URL (http:, mailto:) or an anchor within the page
        file_part = target.split("#", 1)[0]
        if not (path.parent / file_part).exists():
            broken.append(target)
    return broken


def issue_refs(markdown: str) -> list[str]:
    """Tracker references ("issue 11", "issues 3", "#15") in the prose."""
    return [m.group(0) for m in ISSUE_REF.finditer(prose(markdown))]


# -- the README and the docs ------------------------------------------------------------------
def test_readme_fits_on_a_few_screens() -> None:
    lines = README.read_text().count("\n")
    assert lines <= MAX_README_LINES, f"README.md has {lines} lines; move details to docs/"


def test_readme_names_the_commands_ci_runs() -> None:
    """`.ci/run` runs exactly `scripts/test` and `scripts/test --debian 13`; the README shows
    them as they are typed, beside `scripts/demo`."""
    text = README.read_text()
    shown = {m.group(1).strip()
             for m in re.finditer(r"^(scripts/test[^#\n]*?)\s*(?:#|$)", text, re.MULTILINE)}
    ci = (REPO / ".ci" / "run").read_text()
    lanes = set(re.findall(r"\.log (scripts/test(?: --debian 13)?)\s*&?$", ci, re.MULTILINE))
    assert lanes == {"scripts/test", "scripts/test --debian 13"}
    assert lanes <= shown
    assert re.search(r"^scripts/demo\b", text, re.MULTILINE)


@pytest.mark.parametrize("path", [README, *DOCS], ids=lambda p: p.name)
def test_every_relative_link_points_to_a_file(path: Path) -> None:
    assert broken_links(path) == []


@pytest.mark.parametrize("path", [README, *DOCS], ids=lambda p: p.name)
def test_no_issue_numbers(path: Path) -> None:
    """Plain statements, not "(issue 12)": a reader has no tracker at hand."""
    assert issue_refs(path.read_text()) == []


def test_the_docs_by_audience_exist_and_the_readme_links_them() -> None:
    text = README.read_text()
    for name in ("admin", "researchers", "architecture", "benchmarks", "jobs", "slurm-releases",
                 "vllm-versions", "ci-health"):
        assert (REPO / "docs" / f"{name}.md").is_file()
        assert f"(docs/{name}.md" in text, f"README does not link docs/{name}.md"


#: What a site must find in the admin guide: the safety settings and files a move of the
#: README's text could drop without any link breaking.
ADMIN_FACTS = [
    "AllowGroups=root", "slurm.serve_access", "slurm.foreign_job_action", "event: foreign_job",
    "replica-jobs.key", "sig=", "foreign-replica-job", "{identity}", "engine-identity/",
    "action `repair`", "hidepid=2", "runner", "$SLURM_IDLE_CONFIG", "web.user_header",
    "web.show_all_users", "pipeline.max_steps", "/run/slurm-idle/tick.lock",
    "slurm.requeue_grace_s", "SuspendExcParts", "policy.min_job_runtime_s", "router.kind",
    "placement: jobs", "slurm.prefer_feature", "etc/job_submit.lua", "slurm-idle doctor",
]


def test_the_admin_guide_keeps_what_a_site_needs() -> None:
    text = (REPO / "docs" / "admin.md").read_text()
    assert [fact for fact in ADMIN_FACTS if fact not in text] == []


# -- the checks themselves --------------------------------------------------------------------
def test_link_check_finds_a_missing_file(tmp_path: Path) -> None:
    (tmp_path / "there.md").write_text("x")
    page = tmp_path / "page.md"
    page.write_text("[a](there.md) [b](there.md#part) [c](missing.md) [d](https://example.org/x.md)\n"
                    "[e](#local) ![f](img/none.png)\n```\n[g](in-code.md)\n```\n"
                    '<img src="there.md" width="5"> <img src="img/gone.png">\n')
    assert broken_links(page) == ["missing.md", "img/none.png", "img/gone.png"]


def test_issue_check_finds_references_outside_code() -> None:
    assert issue_refs("Fixed (issue 12). Issues 3 and #15 too.") == ["issue 12", "Issues 3", "#15"]
    assert issue_refs("`llama-70b#1` and\n```\nsee #4\n```\nand [PR](https://x/pull/34730)") == []


# -- the demo excerpt matcher ----------------------------------------------------------------
RUN = [
    "[   2.6s] load 0.2 req/s: the first tick adopts every node into serving",
    "[  37.0s]   gpu3: serving -> retiring (demand 92 tok/s needs 1; 3 serving: lending)",
    "[  77.6s] all lent nodes serving again in 6s (per node: {'gpu3': 6.0}); job 1 is PENDING",
]


def test_the_time_prefix_is_ignored() -> None:
    assert strip_time("[ 177.5s]   gpu4 still drained") == "gpu4 still drained"
    quoted = ["[ 999.9s] load 0.2 req/s: the first tick adopts every node into serving"]
    assert missing_lines(quoted, RUN) == []


def test_dots_match_any_text() -> None:
    quoted = ["...: serving -> retiring (demand ...",
              "all lent nodes serving again in ...s (per node: ...); job ... is ..."]
    assert missing_lines(quoted, RUN) == []
    assert line_pattern("job ... is PENDING").fullmatch("job 12 is PENDING")


def test_a_changed_word_does_not_match() -> None:
    quoted = ["load 0.2 req/s: the first tick adopts every node into lending"]
    assert missing_lines(quoted, RUN) == quoted
    assert missing_lines(["...: serving -> lent (demand ..."], RUN) == ["...: serving -> lent (demand ..."]


def test_a_quoted_line_must_be_the_whole_line() -> None:
    """Without `...` at its end a quoted line may not stop short of the printed one."""
    assert missing_lines(["...: serving -> retiring (demand 92 tok/s"], RUN) != []


def test_order_matters() -> None:
    first, second = RUN[0], RUN[2]
    assert missing_lines([first, second], RUN) == []
    assert missing_lines([second, first], RUN) == [first]


def test_excerpt_is_read_between_the_markers() -> None:
    text = "intro\n<!-- demo-excerpt -->\n```\n[ 1.0s] a\n\n[ 2.0s] b\n```\n<!-- /demo-excerpt -->\nafter\n"
    assert excerpt(text) == ["[ 1.0s] a", "[ 2.0s] b"]
    with pytest.raises(ValueError):
        excerpt("no markers here")


def test_the_readme_has_a_demo_excerpt_with_deterministic_lines() -> None:
    """The quote exists, and what varies from run to run or lane to lane (loads, KV cache %,
    waiting requests, seconds, resumed_from, client counts, ports, the Slurm release) is cut
    with `...`."""
    quoted = excerpt(README.read_text())
    assert len(quoted) >= 10
    varying = re.compile(r"tok/s|KV cache \d|requests waiting|resumed_from=\d|in \d+s|"
                         r"per node: \{|requests \d|failed \d|p99 \d|:\d{4,5}\b|Slurm \d")
    assert [line for line in quoted if varying.search(strip_time(line))] == []
