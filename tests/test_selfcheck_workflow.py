""".github/workflows/ci.yml cannot run here; what can be checked is: it parses, it has
the three jobs, its actions are official and pinned, and every command it runs exists
in the project (scripts, kvmetal subcommands and their flags, extras, the README's
test command)."""
from __future__ import annotations

import contextlib
import copy
import io
import os
import re
import shlex
from pathlib import Path

import pytest
import yaml  # PyYAML: a dependency of mlx-lm, which the test extra installs

from kvmetal import cli

ROOT = Path(__file__).resolve().parent.parent
WORKFLOW = ROOT / ".github" / "workflows" / "ci.yml"
# Tools a runner or the container image provides; everything else must be in the project.
EXTERNAL = {"pip", "python", "pytest", "cd"}


@pytest.fixture(scope="module")
def workflow():
    return yaml.safe_load(WORKFLOW.read_text())


def _steps(workflow, job):
    return workflow["jobs"][job]["steps"]


def _commands(workflow):
    """(job, simple command as words) for every command of every `run:` step."""
    for job, spec in workflow["jobs"].items():
        for step in spec["steps"]:
            script = step.get("run")
            if not script:
                continue
            for line in script.replace("\\\n", " ").splitlines():
                line = line.split(" #")[0].strip()
                for part in re.split(r"&&|\|\||;|\|", line):
                    if part.strip():
                        yield job, step, shlex.split(part)


def _expand(word: str) -> str:
    """Shell and expression placeholders -> a plausible value, for parsing flags."""
    return re.sub(r"\$\{\{[^}]*\}\}|\$\w+|\$\{\w+\}", "x", word)


def test_workflow_parses_with_the_three_jobs(workflow):
    triggers = workflow.get("on", workflow.get(True))  # YAML 1.1 reads a bare `on` as True
    assert {"push", "pull_request"} <= set(triggers)
    assert "v*" in triggers["push"]["tags"]
    assert set(workflow["jobs"]) == {"linux", "macos", "wheels"}
    assert all(spec.get("timeout-minutes") for spec in workflow["jobs"].values())


def test_actions_are_official_and_pinned(workflow):
    uses = [step["uses"] for spec in workflow["jobs"].values() for step in spec["steps"] if "uses" in step]
    assert uses
    for use in uses:
        assert re.fullmatch(r"actions/[\w-]+@(v\d+(\.\d+){0,2}|[0-9a-f]{40})", use), use


def test_linux_job_runs_ci_run_and_uploads_selfcheck(workflow):
    runs = [s.get("run", "") for s in _steps(workflow, "linux")]
    assert ".ci/run" in runs
    selfcheck = next(r for r in runs if "selfcheck" in r)
    report = re.search(r'--json "\$GITHUB_WORKSPACE/([\w.-]+)"', selfcheck).group(1)
    upload = next(s for s in _steps(workflow, "linux") if s.get("uses", "").startswith("actions/upload-artifact"))
    assert upload["with"]["path"] == report and "cancelled" in upload["if"]
    # It runs the kvmetal that .ci/run installed, in the venv .ci/run makes.
    venv = re.match(r"(/tmp/[\w-]+)/bin/kvmetal", selfcheck).group(1)
    assert f"python3 -m venv {venv}" in (ROOT / ".ci" / "run").read_text()


def test_macos_job_runs_the_readme_commands_on_arm64(workflow):
    job = workflow["jobs"]["macos"]
    assert set(job["strategy"]["matrix"]["os"]) <= {"macos-14", "macos-15"} and job["strategy"]["matrix"]["os"]
    runs = [s.get("run", "").strip() for s in job["steps"]]
    readme = (ROOT / "README.md").read_text()
    test_command = next(line for line in readme.splitlines() if line.startswith('pip install ".[test]" && pytest'))
    install, test = (part.strip() for part in test_command.split("&&"))
    assert install in runs and any(r.split()[0] == test for r in runs if r)
    # The selfcheck report is written, then uploaded even when a check failed.
    selfcheck = next(r for r in runs if r.startswith("kvmetal selfcheck"))
    path = re.search(r'--json "([^"]+)"', selfcheck).group(1)
    upload = next(s for s in job["steps"] if s.get("uses", "").startswith("actions/upload-artifact"))
    assert upload["with"]["path"] == path.replace("$RUNNER_TEMP", "${{ runner.temp }}")
    assert "cancelled" in upload["if"]
    assert runs.index(selfcheck) < next(i for i, r in enumerate(runs) if r.startswith("pytest"))


def test_wheels_job_runs_cibuildwheel_on_tags(workflow):
    job = workflow["jobs"]["wheels"]
    assert "refs/tags/" in job["if"]
    runs = " ".join(s.get("run", "") for s in job["steps"])
    assert re.search(r"pip install cibuildwheel==\d+\.\d+\.\d+", runs) and "python -m cibuildwheel" in runs
    assert "[tool.cibuildwheel]" in (ROOT / "pyproject.toml").read_text()
    archs = {entry["arch"] for entry in job["strategy"]["matrix"]["include"]}
    assert archs == {"x86_64", "aarch64", "arm64"}  # what [tool.cibuildwheel] builds


def _extras() -> set:
    text = (ROOT / "pyproject.toml").read_text()
    section = text.split("[project.optional-dependencies]", 1)[1].split("\n[", 1)[0]
    return set(re.findall(r"^(\w+)\s*=", section, re.M))


def _kvmetal_problem(args) -> str | None:
    if not args or args[0] not in cli.COMMANDS:
        return f"no kvmetal command {args[:1]}"
    import importlib

    parser = importlib.import_module(cli.COMMANDS[args[0]][0])._parser()
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            parser.parse_args([_expand(a) for a in args[1:]])
    except SystemExit as exc:
        return f"kvmetal {' '.join(args)} does not parse (exit {exc.code})"
    return None


def command_problems(workflow) -> tuple:
    """(problems, commands seen): each command a run step runs that the project lacks."""
    problems, seen = [], set()
    for job, step, words in _commands(workflow):
        where = f"job {job}, step {step.get('name', step.get('run'))!r}"
        while words and re.fullmatch(r"\w+=.*", words[0]):  # leading VAR=value
            words = words[1:]
        cmd, args = words[0], words[1:]
        seen.add(cmd)
        problem = None
        if cmd == "kvmetal" or cmd.endswith("/bin/kvmetal"):
            problem = _kvmetal_problem(args)
        elif cmd == "python" and args[:2] == ["-m", "cibuildwheel"]:
            installs = " ".join(s.get("run", "") for s in workflow["jobs"][job]["steps"])
            if "pip install cibuildwheel==" not in installs:
                problem = "cibuildwheel runs without a pinned install"
        elif cmd in ("pip", "python"):
            if cmd == "python":
                args = args[2:] if args[:2] == ["-m", "pip"] else ["?"]
            if args[:1] != ["install"]:
                problem = f"unexpected {words}"
            for target in args[1:]:
                extra = re.fullmatch(r"\.\[([\w,]+)\]", target)
                if extra and not set(extra.group(1).split(",")) <= _extras():
                    problem = f"unknown extra in {target}"
                elif not extra and target != "." and not re.fullmatch(r"[\w-]+==[\w.]+", target):
                    problem = f"unpinned or unknown install target {target}"
        elif cmd not in EXTERNAL:
            path = ROOT / cmd
            if not (path.is_file() and os.access(path, os.X_OK)):
                problem = f"{cmd} is not an executable in the project"
        if problem:
            problems.append(f"{where}: {problem}")
    return problems, seen


def test_every_command_exists_in_the_project(workflow):
    problems, seen = command_problems(workflow)
    assert problems == []
    assert {".ci/run", "pip", "pytest", "python"} <= seen and any(c.endswith("kvmetal") for c in seen)


@pytest.mark.parametrize("bad, why", [
    ("kvmetal selfchek --json r.json", "no kvmetal command"),
    ("kvmetal selfcheck --jsn r.json", "does not parse"),
    ("tools/no_such_script.sh", "not an executable"),
    ('pip install ".[nosuch]"', "unknown extra"),
    ("python -m cibuildwheel --output-dir w", "without a pinned install"),
])
def test_the_command_check_catches_what_is_missing(workflow, bad, why):
    broken = copy.deepcopy(workflow)
    broken["jobs"]["linux"]["steps"].append({"name": "bad", "run": bad})
    problems, _ = command_problems(broken)
    assert len(problems) == 1 and why in problems[0], problems
