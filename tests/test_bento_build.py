"""`bentoml build` offline: the bento's service target, its model reference and the generated Dockerfile; and
the wheel's package data."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile

import pytest
import yaml

from bento_pagedllm.web import STATIC_DIR

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TILES_DIR = os.path.join(REPO, "bento_pagedllm", "kernels", "tiles")
BIN = os.path.dirname(sys.executable)


@pytest.mark.timeout(600)
def test_bentoml_build_offline_references_the_model(smollm2_model):
    env = dict(os.environ, PATH=f"{BIN}:{os.environ['PATH']}")
    result = subprocess.run([os.path.join(BIN, "bentoml"), "build", "--output", "tag"], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    tag = result.stdout.strip().splitlines()[-1].removeprefix("__tag__:")
    assert tag.startswith("pagedllm:")
    info = json.loads(subprocess.run([os.path.join(BIN, "bentoml"), "get", tag, "-o", "json"], env=env,
                                     capture_output=True, text=True, check=True).stdout)
    bento_dir = os.path.join(os.environ["BENTOML_HOME"], "bentos", *tag.split(":"))
    with open(os.path.join(bento_dir, "bento.yaml")) as f:
        manifest = yaml.safe_load(f)
    assert manifest["service"] == "service:svc"
    models = [m["tag"] for service in manifest["services"] for m in service["models"]]
    assert models == [str(smollm2_model.tag)], (models, info)
    assert {e["name"]: e["value"] for e in manifest["envs"]} == {"PAGEDLLM_DEVICE": "cuda", "PAGEDLLM_DTYPE": "bfloat16"}
    # built on this CPU machine, the bento still asks for a GPU (the bento argument `accelerator`)
    (service,) = manifest["services"]
    assert manifest["args"] == {"accelerator": "gpu"}
    assert service["config"]["resources"] == {"gpu": 1}, service["config"]
    # what BentoML lists of the API: the /v1 routes where they are served (BentoCloud reads `openai_endpoint`)
    assert manifest["labels"]["openai_endpoint"] == "/v1"
    with open(os.path.join(bento_dir, "apis", "schema.json")) as f:
        paths = set(json.load(f)["paths"])
    assert {"/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/models", "/tokenize", "/health"} <= paths
    assert all(path.startswith(("/v1/", "/chat")) or path.count("/") == 1 for path in paths), paths
    # the engine's source and the chat page travel with the bento; tests and benchmarks do not
    src = os.path.join(bento_dir, "src")
    for path in ("service.py", "bento_pagedllm/engine.py", "bento_pagedllm/openai/routes.py",
                 "bento_pagedllm/kernels/__init__.py", "bento_pagedllm/web/app.py",
                 *(f"bento_pagedllm/web/static/{name}" for name in os.listdir(STATIC_DIR)),
                 *(f"bento_pagedllm/kernels/tiles/{name}" for name in os.listdir(TILES_DIR))):
        assert os.path.isfile(os.path.join(src, path)), path
    assert not os.path.exists(os.path.join(src, "tests"))
    with open(os.path.join(bento_dir, "env", "docker", "Dockerfile")) as f:
        dockerfile = f.read()
    assert "FROM python:3.11" in dockerfile
    assert 'ENTRYPOINT [ "/home/bentoml/bento/env/docker/entrypoint.sh" ]' in dockerfile
    assert "EXPOSE 3000" in dockerfile
    with open(os.path.join(bento_dir, "env", "docker", "entrypoint.sh")) as f:
        assert "bentoml" in f.read()  # the entrypoint serves the bento
    with open(os.path.join(bento_dir, "env", "python", "requirements.txt")) as f:
        requirements = f.read()
    assert "torch" in requirements and "bentoml" in requirements


@pytest.mark.timeout(300)
def test_the_wheel_ships_every_module_and_the_chat_page(tmp_path):
    """pyproject's packages and package data: an installed package has every module of the source tree (an
    editable install would hide one left out), serves /chat from the same files and pins the same measured
    tiles (kernels/tiles/)."""
    result = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                             "-w", str(tmp_path), REPO], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    (wheel,) = tmp_path.glob("bento_pagedllm-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
    package_root = os.path.join(REPO, "bento_pagedllm")
    modules = {os.path.relpath(os.path.join(folder, name), REPO) for folder, _, files in os.walk(package_root)
               for name in files if name.endswith(".py")}
    assert len(modules) > 40 and modules <= names, sorted(modules - names)
    for name in os.listdir(STATIC_DIR):
        assert f"bento_pagedllm/web/static/{name}" in names, name
    assert "bento_pagedllm/web/app.py" in names
    for name in os.listdir(TILES_DIR):
        assert f"bento_pagedllm/kernels/tiles/{name}" in names, name


@pytest.mark.parametrize("where", ["the project root", "elsewhere"])
def test_nothing_of_ours_imports_as_kernels(where, tmp_path):
    """`bentoml serve service:svc` runs with the project root first on sys.path, and transformers imports the PyPI
    package `kernels` (a dependency since 5.25): nothing named `kernels` at the root, nor in our install, may
    stand in for it (ours import as `bento_pagedllm.kernels`)."""
    probe = ("import importlib.util, sys; spec = importlib.util.find_spec('kernels'); "
             "print(spec.origin if spec else '')")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    cwd = REPO if where == "the project root" else tmp_path
    result = subprocess.run([sys.executable, "-c", probe], cwd=cwd, env=env, capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr
    origin = result.stdout.strip()
    assert not origin.startswith((os.path.join(REPO, "kernels"), os.path.join(REPO, "bento_pagedllm"))), origin


def test_the_image_requirements_are_the_packages_ranges():
    """requirements-bento.txt (what `bentoml containerize` installs) names each package with pyproject's own
    range, so the image and a source install cannot drift apart; every range has an upper bound (a fresh
    install takes the newest release allowed)."""
    import tomllib

    from packaging.requirements import Requirement

    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)["project"]
    ranges = {Requirement(line).name: Requirement(line) for line in project["dependencies"]}
    with open(os.path.join(REPO, "requirements-bento.txt")) as f:
        image = [Requirement(line) for line in f.read().split("\n") if line.strip() and not line.startswith("#")]
    assert {r.name for r in image} >= {"torch", "bentoml", "transformers", "llguidance"}
    for requirement in image:
        assert str(requirement.specifier) == str(ranges[requirement.name].specifier), requirement
    extras = [Requirement(line) for lines in project["optional-dependencies"].values() for line in lines]
    for requirement in [*ranges.values(), *extras]:
        if requirement.name != "setuptools":  # NOTE: the build backend's floor only
            assert any(spec.operator in ("<", "<=", "==") for spec in requirement.specifier), requirement
