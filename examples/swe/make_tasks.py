"""Coding tasks for the SWE example: a bug-injection generator, a loader for SWE-smith / SWE-bench files, and
the task functions ``agl-trainer`` reads (``train_tasks`` / ``heldout_tasks``, see config.yaml).

Generate (SWE-smith's procedural-mutation idea on a local repository; nothing is downloaded)::

    python examples/swe/make_tasks.py generate --repo repos/minilib --out data/tasks.jsonl

Each candidate is one AST mutation of one source file (flip a comparison, off-by-one on an integer literal,
``+``/``-`` and ``//``/``/`` swaps, swapped operands of ``-`` and ``/``, ``and``/``or``). The whole test suite
runs on the clean and on the mutated repository: FAIL_TO_PASS = the tests that pass clean and fail mutated,
PASS_TO_PASS = the tests that pass on both. A mutant that breaks no test carries no signal and is dropped.
The problem statement names the broken function and quotes the failing assertion, the way a bug report
would; the hidden test files themselves are not shown to the agent.

Load public data (fields parsed; the repositories must already be on disk, see README.md)::

    python examples/swe/make_tasks.py load swe_smith.jsonl --repos-dir /data/repos --out tasks.jsonl --clean

``--clean`` (and ``clean``) drops tasks whose FAIL_TO_PASS tests fail before the bug or pass with it.
"""


import argparse  # no "from __future__ import annotations": agl-trainer loads this file without sys.modules (dataclass)
import ast
import hashlib
import json
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import grading

DATA_FILE = HERE / "data" / "tasks.jsonl"
DEFAULT_REPO = "repos/minilib"

COMPARE_FLIPS = {ast.Lt: ("<", "<="), ast.LtE: ("<=", "<"), ast.Gt: (">", ">="), ast.GtE: (">=", ">"),
                 ast.Eq: ("==", "!="), ast.NotEq: ("!=", "==")}
BINOP_FLIPS = {ast.Add: ("+", "-"), ast.Sub: ("-", "+"), ast.FloorDiv: ("//", "/"), ast.Div: ("/", "//")}


# ------------------------------------------------------------------ mutations
@dataclass
class Mutation:
    path: str          # file, relative to the repository root
    function: str      # enclosing function (qualified name)
    kind: str          # compare_flip, binop_flip, off_by_one, swap_operands, boolop_flip
    start: int         # character offsets of the replaced text in the file
    end: int
    new: str
    line: int

    def apply(self, source: str) -> str:
        return source[: self.start] + self.new + source[self.end:]


def _offsets(source: str) -> list[int]:
    starts, pos = [], 0
    for line in source.splitlines(keepends=True):
        starts.append(pos)
        pos += len(line)
    starts.append(pos)
    return starts


def _functions(tree: ast.AST) -> Iterator[tuple[str, ast.AST]]:
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node.name, node


def mutations(path: str, source: str) -> list[Mutation]:
    """Every single-site mutation of ``source`` inside a function (docstrings and defaults untouched)."""
    tree = ast.parse(source)
    starts = _offsets(source)

    def off(line: int, col: int) -> int:  # col is a UTF-8 byte offset
        text = source[starts[line - 1]: starts[line]]
        return starts[line - 1] + len(text.encode()[:col].decode(errors="ignore"))

    def span(node: ast.AST) -> tuple[int, int]:
        return off(node.lineno, node.col_offset), off(node.end_lineno, node.end_col_offset)

    found: list[Mutation] = []
    seen: set[tuple[int, int, str]] = set()
    for fname, func in _functions(tree):
        skip = {id(d) for d in func.args.defaults + func.args.kw_defaults if d is not None}
        body = func.body[1:] if (func.body and isinstance(func.body[0], ast.Expr)
                                 and isinstance(func.body[0].value, ast.Constant)) else func.body
        for stmt in body:
            for node in ast.walk(stmt):
                if id(node) in skip:
                    continue
                new: list[tuple[str, int, int, str]] = []
                if isinstance(node, ast.Compare) and len(node.ops) == 1 and type(node.ops[0]) in COMPARE_FLIPS:
                    old_op, new_op = COMPARE_FLIPS[type(node.ops[0])]
                    a, b = span(node.left)[1], span(node.comparators[0])[0]
                    gap = source[a:b]
                    i = gap.find(old_op)
                    if i >= 0:
                        new.append(("compare_flip", a + i, a + i + len(old_op), new_op))
                elif isinstance(node, ast.BinOp) and type(node.op) in BINOP_FLIPS:
                    old_op, new_op = BINOP_FLIPS[type(node.op)]
                    a, b = span(node.left)[1], span(node.right)[0]
                    i = source[a:b].find(old_op)
                    if i >= 0 and not (old_op == "/" and source[a + i: a + i + 2] == "//"):
                        new.append(("binop_flip", a + i, a + i + len(old_op), new_op))
                    if isinstance(node.op, (ast.Sub, ast.Div)):
                        (ls, le), (rs, re_) = span(node.left), span(node.right)
                        left, right = source[ls:le], source[rs:re_]
                        if left != right:
                            new.append(("swap_operands", ls, re_, f"{right}{source[le:rs]}{left}"))
                elif isinstance(node, ast.Constant) and type(node.value) is int and "\n" not in source[slice(*span(node))]:
                    s, e = span(node)
                    new.append(("off_by_one", s, e, str(node.value + 1)))
                elif isinstance(node, ast.BoolOp) and len(node.values) == 2:
                    a, b = span(node.values[0])[1], span(node.values[1])[0]
                    old_op, new_op = ("and", "or") if isinstance(node.op, ast.And) else ("or", "and")
                    i = source[a:b].find(old_op)
                    if i >= 0:
                        new.append(("boolop_flip", a + i, a + i + len(old_op), new_op))
                for kind, s, e, text in new:
                    if (s, e, text) in seen:
                        continue
                    seen.add((s, e, text))
                    found.append(Mutation(path, fname, kind, s, e, text, getattr(node, "lineno", 0)))
    return found


def source_files(repo: Path) -> list[str]:
    """The repository's non-test Python files, relative paths."""
    out = []
    for p in sorted(repo.rglob("*.py")):
        rel = p.relative_to(repo).as_posix()
        if grading.protected_reason(rel) is None and "__pycache__" not in rel and p.name != "__init__.py":
            out.append(rel)
    return out


def _diff(repo: Path, rel: str, new_source: str) -> str:
    """A git diff of ``rel`` in ``repo`` changed to ``new_source`` (clean -> buggy: SWE-smith's ``patch``)."""
    with tempfile.TemporaryDirectory(prefix="agl-swe-gen-") as tmp:
        work = Path(tmp)
        (work / rel).parent.mkdir(parents=True, exist_ok=True)
        (work / rel).write_text((repo / rel).read_text())
        grading._git(["init", "-q"], work)
        grading._git(["add", "-A"], work)
        (work / rel).write_text(new_source)
        return grading._git(["diff"], work).stdout


def problem_statement(m: Mutation, failing: list[str], messages: dict[str, str]) -> str:
    module = m.path[:-3].replace("/", ".")
    lines = [f"`{module}.{m.function}` gives wrong results.", "",
             f"Since a recent change, `{m.function}` (in `{m.path}`) no longer behaves as its docstring says."]
    quoted = []
    for test in failing:
        title = test.split("::")[-1]
        msg = messages.get(title)
        if msg:
            quoted += [ln[:200] for ln in msg.splitlines()[:2]]
    if quoted:
        lines += ["", "For example, this check now fails:", "", "```", *quoted[:4], "```"]
    lines += ["", f"Please fix `{m.function}` so that it behaves as documented again."]
    return "\n".join(lines)


def generate(repo: str = DEFAULT_REPO, limit: int | None = None, files: list[str] | None = None,
             timeout_s: float = 120.0, log=print) -> tuple[list[dict], list[tuple[str, str]]]:
    """Mutants of ``repo`` as tasks; returns (tasks, [(instance_id, reason)] of the dropped candidates)."""
    root = grading.resolve_repo(repo)
    clean_run = grading.run_tests(root, None, timeout_s)
    clean_pass = sorted(t for t, o in clean_run.outcomes.items() if o == "passed")
    if not clean_pass:
        raise RuntimeError(f"no test passes on the clean repository {root}:\n{clean_run.output[-2000:]}")
    tasks, dropped = [], []
    candidates = [m for rel in (files or source_files(root)) for m in mutations(rel, (root / rel).read_text())]
    for m in candidates[:limit] if limit else candidates:
        base = f"{m.path[:-3].replace('/', '.')}.{m.function}.{m.kind}"
        iid = f"{base}__{hashlib.sha1(f'{m.start}:{m.end}:{m.new}'.encode()).hexdigest()[:6]}"
        new_source = m.apply((root / m.path).read_text())
        try:
            compile(new_source, m.path, "exec")
        except SyntaxError:
            dropped.append((iid, "syntax_error"))
            continue
        with tempfile.TemporaryDirectory(prefix="agl-swe-mut-") as tmp:
            buggy = Path(tmp) / "repo"
            grading.shutil.copytree(root, buggy, ignore=grading.IGNORE)
            (buggy / m.path).write_text(new_source)
            run = grading.run_tests(buggy, None, timeout_s)
        if run.timed_out:
            dropped.append((iid, "timeout"))
            continue
        f2p = [t for t in clean_pass if run.outcomes.get(t) != "passed"]
        p2p = [t for t in clean_pass if run.outcomes.get(t) == "passed"]
        if not f2p:
            dropped.append((iid, "no_failing_test"))
            continue
        tasks.append({"instance_id": iid, "format": "generated", "repo": repo, "base_commit": None,
                      "bug_patch": _diff(root, m.path, new_source), "gold_patch": None, "test_patch": None,
                      "problem_statement": problem_statement(m, f2p, run.failures),
                      "FAIL_TO_PASS": f2p, "PASS_TO_PASS": p2p,
                      "meta": {"file": m.path, "function": m.function, "kind": m.kind, "line": m.line}})
        log(f"{iid}: {len(f2p)} fail-to-pass, {len(p2p)} pass-to-pass")
    return tasks, dropped


# ------------------------------------------------------------------ public formats
def _test_list(value) -> list[str]:
    """FAIL_TO_PASS / PASS_TO_PASS: a list (SWE-smith) or a JSON-encoded list (SWE-bench)."""
    if value is None:
        return []
    if isinstance(value, str):
        value = json.loads(value) if value.strip() else []
    if not isinstance(value, list) or not all(isinstance(t, str) for t in value):
        raise ValueError(f"expected a list of test ids, got {value!r}"[:200])
    return value


def from_public(record: dict, repos_dir: str | Path | None = None) -> dict:
    """One SWE-bench or SWE-smith record as a task.

    SWE-bench (``base_commit`` and ``test_patch`` present): ``patch`` is the gold fix, ``test_patch`` the hidden
    tests, the repository a local git clone ``{repos_dir}/{owner}__{name}`` (or ``{name}``). SWE-smith: ``patch``
    turns the clean mirror ``{repos_dir}/{repo name}`` (a folder or ``.tar.gz``) into the buggy one.
    """
    for key in ("instance_id", "problem_statement", "FAIL_TO_PASS", "PASS_TO_PASS", "repo"):
        if key not in record:
            raise ValueError(f"record {record.get('instance_id', '?')!r} lacks {key!r}")
    repos = Path(repos_dir) if repos_dir else Path(".")
    repo_name = record["repo"]
    swe_bench = bool(record.get("base_commit")) and "test_patch" in record
    if swe_bench:
        candidates = [repos / repo_name.replace("/", "__"), repos / repo_name.split("/")[-1], repos / repo_name]
    else:
        name = repo_name.split("/")[-1]
        candidates = [repos / name, repos / f"{name}.tar.gz", repos / repo_name.replace("/", "__")]
    local = next((c for c in candidates if c.exists()), candidates[0])
    return {"instance_id": record["instance_id"], "format": "swe-bench" if swe_bench else "swe-smith",
            "repo": str(local.resolve()), "base_commit": record.get("base_commit") if swe_bench else None,
            "bug_patch": None if swe_bench else record.get("patch"),
            "gold_patch": record.get("patch") if swe_bench else None,
            "test_patch": record.get("test_patch") if swe_bench else None,
            "problem_statement": record["problem_statement"],
            "FAIL_TO_PASS": _test_list(record["FAIL_TO_PASS"]), "PASS_TO_PASS": _test_list(record["PASS_TO_PASS"]),
            "meta": {k: record[k] for k in ("repo", "image_name", "version", "created_at") if k in record}}


def load_public(path: str | Path, repos_dir: str | Path | None = None) -> list[dict]:
    """Tasks from a SWE-bench / SWE-smith file: JSON Lines, or a JSON list (as the datasets export them)."""
    text = Path(path).read_text()
    stripped = text.lstrip()
    records = json.loads(text) if stripped.startswith("[") else [json.loads(ln) for ln in text.splitlines() if ln.strip()]
    return [from_public(r, repos_dir) for r in records]


# ------------------------------------------------------------------ files and the trainer's task functions
def write_jsonl(tasks: list[dict], out: str | Path) -> None:
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text("".join(json.dumps(t) + "\n" for t in tasks))


def read_jsonl(path: str | Path = DATA_FILE) -> list[dict]:
    return [json.loads(ln) for ln in Path(path).read_text().splitlines() if ln.strip()]


def split(tasks: list[dict]) -> tuple[list[dict], list[dict]]:
    """Disjoint by function: tasks whose broken function hashes into the last quarter are held out."""
    def held(t: dict) -> bool:
        key = t.get("meta", {}).get("function") or t["instance_id"]
        return int(hashlib.sha1(key.encode()).hexdigest(), 16) % 4 == 0
    return [t for t in tasks if not held(t)], [t for t in tasks if held(t)]


def train_tasks() -> list[dict]:
    return split(read_jsonl())[0]


def heldout_tasks() -> list[dict]:
    return split(read_jsonl())[1]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("generate", help="inject bugs into a local repository")
    g.add_argument("--repo", default=DEFAULT_REPO, help="relative to examples/swe, or absolute")
    g.add_argument("--out", default=str(DATA_FILE))
    g.add_argument("--limit", type=int, default=None)
    g.add_argument("--per-function", type=int, default=None, help="keep at most N tasks per function")
    g.add_argument("--clean", action="store_true", help="also re-validate each task from its stored patch")
    ld = sub.add_parser("load", help="convert a SWE-bench / SWE-smith JSON(L) file")
    ld.add_argument("path")
    ld.add_argument("--repos-dir", default=None)
    ld.add_argument("--out", required=True)
    ld.add_argument("--clean", action="store_true")
    c = sub.add_parser("clean", help="drop tasks without signal from a task file")
    c.add_argument("path")
    c.add_argument("--out", required=True)
    args = parser.parse_args(argv)

    dropped: list[tuple[str, str]] = []
    if args.cmd == "generate":
        tasks, dropped = generate(args.repo, args.limit)
        if args.per_function:
            count: dict[str, int] = {}
            kept = []
            for t in tasks:
                key = t["meta"]["function"]
                if count.get(key, 0) < args.per_function:
                    kept.append(t)
                    count[key] = count.get(key, 0) + 1
            tasks = kept
    elif args.cmd == "load":
        tasks = load_public(args.path, args.repos_dir)
    else:
        tasks = read_jsonl(args.path)
    if getattr(args, "clean", False) or args.cmd == "clean":
        tasks, more = grading.clean_tasks(tasks)
        dropped += more
    write_jsonl(tasks, args.out)
    for iid, reason in dropped:
        print(f"dropped {iid}: {reason}", file=sys.stderr)
    train, held = split(tasks)
    print(f"{len(tasks)} tasks ({len(train)} train, {len(held)} held out) -> {args.out}; {len(dropped)} dropped")


if __name__ == "__main__":
    main()
