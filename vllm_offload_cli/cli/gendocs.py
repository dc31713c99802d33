"""Generate the man page and the bash/zsh/fish completions from the command tree.

The committed copies under man/ and completions/ are outputs of this module;
a test regenerates them and fails on any drift, so help text, options and
their documentation cannot disagree. Run `python -m vllm_offload_cli.cli.gendocs`
after changing a command.

Completions are static (no Python start on every TAB) and complete engine
ids from the region files in $VLLM_OFFLOAD_SHM_DIR (default /dev/shm).
"""

from __future__ import annotations

import enum
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vllm_offload_cli import __version__
from vllm_offload_cli.cli import datadoc

PROG = "vllm-offload"

EXIT_CODES = [
    (0, "success"),
    (1, "the operation failed"),
    (2, "bad usage or invalid input (engine_id, sizes, options)"),
    (3, "verification found problems"),
    (4, "region busy, or its name is taken by a live region"),
    (5, "not enough space or memory (tmpfs, cgroup limit, host memory; no GPU for --device cuda)"),
    (6, "refused as unsafe (ownership, mode, symlink, link count, wrong size, corrupt manifest)"),
    (7, "fleet: partial answer, a node failed or did not answer in time (the others are shown)"),
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
    default: str | None = None  # as --help shows it; None for flags and no default


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
    from vllm_offload_cli.cli.app import root_command

    return _commands(root_command(), "")


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
                arg = (p.metavar or p.name).upper()
                arg = arg if p.required else f"[{arg}]"
                args.append(f"{arg}..." if p.nargs == -1 else arg)
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
    default = None
    if takes_value and isinstance(p.show_default, str):
        default = p.show_default
    elif takes_value and p.show_default and p.default is not None:
        default = str(p.default.value if isinstance(p.default, enum.Enum) else p.default)
    metavar = p.metavar or long.lstrip("-").upper().replace("-", "_")
    return Opt(tuple(p.opts) + tuple(p.secondary_opts), (p.help or "").strip(), takes_value,
               metavar, choices, kind, default)


# -- man page ------------------------------------------------------------------


def _roff(text: str, *, fill: bool = True) -> str:
    """Text as roff input: escaped, and filled to lines under 80 bytes unless `fill` is off."""
    lines = text.splitlines()
    if fill:
        lines = [w for line in lines for w in (textwrap.wrap(
            line, 72, break_long_words=False, break_on_hyphens=False) or [""])]
    out = []
    for line in lines:
        line = line.replace("\\", "\\e").replace("-", "\\-")
        out.append(("\\&" + line) if line.startswith((".", "'")) else line)
    return "\n".join(out)


def man_page(cmds: list[Cmd]) -> str:
    date = "2026-01-01"  # fixed, and in a form mandoc parses: output must not depend on today
    out = [
        f'.TH VLLM\\-OFFLOAD 1 {date} "vllm\\-offload {__version__}" "User Commands"',
        ".SH NAME",
        "vllm\\-offload \\- operate vLLM's shared\\-memory KV\\-cache offload regions",
        ".SH SYNOPSIS",
        ".B vllm\\-offload",
        "\\fICOMMAND\\fR [\\fIOPTIONS\\fR] [\\fIARGS\\fR]",
        ".br",
        ".B vllm\\-offload \\-\\-version",
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
    out += _defaults(cmds)
    out += _json_reference()
    out += [".SH EXIT STATUS"]
    for code, meaning in EXIT_CODES:
        out += [".TP", f".B {code}", _roff(meaning)]
    out += [".SH ENVIRONMENT", ".TP", ".B VLLM_OFFLOAD_SHM_DIR",
            _roff("Default for --shm-dir (otherwise /dev/shm)."),
            ".TP", ".B RAY_ADDRESS",
            _roff("fleet commands: the Ray cluster when --address is not given (otherwise "
                  "auto, the cluster this host belongs to)."),
            ".TP", ".B CUDA_VISIBLE_DEVICES",
            _roff("verify-rank-layout --devices env: the devices split into replicas."),
            ".TP", ".B COLUMNS",
            _roff("Width of help and of benchmark tables; the inspect, gc and "
                  "verify-rank-layout tables keep one line per item at any width."),
            ".SH FILES", ".TP", ".I /dev/shm/vllm_offload_{engine_id}.mmap",
            _roff("A region: num_blocks rows of row_stride bytes, one slot per worker in "
                  "each row."), ".TP",
            ".I /dev/shm/vllm_offload_{engine_id}.mmap.N",
            _roff("Its further segment files, as vLLM's CPU spec splits a region of a GiB "
                  "or more."), ".TP",
            ".I /dev/shm/vllm_offload_{engine_id}.manifest.json",
            _roff("Sidecar manifest: geometry, creator and attached workers (mode 0600), "
                  "removed with the region."), ".TP",
            ".I /proc/locks, /proc/*/maps, /proc/*/fd",
            _roff("Read to find every process that holds a region, deleted mappings "
                  "included."),
            ".SH EXAMPLES", ".nf",
            _roff("vllm-offload inspect\n"
                  "vllm-offload create my-engine --dp-rank 0 --world-size 2 "
                  "--cpu-page-size 64KiB --size 1GiB\n"
                  "vllm-offload inspect --format prometheus --output "
                  "/var/lib/node_exporter/vllm_offload.prom"),
            ".fi", ".SH SEE ALSO", "\\fBtmpfiles.d\\fR(5), \\fBflock\\fR(2), \\fBmincore\\fR(2)"]
    return "\n".join(out) + "\n"


def _man_opt(o: Opt) -> list[str]:
    names = ", ".join(f"\\fB{_roff(n, fill=False)}\\fR" for n in o.names)
    if o.takes_value:
        value = "|".join(o.choices) if o.choices else o.metavar
        names += f" \\fI{_roff(value, fill=False)}\\fR"
    text = o.help or ""
    if o.default is not None:
        text += f" Default: {o.default}."
    return [".TP", names, _roff(text)]


def _defaults(cmds: list[Cmd]) -> list[str]:
    """Every option's default in one place: what a cron line gets when it says nothing."""
    out = [".SH DEFAULTS", _roff("What each command assumes when an option is not given:")]
    for c in cmds:
        rows = [(o, o.default) for o in c.options if o.default is not None]
        if c.hidden or not rows:
            continue
        out += [".SS " + _roff(c.name, fill=False)]
        for o, default in rows:
            out += [".TP", f"\\fB{_roff(o.names[0], fill=False)}\\fR", _roff(default)]
    return out


def _json_reference() -> list[str]:
    out = [".SH JSON OUTPUT", _roff(datadoc.ENVELOPE), ".PP",
           _roff("The data object of each command:")]
    for name, fields in datadoc.DATA.items():
        out += [".SS " + _roff(name, fill=False)]
        for key, meaning in fields:
            out += [".TP", f"\\fB{_roff(key, fill=False)}\\fR", _roff(meaning)]
    return out


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
                if o.choices:  # only these: -x (a value, and no file names)
                    extra = f" -x -a '{' '.join(o.choices)}'"
                elif o.kind in ("dir", "file"):
                    extra = " -r -F"
                else:
                    extra = " -x"
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
