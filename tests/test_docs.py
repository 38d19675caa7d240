"""The user documentation holds together (pure: reads text files, imports neither torch nor Ray).

The README is the front door and ``docs/`` holds a page per task, so a reader moves between them
by links: each relative link must reach a file, and each ``#anchor`` a heading of that file.
The Python blocks are what a reader copies, so each must at least compile, and the README's own-model block
trains as written (in a process of its own). The README stays
small enough to read at once, and it keeps CI's test command as one of its lines (``.ci/run``
greps for it with ``grep -qxF``; this test says so before CI does). The pages speak to users: a
table cell reads at a glance, the results page stays a page, and neither the docs nor the
package's text speak of sessions, issue numbers or the machines the work was done on.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
README_MAX_BYTES = 15 * 1024
PAGES = [README] + sorted((ROOT / "docs").glob("*.md"))
PERFORMANCE = ROOT / "docs" / "performance.md"
PERFORMANCE_MAX_BYTES = 10 * 1024
TABLE_CELL_MAX_CHARS = 300
# Words about how the work was organised, not about what a user runs.
_WORKPLACE = re.compile(r"session \d+|issue \d+|stop \d+|this VM|the VM\b|\blent\b", re.IGNORECASE)
# Being rewritten by another change; remove this set when it lands.

_FENCE = re.compile(r"^(```|~~~)")
# [text](target) and ![alt](target); the target ends at whitespace (an optional "title") or ")".
_LINK = re.compile(r"!?\[(?:[^\]\\]|\\.)*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_INLINE_CODE = re.compile(r"(`+)(?:(?!\1).)+?\1")


def _prose_lines(text: str):
    """(line number, line) outside fenced code blocks, inline code spans blanked out."""
    fenced = False
    for number, line in enumerate(text.splitlines(), start=1):
        if _FENCE.match(line.lstrip()):
            fenced = not fenced
            continue
        if not fenced:
            yield number, _INLINE_CODE.sub(lambda m: " " * len(m.group(0)), line)


def _python_blocks(text: str):
    """(line number of the opening fence, source) of every ```python block."""
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        opening = lines[i].strip()
        if opening.startswith("```"):
            language = opening[3:].strip().lower()
            end = i + 1
            while end < len(lines) and not lines[end].strip().startswith("```"):
                end += 1
            if language in ("python", "py"):
                yield i + 1, "\n".join(lines[i + 1:end]) + "\n"
            i = end + 1
        else:
            i += 1


def github_slug(heading: str) -> str:
    """GitHub's anchor for a heading: lowercase, punctuation dropped except - and _, spaces to -."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading keeps its text
    text = text.strip().lower()
    text = "".join(ch for ch in text if ch.isalnum() or ch in "-_ ")
    return text.replace(" ", "-")


def anchors(path: Path) -> set:
    """Every heading's anchor in a markdown file (outside code blocks; inline code keeps its words);
    a repeated heading gets -1, -2, ... as on GitHub."""
    seen: dict = {}
    result = set()
    fenced = False
    for line in path.read_text(encoding="utf-8").splitlines():
        if _FENCE.match(line.lstrip()):
            fenced = not fenced
            continue
        match = None if fenced else re.match(r"^ {0,3}#{1,6}\s+(.*?)\s*#*\s*$", line)
        if match:
            slug = github_slug(match.group(1))
            count = seen.get(slug, 0)
            seen[slug] = count + 1
            result.add(slug if count == 0 else f"{slug}-{count}")
    return result


def links(path: Path):
    """(line number, target) of every relative link in a markdown file (web and mail links left out)."""
    for number, line in _prose_lines(path.read_text(encoding="utf-8")):
        for match in _LINK.finditer(line):
            target = match.group(1)
            if re.match(r"^(https?:|mailto:)", target, re.IGNORECASE):
                continue
            yield number, target


def _page_id(path: Path) -> str:
    return str(path.relative_to(ROOT))


@pytest.mark.parametrize("page", PAGES, ids=_page_id)
def test_every_relative_link_reaches_a_file_and_its_heading(page):
    broken = []
    for number, target in links(page):
        file_part, _, anchor = target.partition("#")
        destination = (page.parent / file_part).resolve() if file_part else page
        where = f"{_page_id(page)}:{number}: [{target}]"
        if not destination.exists():
            broken.append(f"{where}: {file_part} does not exist (relative to {_page_id(page.parent) or '.'}/)")
        elif anchor and destination.suffix == ".md":
            known = anchors(destination)
            if anchor not in known:
                broken.append(f"{where}: no heading of {destination.relative_to(ROOT)} has the anchor "
                              f"#{anchor}; its anchors: {sorted(known)}")
    assert not broken, "broken links:\n" + "\n".join(broken)


@pytest.mark.parametrize("page", PAGES, ids=_page_id)
def test_every_python_block_compiles(page):
    failures = []
    for line, source in _python_blocks(page.read_text(encoding="utf-8")):
        name = f"{_page_id(page)}:{line}"
        try:
            compile(source, name, "exec")
        except SyntaxError as error:
            failures.append(f"{name} (the ```python block opening on line {line}): {error}")
    assert not failures, "\n".join(failures)


def test_the_readme_is_a_front_door_not_a_manual():
    size = README.stat().st_size
    assert size <= README_MAX_BYTES, (
        f"README.md is {size:,} bytes, over {README_MAX_BYTES:,}: move detail into a page of docs/ "
        f"and link to it from the README")


def _ci_command() -> str:
    for line in (ROOT / ".ci" / "run").read_text(encoding="utf-8").splitlines():
        if line.startswith("CMD="):
            return shlex.split(line[len("CMD="):])[0]
    raise AssertionError(".ci/run has no CMD= line: where does CI take the README's test command from?")


def test_the_readme_has_the_ci_test_command_as_a_line():
    command = _ci_command()
    assert command in README.read_text(encoding="utf-8").splitlines(), (
        f"README.md has no line that is exactly CI's test command (.ci/run greps for it with grep -qxF):\n"
        f"{command}\nPut it back word for word, or change .ci/run's CMD= with it.")


def test_the_slug_rule_is_githubs():
    assert github_slug("Which strategy? `raytrain-mgpu compare`") == "which-strategy-raytrain-mgpu-compare"
    assert github_slug('`strategy="auto"`') == "strategyauto"
    assert github_slug("On a cluster: `ray up` → `ray job submit`") == "on-a-cluster-ray-up--ray-job-submit"
    assert github_slug("Spot and elastic") == "spot-and-elastic"
    assert github_slug("step_checkpoints and more") == "step_checkpoints-and-more"


def _table_cells(line: str):
    """The cells of a markdown table row (inline code already blanked, so its pipes do not split)."""
    return [cell.strip() for cell in re.split(r"(?<!\\)\|", line.strip().strip("|"))]


@pytest.mark.parametrize("page", PAGES, ids=_page_id)
def test_every_table_cell_reads_at_a_glance(page):
    long_cells = [f"{_page_id(page)}:{number}: a cell of {len(cell)} characters: {cell[:80]}..."
                  for number, line in _prose_lines(page.read_text(encoding="utf-8"))
                  if line.lstrip().startswith("|") for cell in _table_cells(line)
                  if len(cell) > TABLE_CELL_MAX_CHARS]
    assert not long_cells, (f"table cells over {TABLE_CELL_MAX_CHARS} characters (a cell is a figure or a "
                            f"phrase; move the explanation into a sentence under the table):\n" + "\n".join(long_cells))


def test_the_results_page_stays_a_page():
    size = PERFORMANCE.stat().st_size
    assert size < PERFORMANCE_MAX_BYTES, (
        f"docs/performance.md is {size:,} bytes, not under {PERFORMANCE_MAX_BYTES:,}: keep the newest figure of "
        f"each measurement (git keeps the history) and one or two sentences of why")


def _package_sources():
    for path in sorted((ROOT / "raytrain_mgpu").rglob("*.py")):
        name = str(path.relative_to(ROOT))
        yield name, path


def test_docs_and_package_text_speak_to_users_not_of_how_the_work_was_organised():
    found = []
    for name, path in [(_page_id(page), page) for page in PAGES] + list(_package_sources()):
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
            found += [f"{name}:{number}: {match.group(0)!r} in: {line.strip()[:100]}"
                      for match in _WORKPLACE.finditer(line)]
    assert not found, ("session, issue or stop numbers and words about the machines the work ran on "
                       "(\"this VM\", \"lent\"): say what a user needs instead (\"on a 2-core Intel Xeon "
                       "machine\", \"a machine with one H200\", the commit):\n" + "\n".join(found))


def _package_map() -> str:
    """The package map of docs/development.md: the code block under "## Layout" that starts at ``raytrain_mgpu/``."""
    text = (ROOT / "docs" / "development.md").read_text()
    layout = text[text.index("## Layout"):]
    start = layout.index("```\nraytrain_mgpu/\n") + 4
    return layout[start:layout.index("\n```", start)]


def _entries(block: str) -> dict:
    """``{"engine/": its text, "config/train.py": its text, ...}``: each entry of the map with its continuation lines."""
    entries, current = {}, None
    for line in block.splitlines():
        match = re.match(r"^  (\S+)\s", line + " ")
        if match:
            current = match.group(1)
            entries[current] = line
        elif current is not None and line.startswith("    "):
            entries[current] += " " + line.strip()
    return entries


def test_the_package_map_names_every_folder_and_module():
    package = ROOT / "raytrain_mgpu"
    block = _package_map()
    entries = _entries(block)
    missing = []
    for path in sorted(package.rglob("*.py")):
        relative = path.relative_to(package)
        parts = relative.parts
        if parts[0] == "bench" and len(parts) > 1 or path.name == "__init__.py" and len(parts) == 1:
            continue  # the benchmarks: their folder is named; the package's own __init__
        if len(parts) == 1:
            if not re.search(rf"(?<![\w/]){re.escape(path.name)}", block):
                missing.append(str(relative))
            continue
        entry = entries.get(f"{parts[0]}/", "")
        if not entry:
            missing.append(f"{parts[0]}/")
            continue
        for folder in parts[1:-1]:
            if f"{folder}/" not in entry:
                missing.append(f"{parts[0]}/{folder}/")
        if path.name != "__init__.py" and not re.search(rf"(?<![\w]){re.escape(path.name)}", entry):
            missing.append(str(relative))
    assert not sorted(set(missing)), f"docs/development.md's package map does not name: {sorted(set(missing))}"


def test_the_readmes_own_model_and_data_block_trains_as_written(tmp_path):
    # The block a user copies first, run as a script of its own (its classes and functions in __main__, as a user's
    # are), in a fresh process with its own HOME: its one worker trains in that process, no Ray.
    blocks = [source for _, source in _python_blocks(README.read_text(encoding="utf-8")) if "class Net" in source]
    assert len(blocks) == 1, "the README's 'Your own model and data' block"
    script = tmp_path / "mine.py"
    script.write_text(blocks[0].replace("rtm.fit(cfg)", f"rtm.fit(cfg.replace(storage_path={str(tmp_path)!r}))"))
    env = {**os.environ, "HOME": str(tmp_path), "RAYTRAIN_MGPU_EMULATE_GPUS": ""}
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=300,
                          cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "in this process" in done.stdout  # the banner: the in-process runner, no Ray
    assert float(done.stdout.strip().splitlines()[-1]) > 0.8  # the printed test accuracy of 5 epochs
