"""The documentation stays true to the code it describes (README.md and docs/*.md).

- every `hybrid ...` command line in a code block parses with the CLI's own parser (`hybrid.cli.build_parser`);
- every relative link and `#anchor` resolves (GitHub's heading slugs and `<a id="...">` anchors), and so does
  every `docs/....md#anchor` pointer in the code of hybrid/ and moe/;
- every repository path named exists, and docs/architecture.md lists every source file of hybrid/ and moe/;
- README.md's Python example runs on the shipped checkpoint, README.md has at most 250 lines and holds .ci/run's
  set-up and test commands verbatim;
- no line of hybrid/ or moe/ (Python or C++) states a measured figure: measurements go to docs/perf-log.md,
  the code keeps the rule and a pointer to the log entry.

Each checker returns the problems it finds as strings; the tests at the end feed each one a deliberately broken
input and assert that it is caught.
"""

from __future__ import annotations

import contextlib
import io
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
MAX_README_LINES = 250
PACKAGES = ("hybrid", "moe")
TOP_DIRS = ("hybrid", "moe", "tests", "scripts", "checkpoints", "docs", ".ci")

# Lines of hybrid/ and moe/ that match the figure pattern without stating a measurement: (path, text, reason).
FIGURE_ALLOWED: list[tuple[str, str, str]] = []

FIGURE = re.compile(r"(?<![\w.])\d[\d,]*(?:\.\d+)?\s?(?:ms|us|µs|GB/s|MB/s|tok/s|GFLOP/s|TFLOP/s)(?![\w/])"
                    r"|\d(?:\.\d+)?x faster", re.IGNORECASE)
FENCE = re.compile(r"^\s*```+\s*([\w+-]*)")
SHELL_LANGS = {"bash", "sh", "shell", "console", ""}


def doc_files() -> list[Path]:
    return [README, *sorted((ROOT / "docs").glob("*.md"))]


def split_blocks(text: str) -> tuple[list[tuple[int, str]], list[tuple[str, int, list[str]]]]:
    """(prose lines as (line number, text), fenced code blocks as (language, first line number, lines))."""
    prose, blocks, block = [], [], None
    for number, line in enumerate(text.splitlines(), 1):
        fence = FENCE.match(line)
        if block is None and fence:
            block = (fence.group(1).lower(), number + 1, [])
        elif block is not None and line.strip().startswith("```"):
            blocks.append(block)
            block = None
        elif block is not None:
            block[2].append(line)
        else:
            prose.append((number, line))
    return prose, blocks


def strip_inline_code(line: str) -> str:
    return re.sub(r"`[^`]*`", "", line)


# ---- command lines ----

def command_lines(text: str) -> list[tuple[int, list[str] | None]]:
    """The `hybrid` argument lists of every command in a shell code block, with their line numbers: lines
    starting with `hybrid`, or running `-m hybrid` (python, torchrun), continued by a trailing backslash; each
    part between `&&`, `|`, `;` and redirections on its own. None for a line naming `hybrid` that is not a
    shell command line (an unbalanced quote)."""
    found = []
    for lang, first, lines in split_blocks(text)[1]:
        if lang not in SHELL_LANGS:
            continue
        joined, start = "", None
        for offset, line in enumerate(lines):
            if start is None:
                start = first + offset
            if line.rstrip().endswith("\\"):
                joined += line.rstrip()[:-1] + " "
                continue
            joined += line
            try:
                found += [(start, args) for args in _hybrid_commands(joined)]
            except ValueError:  # shlex: no closing quotation
                if "hybrid" in joined:
                    found.append((start, None))
            joined, start = "", None
    return found


def _hybrid_commands(line: str) -> list[list[str]]:
    lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
    lexer.whitespace_split, lexer.commenters = True, "#"
    tokens = list(lexer)
    parts, part, redirected = [], [], False
    for token in tokens:
        if redirected:  # the file of `< prompt.txt`
            redirected = False
        elif set(token) <= set("<>"):
            redirected = True
        elif set(token) <= set("&|;"):
            parts.append(part)
            part = []
        else:
            part.append(token)
    parts.append(part)
    commands = []
    for part in parts:
        if part[:1] == ["hybrid"]:
            commands.append(part[1:])
        elif "-m" in part and part[part.index("-m") + 1:part.index("-m") + 2] == ["hybrid"]:
            commands.append(part[part.index("-m") + 2:])
    return commands


def command_problems(path_name: str, text: str) -> list[str]:
    from hybrid.cli import build_parser

    problems = []
    for number, args in command_lines(text):
        if args is None:
            problems.append(f"{path_name}:{number}: not a shell command line (an unbalanced quote?)")
            continue
        stderr = io.StringIO()
        try:
            with contextlib.redirect_stderr(stderr), contextlib.redirect_stdout(io.StringIO()):
                build_parser().parse_args(args)
        except SystemExit as e:
            if e.code:
                message = stderr.getvalue().strip().splitlines()
                problems.append(f"{path_name}:{number}: `hybrid {shlex.join(args)}` does not parse: "
                                f"{message[-1] if message else e.code}")
    return problems


# ---- links and anchors ----

def slug(heading: str) -> str:
    """GitHub's anchor of a heading: its text lower-cased, punctuation dropped, spaces made hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text stays
    text = text.replace("`", "").strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(text: str) -> set[str]:
    found, seen = set(), {}
    for _, line in split_blocks(text)[0]:
        heading = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if heading:
            base = slug(heading.group(1))
            n = seen.get(base, 0)
            seen[base] = n + 1
            found.add(base if n == 0 else f"{base}-{n}")
        found.update(re.findall(r"<a\s+(?:id|name)=\"([^\"]+)\"", line))
    return found


def link_problems(path: Path, text: str) -> list[str]:
    problems = []
    for number, line in split_blocks(text)[0]:
        for target in re.findall(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)", strip_inline_code(line)):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
                continue
            file_part, _, anchor = target.partition("#")
            linked = (path.parent / file_part).resolve() if file_part else path
            where = f"{_name(path)}:{number}: link {target}"
            if not linked.exists():
                problems.append(f"{where}: {file_part} does not exist")
            elif anchor and linked.suffix == ".md" and anchor not in anchors(linked.read_text()):
                problems.append(f"{where}: no heading or <a id> '{anchor}' in {_name(linked)}")
    return problems


def code_pointer_problems(files: list[Path]) -> list[str]:
    """`docs/....md#anchor` pointers in the code: the page exists and holds the anchor."""
    problems = []
    for path in files:
        for number, line in enumerate(path.read_text().splitlines(), 1):
            for page, anchor in re.findall(r"\b(docs/[\w./-]+\.md)(?:#([\w-]+))?", line):
                target = ROOT / page
                if not target.exists():
                    problems.append(f"{_name(path)}:{number}: {page} does not exist")
                elif anchor and anchor not in anchors(target.read_text()):
                    problems.append(f"{_name(path)}:{number}: no anchor '{anchor}' in {page}")
    return problems


# ---- repository paths ----

PROSE_PATH = re.compile(r"(?<![\w./~-])((?:" + "|".join(re.escape(d) for d in TOP_DIRS) + r")/[\w./-]*)(?![\w*{<])")
CODE_PATH = re.compile(r"(?<![\w./~-])((?:" + "|".join(re.escape(d) for d in TOP_DIRS)
                       + r")/[\w./-]+\.(?:py|sh|json|md|cpp|safetensors))\b")


def path_problems(path_name: str, text: str) -> list[str]:
    """Repository paths named in prose (plain or in inline code) and script / file paths in code blocks must
    exist; a pattern (`*`, `{`) is not a path."""
    prose, blocks = split_blocks(text)
    named = [(n, m) for n, line in prose for m in PROSE_PATH.findall(line)]
    named += [(first + i, m) for _, first, lines in blocks for i, line in enumerate(lines) for m in CODE_PATH.findall(line)]
    problems = []
    for number, name in named:
        name = name.rstrip(".,:;")
        if not (ROOT / name).exists():
            problems.append(f"{path_name}:{number}: {name} does not exist")
    return problems


def source_files() -> list[Path]:
    return sorted(p for package in PACKAGES for p in (ROOT / package).rglob("*") if p.suffix in (".py", ".cpp"))


def map_problems(architecture: str, files: list[Path]) -> list[str]:
    listed = set(re.findall(r"`([\w./-]+)`", architecture))
    return [f"docs/architecture.md does not list {_name(p)}" for p in files if _name(p) not in listed]


# ---- measured figures in the code ----

def figure_problems(path_name: str, text: str, allowed=FIGURE_ALLOWED) -> list[str]:
    problems = []
    for number, line in enumerate(text.splitlines(), 1):
        match = FIGURE.search(line)
        if match and not any(path_name == a_path and a_text in line for a_path, a_text, _ in allowed):
            problems.append(f"{path_name}:{number}: a measured figure ({match.group(0)!r}) belongs in "
                            f"docs/perf-log.md, with a pointer here: {line.strip()}")
    return problems


# ---- the README's Python example ----

def python_example(text: str) -> str:
    blocks = [lines for lang, _, lines in split_blocks(text)[1] if lang in ("python", "py")]
    return "\n".join(blocks[0]) if blocks else ""


def example_problems(code: str) -> list[str]:
    if not code:
        return ["README.md has no Python example"]
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=600)
    if run.returncode:
        return [f"README.md's Python example failed (exit {run.returncode}): {run.stderr.strip()[-2000:]}"]
    return []


def _name(path: Path) -> str:
    """`path` relative to the repository (as the pages name it), or as given outside it."""
    path = path.resolve()
    return path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else str(path)


def _report(problems: list[str]) -> str:
    return "\n".join(problems)


# ---- the checks ----

@pytest.mark.parametrize("path", doc_files(), ids=_name)
def test_command_lines_parse(path):
    problems = command_problems(_name(path), path.read_text())
    assert not problems, _report(problems)


@pytest.mark.parametrize("path", doc_files(), ids=_name)
def test_links_and_anchors_resolve(path):
    problems = link_problems(path, path.read_text())
    assert not problems, _report(problems)


@pytest.mark.parametrize("path", doc_files(), ids=_name)
def test_named_paths_exist(path):
    problems = path_problems(_name(path), path.read_text())
    assert not problems, _report(problems)


def test_code_points_at_log_entries_that_exist():
    problems = code_pointer_problems(source_files())
    assert not problems, _report(problems)


def test_architecture_lists_every_source_file():
    problems = map_problems((ROOT / "docs" / "architecture.md").read_text(), source_files())
    assert not problems, _report(problems)


def test_no_measured_figures_in_the_code():
    problems = [p for f in source_files() for p in figure_problems(_name(f), f.read_text())]
    assert not problems, _report(problems)


def test_readme_is_short_and_holds_the_ci_commands():
    text = README.read_text()
    assert len(text.splitlines()) <= MAX_README_LINES
    ci = [line for line in (ROOT / ".ci" / "run").read_text().splitlines() if "pip install" in line or "pytest" in line]
    assert len(ci) == 2, ci
    for command in ci:
        assert command in text.splitlines(), f"README.md must show .ci/run's command verbatim: {command}"


def test_readme_python_example_runs():
    problems = example_problems(python_example(README.read_text()))
    assert not problems, _report(problems)


# ---- each checker catches a deliberately broken input ----

def test_checkers_catch_a_broken_example_line():
    broken = ("```bash\nhybrid generate --prompt hi --no-such-option 1\nhybrid serve --port 99999\n"
              "hybrid generate --prompt \"unclosed\n```\n")
    assert [p.split(":")[1] for p in command_problems("broken.md", broken)] == ["2", "3", "4"]
    fine = ("```bash\nhybrid generate --prompt - --json < prompt.txt   # a comment\n"
            "torchrun --nproc-per-node 2 -m hybrid generate m \\\n    --prompt hi\n"
            "pip install -e . && hybrid info --json | head -3\n```\n")
    assert command_lines(fine) == [(2, ["generate", "--prompt", "-", "--json"]),
                                   (3, ["generate", "m", "--prompt", "hi"]), (5, ["info", "--json"])]
    assert command_problems("fine.md", fine) == []


def test_checkers_catch_a_broken_link_or_anchor(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# Title\n\n## A `code` section: here\n\n<a id=\"entry\"></a>\n")
    other = tmp_path / "other.md"
    other.write_text("[ok](page.md#a-code-section-here) [ok](page.md#entry) [ok](#own) [web](https://x.y)\n"
                     "## Own\n[missing](nope.md) [bad anchor](page.md#nowhere) `[code](nope.md)`\n")
    problems = link_problems(other, other.read_text())
    assert len(problems) == 2 and "nope.md does not exist" in problems[0] and "'nowhere'" in problems[1]


def test_checkers_catch_a_missing_path_and_an_unlisted_file():
    text = "See `hybrid/cli.py` and hybrid/no_such_module.py, or `tests/test_*.py`.\n```bash\npython scripts/nope.py\n```\n"
    problems = path_problems("x.md", text)
    assert [p.split(": ")[1] for p in problems] == ["hybrid/no_such_module.py does not exist",
                                                   "scripts/nope.py does not exist"]
    assert map_problems("`hybrid/cli.py`", [ROOT / "hybrid" / "cli.py", ROOT / "moe" / "router.py"]) == [
        "docs/architecture.md does not list moe/router.py"]


def test_checkers_catch_a_measured_figure():
    code = ("x = 1  # reads the weight at 31.4 GB/s\n"
            "# 1.2-2.4x faster than F.linear\n"
            "# 300 -> 207 ms a layer\n"
            "# inputs of 8 to 16 rows take the AMX path: see docs/perf-log.md#amx-rows\n"
            "print(f'{rate:.1f} tok/s')\n")
    assert [p.split(":")[1] for p in figure_problems("m.py", code)] == ["1", "2", "3"]
    allowed = [("m.py", "31.4 GB/s", "an example")]
    assert [p.split(":")[1] for p in figure_problems("m.py", code, allowed)] == ["2", "3"]


def test_checkers_catch_a_broken_code_pointer(tmp_path):
    source = tmp_path / "m.py"
    source.write_text("# see docs/perf-log.md#no-such-entry and docs/no-such-page.md\n")
    problems = code_pointer_problems([source])
    assert len(problems) == 2


def test_checkers_catch_a_python_example_that_fails():
    broken = "text = '```python\\nlogits = model(input_ids)\\n```'"
    assert python_example("```python\nlogits = model(input_ids)\n```\n") == "logits = model(input_ids)"
    problems = example_problems("logits = model(input_ids)")
    assert len(problems) == 1 and "NameError" in problems[0], broken
