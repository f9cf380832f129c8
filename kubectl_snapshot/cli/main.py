"""kubectl-snapshot: the kubectl plugin (`kubectl snapshot ...`).

    kubectl snapshot pod/NAME [--to REPO[:TAG]] [--stop] ...     take a snapshot (a PodSnapshot)
    kubectl snapshot restore REF|SNAPSHOT [--name N] [--node N]   create a pod from a snapshot
    kubectl snapshot migrate pod/NAME [--node N]                   snapshot, restore elsewhere, delete
    kubectl snapshot list | inspect | delete                       manage snapshots
    kubectl snapshot install | uninstall | doctor                  the node agent

The root of a thin click layer: each command group lives in a module of its own (snapshot, restore,
migrate, listing, inspection, delete, install, doctor, policy) over one wiring module (wiring.py: the
cluster flags and the adapters built from them); this module only assembles them and runs the program.
Errors print `error:`/`hint:` and exit 1 (runtime) or 2 (usage); `-v` adds tracebacks.
"""

from __future__ import annotations

import sys
from typing import Any

import click

from kubectl_snapshot.cli import completion, delete, doctor, inspection, install, listing, migrate, policy, restore
from kubectl_snapshot.cli import snapshot as snapshot_cmd
from kubectl_snapshot.cli.params import common_options
from kubectl_snapshot.console import leave

DEFAULT_COMMAND = snapshot_cmd.COMMAND
ALIASES = {"snapshot": DEFAULT_COMMAND}  # `kubectl-snapshot snapshot pod/NAME` reads naturally too


class PluginGroup(click.Group):
    """`kubectl snapshot pod/NAME`: an argument that is not a subcommand goes to the `pod` command."""

    def resolve_command(
        self, ctx: click.Context, args: list[str]
    ) -> tuple[str | None, click.Command | None, list[str]]:
        if args and args[0] in ALIASES:
            return ALIASES[args[0]], self.get_command(ctx, ALIASES[args[0]]), args[1:]
        if args and not args[0].startswith("-") and self.get_command(ctx, args[0]) is None:
            return DEFAULT_COMMAND, self.get_command(ctx, DEFAULT_COMMAND), args
        return super().resolve_command(ctx, args)

    def shell_complete(self, ctx: click.Context, incomplete: str) -> list[Any]:
        """Subcommands, and `pod/NAME` for the default command."""
        items = [i for i in super().shell_complete(ctx, incomplete) if not str(i.value).startswith("__")]
        if incomplete.startswith("pod/") or (incomplete and "pod/".startswith(incomplete)):
            items += completion.pods(ctx, None, incomplete)
        return items


@click.group(
    cls=PluginGroup,
    context_settings={"help_option_names": ["-h", "--help"]},
    invoke_without_command=False,
)
@common_options
@click.version_option(package_name="kubectl-snapshot")
def cli() -> None:
    """Save games for pods: snapshot a running pod to a registry, restore it anywhere.

    \b
    kubectl snapshot pod/NAME --to REGISTRY/REPO      take a snapshot
    kubectl snapshot restore SNAPSHOT|REF              bring it back as a new pod
    """


for _command in (
    snapshot_cmd.pod_cmd,
    restore.restore_cmd,
    migrate.migrate_cmd,
    listing.list_cmd,
    inspection.inspect_cmd,
    delete.delete_cmd,
    install.install_cmd,
    install.uninstall_cmd,
    doctor.doctor_cmd,
    policy.policy_group,
):
    cli.add_command(_command)


@cli.command("completion")
@click.argument("shell", type=click.Choice(completion.SHELLS))
def completion_cmd(shell: str) -> None:
    """Print a completion script for the kubectl-snapshot command (bash, zsh or fish).

    \b
    With kubectl >= 1.26 `kubectl snapshot <TAB>` completes through kubectl's own completion
    (`source <(kubectl completion bash)`) once kubectl_complete-snapshot is on PATH (pip installs it;
    from krew: ln -s ~/.krew/store/snapshot/*/kubectl_complete-snapshot ~/.krew/bin/).
    For the kubectl-snapshot command itself:
      bash:  source <(kubectl snapshot completion bash)
      zsh:   source <(kubectl snapshot completion zsh)
      fish:  kubectl snapshot completion fish | source
    """
    click.echo(completion.source(cli, shell))


# --- entry point ---------------------------------------------------------------------------------------


def kubectl_args(argv: list[str]) -> list[str]:
    """kubectl's spellings click does not parse by itself: a bare `--dry-run` means `--dry-run=client`
    (kubectl never takes the next word as its value)."""
    out: list[str] = []
    for i, arg in enumerate(argv):
        if arg == "--":
            return out + argv[i:]
        out.append("--dry-run=client" if arg == "--dry-run" else arg)
    return out


def main(argv: list[str] | None = None) -> None:
    """Run the plugin; usage errors print `error:`/`hint:` and exit 2."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["__complete"]:  # kubectl_complete-snapshot in the krew archive runs this
        complete(args[1:])
        return
    try:
        cli.main(
            args=kubectl_args(args),
            prog_name="kubectl snapshot",
            standalone_mode=False,
            complete_var=completion.COMPLETE_VAR,
        )
    except click.exceptions.NoArgsIsHelpError as e:
        click.echo(e.ctx.get_help() if e.ctx else "", err=True)
        sys.exit(2)
    except click.UsageError as e:
        cmd = e.ctx.command_path if e.ctx else "kubectl snapshot"
        click.echo(f"error: {e.format_message()}\nhint: see '{cmd} --help'", err=True)
        sys.exit(2)
    except click.exceptions.Abort:
        click.echo("error: aborted", err=True)
        sys.exit(1)
    except click.exceptions.Exit as e:
        sys.exit(e.exit_code)
    except click.ClickException as e:
        click.echo(f"error: {e.format_message()}", err=True)
        sys.exit(e.exit_code)


def complete(argv: list[str] | None = None) -> None:
    """`kubectl_complete-snapshot`: what kubectl runs for TAB after `kubectl snapshot`."""
    args = sys.argv[1:] if argv is None else argv
    sys.stdout.write(completion.cobra_output(cli, list(args)))


def entry() -> None:
    """The `kubectl-snapshot` program: `main`, then a quick exit (console/leave.py)."""
    leave.run(main)


if __name__ == "__main__":
    entry()
