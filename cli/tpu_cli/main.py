"""``tpu``: the command line, its help, exit codes and shell completion."""

from __future__ import annotations

import argparse
import sys

from tpu_cli import __version__, account, work
from tpu_cli.errors import INTERRUPTED, CliError
from tpu_cli.session import say

EPILOG = """exit codes: 0 done; 1 failed (a worker in exec, a job without an exit code);
2 bad input; 3 not signed in, or the sign-in ended; 4 no such VM or job, or no access;
5 the portal cannot be reached; 130 interrupted (a followed job goes on).
`tpu run` ends with the job's own exit code."""

RUN_HELP = """Ask the portal whether it would queue the job (nothing is copied when it
refuses), then sync DIR to the same path under your home on every worker (rsync through your
ssh config, all workers at once, only changed files, .gitignore respected, .git left
out, nothing deleted on the workers), queue CMD as a job there, then follow it: its
states, then every worker's log live, each line after (wN). Ctrl-C detaches: the job
goes on, `tpu logs -f JOB` follows it again.

--sync all (default) sends from this machine to every worker at once. --sync
via-worker0 sends to worker 0 only, which then sends to the others over the pod's own
network: better when your uplink is slow and the pod is large. It needs your ssh
agent (worker 0 logs in to the others as you, with agent forwarding) and checks their
pinned host keys.

With --type (any free VM of a kind) the VM is known only once the job is placed, so
DIR goes to the portal first, as a snapshot the job names; the portal puts it at the
same path under your home on every worker of the VM the job lands on. The files are
those rsync would send (its reading of .gitignore: per folder, /anchored, dir/, **,
and no `!` re-include), .git left out, regular files only, mode 0755 or 0644 from the
owner's execute bit. A symlink to a file inside DIR goes as that file; any other
symlink (to a folder, out of DIR, to nothing) is left out and named. Only the
contents the portal lacks are sent (hashes are kept in your cache folder, so after an
edit only the changed files are read); the portal caps a snapshot's size."""


def _parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(
        prog="tpu", description="The TPU Portal from your terminal.", epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    top.add_argument("--version", action="version", version=f"tpu {__version__}")
    sub = top.add_subparsers(dest="what", metavar="COMMAND")

    def command(name, help, func, **kw):
        parser = sub.add_parser(
            name, help=help, description=kw.pop("description", help), epilog=EPILOG,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )  # fmt: skip
        parser.set_defaults(func=func)
        return parser

    p = command("login", "Sign in to a portal (in the browser, or with a token).", account.login)
    p.add_argument("url", nargs="?", help="the portal, e.g. https://tpu.example.edu")
    p.add_argument("--with-token", action="store_true",
                   help="read a token (from the API tokens page) from standard input")  # fmt: skip
    p.add_argument("--no-browser", action="store_true", help="only print the link")
    p.add_argument("--device-name", help="how the portal names this machine (its hostname)")

    command("logout", "Revoke this machine's token on the portal and forget it.", account.logout)

    p = command("auth", "Your sign-in.", None)
    auth_sub = p.add_subparsers(dest="auth_what", metavar="ACTION")
    q = auth_sub.add_parser(
        "status", help="The portal, who you are, the token's expiry, whether it still works.",
        description="The portal you are signed in to, as whom, when the token expires (when "
        "the portal says) and whether it still works. Exits 3 when it does not, 5 when the "
        "portal cannot be reached.",
    )  # fmt: skip
    q.add_argument("--json", action="store_true")
    q.set_defaults(func=account.auth_status)

    p = command("ls", "Your TPU VMs: access, state, who uses the TPU, addresses, your queue "
                "place; your jobs waiting for any VM of a kind.", account.ls)  # fmt: skip
    p.add_argument("--json", action="store_true")
    p.add_argument("--names", action="store_true", help=argparse.SUPPRESS)

    p = command("config", "Your ssh config.", None)
    config_sub = p.add_subparsers(dest="config_what", metavar="ACTION")
    q = config_sub.add_parser(
        "install", help="Write ~/.ssh/config.d/tpu-portal and the host keys; Include it once.",
        description="Write your ssh config for the portal's hosts to "
        "~/.ssh/config.d/tpu-portal and their pinned host keys to "
        "~/.ssh/tpu-portal_known_hosts (made by the client from the portal's data, every "
        "value checked), and add `Include <home>/.ssh/config.d/*` at the top of "
        "~/.ssh/config once (keeping a backup). Every other tpu command keeps both files "
        "current when an address or host key changes.",
    )  # fmt: skip
    q.add_argument("--json", action="store_true")
    q.set_defaults(func=account.config_install)

    p = command("run", "Sync a workdir to every worker, run a job, follow its log.", work.run,
                description=RUN_HELP)  # fmt: skip
    p.add_argument("vm", nargs="?", help="tpu5, or lab/tpu5 (or --type for any free VM of a kind)")
    p.add_argument(
        "--type",
        metavar="TYPE",
        help="instead of a VM: any free VM of this accelerator type (v4-8) you may use",
    )
    p.add_argument("--lab", metavar="SLUG", help="with --type: the lab (when you are in several)")
    p.add_argument(
        "--zone", action="append", metavar="ZONE", help="with --type: only in ZONE (repeat)"
    )
    p.add_argument("--spot", action="store_true", help="with --type: only spot VMs")
    p.add_argument("--on-demand", action="store_true", help="with --type: only on-demand VMs")
    p.add_argument("--workdir", metavar="DIR",
                   help="a folder to sync first (with --type: to send to the portal as a "
                   "snapshot); the job runs there")  # fmt: skip
    p.add_argument("--env", action="append", metavar="K=V", help="an environment variable (repeat)")
    p.add_argument("--venv", metavar="PATH", help="a Python venv on the workers (e.g. ~/venv)")
    p.add_argument("--time-limit", type=int, metavar="MINUTES")
    p.add_argument("--worker", metavar="N", help="follow only worker N's log")
    p.add_argument("--sync", choices=("all", "via-worker0"), default="all")
    p.add_argument("--notify", action="store_true", help="an email when it ends")
    p.add_argument("--detach", action="store_true", help="queue it and return (prints the job)")
    p.add_argument("--json", action="store_true", help="with --detach: the job as JSON")
    p.usage = f"tpu {p.prog.split()[-1]} [options] (VM | --type TYPE) -- CMD ..."

    p = command("logs", "A job's log on every worker (-f: follow it live).", work.logs,
                description="A job's log on every worker (-f: follow it live), each line "
                "after (wN), with terminal escape sequences and control characters removed "
                "(a log may be another person's output).")  # fmt: skip
    p.add_argument("job", help="the job's number")
    p.add_argument("-f", "--follow", action="store_true")
    p.add_argument("--worker", metavar="N")

    p = command("cancel", "Cancel a job.", work.cancel)
    p.add_argument("job")
    p.add_argument("--json", action="store_true")

    p = command("jobs", "Recent jobs on your VMs (or one), and those waiting for any VM of a "
                "kind: their place in line, why they wait, where a moved one came from.",
                work.jobs)  # fmt: skip
    p.add_argument("vm", nargs="?")
    p.add_argument("--days", type=int, default=7, help="changed in the last DAYS days (7)")
    p.add_argument("--json", action="store_true")

    p = command("exec", "Run a command over ssh on every worker at once (not a job).", work.exec_,
                description="Run CMD over ssh on every worker (or one) at once, as you, each "
                "output line after (wN). One word is a shell command line as written "
                "('cd x && make'); several are passed word by word. Exits non-zero when any "
                "worker failed, and says which.")  # fmt: skip
    p.add_argument("vm")
    p.add_argument("--worker", default="all", metavar="all|N")
    p.add_argument("--json", action="store_true", help="each worker's exit status")
    p.usage = f"tpu {p.prog.split()[-1]} [options] (VM | --type TYPE) -- CMD ..."

    p = command("forward", "Forward a port of worker 0 here (TensorBoard, Jupyter).",
                work.forward)  # fmt: skip
    p.add_argument("vm")
    p.add_argument("port", metavar="PORT[:LOCAL]")

    p = command("usage", "TPU worker-hours: yours, and your labs' for their admins.",
                account.usage)  # fmt: skip
    p.add_argument("--from", dest="from_date", metavar="YYYY-MM-DD")
    p.add_argument("--to", dest="to_date", metavar="YYYY-MM-DD")
    p.add_argument("--json", action="store_true")

    p = command("completion", "Print a shell completion script.", completion)
    p.add_argument("shell", choices=("bash", "zsh", "fish"))
    return top


# --- completion --------------------------------------------------------------------------

_COMMANDS = "login logout auth ls config run logs cancel jobs exec forward usage completion"
_VM_COMMANDS = "run exec forward jobs"

_BASH = """_tpu() {
  local cur=${COMP_WORDS[COMP_CWORD]} cmd=${COMP_WORDS[1]}
  if [ "$COMP_CWORD" -eq 1 ]; then
    COMPREPLY=($(compgen -W "%(commands)s --help --version" -- "$cur")); return
  fi
  case "$cur" in -*)
    COMPREPLY=($(compgen -W "$(tpu "$cmd" --help 2>/dev/null | grep -o -- '--[a-z0-9-]*')" \
      -- "$cur")); return;;
  esac
  case "$cmd" in
    config) COMPREPLY=($(compgen -W "install" -- "$cur"));;
    auth) COMPREPLY=($(compgen -W "status" -- "$cur"));;
    completion) COMPREPLY=($(compgen -W "bash zsh fish" -- "$cur"));;
    %(vm_case)s) [ "$COMP_CWORD" -eq 2 ] &&
      COMPREPLY=($(compgen -W "$(tpu ls --names 2>/dev/null)" -- "$cur"));;
  esac
}
complete -F _tpu tpu
"""

_ZSH = """#compdef tpu
_tpu() {
  if (( CURRENT == 2 )); then
    compadd -- %(commands)s
  elif [[ ${words[CURRENT]} == -* ]]; then
    compadd -- $(tpu ${words[2]} --help 2>/dev/null | grep -o -- '--[a-z0-9-]*' | sort -u)
  elif (( CURRENT == 3 )); then
    case ${words[2]} in
      config) compadd install;;
      auth) compadd status;;
      completion) compadd bash zsh fish;;
      %(vm_case)s) compadd -- $(tpu ls --names 2>/dev/null);;
    esac
  fi
}
compdef _tpu tpu
"""

_FISH = """complete -c tpu -f
complete -c tpu -n __fish_use_subcommand -a '%(commands)s'
complete -c tpu -n '__fish_seen_subcommand_from config' -a install
complete -c tpu -n '__fish_seen_subcommand_from auth' -a status
complete -c tpu -n '__fish_seen_subcommand_from completion' -a 'bash zsh fish'
complete -c tpu -n '__fish_seen_subcommand_from %(vm_words)s' -a '(tpu ls --names 2>/dev/null)'
"""


def completion(args) -> int:
    values = {"commands": _COMMANDS, "vm_case": _VM_COMMANDS.replace(" ", "|"),
              "vm_words": _VM_COMMANDS}  # fmt: skip
    script = {"bash": _BASH, "zsh": _ZSH, "fish": _FISH}[args.shell] % values
    sys.stdout.write(script)
    return 0


def main(argv: list[str] | None = None) -> None:
    parser = _parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    # What follows `--` is the command for the workers, whatever it looks like.
    command = None
    if "--" in argv:
        at = argv.index("--")
        argv, command = argv[:at], argv[at + 1 :]
    args = parser.parse_args(argv)
    args.command = command
    if getattr(args, "func", None) is None:
        if args.what in ("config", "auth"):
            parser.parse_args([args.what, "--help"])
        parser.print_help()
        sys.exit(2)
    try:
        code = args.func(args)
    except CliError as exc:
        say(f"tpu: {exc.message}")
        code = exc.code
    except KeyboardInterrupt:
        say("tpu: interrupted.")
        code = INTERRUPTED
    except BrokenPipeError:
        code = 0
    sys.exit(code)
