"""Every `swarm-client` command quoted in README.md and docs/ parses with the real CLI; every relative link resolves."""

from __future__ import annotations

import json
import os
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import pytest

from client.cli import build_parser

ROOT = Path(__file__).resolve().parent.parent
DOC_FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "benchmarks" / "results" / "README.md"]
SKIPPED_FENCES = {"json", "toml", "mermaid", "python", "yaml"}
DOCKER_RUN_VALUE_FLAGS = {
    *("-p", "-v", "-e", "-w", "--gpus", "--name", "--restart", "--shm-size", "--env-file", "--ipc"),
    *("--stop-timeout", "--entrypoint", "--env", "--volume", "--publish", "--user"),
}
SEPARATORS = {"&&", "||", ";", "|"}
MIN_COMMANDS = 15


@dataclass(frozen=True)
class Quoted:
    where: str  # file:line
    argv: list[str]  # arguments after `swarm-client`
    env: dict[str, str]  # SWARM_* variables set on the same command line (VAR=value or docker -e)

    def __str__(self) -> str:
        return f"{self.where}: swarm-client {shlex.join(self.argv)}"


def code_lines(path: Path) -> list[tuple[int, str]]:
    """Lines of fenced code blocks (continuations joined) and inline code spans, with their line numbers."""
    found: list[tuple[int, str]] = []
    fence, pending, pending_at = None, "", 0
    for number, line in enumerate(path.read_text().splitlines(), 1):
        stripped = line.strip()
        if stripped.startswith("```"):
            fence = None if fence is not None else (stripped[3:].strip() or "text")
            continue
        if fence is None:
            found += [(number, span) for span in re.findall(r"`([^`]+)`", line)]
            continue
        if fence in SKIPPED_FENCES:
            continue
        if not pending:
            pending_at = number
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        found.append((pending_at, pending + stripped))
        pending = ""
    return found


def default_cmd() -> list[str]:
    match = re.search(r"^CMD\s+(\[.*\])\s*$", (ROOT / "Dockerfile").read_text(), re.MULTILINE)
    return json.loads(match.group(1)) if match else []


def docker_run(tokens: list[str]) -> tuple[list[str], dict[str, str]] | None:
    """`docker run [options] IMAGE [args]` -> the entrypoint's args (the image's CMD when none) and -e variables.

    None when the container runs another entrypoint (e.g. hivemind-dht for a bootstrap node).
    """
    env: dict[str, str] = {}
    entrypoint = "swarm-client"
    i = 2
    while i < len(tokens) and tokens[i].startswith("-"):
        flag = tokens[i]
        value = None
        if "=" in flag:
            flag, value = flag.split("=", 1)
        elif flag in DOCKER_RUN_VALUE_FLAGS:
            i += 1
            value = tokens[i] if i < len(tokens) else ""
        if flag in ("-e", "--env") and value and "=" in value:
            name, val = value.split("=", 1)
            env[name] = val
        if flag == "--entrypoint":
            entrypoint = value
        i += 1
    if i >= len(tokens) or entrypoint != "swarm-client":
        return None
    return tokens[i + 1 :] or default_cmd(), env


def quoted_commands(path: Path) -> list[Quoted]:
    commands = []
    for number, text in code_lines(path):
        text = re.sub(r"^\s*\$\s+", "", text)  # a shell prompt
        try:
            tokens = shlex.split(text, comments=True)
        except ValueError:
            continue
        segment: list[str] = []
        for token in [*tokens, ";"]:
            if token not in SEPARATORS:
                segment.append(token)
                continue
            env = {}
            while segment and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", segment[0]):
                name, value = segment.pop(0).split("=", 1)
                env[name] = value
            where = f"{path.relative_to(ROOT)}:{number}"
            if segment[:1] == ["swarm-client"]:
                commands.append(Quoted(where, segment[1:], env))
            elif segment[:2] == ["docker", "run"] and (parsed := docker_run(segment)):
                commands.append(Quoted(where, parsed[0], {**env, **parsed[1]}))
            elif segment[:2] == ["docker", "exec"] and "swarm-client" in segment:
                commands.append(Quoted(where, segment[segment.index("swarm-client") + 1 :], env))
            segment = []
    return commands


ALL = [c for path in DOC_FILES for c in quoted_commands(path)]


def test_the_docs_quote_enough_commands():
    assert len(ALL) >= MIN_COMMANDS, [str(c) for c in ALL]
    quoted_in = {c.where.split(":")[0] for c in ALL}
    for name in ("README.md", "docs/volunteer.md", "docs/operator.md"):
        assert name in quoted_in, f"{name} quotes no swarm-client command"
    subcommands = {c.argv[0] for c in ALL if c.argv}
    assert {"start", "join", "demo", "export", "status", "doctor", "health"} <= subcommands, subcommands


@pytest.mark.parametrize("quoted", ALL, ids=str)
def test_quoted_command_parses(monkeypatch, quoted):
    for name in list(os.environ):
        if name.startswith("SWARM_"):
            monkeypatch.delenv(name)
    for name, value in quoted.env.items():
        monkeypatch.setenv(name, value)
    try:
        build_parser().parse_args(quoted.argv)
    except SystemExit as e:
        assert e.code == 0 and ("--help" in quoted.argv or "-h" in quoted.argv), f"{quoted} does not parse"


LINK = re.compile(r"\]\(([^)\s]+)\)")


@pytest.mark.parametrize("path", DOC_FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(path):
    broken = []
    for target in LINK.findall(path.read_text()):
        if re.match(r"^[a-z]+:", target) or target.startswith("#"):
            continue
        if not (path.parent / target.split("#")[0]).exists():
            broken.append(target)
    assert not broken, f"{path.name} links to missing files: {broken}"


def test_the_benchmark_report_reads_in_ten_minutes_and_each_section_names_its_result_files():
    """docs/benchmarks.md is the current figures, not a lab notebook: under 400 lines, each numbered section linking
    the result files its figures come from; the history lives in benchmarks/results/README.md, linked from it."""
    text = (ROOT / "docs" / "benchmarks.md").read_text()
    assert len(text.splitlines()) < 400
    sections = re.split(r"^## \d+\. ", text, flags=re.MULTILINE)[1:]
    assert len(sections) >= 12
    unlinked = [s.splitlines()[0] for s in sections if "](../benchmarks/results/" not in s]
    assert not unlinked, f"sections without a result file: {unlinked}"
    assert "](../benchmarks/results/README.md)" in text


def test_the_docs_exist():
    for name in ("volunteer.md", "operator.md", "architecture.md", "security.md"):
        text = (ROOT / "docs" / name).read_text()
        assert text.startswith("# ") and len(text) > 1000, name
    readme = (ROOT / "README.md").read_text()
    for name in ("volunteer.md", "operator.md", "architecture.md", "security.md"):
        assert f"docs/{name}" in readme, f"README.md does not link docs/{name}"


def test_run_ids_in_the_docs_are_the_presets_current_ones():
    """A run id is the hash of the manifest: when a preset or a manifest default changes, so do the quoted ids."""
    from client.presets import PRESETS, build_manifest

    current = {build_manifest(name).run_id: name for name in PRESETS}
    for path in DOC_FILES:
        text = path.read_text()
        stale = sorted({i for i in re.findall(r"\b[0-9a-f]{16}\b", text) if i not in current})
        assert not stale, f"{path.name} quotes run ids that no preset has now: {stale}; current: {current}"
        for run_id, name in re.findall(r"Run ([0-9a-f]{16}) \(([\w-]+)\)", text):
            preset = current.get(run_id)
            assert preset and PRESETS[preset]["name"] == name, (path.name, run_id, name)


def test_operator_manifest_table_lists_exactly_the_manifest_fields():
    from pydantic import BaseModel

    from swarm import RunManifest

    def leaves(model: type[BaseModel], prefix: str = "") -> set[str]:
        out = set()
        for name, info in model.model_fields.items():
            kind = info.annotation
            if isinstance(kind, type) and issubclass(kind, BaseModel):
                out |= leaves(kind, f"{prefix}{name}.")
            else:
                out.add(prefix + name)
        return out

    text = (ROOT / "docs" / "operator.md").read_text()
    table = text[text.index("| Field | Default | Meaning |") :].split("\n\n")[0]
    documented = set()
    for row in table.splitlines()[2:]:
        section = ""
        for name in re.findall(r"`([\w.]+)`", row.split("|")[1]):
            if name.startswith("."):
                documented.add(section + name)
            else:
                documented.add(name)
                section = name.rsplit(".", 1)[0] if "." in name else ""
    assert documented == leaves(RunManifest) - {"version"}, (
        f"missing: {leaves(RunManifest) - documented - {'version'}}; unknown: {documented - leaves(RunManifest)}"
    )
