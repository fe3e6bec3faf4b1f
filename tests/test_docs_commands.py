"""Every command README.md and docs/*.md give a user still runs as written, checked without running
any of them (no training, no process group): a renamed flag or a moved script fails here, not at
the user's first try.

What is a command: a line of a fenced code block (```bash, ```sh, ```shell or a bare ```; ```python
and output blocks are not) or an inline code span of the prose, once line continuations (``\\``)
are joined and comments cut, split at ``&&``, ``||``, ``;``, ``|`` and ``&``, with environment
prefixes (``FOO=1 python ...``, ``env``, ``exec``, ``nice``) and wrappers (``nsys profile ...``,
``srun ...``) skipped, whose program is ``python``/``python3`` (a script or ``-m module``),
``torchrun`` (its own options skipped), ``bash``/``sh``/``sbatch`` (a script), or a script path
itself (``pretrain_gpt_moe.py ...``). Other programs (pip, lm_eval, nsys alone) are not checked.

What is checked, per command:

* the script (``tools/x.py``, ``scripts/x.sh``, ``examples/x.sh``) or module (``-m kernels.aot``)
  exists in the repository; a script outside it must be named in USER_FILES (a file the doc has
  the user write) or carry a ``$VAR`` / ``<placeholder>`` / absolute path (someone else's checkout);
* a Python script or module with an argparse parser: the parser it really builds (run as
  ``__main__`` in a forked child, tests/_docs_parsers.py, stopped at its first parse, so nothing
  else runs; for pretrain_gpt_moe.py / pretrain_bert_moe.py that is megatron_moe/arguments.py's
  parser with every Megatron flag of flags/status.txt) parses the whole argv when the command is
  complete -- flag names, values, choices, arity; a placeholder value (``CKPT``, ``N``,
  ``<path>``, ``$VAR``) that the flag's type or choices would reject is stubbed. A command with
  ``...`` (or a ``<several words>`` placeholder, or a ``$VAR`` where a flag would be) is partial:
  then each ``--flag`` name is checked. A flag must be spelt in full (argparse would take an
  abbreviation). Not checked: the training parser's required flags (it checks them after
  --use-checkpoint-args), anything after the parse -- validate_args (world size, GPU-only flags,
  combinations), files on disk: a GPU command parses on a CPU machine, it does not validate there;
* a refused Megatron flag (flags/status.txt) is an error unless the command's line or the comment
  above it says "refused";
* a shell script that forwards ``"$@"`` to a Python script or module (examples/*.sh to
  pretrain_*.py after its ``shift N`` positionals, scripts/gpu_check.sh to
  ``-m megatron_moe.gpucheck``): the doc's flags are checked by name against that parser;
* flags in a ``#`` comment of a code block (``# other tokenizers: --tokenizer-type ...``): by name,
  against the script the comment names, else the command above it;
* every ``--flag`` in the prose's inline code is known to some parser of the project (the training
  parser, tools/, bench/, scripts/' modules) or to the external program in EXTERNAL_FLAGS, and
  the values a span lists as ``--flag a|b|c`` are among its choices;
* every repository path, file name and dotted module name a doc gives exists (check_paths), and
  so do the names a ```python example imports from the repository.

Both megatron-core releases get the same parsers (flags/ registers every flag of both), so a doc
command parses on both legs; one meant for a single release says so on its line or the comment
above it (``megatron-core 0.19 only`` / ``>= 0.19`` / ``0.16:``) and is checked on that release.

Mutations (each must fail, naming the doc and line): a misspelt, an abbreviated, a refused and a
forwarded flag, a bad value, a comment's flag, a missing script and module, an example script's
array flag, a prose flag and value, a path, a file name and an import.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os
import re
import shlex
import tempfile

import pytest

from megatron_moe.runtime.local_ranks import run_script

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DRIVER = os.path.join(ROOT, "tests", "_docs_parsers.py")
# generated from flags/status.txt (tests/test_flags.py checks it); its flags are the parser's own
GENERATED = {"docs/flags.md"}
# scripts a doc has the user write (not in the repository): {name: doc}
USER_FILES = {"check_my_comm.py": "docs/comm.md", "my_comm.py": "docs/comm.md"}
# flags of programs that are not ours, mentioned in the prose without the program: {flag: program}
EXTERNAL_FLAGS = {"--signal": "sbatch/scancel", "--requeue": "sbatch", "--open-mode": "sbatch",
                  "--ntasks": "srun", "--signals_to_handle": "torchrun", "--no-deps": "pip",
                  "--target": "pip"}
# an inline span that starts with one of these is another program's command line
EXTERNAL_PROGRAMS = {"git", "pip", "sbatch", "srun", "scancel", "torchrun", "nsys", "lm_eval",
                     "docker", "#SBATCH", "bash"}
# parsers whose flags depend on the argv (a pre-parser picks plugins): captured per command
ARGV_DEPENDENT = {"tools/checkpoint/convert.py"}
ENTRY_POINTS = ("pretrain_gpt_moe.py", "pretrain_bert_moe.py")   # parse in training/loop.pretrain
COMMAND_LANGS = {"", "bash", "sh", "shell", "console"}
PYTHON = re.compile(r"^(python3?(\.\d+)?|\S*/bin/python3?(\.\d+)?|\$\{?PY(THON)?\}?)$")
ENV_ASSIGN = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
PREFIXES = {"env", "exec", "nice", "time", "command"}
TORCHRUN_SWITCHES = {"--standalone", "--no-python", "--no_python", "--run-path", "--run_path",
                     "-m", "--module"}
PLACEHOLDER = re.compile(r"^([A-Z][A-Z0-9_]*|<[^<>]+>|\S*\$\S*|\S*\.\.\.\S*)$")
ARRAY = re.compile(r"^\$\{\w+\[@\]\}$")
MULTIWORD = re.compile(r"<[a-z][^<>`]* [^<>`]*>")   # <the same flags>: stands for several words
OPERATORS = {"&&", "||", ";", "|", "&", ";;", "|&"}


def read_doc(rel: str) -> str:
    """A doc's text (the mutation cases replace it)."""
    with open(os.path.join(ROOT, rel), encoding="utf-8") as f:
        return f.read()


def doc_files() -> list:
    docs = ["README.md"] + sorted(os.path.relpath(p, ROOT)
                                  for p in glob.glob(os.path.join(ROOT, "docs", "*.md")))
    return [d for d in docs if d not in GENERATED]


@dataclasses.dataclass
class Command:
    doc: str
    line: int
    text: str
    kind: str = ""          # script | module
    name: str = ""          # repository path or module name
    argv: list = dataclasses.field(default_factory=list)
    complete: bool = True   # else partial (`...`): flag names only
    refused_ok: bool = False
    release: str = ""       # "0.19" / "0.16": checked on that megatron-core release only

    def where(self) -> str:
        return f"{self.doc}:{self.line}"


# ----------------------------------------------------------------------------- extraction
def _logical_lines(numbered):
    """Join ``\\`` continuations: [(first line number, text)]."""
    out, buf, start = [], [], None
    for lineno, line in numbered:
        if start is None:
            start = lineno
        if line.rstrip().endswith("\\") and not line.lstrip().startswith("#"):
            buf.append(line.rstrip()[:-1])
            continue
        buf.append(line)
        out.append((start, " ".join(b.strip() for b in buf)))
        buf, start = [], None
    if buf:
        out.append((start, " ".join(b.strip() for b in buf)))
    return out


def _split_comment(text):
    """(code, comment): the first ``#`` that starts a word outside quotes."""
    quote = None
    for i, ch in enumerate(text):
        if quote:
            if ch == quote:
                quote = None
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or text[i - 1].isspace()):
            return text[:i], text[i + 1:]
    return text, ""


def _tokens(code):
    code = MULTIWORD.sub(" ... ", code)
    lexer = shlex.shlex(code, posix=True, punctuation_chars=";&|")
    lexer.whitespace_split = True
    lexer.commenters = ""
    try:
        return list(lexer)
    except ValueError:   # unbalanced quotes: not a shell line
        return None


def _segments(tokens):
    seg = []
    for tok in tokens:
        if tok in OPERATORS:
            if seg:
                yield seg
            seg = []
        else:
            seg.append(tok)
    if seg:
        yield seg


def _skip_options(tokens, i, switches=()):
    """Index of the first token after a launcher's own options (``--opt value`` / ``--opt=v``)."""
    while i < len(tokens) and (tokens[i].startswith("-") or ARRAY.match(tokens[i])):
        if ARRAY.match(tokens[i]) or "=" in tokens[i] or tokens[i] in switches:
            i += 1
        else:
            i += 2
    return i


def parse_segment(tokens, bare_script=True):
    """(kind, name, argv) of one simple command, or None when its program is not checked.
    ``bare_script``: a line may start with the script itself (``pretrain_gpt_moe.py ...``)."""
    i = 0
    while i < len(tokens) and (ENV_ASSIGN.match(tokens[i]) or tokens[i] in PREFIXES
                               or ARRAY.match(tokens[i])):
        i += 1
    if i >= len(tokens):
        return None
    head = tokens[i]
    if PYTHON.match(head):
        j = i + 1
        while j < len(tokens) and tokens[j].startswith("-"):
            if tokens[j] == "-c":
                return None
            if tokens[j] == "-m" and j + 1 < len(tokens):
                module = tokens[j + 1]
                if module == "torch.distributed.run":
                    return _script(tokens, _skip_options(tokens, j + 2, TORCHRUN_SWITCHES))
                return "module", module, tokens[j + 2:]
            j += 2 if tokens[j] in ("-W", "-X") else 1
        return _script(tokens, j)
    if head == "torchrun":
        return _script(tokens, _skip_options(tokens, i + 1, TORCHRUN_SWITCHES))
    if head in ("bash", "sh", "sbatch"):
        j = _skip_options(tokens, i + 1, () if head == "sbatch" else ("-x", "-e", "-u"))
        if head != "sbatch" and i + 1 < len(tokens) and tokens[i + 1] == "-c":
            return None
        return _script(tokens, j)
    if head == "srun":
        return parse_segment(tokens[_skip_options(tokens, i + 1):])
    if bare_script and re.search(r"\.(py|sh|sbatch)$", head):
        return _script(tokens, i)
    for j in range(i + 1, len(tokens) if bare_script else 0):   # a wrapper (nsys profile ...)
        if PYTHON.match(tokens[j]) or tokens[j] == "torchrun":
            return parse_segment(tokens[j:])
    return None


def _script(tokens, j):
    if j >= len(tokens) or not re.search(r"\.(py|sh|sbatch)$", tokens[j]):
        return None
    name = re.sub(r"^(\$\{?ROOT\}?/|\./)", "", tokens[j])
    return "script", name, tokens[j + 1:]


def _release_note(*texts):
    for text in texts:
        m = re.search(r"megatron-core\s*(?:>=\s*)?(0\.1\d)|\b(0\.1\d)(?:\.\d)?\s*(?:only|:)", text)
        if m:
            return m.group(1) or m.group(2)
    return ""


def _command(doc, lineno, code, comment, context, bare_script):
    """The checked Commands of one logical line."""
    tokens = _tokens(code)
    if not tokens:
        return []
    out = []
    for seg in _segments(tokens):
        # optional parts in brackets ([--summary s.txt]) are checked like the rest; --help is
        # every parser's
        seg = [t.strip("[]") for t in seg if t.strip("[]") and t not in ("-h", "--help")]
        if bare_script == "inline":   # `tools/x.py ARG --flag`: a command; `tools/x.py`: a path
            bare_ok = len(seg) > 1 and re.search(r"\.(py|sh|sbatch)$", seg[0]) is not None
        else:
            bare_ok = bare_script
        parsed = parse_segment(seg, bare_ok)
        if parsed is None:
            continue
        kind, name, argv = parsed
        cmd = Command(doc, lineno, code.strip(), kind, name, list(argv))
        # `...`, or a $VAR standing for flags ($MODEL_ARGS, "${ARGS[@]}", "$@"): partial
        cmd.complete = bare_script != "inline" or not bare_ok
        cmd.complete &= not any("..." in t or re.match(r"^\$\{?(\w*(ARGS|FLAGS|OPTS)\b|@)", t)
                                for t in argv)
        cmd.refused_ok = "refused" in (code + comment + context).lower()
        cmd.release = _release_note(comment, context)
        out.append(cmd)
    return out


def _fenced_blocks(text):
    """[(lang, [(lineno, line)])] of the fenced code blocks."""
    blocks, current, lang = [], None, None
    for lineno, line in enumerate(text.splitlines(), 1):
        m = re.match(r"^\s*```\s*([\w+-]*)", line)
        if m:
            if current is None:
                current, lang = [], m.group(1).lower()
            else:
                blocks.append((lang, current))
                current = None
            continue
        if current is not None:
            current.append((lineno, line))
    return blocks


def _prose(text):
    """The text outside fenced blocks, same line numbers (fenced lines blanked)."""
    lines, inside = [], False
    for line in text.splitlines():
        if re.match(r"^\s*```", line):
            inside = not inside
            lines.append("")
        else:
            lines.append("" if inside else line)
    return "\n".join(lines)


def inline_spans(text):
    """[(lineno, span)] of the prose's inline code (a span may wrap onto the next line)."""
    prose = _prose(text)
    out = []
    for m in re.finditer(r"(?<!`)`([^`]+)`(?!`)", prose):
        out.append((prose.count("\n", 0, m.start()) + 1, m.group(1).replace("\n", " ")))
    return out


def doc_commands(doc, text):
    """(commands, comment_flags): the checked commands of one doc, and [(doc, lineno, (kind,
    name), flags)] of the flags its code blocks' comment lines name, and the script they are
    for."""
    commands, comment_flags = [], []
    for lang, lines in _fenced_blocks(text):
        if lang not in COMMAND_LANGS:
            continue
        previous, above = None, ""
        for lineno, logical in _logical_lines(lines):
            logical = re.sub(r"^\s*\$ ", "", logical)
            code, comment = _split_comment(logical)
            found = (_command(doc, lineno, code, comment, above, lang != "")
                     if code.strip() else [])
            commands += found
            flags = re.findall(r"(?<![\w-])--[a-z][\w-]*", comment)
            named = re.findall(r"\b((?:tools|bench|scripts|examples)/[\w/]+\.py|pretrain_\w+\.py)",
                               comment)
            target = (("script", named[0]) if named
                      else (previous.kind, previous.name) if previous else None)
            if flags and target and not code.strip():
                comment_flags.append((doc, lineno, target, flags))
            above = comment if not code.strip() else ""
            previous = found[-1] if found else previous
    for lineno, span in inline_spans(text):
        commands += _command(doc, lineno, *_split_comment(span), "", "inline")
    return commands, comment_flags


def prose_flags(doc, text):
    """[(lineno, flag)] of every --flag in the prose's inline code but the spans of another
    program (``git rev-parse --short``, ``pip install --target``, ``#SBATCH --signal=...``); a
    ``--flag-*`` is a prefix (some flag starts with it), ``--start/end-x`` two flags (skipped)."""
    out = []
    for lineno, span in inline_spans(text):
        words = span.split()
        if words and words[0] in EXTERNAL_PROGRAMS:
            continue
        for m in re.finditer(r"(?<![\w-])(--[a-z][\w-]*[a-z0-9])(-?\*|/)?", span):
            if m.group(2) != "/":
                out.append((lineno, m.group(1) + ("*" if m.group(2) else "")))
    return out


# ----------------------------------------------------------------------------- resolution
def _repo_packages():
    return {d for d in os.listdir(ROOT) if os.path.isfile(os.path.join(ROOT, d, "__init__.py"))}


def _find(name, reference):
    """The repository path a doc's script name means, or None. ``reference``: an inline mention
    (`offload/store.py HostCache`, `gpu_check.sh --cpu`), which may be relative to megatron_moe/ or
    a unique file name."""
    if os.path.isfile(os.path.join(ROOT, name)):
        return name
    if not reference:
        return None
    if os.path.isfile(os.path.join(ROOT, "megatron_moe", name)):
        return os.path.join("megatron_moe", name)
    if "/" not in name:
        hits = sorted(p for p in glob.glob(os.path.join(ROOT, "**", name), recursive=True)
                      if "/." not in p)
        if hits:
            return os.path.relpath(hits[0], ROOT)
    return None


def _has_parser(path):
    """Whether the script parses a command line (only those are run, up to their parser)."""
    if path in ENTRY_POINTS:
        return True
    with open(os.path.join(ROOT, path), encoding="utf-8") as f:
        text = f.read()
    return "ArgumentParser" in text or "parse_args(" in text


def _module_file(module):
    base = os.path.join(ROOT, *module.split("."))
    for candidate in (base + ".py", os.path.join(base, "__main__.py")):
        if os.path.isfile(candidate):
            return os.path.relpath(candidate, ROOT)
    return None


def read_script(rel: str) -> str:
    """A shell script's text (the mutation cases replace it)."""
    with open(os.path.join(ROOT, rel), encoding="utf-8") as f:
        return f.read()


def shell_forward(path):
    """(kind, name, positionals, extra, arrays): where a repository shell script sends its
    ``"$@"`` -- the Python script or module of its last ``... "$@"`` line, the positional
    arguments it ``shift``s off first, whether that line adds arguments of its own, and the bash
    arrays it passes after the script (``"${MODEL_ARGS[@]}"``: the script's own flags); None if
    it forwards to nothing of ours."""
    text = read_script(path)
    forward = None
    for _, logical in _logical_lines(enumerate(text.splitlines(), 1)):
        code, _ = _split_comment(logical)
        tokens = _tokens(code) or []
        for seg in _segments(tokens):
            if "$@" not in seg:
                continue
            parsed = parse_segment(seg)
            if parsed is None:
                continue
            kind, name, argv = parsed
            if kind == "script":
                name = _find(name, False)
            elif _module_file(name) is None:
                name = None
            if name:
                arrays = [m.group(1) for t in argv for m in [re.match(r"^\$\{(\w+)\[@\]\}$", t)]
                          if m]
                forward = (kind, name, argv.index("$@") > 0, arrays)
    if forward is None:
        return None
    shift = re.search(r"^[^#\n]*\bshift (\d+)", text, re.M)
    return forward[0], forward[1], int(shift.group(1)) if shift else 0, forward[2], forward[3]


def bash_arrays(text):
    """{name: [(line, words)]} of a script's array assignments (``NAME=(...)``, ``NAME+=(...)``)."""
    out = {}
    for m in re.finditer(r"^\s*(?:if .*then\s+)?(\w+)\+?=\(", text, re.M):
        depth, i, quote = 1, m.end(), None
        while i < len(text) and depth:
            ch = text[i]
            if quote:
                quote = None if ch == quote else quote
            elif ch in "'\"":
                quote = ch
            elif ch == "(":
                depth += 1
            elif ch == ")":
                depth -= 1
            i += 1
        body = re.sub(r"(^|\s)#[^\n]*", " ", text[m.end():i - 1])
        line = text.count("\n", 0, m.start(1)) + 1
        out.setdefault(m.group(1), []).append((line, _tokens(body) or []))
    return out


def example_scripts():
    paths = glob.glob(os.path.join(ROOT, "examples", "*.sh"))
    paths += glob.glob(os.path.join(ROOT, "examples", "*.sbatch"))
    return sorted(os.path.relpath(p, ROOT) for p in paths)


def example_commands(scripts):
    """(commands, jobs): the commands in the example scripts (as a ```bash block: their tools/
    calls, their calls of each other with extra flags), and for each script that launches ours,
    its arrays' flags by name against that parser."""
    commands, jobs = [], []
    for rel in scripts:
        text = read_script(rel)
        found, _ = doc_commands(rel, "```bash\n" + text + "\n```\n")
        commands += [dataclasses.replace(c, line=c.line - 1) for c in found]
        forward = shell_forward(rel)
        if forward is None:
            continue
        kind, name, _, _, arrays = forward
        assigned = bash_arrays(text)
        for array in arrays:
            for line, words in assigned.get(array, []):
                flags = [w for w in words if re.match(r"--[a-z]", w)]
                jobs.append((f"{rel}:{line}: {array}=(...)",
                             dict(kind=kind, name=name, argv=flags, complete=False,
                                  placeholders=[], refused_ok=False)))
    return commands, jobs


def resolve(cmd):
    """(error or None, job or None): where the command's script is, and what the child checks."""
    argv = cmd.argv
    if cmd.kind == "module":
        if cmd.name.split(".")[0] not in _repo_packages():
            return None, None   # someone else's module (pytest, torch.distributed.run, pip)
        path = _module_file(cmd.name)
        if path is None:
            return f"no module {cmd.name} in the repository (python -m {cmd.name})", None
        kind, name = "module", cmd.name
    else:
        if "$" in cmd.name or "<" in cmd.name or cmd.name.startswith("/"):
            return None, None   # another checkout's script (Megatron-LM's)
        if USER_FILES.get(cmd.name) == cmd.doc:
            return None, None
        path = _find(cmd.name, reference=not cmd.complete)
        if path is None:
            return f"no such file in the repository: {cmd.name}", None
        kind, name = "script", path
        if path.endswith((".sh", ".sbatch")):
            forward = shell_forward(path)
            if forward is None:
                return None, None
            kind, name, positionals, extra, _ = forward
            argv = argv[positionals:]
            if not any(t.startswith("-") for t in argv):
                return None, None
            cmd = dataclasses.replace(cmd, complete=cmd.complete and not extra and positionals == 0)
        elif not _has_parser(path):
            return None, None
    job = dict(kind=kind, name=name, argv=argv, complete=cmd.complete,
               placeholders=[k for k, t in enumerate(argv) if PLACEHOLDER.match(t)],
               refused_ok=cmd.refused_ok, argv_dependent=name in ARGV_DEPENDENT)
    return None, job


def _core_release():
    from importlib.metadata import version

    return ".".join(version("megatron-core").split(".")[:2])


def check_docs(docs=None, examples=()):
    """(errors, counts): every error as 'doc:line: command: message', and {doc: commands checked}.
    ``examples``: example scripts to check as well."""
    docs = doc_files() if docs is None else docs
    release = _core_release()
    errors, jobs, owners, counts = [], [], [], {}
    sources = [(doc, *doc_commands(doc, read_doc(doc))) for doc in docs]
    if examples:
        commands, array_jobs = example_commands(examples)
        sources.append(("examples/", commands, []))
        owners += [owner for owner, _ in array_jobs]
        jobs += [job for _, job in array_jobs]
        counts["examples/ arrays"] = len(array_jobs)
    for doc, commands, comment_flags in sources:
        counts[doc] = 0
        for cmd in commands:
            if cmd.release and cmd.release != release:
                continue   # "megatron-core 0.19 only": checked on that release
            error, job = resolve(cmd)
            counts[doc] += 1
            if error:
                errors.append(f"{cmd.where()}: {cmd.text}: {error}")
            if job:
                jobs.append(job)
                owners.append(f"{cmd.where()}: {cmd.text}")
        for _, lineno, (kind, name), flags in comment_flags:
            cmd = Command(doc, lineno, " ".join(flags), kind, name, flags, complete=False)
            error, job = resolve(cmd)
            if job:
                jobs.append(job)
                owners.append(f"{cmd.where()}: # ... {cmd.text}")
    for owner, errs in zip(owners, run_jobs(jobs)):
        errors += [f"{owner}: {e}" for e in errs]
    return errors, counts


def run_jobs(jobs):
    """The child's error lines for each job (tests/_docs_parsers.py, one forked process)."""
    if not jobs:
        return []
    with tempfile.TemporaryDirectory() as tmp:
        paths = [os.path.join(tmp, "jobs.json"), os.path.join(tmp, "results.json")]
        with open(paths[0], "w") as f:
            json.dump(jobs, f)
        out = run_script(DRIVER, paths, env=dict(os.environ, OMP_NUM_THREADS="1",
                                                 PYTHONPATH=ROOT), timeout_s=300)
        assert out.returncode == 0, out.stderr[-3000:]
        with open(paths[1]) as f:
            return json.load(f)


def parser_targets():
    """Every command line the project has: the training entry points, tools/, bench/ and the GPU
    kit's modules (kind, name)."""
    out = [("script", p) for p in ENTRY_POINTS]
    for pattern in ("tools/*.py", "tools/checkpoint/convert.py", "bench/*.py"):
        for path in sorted(glob.glob(os.path.join(ROOT, pattern))):
            rel = os.path.relpath(path, ROOT)
            with open(path, encoding="utf-8") as f:
                if "__main__" in f.read() and _has_parser(rel):
                    out.append(("script", rel))
    for path in sorted(glob.glob(os.path.join(ROOT, "megatron_moe", "gpucheck", "*.py"))):
        with open(path, encoding="utf-8") as f:
            if "ArgumentParser(" in f.read():
                name = os.path.splitext(os.path.relpath(path, ROOT))[0].replace(os.sep, ".")
                out.append(("module", name))
    return out


def known_flags():
    """{flag: [the choices of each parser defining it; None: any value]} over every parser of the
    project (tests/_docs_parsers.py, captured with no argv: convert.py then adds every loader's
    and saver's flags)."""
    targets = parser_targets()
    results = run_jobs([dict(kind=k, name=n, argv=[], options=True) for k, n in targets])
    flags = {}
    for (kind, name), result in zip(targets, results):
        assert isinstance(result, dict) and result, f"{name}: {result}"
        for flag, choices in result.items():
            flags.setdefault(flag, []).append(choices)
    return flags


def check_prose_flags(docs=None, flags=None):
    """Every --flag of the prose's inline code is known (``flags``: known_flags()); the values a
    span lists as ``--flag a|b|c`` are among its choices."""
    errors = []
    for doc in doc_files() if docs is None else docs:
        for lineno, span in inline_spans(read_doc(doc)):
            for m in re.finditer(r"(--[a-z][\w-]*)\s+([\w.-]+(?:\\?\|[\w.-]+)+)", span):
                parsers = flags.get(m.group(1), [None])
                for value in m.group(2).replace("\\", "").split("|"):
                    if "..." not in value and all(c is not None and value not in c
                                                  for c in parsers):
                        errors.append(f"{doc}:{lineno}: {m.group(1)} {value}: not one of its "
                                      f"choices ({', '.join(parsers[0])})")
        for lineno, flag in prose_flags(doc, read_doc(doc)):
            known = (any(f.startswith(flag[:-1]) for f in flags) if flag.endswith("*")
                     else flag in flags)
            if not known and flag not in EXTERNAL_FLAGS:
                errors.append(f"{doc}:{lineno}: {flag}: no parser of the project defines it")
    return errors


# a repository path: with an extension (tools/x.py, tests/test_*_x.py) or a folder (docs/gpu_runs/)
PATH_RE = re.compile(r"(?<![\w./-])((?:megatron_moe|tools|bench|scripts|examples|tests|kernels"
                     r"|docs)/(?:[\w*-]+/)*(?:[\w*-]+\.\w+(?:\.\w+)*|[\w*-]+/)?)")
MODULE_RE = re.compile(r"(?<![\w./-])((?:megatron_moe|tools|bench|kernels)(?:\.\w+)+)")
# paths of other projects a doc names: {path: whose}
FOREIGN_PATHS = {
    "pretrain_gpt.py": "Megatron-LM", "megatron/training/arguments.py": "Megatron-LM",
    "gpt2_tokenization.py": "Megatron-LM", "endpoints/completions.py": "Megatron-LM",
    "data_samplers.py": "Megatron-LM",
    "megatron/core/inference/text_generation_server/text_generation_server.py": "megatron-core",
    "transformer/moe/ops/paged_stash.py": "megatron-core",
    "examples/post_training/modelopt/": "Megatron-LM",
    "examples/post_training/modelopt/conf": "Megatron-LM",
    "examples/post_training/modelopt/conf/deepseek-ai/DeepSeek-V2-Lite.sh": "Megatron-LM",
    "examples/post_training/modelopt/conf/openai/gpt-oss-20b.sh": "Megatron-LM",
    "examples/gptoss/02_train.sh": "Megatron-LM",
    "tests/functional_tests/test_cases/moe/*/model_config.yaml": "Megatron-LM",
    "examples/inference/advanced/gpt_static_inference.py": "Megatron-LM",
    "gpt_static_inference.py": "Megatron-LM", "gpt_dynamic_inference.py": "Megatron-LM",
    "tests/test_utils/recipes/h100/moe-static-inference.yaml": "Megatron-LM",
}


def _defines(path, name):
    with open(path, encoding="utf-8") as f:
        return re.search(rf"\b{re.escape(name)}\b", f.read()) is not None


def _module_or_attribute(dotted):
    """None if ``a.b.c`` is a module of the repository or a name one of its modules holds."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        base = os.path.join(ROOT, *parts[:cut])
        path = next((p for p in (base + ".py", os.path.join(base, "__init__.py"))
                     if os.path.isfile(p)), None)
        if path is None:
            continue
        rest = parts[cut:]
        if not rest or (len(rest) == 1 and _defines(path, rest[0])):
            return None
        return f"{'.'.join(parts[:cut])} has no {'.'.join(rest)}"
    return "no such module"


def _path_exists(path):
    if path in FOREIGN_PATHS or glob.glob(os.path.join(ROOT, path)):
        return True
    base, _, name = path.rpartition(".")   # tests/_cases.run: a name the module defines
    return os.path.isfile(os.path.join(ROOT, base + ".py")) and _defines(
        os.path.join(ROOT, base + ".py"), name)


def check_paths(docs=None):
    """Every repository path (``tools/x.py``, ``docs/gpu_runs/``, ``tests/test_*_x.py``,
    ``kernels/sync_audit.count_host_syncs``) and dotted module name
    (``megatron_moe.runtime.local_ranks.run_script``) a doc names exists; a code file named alone
    in inline code (``compat/cpu.py``, ``gpu_check.sh``) exists under the root, under
    megatron_moe/ or anywhere in the repository."""
    errors = []
    for doc in doc_files() if docs is None else docs:
        text = read_doc(doc)
        for lineno, line in enumerate(text.splitlines(), 1):
            for m in PATH_RE.finditer(line):
                path = m.group(1)
                if not _path_exists(path):
                    errors.append(f"{doc}:{lineno}: {path}: no such file or directory")
            for m in MODULE_RE.finditer(line):
                why = _module_or_attribute(m.group(1))
                if why:
                    errors.append(f"{doc}:{lineno}: {m.group(1)}: {why}")
        names = [(lineno, span.strip()) for lineno, span in inline_spans(text)
                 if re.fullmatch(r"[\w./-]+\.(py|sh|sbatch)", span.strip())]
        for lineno, line in enumerate(_prose(text).splitlines(), 1):   # file.py in plain text
            names += [(lineno, m.group(1)) for m in re.finditer(
                r"(?<![\w./*{$-])((?:[\w-]+/)*[\w-]+\.(?:py|sh|sbatch))(?![\w*/])", line)]
        for lineno, name in names:
            if (not PATH_RE.match(name) and name not in FOREIGN_PATHS and name not in USER_FILES
                    and _find(name, reference=True) is None):
                errors.append(f"{doc}:{lineno}: {name}: no such file in the repository")
        for lang, lines in _fenced_blocks(text):   # a Python example's imports of ours
            for lineno, line in lines if lang == "python" else []:
                m = re.match(r"\s*from ((?:megatron_moe|tools|bench|kernels)[\w.]*) import "
                             r"([\w, ]+)", line)
                for name in [p.split()[0] for p in m.group(2).split(",") if p.strip()] if m else []:
                    why = _module_or_attribute(f"{m.group(1)}.{name}")
                    if why:
                        errors.append(f"{doc}:{lineno}: from {m.group(1)} import {name}: {why}")
    return sorted(set(errors))


# ----------------------------------------------------------------------------- tests
@pytest.fixture(scope="module")
def flags():
    return known_flags()


def test_doc_commands_parse():
    errors, counts = check_docs(examples=example_scripts())
    print("commands checked:", counts)
    assert not errors, "stale commands in the docs:\n" + "\n".join(errors)
    # the extraction found what the docs hold (a parser that found nothing would pass above)
    assert counts["README.md"] >= 20 and counts["docs/inference.md"] >= 8, counts
    assert counts["examples/ arrays"] >= 50, counts


def test_doc_flags_are_known(flags):
    assert "--moe-router-topk" in flags and "--num-tokens-to-generate" in flags   # captured
    errors = check_prose_flags(flags=flags)
    assert not errors, "flags no parser defines:\n" + "\n".join(errors)


def test_doc_paths_exist():
    errors = check_paths()
    assert not errors, "\n".join(errors)


def _line_of(text, needle):
    return text[:text.index(needle)].count("\n") + 1


# (doc, text in it, its replacement, what the error says)
MUTATIONS = {
    "misspelt_flag": ("docs/inference.md", "--num-tokens-to-generate 32",
                      "--num-token-to-generate 32",
                      "unrecognized argument: --num-token-to-generate"),
    "abbreviated_flag": ("docs/gpu.md", "gpu_check.sh --sections perf OUTDIR",
                         "gpu_check.sh --section perf OUTDIR", "unrecognized argument: --section"),
    "bad_value": ("docs/inference.md", "--top_k 0", "--top_k zero", "invalid int value: 'zero'"),
    "missing_script": ("docs/checkpoints.md", "python tools/checkpoint_info.py CKPT --verify",
                       "python tools/checkpoint_inf.py CKPT --verify",
                       "no such file in the repository: tools/checkpoint_inf.py"),
    "missing_module": ("docs/kernels.md", "python -m kernels.aot", "python -m kernels.aott",
                       "no module kernels.aott"),
    "refused_flag": ("docs/offload.md", "--moe-offload-cache-layers 2",
                     "--moe-offload-cache-layers 2 --fp4-format e2m1",
                     "--fp4-format is refused (flags/status.txt)"),
    "forwarded_flag": ("README.md", "DATA_PATH   # multi-node", "DATA_PATH --exit-intervall 5",
                       "unrecognized argument: --exit-intervall"),
    "comment_flag": ("README.md", "--tiktoken-pattern v2", "--tiktoken-patterns v2",
                     "unrecognized argument: --tiktoken-patterns"),
}


@pytest.mark.parametrize("name", sorted(MUTATIONS))
def test_a_stale_command_fails_naming_doc_and_line(monkeypatch, name):
    doc, old, new, message = MUTATIONS[name]
    text = read_doc(doc)
    assert old in text, f"{doc} no longer holds {old!r}: update the mutation"
    line = _line_of(text, old)
    original = read_doc
    monkeypatch.setitem(globals(), "read_doc",
                        lambda rel: text.replace(old, new) if rel == doc else original(rel))
    errors, _ = check_docs([doc])
    hits = [e for e in errors if message in e]
    assert hits and all(e.startswith(f"{doc}:") for e in hits), errors
    # the line of the command (a continued command: the line it starts on, at or above)
    assert any(int(e.split(":")[1]) in range(line - 3, line + 1) for e in hits), (line, hits)


def test_a_stale_example_flag_fails_naming_script_and_line(monkeypatch):
    script = "examples/train_mixtral_8x7b_4node_32gpu.sh"
    text = read_script(script)
    line = _line_of(text, "--num-experts ")
    original = read_script
    monkeypatch.setitem(globals(), "read_script", lambda rel: text.replace(
        "--num-experts ", "--num-expert ") if rel == script else original(rel))
    errors, _ = check_docs([], examples=[script])
    assert [e for e in errors if e.startswith(f"{script}:") and "--num-expert" in e
            and int(e.split(":")[1]) <= line], errors


def test_a_stale_prose_flag_or_path_fails(monkeypatch, flags):
    text = read_doc("README.md")
    original = read_doc
    monkeypatch.setitem(globals(), "read_doc", lambda rel: text.replace(
        "--moe-router-topk --moe-router-dtype", "--moe-router-top-k --moe-router-dtype").replace(
        "--dataloader-type single\\|cyclic", "--dataloader-type single\\|cyclical").replace(
        "megatron_moe/flops.py", "megatron_moe/flop.py").replace(
        "megatron_moe.runtime.local_ranks", "megatron_moe.runtime.local_rank")
        if rel == "README.md" else original(rel))
    errors = check_prose_flags(["README.md"], flags) + check_paths(["README.md"])
    assert any(e.startswith("README.md:") and "--moe-router-top-k" in e for e in errors), errors
    assert any(e.startswith("README.md:") and "--dataloader-type cyclical: not one of its choices"
               in e for e in errors), errors
    assert any(e.startswith("README.md:") and "megatron_moe/flop.py" in e for e in errors), errors


@pytest.mark.parametrize("noted", ["this", "other"])
def test_a_release_note_limits_a_command_to_that_release(monkeypatch, noted):
    """"megatron-core 0.19 only" above a command: checked on that release, skipped on another."""
    other = "0.19" if _core_release() == "0.16" else "0.16"
    release = _core_release() if noted == "this" else other
    text = f"```bash\n# megatron-core {release} only\npython tools/gone_in_this_release.py\n```\n"
    monkeypatch.setitem(globals(), "read_doc", lambda rel: text)
    errors, counts = check_docs(["docs/x.md"])
    assert counts["docs/x.md"] == (1 if noted == "this" else 0)
    assert errors == ([] if noted == "other" else
                      ["docs/x.md:3: python tools/gone_in_this_release.py: no such file in the "
                       "repository: tools/gone_in_this_release.py"])


def test_a_stale_file_name_or_import_fails(monkeypatch):
    text = ("Installed by training.py (now training/loop.py), `moe/layers.py` and `moe/layer.py`;\n"
            "Megatron-LM's `pretrain_gpt.py` is someone else's.\n"
            "```python\nfrom megatron_moe.comm import all_to_all, all_to_al\n```\n")
    monkeypatch.setitem(globals(), "read_doc", lambda rel: text)
    assert check_paths(["docs/x.md"]) == [
        "docs/x.md:1: moe/layers.py: no such file in the repository",
        "docs/x.md:1: training.py: no such file in the repository",
        "docs/x.md:4: from megatron_moe.comm import all_to_al: megatron_moe.comm has no all_to_al"]
