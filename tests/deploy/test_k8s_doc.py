"""docs/kubernetes.md runs as written: every command of it names objects the generator renders.

No cluster. The doc's ```bash blocks (``\\``-continued lines joined, heredocs kept with their
command) and its inline ``kubectl ...`` / ``metaps ...`` spans are read from the doc, not
copied here. In a scratch folder holding the repo's ``configs/``:

* every ``metaps deploy k8s ...`` command runs as written (in process: the ``metaps`` parser and
  its handler) and each ``--out`` directory is rendered once with ``kubectl kustomize``;
* every ``kubectl`` command's objects -- ``KIND/NAME`` arguments, ``get|delete|patch KIND NAME...``,
  ``-l`` selectors, ``apply -k DIR`` / ``apply -f FILE``, ``cp ... POD:PATH``, ``--from=cronjob/X``
  -- exist in that output with that kind, name and namespace (``-n``), or were created by an
  earlier command of the doc (its loader pod, whose volume claim must be rendered too, or a
  ``create job``);
* every ``ctr-...`` name in a bash block (comments included) is an object the doc renders or creates;
* every ``metaps`` command (those run by ``kubectl exec ... --`` included) names a subcommand
  and flags its parser has.

One render per module: the whole file takes a few seconds.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "kubernetes.md"
KINDS = {"job": "Job", "jobs": "Job", "cronjob": "CronJob", "cronjobs": "CronJob", "pod": "Pod", "pods": "Pod",
         "jobset": "JobSet", "jobsets": "JobSet", "pvc": "PersistentVolumeClaim", "svc": "Service",
         "service": "Service", "configmap": "ConfigMap", "secret": "Secret", "namespace": "Namespace"}
VERBS_WITH_NAMES = ("get", "delete", "patch", "describe", "wait", "logs", "exec")
Obj = tuple[str, str, str]  # kind, name, namespace ('' = none given)


def commands(text: str) -> tuple[list[tuple[str, str]], list[str]]:
    """(command, heredoc body) of every ```bash block, in order, and every block's raw text."""
    out: list[tuple[str, str]] = []
    raw: list[str] = []
    for body in re.findall(r"^ *```bash\n(.*?)^ *```", text, flags=re.S | re.M):
        raw.append(body)
        lines = [ln.strip() for ln in body.splitlines()]
        i, cur = 0, ""
        while i < len(lines):
            ln = lines[i]
            i += 1
            cur = f"{cur} {ln[:-1]}" if ln.endswith("\\") else f"{cur} {ln}"
            if ln.endswith("\\"):
                continue
            cmd, cur = cur.strip(), ""
            if not cmd or cmd.startswith("#"):
                continue
            doc = ""
            m = re.search(r"<<-?'?(\w+)'?", cmd)
            if m:
                end = lines.index(m.group(1), i)
                doc, i = "\n".join(body.splitlines()[i:end]), end + 1
            out.append((cmd, doc))
    return out, raw


def inline_spans(text: str) -> list[str]:
    """Inline code spans of the prose that are whole commands (``kubectl ...``, ``metaps ...``)."""
    prose = re.sub(r"^ *```.*?^ *```", "", text, flags=re.S | re.M)
    spans = [re.sub(r"\s+", " ", s) for s in re.findall(r"`([^`]+)`", prose)]
    return [s for s in spans if re.match(r"^(kubectl|metaps) [-a-z]", s) and "..." not in s]


def split_pipeline(cmd: str) -> list[list[str]]:
    """The simple commands of a line (split on ``&&``, ``;``, ``&``), as words, comments dropped."""
    words = shlex.split(re.sub(r"<<-?'?\w+'?", "", cmd), comments=True)
    parts: list[list[str]] = [[]]
    for w in words:
        if w in ("&&", ";", "&", "||"):
            parts.append([])
        else:
            for piece in re.split(r"(;|&&|&)$", w):  # `... & ok=$!`, `cmd;`
                if piece in (";", "&&", "&"):
                    parts.append([])
                elif piece:
                    parts[-1].append(piece)
    return [p for p in parts if p]


def metaps_parser() -> Any:
    from metaps.cli import build_parser

    return build_parser()


def check_metaps(words: list[str], parser: Any) -> None:
    """``metaps SUB [SUB2] --flag ...``: the subcommands exist, every ``--flag`` is one of theirs."""
    import argparse

    assert words[0] == "metaps", words
    p, i = parser, 1
    while i < len(words):
        subs = [a for a in p._actions if isinstance(a, argparse._SubParsersAction)]
        if not subs or words[i].startswith("-"):
            break
        assert words[i] in subs[0].choices, f"`metaps {' '.join(words[1:i + 1])}`: no such subcommand"
        p, i = subs[0].choices[words[i]], i + 1
    flags = {s for a in p._actions for s in a.option_strings}
    for w in words[i:]:
        if w.startswith("--"):
            assert w.split("=")[0] in flags, f"`{' '.join(words)}`: {w.split('=')[0]} is not a flag of `{p.prog}`"


class Rendered:
    """What the doc's ``metaps deploy k8s`` commands wrote (``by_dir``, rendered), and what its
    commands have applied or created so far (``objects``): a command acts on the latter only."""

    def __init__(self, work: Path) -> None:
        self.work = work
        self.objects: dict[Obj, dict[str, Any]] = {}
        self.by_dir: dict[str, list[dict[str, Any]]] = {}
        self.namespaces: set[str] = set()

    @property
    def dirs(self) -> set[str]:
        return set(self.by_dir)

    def apply(self, docs: list[dict[str, Any]]) -> None:
        for d in docs:
            self.add(d)

    def apply_all(self) -> None:
        """Every rendered directory (the prose's commands refer to any section's output)."""
        for docs in self.by_dir.values():
            self.apply(docs)

    def add(self, doc: dict[str, Any]) -> None:
        meta = doc.get("metadata") or {}
        self.objects[(doc["kind"], meta["name"], meta.get("namespace", ""))] = doc

    def has(self, kind: str, name: str, ns: str) -> bool:
        return any(k == kind and n == name and (not ns or s in ("", ns)) for k, n, s in self.objects)

    def names(self) -> set[str]:
        return {n for _, n, _ in self.objects}

    def selects(self, selector: str, ns: str) -> bool:
        """Some rendered object (or pod template) carries every ``key=value`` of the selector."""
        want = dict(kv.split("=", 1) for kv in selector.split(","))

        def labels(d: dict[str, Any]) -> list[dict[str, str]]:
            found = [(d.get("metadata") or {}).get("labels") or {}]
            spec = d.get("spec") or {}
            tmpl = spec.get("template") or (spec.get("jobTemplate") or {}).get("spec", {}).get("template") or {}
            found.append((tmpl.get("metadata") or {}).get("labels") or {})
            return found
        return any(all(lb.get(k) == v for k, v in want.items())
                   for (_, _, s), d in self.objects.items() if not ns or s in ("", ns) for lb in labels(d))


def _run_generator(words: list[str], work: Path, parser: Any) -> str:
    """``metaps deploy k8s ...`` as written, in ``work``; its ``--out``."""
    args = parser.parse_args(words[1:])
    here = Path.cwd()
    os.chdir(work)
    try:
        assert args.func(args) == 0, words
    finally:
        os.chdir(here)
    return args.out


@pytest.fixture(scope="module")
def doc() -> tuple[list[tuple[str, str]], list[str], list[str]]:
    text = DOC.read_text()
    cmds, raw = commands(text)
    return cmds, raw, inline_spans(text)


@pytest.fixture(scope="module")
def rendered(doc: Any, tmp_path_factory: pytest.TempPathFactory) -> Rendered:
    """Every ``metaps deploy k8s`` command of the doc run and its output rendered (once)."""
    assert shutil.which("kubectl"), "kubectl (with kustomize) is required on test machines"
    work = tmp_path_factory.mktemp("k8sdoc")
    shutil.copytree(REPO / "configs", work / "configs")
    parser = metaps_parser()
    out = Rendered(work)
    for cmd, _ in doc[0]:
        for words in split_pipeline(cmd):
            if words[:3] == ["metaps", "deploy", "k8s"]:
                out.by_dir[_run_generator(words, work, parser)] = []
    assert out.dirs, "no `metaps deploy k8s` command in docs/kubernetes.md"
    for d in sorted(out.dirs):
        r = subprocess.run(["kubectl", "kustomize", str(work / d)], capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, f"kubectl kustomize {d}: {r.stderr}"
        out.by_dir[d] = [obj for obj in yaml.safe_load_all(r.stdout) if obj]
        out.namespaces |= {obj["metadata"].get("namespace", "") for obj in out.by_dir[d]}
    return out


def _ns(words: list[str]) -> str:
    for i, w in enumerate(words):
        if w in ("-n", "--namespace") and i + 1 < len(words):
            return words[i + 1]
        if w.startswith("--namespace="):
            return w.split("=", 1)[1]
    return ""


def check_kubectl(words: list[str], heredoc: str, r: Rendered, parser: Any) -> None:
    """One ``kubectl`` command's objects exist (or the doc created them before)."""
    where = " ".join(words)
    ns = _ns(words)
    if ns:
        assert ns in r.namespaces, f"`{where}`: namespace {ns!r}, the manifests are in {sorted(r.namespaces)}"
    rest = [w for i, w in enumerate(words[1:], 1)
            if w not in ("-n", "--namespace") and words[i - 1] not in ("-n", "--namespace")]
    if "--" in rest:  # kubectl exec ... -- metaps ...
        cmd = rest[rest.index("--") + 1:]
        rest = rest[:rest.index("--")]
        if cmd and cmd[0] == "metaps":
            check_metaps(cmd, parser)
    verb = rest[0]
    if verb == "create" and rest[1] == "namespace":
        assert rest[2] in r.namespaces, f"`{where}`: the manifests are in {sorted(r.namespaces)}"
        return
    for i, w in enumerate(rest):
        if i + 1 == len(rest):  # a bare `kubectl apply -k` in the prose names nothing
            break
        if w == "-l" or w.startswith("-l="):
            sel = rest[i + 1] if w == "-l" else w[3:]
            assert r.selects(sel, ns), f"`{where}`: no rendered object carries the labels {sel}"
        if w == "-k" and verb in ("apply", "kustomize", "delete"):
            assert rest[i + 1] in r.dirs or rest[i + 1].startswith("overlays/"), \
                f"`{where}`: {rest[i + 1]} is no directory a `metaps deploy k8s` command of the doc wrote"
            if verb == "apply" and rest[i + 1] in r.dirs:
                r.apply(r.by_dir[rest[i + 1]])
        if w == "-f" and verb in ("apply", "create", "delete") and rest[i + 1] != "-":
            path = Path(rest[i + 1])
            assert str(path.parent) in r.dirs and (r.work / path).is_file(), f"`{where}`: {path} is not written"
            if verb == "apply":
                r.apply([d for d in yaml.safe_load_all((r.work / path).read_text()) if d])
        if w == "-f" and verb in ("apply", "create") and rest[i + 1] == "-":
            for obj in yaml.safe_load_all(heredoc):
                obj.setdefault("metadata", {}).setdefault("namespace", ns)
                for vol in (obj.get("spec") or {}).get("volumes") or []:
                    claim = (vol.get("persistentVolumeClaim") or {}).get("claimName")
                    if claim:
                        assert r.has("PersistentVolumeClaim", claim, ns), f"`{where}`: no PVC {claim} in {ns}"
                r.add(obj)
    names: list[tuple[str, str]] = []
    for w in rest[1:]:
        w = w.split("=", 1)[1] if w.startswith("--from=") else w
        m = re.fullmatch(r"([a-z]+)/([a-z0-9][-a-z0-9.]*)", w)
        if m and m.group(1) in KINDS:
            names.append((KINDS[m.group(1)], m.group(2)))
    if verb == "cp":
        pods = [w.split(":", 1)[0] for w in rest[1:] if ":" in w]
        names += [("Pod", p) for p in pods]
    if verb in VERBS_WITH_NAMES and len(rest) > 1 and rest[1] in KINDS:
        for w in rest[2:]:
            if w.startswith("-"):
                break
            names.append((KINDS[rest[1]], w))
    for kind, name in names:
        assert r.has(kind, name, ns), f"`{where}`: no {kind} {name!r} in namespace {ns!r} rendered or created"
    if verb == "create" and rest[1] == "job":  # kubectl create job --from=cronjob/X NAME
        r.add({"kind": "Job", "metadata": {"name": rest[-1], "namespace": ns}})


def test_every_command_of_the_doc_names_what_it_renders(doc: Any, rendered: Rendered) -> None:
    cmds, raw, spans = doc
    rendered.objects.clear()  # nothing applied yet: the blocks run from the top
    parser = metaps_parser()
    seen = {"kubectl": 0, "metaps": 0}
    for n, (cmd, heredoc) in enumerate(cmds + [(s, "") for s in spans]):
        if n == len(cmds):  # the blocks ran in order; the prose's spans refer to any section's objects
            rendered.apply_all()
        for words in split_pipeline(cmd):
            if words[0] in seen:
                seen[words[0]] += 1
            if words[0] == "kubectl":
                check_kubectl(words, heredoc, rendered, parser)
            elif words[0] == "metaps":
                check_metaps(words, parser)
    assert seen["kubectl"] >= 15 and seen["metaps"] >= 6, seen
    # every ctr-... name a bash block mentions (comments too) is an object rendered or created
    rendered.apply_all()
    known = rendered.names()
    for body in raw:
        for name in re.findall(r"(?<![-\w/.])(ctr-[a-z0-9][-a-z0-9]*[a-z0-9])", body):
            assert name in known, f"docs/kubernetes.md names {name!r}, which nothing renders or creates"


def test_the_doc_generates_one_job_in_one_namespace(rendered: Rendered) -> None:
    """The day-1 manifests hold what later sections act on: the data Job, the ctr-* objects."""
    assert rendered.namespaces == {"ctr"}
    rendered.apply_all()
    for kind, name in [("Job", "ctr-data"), ("Job", "ctr-controller"), ("Job", "ctr-ps"), ("Job", "ctr-worker"),
                       ("CronJob", "ctr-deliver"), ("PersistentVolumeClaim", "ctr-data"), ("JobSet", "ctr")]:
        assert rendered.has(kind, name, "ctr"), (kind, name)


def test_the_doc_shows_the_job_it_runs_and_day_2_warm_starts_from_day_1(doc: Any, rendered: Rendered) -> None:
    """Section 3's ``[deploy]`` is configs/k8s_job.toml's, and every ``--warm-start-from`` names the
    checkpoints directory of a run the doc generated before (day 1's ``--checkpoint-root``)."""
    import tomllib

    text = DOC.read_text()
    section = text[text.index("## 3. Generate and apply"):text.index("**Per-role volumes**")]
    (shown,) = [tomllib.loads(b) for b in re.findall(r"```toml\n(.*?)```", section, re.S)]
    job = tomllib.loads((REPO / "configs" / "k8s_job.toml").read_text())
    assert shown["deploy"] == job["deploy"], "section 3's [deploy] is not configs/k8s_job.toml's"
    roots = set()
    for docs in rendered.by_dir.values():
        for d in docs:
            if d["kind"] == "Job" and d["metadata"]["name"] == "ctr-controller":
                a = d["spec"]["template"]["spec"]["containers"][0]["args"]
                roots.add(a[a.index("--checkpoint-root") + 1])
    starts = [w[i + 1] for cmd, _ in doc[0] for w in split_pipeline(cmd) for i, x in enumerate(w)
              if x == "--warm-start-from"]
    assert starts, "no --warm-start-from in the doc"
    for s in starts:
        assert f"/data/{s}" in roots, f"--warm-start-from {s}: no run of the doc checkpoints there ({sorted(roots)})"
