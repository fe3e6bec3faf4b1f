"""Child side of tests/test_docs_commands.py: each command line a doc gives, checked against the
argparse parser its script or module really builds, without running the script past that parser.

Run by ``megatron_moe.runtime.local_ranks.run_script`` (a process forked with torch and
megatron-core imported): ``python tests/_docs_parsers.py JOBS.json RESULTS.json``. Each target is
run as ``__main__`` with ``ArgumentParser.parse_args`` replaced by a stop that hands back the
parser, and ``parse_known_args`` too except on a parser built with ``add_help=False`` (a
pre-parser choosing which flags to add, tools/checkpoint/convert.py's); the doc's argv is then
parsed by that captured parser here, so nothing after the argument parsing runs. A parser is
captured once per target, or once per command where it depends on the argv (``argv_dependent``:
convert.py adds its loader's and saver's flags).
"""

import argparse
import contextlib
import io
import json
import os
import re
import runpy
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_REFUSED = "refused:"   # megatron_moe/flags: the dest of a refused Megatron flag's placeholder
_PARSE_KNOWN = argparse.ArgumentParser.parse_known_args
_PARSE = argparse.ArgumentParser.parse_args


class _Captured(BaseException):   # BaseException: a tool's `except Exception` does not swallow it
    def __init__(self, parser):
        super().__init__()
        self.parser = parser


def _stop_at_parse(self, args=None, namespace=None):
    raise _Captured(self)


def _stop_at_parse_known(self, args=None, namespace=None):
    if not self.add_help:   # a pre-parser (which flags to add) or a parser's own nested parse
        return _PARSE_KNOWN(self, args, namespace)
    raise _Captured(self)


def capture_parser(kind: str, name: str, argv: list):
    """The parser ``python name argv`` (kind "script") or ``python -m name argv`` builds, or an
    error line when none is reached."""
    saved_argv, saved_path, saved_env = list(sys.argv), list(sys.path), dict(os.environ)
    argparse.ArgumentParser.parse_args = _stop_at_parse
    argparse.ArgumentParser.parse_known_args = _stop_at_parse_known
    out, err = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            if kind == "script":
                path = os.path.join(ROOT, name)
                sys.argv = [path, *argv]
                sys.path.insert(0, os.path.dirname(path))
                runpy.run_path(path, run_name="__main__")
            else:
                sys.argv = [name, *argv]
                runpy.run_module(name, run_name="__main__", alter_sys=True)
    except _Captured as captured:
        return captured.parser
    except SystemExit as exc:
        return f"exited ({exc.code}) before parsing its arguments: {_last_line(err, out)}"
    except Exception as exc:   # noqa: BLE001 -- reported as the doc command's error
        return f"{type(exc).__name__} before parsing its arguments: {exc}"
    finally:
        argparse.ArgumentParser.parse_args = _PARSE
        argparse.ArgumentParser.parse_known_args = _PARSE_KNOWN
        sys.argv[:] = saved_argv
        sys.path[:] = saved_path
        os.environ.clear()
        os.environ.update(saved_env)
    return "finished without parsing any arguments (no argparse parser)"


def _last_line(*streams):
    for s in streams:
        lines = [ln for ln in s.getvalue().splitlines() if ln.strip()]
        if lines:
            return lines[-1].strip()
    return ""


def _action(parser, token):
    return parser._option_string_actions.get(token.split("=", 1)[0])


def stub_placeholders(parser, argv, placeholders):
    """A placeholder value (CKPT, N, <path>, $VAR) that the flag's type or choices would reject is
    replaced by a value they accept: the doc names a value to fill in, not a literal."""
    argv = list(argv)
    for i in placeholders:
        prev = _action(parser, argv[i - 1]) if i > 0 and argv[i - 1].startswith("-") else None
        if prev is None:
            continue
        if prev.choices is not None and argv[i] not in prev.choices:
            argv[i] = str(next(iter(prev.choices)))
            continue
        if callable(prev.type):
            try:
                prev.type(argv[i])
            except (TypeError, ValueError, argparse.ArgumentTypeError):
                argv[i] = "1"
    return argv


def check(parser, job) -> list:
    """Error lines for one command: a flag the parser does not define (by its exact name), then
    argparse's own errors (complete commands: values, choices, arity, positionals), and refused
    Megatron flags the doc does not say are refused."""
    errors = []
    flags = [t for t in job["argv"] if re.match(r"--?[A-Za-z]", t)]
    for flag in flags:   # exact names: argparse would take an abbreviation, a doc must not
        if _action(parser, flag) is None:
            errors.append(f"unrecognized argument: {flag.split('=', 1)[0]}")
    if errors:
        return errors
    if job["complete"]:
        argv = stub_placeholders(parser, job["argv"], job["placeholders"])
        err = io.StringIO()
        try:
            with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
                _, extra = _PARSE_KNOWN(parser, argv)
            if extra:
                errors.append(f"unrecognized arguments: {' '.join(extra)}")
        except SystemExit:
            lines = [ln for ln in err.getvalue().splitlines() if "error: " in ln]
            errors.append(lines[-1].split("error: ", 1)[1] if lines else _last_line(err))
    if not job["refused_ok"]:
        for flag in flags:
            action = _action(parser, flag)
            if action is not None and str(action.dest).startswith(_REFUSED):
                errors.append(f"{flag.split('=', 1)[0]} is refused (flags/status.txt) and the doc "
                              f"does not say so")
    return errors


def _options(parser):
    """{option string: its choices or None} of a parser and of its sub-commands' parsers."""
    out = {flag: None if action.choices is None else [str(c) for c in action.choices]
           for flag, action in parser._option_string_actions.items()}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                out.update(_options(sub))
    return out


def main(jobs_path, results_path):
    with open(jobs_path) as f:
        jobs = json.load(f)
    results, parsers = [], {}
    for job in jobs:
        key = (job["kind"], job["name"])
        if key in parsers:
            parser = parsers[key]
        else:
            parser = capture_parser(job["kind"], job["name"], job["argv"])
            if not job.get("argv_dependent"):
                parsers[key] = parser
        if isinstance(parser, str):
            results.append([parser])
        elif job.get("options"):   # the flags it defines (the prose check's vocabulary)
            results.append(_options(parser))
        else:
            results.append(check(parser, job))
    with open(results_path, "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main(*sys.argv[1:3])
