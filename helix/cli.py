"""The `helix` command line: one subcommand per module of helix/commands/.

  helix demo                         a Helix decode of a small default model (GPU if present)
  helix generate --model M --prompt-ids 5,17,42 [--prompt-ids ...] --max-new-tokens N [--json]
  helix serve MODEL [--port 8000]    an OpenAI-compatible HTTP server (helix.serving)
  helix models                       the model presets and their shapes
  helix sweep FILE [--out r.json]    decode latency sweeps (configs/sweeps/)
  helix profile --model M ...        a profiler trace and per-kernel / per-phase tables
  helix plan --model M --gpus N ...  rank layouts for GPUs you may not have (analytical model)

A user's mistake exits 2 with one line on stderr, never a traceback; Ctrl-C exits 130 and SIGTERM
143, with every worker rank gone.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from importlib.metadata import PackageNotFoundError, version

from helix.commands import demo, generate, models, plan, profile, serve, sweep
from helix.errors import EngineDeadError, HelixError

COMMANDS = (generate, serve, demo, models, sweep, profile, plan)


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, no usage dump
        print(f"helix: error: {message} (see {self.prog} --help)", file=sys.stderr)
        sys.exit(2)


def _version() -> str:
    try:
        return version("helix-decode")
    except PackageNotFoundError:
        return "unknown (not installed)"


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="helix", description="Helix-parallel decode runtime")
    parser.add_argument("--version", action="version", version=f"helix {_version()}")
    sub = parser.add_subparsers(dest="cmd", required=True, parser_class=_Parser)
    for command in COMMANDS:
        command.add_parser(sub)
    return parser


class _Terminated(BaseException):
    """SIGTERM, raised in the main thread so `with LLM(...)` blocks close their workers. A
    BaseException, like KeyboardInterrupt, so no `except Exception` (a step's fault confinement)
    takes it for a failure."""


def _on_sigterm(signum, frame):
    raise _Terminated()


def _join_negative_values(argv: list[str]) -> list[str]:
    """`--prompt-ids -1,2` -> `--prompt-ids=-1,2`: argparse would take the value for an option
    and report a missing argument; joined, the option's own check names the mistake."""
    out: list[str] = []
    for a in argv:
        if (out and out[-1].startswith("--") and "=" not in out[-1] and len(a) > 1
                and a[0] == "-" and (a[1].isdigit() or a[1] == ".")):
            out[-1] = f"{out[-1]}={a}"
        else:
            out.append(a)
    return out


def main(argv: list[str] | None = None) -> int:
    argv = _join_negative_values(sys.argv[1:] if argv is None else list(argv))
    args = build_parser().parse_args(argv)
    log = logging.getLogger("helix")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("helix: %(message)s"))
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    previous = signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        return args.func(args)
    except EngineDeadError as e:
        print(f"helix: error: {e}", file=sys.stderr)
        return 1
    except HelixError as e:
        print(f"helix: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("helix: interrupted", file=sys.stderr)
        return 130
    except _Terminated:
        print("helix: terminated", file=sys.stderr)
        return 143
    finally:
        signal.signal(signal.SIGTERM, previous)
        log.removeHandler(handler)


if __name__ == "__main__":
    sys.exit(main())
