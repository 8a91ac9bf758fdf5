"""The README stays short and true: every command in it is checked against what it names.

`kvferry` command lines are parsed by the real CLI (typer/click) without starting anything
(`up` lines run with `--dry-run`, which prints the engines' command lines); the test command
is what .ci/run runs; curl and SDK examples talk to the router's real routes with the model
name the `up` line serves; links into docs/ and benchmarks/ resolve, anchors included.
The quick start's `kvferry run` itself runs, on real engines, in tests/test_e2e_cli.py.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import re
import shlex
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
from typer.main import get_command
from typer.testing import CliRunner

from kvferry.router.api.app import create_app
from kvferry.router.settings import RouterSettings
from kvferry.scripts.cli import app
from kvferry.scripts.engines import ROUTER_PORT

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
MAX_LINES = 300
USER_DOCS = [README, *sorted((ROOT / "docs").glob("*.md"))]
ALL_DOCS = [*USER_DOCS, ROOT / "benchmarks" / "README.md"]


def sections(text: str) -> dict[str, str]:
    """`## Heading` -> the text under it, up to the next `## `."""
    out: dict[str, str] = {}
    for part in re.split(r"^## ", text, flags=re.M)[1:]:
        head, _, body = part.partition("\n")
        out[head.strip()] = body
    return out


def code_lines(body: str) -> list[str]:
    """The shell commands of a section: its indented (4-space) code lines, outside fences."""
    lines, fenced = [], False
    for line in body.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and line.startswith("    ") and line.strip():
            lines.append(line.strip())
    return lines


def fenced_python(body: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", body, flags=re.S)


def commands(line: str) -> list[list[str]]:
    """One shell line -> its `&&`-joined commands, each split like the shell would."""
    return [shlex.split(part) for part in line.split("&&")]


def is_kvferry(argv: list[str]) -> bool:
    return bool(argv) and Path(argv[0]).name == "kvferry"


def parse_kvferry(argv: list[str]) -> Any:
    """Resolve subcommands and parse the options with the real CLI; invokes nothing.
    (typer ships its own click: groups are found by their `get_command`.)"""
    cmd: Any = get_command(app)
    name, args, parent = "kvferry", list(argv[1:]), None
    while hasattr(cmd, "get_command") and args:
        ctx = cmd.context_class(cmd, info_name=name, parent=parent)
        sub = cmd.get_command(ctx, args[0])
        if sub is None:
            break
        parent, cmd, name, args = ctx, sub, args[0], args[1:]
    return cmd.make_context(name, args, parent=parent)


def dry_run(argv: list[str]) -> str:
    """An `up` line as written plus `--dry-run` (before any `--`): the printed commands."""
    args = list(argv[1:])
    cut = args.index("--") if "--" in args else len(args)
    result = CliRunner().invoke(app, [*args[:cut], "--dry-run", *args[cut:]])
    assert result.exit_code == 0, result.output
    return result.output


def engine_lines(out: str) -> dict[str, str]:
    """`up --dry-run` output -> role -> that process's command line."""
    roles = re.findall(r"^# (\w+) \(log ", out, flags=re.M)
    lines = [ln for ln in out.splitlines() if ln and not ln.startswith("#")]
    return dict(zip(roles, lines, strict=True))


TEXT = README.read_text()
SECTIONS = sections(TEXT)
QUICK = SECTIONS["Quick start (CPU, from a fresh clone)"]
TALK = SECTIONS["Talk to it"]
ALL_CODE = [ln for head, body in SECTIONS.items() if head != "Layout" for ln in code_lines(body)]


def test_readme_is_short() -> None:
    assert len(TEXT.splitlines()) <= MAX_LINES


def test_quick_start_commands_exist_and_parse() -> None:
    lines = code_lines(QUICK)
    assert lines[0] == "bash .ci/setup && .venv/bin/kvferry run"
    for line in lines:
        for argv in commands(line):
            if argv[0] == "bash":
                assert (ROOT / argv[1]).is_file(), argv
            elif argv[:3] == [".venv/bin/python", "-m", "pytest"]:
                continue  # the test command (test_test_command_is_what_ci_runs)
            else:
                assert is_kvferry(argv), argv
                assert parse_kvferry(argv).info_name == "run"


def test_test_command_is_what_ci_runs() -> None:
    """The README's test command is the line .ci/run runs, word for word."""
    command = "bash .ci/setup --tests && bash .ci/test"
    assert command in code_lines(QUICK)
    ci_run = (ROOT / ".ci" / "run").read_text()
    assert re.search(rf"^{re.escape(command)}( \"\$@\")?$", ci_run, flags=re.M), ci_run
    assert "`bash\n.ci/run`" in QUICK or "`bash .ci/run`" in QUICK  # names what CI runs


def served_name() -> str:
    """The model name the README's `kvferry up` line serves (its --served-model-name)."""
    (line,) = [ln for ln in code_lines(TALK) if is_kvferry(shlex.split(ln))]
    argv = shlex.split(line)
    ctx = parse_kvferry(argv)
    assert ctx.info_name == "up"
    extra = ctx.args
    name = extra[extra.index("--served-model-name") + 1]
    out = engine_lines(dry_run(argv))
    for role in ("prefill", "decode"):
        assert f"--served-model-name {name}" in out[role], out[role]
    return name


def router_paths() -> set[str]:
    settings = RouterSettings(prefill_urls=["http://127.0.0.1:8100"],
                              decode_urls=["http://127.0.0.1:8200"])
    return {getattr(r, "path", "") for r in create_app(settings, b"k").routes}


def test_talk_to_it_curl_uses_router_routes_and_the_served_name() -> None:
    name = served_name()
    paths = router_paths()
    curls = [shlex.split(ln) for ln in code_lines(TALK) if ln.startswith("curl ")]
    assert len(curls) >= 2
    for argv in curls:
        url = urlsplit(next(a for a in argv if a.startswith("http")))
        assert (url.hostname, url.port) == ("127.0.0.1", ROUTER_PORT)
        assert url.path in paths, url.path
        if "-d" in argv:
            body = json.loads(argv[argv.index("-d") + 1])
            assert body["model"] == name
            assert "Content-Type: application/json" in argv


def test_talk_to_it_sdk_snippet_targets_the_router() -> None:
    name = served_name()
    (snippet,) = fenced_python(TALK)
    tree = ast.parse(snippet)
    calls = {getattr(n.func, "attr", getattr(n.func, "id", "")): n
             for n in ast.walk(tree) if isinstance(n, ast.Call)}
    kw = {k.arg: ast.literal_eval(k.value) for k in calls["OpenAI"].keywords}
    assert kw["base_url"] == f"http://127.0.0.1:{ROUTER_PORT}/v1"
    assert "/v1/chat/completions" in router_paths()
    create = {k.arg: k.value for k in calls["create"].keywords}
    assert ast.literal_eval(create["model"]) == name
    # The SDK is importable where the README says it is installed (.venv).
    assert importlib.util.find_spec("openai") is not None


def test_every_kvferry_line_parses_and_up_lines_dry_run() -> None:
    lines = [shlex.split(ln) for ln in ALL_CODE if is_kvferry(shlex.split(ln))]
    assert len(lines) >= 4
    for argv in lines:
        ctx = parse_kvferry(argv)
        if ctx.info_name == "up":
            dry_run(argv)


def doc_commands(path: Path) -> list[list[str]]:
    """The `kvferry ...` commands in a page's code blocks, backslash continuations joined."""
    joined = re.sub(r"\\\n\s+", " ", path.read_text())
    out = []
    for line in code_lines(joined):
        for part in line.split("&&"):
            if Path(part.split(maxsplit=1)[0]).name == "kvferry":
                out.append(shlex.split(part))
    return out


@pytest.mark.parametrize("doc", USER_DOCS[1:], ids=lambda p: str(p.relative_to(ROOT)))
def test_every_kvferry_command_in_docs_parses(doc: Path) -> None:
    """`up` and `launch` lines also run with `--dry-run` (prints, writes nothing), which
    checks what the parser cannot: choices, TP against the instance type, ports."""
    for argv in doc_commands(doc):
        ctx = parse_kvferry(argv)
        if ctx.info_name in ("up", "launch"):
            out = dry_run(argv)
            assert "KVFERRY_SECRET" in out


def gpu_line(*must: str) -> list[str]:
    (line,) = [ln for ln in code_lines(SECTIONS["On GPUs"])
               if is_kvferry(shlex.split(ln)) and all(m in ln for m in must)
               and (must or "--share-device" not in ln and "--model" not in ln)]
    return shlex.split(line)


def test_two_gpus_put_prefill_on_gpu_0_and_decode_on_gpu_1() -> None:
    out = engine_lines(dry_run(gpu_line()))
    assert "CUDA_VISIBLE_DEVICES=0 " in out["prefill"]
    assert "CUDA_VISIBLE_DEVICES=1 " in out["decode"]


def test_one_gpu_shares_gpu_0_with_a_fixed_kv_size() -> None:
    out = engine_lines(dry_run(gpu_line("--share-device 30")))
    for role in ("prefill", "decode"):
        assert "CUDA_VISIBLE_DEVICES=0 " in out[role]
        assert f"--kv-cache-memory-bytes {30 << 30}" in out[role]
        assert "--gpu-memory-utilization 0.4" in out[role]


def test_a_hub_model_id_reaches_vllm_as_an_id() -> None:
    out = engine_lines(dry_run(gpu_line("--model Qwen/Qwen3-0.6B")))
    assert "--model Qwen/Qwen3-0.6B " in out["prefill"]


def test_cuda_install_extra_exists() -> None:
    (line,) = [ln for ln in ALL_CODE if "pip install" in ln]
    extra = re.search(r'"\.\[(\w+)\]"', line)
    assert extra and f"\n{extra.group(1)} = [" in (ROOT / "pyproject.toml").read_text()


def slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    s = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return s.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    return {slug(h) for h in re.findall(r"^#+ (.+)$", path.read_text(), flags=re.M)}


@pytest.mark.parametrize("doc", ALL_DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_links_resolve_inside_the_repository(doc: Path) -> None:
    links = re.findall(r"\]\(([^)\s]+)\)", doc.read_text())
    for link in links:
        assert not re.match(r"\w+://", link), f"{doc.name}: external link {link}"
        target, _, anchor = link.partition("#")
        path = (doc.parent / target).resolve() if target else doc
        assert path.is_relative_to(ROOT), f"{doc.name}: {link} leaves the repository"
        assert path.exists(), f"{doc.name}: {link} does not exist"
        if anchor:
            assert anchor in anchors(path), f"{doc.name}: no heading for #{anchor} in {path.name}"


def test_readme_links_every_docs_page() -> None:
    for page in sorted((ROOT / "docs").glob("*.md")):
        assert f"(docs/{page.name}" in TEXT, page.name


COMMIT = re.compile(r"\b(?=[0-9a-f]*\d)(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}\b")
ISSUE = re.compile(r"issue #?\d+|(?<![\w&])#\d+\b", flags=re.I)


@pytest.mark.parametrize("doc", USER_DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_user_docs_have_no_commit_hashes_issue_numbers_or_outside_paths(doc: Path) -> None:
    text = doc.read_text()
    assert not COMMIT.findall(text)
    assert not ISSUE.findall(text)
    assert "../shared" not in text


def layout_block() -> str:
    """The Layout section's code block, indentation kept: top-level names start a line."""
    body = SECTIONS["Layout"]
    return "\n".join(ln[4:] for ln in body.splitlines() if ln.startswith("    "))


def top_level_dirs() -> set[str]:
    """Source directories: hidden ones (caches, the venv, git) only for .ci."""
    return {p.name for p in ROOT.iterdir()
            if p.is_dir() and (p.name == ".ci" or not p.name.startswith("."))
            and p.name not in {"__pycache__", "build"} and not p.name.endswith(".egg-info")}


def test_layout_lists_every_top_level_directory_and_nothing_else() -> None:
    named = set(re.findall(r"^([.\w]+)/", layout_block(), flags=re.M))
    assert named == top_level_dirs()


def test_layout_names_only_paths_that_exist() -> None:
    block = layout_block()
    for sub in re.findall(r"\b(\w+)/ \(", block):  # "protocol/ (...)" inside connectors/ or router/
        assert (ROOT / "connectors" / sub).is_dir() or (ROOT / "router" / sub).is_dir(), sub
    packages = ("connectors", "neuron", "router", "scripts", "tests", "benchmarks")
    for module in re.findall(r"\b(\w+\.py)\b", block):
        assert any(list((ROOT / p).rglob(module)) for p in packages), module
