"""README.md and docs/*.md are tested like code.

* Every ```python block runs: the blocks of one file in order, in one namespace, in a temporary
  folder (a file whose code starts a process group runs in a fresh process as a single rank).
* Every command (the lines of ```bash blocks, and inline `leanact ...` / `python benchmarks/...`
  commands quoted next to results) names what exists: ``leanact ...`` parses with the CLI's parser,
  a script exists and has each ``--option`` given, ``pip install ".[extra]"`` names extras of
  pyproject.toml, repository paths exist. (Running them is the benchmarks' and the CLI tests' job:
  they take minutes.)
* ```text blocks are output, not run.
* Relative links resolve (files, and #anchors to headings); docs/api.md is what
  ``scripts/api_reference.py`` writes (every public name, current signatures and docstrings).
* The README stays short, keeps CI's test command after its marker, and no page has dates.
* ``.ci/run`` runs that command in a virtual environment of its own, made for the run and removed
  after it (checked on a stand-in README whose command inspects its environment).
"""
import json
import os
import pathlib
import re
import shlex
import shutil
import socket
import subprocess
import sys
import tomllib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", flags=re.S | re.M)
LANGS = {"python", "bash", "text"}


def _blocks(path: pathlib.Path, lang: str) -> list[str]:
    return [code for kind, code in FENCE.findall(path.read_text()) if kind == lang]


def _ids(pages):
    return [str(p.relative_to(ROOT)) for p in pages]


def test_every_block_has_a_known_language():
    for page in PAGES:
        kinds = {kind for kind, _ in FENCE.findall(page.read_text())}
        assert kinds <= LANGS, f"{page.name}: fence languages {kinds - LANGS}; use one of {sorted(LANGS)}"


PYTHON_PAGES = [p for p in PAGES if _blocks(p, "python")]


@pytest.mark.slow
@pytest.mark.parametrize("page", PYTHON_PAGES, ids=_ids(PYTHON_PAGES))
def test_python_blocks_run(page, tmp_path, monkeypatch):
    code = "\n\n".join(_blocks(page, "python"))
    monkeypatch.chdir(tmp_path)  # snippets may write files (Trainer output, checkpoints)
    if "init_process_group" in code:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        env = dict(os.environ, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
        assert out.returncode == 0, out.stderr[-4000:]
        return
    namespace = {"__name__": "__docs__"}
    for i, block in enumerate(_blocks(page, "python")):
        exec(compile(block, f"{page.name} (python block {i + 1})", "exec"), namespace)


def _leanact_parser():
    from leanact.cli.main import build_parser

    parser = build_parser()

    def error(message):
        raise ValueError(message)

    for p in [parser, *parser._subparsers._group_actions[0].choices.values()]:
        p.error = error
    return parser


def _check_command(words: list[str], parser, extras: set[str]) -> None:
    while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):  # VAR=value prefixes
        words = words[1:]
    if not words:
        return
    if words[0] == "leanact":
        try:
            parser.parse_args(words[1:])
        except SystemExit as e:  # --help, --version
            assert e.code == 0, words
        return
    if words[:4] == ["python", "-m", "pip", "install"] or words[:2] == ["pip", "install"]:
        for w in words:
            m = re.fullmatch(r"""["']?\.\[([\w,-]+)\]["']?""", w)
            if m:
                assert set(m.group(1).split(",")) <= extras, (w, extras)
        return
    for w in words:
        if re.match(r"(benchmarks|scripts|tests|docs|leanact)/", w):
            path = ROOT / w.split("::")[0].rstrip(",;")
            assert path.exists() or list(ROOT.glob(w)), f"{w} does not exist"
    if words[0] == "python" and len(words) > 1 and words[1].endswith(".py"):
        source = (ROOT / words[1]).read_text()
        for w in words[2:]:
            if w.startswith("--"):
                option = w.split("=")[0]
                assert f'"{option}"' in source, f"{words[1]} has no option {option}"


def _commands(page: pathlib.Path) -> list[str]:
    """The command lines of the page's bash blocks, and its inline `leanact ...` / `python
    benchmarks/...` / `python scripts/...` commands (the ones quoted next to results)."""
    out = []
    for block in _blocks(page, "bash"):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split(" #")[0].strip()
            if line and not line.startswith("#"):
                out += re.split(r"&&|\|\|", line)
    for span in re.findall(r"`([^`]+)`", FENCE.sub("", page.read_text())):
        span = " ".join(span.split())
        if re.match(r"(leanact (profile|layers)|python (benchmarks|scripts)/\S+\.py)(\s|$)", span):
            out.append(span)
    return out


COMMAND_PAGES = [p for p in PAGES if _commands(p)]


@pytest.mark.parametrize("page", COMMAND_PAGES, ids=_ids(COMMAND_PAGES))
def test_commands_name_what_exists(page):
    parser = _leanact_parser()
    extras = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])
    for command in _commands(page):
        try:
            _check_command(shlex.split(command), parser, extras)
        except (AssertionError, ValueError) as e:
            raise AssertionError(f"{page.name}: {command.strip()!r}: {e}") from None


def _anchors(path: pathlib.Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    out = set()
    for line in path.read_text().splitlines():
        m = re.match(r"#+ (.*)", line)
        if m:
            out.add(re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-"))
    return out


def test_links_resolve():
    bad = []
    for page in PAGES:
        text = FENCE.sub("", page.read_text())
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+://", target):
                continue
            file, _, anchor = target.partition("#")
            dest = (page.parent / file).resolve() if file else page
            if not dest.exists():
                bad.append(f"{page.name}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                bad.append(f"{page.name}: {target} (no such heading)")
    assert not bad, "\n".join(bad)


def test_api_reference_is_current():
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import api_reference
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    assert (ROOT / "docs" / "api.md").read_text() == api_reference.render(), \
        "docs/api.md is out of date: run python scripts/api_reference.py"


def test_readme_is_short_and_keeps_ci_test_command():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 250, len(lines)
    i = lines.index("<!-- test-command -->")
    assert lines[i + 1] == "```bash"  # .ci/run takes the line after this one
    command = lines[i + 2]
    assert command.startswith("python -m pip install") and command.endswith("python -m pytest -q -n auto"), command


@pytest.mark.slow
def test_ci_runs_the_readme_command_in_a_new_virtual_environment(tmp_path):
    """.ci/run on a stand-in repository whose README command records where it runs and fails: it
    ran in a new virtual environment (its own python and pip first on PATH, none of this
    environment's packages), CI's exit status is the command's, and the environment is gone."""
    repo, tmp = tmp_path / "repo", tmp_path / "tmp"
    (repo / ".ci").mkdir(parents=True)
    tmp.mkdir()
    shutil.copy(ROOT / ".ci" / "run", repo / ".ci" / "run")
    probe = ("import importlib.util as u, json, shutil, sys; json.dump([sys.prefix, shutil.which('python'), "
             "u.find_spec('pytest') is not None], open('where.json', 'w'))")
    command = f'python -c "{probe}" && python -m pip --version > pip.txt && python -c "import sys; sys.exit(3)"'
    (repo / "README.md").write_text(f"# stand-in\n\n<!-- test-command -->\n```bash\n{command}\n```\n")
    site = pathlib.Path(pytest.__file__).parents[1]  # where this environment has pytest: CI must not see it
    env = dict(os.environ, TMPDIR=str(tmp), LEANACT_CI_PYTHON=sys.executable, PYTHONPATH=str(site))
    out = subprocess.run(["bash", str(repo / ".ci" / "run")], cwd=tmp_path, env=env, stdin=subprocess.DEVNULL,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 3, out.stdout + out.stderr
    prefix, python, has_pytest = json.loads((repo / "where.json").read_text())
    venv = pathlib.Path(prefix)
    assert venv.parent == tmp and venv.name.startswith("leanact-ci-venv."), prefix
    assert python == str(venv / "bin" / "python") and not has_pytest  # PYTHONPATH dropped too
    assert str(venv) in (repo / "pip.txt").read_text()  # the environment's own pip
    assert list(tmp.iterdir()) == [], "the virtual environment was not removed"
    assert f"+ {command}" in out.stdout


def test_no_dates_in_docs():
    for page in PAGES:
        text = page.read_text()
        assert not re.search(r"\b20\d\d-\d\d-\d\d\b", text), f"{page.name} has a date"
        for phrase in ("this task", "was lent", "is now `"):
            assert phrase not in text, f"{page.name}: {phrase!r}"

