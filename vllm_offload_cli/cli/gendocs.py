"""Generate the man page and the bash/zsh/fish completions from the command tree.

The committed copies under man/ and completions/ are outputs of this module;
a test regenerates them and fails on any drift, so help text, options and
their documentation cannot disagree. Run `python -m vllm_offload_cli.cli.gendocs`
after changing a command.

Completions are static (no Python start on every TAB) and complete engine
ids from the region files in $VLLM_OFFLOAD_SHM_DIR (default /dev/shm).
"""

from __future__ import annotations

import datetime as _dt
import enum
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import typer

from vllm_offload_cli import __version__

PROG = "vllm-offload"

EXIT_CODES = [
    (0, "success"),
    (1, "the operation failed"),
    (2, "bad usage or invalid input (engine_id, sizes, options)"),
    (3, "verification found problems"),
    (4, "region busy, or its name is taken by a live region"),
    (5, "not enough space or memory (tmpfs, cgroup limit, host memory; no GPU for --device cuda)"),
    (6, "refused as unsafe (ownership, mode, symlink, link count, wrong size, corrupt manifest)"),
    (7, "partial: fleet, a node failed or did not answer in time (the others are shown); "
        "garbage-collect, regions were removed (all reported) but --prometheus could not be "
        "written"),
    (130, "interrupted"),
]


@dataclass(frozen=True)
class Opt:
    names: tuple[str, ...]
    help: str
    takes_value: bool
    metavar: str
    choices: tuple[str, ...]
    kind: str  # "dir", "file" or ""


@dataclass(frozen=True)
class Cmd:
    name: str
    help: str
    short: str
    arguments: tuple[str, ...]
    options: tuple[Opt, ...]
    hidden: bool
    subcommands: tuple[str, ...] = ()  # a group (`fleet`): its visible subcommands

    @property
    def group(self) -> str | None:
        """`fleet` for `fleet inspect`; None for a top-level command."""
        return self.name.split(" ")[0] if " " in self.name else None


def command_tree() -> list[Cmd]:
    """The subcommands as the CLI parser sees them; a group's own come after it."""
    from vllm_offload_cli.cli.app import app

    return _commands(typer.main.get_command(app), "")


def _commands(group: Any, prefix: str) -> list[Cmd]:
    cmds = []
    for name in sorted(group.commands):
        cmd = group.commands[name]
        help_text = (cmd.help or "").strip()
        short = (cmd.short_help or help_text.split("\n")[0]).strip()
        sub = getattr(cmd, "commands", None)
        if sub is not None:
            visible = tuple(n for n in sorted(sub) if not sub[n].hidden)
            cmds.append(Cmd(prefix + name, help_text, short, (), (), bool(cmd.hidden), visible))
            cmds += _commands(cmd, f"{prefix}{name} ")
            continue
        opts, args = [], []
        for p in cmd.params:
            if p.param_type_name == "argument":
                args.append(p.metavar or p.name.upper())
                continue
            opts.append(_option(p))
        cmds.append(Cmd(prefix + name, help_text, short, tuple(args), tuple(opts),
                        bool(cmd.hidden)))
    return cmds


def _option(p: Any) -> Opt:
    annotation = p.type_descriptor.annotation
    info = p.type_descriptor.parameter_info
    choices: tuple[str, ...] = ()
    kind = ""
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        choices = tuple(str(m.value) for m in annotation)
    elif annotation is Path or str(annotation) in ("pathlib.Path | None", "Optional[Path]"):
        kind = "dir" if getattr(info, "file_okay", True) is False else "file"
    takes_value = not (p.is_flag or p.count)
    long = next((o for o in p.opts if o.startswith("--")), p.opts[0])
    return Opt(tuple(p.opts) + tuple(p.secondary_opts), (p.help or "").strip(), takes_value,
               long.lstrip("-").upper().replace("-", "_"), choices, kind)


# -- man page ------------------------------------------------------------------


def _roff(text: str) -> str:
    text = text.replace("\\", "\\e").replace("-", "\\-")
    return "\n".join(("\\&" + line) if line.startswith((".", "'")) else line
                     for line in text.splitlines())


def man_page(cmds: list[Cmd]) -> str:
    date = _dt.date(2026, 1, 1).strftime("%Y")  # fixed: output must not depend on today
    out = [
        f'.TH VLLM\\-OFFLOAD 1 "{date}" "vllm-offload {__version__}" "User Commands"',
        ".SH NAME",
        "vllm\\-offload \\- operate vLLM's shared\\-memory KV\\-cache offload regions",
        ".SH SYNOPSIS",
        ".B vllm\\-offload",
        "[\\fB\\-\\-version\\fR] \\fICOMMAND\\fR [\\fIOPTIONS\\fR] [\\fIARGS\\fR]",
        ".SH DESCRIPTION",
        _roff("vLLM offloads KV-cache blocks into one shared-memory file per engine, "
              "/dev/shm/vllm_offload_{engine_id}.mmap, where engine_id carries a _dp{rank} "
              "suffix per data-parallel replica and each worker owns one slot of every block "
              "row. vllm-offload creates such regions exactly as vLLM lays them out, lists "
              "them with their holders and state, proves that no two workers share bytes, "
              "measures copy throughput, and removes leaked regions only when no process can "
              "still use them."),
        ".SH COMMON OPTIONS",
        "Every command accepts:",
    ]
    common = {"--shm-dir", "--json", "--verbose", "--quiet"}
    first = next((c for c in cmds if not c.hidden and not c.subcommands), None)
    shared = [o for o in (first.options if first else ()) if set(o.names) & common]
    for o in shared:
        out += _man_opt(o)
    out.append(".SH COMMANDS")
    for c in cmds:
        if c.hidden:
            continue
        args = " ".join(f"\\fI{_roff(a)}\\fR" for a in c.arguments)
        if c.subcommands:
            args = "\\fICOMMAND\\fR"
        out += [".SS " + _roff(f"{c.name}"), f".B vllm\\-offload {_roff(c.name)}",
                f"[\\fIOPTIONS\\fR] {args}".rstrip(), ".PP", _roff(c.help)]
        if c.subcommands:
            out += [".PP", _roff("Commands: " + ", ".join(c.subcommands) + ".")]
        for o in c.options:
            if set(o.names) & common or "--help" in o.names:
                continue
            out += _man_opt(o)
    aliases = [c.name for c in cmds if c.hidden]
    if aliases:
        out += [".PP", _roff("Aliases: " + ", ".join(aliases) + ".")]
    out += [".SH JSON OUTPUT",
            _roff('With --json a command prints exactly one JSON document on stdout: '
                  '{"schema_version": 1, "command": NAME, "ok": BOOL, "exit_code": INT, '
                  '"data": {...}, "errors": [{"code", "message"}], "warnings": [{"code", '
                  '"message"}]}. Diagnostics and progress go to stderr. A fleet command\'s '
                  'data has "nodes": one entry per node with "node_id", "label", "status" '
                  '(ok, error, refused, absent, failed, timed_out), "exit_code", "reason", '
                  'and that node\'s own "data", "errors" and "warnings"; "partial" is true '
                  'when a node did not answer.'),
            ".SH EXIT STATUS"]
    for code, meaning in EXIT_CODES:
        out += [".TP", f".B {code}", _roff(meaning)]
    out += [".SH ENVIRONMENT", ".TP", ".B VLLM_OFFLOAD_SHM_DIR",
            _roff("Default for --shm-dir (otherwise /dev/shm)."),
            ".SH FILES", ".TP", ".I /dev/shm/vllm_offload_{engine_id}.mmap[.N]",
            _roff("A region (and its segments)."), ".TP",
            ".I /dev/shm/vllm_offload_{engine_id}.manifest.json",
            _roff("Sidecar manifest: geometry and attached workers (mode 0600)."),
            ".SH EXAMPLES", ".nf",
            _roff("vllm-offload inspect\n"
                  "vllm-offload create my-engine --dp-rank 0 --world-size 2 "
                  "--cpu-page-size 64KiB --size 1GiB\n"
                  "vllm-offload inspect --format prometheus --output "
                  "/var/lib/prometheus/node-exporter/vllm_offload_regions.prom"),
            ".fi", ".SH SEE ALSO", "\\fBtmpfiles.d\\fR(5), \\fBflock\\fR(2), \\fBmincore\\fR(2)"]
    return "\n".join(out) + "\n"


def _man_opt(o: Opt) -> list[str]:
    names = ", ".join(f"\\fB{_roff(n)}\\fR" for n in o.names)
    if o.takes_value:
        value = "|".join(o.choices) if o.choices else o.metavar
        names += f" \\fI{_roff(value)}\\fR"
    return [".TP", names, _roff(o.help or "")]


# -- completions ---------------------------------------------------------------

_ENGINE_IDS_SH = (
    'd="${VLLM_OFFLOAD_SHM_DIR:-/dev/shm}"; for f in "$d"/vllm_offload_*.mmap; do '
    '[ -e "$f" ] || continue; f="${f##*/vllm_offload_}"; printf "%s\\n" "${f%.mmap}"; done'
)


def _case_label(name: str) -> str:
    return f'"{name}"' if " " in name else name


def bash_completion(cmds: list[Cmd]) -> str:
    names = " ".join(c.name for c in cmds if not c.hidden and c.group is None)
    groups = "|".join(c.name for c in cmds if c.subcommands) or "''"
    lines = [
        "# bash completion for vllm-offload (generated by vllm_offload_cli.cli.gendocs)",
        "_vllm_offload_engine_ids() {",
        f"    {_ENGINE_IDS_SH}",
        "}",
        "_vllm_offload() {",
        '    local cur="${COMP_WORDS[COMP_CWORD]}" prev="${COMP_WORDS[COMP_CWORD-1]}"',
        '    local cmd="" i',
        "    for ((i = 1; i < COMP_CWORD; i++)); do",
        '        case "${COMP_WORDS[i]}" in',
        "            -*) ;;",
        '            *) cmd="${cmd:+$cmd }${COMP_WORDS[i]}"',
        f'               case "$cmd" in {groups}) ;; *) break ;; esac ;;',
        "        esac",
        "    done",
        '    if [ -z "$cmd" ]; then',
        f'        COMPREPLY=($(compgen -W "{names} --help --version" -- "$cur")); return',
        "    fi",
        '    case "$cmd" in',
    ]
    for c in cmds:
        if c.subcommands:
            subs = " ".join((*c.subcommands, "--help"))
            lines.append(f'    {c.name}) COMPREPLY=($(compgen -W "{subs}" -- "$cur")) ;;')
            continue
        opts = " ".join(n for o in c.options for n in o.names)
        lines.append(f"    {_case_label(c.name)})")
        lines.append('        case "$prev" in')
        for o in c.options:
            if not o.takes_value:
                continue
            pat = "|".join(o.names)
            if o.choices:
                action = f'COMPREPLY=($(compgen -W "{" ".join(o.choices)}" -- "$cur"))'
            elif o.kind == "dir":
                action = 'COMPREPLY=($(compgen -d -- "$cur"))'
            elif o.kind == "file":
                action = 'COMPREPLY=($(compgen -f -- "$cur"))'
            else:
                action = "COMPREPLY=()"
            lines.append(f"            {pat}) {action}; return ;;")
        lines.append("        esac")
        lines.append('        if [[ "$cur" == -* ]]; then')
        lines.append(f'            COMPREPLY=($(compgen -W "{opts}" -- "$cur"))')
        if c.arguments:
            lines.append("        else")
            lines.append('            COMPREPLY=($(compgen -W "$(_vllm_offload_engine_ids)" '
                         '-- "$cur"))')
        lines.append("        fi ;;")
    lines += ["    esac", "}", "complete -F _vllm_offload vllm-offload", ""]
    return "\n".join(lines)


def _zsh_escape(text: str) -> str:
    return text.replace("'", "'\\''").replace("[", "\\[").replace("]", "\\]").replace(":", "\\:")


def zsh_completion(cmds: list[Cmd]) -> str:
    lines = [
        "#compdef vllm-offload",
        "# zsh completion for vllm-offload (generated by vllm_offload_cli.cli.gendocs)",
        "_vllm_offload_engine_ids() {",
        "    local -a ids",
        f"    ids=(${{(f)\"$({_ENGINE_IDS_SH})\"}})",
        "    _describe 'engine id' ids",
        "}",
        "_vllm_offload() {",
        "    local -a commands",
        "    commands=(",
    ]
    for c in cmds:
        if not c.hidden and c.group is None:
            lines.append(f"        '{c.name}:{_zsh_escape(c.short)}'")
    lines += [
        "    )",
        "    if (( CURRENT == 2 )); then",
        "        _describe 'command' commands; _arguments '--version[print the version]'; return",
        "    fi",
        "    local cmd=${words[2]}",
    ]
    for g in (c for c in cmds if c.subcommands):
        subs = " ".join(f"'{_zsh_escape(c.name.split(' ', 1)[1])}:{_zsh_escape(c.short)}'"
                        for c in cmds if c.group == g.name and not c.hidden)
        lines += [
            f"    if [[ $cmd == {g.name} ]]; then",
            "        if (( CURRENT == 3 )); then",
            f"            local -a subs; subs=({subs}); _describe 'command' subs; return",
            "        fi",
            f'        cmd="{g.name} ${{words[3]}}"; shift words; (( CURRENT-- ))',
            "    fi",
        ]
    lines += [
        "    shift words; (( CURRENT-- ))",
        "    case $cmd in",
    ]
    for c in cmds:
        if c.subcommands:
            continue
        specs = []
        for o in c.options:
            if o.takes_value:
                if o.choices:
                    action = f":{o.metavar.lower()}:({' '.join(o.choices)})"
                elif o.kind == "dir":
                    action = f":{o.metavar.lower()}:_files -/"
                elif o.kind == "file":
                    action = f":{o.metavar.lower()}:_files"
                else:
                    action = f":{o.metavar.lower()}: "
            else:
                action = ""
            repeat = "*" if o.names[0] in ("--verbose", "--quiet") else ""
            text = _zsh_escape(o.help.splitlines()[0] if o.help else "")
            for n in o.names:
                specs.append(f"'{repeat}{n}[{text}]{action}'")
        if c.arguments:
            specs.append("'*:engine id:_vllm_offload_engine_ids'")
        lines.append(f"        {_case_label(c.name)}) _arguments -s {' '.join(specs)} ;;")
    lines += ["    esac", "}", '_vllm_offload "$@"', ""]
    return "\n".join(lines)


def _fish_escape(text: str) -> str:
    return text.replace("\\", "\\\\").replace("'", "\\'")


def fish_completion(cmds: list[Cmd]) -> str:
    lines = [
        "# fish completion for vllm-offload (generated by vllm_offload_cli.cli.gendocs)",
        "function __vllm_offload_engine_ids",
        "    set -l d /dev/shm",
        "    set -q VLLM_OFFLOAD_SHM_DIR; and set d $VLLM_OFFLOAD_SHM_DIR",
        "    for f in $d/vllm_offload_*.mmap",
        "        string replace -r '^.*/vllm_offload_(.*)\\.mmap$' '$1' -- $f",
        "    end",
        "end",
        "complete -c vllm-offload -f",
        "complete -c vllm-offload -n __fish_use_subcommand -l version -d 'Print the version'",
    ]
    groups = [c for c in cmds if c.subcommands]
    for c in cmds:
        if not c.hidden and c.group is None:
            lines.append(f"complete -c vllm-offload -n __fish_use_subcommand -a {c.name} "
                         f"-d '{_fish_escape(c.short)}'")
    for g in groups:
        members = " ".join(c.name.split(" ", 1)[1] for c in cmds if c.group == g.name)
        for c in cmds:
            if c.group == g.name and not c.hidden:
                lines.append(f"complete -c vllm-offload -n '__fish_seen_subcommand_from "
                             f"{g.name}; and not __fish_seen_subcommand_from {members}' -a "
                             f"{c.name.split(' ', 1)[1]} -d '{_fish_escape(c.short)}'")
    outside = "".join(f"; and not __fish_seen_subcommand_from {g.name}" for g in groups)
    for c in cmds:
        if c.subcommands:
            continue
        if c.group is None:
            cond = f"'__fish_seen_subcommand_from {c.name}{outside}'"
        else:
            group, sub = c.name.split(" ", 1)
            cond = (f"'__fish_seen_subcommand_from {group}; and __fish_seen_subcommand_from "
                    f"{sub}'")
        if c.arguments:
            lines.append(f"complete -c vllm-offload -n {cond} -a '(__vllm_offload_engine_ids)'")
        for o in c.options:
            flags = []
            for n in o.names:
                flags.append(f"-l {n[2:]}" if n.startswith("--") else f"-s {n[1:]}")
            extra = ""
            if o.takes_value:
                if o.choices:
                    extra = f" -r -a '{' '.join(o.choices)}'"
                elif o.kind in ("dir", "file"):
                    extra = " -r -F"
                else:
                    extra = " -r"
            desc = _fish_escape(o.help.splitlines()[0] if o.help else "")
            lines.append(f"complete -c vllm-offload -n {cond} {' '.join(flags)}{extra} "
                         f"-d '{desc}'")
    lines.append("")
    return "\n".join(lines)


def outputs() -> dict[str, str]:
    """Generated text by path relative to the repository root."""
    cmds = command_tree()
    return {
        "man/vllm-offload.1": man_page(cmds),
        "completions/vllm-offload.bash": bash_completion(cmds),
        "completions/_vllm-offload": zsh_completion(cmds),
        "completions/vllm-offload.fish": fish_completion(cmds),
    }


def main() -> None:
    """Rewrite the committed copies; run from the repository root."""
    root = Path.cwd()
    if not (root / "pyproject.toml").exists():
        sys.exit("run this from the repository root")
    for rel, text in outputs().items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        sys.stdout.write(f"wrote {rel}\n")


if __name__ == "__main__":
    main()
